"""The key rotations are read through their partial index (migration 0006), so following
them (every signer, `verify --since-verified`) does not scan the log, and a rotation is
still found by it after more events. See docs/ledger.md#incremental-verify."""

from __future__ import annotations

from sqlalchemy import text

from ledger.heads import ROTATION_KIND
from ledger.signing import rotations_between
from ledger.store import Ledger


def _plan(ledger: Ledger) -> str:
    with ledger.engine.begin() as conn:
        sql = str(rotations_between(0, 10**6).compile(conn, compile_kwargs={"literal_binds":
                                                                            True}))
        if conn.dialect.name == "sqlite":
            return str(conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql).all())
        conn.exec_driver_sql("SET LOCAL enable_seqscan = off")  # may it use the index?
        return str(conn.exec_driver_sql("EXPLAIN " + sql).all())


def test_the_rotations_are_read_through_their_partial_index(signed: Ledger) -> None:
    plan = _plan(signed)
    assert "ix_events_key_rotations" in plan, plan
    assert "SCAN events" not in plan and "Seq Scan" not in plan


def test_a_rotation_is_found_through_the_index_after_more_events(signed: Ledger) -> None:
    signed.heads.rotate_key(bytes(range(50, 82)))
    signed.events.append("bench_note", {"i": 1}, None)  # more log after the rotation
    with signed.engine.connect() as conn:
        found = [r.seq for r in conn.execute(rotations_between(0, 10**9))]
        every = conn.execute(text("SELECT seq FROM events WHERE kind = :k"),
                             {"k": ROTATION_KIND}).scalars().all()
    assert len(found) == 1 and found == every
    first = signed.verify()
    assert first.ok, first.problems
    since = signed.verifier.verify_since(first.verified_head)
    assert since.ok, since.problems
