"""Prometheus metrics of the background worker (exported on its own port).

The worker is one process per replica, so these are plain in-process metrics;
Prometheus scrapes every worker and sums. Base units, `_total` counters, and
no label with more values than there are learner kinds.
See docs/operations.md (Metrics and alerts)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)

DELETION_LATENCY = Histogram(
    "obliviate_deletion_latency_seconds",
    "Time from a deletion's receipt to the publication of a model version without the data.",
    buckets=LATENCY_BUCKETS,
)
UPDATE_SECONDS = Histogram(
    "obliviate_model_update_seconds",
    "Learner update time per batch of requests.",
    ["learner"],
    buckets=LATENCY_BUCKETS,
)
BOUND_SECONDS = Histogram(
    "obliviate_guard_bound_seconds",
    "Time to recompute the guard's bound for a new model version.",
    ["learner"],
    buckets=LATENCY_BUCKETS,
)
EXACT_SECONDS = Histogram(
    "obliviate_exact_replacement_seconds",
    "Time approximate versions (the game learner's updates) were current before the exact "
    "retrain that replaces them was published.",
    buckets=LATENCY_BUCKETS,
)
APPLIED = Counter(
    "obliviate_requests_applied",
    "Requests applied to a published model version.",
    ["op"],
)
VERIFY_FAILURES = Counter(
    "obliviate_verify_failures",
    "Exactness checks (retrain from scratch, compare hashes) that did not match.",
)
UPDATE_FAILURES = Counter(
    "obliviate_update_failures",
    "Update batches that raised; their requests stay claimed and are retried.",
)
QUARANTINED = Counter(
    "obliviate_requests_quarantined",
    "Requests the learner could not apply (it raised on them alone): failed, with the "
    "learner's error as the reason in the ledger, never retried.",
    ["op"],
)
for _op in ("add", "delete"):  # exported at 0: an alert's increase() starts from there
    QUARANTINED.labels(op=_op)
PASS_ERRORS = Counter(
    "obliviate_worker_pass_errors",
    "Worker passes that failed through no request's fault (database, disk, publication): "
    "nothing marked failed, retried after a back-off.",
)
POINTER_REFUSED = Gauge(
    "obliviate_worker_pointer_refused",
    "1 while the current-version pointer names a version the worker may not build on "
    "(destroyed, never published, or its files are not what was published).",
)
