"""Small ReLU networks shared by SISA, the mlp and game learners and the LUCID guard: torch
modules, compiled training loops, and leave-one-out sets trained together."""
