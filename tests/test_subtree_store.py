"""Proofs from stored subtree hashes (ledger.subtree_store) against the full rebuild.

The in-memory builders of ledger.merkle are held to a literal transcription of RFC 6962
and the Certificate Transparency vectors (tests/test_merkle.py); here the proofs the
ledger serves from `merkle_nodes` are held to them, on SQLite and PostgreSQL, for every
(m, n) up to 64 events and random pairs of larger logs, and their cost is counted.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from sqlalchemy import delete, event, func, select, update

from ledger import merkle, subtree_store
from ledger.appender import ChainAppender
from ledger.chain import event_leaf
from ledger.db import writing
from ledger.store import Ledger
from ledger.tables import EVENTS, MERKLE_NODES
from tests.conftest import HMAC_KEY


@pytest.fixture
def bare(db_url: str) -> Iterator[Ledger]:
    """A ledger whose events are notes (no heads: the proofs alone are under test)."""
    led = Ledger(db_url, HMAC_KEY, checkpoint_every=10**9, head_interval_s=10**9)
    yield led
    led.close()


def append_notes(led: Ledger, n: int) -> None:
    """`n` events in one transaction, through the append path every event takes."""
    with writing(led.engine) as conn:
        appender = ChainAppender(conn)
        for _ in range(n):
            appender.append("note", None, {"i": appender.seq + 1}, "2026-11-27T00:00:00.000000Z")
        appender.flush(conn)


def leaves(led: Ledger) -> list[bytes]:
    with led.engine.connect() as conn:
        return [event_leaf(h) for h in conn.execute(
            select(EVENTS.c.hash).order_by(EVENTS.c.seq)).scalars()]


def stored_rows(led: Ledger) -> int:
    with led.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(MERKLE_NODES)).scalar()


def assert_proofs_match(led: Ledger, pairs: list[tuple[int, int]]) -> None:
    """For each (m, n): inclusion of event m+1 in n (m < n) and consistency m -> n."""
    full = leaves(led)
    with led.engine.connect() as conn:
        for m, n in pairs:
            tree = full[:n]
            assert subtree_store.root(conn, n) == merkle.root(tree), n
            if m < n:
                proof = subtree_store.inclusion_proof(conn, m, n)
                assert proof == merkle.inclusion_proof(tree, m), (m, n)
                assert merkle.verify_inclusion(tree[m], m, n, proof, merkle.root(tree))
            proof = subtree_store.consistency_proof(conn, m, n)
            assert proof == merkle.consistency_proof(tree, m), (m, n)
            assert merkle.verify_consistency(m, n, merkle.root(full[:m]), merkle.root(tree),
                                             proof)


def test_position_numbers_subtrees_in_the_order_appends_complete_them() -> None:
    frontier, order = merkle.MerkleFrontier(), []
    for i in range(1, 300):
        for level, _ in enumerate(frontier.append(merkle.leaf_hash(b"%d" % i)), start=1):
            order.append((level, (i >> level) - 1))
        assert len(order) == subtree_store.stored_count(i)
    assert [subtree_store.position(lv, j) for lv, j in order] == list(range(len(order)))


def test_every_pair_up_to_64_events_equals_the_full_rebuild(bare: Ledger) -> None:
    """Appended one to five at a time, so a flush completes subtrees across its events."""
    rng, n = random.Random(1), 0
    while n < 64:
        batch = min(rng.randint(1, 5), 64 - n)
        append_notes(bare, batch)
        n += batch
    assert len(leaves(bare)) == 64
    assert stored_rows(bare) == subtree_store.stored_count(64)
    assert_proofs_match(bare, [(m, n) for n in range(1, 65) for m in range(n + 1)])


def test_random_pairs_in_larger_logs_equal_the_full_rebuild(bare: Ledger) -> None:
    rng = random.Random(7)
    for batch in (1000, 777, 1):
        append_notes(bare, batch)
        n = len(leaves(bare))
        pairs = [(n - 1, n), (0, n)] + [tuple(sorted(rng.sample(range(n + 1), 2)))
                                        for _ in range(40)]
        assert_proofs_match(bare, pairs)
    assert stored_rows(bare) == subtree_store.stored_count(1778)


def test_a_proof_costs_two_reads_of_log_n_rows(bare: Ledger) -> None:
    append_notes(bare, 5000)
    statements: list[str] = []
    listen = (bare.engine, "before_cursor_execute")

    def count(conn, cursor, sql, params, context, many) -> None:  # noqa: ANN001
        if sql.lstrip().upper().startswith("SELECT"):
            statements.append(sql)
    event.listen(*listen, count)
    try:
        with bare.engine.connect() as conn:
            for index, size in ((0, 5000), (4321, 4999), (2048, 4097)):
                statements.clear()
                proof = subtree_store.inclusion_proof(conn, index, size)
                assert len(statements) <= 2 and len(proof) <= 13, statements
            statements.clear()
            subtree_store.consistency_proof(conn, 1234, 5000)
            assert len(statements) <= 2
    finally:
        event.remove(*listen, count)


def test_missing_and_stale_rows_are_rebuilt_by_the_next_append(bare: Ledger) -> None:
    append_notes(bare, 100)
    with bare.engine.begin() as conn:  # a hole inside (only `verify` looks for those)
        conn.execute(delete(MERKLE_NODES).where(MERKLE_NODES.c.position == 50))
    full = leaves(bare)
    with bare.engine.connect() as conn:  # a proof reads around it, from the events
        assert subtree_store.root(conn, 100) == merkle.root(full)
        assert subtree_store.inclusion_proof(conn, 0, 100) == merkle.inclusion_proof(full, 0)
    with bare.engine.begin() as conn:  # the rows of the last events gone: appended behind
        conn.execute(delete(MERKLE_NODES).where(MERKLE_NODES.c.position >= 80))
    append_notes(bare, 3)
    assert stored_rows(bare) == subtree_store.stored_count(103) - 1
    with bare.engine.begin() as conn:  # events removed: their rows go at the next append
        conn.execute(delete(EVENTS).where(EVENTS.c.seq > 90))
    append_notes(bare, 5)
    assert stored_rows(bare) == subtree_store.stored_count(95) - 1
    with bare.engine.begin() as conn:  # the table emptied: streamed back from event 1
        conn.execute(delete(MERKLE_NODES))
    append_notes(bare, 1)
    assert stored_rows(bare) == subtree_store.stored_count(96)
    assert_proofs_match(bare, [(m, 96) for m in range(0, 97, 7)])


def test_an_edited_subtree_gives_proofs_that_fail_against_the_root(bare: Ledger) -> None:
    append_notes(bare, 40)
    full = leaves(bare)
    with bare.engine.begin() as conn:
        conn.execute(update(MERKLE_NODES).where(MERKLE_NODES.c.position.in_(
            [subtree_store.position(3, 1), subtree_store.position(4, 0)]))
            .values(hash=b"\x00" * 32))
    with bare.engine.connect() as conn:
        proof = subtree_store.inclusion_proof(conn, 0, 40)  # events 9..16: a sibling on its path
        assert not merkle.verify_inclusion(full[0], 0, 40, proof, merkle.root(full))
        proof = subtree_store.consistency_proof(conn, 20, 40)  # events 1..16 are in it
        assert not merkle.verify_consistency(20, 40, merkle.root(full[:20]),
                                             merkle.root(full), proof)
