"""Prometheus metrics the ledger side updates (the service exports them).

Names follow Prometheus conventions: `_total` counters, base units, and no
per-user or per-request labels.
See docs/operations.md (Metrics and alerts)."""

from __future__ import annotations

from prometheus_client import Counter

REQUESTS = Counter(
    "obliviate_requests",
    "Incoming deletion/addition requests by outcome of intake.",
    ["op", "status"],
)
LEDGER_EVENTS = Counter(
    "obliviate_ledger_events",
    "Events appended to the hash-chained ledger.",
    ["kind"],
)
DEAD_LETTERS = Counter(
    "obliviate_dead_letters",
    "Messages sent to the dead-letter topic.",
)
LOG_RESETS = Counter(
    "obliviate_consumer_log_resets",
    "Times the consumer found a requests partition's log started again (a broker that "
    "lost it) and read it from its beginning.",
)
