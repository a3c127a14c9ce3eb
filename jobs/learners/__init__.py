"""Learners that forget records by id: SISA and DaRE (exact), game-theoretic NN (approximate)."""
