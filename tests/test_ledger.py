"""The ledger on SQLite and PostgreSQL: lifecycle, idempotency, purging, tamper evidence."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import event, text

from ledger import merkle
from ledger.chain import event_leaf
from ledger.intake import IncomingMessage
from ledger.store import Ledger
from tests.conftest import HMAC_KEY, requests_of_subject_by_scan, seed


def delete(rid: str, *records: str, subject: str | None = None) -> dict:
    msg: dict = {"request_id": rid, "op": "delete"}
    if records:
        msg["record_ids"] = list(records)
    if subject:
        msg["subject_id"] = subject
    return msg


def add(rid: str, record_id: str, subject: str = "s99", features=None, label: int = 1) -> dict:
    return {"request_id": rid, "op": "add", "subject_id": subject,
            "payload": {"records": [{"record_id": record_id,
                                     "features": features or [0.1, 0.2, 0.3, 0.4],
                                     "label": label}]}}


def apply_all(ledger: Ledger, version: str = "v2") -> list[str]:
    ids = [r.request_id for r in ledger.lifecycle.claim(100, worker="w1")]
    ledger.lifecycle.mark_applied(ids, version, {"guarantee": "exact"})
    ledger.lifecycle.mark_verified(ids, version)
    return ids


def tamper(ledger: Ledger, sql: str, **params) -> None:
    with ledger.engine.begin() as conn:
        conn.execute(text(sql), params)


def test_receive_records_request_and_event(seeded: Ledger) -> None:
    res = seeded.receive(delete("a", "r001"))
    assert res.status == "accepted" and res.record_ids == ("r001",) and res.http_status == 202
    history = seeded.history("a")
    assert history["request"]["status"] == "received"
    [event] = history["events"]
    assert event["kind"] == "received"
    assert event["payload"]["record_ids"] == ["r001"]
    assert event["payload"]["source"] == {"kind": "http"}


def test_duplicate_request_id_is_ignored_and_counted(seeded: Ledger) -> None:
    assert seeded.receive(delete("a", "r001")).status == "accepted"
    again = seeded.receive(delete("a", "r002"))
    assert again.status == "duplicate" and again.http_status == 200
    seeded.receive(delete("a", "r001"))
    history = seeded.history("a")
    assert history["request"]["duplicate_count"] == 2
    assert history["request"]["record_ids"] == ["r001"]  # the first one wins
    assert [e["kind"] for e in history["events"]] == ["received"]


def test_duplicates_within_one_batch(seeded: Ledger) -> None:
    results = seeded.intake.receive_batch([IncomingMessage(delete("a", "r001")),
                                    IncomingMessage(delete("a", "r001"))])
    assert [r.status for r in results] == ["accepted", "duplicate"]


def test_subject_request_expands_at_receive_time(seeded: Ledger) -> None:
    res = seeded.receive(delete("s", subject="s01"))
    assert res.status == "accepted" and res.record_ids == ("r003", "r004", "r005")
    payload = seeded.history("s")["events"][0]["payload"]
    assert payload["expanded_from_subject"] is True
    assert payload["record_ids"] == ["r003", "r004", "r005"]


@pytest.mark.parametrize(("message", "reason"), [
    (delete("x", "nope"), "unknown record(s): 'nope'"),
    (delete("x", subject="nobody"), "unknown subject 'nobody'"),
    (delete("x", "r001", subject="s05"), "not owned by subject 's05'"),
    (add("x", "r001"), "record(s) already exist: 'r001'"),
    (add("x", "n1", features=[0.1, 0.2]), "must be a list of 4 numbers"),
    (add("x", "n1", label=7), "label 7 is not one of the schema's classes [0, 1, 2]"),
])
def test_rejections_say_why_and_are_logged(seeded: Ledger, message: dict, reason: str) -> None:
    res = seeded.receive(message)
    assert res.status == "rejected" and res.http_status == 422
    assert reason in res.reason
    events = seeded.history("x")["events"]
    assert [e["kind"] for e in events] == ["rejected"]
    assert reason in events[0]["payload"]["reason"]
    assert "message_sha256" in events[0]["payload"]
    # a rejection does not reserve the request_id: a corrected resend is accepted
    assert seeded.receive(delete("x", "r009")).status == "accepted"


def test_lifecycle_purges_deleted_records_and_keeps_their_fingerprint(seeded: Ledger) -> None:
    seeded.receive(delete("d", "r001"))
    seeded.receive(add("n", "new1"))
    before = {r: h for r, h in _hashes(seeded).items() if r == "r001"}
    assert apply_all(seeded, "v2") == ["d", "n"]
    rec = _record(seeded, "r001")
    assert rec.state == "purged" and _payload(seeded, "r001") is None
    assert rec.record_hash == before["r001"] and rec.purged_by == "d"
    assert _record(seeded, "new1").state == "live"
    kinds = [e["kind"] for e in seeded.history("d")["events"]]
    assert kinds == ["received", "claimed", "applied", "verified"]
    applied = seeded.history("d")["events"][2]
    assert applied["model_version"] == "v2"
    assert applied["payload"]["purged_record_hashes"] == before
    assert applied["payload"]["guarantee"] == "exact"
    live = seeded.records.live()
    assert "r001" not in set(live.record_ids) and "new1" in set(live.record_ids)
    assert live.X.shape == (30, 4)
    # the purged record can be neither deleted again nor re-added under its id
    assert "already deleted" in seeded.receive(delete("d2", "r001")).reason
    assert "already exist" in seeded.receive(add("n2", "r001")).reason
    assert seeded.verify().ok


def test_a_batch_purges_each_requests_records_under_its_own_name(seeded: Ledger) -> None:
    """mark_applied purges a batch's deletions together: each request's event still lists
    its own records' fingerprints and each record names the request that purged it, and a
    record added and deleted in the same batch ends purged."""
    for msg in (add("a", "new1"), delete("d1", "r001"), delete("d2", subject="s02"),
                delete("d3", "new1")):
        assert seeded.receive(msg).status == "accepted"
    hashes = _hashes(seeded)
    assert apply_all(seeded) == ["a", "d1", "d2", "d3"]
    owned = {"d1": ["r001"], "d2": ["r006", "r007", "r008"], "d3": ["new1"]}
    for rid, records in owned.items():
        applied = seeded.history(rid)["events"][2]
        assert applied["payload"]["purged_record_hashes"] == {r: hashes[r] for r in records}
        for r in records:
            rec = _record(seeded, r)
            assert (rec.state, rec.purged_by) == ("purged", rid)
            assert _payload(seeded, r) is None
    assert seeded.verify().ok


@pytest.mark.slow
def test_subject_with_everything_deleted_says_so(seeded: Ledger) -> None:
    seeded.receive(delete("s", subject="s02"))
    apply_all(seeded)
    res = seeded.receive(delete("s-again", subject="s02"))
    assert res.status == "rejected" and "no records left" in res.reason


def test_invalid_transitions_are_refused(seeded: Ledger) -> None:
    seeded.receive(delete("d", "r001"))
    with pytest.raises(ValueError, match="only a 'claimed' request"):
        seeded.lifecycle.mark_applied(["d"], "v2")
    with pytest.raises(KeyError):
        seeded.lifecycle.mark_verified(["nope"], "v2")
    [claimed] = seeded.lifecycle.claim(10)
    assert claimed.request_id == "d" and seeded.lifecycle.claim(10, worker="other") == []
    seeded.lifecycle.mark_failed("d", "learner crashed")
    assert seeded.history("d")["request"]["status"] == "failed"
    assert seeded.verify().ok


def test_claims_are_taken_back_after_a_crash_or_a_lease(seeded: Ledger) -> None:
    seeded.receive(delete("d", "r001"))
    assert [r.request_id for r in seeded.lifecycle.claim(10, worker="a")] == ["d"]
    assert seeded.lifecycle.claim(10, worker="b") == []  # a's claim is live
    # a restarted under the same name takes its claim back at once
    assert [r.request_id for r in seeded.lifecycle.claim(10, worker="a")] == ["d"]
    # anyone may take it once the lease has run out
    [r] = seeded.lifecycle.claim(10, worker="b", lease_s=0.0)
    assert r.claimed_by == "b"
    claims = [e for e in seeded.history("d")["events"] if e["kind"] == "claimed"]
    assert [e["payload"].get("reclaimed_from") for e in claims] == [None, "a", "a"]
    assert seeded.verify().ok


def test_verify_names_an_edited_event(seeded: Ledger) -> None:
    for i in range(5):
        seeded.receive(delete(f"q{i}", f"r{i:03d}"))
    assert seeded.verify().ok
    tamper(seeded, "UPDATE events SET payload = :p WHERE seq = 3",
           p=json.dumps({"op": "delete", "record_ids": ["r999"]}))
    result = seeded.verify()
    assert not result.ok and result.first_bad_seq == 3
    assert "event 3" in str(result.problems[0]) and "edited" in str(result.problems[0])


def test_verify_names_a_removed_event_and_a_forged_checkpoint(seeded: Ledger) -> None:
    for i in range(12):  # checkpoint_every=10 -> a checkpoint is written
        seeded.receive(delete(f"q{i}", f"r{i:03d}"))
    cp = seeded.heads.checkpoint()
    assert cp is not None and cp.tree_size == 13
    tamper(seeded, "DELETE FROM events WHERE seq = 7")
    result = seeded.verify()
    assert result.first_bad_seq == 7
    assert any("event 7" in str(p) and "missing" in str(p) for p in result.problems)


def test_verify_names_a_forged_checkpoint_root(seeded: Ledger) -> None:
    for i in range(3):
        seeded.receive(delete(f"q{i}", f"r{i:03d}"))
    cp = seeded.heads.checkpoint()
    tamper(seeded, "UPDATE checkpoints SET root_hash = :r WHERE tree_size = :n",
           r="ab" * 32, n=cp.tree_size)
    problems = [str(p) for p in seeded.verify().problems]
    assert problems == [f"checkpoint {cp.tree_size}: Merkle root does not match the events "
                        "it covers"]


def test_verify_catches_rewritten_tail_through_the_checkpoint(seeded: Ledger) -> None:
    """Re-hashing an edited last event keeps the chain whole; the checkpoint still sees it."""
    seeded.receive(delete("q", "r001"))
    cp = seeded.heads.checkpoint()
    with seeded.engine.connect() as conn:
        e = conn.execute(text("SELECT * FROM events WHERE seq = :n"), {"n": cp.tree_size}).one()
    from ledger.chain import event_hash
    forged_payload = e.payload.replace("r001", "r002")
    forged = event_hash(e.seq, e.request_id, e.kind, forged_payload, e.model_version,
                        e.created_at, e.prev_hash)
    tamper(seeded, "UPDATE events SET payload = :p, hash = :h WHERE seq = :n",
           p=forged_payload, h=forged, n=e.seq)
    # and the subtree hash stored over it when it was appended no longer matches either
    assert [p.where for p in seeded.verify().problems] == [f"checkpoint {cp.tree_size}",
                                                          "stored subtree hashes"]


def test_verify_names_edited_records_and_unpurged_data(seeded: Ledger) -> None:
    tamper(seeded, "UPDATE record_payloads SET label = 2 WHERE record_id = 'r004'")
    seeded.receive(delete("d", "r001"))
    apply_all(seeded)
    tamper(seeded, "INSERT INTO record_payloads (record_id, features, label) "
                   "VALUES ('r001', '[0.1, 0.2, 0.3, 0.4]', 1)")
    problems = {p.where: p.message for p in seeded.verify().problems}
    assert "fingerprint" in problems["record r004"]
    assert "still holds raw" in problems["record r001"]


def test_verify_names_a_request_whose_status_was_edited(seeded: Ledger) -> None:
    seeded.receive(delete("d", "r001"))
    tamper(seeded, "UPDATE requests SET status = 'verified' WHERE request_id = 'd'")
    [problem] = seeded.verify().problems
    assert problem.where == "request d" and "'received'" in problem.message


@pytest.mark.slow
def test_inclusion_proofs_verify_and_fail_when_tampered(seeded: Ledger) -> None:
    for i in range(9):
        seeded.receive(delete(f"q{i}", f"r{i:03d}"))
    history = seeded.history("q4")
    head = history["tree_head"]
    root = bytes.fromhex(head["root_hash"])
    [ev] = history["events"]
    proof = [bytes.fromhex(h) for h in ev["inclusion_proof"]]
    leaf = event_leaf(ev["hash"])
    assert merkle.verify_inclusion(leaf, ev["seq"] - 1, head["tree_size"], proof, root)
    bad = bytearray(proof[0])
    bad[0] ^= 1
    assert not merkle.verify_inclusion(leaf, ev["seq"] - 1, head["tree_size"],
                                       [bytes(bad), *proof[1:]], root)
    other = event_leaf(seeded.history("q5")["events"][0]["hash"])
    assert not merkle.verify_inclusion(other, ev["seq"] - 1, head["tree_size"], proof, root)
    assert not merkle.verify_inclusion(leaf, ev["seq"], head["tree_size"], proof, root)


@pytest.mark.slow
def test_incremental_checkpoints_match_a_full_recomputation(seeded: Ledger) -> None:
    for i in range(27):
        seeded.receive(delete(f"q{i}", f"r{i:03d}"))
    seeded.heads.checkpoint()
    with seeded.engine.connect() as conn:
        hashes = [r[0] for r in conn.execute(text("SELECT hash FROM events ORDER BY seq"))]
        cps = conn.execute(text("SELECT tree_size, root_hash FROM checkpoints")).all()
    assert len(cps) >= 3
    for size, root in cps:
        assert merkle.root([event_leaf(h) for h in hashes[:size]]).hex() == root


def test_export_since_sequence_and_time(seeded: Ledger) -> None:
    for i in range(4):
        seeded.receive(delete(f"q{i}", f"r{i:03d}"))
    events = list(seeded.events.export())
    assert [e["seq"] for e in events] == [1, 2, 3, 4, 5]
    assert [e["seq"] for e in seeded.events.export(since=3)] == [4, 5]
    assert len(list(seeded.events.export(since=events[1]["created_at"]))) >= 4
    assert list(seeded.events.export(since="2999-01-01T00:00:00+00:00")) == []


def test_redelivered_kafka_offsets_have_no_second_effect(seeded: Ledger) -> None:
    batch = [IncomingMessage(json.dumps(delete(f"k{i}", f"r{i:03d}")).encode(), "kafka",
                             "t", 0, i) for i in range(3)]
    batch.append(IncomingMessage(b"garbage", "kafka", "t", 0, 3))
    first = seeded.intake.receive_batch(batch)
    assert [r.status for r in first] == ["accepted"] * 3 + ["rejected"]
    again = seeded.intake.receive_batch(batch)
    assert [r.status for r in again] == ["redelivered"] * 4
    assert len(list(seeded.events.export())) == 1 + 4


def test_failing_dead_letter_hook_records_nothing(seeded: Ledger) -> None:
    def broken(_pairs) -> None:
        raise ConnectionError("dead-letter topic unavailable")

    msgs = [IncomingMessage(b"garbage", "kafka", "t", 0, 0),
            IncomingMessage(json.dumps(delete("ok", "r001")).encode(), "kafka", "t", 0, 1)]
    with pytest.raises(ConnectionError):
        seeded.intake.receive_batch(msgs, before_commit=broken)
    assert len(list(seeded.events.export())) == 1  # only the initial load
    assert [r.status for r in seeded.intake.receive_batch(msgs)] == ["rejected", "accepted"]


@pytest.mark.slow
def test_concurrent_writers_keep_one_chain(db_url: str) -> None:
    ledgers = [Ledger(db_url, HMAC_KEY, checkpoint_every=7) for _ in range(3)]
    seed(ledgers[0], n=60)
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for i in range(20):
                ledgers[k].receive(delete(f"w{k}-{i}", f"r{k * 20 + i:03d}"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    result = ledgers[0].verify()
    assert result.ok and result.events == 61
    for led in ledgers:
        led.close()


def test_load_records_refuses_bad_input(ledger: Ledger) -> None:
    seed(ledger)
    with pytest.raises(ValueError, match="already exist"):
        seed(ledger)
    import numpy as np
    with pytest.raises(ValueError, match="NaN"):
        ledger.records.load(["z"], ["s"], np.array([[np.nan, 0, 0, 0]]), np.array([0]))
    with pytest.raises(ValueError, match="schema"):
        ledger.records.load(["z"], ["s"], np.zeros((1, 3)), np.array([0]))


def _record(ledger: Ledger, record_id: str):
    with ledger.engine.connect() as conn:
        return conn.execute(text("SELECT * FROM training_records WHERE record_id = :r"),
                            {"r": record_id}).one()


def _payload(ledger: Ledger, record_id: str):
    with ledger.engine.connect() as conn:
        return conn.execute(text("SELECT * FROM record_payloads WHERE record_id = :r"),
                            {"r": record_id}).first()


def _hashes(ledger: Ledger) -> dict[str, str]:
    with ledger.engine.connect() as conn:
        return dict(conn.execute(text("SELECT record_id, record_hash FROM training_records")).all())


def test_auditor_recomputes_exported_events_without_the_database(seeded: Ledger) -> None:
    """docs/ledger.md's recipe: an exported event alone re-hashes to its stored hash."""
    from ledger.chain import canonical_json, event_hash

    seeded.receive(add("n", "new1", features=[0.1, 1e-7, 0.3333333333333333, 2.5]))
    seeded.receive(delete("d", subject="s01"))
    for ev in seeded.events.export():
        assert event_hash(ev["seq"], ev["request_id"], ev["kind"], canonical_json(ev["payload"]),
                          ev["model_version"], ev["created_at"], ev["prev_hash"]) == ev["hash"]


def test_a_subjects_requests_are_those_found_by_subject_or_by_record(seeded: Ledger) -> None:
    """The page the index serves is the one every request read and matched in Python gave,
    on both backends, and its pages joined are the whole list at every size."""
    for msg in (delete("d0", "r003", "r004"),  # two of s01's records in one request
                delete("d1", "r003"), delete("d2", subject="s02"),  # s01 owns r003..r005
                delete("d3", "r004", subject="s01"), add("a1", "n1", subject="s01"),
                delete("d4", "r005", "r006"), delete("d5", "r009")):
        assert seeded.receive(msg).status == "accepted", msg
    # a request that names s01's record under another subject id (intake refuses one
    # today; an edited row stands for it): found by the record, and by its own subject
    tamper(seeded, "UPDATE requests SET subject_id = 's07' WHERE request_id = 'd1'")
    tamper(seeded, "UPDATE requests SET subject_id = 's08' WHERE request_id = 'd0'")
    apply_all(seeded)
    pages = seeded.lifecycle.requests_of_subject
    assert [r["request_id"] for r in pages("s01")] == ["d0", "d1", "d3", "a1", "d4"]
    # d0 names two of s01's records: one row, and a page of two is d0 and d1, not d0, d3
    assert [r["request_id"] for r in pages("s01", 2)] == ["d0", "d1"]
    for subject in ("s01", "s02", "s07", "s08", "s99", "nobody"):
        whole = pages(subject)
        assert whole == requests_of_subject_by_scan(seeded, subject), subject
        for limit in (1, 2, 3):
            joined, after = [], 0
            while page := pages(subject, limit, after):
                assert len(page) <= limit
                joined, after = joined + page, page[-1]["received_seq"]
            assert joined == whole, (subject, limit)
    d3 = pages("s01")[2]
    assert d3["subject_id"] == "s01" and d3["record_ids"] == ["r004"] \
        and d3["status"] == "verified" and d3["op"] == "delete"
    assert pages("s01", 10, d3["received_seq"]) == pages("s01")[3:]
    assert [r["request_id"] for r in pages("s07")] == ["d1"]
    assert pages("s01", 0) == []


def test_a_subjects_page_reads_requests_by_index_only(tmp_path: Path) -> None:
    """No timing: SQLite's plan for the page searches each table it reads by an index and
    scans none, so a page does not grow with the ledger."""
    led = Ledger(f"sqlite:///{tmp_path / 'plan.db'}", HMAC_KEY)
    seed(led)
    assert led.receive(delete("d1", "r003")).status == "accepted"
    captured: list[tuple[str, Any]] = []
    event.listen(led.engine, "before_cursor_execute",
                 lambda conn, cursor, sql, params, *_: captured.append((sql, params)))
    assert [r["request_id"] for r in led.lifecycle.requests_of_subject("s01", 5, 0)] == ["d1"]
    sql, params = captured[-1]
    with led.engine.connect() as conn:
        plan = [row[-1] for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params)]
    led.close()
    tables = ("requests", "request_records", "training_records")
    assert all(any(step.startswith(f"SEARCH {t} USING INDEX") for step in plan)
               for t in tables), plan
    assert not [step for step in plan if step.split()[:2] in (["SCAN", t] for t in tables)], plan


def test_a_training_set_digest_matches_one_read_afresh(seeded: Ledger) -> None:
    """A worker's digests read only the records it has not fingerprinted yet: the root
    must be the one a process that read every fingerprint computes."""
    ids = [f"r{i:03d}" for i in range(30)]
    before = seeded.records.digest(ids)
    assert seeded.records.digest(ids[3:]) != before
    assert seeded.records.digest(list(reversed(ids))) == before
    with pytest.raises(KeyError, match="1 record id"):
        seeded.records.digest([*ids, "nobody"])
    fresh = Ledger(seeded.url, HMAC_KEY)
    try:
        assert fresh.records.digest(ids[3:]) == seeded.records.digest(ids[3:])
        assert fresh.records.digest(ids) == before == (30, before[1])
    finally:
        fresh.close()


def test_a_large_set_reads_its_fingerprints_in_one_scan(seeded: Ledger,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from ledger import record_store

    ids = [f"r{i:03d}" for i in range(30)]
    want = seeded.records.digest(ids)
    monkeypatch.setattr(record_store, "_SCAN_OVER", 5)
    fresh = Ledger(seeded.url, HMAC_KEY)
    try:
        assert fresh.records.digest(ids) == want
        with pytest.raises(KeyError, match="2 record id"):
            fresh.records.digest([*ids, "nobody", "nobody either"])
    finally:
        fresh.close()


def test_the_kept_digest_is_the_digest_of_the_set_through_deletions_and_additions() -> None:
    """The worker's digest keeps the last set's sorted leaves and masks the records that
    left: after every step the root is the one sorting the set's fingerprints afresh
    gives, and a fingerprint is fetched once while it stays in the set."""
    from ledger import merkle
    from ledger.training_digest import TrainingSetDigest

    rng = np.random.default_rng(0)
    fingerprint = {f"r{i}": rng.bytes(32) for i in range(400)}
    fetched: list[str] = []

    def fetch(ids: list[str]) -> dict[str, bytes]:
        fetched.extend(ids)
        return {r: fingerprint[r] for r in ids}

    def afresh(ids: list[str]) -> tuple[int, str]:
        fps = sorted(fingerprint[r] for r in set(ids))
        return len(fps), merkle.root([merkle.leaf_hash(f) for f in fps]).hex()

    digest = TrainingSetDigest(fetch)
    live = [f"r{i}" for i in range(300)]
    for step in range(40):
        if step % 7 == 3:  # additions, one named twice
            new = [f"r{i}" for i in range(300 + step, 305 + step)]
            live = [*live, *new, new[0]]
        else:  # deletions, some steps below half of the sorted records
            live = [r for r in live if rng.random() > (0.4 if step % 9 == 8 else 0.05)]
        rng.shuffle(live)
        assert digest(live) == afresh(live), step
    assert len(fetched) == len(set(fetched))
