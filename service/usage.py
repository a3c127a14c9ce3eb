"""Guard outcomes and privacy spent, per version and time window, kept in the database.

Prometheus shows the live rates; auditors need the history, so every serving
process adds its counts to a row per (process, version, window) every few
seconds. Summing rows gives the budget spent over any period.
See docs/sidecar.md (Service)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, func, insert, select
from sqlmodel import Field, SQLModel

from ledger import migrations
from ledger.chain import as_utc, iso, utc_now


class GuardUsageRow(SQLModel, table=True):
    __tablename__ = "guard_usage"

    id: int | None = Field(default=None, primary_key=True)
    process: str = Field(max_length=128)
    version: str = Field(max_length=64, index=True)
    period_end: datetime = Field(index=True)
    certain: int
    noised: int
    fresh_noised: int
    epsilon_spent: float


USAGE = GuardUsageRow.__table__


class GuardUsage:
    """Counts in memory, written out by :meth:`flush`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        migrations.ensure(engine)  # its table is in the ledger's migrations
        self._lock = threading.Lock()
        self._pending: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0, 0.0])
        self._last_flush = time.monotonic()

    def add(self, version: str, certain: int, noised: int, fresh: int, eps: float) -> None:
        with self._lock:
            row = self._pending[version]
            row[0] += certain
            row[1] += noised
            row[2] += fresh
            row[3] += eps

    def flush(self, process: str, min_interval_s: float = 0.0) -> None:
        if time.monotonic() - self._last_flush < min_interval_s:
            return
        with self._lock:
            pending, self._pending = self._pending, defaultdict(lambda: [0, 0, 0, 0.0])
            self._last_flush = time.monotonic()
        if not pending:
            return
        now = utc_now()
        with self.engine.begin() as conn:
            conn.execute(insert(USAGE), [
                {"process": process, "version": v, "period_end": now, "certain": int(c[0]),
                 "noised": int(c[1]), "fresh_noised": int(c[2]), "epsilon_spent": float(c[3])}
                for v, c in pending.items()])

    def summary(self, bucket_s: int = 60, limit: int = 500) -> dict[str, Any]:
        """Per version totals and a time series (buckets of `bucket_s`) across processes."""
        with self.engine.connect() as conn:
            per_version = conn.execute(
                select(USAGE.c.version, func.sum(USAGE.c.certain), func.sum(USAGE.c.noised),
                       func.sum(USAGE.c.epsilon_spent), func.min(USAGE.c.period_end),
                       func.max(USAGE.c.period_end))
                .group_by(USAGE.c.version).order_by(func.min(USAGE.c.period_end))).all()
            rows = conn.execute(select(USAGE.c.period_end, USAGE.c.certain, USAGE.c.noised,
                                       USAGE.c.epsilon_spent)
                                .order_by(USAGE.c.period_end.desc()).limit(50 * limit)).all()
        buckets: dict[int, list[float]] = defaultdict(lambda: [0, 0, 0.0])
        for r in rows:
            key = int(as_utc(r.period_end).timestamp()) // bucket_s * bucket_s
            b = buckets[key]
            b[0] += r.certain
            b[1] += r.noised
            b[2] += r.epsilon_spent
        series, spent = [], 0.0
        for key in sorted(buckets)[-limit:]:
            c, n, e = buckets[key]
            spent += e
            series.append({"t": iso(datetime.fromtimestamp(key, tz=UTC)),
                           "certain": int(c), "noised": int(n), "epsilon_spent": e,
                           "epsilon_spent_cumulative": spent})
        return {
            "versions": [{"version": v, "certain": int(c or 0), "noised": int(n or 0),
                          "epsilon_spent": float(e or 0.0), "first": iso(a), "last": iso(b)}
                         for v, c, n, e, a, b in per_version],
            "series": series,
            "epsilon_spent_total": float(sum(float(r[3] or 0.0) for r in per_version)),
        }
