"""SISA: a sharded, sliced ensemble that forgets exactly.
See docs/learners.md (SISA)."""
