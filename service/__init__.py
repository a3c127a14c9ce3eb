"""The BentoML service: guarded label-only answers from the current version, the admin API,
the audit page and metrics. Depends on `jobs` and `ledger`.
See docs/sidecar.md (Service)."""
