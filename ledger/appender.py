"""Appending events to the hash chain, inside the transaction that makes the change.

The same transaction stores the Merkle subtrees the new events complete
(:mod:`ledger.subtree_store`), so proofs never wait for a rebuild.
See docs/ledger.md (Stored subtree hashes).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from sqlalchemy import Connection, select

from ledger import intake_metrics as metrics
from ledger import subtree_store
from ledger.chain import GENESIS_HASH, canonical_json, event_hash, event_leaf
from ledger.db import insert_rows
from ledger.tables import EVENTS


class ChainAppender:
    """Extends the hash chain from its current tail inside one locked transaction."""

    def __init__(self, conn: Connection) -> None:
        tail = conn.execute(select(EVENTS.c.seq, EVENTS.c.hash)
                            .order_by(EVENTS.c.seq.desc()).limit(1)).first()
        self.seq, self.prev = (tail.seq, tail.hash) if tail else (0, GENESIS_HASH)
        self.rows: list[dict[str, Any]] = []

    def append(self, kind: str, request_id: str | None, payload: dict[str, Any],
               created_at: str, model_version: str | None = None) -> int:
        self.seq += 1
        text = canonical_json(payload)
        h = event_hash(self.seq, request_id, kind, text, model_version, created_at, self.prev)
        self.rows.append({"seq": self.seq, "request_id": request_id, "kind": kind,
                          "payload": text, "model_version": model_version,
                          "created_at": created_at, "prev_hash": self.prev, "hash": h})
        self.prev = h
        return self.seq

    def flush(self, conn: Connection) -> None:
        """Insert the appended events and the Merkle subtrees they complete."""
        if self.rows:
            first = self.rows[0]
            frontier = subtree_store.catch_up(conn, first["seq"] - 1, first["prev_hash"])
            insert_rows(conn, EVENTS, self.rows)
            if frontier is not None:
                subtree_store.store(conn, frontier, (event_leaf(r["hash"]) for r in self.rows))
            for kind, n in Counter(r["kind"] for r in self.rows).items():
                metrics.LEDGER_EVENTS.labels(kind=kind).inc(n)
            self.rows = []
