"""The background jobs: learners that forget, the iDP guard, private prediction mode, the
evaluation of unlearning, and the worker that applies the ledger's requests and publishes
versions. Depends on `ledger`, never on `service`.
See docs/DESIGN.md (Code layout and dependency direction)."""
