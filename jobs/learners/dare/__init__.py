"""DaRE random forests that forget exactly.
See docs/learners.md (DaRE)."""
