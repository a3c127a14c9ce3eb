"""The event log as its readers see it: exports, a request's history, proofs.

Auditors export the events and check consistency proofs between the heads they saved; a
request's subject gets its history with an inclusion proof of every event. Events that
belong to no request (a model published or destroyed) are appended here too.
See docs/ledger.md (Checking an event without the rest of the log)."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, func, select

from ledger import subtree_store
from ledger.appender import ChainAppender
from ledger.chain import iso, utc_now
from ledger.db import writing
from ledger.models import REQUEST_STATUSES
from ledger.tables import EVENTS, REQUESTS
from ledger.tree_heads import TreeHeads


class EventLog:
    """Reads the hash-chained log and proves what it holds."""

    def __init__(self, engine: Engine, hmac_key: bytes, heads: TreeHeads) -> None:
        self.engine = engine
        self._key = hmac_key
        self._heads = heads

    def append(self, kind: str, payload: dict[str, Any], model_version: str | None = None,
               in_transaction: Callable[[Connection], None] | None = None) -> int:
        """Append an event that belongs to no request (a model published, say)."""
        if kind in REQUEST_STATUSES:
            raise ValueError(f"{kind!r} is a request lifecycle event")
        with writing(self.engine) as conn:
            appender = ChainAppender(conn)
            seq = appender.append(kind, None, payload, iso(utc_now()), model_version)
            if in_transaction is not None:
                in_transaction(conn)
            appender.flush(conn)
            self._heads.take_if_due(conn, appender.seq)
        return seq

    def last_seq(self) -> int:
        """The number of events in the log."""
        with self.engine.connect() as conn:
            return conn.execute(select(func.max(EVENTS.c.seq))).scalar() or 0

    def export(self, since: str | int | None = None) -> Iterator[dict[str, Any]]:
        """Events for auditors, oldest first: since a sequence number or an ISO time."""
        q = select(EVENTS).order_by(EVENTS.c.seq)
        if isinstance(since, int):
            q = q.where(EVENTS.c.seq > since)
        elif since is not None:
            q = q.where(EVENTS.c.created_at >= iso(datetime.fromisoformat(since)))
        with self.engine.connect() as conn:
            for row in conn.execution_options(yield_per=5000).execute(q):
                yield _event_dict(row)

    def history(self, request_id: str) -> dict[str, Any]:
        """A request, its events, and for each event an inclusion proof to a published root.

        Publishes a new checkpoint first if the latest one does not cover the events yet.
        """
        with self.engine.connect() as conn:
            req = conn.execute(select(REQUESTS).where(REQUESTS.c.request_id == request_id)).first()
            events = conn.execute(select(EVENTS).where(EVENTS.c.request_id == request_id)
                                  .order_by(EVENTS.c.seq)).all()
        if req is None and not events:
            raise KeyError(f"no request or event with request_id {request_id!r}")
        head = self._heads.checkpoint()
        proofs = self.inclusion_proofs([e.seq for e in events], head.tree_size)
        out_events = [{**_event_dict(e), "inclusion_proof": proofs[e.seq]} for e in events]
        request = None
        if req is not None:
            request = {k: v for k, v in req._mapping.items() if k != "id"}
            for k in ("received_at", "claimed_at"):
                if request[k] is not None:
                    request[k] = iso(request[k])
        return {"request": request, "events": out_events,
                "tree_head": {"tree_size": head.tree_size, "root_hash": head.root_hash,
                              "created_at": head.created_at,
                              "signed": self._heads.head_at(head.tree_size)}}

    def inclusion_proofs(self, seqs: Sequence[int], tree_size: int) -> dict[int, list[str]]:
        """The inclusion proof of each of events `seqs` in the tree of the first
        `tree_size` events (hex hashes), each from O(log n) stored subtrees."""
        with self.engine.connect() as conn:
            return {s: [p.hex() for p in subtree_store.inclusion_proof(conn, s - 1, tree_size)]
                    for s in seqs}

    def consistency(self, old_size: int, new_size: int) -> dict[str, Any]:
        """RFC 6962 consistency proof that events 1..old_size are a prefix of 1..new_size,
        with both roots as the stored subtrees give them now (an auditor compares those
        with the signed heads it holds, never trusts them). ValueError for impossible
        sizes."""
        last = self.last_seq()
        if not 0 <= old_size <= new_size <= last:
            raise ValueError(f"need 0 <= old <= new <= {last} (the log's size); "
                             f"got old={old_size}, new={new_size}")
        with self.engine.connect() as conn:
            proof = subtree_store.consistency_proof(conn, old_size, new_size)
            roots = subtree_store.root(conn, old_size), subtree_store.root(conn, new_size)
            _, rotations = self._heads.published_keys(conn, new_size)
            signing = self._heads.signing
            heads = (signing.head_at(conn, old_size), signing.head_at(conn, new_size))
        return {"old_size": old_size, "new_size": new_size,
                "old_root": roots[0].hex(), "new_root": roots[1].hex(),
                "proof": [p.hex() for p in proof],
                "old_head": heads[0], "new_head": heads[1], "rotations": rotations}

    def receipt_token(self, request_id: str) -> str:
        """The token that lets a request's subject fetch its deletion receipt: an HMAC of
        the request id under the deployment secret, so nothing is stored for it."""
        return hmac.new(self._key, b"obliviate receipt token\0" + request_id.encode(),
                        hashlib.sha256).hexdigest()


def _event_dict(row: Any) -> dict[str, Any]:
    return {"seq": row.seq, "request_id": row.request_id, "kind": row.kind,
            "payload": json.loads(row.payload), "model_version": row.model_version,
            "created_at": row.created_at, "prev_hash": row.prev_hash, "hash": row.hash}
