"""Learners that forget records by id: DaRE, SISA and the mlp learner (exact), the game
learner (approximate), behind one interface.
See docs/learners.md (Which learner)."""
