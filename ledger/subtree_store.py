"""Stored subtree hashes, so that a proof reads O(log n) rows instead of every event.

As a Certificate Transparency log keeps them: the root of every perfect subtree of the
events' RFC 6962 tree above the leaves is written to `merkle_nodes` in the transaction
that appends its last event. Any range of the tree a proof needs is such a subtree, an
event, or the fold of O(log n) of them (`merkle.perfect_subtrees`). The rows are derived
from the events: `ledger verify` recomputes them all, and a proof built from an edited
row fails against the signed root. See docs/ledger.md#stored-subtree-hashes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence

from sqlalchemy import Connection, delete, func, select

from ledger import merkle
from ledger.chain import event_leaf
from ledger.db import insert_rows
from ledger.tables import EVENTS, MERKLE_NODES

log = logging.getLogger("obliviate.ledger")

Subtree = tuple[int, int]  # (level, index): leaves [index * 2**level, (index + 1) * 2**level)
_BATCH = 20_000  # rows per insert and per streamed read while catching up


def stored_count(size: int) -> int:
    """How many subtrees above the leaves a tree of `size` leaves has complete."""
    return size - size.bit_count()


def position(level: int, index: int) -> int:
    """Where subtree (level >= 1, index) is stored: its place in the order appends
    complete subtrees (the leaf that ends it completes levels 1.. up to its trailing
    zero bits, lowest first)."""
    end = (index + 1) << level
    return stored_count(end) - 1 - ((end & -end).bit_length() - 1 - level)


def read(conn: Connection, subtrees: Iterable[Subtree]) -> dict[Subtree, bytes]:
    """The roots of `subtrees`: leaves from the events, the others from `merkle_nodes`;
    one a row is missing for (written behind the ledger's back) is rebuilt from its
    events. ValueError when the events themselves are not there."""
    wanted = set(subtrees)
    leaves = sorted(j + 1 for level, j in wanted if level == 0)
    out: dict[Subtree, bytes] = {}
    if leaves:
        for seq, h in conn.execute(select(EVENTS.c.seq, EVENTS.c.hash)
                                   .where(EVENTS.c.seq.in_(leaves))):
            out[(0, seq - 1)] = event_leaf(h)
    at = {position(level, j): (level, j) for level, j in wanted if level > 0}
    if at:
        for pos, h in conn.execute(select(MERKLE_NODES.c.position, MERKLE_NODES.c.hash)
                                   .where(MERKLE_NODES.c.position.in_(sorted(at)))):
            out[at[pos]] = bytes(h)
    for level, j in wanted - out.keys():
        out[(level, j)] = _from_events(conn, j << level, (j + 1) << level)
    return out


def _from_events(conn: Connection, lo: int, hi: int) -> bytes:
    leaves = [event_leaf(h) for h in conn.execute(
        select(EVENTS.c.hash).where(EVENTS.c.seq > lo, EVENTS.c.seq <= hi)
        .order_by(EVENTS.c.seq)).scalars()]
    if len(leaves) != hi - lo:
        raise ValueError(f"events {lo + 1}..{hi} are not all there ({len(leaves)} found)")
    return merkle.root(leaves)


def _roots(conn: Connection, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """MTH of each leaf range of RFC 6962's tree, from one read of their subtrees."""
    parts = [merkle.perfect_subtrees(lo, hi) for lo, hi in ranges]
    hashes = read(conn, (s for p in parts for s in p))
    return [merkle.fold([hashes[s] for s in p]) for p in parts]


def inclusion_proof(conn: Connection, index: int, tree_size: int) -> list[bytes]:
    """PATH(index, D[tree_size]) of RFC 6962, from O(log n) stored subtrees."""
    return _roots(conn, merkle.inclusion_ranges(index, tree_size))


def consistency_proof(conn: Connection, old_size: int, tree_size: int) -> list[bytes]:
    """PROOF(old_size, D[tree_size]) of RFC 6962, from O(log n) stored subtrees."""
    return _roots(conn, merkle.consistency_ranges(old_size, tree_size))


def root(conn: Connection, tree_size: int) -> bytes:
    """MTH(D[tree_size]), from the O(log n) stored subtrees that cover the events."""
    return _roots(conn, [(0, tree_size)])[0] if tree_size else merkle.EMPTY_ROOT


def frontier_at(conn: Connection, size: int, last_hash: str | None = None
                ) -> merkle.MerkleFrontier | None:
    """The frontier over events 1..size from the stored subtrees (`last_hash`: event
    `size`'s hash, when the caller has it); None when a row it needs is missing."""
    subtrees = merkle.perfect_subtrees(0, size)
    stored = [s for s in subtrees if s[0] > 0]
    hashes = {}
    if stored:
        at = {position(*s): s for s in stored}
        hashes = {at[pos]: bytes(h) for pos, h in conn.execute(
            select(MERKLE_NODES.c.position, MERKLE_NODES.c.hash)
            .where(MERKLE_NODES.c.position.in_(sorted(at))))}
    if size & 1:
        if last_hash is None:
            last_hash = conn.execute(select(EVENTS.c.hash).where(EVENTS.c.seq == size)
                                     ).scalar()
        if last_hash is not None:
            hashes[(0, size - 1)] = event_leaf(last_hash)
    if len(hashes) != len(subtrees):
        return None
    return merkle.MerkleFrontier.from_state(size, [hashes[s] for s in subtrees])


def store(conn: Connection, frontier: merkle.MerkleFrontier, leaves: Iterable[bytes],
          from_position: int = 0) -> None:
    """Append `leaves` to `frontier` and insert the subtrees they complete (those at
    `from_position` or later), in batches."""
    rows = []
    pos = stored_count(frontier.size)
    for leaf in leaves:
        for h in frontier.append(leaf):
            if pos >= from_position:
                rows.append({"position": pos, "hash": h})
            pos += 1
        if len(rows) >= _BATCH:
            insert_rows(conn, MERKLE_NODES, rows)
            rows = []
    insert_rows(conn, MERKLE_NODES, rows)


def catch_up(conn: Connection, size: int, last_hash: str | None = None
             ) -> merkle.MerkleFrontier | None:
    """The frontier over events 1..size, with `merkle_nodes` made to hold exactly their
    subtrees first: rows over events no longer there are dropped, missing ones rebuilt
    from the events (streamed). On the append path (a table in step) it is two reads.
    None (logged) when events 1..size are not all there: no tree to store."""
    have = conn.execute(select(func.max(MERKLE_NODES.c.position))).scalar()
    have = 0 if have is None else have + 1
    want = stored_count(size)
    if have > want:
        log.warning("dropping the stored subtree hashes over events after %d (events "
                    "removed behind the ledger's back; `ledger verify` says more)", size)
        conn.execute(delete(MERKLE_NODES).where(MERKLE_NODES.c.position >= want))
        have = want
    if have == want:
        frontier = frontier_at(conn, size, last_hash)
        if frontier is not None:
            return frontier
    start = _covered(have, size)
    frontier = frontier_at(conn, start)
    if frontier is None:  # a row inside the table is missing: rebuild it all
        conn.execute(delete(MERKLE_NODES))
        start, have, frontier = 0, 0, merkle.MerkleFrontier()
    log.info("storing the subtree hashes of events %d..%d", start + 1, size)
    store(conn, frontier, _leaves_in_sequence(conn, start, size), from_position=have)
    if frontier.size != size:
        log.error("not storing subtree hashes after event %d: events 1..%d are not all "
                  "there (run `obliviate ledger verify`)", frontier.size, size)
        return None
    return frontier


def _leaves_in_sequence(conn: Connection, start: int, size: int) -> Iterator[bytes]:
    """The leaves of events start+1..size, streamed, up to the first one missing."""
    expected = start + 1
    for seq, h in conn.execute(
            select(EVENTS.c.seq, EVENTS.c.hash).where(EVENTS.c.seq > start, EVENTS.c.seq <= size)
            .order_by(EVENTS.c.seq).execution_options(yield_per=_BATCH)):
        if seq != expected:
            return
        yield event_leaf(h)
        expected += 1


def _covered(rows: int, size: int) -> int:
    """The most events (at most `size`) whose subtrees all lie in the first `rows`
    positions: stored_count is non-decreasing, so a binary search finds it."""
    lo, hi = 0, size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if stored_count(mid) <= rows:
            lo = mid
        else:
            hi = mid - 1
    return lo
