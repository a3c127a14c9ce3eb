"""The ledger: the source of truth for every deletion and addition request, a tamper-evident
hash-chained log with signed tree heads, and the training records. Depends on nothing else
of the project.
See docs/ledger.md (Tables)."""
