"""One network that forgets a record by swapping in its leave-one-out twin.
See docs/learners.md (mlp: one network, deletions by swap)."""
