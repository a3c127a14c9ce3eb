"""Small ReLU networks shared by SISA, the mlp and game learners and the LUCID guard: torch
modules, compiled training loops, and leave-one-out sets trained together; and what those
learners share as estimators (the record table, the training spec, the parameter
constraints, the scikit-learn base class).
See docs/DESIGN.md (Training as a function of the SET of records)."""
