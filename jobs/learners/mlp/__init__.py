"""One network that forgets a record by swapping in its leave-one-out twin (docs/learners.md)."""
