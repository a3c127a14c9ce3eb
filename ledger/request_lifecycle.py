"""The request lifecycle: received -> claimed -> applied -> verified, or failed.

Each transition is an event appended in the transaction that changes the request's
row, so the log and the working tables never disagree after a crash. A deletion
becomes `applied` together with the purge of its records' data.
See docs/ledger.md (Tables)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, Engine, Select, func, select, union, update

from ledger.appender import ChainAppender
from ledger.chain import iso, utc_now
from ledger.db import writing
from ledger.models import Request
from ledger.purge_maintenance import PurgeMaintenance, note_purge
from ledger.record_store import purge_records
from ledger.sealed_payloads import PayloadSealer
from ledger.tables import RECORDS, REQUEST_RECORDS, REQUESTS
from ledger.tree_heads import TreeHeads

log = logging.getLogger("obliviate.ledger")


class RequestLifecycle:
    """Claims requests for workers and records what became of them."""

    def __init__(self, engine: Engine, sealer: PayloadSealer, heads: TreeHeads,
                 maintenance: PurgeMaintenance) -> None:
        self.engine = engine
        self.sealer = sealer
        self._heads = heads
        self._maintenance = maintenance

    def claim(self, limit: int = 100, worker: str = "worker", lease_s: float = 300.0,
              retake_own: bool = True) -> list[Request]:
        """Move up to `limit` requests to `claimed`, oldest first.

        Besides received requests this takes claims older than `lease_s` (a worker
        that died for good) and, with `retake_own`, the worker's own claims (left by
        a crash of an earlier run under the same name, or by a failed pass), so a
        claimed request is never stranded.
        """
        with writing(self.engine) as conn:
            now = utc_now()
            retake = REQUESTS.c.claimed_at < now - timedelta(seconds=lease_s)
            if retake_own:
                retake = retake | (REQUESTS.c.claimed_by == worker)
            q = (select(REQUESTS).where((REQUESTS.c.status == "received")
                                       | ((REQUESTS.c.status == "claimed") & retake))
                 .order_by(REQUESTS.c.received_seq).limit(limit))
            if conn.dialect.name == "postgresql":
                q = q.with_for_update(skip_locked=True)
            rows = [Request.model_validate(dict(r._mapping)) for r in conn.execute(q)]
            if not rows:
                return []
            now_s = iso(now)
            appender = ChainAppender(conn)
            for r in rows:
                payload = {"worker": worker}
                if r.status == "claimed":
                    payload["reclaimed_from"] = r.claimed_by
                appender.append("claimed", r.request_id, payload, now_s)
                r.status, r.claimed_by, r.claimed_at = "claimed", worker, now
            conn.execute(update(REQUESTS)
                         .where(REQUESTS.c.request_id.in_([r.request_id for r in rows]))
                         .values(status="claimed", claimed_by=worker, claimed_at=now))
            appender.flush(conn)
            self._heads.take_if_due(conn, appender.seq)
        return rows

    def mark_applied(self, request_ids: Sequence[str], model_version: str,
                     detail: dict[str, Any] | None = None,
                     in_transaction: Callable[[Connection], None] | None = None) -> int:
        """The model `model_version` no longer holds deleted records (and holds added ones).

        Raw features and labels of deleted records are purged in the same
        transaction; their keyed fingerprints go into the event. `in_transaction`
        runs inside that transaction too (the registry publishes the version
        there), so the events and the served version change together or not at all.
        Returns the number of records whose data was purged: when it is not 0, call
        `PurgeMaintenance.run()` (on SQLite this method has already run it).
        """
        with writing(self.engine) as conn:
            now = utc_now()
            reqs = _requests_in_state(conn, request_ids, "claimed", "applied")
            appender = ChainAppender(conn)
            fps, purged, sealed = purge_records(
                conn, [(r.request_id, r.record_ids) for r in reqs if r.op == "delete"], now)
            for r in reqs:
                if r.op == "delete":
                    payload = {"purged_record_hashes": fps[r.request_id]}
                else:
                    # (one the batch's deletions purged stays purged)
                    conn.execute(update(RECORDS).where(RECORDS.c.record_id.in_(r.record_ids),
                                                       RECORDS.c.state != "purged")
                                 .values(state="live", added_at=now))
                    payload = {"added": len(r.record_ids)}
                payload.update(detail or {})
                appender.append("applied", r.request_id, payload, iso(now), model_version)
            _set_status(conn, request_ids, "applied")
            if purged:
                note_purge(conn, now)
            if in_transaction is not None:
                in_transaction(conn)
            appender.flush(conn)
            self._heads.take_if_due(conn, appender.seq)
        # crypto-shredding: every copy of their sealed rows (WAL, backups) is unreadable now;
        # a crash before this line leaves keys that the next maintenance sweeps
        self.sealer.destroy(sealed)
        if purged:
            self._maintenance.after_purge()
        return purged

    def mark_verified(self, request_ids: Sequence[str], model_version: str,
                      detail: dict[str, Any] | None = None,
                      in_transaction: Callable[[Connection], None] | None = None,
                      skip_settled: bool = False) -> None:
        """Mark applied requests verified on `model_version`; with `skip_settled`, requests
        no longer `applied` (another worker verified them) are left as they are instead
        of refused."""
        with writing(self.engine) as conn:
            reqs = _requests_in_state(conn, request_ids, "applied", "verified", skip_settled)
            request_ids = [r.request_id for r in reqs]
            appender = ChainAppender(conn)
            now_s = iso(utc_now())
            for rid in request_ids:
                appender.append("verified", rid, detail or {}, now_s, model_version)
            _set_status(conn, request_ids, "verified")
            if in_transaction is not None:
                in_transaction(conn)
            appender.flush(conn)
            self._heads.take_if_due(conn, appender.seq)

    def mark_failed(self, request_id: str, reason: str) -> None:
        """A claimed request the worker cannot apply: failed, with the reason."""
        with writing(self.engine) as conn:
            _requests_in_state(conn, [request_id], "claimed", "failed")
            appender = ChainAppender(conn)
            appender.append("failed", request_id, {"reason": reason}, iso(utc_now()))
            _set_status(conn, [request_id], "failed")
            appender.flush(conn)
            self._heads.take_if_due(conn, appender.seq)

    def requests_with_status(self, status: str, limit: int = 10_000) -> list[Request]:
        """Requests in one lifecycle state, oldest first."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(REQUESTS).where(REQUESTS.c.status == status)
                                .order_by(REQUESTS.c.received_seq).limit(limit)).all()
        return [Request.model_validate(dict(r._mapping)) for r in rows]

    def requests_of_subject(self, subject_id: str, limit: int | None = None,
                            after: int = 0) -> list[dict[str, Any]]:
        """The requests about a subject (by subject id, or naming any of its records) in
        the order they were received: the first `limit` received after event `after`
        (the next page starts after the last `received_seq` of this one).

        Two index reads (`requests.subject_id`; `request_records` by the subject's
        record ids), each cut to `limit`, so a page costs the same at any ledger size."""
        own = select(RECORDS.c.record_id).where(RECORDS.c.subject_id == subject_id)
        by_subject = select(REQUESTS.c.request_id, REQUESTS.c.received_seq).where(
            REQUESTS.c.subject_id == subject_id, REQUESTS.c.received_seq > after)
        # distinct before the cut: a request naming several of the subject's records is one
        # row of the page (cut first, its rows could fill `limit` and hide a later request)
        by_record = select(REQUEST_RECORDS.c.request_id, REQUEST_RECORDS.c.received_seq).where(
            REQUEST_RECORDS.c.record_id.in_(own), REQUEST_RECORDS.c.received_seq > after
        ).distinct()
        found = union(_first(by_subject, limit), _first(by_record, limit)).subquery()
        q = (select(REQUESTS).join(found, found.c.request_id == REQUESTS.c.request_id)
             .order_by(REQUESTS.c.received_seq).limit(limit))
        with self.engine.connect() as conn:
            return [{"request_id": r.request_id, "op": r.op, "status": r.status,
                     "subject_id": r.subject_id, "record_ids": list(r.record_ids),
                     "received_at": iso(r.received_at), "received_seq": r.received_seq}
                    for r in conn.execute(q)]

    def status_counts(self) -> dict[str, int]:
        """How many requests are in each lifecycle state."""
        with self.engine.connect() as conn:
            return {s: n for s, n in conn.execute(
                select(REQUESTS.c.status, func.count()).group_by(REQUESTS.c.status))}


def _requests_in_state(conn: Connection, request_ids: Sequence[str], state: str,
                       target: str, skip_others: bool = False) -> list[Request]:
    """The requests, locked until the transaction ends (PostgreSQL), all in `state`
    (else KeyError / ValueError; with `skip_others`, those in another state left out)."""
    rows = {r.request_id: r for r in conn.execute(
        select(REQUESTS).where(REQUESTS.c.request_id.in_(list(request_ids)))
        .with_for_update())}
    out = []
    for rid in request_ids:
        r = rows.get(rid)
        if r is None:
            raise KeyError(f"unknown request {rid!r}")
        if r.status != state:
            if skip_others:
                continue
            raise ValueError(f"request {rid!r} is {r.status!r}; only a {state!r} request "
                             f"can become {target!r}")
        out.append(Request.model_validate(dict(r._mapping)))
    return out


def _first(q: Select, limit: int | None) -> Select:
    """`q`'s first `limit` rows by received_seq, as a select a UNION can take (SQLite
    refuses ORDER BY and LIMIT on a member of a compound select itself)."""
    if limit is None:
        return q
    return select(*q.order_by(q.selected_columns.received_seq).limit(limit).subquery().c)


def _set_status(conn: Connection, request_ids: Sequence[str], status: str) -> None:
    conn.execute(update(REQUESTS).where(REQUESTS.c.request_id.in_(list(request_ids)))
                 .values(status=status))
