"""The iDP guard of DaRE forests, from exact leave-one-out forests.
See docs/guard.md (DaRE forests)."""
