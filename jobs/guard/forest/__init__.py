"""The iDP guard of DaRE forests, from exact leave-one-out forests (docs/guard.md)."""
