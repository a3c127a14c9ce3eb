"""`verify`: recompute everything the ledger claims and say what disagrees.

The chain of event hashes, every checkpoint's and signed head's root, the heads'
signatures (following the key rotations), the tail no head covers yet, every
record's keyed fingerprint, and the working tables (requests, records, schema,
Kafka offsets) held to what the events say happened. What is found is a list of
problems, in log order, with notes on what could not be checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, select

from ledger import merkle
from ledger.chain import GENESIS_HASH, event_hash, event_leaf, parse_iso, record_fingerprint
from ledger.heads import log_id
from ledger.keystore import LedgerKeys
from ledger.log_check import LogFacts, Problem, VerifyResult
from ledger.models import REQUEST_STATUSES, DatasetSchema
from ledger.sealed_payloads import PayloadKeyMissing, PayloadSealer
from ledger.signing import head_dict
from ledger.tables import CHECKPOINTS, EVENTS, HEADS, OFFSETS, PAYLOADS, RECORDS, REQUESTS, SEALED
from ledger.tree_heads import TreeHeads


@dataclass
class _EventWalk:
    """What one pass over the events found besides problems."""

    n_events: int = 0
    last_kind: dict[str, str] = field(default_factory=dict)  # request id -> its last event
    first_uncovered: str | None = None  # created_at of the first event no head covers
    last_at: str | None = None


class LedgerVerifier:
    """Checks a ledger's log, heads and tables against each other."""

    def __init__(self, engine: Engine, hmac_key: bytes, sealer: PayloadSealer,
                 keys: LedgerKeys, heads: TreeHeads) -> None:
        self.engine = engine
        self._key = hmac_key
        self._sealer = sealer
        self._keys = keys
        self._heads = heads

    def verify(self) -> VerifyResult:
        """Recompute the chain, every checkpoint and signed head, every record fingerprint,
        and hold the requests and records to what the events say happened to them."""
        problems: list[Problem] = []
        notes: list[str] = []
        facts = LogFacts()
        with self.engine.connect() as conn:
            self._keys.scope(conn)  # read here: on SQLite a second connection would wait
            checkpoints = {r.tree_size: r.root_hash for r in conn.execute(select(CHECKPOINTS))}
            heads = {r.tree_size: r for r in conn.execute(select(HEADS))}
            covered = self._check_heads(conn, heads, checkpoints, problems, notes)
            walk = _check_events(conn, checkpoints, heads, covered, facts, problems)
            self._check_tail(covered, walk, bool(heads) or self._heads.public_key is not None,
                             problems, notes)
            status_of = _check_requests(conn, walk.last_kind, facts, problems)
            n_records = self._check_records(conn, status_of, facts, problems)
            problems.extend(facts.check_loaded())
            problems.extend(facts.check_schema(
                conn.execute(select(DatasetSchema.__table__)).first(), notes))
            problems.extend(facts.check_offsets(conn.execute(select(OFFSETS)).all()))
            problems.extend(_orphan_payloads(conn))
        return VerifyResult(not problems, walk.n_events, len(checkpoints), n_records, problems,
                            heads=len(heads), notes=notes)

    def _check_heads(self, conn: Connection, heads: dict[int, Any],
                     checkpoints: dict[int, str], problems: list[Problem],
                     notes: list[str]) -> int:
        """Signatures of the signed heads, each by the key that signs its size (the key
        rotations followed, and leading through this process's key); returns how many
        events the heads (or, on a ledger that never had a signing key, the checkpoints)
        cover."""
        chain = None
        public_key = self._heads.public_key
        if public_key is None:
            if heads:
                notes.append("no public key: the signed heads' signatures were not checked "
                             "(set the signing key, or check them with `obliviate audit check`)")
            else:
                notes.append("no signing key: the checkpoints are not signed, so whoever can "
                             "write to the database can rewrite the log and its checkpoints")
                return max(checkpoints, default=0)
        else:
            chain, why = self._heads.signing.chain(conn, fresh=True)
            problems.extend(Problem("signing keys", w) for w in why)
            if chain is not None and chain.current != public_key and public_key in chain.keys:
                notes.append(f"this process's key (log {log_id(public_key)[:16]}...) was "
                             "retired by a key rotation: give it the current key")
        good = []
        for size, row in sorted(heads.items()):
            why = None if chain is None else chain.check_head(head_dict(row))
            if why:
                problems.append(Problem(f"signed head {size}", why))
            else:
                good.append(size)
        return max(good, default=0)

    def _check_tail(self, covered: int, walk: _EventWalk, signed: bool,
                    problems: list[Problem], notes: list[str]) -> None:
        """Events after the latest head: no one can check them yet, but none of them may
        be `head_interval_s` older than the newest event: every append takes a head once
        the oldest uncovered event is that old, so a longer tail had its heads dropped.
        (The writers' OBLIVIATE_HEAD_INTERVAL_S is assumed; `checkpoint_every` is not
        held to, since processes may differ in it.)"""
        n_events = walk.n_events
        if covered >= n_events:
            return
        what = "signed head" if signed else "checkpoint"
        n = n_events - covered
        interval = self._heads.head_interval_s
        try:
            span = (parse_iso(walk.last_at) - parse_iso(walk.first_uncovered)).total_seconds()
        except (TypeError, ValueError):
            span = float("inf")
        if span >= interval:
            problems.append(Problem(
                f"events {covered + 1}..{n_events}", f"no {what} covers these {n} events over "
                f"{span:.1f} s, though one is taken once events are {interval:g} s "
                "old: heads dropped, or written by something that takes none", covered + 1))
        else:
            notes.append(f"events {covered + 1}..{n_events} ({n}) come after the latest {what}: "
                         "nothing can check an unsigned tail until the next head covers it")

    def _check_records(self, conn: Connection, status_of: dict[str, str], facts: LogFacts,
                       problems: list[Problem]) -> int:
        """Every record against its fingerprint and the events; returns how many there are."""
        n_records = 0
        for rec in conn.execution_options(yield_per=5000).execute(
                select(RECORDS, PAYLOADS.c.features, PAYLOADS.c.label,
                       PAYLOADS.c.record_id.label("payload_of"), SEALED.c.sealed)
                .select_from(RECORDS.outerjoin(PAYLOADS,
                                               PAYLOADS.c.record_id == RECORDS.c.record_id)
                             .outerjoin(SEALED, SEALED.c.record_id == RECORDS.c.record_id))):
            n_records += 1
            problems.extend(self._check_record(rec))
            problems.extend(facts.check_record(rec, status_of))
        return n_records

    def _check_record(self, rec: Any) -> list[Problem]:
        where = f"record {rec.record_id}"
        if rec.state == "purged":
            if rec.payload_of is not None or rec.sealed is not None:
                return [Problem(where, "is purged but still holds raw features or label "
                                       "(a row in record_payloads or sealed_payloads)")]
            if rec.added_by is not None and self._sealer.has_key(rec.record_id):
                return [Problem(where, "is purged but its payload key is still in the key "
                                       "store (copies of its sealed row would open)")]
            return []
        features, label = rec.features, rec.label
        if features is None and rec.sealed is not None:
            try:
                features, label = self._sealer.open(rec.record_id, bytes(rec.sealed))
            except (PayloadKeyMissing, ValueError) as exc:
                return [Problem(where, f"is {rec.state} but its data cannot be read: {exc}")]
        if features is None or label is None:
            return [Problem(where, f"is {rec.state} but has no features or label")]
        if record_fingerprint(self._key, rec.record_id, rec.subject_id, features,
                              label) != rec.record_hash:
            return [Problem(where, "features or label do not match its keyed fingerprint")]
        return []


def _check_events(conn: Connection, checkpoints: dict[int, str], heads: dict[int, Any],
                  covered: int, facts: LogFacts, problems: list[Problem]) -> _EventWalk:
    """The chain of hashes, the roots of the checkpoints and heads along it, and heads or
    checkpoints over more events than there are."""
    walk = _EventWalk()
    frontier = merkle.MerkleFrontier()
    prev, expected = GENESIS_HASH, 1
    for e in conn.execution_options(yield_per=5000).execute(
            select(EVENTS).order_by(EVENTS.c.seq)):
        if e.seq != expected:
            problems.append(Problem(f"event {expected}", "missing: the sequence jumps "
                                    f"to {e.seq} (deleted row?)", expected))
            expected = e.seq
        if e.prev_hash != prev:
            problems.append(Problem(f"event {e.seq}", "prev_hash does not match the "
                                    "previous event's hash", e.seq))
        if event_hash(e.seq, e.request_id, e.kind, e.payload, e.model_version,
                      e.created_at, e.prev_hash) != e.hash:
            problems.append(Problem(f"event {e.seq}", "content does not match its "
                                    "hash (edited behind the ledger's back)", e.seq))
        prev, expected = e.hash, expected + 1
        frontier.append(event_leaf(e.hash))
        root = checkpoints.get(frontier.size)
        if root is not None and root != frontier.root().hex():
            problems.append(Problem(f"checkpoint {frontier.size}", "Merkle root does not "
                                    "match the events it covers", frontier.size))
        head = heads.get(frontier.size)
        if head is not None and head.root_hash != frontier.root().hex():
            problems.append(Problem(f"signed head {frontier.size}", "Merkle root does "
                                    "not match the events it covers (the log was "
                                    "rewritten)", frontier.size))
        if e.request_id and e.kind in REQUEST_STATUSES:
            walk.last_kind[e.request_id] = e.kind
        facts.see(e, problems)
        if e.seq == covered + 1:
            walk.first_uncovered = e.created_at
        walk.last_at = e.created_at
    n_events = walk.n_events = frontier.size
    for size in sorted(s for s in checkpoints if s > n_events):
        problems.append(Problem(f"checkpoint {size}", f"covers {size} events but the log "
                                f"has {n_events} (events removed?)", n_events + 1))
    for size in sorted(s for s in heads if s > n_events):
        problems.append(Problem(f"signed head {size}", f"covers {size} events but the "
                                f"log has {n_events} (events removed)", n_events + 1))
    return walk


def _check_requests(conn: Connection, last_kind: dict[str, str], facts: LogFacts,
                    problems: list[Problem]) -> dict[str, str]:
    """Each request's status against its last event; returns the statuses by request id."""
    status_of: dict[str, str] = {}
    for r in conn.execute(select(REQUESTS.c.request_id, REQUESTS.c.status,
                                 REQUESTS.c.received_seq)):
        status_of[r.request_id] = r.status
        if last_kind.get(r.request_id) != r.status:
            problems.append(Problem(f"request {r.request_id}", f"status {r.status!r} "
                                    f"disagrees with its last event "
                                    f"{last_kind.get(r.request_id)!r}"))
        problems.extend(facts.check_request(r))
    problems.extend(facts.requests_without_rows(status_of))
    return status_of


def _orphan_payloads(conn: Connection) -> list[Problem]:
    """Raw data (plain or sealed) whose record row is gone."""
    return [Problem(f"record {rid}", "raw features and label in "
                    f"{table.name} belong to no training record")
            for table in (PAYLOADS, SEALED)
            for rid in conn.execute(
                select(table.c.record_id)
                .select_from(table.outerjoin(RECORDS, RECORDS.c.record_id == table.c.record_id))
                .where(RECORDS.c.record_id.is_(None))).scalars()]
