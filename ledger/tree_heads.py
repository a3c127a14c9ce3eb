"""Tree heads: the checkpoints and signed heads that make a rewrite of the log show.

Every appending transaction takes a head when one is due (`checkpoint_every` events, or
events `head_interval_s` old); an idle log gets its head from the processes' loops. A
head is signed only where it extends this log's latest signed head over events that
still give that head's root. See docs/ledger.md (Signed tree heads)."""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy import Connection, Engine, func, insert, select

from ledger import merkle
from ledger.appender import ChainAppender
from ledger.chain import event_leaf, iso, parse_iso, utc_now
from ledger.db import writing
from ledger.heads import ROTATION_KIND, HeadSigner, KeyChain, log_id, verify_head
from ledger.models import Checkpoint
from ledger.signing import SigningKeyRefused, SigningKeys, head_dict
from ledger.tables import CHECKPOINTS, EVENTS, HEADS

log = logging.getLogger("obliviate.ledger")


class TreeHeads:
    """Takes, signs and publishes the heads of one ledger's log."""

    def __init__(self, engine: Engine, signing: SigningKeys, *, checkpoint_every: int,
                 head_interval_s: float) -> None:
        if not head_interval_s > 0:
            raise ValueError(f"head_interval_s must be > 0 seconds, got {head_interval_s}")
        self.engine = engine
        self.signing = signing
        self.checkpoint_every = checkpoint_every
        self.head_interval_s = float(head_interval_s)
        self._next_check = 0.0  # monotonic time before which maybe_sign is a no-op

    @property
    def signer(self) -> HeadSigner | None:
        return self.signing.signer

    @property
    def public_key(self) -> bytes | None:
        """The public half of the key this process signs (or checks) the heads with."""
        return self.signing.public_key

    # ------------------------------------------------------------------ taking heads
    def take_if_due(self, conn: Connection, size: int) -> None:
        """In a transaction that appended events 1..size: take a head if one is due, so
        that no event stays uncovered for `checkpoint_every` events or `head_interval_s`
        while the log grows (`verify` holds the log to that)."""
        if self._due(conn, size):
            try:
                self._take(conn, size)
            except ValueError:  # an edited hash or frontier: the change itself still commits
                log.exception("not taking a tree head over %d events; run `obliviate ledger "
                              "verify`", size)

    def checkpoint(self) -> Checkpoint | None:
        """Publish a tree head over every event so far (no-op if the last one covers them);
        signed when the ledger has its signing key."""
        with writing(self.engine) as conn:
            size = conn.execute(select(func.max(EVENTS.c.seq))).scalar() or 0
            self._take(conn, size)
            _write_checkpoint(conn, size)  # no-op unless the head was refused
            row = conn.execute(select(CHECKPOINTS).order_by(CHECKPOINTS.c.tree_size.desc())
                               .limit(1)).first()
        return None if row is None else Checkpoint.model_validate(dict(row._mapping))

    def sign(self) -> dict[str, Any] | None:
        """A signed head over every event now (the latest one if it covers them already);
        None without a signing key or events, or when signing is refused (logged)."""
        if self.signer is None:
            return None
        with writing(self.engine) as conn:
            size = conn.execute(select(func.max(EVENTS.c.seq))).scalar() or 0
            if size == 0:
                return None
            return self._take(conn, size) or self.signing.head_at(conn, size)

    def maybe_sign(self) -> dict[str, Any] | None:
        """Take a head if one is due: `checkpoint_every` events, or events older than
        `head_interval_s`, not covered yet. Every long-running process calls this from its
        loop (appends take heads when due too, but an idle log needs the timer). Cheap:
        at most one look at the database a second, none at all in between. Never raises
        (a database that cannot be reached is logged; the next call tries again)."""
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + min(1.0, self.head_interval_s / 4)
        try:
            with self.engine.connect() as conn:
                size = conn.execute(select(func.max(EVENTS.c.seq))).scalar() or 0
                if not self._due(conn, size):
                    return None
            with writing(self.engine) as conn:
                size = conn.execute(select(func.max(EVENTS.c.seq))).scalar() or 0
                if not self._due(conn, size):  # another process took it meanwhile
                    return None
                return self._take(conn, size)
        except Exception:  # noqa: BLE001 - a loop's housekeeping must not end the loop
            log.exception("taking a tree head failed; the next call retries")
            return None

    # ------------------------------------------------------------------ publishing
    def published(self, since: int = 0, limit: int | None = None) -> dict[str, Any]:
        """The signed heads over more than `since` events (the newest `limit`, oldest
        first), each naming its key, with the log's current public key and its key
        rotations: what `ledger heads` prints and auditors save."""
        q = select(HEADS).where(HEADS.c.tree_size > since)
        with self.engine.connect() as conn:
            chain, rotations = self.published_keys(conn)
            if chain is not None:
                q = q.where(HEADS.c.log_id.in_(list(chain.log_ids())))
            q = q.order_by(HEADS.c.tree_size.desc())
            rows = conn.execute(q if limit is None else q.limit(limit)).all()
        current = None if chain is None else chain.current
        return {"format": "obliviate-tree-heads/v1",
                "log_id": None if current is None else log_id(current),
                "public_key": None if current is None else current.hex(),
                "heads": [self.signing.named(head_dict(r)) for r in reversed(rows)],
                "rotations": rotations}

    def published_keys(self, conn: Connection, upto: int | None = None
                       ) -> tuple[KeyChain | None, list[dict[str, Any]]]:
        """The chain of this log's keys (None without a key or a rotation) and the
        rotation records (over at most `upto` events) that lead along it, for auditors."""
        chain, _ = self.signing.chain(conn)
        return chain, self.signing.records(conn, upto)

    def head_at(self, size: int) -> dict[str, Any] | None:
        """This log's signed head over exactly `size` events, if there is one."""
        with self.engine.connect() as conn:
            return self.signing.head_at(conn, size)

    # ------------------------------------------------------------------ the signing key
    def signing_log(self) -> str | None:
        """The log id of the key that signs this ledger now (None before its first head)."""
        with self.engine.connect() as conn:
            return self.signing.current_log(conn)

    def use_key(self, seed: bytes) -> None:
        """Sign this ledger's heads with `seed` from now on. SigningKeyRefused when that
        would give it a second signing identity: its heads belong to another key, or a
        key rotation retired this one."""
        keys = SigningKeys(HeadSigner(seed), None)
        with self.engine.connect() as conn:
            why = keys.refusal(conn)
        if why:
            raise SigningKeyRefused(f"{why}; every process of a deployment signs with its one "
                                    "key: give this one that key (OBLIVIATE_LEDGER_SIGNING_KEY_"
                                    "HEX or _FILE), or hand the log over with `obliviate "
                                    "ledger rotate-key`")
        self.signing = keys

    def rotate_key(self, new_seed: bytes) -> dict[str, Any]:
        """Hand the log over to a new signing key. One transaction appends a
        `key_rotated` event naming the new public key, signed by the current key, and that
        key's head over exactly that event; every later head is the new key's, and a
        process still holding the old key stops signing (and refuses to start): give
        every process the new key. Returns the event's seq and the old key's last head."""
        old = self.signer
        if old is None:
            raise ValueError("rotating the signing key needs the current one")
        new = HeadSigner(new_seed)
        if new.public_key == old.public_key:
            raise ValueError("the new signing key is the current one")
        try:
            with writing(self.engine) as conn:
                why = self.signing.refusal(conn)
                if why:
                    raise SigningKeyRefused(why)
                appender = ChainAppender(conn)
                payload = old.rotation(new.public_key, appender.seq + 1, appender.prev)
                seq = appender.append(ROTATION_KIND, None, payload, iso(utc_now()))
                appender.flush(conn)
                head = self._take(conn, seq)
                if head is None:
                    raise RuntimeError("the current key could not sign a head over the "
                                       "rotation (the log says why): nothing was rotated")
        except BaseException:
            self.signing.forget()  # the rotation event read inside the transaction is gone
            raise
        self.signing.use(new)
        return {"seq": seq, "head": head, "public_key": new.public_key.hex(),
                "log_id": new.log_id}

    # ------------------------------------------------------------------ internals
    def _covered(self, conn: Connection) -> int:
        """Events the latest head covers: this log's signed heads, else the checkpoints."""
        if self.signer is not None:
            return self.signing.covered(conn)
        return conn.execute(select(func.max(CHECKPOINTS.c.tree_size))).scalar() or 0

    def _due(self, conn: Connection, size: int) -> bool:
        last = self._covered(conn)
        if size <= last:
            return False
        if size - last >= self.checkpoint_every:
            return True
        first = conn.execute(select(EVENTS.c.created_at).where(EVENTS.c.seq == last + 1)
                             ).scalar()
        try:
            return first is None or (utc_now() - parse_iso(first)).total_seconds() \
                >= self.head_interval_s
        except ValueError:  # an edited time: verify names it; a head does no harm
            return True

    def _take(self, conn: Connection, size: int) -> dict[str, Any] | None:
        """Sign a head over events 1..size, extending this log's latest signed head (only
        once the events after it are all there and the events up to it still give its
        signed root). Without a signing key: an unsigned checkpoint. None when nothing
        was signed; a refusal is logged (and `verify` says why). A checkpoint (the
        frontier the next heads start from) is written every `checkpoint_every` events."""
        if self.signer is None:
            _write_checkpoint(conn, size)
            return None
        frontier = self._trusted_frontier(conn)
        if frontier is None or frontier.size >= size:
            return None
        why = self.signing.refusal(conn, size)
        if why:
            log.error("not signing a head over %d events: %s (restart this process with the "
                      "ledger's key)", size, why)
            return None
        _extend(conn, frontier, size)
        if frontier.size != size:
            log.error("not signing a head over %d events: only %d of them are there", size,
                      frontier.size)
            return None
        if conn.execute(select(HEADS.c.log_id).where(HEADS.c.tree_size == size)).first():
            log.error("not signing a head over %d events: the database holds another log's "
                      "head of that size (run `obliviate ledger verify`)", size)
            return None
        root = frontier.root().hex()
        head = self.signer.sign(size, root, iso(utc_now()))
        conn.execute(insert(HEADS), head)
        last_cp = conn.execute(select(func.max(CHECKPOINTS.c.tree_size))).scalar() or 0
        if size - last_cp >= self.checkpoint_every:
            conn.execute(insert(CHECKPOINTS), {"tree_size": size, "root_hash": root,
                                               "created_at": head["timestamp"],
                                               "frontier": [h.hex() for h in
                                                            frontier.state()[1]]})
        return head

    def _trusted_frontier(self, conn: Connection) -> merkle.MerkleFrontier | None:
        """The Merkle frontier at this log's latest signed head, once it rebuilds the root
        that head signs: from the checkpoint below it, or else from event 1. None, logged,
        when the head's signature fails or the events no longer give its root: signing
        on would vouch for a rewritten log."""
        latest = self.signing.latest_head(conn)
        if latest is None:
            return merkle.MerkleFrontier()
        row, key = latest
        why = verify_head(head_dict(row), key)
        if why:
            log.error("not signing: the latest head in the database (%d events) %s; run "
                      "`obliviate ledger verify`", row.tree_size, why)
            return None
        cp = conn.execute(select(CHECKPOINTS).where(CHECKPOINTS.c.tree_size <= row.tree_size)
                          .order_by(CHECKPOINTS.c.tree_size.desc()).limit(1)).first()
        starts = [merkle.MerkleFrontier()]
        if cp is not None:
            try:
                f = merkle.MerkleFrontier.from_state(cp.tree_size,
                                                     [bytes.fromhex(h) for h in cp.frontier])
                starts.insert(0, f)
            except (TypeError, ValueError):
                pass  # an edited frontier: start from event 1
        for f in starts:
            _extend(conn, f, row.tree_size)
            if f.size == row.tree_size and f.root().hex() == row.root_hash:
                return f
        log.error("not signing: events 1..%d no longer give the root of the signed head over "
                  "them (the log was rewritten); run `obliviate ledger verify`", row.tree_size)
        return None


def _write_checkpoint(conn: Connection, size: int) -> None:
    """Extend the last checkpoint's stored frontier by the events after it."""
    last = conn.execute(select(CHECKPOINTS).order_by(CHECKPOINTS.c.tree_size.desc())
                        .limit(1)).first()
    if size == 0 or (last is not None and last.tree_size >= size):
        return
    frontier = (merkle.MerkleFrontier.from_state(last.tree_size,
                                                 [bytes.fromhex(h) for h in last.frontier])
                if last is not None else merkle.MerkleFrontier())
    _extend(conn, frontier, size)
    conn.execute(insert(CHECKPOINTS), {
        "tree_size": size, "root_hash": frontier.root().hex(), "created_at": iso(utc_now()),
        "frontier": [h.hex() for h in frontier.state()[1]],
    })


def _extend(conn: Connection, frontier: merkle.MerkleFrontier, size: int) -> None:
    """Append the leaves of events frontier.size+1..size (those that are there)."""
    for h in conn.execute(select(EVENTS.c.hash)
                          .where(EVENTS.c.seq > frontier.size, EVENTS.c.seq <= size)
                          .order_by(EVENTS.c.seq).execution_options(yield_per=20_000)
                          ).scalars():
        frontier.append(event_leaf(h))
