"""LUCID's bounds for ReLU networks: interval bounds, the MILP, branch and bound over
leave-one-out sets, and per-shard bounds for SISA.
See docs/guard.md (LUCID for one network)."""
