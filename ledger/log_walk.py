"""`verify`'s pass over the events: the chain, the roots, the stored subtree hashes.

One streamed pass checks each event's hash and link, the Merkle root of every
checkpoint and signed head it meets, and every subtree hash stored for the proofs,
either from event 1 or (`--since-verified`) from a signed head verified before, whose
root the stored subtrees must still give. See docs/ledger.md#what-ledger-verify-holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import Any

from sqlalchemy import Connection, func, select

from ledger import merkle, subtree_store
from ledger.chain import GENESIS_HASH, event_hash, event_leaf
from ledger.log_check import LogFacts, Problem
from ledger.models import REQUEST_STATUSES
from ledger.tables import EVENTS, MERKLE_NODES

_COMPARE_EVERY = 4096  # stored subtree hashes read per comparison
_BATCH = 20_000  # events per fetch
_EVENT_COLUMNS = (EVENTS.c.seq, EVENTS.c.request_id, EVENTS.c.kind, EVENTS.c.payload,
                  EVENTS.c.model_version, EVENTS.c.created_at, EVENTS.c.prev_hash,
                  EVENTS.c.hash)


@dataclass
class LogWalk:
    """Where a pass starts (after `start` events, linked to `prev`, with the tree's
    `frontier` there) and what it found besides problems."""

    start: int = 0
    prev: str = GENESIS_HASH
    frontier: merkle.MerkleFrontier = field(default_factory=merkle.MerkleFrontier)
    n_events: int = 0
    last_kind: dict[str, str] = field(default_factory=dict)  # request id -> its last event
    first_uncovered: str | None = None  # created_at of the first event no head covers
    last_at: str | None = None


def resume(conn: Connection, head: dict[str, Any], problems: list[Problem]) -> LogWalk | None:
    """A walk that starts at `head` (a signed head verified before), once the stored
    subtrees give its root and its last event is proven in it; None (a problem) if not."""
    size, where = head["tree_size"], f"verified head {head['tree_size']}"
    frontier = subtree_store.frontier_at(conn, size)
    last = conn.execute(select(EVENTS).where(EVENTS.c.seq == size)).first()
    if frontier is None or last is None:
        problems.append(Problem(where, f"events 1..{size} or their stored subtree hashes are "
                                "not all there (events removed?): run a full `ledger verify`",
                                size))
        return None
    root = bytes.fromhex(head["root_hash"])
    proof = subtree_store.inclusion_proof(conn, size - 1, size)
    if frontier.root() != root or not merkle.verify_inclusion(
            event_leaf(last.hash), size - 1, size, proof, root):
        problems.append(Problem(where, f"events 1..{size} no longer give the root it signed "
                                "(their stored subtree hashes, or the chain, were rewritten "
                                "since it was verified): run a full `ledger verify`", size))
        return None
    if event_hash(last.seq, last.request_id, last.kind, last.payload, last.model_version,
                  last.created_at, last.prev_hash) != last.hash:
        problems.append(Problem(f"event {size}", "content does not match its hash (edited "
                                "behind the ledger's back)", size))
    return LogWalk(start=size, prev=last.hash, frontier=frontier)


def walk_events(conn: Connection, walk: LogWalk, checkpoints: dict[int, str],
                heads: dict[int, Any], covered: int, facts: LogFacts | None,
                problems: list[Problem]) -> LogWalk:
    """The events after `walk.start`: the chain of hashes, the roots of the checkpoints
    and heads along it, the stored subtrees, and heads or checkpoints over more events
    than there are. `facts` (a full pass only) gathers what the events say happened."""
    frontier, prev, expected = walk.frontier, walk.prev, walk.start + 1
    stored = _StoredSubtrees(conn, frontier.size)
    last_kind, append, lifecycle = walk.last_kind, frontier.append, REQUEST_STATUSES
    told = LogFacts.KINDS if facts is not None else frozenset()
    at = None
    events = conn.execution_options(yield_per=_BATCH).execute(
        select(*_EVENT_COLUMNS).where(EVENTS.c.seq > walk.start).order_by(EVENTS.c.seq))
    for e in chain.from_iterable(events.partitions()):
        seq, rid, kind, payload, model_version, at, prev_hash, h = e
        if seq != expected:
            problems.append(Problem(f"event {expected}", "missing: the sequence jumps "
                                    f"to {seq} (deleted row?)", expected))
            expected = seq
        if prev_hash != prev:
            problems.append(Problem(f"event {seq}", "prev_hash does not match the "
                                    "previous event's hash", seq))
        if event_hash(seq, rid, kind, payload, model_version, at, prev_hash) != h:
            problems.append(Problem(f"event {seq}", "content does not match its "
                                    "hash (edited behind the ledger's back)", seq))
        prev, expected = h, expected + 1
        completed = append(event_leaf(h))
        size = frontier.size
        if completed:
            stored.see(size, completed)
        if size in checkpoints or size in heads:
            _check_roots(frontier, checkpoints, heads, problems)
        if kind in told:
            if rid and kind in lifecycle:
                last_kind[rid] = kind
            facts.see(e, problems)  # type: ignore[union-attr]
        if seq == covered + 1:
            walk.first_uncovered = at
    if at is not None:
        walk.last_at = at
    n_events = walk.n_events = frontier.size
    problems.extend(stored.finish(n_events))
    for size in sorted(s for s in checkpoints if s > n_events):
        problems.append(Problem(f"checkpoint {size}", f"covers {size} events but the log "
                                f"has {n_events} (events removed?)", n_events + 1))
    for size in sorted(s for s in heads if s > n_events):
        problems.append(Problem(f"signed head {size}", f"covers {size} events but the "
                                f"log has {n_events} (events removed)", n_events + 1))
    return walk


def _check_roots(frontier: merkle.MerkleFrontier, checkpoints: dict[int, str],
                 heads: dict[int, Any], problems: list[Problem]) -> None:
    size = frontier.size
    root = checkpoints.get(size)
    if root is not None and root != frontier.root().hex():
        problems.append(Problem(f"checkpoint {size}", "Merkle root does not match the "
                                "events it covers", size))
    head = heads.get(size)
    if head is not None and head.root_hash != frontier.root().hex():
        problems.append(Problem(f"signed head {size}", "Merkle root does not match the "
                                "events it covers (the log was rewritten)", size))


class _StoredSubtrees:
    """The subtree hashes the walk computes, held to the rows `merkle_nodes` stores."""

    def __init__(self, conn: Connection, size: int) -> None:
        self._conn = conn
        self._next = subtree_store.stored_count(size)  # position of the first pending hash
        self._after = size  # the pending hashes are those the events after this completed
        self._pending: list[bytes] = []
        self._edited: list[tuple[int, int]] = []  # level, index
        self._missing: list[tuple[int, int]] = []

    def see(self, size: int, completed: list[bytes]) -> None:
        """The subtrees the `size`-th event completed (levels 1, 2, ...)."""
        if not self._pending:
            self._after = size - 1
        self._pending += completed
        if len(self._pending) >= _COMPARE_EVERY:
            self._compare()

    def _compare(self) -> None:
        pending, start = self._pending, self._next
        if not pending:
            return
        self._pending, self._next = [], start + len(pending)
        span = MERKLE_NODES.c.position.between(start, self._next - 1)
        if self._conn.execute(select(MERKLE_NODES.c.hash).where(span)
                              .order_by(MERKLE_NODES.c.position)).scalars().all() == pending:
            return  # all there, all equal (positions are unique)
        rows = dict(self._conn.execute(select(MERKLE_NODES.c.position, MERKLE_NODES.c.hash)
                                       .where(span)).all())
        for pos, (level, index), h in zip(range(start, self._next), islice(
                _completed_after(self._after), len(pending)), pending, strict=True):
            got = rows.get(pos)
            if got is None:
                self._missing.append((level, index))
            elif bytes(got) != h:
                self._edited.append((level, index))

    def finish(self, n_events: int) -> list[Problem]:
        self._compare()
        out = [_subtree_problem(found, what) for found, what in (
            (self._edited, "do not match the events they cover (edited behind the ledger's "
                           "back): proofs served from them fail against the signed roots"),
            (self._missing, "are missing (events appended behind the ledger's back?): proofs "
                            "are rebuilt from the events meanwhile")) if found]
        extra = self._conn.execute(select(func.count()).select_from(MERKLE_NODES)
                                   .where(MERKLE_NODES.c.position >= self._next)).scalar()
        if extra:
            out.append(Problem("stored subtree hashes", f"{extra} stored beyond the "
                               f"{self._next} that events 1..{n_events} complete (events "
                               "removed?)", n_events + 1))
        return out


def _completed_after(size: int) -> Iterator[tuple[int, int]]:
    """(level, index) of the subtrees the events after the `size`-th complete, in order."""
    while True:
        size += 1
        for level in range(1, (size & -size).bit_length()):
            yield level, (size >> level) - 1


def _subtree_problem(found: list[tuple[int, int]], what: str) -> Problem:
    level, index = found[0]
    lo, hi = (index << level) + 1, (index + 1) << level
    return Problem("stored subtree hashes", f"{len(found)} {what}; the first is the one "
                   f"over events {lo}..{hi}", lo)
