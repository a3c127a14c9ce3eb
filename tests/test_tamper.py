"""A red team's tampering, each caught: by `ledger verify`, or by `audit check` against a
signed head an auditor saved before the tampering (each test says which). On both
databases. Plus what the catching rests on: signed heads, heads on a timer,
consistency proofs, the auditor's check passing on a ledger nobody touched."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from itertools import combinations_with_replacement

import pytest
from sqlalchemy import delete as sql_delete
from sqlalchemy import insert, select, text, update

from jobs.orchestration.consistency import verify_registry
from jobs.orchestration.registry import POINTER, VERSIONS, Registry
from jobs.orchestration.retention import destroyed_versions
from jobs.orchestration.worker import Worker, WorkerConfig
from ledger import audit, merkle, subtree_store
from ledger.chain import canonical_json, event_hash, event_leaf, iso, utc_now
from ledger.heads import HeadSigner, parse_public_key, verify_head
from ledger.intake import IncomingMessage
from ledger.log_check import schema_sha256
from ledger.models import DatasetSchema
from ledger.store import Ledger
from ledger.tables import (
    CHECKPOINTS,
    EVENTS,
    HEADS,
    MERKLE_NODES,
    OFFSETS,
    PAYLOADS,
    RECORDS,
    REQUESTS,
)
from service.cli import main
from tests.conftest import HMAC_KEY, SIGNING_KEY, seed
from tests.conftest import delete_request as delete

PUBLIC_KEY = HeadSigner(SIGNING_KEY).public_key
ATTACKER_KEY = bytes(range(200, 232))
SMALL_DARE = {"n_estimators": 4, "max_depth": 3, "k": 5}


# ---------------------------------------------------------------------------- helpers


def apply_all(ledger: Ledger, version: str = "v2") -> list[str]:
    ids = [r.request_id for r in ledger.lifecycle.claim(100, worker="w1")]
    ledger.lifecycle.mark_applied(ids, version, {"guarantee": "exact"})
    ledger.lifecycle.mark_verified(ids, version)
    return ids


def tamper(ledger: Ledger, *statements) -> None:
    with ledger.engine.begin() as conn:
        for st in statements:
            conn.execute(text(st) if isinstance(st, str) else st)


def problems(ledger: Ledger) -> list[str]:
    return [str(p) for p in ledger.verify().problems]


def saved_heads(ledger: Ledger) -> dict:
    """What an auditor keeps: `ledger heads` as printed (a JSON round trip)."""
    return json.loads(json.dumps(ledger.heads.published()))


def audit_now(ledger: Ledger, saved: dict) -> audit.AuditResult:
    """`obliviate audit check --heads SAVED` against the database, as the CLI runs it."""
    return audit.audit(saved, ledger.heads.published(), public_key=PUBLIC_KEY,
                       events=ledger.events.export())


def append_forged(ledger: Ledger, kind: str, request_id: str | None, payload: dict,
                  model_version: str | None = None) -> int:
    """An event added behind the ledger's back, chained and hashed correctly."""
    with ledger.engine.begin() as conn:
        tail = conn.execute(select(EVENTS.c.seq, EVENTS.c.hash)
                            .order_by(EVENTS.c.seq.desc()).limit(1)).one()
        seq, body, now = tail.seq + 1, canonical_json(payload), iso(utc_now())
        conn.execute(insert(EVENTS), {
            "seq": seq, "request_id": request_id, "kind": kind, "payload": body,
            "model_version": model_version, "created_at": now, "prev_hash": tail.hash,
            "hash": event_hash(seq, request_id, kind, body, model_version, now, tail.hash)})
    return seq


def rewrite_events(ledger: Ledger, edit, upto: int | None = None) -> None:
    """Edit events and re-hash the chain from there on, then recompute every checkpoint
    (root and frontier) and stored subtree: everything the ledger can recompute without
    the signing key."""
    with ledger.engine.begin() as conn:
        rows = conn.execute(select(EVENTS).order_by(EVENTS.c.seq)).all()
        prev, frontier, roots = "0" * 64, merkle.MerkleFrontier(), {}
        for e in rows:
            payload = edit(e) if upto is None or e.seq <= upto else e.payload
            h = event_hash(e.seq, e.request_id, e.kind, payload, e.model_version,
                           e.created_at, prev)
            conn.execute(update(EVENTS).where(EVENTS.c.seq == e.seq)
                         .values(payload=payload, prev_hash=prev, hash=h))
            prev = h
            frontier.append(event_leaf(h))
            roots[frontier.size] = (frontier.root().hex(),
                                    [x.hex() for x in frontier.state()[1]])
        for size in conn.execute(select(CHECKPOINTS.c.tree_size)).scalars().all():
            root, state = roots[size]
            conn.execute(update(CHECKPOINTS).where(CHECKPOINTS.c.tree_size == size)
                         .values(root_hash=root, frontier=state))
        conn.execute(sql_delete(MERKLE_NODES))  # and the stored subtrees, from event 1
        subtree_store.catch_up(conn, len(rows))


def retold(e) -> str:
    """A rewrite that changes history without upsetting the working tables: where the
    requests came from."""
    return e.payload.replace('"kind":"http"', '"kind":"kafka"')


def some_requests(ledger: Ledger, n: int = 12, applied: bool = True, start: int = 0) -> None:
    for i in range(start, start + n):
        assert ledger.receive(delete(f"q{i}", f"r{i:03d}")).status == "accepted"
    if applied:
        apply_all(ledger)


# ---------------------------------------------------------------------------- ledger verify
@pytest.mark.slow
def test_untampered_ledger_verifies_with_signed_heads(signed: Ledger) -> None:
    some_requests(signed)
    result = signed.verify()
    assert result.ok, result.problems
    assert result.heads >= 3 and result.events == 1 + 12 * 4


@pytest.mark.slow
def test_restored_features_of_a_purged_record_are_caught_by_verify(signed: Ledger) -> None:
    X, y = signed.records.data(["r001"])
    some_requests(signed, 2)
    assert signed.verify().ok
    # the insider puts the deleted record back, with its true features: fingerprint matches
    tamper(signed, update(RECORDS).where(RECORDS.c.record_id == "r001")
           .values(state="live", purged_at=None, purged_by=None),
           insert(PAYLOADS).values(record_id="r001", features=X[0].tobytes(), label=int(y[0])))
    assert "r001" in set(signed.records.live().record_ids)
    found = problems(signed)
    assert any(p.startswith("record r001: is live, but the deletion q1 purged it")
               for p in found), found


def test_a_fake_purge_is_caught_by_verify(signed: Ledger) -> None:
    some_requests(signed, 2)
    tamper(signed, "UPDATE training_records SET state = 'purged', purged_by = 'q0' "
                   "WHERE record_id = 'r020'",
           "DELETE FROM record_payloads WHERE record_id = 'r020'")
    found = problems(signed)
    assert found == ["record r020: is purged, but no applied deletion lists it (a purge the "
                     "log does not show)"]


def test_a_swapped_fingerprint_of_a_purged_record_is_caught_by_verify(signed: Ledger) -> None:
    some_requests(signed, 2)
    tamper(signed, "UPDATE training_records SET record_hash = :h WHERE record_id = 'r000'"
           .replace(":h", "'" + "ab" * 32 + "'"))
    found = problems(signed)
    assert any(p.startswith("record r000: its fingerprint is not the one the deletion q0 "
                            "lists") for p in found), found


def test_a_deleted_request_row_is_caught_by_verify(signed: Ledger) -> None:
    some_requests(signed, 3)
    tamper(signed, "DELETE FROM requests WHERE request_id = 'q1'")
    found = problems(signed)
    assert any(p.startswith("request q1: has lifecycle events") and "no request row" in p
               for p in found), found


def test_an_edited_request_index_is_caught_by_verify(signed: Ledger) -> None:
    """request_records serves a subject's requests page: a row taken out would hide a
    request from it, a row put in would show one that names none of its records."""
    some_requests(signed, 3)
    tamper(signed, "DELETE FROM request_records WHERE request_id = 'q1'")
    tamper(signed, "UPDATE request_records SET record_id = 'r009' WHERE request_id = 'q2'")
    found = problems(signed)
    assert any(p.startswith("request q1: names record r001 but request_records does not")
               for p in found), found
    assert any(p.startswith("request q2: request_records lists record r009") for p in found)
    assert any(p.startswith("request q2: names record r002") for p in found), found
    assert not any(p.startswith("request q0") for p in found), found


def test_forged_events_appended_with_valid_hashes_are_caught_by_verify(signed: Ledger) -> None:
    some_requests(signed, 3, applied=False)
    assert signed.verify().ok
    # a request that skips its lifecycle, its row edited to match
    seq = append_forged(signed, "verified", "q0", {}, "v9")
    tamper(signed, "UPDATE requests SET status = 'verified' WHERE request_id = 'q0'")
    found = problems(signed)
    assert found[0] == (f"event {seq}: 'verified' of request q0 cannot follow 'received' "
                        "(forged, or events removed)"), found
    assert signed.verify().first_bad_seq == seq
    # a request nobody sent
    append_forged(signed, "received", "ghost", {"op": "delete", "record_ids": ["r005"]})
    assert any(p.startswith("request ghost: has lifecycle events") for p in problems(signed))


@pytest.mark.slow
def test_a_forged_publication_is_caught_by_verify(signed: Ledger) -> None:
    led, reg, _ = _published(signed)
    seq = append_forged(led, "model_trained", None, {"change": {"op": "train"}}, "v000099")
    found = [str(p) for p in verify_registry(led, reg)]
    assert f"model version v000099: event {seq} (model_trained) announces it, but no model " \
           "version row exists (forged event, or row deleted)" in found


@pytest.mark.slow
def test_rewriting_everything_and_recomputing_checkpoints_is_caught(signed: Ledger) -> None:
    """Caught by `ledger verify` (the signed heads) and by `audit check`."""
    some_requests(signed)
    saved = saved_heads(signed)
    rewrite_events(signed, retold)
    found = problems(signed)
    assert found and all(p.startswith("signed head ") and "rewritten" in p for p in found)
    assert not audit_now(signed, saved).ok
    # the heads re-signed with a key of the insider's own: the signatures give it away
    attacker = HeadSigner(ATTACKER_KEY)
    with signed.engine.begin() as conn:
        for row in conn.execute(select(HEADS)).all():
            root = merkle.root([event_leaf(h) for h in conn.execute(
                select(EVENTS.c.hash).where(EVENTS.c.seq <= row.tree_size)
                .order_by(EVENTS.c.seq)).scalars()]).hex()
            forged = attacker.sign(row.tree_size, root, row.timestamp)
            conn.execute(update(HEADS).where(HEADS.c.tree_size == row.tree_size)
                         .values(**forged))
    found = problems(signed)
    assert sum("not the log of this public key" in p for p in found) == len(saved["heads"])
    result = audit_now(signed, saved)
    assert result.problems == ["the log publishes no signed head"]


def test_a_rewritten_log_signed_afresh_is_caught_by_audit_check(signed: Ledger) -> None:
    """The insider drops the heads and rewrites the log; the ledger's own process then
    signs the rewritten log. Nothing in the database disagrees any more: only a head
    saved before can tell."""
    some_requests(signed)
    saved = saved_heads(signed)
    tamper(signed, sql_delete(HEADS))
    rewrite_events(signed, retold)
    assert signed.heads.sign() is not None
    assert signed.verify().ok
    result = audit_now(signed, saved)
    assert not result.ok
    assert any("not consistent with the newest head" in p or "do not rebuild its root" in p
               for p in result.problems), result.problems


@pytest.mark.slow
def test_rewriting_the_tail_after_the_last_checkpoint_is_caught(signed: Ledger) -> None:
    """With the head over it left in place, `ledger verify` sees it; with that head
    dropped too, `audit check` against the saved head does."""
    some_requests(signed, applied=False)
    head = signed.heads.sign()
    saved = saved_heads(signed)
    last_cp = max(s for s in _sizes(signed, CHECKPOINTS) if s < head["tree_size"])
    rewrite_events(signed, lambda e: retold(e) if e.seq > last_cp else e.payload)
    assert any(p.startswith(f"signed head {head['tree_size']}: Merkle root does not match")
               for p in problems(signed))
    tamper(signed, sql_delete(HEADS).where(HEADS.c.tree_size > last_cp),
           sql_delete(CHECKPOINTS).where(CHECKPOINTS.c.tree_size > last_cp))
    result = signed.verify()
    assert result.ok  # nothing in the database can check an unsigned tail ...
    assert any("nothing can check an unsigned tail" in n for n in result.notes)
    checked = audit_now(signed, saved)  # ... the auditor's saved head can
    assert any(p.startswith(f"saved head {head['tree_size']}:") for p in checked.problems)


@pytest.mark.slow
def test_truncating_the_tail_is_caught_by_audit_check(signed: Ledger) -> None:
    some_requests(signed, applied=False)
    head = signed.heads.sign()
    saved = saved_heads(signed)
    keep = head["tree_size"] - 2
    tamper(signed, sql_delete(EVENTS).where(EVENTS.c.seq > keep),
           sql_delete(HEADS).where(HEADS.c.tree_size > keep),
           sql_delete(CHECKPOINTS).where(CHECKPOINTS.c.tree_size > keep))
    result = audit_now(signed, saved)
    assert any(p.startswith(f"saved head {head['tree_size']}:") and "covers" in p
               for p in result.problems), result.problems


@pytest.mark.slow
def test_dropping_all_checkpoints_and_heads_is_caught(db_url: str) -> None:
    """By `ledger verify` (a log older than the head interval has heads) and by
    `audit check`."""
    led = Ledger(db_url, HMAC_KEY, checkpoint_every=1000, signing_key=SIGNING_KEY,
                 head_interval_s=0.5)
    seed(led)
    some_requests(led, 3, applied=False)
    time.sleep(0.6)
    some_requests(led, 3, start=3)  # the first of these appends takes a head: events are old
    assert led.verify().ok and led.heads.published()["heads"]
    saved = saved_heads(led)
    tamper(led, sql_delete(HEADS), sql_delete(CHECKPOINTS))
    [found] = problems(led)
    n = led.events.last_seq()
    assert found.startswith(f"events 1..{n}: no signed head covers these {n} events over ")
    assert found.endswith("though one is taken once events are 0.5 s old: heads dropped, or "
                          "written by something that takes none")
    assert audit_now(led, saved).problems == ["the log publishes no signed head"]
    led.close()


def test_the_signer_never_vouches_for_a_rewritten_log(signed: Ledger, caplog) -> None:
    some_requests(signed, applied=False)
    head = signed.heads.sign()
    # an edited checkpoint frontier is only a cache: the head's root is rebuilt from events
    tamper(signed, update(CHECKPOINTS).values(frontier=["00" * 32]))
    signed.receive(delete("x1", "r020"))
    assert signed.heads.sign()["tree_size"] == head["tree_size"] + 1
    # events below the latest head rewritten: the next head is refused, not signed
    rewrite_events(signed, retold)
    signed.receive(delete("x2", "r021"))
    assert signed.heads.sign() is None
    assert "no longer give the root of the signed head" in caplog.text
    assert [h["tree_size"] for h in signed.heads.published()["heads"]][-1] == \
        head["tree_size"] + 1


# ---------------------------------------------------------------------------- stored subtrees
def test_an_edited_stored_subtree_is_caught_by_verify(signed: Ledger) -> None:
    some_requests(signed, applied=False)
    assert signed.verify().ok
    tamper(signed, update(MERKLE_NODES).where(MERKLE_NODES.c.position ==
                                              subtree_store.position(2, 1))
           .values(hash=b"\x11" * 32))
    assert problems(signed) == [
        "stored subtree hashes: 1 do not match the events they cover (edited behind the "
        "ledger's back): proofs served from them fail against the signed roots; the first "
        "is the one over events 5..8"]
    tamper(signed, sql_delete(MERKLE_NODES).where(MERKLE_NODES.c.position == 0))
    assert problems(signed)[1].startswith("stored subtree hashes: 1 are missing (events "
                                          "appended behind the ledger's back?)")


# ---------------------------------------------------------------------------- incremental
def test_verify_since_a_verified_head_checks_the_log_after_it(signed: Ledger) -> None:
    some_requests(signed, applied=False)
    first = signed.verify()
    assert first.ok and first.verified_head.items() <= \
        signed.heads.published()["heads"][-1].items()
    some_requests(signed, 6, start=20, applied=False)
    signed.heads.sign()
    result = signed.verifier.verify_since(first.verified_head)
    assert result.ok, result.problems
    assert result.since == first.verified_head["tree_size"]
    assert result.verified_head.items() <= signed.heads.published()["heads"][-1].items()
    assert result.verified_head["tree_size"] == result.events > result.since


def test_incremental_verify_catches_tampering_after_the_verified_head(signed: Ledger) -> None:
    some_requests(signed, applied=False)
    verified = signed.verify().verified_head
    some_requests(signed, 6, start=20, applied=False)
    signed.heads.sign()
    later = verified["tree_size"] + 2
    tamper(signed, update(EVENTS).where(EVENTS.c.seq == later).values(
        payload=EVENTS.c.payload + " "))
    found = [str(p) for p in signed.verifier.verify_since(verified).problems]
    assert found == [f"event {later}: content does not match its hash (edited behind the "
                     "ledger's back)"]
    # rewritten and re-hashed from there on, subtrees and checkpoints too: the heads
    # signed after the verified one no longer match
    rewrite_events(signed, lambda e: retold(e) if e.seq > verified["tree_size"] else e.payload)
    found = [str(p) for p in signed.verifier.verify_since(verified).problems]
    assert found and all(p.startswith("signed head ") for p in found), found
    assert any("is not consistent with the verified head" in p for p in found), found


def test_incremental_verify_catches_a_rewrite_before_the_verified_head(signed: Ledger) -> None:
    """The insider rewrites history before the verified head, recomputes every checkpoint
    and stored subtree, drops the heads and has the ledger sign the rewritten log afresh:
    a full verify finds nothing wrong, the head kept outside the database does."""
    some_requests(signed, applied=False)
    verified = signed.verify().verified_head
    size = verified["tree_size"]
    tamper(signed, sql_delete(HEADS))
    rewrite_events(signed, retold)
    assert signed.heads.sign() is not None and signed.verify().ok
    assert [str(p) for p in signed.verifier.verify_since(verified).problems] == [
        f"verified head {size}: events 1..{size} no longer give the root it signed (their "
        "stored subtree hashes, or the chain, were rewritten since it was verified): run a "
        "full `ledger verify`"]


def test_what_incremental_verify_does_not_read(signed: Ledger) -> None:
    """An event before the verified head edited without re-hashing keeps every hash and
    root: only the full verify (and anyone who checks that event's proof) sees it; the
    same goes for the working tables."""
    some_requests(signed, applied=False)
    verified = signed.verify().verified_head
    tamper(signed, update(EVENTS).where(EVENTS.c.seq == 3).values(
        payload=EVENTS.c.payload + " "),
           update(REQUESTS).where(REQUESTS.c.request_id == "q1").values(status="verified"))
    result = signed.verifier.verify_since(verified)
    assert result.ok and any("the tables by a full `ledger verify`" in n for n in result.notes)
    assert {"event 3: content does not match its hash (edited behind the ledger's back)",
            "request q1: status 'verified' disagrees with its last event 'received'"} <= \
        set(problems(signed))


def test_cli_verify_keeps_the_verified_head_for_since_verified(cli_env: str, tmp_path,
                                                               capsys) -> None:
    kept = tmp_path / "state" / "verified.json"
    assert run(capsys, "ledger", "init", "--dataset", "iris")[0] == 0
    for i in range(7):
        run(capsys, "submit", json.dumps(delete(f"q{i}", f"r{i:03d}")))
    code, _, err = run(capsys, "ledger", "verify", "--since-verified", "--verified-head",
                       str(kept))
    assert code == 0 and f"note: no verified head in {kept} yet: verifying everything" in err
    head = json.loads(kept.read_text())["head"]
    assert kept.stat().st_mode & 0o777 == 0o600
    for i in range(7, 14):
        run(capsys, "submit", json.dumps(delete(f"q{i}", f"r{i:03d}")))
    run(capsys, "ledger", "checkpoint")
    code, out, err = run(capsys, "ledger", "verify", "--since-verified", "--verified-head",
                         str(kept))
    assert code == 0, err
    assert out.startswith(f"ledger OK: events {head['tree_size'] + 1}..")
    assert f"since the head over {head['tree_size']}" in out
    assert json.loads(kept.read_text())["head"]["tree_size"] > head["tree_size"]
    kept.write_text("{}")
    code, _, err = run(capsys, "ledger", "verify", "--since-verified", "--verified-head",
                       str(kept))
    assert code == 1 and err.strip() == (
        f"obliviate: error: {kept}: not a verified head (format obliviate-verified-head/v1 "
        "with a signed head over at least one event expected)")


# ---------------------------------------------------------------------------- what a query means
SCHEMA = DatasetSchema.__table__


def _edit_transform(schema) -> dict:
    doc = json.loads(json.dumps(schema.transform))
    doc["features"][0]["max"] = doc["features"][0]["max"] * 10  # rescales every query
    return {"transform": doc}


@pytest.mark.parametrize("edit", [
    _edit_transform,
    lambda schema: {"classes": [*schema.classes, 7]},
    lambda schema: {"n_features": schema.n_features + 1},
], ids=["transform", "classes", "n_features"])
def test_an_edited_schema_is_caught_by_verify(signed: Ledger, edit) -> None:
    with signed.engine.connect() as conn:
        schema = conn.execute(select(SCHEMA)).one()
    assert signed.verify().ok
    tamper(signed, update(SCHEMA).values(**edit(schema)))
    found = problems(signed)
    assert found == ["dataset_schema: the input transform, classes or width is not what "
                     "event 1 (records_loaded) committed to: edited, which changes what every "
                     "query and addition means"], found


def _rename_category(doc: dict) -> None:
    column = next(c for c in doc["columns"] if c["kind"] == "categorical")
    column["categories"][0] += "x"  # its rows' queries would count as 'other'


def _swap_labels(doc: dict) -> None:
    doc["labels"].reverse()  # every answer's label name flips


def _move_imputed(doc: dict) -> None:
    next(c for c in doc["columns"] if "impute" in c)["impute"] += 1.0


@pytest.mark.parametrize("edit", [_rename_category, _swap_labels, _move_imputed],
                         ids=["category", "label-names", "imputed-value"])
def test_an_edited_encoding_is_caught_by_verify(db_url: str, tmp_path, edit) -> None:
    """Issue 28: the encoding of a table with text (categories, label names, imputed
    values) is part of the schema the proof covers."""
    from ledger.census import census_export
    from ledger.datasets import TableOptions, load_csv
    from tests.exported_tables import write_csv

    path = write_csv(tmp_path / "adult.csv", census_export(60, numeric_missing=0.05))
    ds = load_csv(path, "income", "person", "record_id",
                  options=TableOptions(na="?", impute="median"))
    led = Ledger(db_url, HMAC_KEY)
    try:
        led.records.load(ds.record_ids, ds.subject_ids, ds.X, ds.y, ds.name, ds.transform)
        assert led.verify().ok
        with led.engine.connect() as conn:
            doc = json.loads(json.dumps(conn.execute(select(SCHEMA)).one().transform))
        edit(doc)
        tamper(led, update(SCHEMA).values(transform=doc))
        assert problems(led) == [
            "dataset_schema: the input transform, classes or width is not what event 1 "
            "(records_loaded) committed to: edited, which changes what every query and "
            "addition means"]
    finally:
        led.close()


def test_an_edited_schema_with_its_event_rewritten_is_caught_by_audit_check(
        signed: Ledger) -> None:
    """The insider edits the schema and the digest in its `records_loaded` event, and
    re-hashes the chain: the signed heads (verify) and a saved head (audit check) see it."""
    some_requests(signed, 3)
    saved = saved_heads(signed)
    with signed.engine.connect() as conn:
        schema = conn.execute(select(SCHEMA)).one()
    classes = [*schema.classes, 7]
    new = schema_sha256(schema.n_features, classes, schema.transform)
    tamper(signed, update(SCHEMA).values(classes=classes))
    rewrite_events(signed, lambda e: e.payload if e.kind != "records_loaded" else canonical_json(
        {**json.loads(e.payload), "schema_sha256": new}))
    found = problems(signed)
    assert found and all(p.startswith("signed head ") for p in found), found
    assert any("do not rebuild its root" in p or "not consistent" in p
               for p in audit_now(signed, saved).problems)


def kafka(ledger: Ledger, topic: str, *values: tuple[int, dict | bytes]) -> None:
    """Messages as the consumer records them: (offset, value) on partition 0 of `topic`."""
    ledger.intake.receive_batch([IncomingMessage(json.dumps(v).encode() if isinstance(v, dict)
                                          else v, "kafka", topic, 0, offset)
                          for offset, v in values])


@pytest.mark.parametrize("edit,message", [
    ({"next_offset": 9}, "messages would be skipped"),
    ({"next_offset": 1}, "messages would be taken again"),
    (None, "source_offsets has no row for it (deleted)"),
], ids=["raised", "lowered", "deleted"])
def test_an_edited_kafka_offset_is_caught_by_verify(signed: Ledger, edit, message) -> None:
    kafka(signed, "reqs", (0, delete("k0", "r000")), (1, b"not json"),
          (2, delete("k1", "r001")), (3, delete("k1", "r001")))  # a duplicate last
    assert signed.verify().ok, signed.verify().problems
    where = (OFFSETS.c.topic == "reqs") & (OFFSETS.c.partition == 0)
    tamper(signed, update(OFFSETS).where(where).values(**edit) if edit
           else sql_delete(OFFSETS).where(where))
    found = problems(signed)
    assert len(found) == 1 and found[0].startswith("source offset reqs/0: ") and \
        message in found[0], found
    # a row for a partition no event records
    tamper(signed, insert(OFFSETS).values(topic="reqs", partition=5, next_offset=40))
    assert any(p.startswith("source offset reqs/5: says the next offset is 40, but no event "
                            "records a message of that partition") for p in problems(signed))


def test_a_restarted_kafka_log_is_taken_and_its_offsets_still_checked(signed: Ledger) -> None:
    """A broker that lost its log numbers from 0 again: after `restart_source` the new
    log's messages are accepted, not skipped as redeliveries, and verify follows the
    `source_reset` event, still catching an edited offset."""
    kafka(signed, "reqs", (0, delete("k0", "r000")), (1, delete("k1", "r001")))
    assert signed.intake.restart_source("reqs", 0, 0, "log ends at offset 0") is not None
    assert signed.intake.restart_source("reqs", 0, 0, "again") is None  # nothing above 0
    assert signed.verify().ok, signed.verify().problems
    kafka(signed, "reqs", (0, delete("k2", "r002")), (1, delete("k1", "r001")))
    kinds = [e["kind"] for e in signed.events.export()][-3:]
    assert kinds == ["source_reset", "received", "duplicate"], kinds
    assert signed.intake.next_offsets("reqs") == {0: 2}
    assert signed.verify().ok, signed.verify().problems
    tamper(signed, update(OFFSETS).values(next_offset=5))
    assert any("messages would be skipped" in p for p in problems(signed))


# ---------------------------------------------------------------------------- the registry
def _published(ledger: Ledger) -> tuple[Ledger, Registry, list[str]]:
    """A worker's real history: train v1, a deletion (v2), an addition (v3), both verified
    on v3; v1 destroyed."""
    reg = Registry(ledger.engine, name=f"t{uuid.uuid4().hex[:8]}")
    w = Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                         guard_after_idle_s=3600.0, destroy_grace_s=0.0))
    w.bootstrap("dare", SMALL_DARE)
    assert ledger.receive(delete("d1", "r004")).status == "accepted"
    assert w.step()
    assert ledger.receive({"request_id": "a1", "op": "add", "subject_id": "snew", "payload": {
        "records": [{"record_id": "n1", "features": [0.1, 0.2, 0.3, 0.4], "label": 1}]}}
                          ).status == "accepted"
    assert w.step()
    # a pause: the check runs (the guard pass schedules it, by its own settings)
    w.guard.config = replace(w.guard.config, guard_after_idle_s=0.0)
    end = time.monotonic() + 60
    while time.monotonic() < end and (w.step() or w.busy or not destroyed_versions(reg)
                                      or ledger.lifecycle.requests_with_status("applied")):
        time.sleep(0.01)
    versions = [v.version for v in reversed(reg.lineage())]
    assert len(versions) == 3 and reg.current().version == versions[2]
    assert [v for v, _ in destroyed_versions(reg)] == versions[:1]
    assert verify_registry(ledger, reg) == [] and ledger.verify().ok, \
        (verify_registry(ledger, reg), ledger.verify().problems)
    return ledger, reg, versions


@pytest.mark.slow
def test_an_edited_model_pointer_is_caught_by_verify(signed: Ledger) -> None:
    led, reg, (v1, v2, v3) = _published(signed)
    tamper(led, update(POINTER).where(POINTER.c.name == reg.name)
           .values(version=v1, seq=reg.get(v1).seq))
    found = [str(p) for p in verify_registry(led, reg)]
    assert f"model pointer {reg.name}: names {v1}, but the latest publication" in found[0]
    assert any(f"names {v1}, which was destroyed" in p for p in found)
    # an earlier version that was never destroyed: only the events know it is not current
    tamper(led, update(POINTER).where(POINTER.c.name == reg.name)
           .values(version=v2, seq=reg.get(v2).seq))
    found = [str(p) for p in verify_registry(led, reg)]
    assert found[0].startswith(f"model pointer {reg.name}: names {v2}, but the latest "
                               f"publication") and found[0].endswith(f"is {v3} (pointer edited)")
    # a version row inserted behind the ledger's back, and pointed at
    row = reg.get(v3).model_dump()
    row.update(version="v000042", seq=42, manifest={**row["manifest"], "version_seq": 42})
    tamper(led, insert(VERSIONS).values(**row),
           update(POINTER).where(POINTER.c.name == reg.name).values(version="v000042", seq=42))
    found = [str(p) for p in verify_registry(led, reg)]
    assert f"model pointer {reg.name}: names v000042, which no event announces " \
           "(pointer edited)" in found
    assert "model version v000042: no event announces its publication (row inserted " \
           "behind the ledger's back)" in found


@pytest.mark.slow
def test_an_edited_manifest_is_caught_by_verify(signed: Ledger) -> None:
    led, reg, (v1, v2, v3) = _published(signed)
    # the served version's: its copy beside the files disagrees
    man = reg.get(v3).manifest
    tamper(led, update(VERSIONS).where(VERSIONS.c.name == reg.name, VERSIONS.c.version == v3)
           .values(manifest={**man, "training_set": {"count": 1, "merkle_root": "00" * 32}}))
    found = [str(p) for p in verify_registry(led, reg)]
    [applied] = [e["seq"] for e in led.events.export()
                 if e["kind"] == "applied" and e["request_id"] == "a1"]
    assert sorted(found) == sorted([
        f"model version {v3}: the manifest in the database is not the one saved beside its "
        "files (manifest.json in the model store): edited",
        f"model version {v3}: the manifest's manifest_sha256 is not what event {applied} "
        "(applied) says (manifest edited)"])  # its publication event carries its digest
    # the update's: its `applied` event says which guarantee it gave
    man = reg.get(v2).manifest
    tamper(led, update(VERSIONS).where(VERSIONS.c.name == reg.name, VERSIONS.c.version == v2)
           .values(manifest={**man, "guarantee": "certified"}))
    found = [str(p) for p in verify_registry(led, reg)]
    assert any(p.startswith(f"model version {v2}: the manifest's guarantee, manifest_sha256 "
                            "is not what event") for p in found), found
    # a destroyed version's (no files left): its `destroyed` event has the digest
    man = reg.get(v1).manifest
    tamper(led, update(VERSIONS).where(VERSIONS.c.name == reg.name, VERSIONS.c.version == v1)
           .values(manifest={**man, "seed": 7}))
    found = [str(p) for p in verify_registry(led, reg)]
    assert any(p.startswith(f"model version {v1}: its manifest's digest is not the one event")
               for p in found), found


@pytest.mark.slow
def test_a_destroyed_version_brought_back_is_caught_by_verify(signed: Ledger) -> None:
    led, reg, (v1, _, _) = _published(signed)
    tamper(led, update(VERSIONS).where(VERSIONS.c.name == reg.name, VERSIONS.c.version == v1)
           .values(destroyed_at=None))
    reg.keys.put(reg.key_name(v1), bytes(32))
    found = [str(p) for p in verify_registry(led, reg)]
    assert any("destroyed_at cleared" in p for p in found)
    assert any("the key store holds a key for it again" in p for p in found)


@pytest.mark.slow
def test_a_deleted_key_of_a_kept_version_is_caught_by_verify(signed: Ledger) -> None:
    """Deleting the current version's sealing key stops every process from loading it
    (a denial of service): the check reads the key store."""
    led, reg, (_, _, v3) = _published(signed)
    assert reg.has_key(v3)
    reg.keys.delete(reg.key_name(v3))
    assert not reg.has_key(v3)
    found = [str(p) for p in verify_registry(led, reg)]
    assert found == [f"model version {v3}: is not destroyed, but its sealing key is gone: "
                     "no process can load it (key deleted)"], found


# ---------------------------------------------------------------------------- heads
@pytest.mark.slow
def test_heads_are_taken_on_a_timer_without_intake(db_url: str) -> None:
    led = Ledger(db_url, HMAC_KEY, checkpoint_every=1000, signing_key=SIGNING_KEY,
                 head_interval_s=0.3)
    seed(led)  # one event, no head yet: not due
    assert led.heads.maybe_sign() is None and led.heads.published()["heads"] == []
    time.sleep(0.35)
    head = led.heads.maybe_sign()  # what the worker's, consumer's, service's loop calls
    assert head is not None and head["tree_size"] == 1
    assert verify_head(head, PUBLIC_KEY) is None
    assert led.heads.maybe_sign() is None  # nothing new: cheap, no head
    # an append once the oldest uncovered event is older than the interval takes a head
    led.events.append("note", {"n": 1})
    time.sleep(0.35)
    led.events.append("note", {"n": 2})
    assert [h["tree_size"] for h in led.heads.published()["heads"]] == [1, 3]
    assert led.verify().ok
    led.close()


def test_consistency_proofs_between_every_pair_of_heads_verify(db_url: str) -> None:
    from starlette.testclient import TestClient

    from service.http_api import AppContext, build_app

    led = Ledger(db_url, HMAC_KEY, checkpoint_every=5, signing_key=SIGNING_KEY)
    seed(led)
    some_requests(led, 6)
    heads = led.heads.published()["heads"]
    assert len(heads) >= 4
    client = TestClient(build_app(AppContext(ledger=led)))
    assert client.get("/v1/ledger/heads").json() == json.loads(json.dumps(
        led.heads.published()))
    for a, b in combinations_with_replacement(heads, 2):
        proof = [bytes.fromhex(p) for p in led.events.consistency(a["tree_size"], b["tree_size"])
                 ["proof"]]
        assert merkle.verify_consistency(a["tree_size"], b["tree_size"],
                                         bytes.fromhex(a["root_hash"]),
                                         bytes.fromhex(b["root_hash"]), proof)
        served = client.get("/v1/ledger/consistency",
                            params={"old": a["tree_size"], "new": b["tree_size"]}).json()
        assert served["proof"] == [p.hex() for p in proof]
        if a["tree_size"] < b["tree_size"]:  # not a proof for another root
            assert not merkle.verify_consistency(a["tree_size"], b["tree_size"],
                                                 bytes.fromhex(b["root_hash"]),
                                                 bytes.fromhex(b["root_hash"]), proof)
    assert client.get("/v1/ledger/consistency", params={"old": 5}).status_code == 400
    assert client.get("/v1/ledger/consistency", params={"old": 9, "new": 5}).status_code == 422
    led.close()


# ---------------------------------------------------------------------------- the CLI
@pytest.fixture
def cli_env(db_url: str, tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("OBLIVIATE_DATABASE_URL", db_url)
    monkeypatch.setenv("OBLIVIATE_HMAC_KEY_FILE", str(tmp_path / "hmac.key"))
    monkeypatch.setenv("OBLIVIATE_LEDGER_SIGNING_KEY_FILE", str(tmp_path / "signing.key"))
    monkeypatch.setenv("OBLIVIATE_CHECKPOINT_EVERY", "5")
    monkeypatch.setenv("OBLIVIATE_MODEL_NAME", f"cli{uuid.uuid4().hex[:8]}")
    return db_url


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_cli_heads_key_consistency_and_audit(cli_env: str, tmp_path, capsys) -> None:
    assert run(capsys, "ledger", "init", "--dataset", "iris")[0] == 0
    for i in range(12):
        run(capsys, "submit", json.dumps(delete(f"q{i}", f"r{i:03d}")))
    code, out, _ = run(capsys, "ledger", "key")
    public = parse_public_key(out)
    assert code == 0 and len(public) == 32
    assert parse_public_key(run(capsys, "ledger", "key", "--pem")[1]) == public
    assert (tmp_path / "signing.key").stat().st_mode & 0o777 == 0o600
    code, out, _ = run(capsys, "ledger", "heads")
    doc = json.loads(out)
    assert doc["public_key"] == public.hex() and len(doc["heads"]) == 2  # at 6 and 11 events
    assert all(verify_head(h, public) is None for h in doc["heads"])
    saved = tmp_path / "saved.json"
    saved.write_text(out)
    old, new = (h["tree_size"] for h in doc["heads"])
    code, out, _ = run(capsys, "ledger", "consistency", str(old), str(new))
    proof = json.loads(out)
    assert code == 0 and merkle.verify_consistency(
        old, new, bytes.fromhex(doc["heads"][0]["root_hash"]),
        bytes.fromhex(doc["heads"][1]["root_hash"]), [bytes.fromhex(p) for p in proof["proof"]])
    assert run(capsys, "ledger", "consistency", str(new), str(old))[0] == 1

    # the log grows; the auditor checks it against what was saved, from the database ...
    run(capsys, "submit", json.dumps(delete("late", "r040")))
    code, out, err = run(capsys, "ledger", "checkpoint")
    assert code == 0 and "signed=" in out
    code, out, err = run(capsys, "audit", "check", "--heads", str(saved),
                         "--public-key", public.hex())
    assert code == 0 and "audit OK" in out, err
    # ... and from files alone (stdlib + cryptography + ledger/{chain,merkle,heads,audit}.py)
    events, current = tmp_path / "events.jsonl", tmp_path / "now.json"
    events.write_text(run(capsys, "ledger", "export")[1])
    current.write_text(run(capsys, "ledger", "heads")[1])
    files = ["--heads", str(saved), "--current", str(current), "--events", str(events)]
    assert run(capsys, "audit", "check", *files)[0] == 0
    assert audit.main(files) == 0
    code, out, err = run(capsys, "ledger", "verify")
    assert code == 0 and "signed heads" in out, err

    # the insider truncates the log and drops the heads over what went
    insider = Ledger(cli_env, bytes(16))
    tamper(insider, sql_delete(EVENTS).where(EVENTS.c.seq > old),
           sql_delete(HEADS).where(HEADS.c.tree_size > old),
           sql_delete(CHECKPOINTS).where(CHECKPOINTS.c.tree_size > old),
           sql_delete(REQUESTS).where(REQUESTS.c.received_seq > old))
    insider.close()
    code, _, err = run(capsys, "audit", "check", "--heads", str(saved))
    assert code == 1 and f"first: saved head {new}: covers {new} events" in err, err


def _sizes(ledger: Ledger, table) -> list[int]:
    with ledger.engine.connect() as conn:
        return sorted(conn.execute(select(table.c.tree_size)).scalars())


def test_a_manifest_with_shard_keys_past_9_is_vouched_for_as_stored(tmp_path) -> None:  # noqa: ANN001
    """SISA's `from_slice` is keyed by shard number; the model_versions JSON column hands
    the keys back as text, which sort "10" before "2". The digest the publication event
    carries must be that of the manifest as stored, or a version of 11+ shards whose
    pass retrained shards on both sides of 10 is refused as edited (seen with 20
    shards in bench_scale's e2e stage)."""
    from sqlalchemy import create_engine

    from jobs.orchestration.registry import manifest_sha256

    engine = create_engine(f"sqlite:///{tmp_path / 'v.db'}")
    VERSIONS.metadata.create_all(engine, tables=[VERSIONS])
    man = {"change": {"updates": [{"retrained": {"from_slice": {2: 0, 10: 3}}}]}}
    with engine.begin() as conn:
        conn.execute(insert(VERSIONS), {"name": "m", "version": "v000002", "seq": 2,
                                        "parent": "v000001", "manifest": man,
                                        "created_at": utc_now()})
    with engine.connect() as conn:
        stored = conn.execute(select(VERSIONS.c.manifest)).scalar_one()
    assert stored != man  # the shard keys come back as text
    assert manifest_sha256(stored) == manifest_sha256(man)
