"""DaRE random forests that forget exactly (docs/learners.md, "DaRE")."""
