"""`verify`: recompute everything the ledger claims and say what disagrees.

The chain of event hashes, every checkpoint's, signed head's and stored subtree's
root, the heads' signatures (following the key rotations), the tail no head covers
yet, every record's keyed fingerprint, and the working tables (requests, records,
schema, Kafka offsets) held to what the events say happened; or, incrementally, the
log after a head verified before. What is found is a list of problems, in log order,
with notes on what could not be checked. See docs/ledger.md#what-ledger-verify-holds.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Engine, select

from ledger import merkle, subtree_store
from ledger.chain import parse_iso
from ledger.heads import log_id
from ledger.keystore import LedgerKeys
from ledger.log_check import LogFacts, Problem, VerifyResult
from ledger.log_walk import LogWalk, resume, walk_events
from ledger.models import DatasetSchema
from ledger.record_check import RecordCheck
from ledger.sealed_payloads import PayloadSealer
from ledger.signing import head_dict
from ledger.tables import (
    CHECKPOINTS,
    HEADS,
    OFFSETS,
    PAYLOADS,
    RECORDS,
    REQUEST_RECORDS,
    REQUESTS,
    SEALED,
)
from ledger.tree_heads import TreeHeads


class LedgerVerifier:
    """Checks a ledger's log, heads and tables against each other."""

    def __init__(self, engine: Engine, hmac_key: bytes, sealer: PayloadSealer,
                 keys: LedgerKeys, heads: TreeHeads) -> None:
        self.engine = engine
        self._records = RecordCheck(hmac_key, sealer)
        self._keys = keys
        self._heads = heads

    def verify(self) -> VerifyResult:
        """Recompute the chain, every checkpoint and signed head, every stored subtree,
        every record fingerprint, and hold the requests and records to what the events
        say happened to them."""
        problems: list[Problem] = []
        notes: list[str] = []
        facts = LogFacts()
        with self.engine.connect() as conn:
            self._keys.scope(conn)  # read here: on SQLite a second connection would wait
            checkpoints = {r.tree_size: r.root_hash for r in conn.execute(select(CHECKPOINTS))}
            heads = {r.tree_size: r for r in conn.execute(select(HEADS))}
            covered = self._check_heads(conn, heads, checkpoints, problems, notes)
            walk = walk_events(conn, LogWalk(), checkpoints, heads, covered, facts, problems)
            self._check_tail(covered, walk, bool(heads) or self._heads.public_key is not None,
                             problems, notes)
            status_of, named = _check_requests(conn, walk.last_kind, facts, problems)
            n_records = self._records.run(conn, status_of, facts, problems)
            problems.extend(facts.check_loaded())
            problems.extend(facts.check_schema(
                conn.execute(select(DatasetSchema.__table__)).first(), notes))
            problems.extend(facts.check_offsets(conn.execute(select(OFFSETS)).all()))
            problems.extend(_orphan_payloads(conn))
            problems.extend(_request_index(conn, named))
        return VerifyResult(not problems, walk.n_events, len(checkpoints), n_records, problems,
                            heads=len(heads), notes=notes,
                            verified_head=_good_head(heads, covered, problems)
                            if self._heads.public_key is not None else None)

    def verify_since(self, verified: dict[str, Any]) -> VerifyResult:
        """The log after `verified`, a signed head a verify passed on before (kept where
        the database's writers cannot reach it): its signature, that the stored subtrees
        still give its root, the events after it (chain, roots of the heads and
        checkpoints, stored subtrees) and an RFC 6962 consistency proof from it to the
        newest head. The tables and the events before it are not read (`verify` does)."""
        problems: list[Problem] = []
        notes = ["only the log after the verified head was checked: the events before it "
                 "are held by its root, the tables by a full `ledger verify`"]
        size = verified["tree_size"]
        with self.engine.connect() as conn:
            checkpoints = {r.tree_size: r.root_hash for r in conn.execute(
                select(CHECKPOINTS).where(CHECKPOINTS.c.tree_size > size))}
            heads = {r.tree_size: r for r in conn.execute(
                select(HEADS).where(HEADS.c.tree_size >= size))}
            stored = heads.pop(size, None)
            covered = max(size, self._check_heads(conn, heads, checkpoints, problems, notes))
            self._check_verified(conn, verified, stored, problems)
            walk = resume(conn, verified, problems)
            if walk is None:
                return VerifyResult(False, 0, 0, 0, problems, notes=notes, since=size)
            walk = walk_events(conn, walk, checkpoints, heads, covered, None, problems)
            self._check_tail(covered, walk, True, problems, notes)
            if covered > size and covered in heads:
                problems.extend(_consistent(conn, verified, heads[covered]))
        good = _good_head(heads, covered, problems)
        return VerifyResult(not problems, walk.n_events, len(checkpoints), 0, problems,
                            heads=len(heads), notes=notes, since=size,
                            verified_head=good if good is not None else verified)

    def _check_verified(self, conn: Connection, verified: dict[str, Any], stored: Any,
                        problems: list[Problem]) -> None:
        """The verified head is this log's (signed by the key that signs its size), and
        the database's head of that size, if it keeps one, is that head. (After
        `_check_heads`, which read the key rotations afresh and reported their problems.)"""
        where = f"verified head {verified['tree_size']}"
        chain, _ = self._heads.signing.chain(conn)
        if chain is None:
            problems.append(Problem(where, "no public key to check it with: set the ledger's "
                                    "signing key (or its public half)"))
            return
        why_not = chain.check_head(verified)
        if why_not:
            problems.append(Problem(where, why_not))
        elif stored is not None and stored.root_hash != verified["root_hash"]:
            problems.append(Problem(f"signed head {verified['tree_size']}", "is not the head "
                                    "verified before: its root differs (the log was "
                                    "rewritten and signed again)", verified["tree_size"]))

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

    def _check_tail(self, covered: int, walk: LogWalk, signed: bool,
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


def _good_head(heads: dict[int, Any], covered: int, problems: list[Problem]
               ) -> dict[str, Any] | None:
    """The newest signed head a verify that found nothing wrong vouches for (what
    `--since-verified` starts from next time), or None."""
    return None if problems or covered not in heads else head_dict(heads[covered])


def _consistent(conn: Connection, old: dict[str, Any], new: Any) -> list[Problem]:
    """An RFC 6962 consistency proof, from the stored subtrees, between two signed heads."""
    proof = subtree_store.consistency_proof(conn, old["tree_size"], new.tree_size)
    if merkle.verify_consistency(old["tree_size"], new.tree_size,
                                 bytes.fromhex(old["root_hash"]), bytes.fromhex(new.root_hash),
                                 proof):
        return []
    return [Problem(f"signed head {new.tree_size}", f"is not consistent with the verified "
                    f"head {old['tree_size']}: the consistency proof from the stored subtree "
                    "hashes fails", old["tree_size"])]


def _check_requests(conn: Connection, last_kind: dict[str, str], facts: LogFacts,
                    problems: list[Problem]
                    ) -> tuple[dict[str, str], set[tuple[str, str, int]]]:
    """Each request's status against its last event; returns the statuses by request id
    and (request, record id, received_seq) of every record id a request names (one read
    of the requests serves both)."""
    status_of: dict[str, str] = {}
    named: set[tuple[str, str, int]] = set()
    for r in conn.execute(select(REQUESTS.c.request_id, REQUESTS.c.status,
                                 REQUESTS.c.received_seq, REQUESTS.c.record_ids)
                          .execution_options(yield_per=10_000)):
        status_of[r.request_id] = r.status
        named.update((r.request_id, rid, r.received_seq) for rid in r.record_ids)
        if last_kind.get(r.request_id) != r.status:
            problems.append(Problem(f"request {r.request_id}", f"status {r.status!r} "
                                    f"disagrees with its last event "
                                    f"{last_kind.get(r.request_id)!r}"))
        problems.extend(facts.check_request(r))
    problems.extend(facts.requests_without_rows(status_of))
    return status_of, named


def _request_index(conn: Connection, named: set[tuple[str, str, int]]) -> list[Problem]:
    """`request_records` (what a subject's requests page reads) against the record ids
    each request names (`named`, which the events hold the requests to): an edited index
    could hide a request from its subject's page."""
    have = {tuple(r) for r in conn.execute(select(
        REQUEST_RECORDS.c.request_id, REQUEST_RECORDS.c.record_id, REQUEST_RECORDS.c.received_seq))}
    return ([Problem(f"request {q}", f"names record {rid} but request_records does not "
                     "list it (its subject's requests page would not show it)")
             for q, rid, _ in sorted(named - have)]
            + [Problem(f"request {q}", f"request_records lists record {rid} at event {seq}, "
                       "which the request does not name there")
               for q, rid, seq in sorted(have - named)])


def _orphan_payloads(conn: Connection) -> list[Problem]:
    """Raw data (plain or sealed) whose record row is gone."""
    return [Problem(f"record {rid}", "raw features and label in "
                    f"{table.name} belong to no training record")
            for table in (PAYLOADS, SEALED)
            for rid in conn.execute(
                select(table.c.record_id)
                .select_from(table.outerjoin(RECORDS, RECORDS.c.record_id == table.c.record_id))
                .where(RECORDS.c.record_id.is_(None))).scalars()]
