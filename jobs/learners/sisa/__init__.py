"""SISA: a sharded, sliced ensemble that forgets exactly (docs/learners.md, "SISA")."""
