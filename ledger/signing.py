"""Which key signs this ledger's heads: one per deployment, changed only by a rotation.

A second key would start a second log that no auditor holding the first key can check, so
a process signs only when its key is the one the log says signs now (its first heads' key,
or the one the latest `key_rotated` event introduced). The rotations are read from the
database (through a partial index, so the read does not grow with the log) and cached:
they are rare and never change (`verify` reads them afresh).
See docs/ledger.md (Signed tree heads)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Select, func, select, text

from ledger.heads import HeadSigner, KeyChain, log_id
from ledger.models import ROTATION_ONLY
from ledger.tables import EVENTS, HEADS


class SigningKeyRefused(ValueError):
    """This process would sign the ledger with a second key (or a retired one)."""


class SigningKeys:
    """The key this process signs with (if any), the key it checks heads with, and the
    log's chain of keys as its rotation events describe it."""

    def __init__(self, signer: HeadSigner | None, public_key: bytes | None) -> None:
        self.signer = signer
        self.public_key = signer.public_key if signer is not None else public_key
        self._events: list[dict[str, Any]] = []  # rotation events read so far, as stored
        self._upto = 0  # events 1.._upto were looked through for rotations
        # log id -> public key of every key of the chain last followed
        self.known: dict[str, bytes] = {} if self.public_key is None else {
            log_id(self.public_key): self.public_key}

    def use(self, signer: HeadSigner) -> None:
        self.signer, self.public_key = signer, signer.public_key
        self.known[signer.log_id] = signer.public_key

    def records(self, conn: Connection, upto: int | None = None, fresh: bool = False
                ) -> list[dict[str, Any]]:
        """Every `key_rotated` event (over at most `upto` events), each with the head over
        exactly its seq: what :meth:`KeyChain.follow` takes."""
        if fresh:
            self.forget()
        last = conn.execute(select(func.max(EVENTS.c.seq))).scalar() or 0
        if last > self._upto:
            self._events += [stored_event(r) for r in conn.execute(
                rotations_between(self._upto, last))]
            self._upto = last
        events = [e for e in self._events if upto is None or e["seq"] <= upto]
        heads = {r.tree_size: head_dict(r) for r in conn.execute(
            select(HEADS).where(HEADS.c.tree_size.in_([e["seq"] for e in events])))
        } if events else {}
        return [{"event": e, "head": heads.get(e["seq"])} for e in events]

    def chain(self, conn: Connection, anchor: bytes | None = None, fresh: bool = False
              ) -> tuple[KeyChain | None, list[str]]:
        """The log's keys from its rotations (anchored at `anchor`, else this process's
        key), and what is wrong with them."""
        chain, problems = KeyChain.follow(anchor or self.public_key,
                                          self.records(conn, fresh=fresh))
        if chain is not None:
            self.known.update(chain.log_ids())
        return chain, problems

    def forget(self) -> None:
        """Read the rotations afresh next time (a rotation's transaction rolled back)."""
        self._events, self._upto = [], 0

    def current_log(self, conn: Connection) -> str | None:
        """The log id of the key that signs this ledger now: the one the rotations lead
        to, else the one of its first head; None before any head."""
        chain, _ = KeyChain.follow(None, self.records(conn))
        return log_id(chain.current) if chain is not None else _first_log(conn)

    def refusal(self, conn: Connection, size: int | None = None) -> str | None:
        """Why this process's key may not sign a head over `size` events (None: any
        size from now on), or None when it may."""
        assert self.signer is not None
        mine = self.signer.log_id
        chain, _ = KeyChain.follow(None, self.records(conn))
        if chain is None:  # no rotation: the key of the first head is the log's
            first = _first_log(conn)
            if first is not None and first != mine:
                return (f"the ledger's heads are signed by log {first[:16]}..., not by this "
                        f"process's key (log {mine[:16]}...)")
            return None
        self.known.update(chain.log_ids())
        now = log_id(chain.current)
        if self.signer.public_key not in chain.keys:
            return (f"the ledger's signing key is log {now[:16]}... (key rotation at event "
                    f"{chain.ends[-1]}), not this process's key (log {mine[:16]}...)")
        lo, hi = chain.span(self.signer.public_key)
        if size is not None and size <= lo:
            return f"a head over {size} events is a retired key's to sign (rotated at {lo})"
        if (size is None or size > hi) and hi != float("inf"):
            return (f"this process's key (log {mine[:16]}...) was retired by the key rotation "
                    f"at event {int(hi)}: the ledger's signing key is now log {now[:16]}...")
        return None

    def covered(self, conn: Connection) -> int:
        """Events the latest head of this log's keys covers (0: none)."""
        return conn.execute(select(func.max(HEADS.c.tree_size))
                            .where(HEADS.c.log_id.in_(list(self.known)))).scalar() or 0

    def latest_head(self, conn: Connection) -> tuple[Any, bytes] | None:
        """The latest head of this log's keys, with the key that signs it."""
        row = conn.execute(select(HEADS).where(HEADS.c.log_id.in_(list(self.known)))
                           .order_by(HEADS.c.tree_size.desc()).limit(1)).first()
        return None if row is None else (row, self.known[row.log_id])

    def head_at(self, conn: Connection, size: int) -> dict[str, Any] | None:
        """This log's head over exactly `size` events (any head when no key is known)."""
        q = select(HEADS).where(HEADS.c.tree_size == size)
        if self.public_key is not None:
            q = q.where(HEADS.c.log_id.in_(list(self.known)))
        row = conn.execute(q).first()
        return None if row is None else self.named(head_dict(row))

    def named(self, head: dict[str, Any]) -> dict[str, Any]:
        """A head with the public key of the log it names, where that key is known."""
        key = self.known.get(head["log_id"])
        return head if key is None else {**head, "public_key": key.hex()}


def rotations_between(after: int, upto: int) -> Select[Any]:
    """The `key_rotated` events among events after..upto, read through their partial
    index (its predicate spelled out, as SQLite needs to pick it): not a scan of the log."""
    return (select(EVENTS).where(text(ROTATION_ONLY), EVENTS.c.seq > after,
                                 EVENTS.c.seq <= upto).order_by(EVENTS.c.seq))


def head_dict(row: Any) -> dict[str, Any]:
    return {"log_id": row.log_id, "tree_size": row.tree_size, "root_hash": row.root_hash,
            "timestamp": row.timestamp, "signature": row.signature}


def _first_log(conn: Connection) -> str | None:
    return conn.execute(select(HEADS.c.log_id).order_by(HEADS.c.tree_size).limit(1)).scalar()


def stored_event(row: Any) -> dict[str, Any]:
    """An event exactly as stored (its payload as the text its hash covers)."""
    return {"seq": row.seq, "request_id": row.request_id, "kind": row.kind,
            "payload": row.payload, "model_version": row.model_version,
            "created_at": row.created_at, "prev_hash": row.prev_hash, "hash": row.hash}
