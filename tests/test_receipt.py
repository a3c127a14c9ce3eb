"""A deletion receipt its subject checks alone, and the exactness of the first version
served without a record (`ledger forgotten`).

A real worker publishes the versions (DaRE, on both databases): the first version
without a record is not the one the exactness check runs on when a second deletion
comes before the check, so the report shows the chain of exact updates between them.
The receipt is checked by `ledger/receipt.py` run with the project's other modules
made unimportable; tampering with it, or rewriting the ledger after it was cut, fails.
"""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import delete as sql_delete
from starlette.testclient import TestClient

from jobs.orchestration.registry import Registry
from jobs.orchestration.retention import destroyed_versions
from jobs.orchestration.worker import Worker, WorkerConfig
from ledger import merkle
from ledger import receipt as checker
from ledger.forgotten import forgotten, receipt, render
from ledger.heads import HeadSigner
from ledger.store import Ledger
from ledger.tables import HEADS
from service.http_api import AppContext, build_app
from tests.conftest import SIGNING_KEY
from tests.conftest import delete_request as delete
from tests.test_tamper import rewrite_events, tamper

PUBLIC_KEY = HeadSigner(SIGNING_KEY).public_key
SMALL_DARE = {"n_estimators": 4, "max_depth": 3, "k": 5}
RECEIPT_PY = Path(checker.__file__)


def two_deletions_then_the_check(ledger: Ledger) -> tuple[Worker, list[str]]:
    """v1 trained; d1 -> v2 and d2 -> v3 before any check; then the check runs (on v3)."""
    reg = Registry(ledger.engine, name=f"r{uuid.uuid4().hex[:8]}")
    w = Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                         guard_after_idle_s=3600.0, destroy_grace_s=0.0))
    w.bootstrap("dare", SMALL_DARE)
    for rid, rec in (("d1", "r004"), ("d2", "r005")):
        assert ledger.receive(delete(rid, rec)).status == "accepted"
        assert w.step()
    versions = [v.version for v in reversed(reg.lineage())]
    assert len(versions) == 3
    return w, versions


def run_checks(w: Worker, ledger: Ledger) -> None:
    # a pause: the check runs (the guard pass schedules it, by its own settings)
    w.guard.config = replace(w.guard.config, guard_after_idle_s=0.0)
    end = time.monotonic() + 90
    while time.monotonic() < end and (w.step() or w.busy or len(destroyed_versions(
            w.registry)) < 2 or ledger.lifecycle.requests_with_status("applied")):
        time.sleep(0.01)
    assert not ledger.lifecycle.requests_with_status("applied")


# ---------------------------------------------------------------------------- ledger forgotten
def test_forgotten_proves_the_first_version_without_the_record_exact(signed: Ledger) -> None:
    w, (v1, v2, v3) = two_deletions_then_the_check(signed)
    report = forgotten(signed, "d1")
    assert report["first_version_without"]["version"] == v2
    chain = report["exactness_chain"]
    assert chain["covered"] is False and "no checked version covers it yet" in chain["why"]
    assert any(line.startswith(f"exactness of {v2} (the first version served without it): "
                               "NOT PROVEN: no checked version covers it yet")
               for line in render(report))

    run_checks(w, signed)
    report = forgotten(signed, "d1")
    chain = report["exactness_chain"]
    checked = chain["checked"]["version"]
    assert chain["covered"] is True and checked != v2  # the check ran on a later version
    assert report["exactness"]["version"] == checked  # ... which is all the request's says
    links = chain["links"]
    assert links[0] == {"version": v3, "parent": v2, "event_seq": links[0]["event_seq"],
                        "kind": "applied", "change": "update", "guarantee": "exact"}
    assert [link["parent"] for link in links[1:]] == [link["version"] for link in links[:-1]]
    assert links[-1]["version"] == checked
    assert chain["checked"]["served_hash"] == chain["checked"]["retrained_hash"]
    lines = render(report)
    assert any(line.startswith(f"exactness of {v2} (the first version served without it): "
                               f"{len(links)} exact update(s) to {checked}") for line in lines)
    assert f"  {v3} <- {v2}: update, exact (event {links[0]['event_seq']})" in lines
    # d2's first version without its record is the checked one's own lineage start
    assert forgotten(signed, "d2")["exactness_chain"]["covered"] is True


GAME_SMALL = {"hidden": [8], "epochs": 5, "rounds": 5, "attack_steps": 50,
              "third_fraction": 0.25}


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the chain reads events only
def test_a_game_deletion_is_proven_exact_by_the_retrain_that_replaced_its_version(
        signed: Ledger) -> None:
    """The game serves a deletion at once from an approximate version; the chain of its
    receipt runs to the exact retrain that replaced that version, and checks offline."""
    reg = Registry(signed.engine, name=f"r{uuid.uuid4().hex[:8]}")
    w = Worker(signed, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                         guard_after_idle_s=3600.0, destroy_grace_s=0.0))
    w.bootstrap("game", GAME_SMALL)
    model = reg.load(reg.current().version)
    held = set(model.holdout_ids().tolist())
    rec = next(r for r in model.learner.record_ids_.tolist() if r not in held)
    assert signed.receive(delete("g1", rec)).status == "accepted"
    assert w.step()
    approx = reg.current().version
    pending = forgotten(signed, "g1")["exactness_chain"]
    assert not pending["covered"] and "no exact retrain has replaced it yet" in pending["why"]
    run_checks(w, signed)
    chain = forgotten(signed, "g1")["exactness_chain"]
    assert chain["covered"] and chain["links"][0]["parent"] == approx
    assert chain["links"][0]["change"] == "exact retrain"
    verdict = checker.check(json.loads(json.dumps(receipt(signed, "g1"))), PUBLIC_KEY)
    assert verdict.ok, verdict.problems
    assert any(f"exactness of {approx}: 1 exact update(s)" in f for f in verdict.facts)


def test_an_approximate_versions_first_link_must_be_the_retrain_that_replaced_it() -> None:
    """The receipt's own check: for a deletion first served by an approximate version, a
    passing exact retrain covers it only if its publication names that version as
    replaced (another version's retrain, or a plain publication, proves nothing of it)."""
    applied = {"seq": 5, "model_version": "v2", "payload": {"guarantee": "approximate"}}
    check = {"guarantee": "exact", "exact": True, "served_hash": "h", "retrained_hash": "h"}

    def verdict(payload: dict) -> checker.Verdict:
        ev = {"seq": 9, "kind": "verified", "model_version": "v3",
              "payload": {"exactness": check, **payload}}
        claim = {"covered": True, "links": [{"version": "v3", "parent": "v2", "event_seq": 9}],
                 "checked": {"version": "v3", "event_seq": 9}}
        out = checker.Verdict()
        checker._check_exactness("v2", applied, claim, {9: ev}, out)
        return out

    assert verdict({"replaces": ["v2"]}).ok
    for payload in ({"replaces": ["v1"]}, {}):
        bad = verdict(payload)
        assert bad.problems == ["event 9 does not replace the approximate v2 with an exact "
                                "retrain"], payload


def test_a_new_training_between_breaks_the_chain(signed: Ledger) -> None:
    """A later version that is not an update of the first one (seeds rotated: a retrain
    with other seeds) says nothing of it, however well it is checked."""
    w, (_, v2, v3) = two_deletions_then_the_check(signed)
    signed.events.append("seeds_rotated", {"change": {"op": "retrain"}}, "v000099")
    signed.events.append("guard_refreshed", {"change": {"op": "guard", "exactness": {
        "guarantee": "exact", "exact": True, "served_hash": "ab", "retrained_hash": "ab"}}},
        "v000099")
    chain = forgotten(signed, "d1")["exactness_chain"]
    assert chain["covered"] is False
    assert chain["why"].startswith("v000099 is not an update of")
    assert [link["version"] for link in chain["links"]] == [v3]


# ---------------------------------------------------------------------------- the receipt
def check_alone(path: Path, key: bytes, *extra: str) -> subprocess.CompletedProcess:
    """`python -m ledger.receipt` with every module of this project unimportable."""
    code = ("import runpy, sys; sys.modules.update(dict.fromkeys(['ledger', 'jobs', "
            "'service', 'tests'])); sys.argv = ['receipt', *sys.argv[1:]]; "
            f"runpy.run_path({str(RECEIPT_PY)!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-I", "-c", code, str(path), "--key", key.hex(),
                           *extra], capture_output=True, text=True, timeout=60)


@pytest.mark.processes
def test_an_honest_receipt_checks_alone_and_a_tampered_one_fails(signed: Ledger,
                                                                  tmp_path) -> None:
    w, (v1, v2, _) = two_deletions_then_the_check(signed)
    run_checks(w, signed)
    doc = json.loads(json.dumps(receipt(signed, "d1")))
    path = tmp_path / "receipt.json"
    path.write_text(json.dumps(doc))
    done = check_alone(path, PUBLIC_KEY)
    assert done.returncode == 0 and "receipt OK" in done.stdout, done.stderr
    assert f"first served without them by {v2}" in done.stdout
    assert f"held by {v1}: destroyed" in done.stdout
    assert f"exactness of {v2}: " in done.stdout and "same hash" in done.stdout
    kinds = {e["kind"] for e in doc["events"]}
    assert {"received", "applied", "verified", "destroyed"} <= kinds

    def edited(change) -> checker.Verdict:
        bad = copy.deepcopy(doc)
        change(bad)
        return checker.check(bad, PUBLIC_KEY)

    def event(d: dict, kind: str) -> dict:
        return next(e for e in d["events"] if e["kind"] == kind)

    def swap_fingerprint(d: dict) -> None:
        ev = event(d, "applied")
        ev["payload"] = ev["payload"].replace(ev["payload"][-20:-4], "0" * 16)

    failures = {
        "an event's content": swap_fingerprint,
        "the first version": lambda d: d["claims"].update(first_version_without=v1),
        "the head's root": lambda d: d["head"].update(root_hash="00" * 32),
        "an inclusion proof": lambda d: event(d, "received").update(
            inclusion_proof=["11" * 32]),
        "a destroyed version": lambda d: d["claims"]["held_by"][0].update(version=v2),
        "the checked version": lambda d: d["claims"]["exactness"]["checked"].update(
            event_seq=event(d, "received")["seq"]),
        "an event left out": lambda d: d["events"].remove(event(d, "destroyed")),
    }
    for what, change in failures.items():
        assert not edited(change).ok, what
    # another key than the deployment's
    assert not checker.check(doc, HeadSigner(bytes(32)).public_key).ok
    bad = copy.deepcopy(doc)
    swap_fingerprint(bad)
    path.write_text(json.dumps(bad))
    done = check_alone(path, PUBLIC_KEY)
    assert done.returncode == 1 and "content does not match its hash" in done.stderr


@pytest.mark.processes
def test_later_heads_prove_the_receipt_was_never_rewritten(signed: Ledger, tmp_path) -> None:
    w, _ = two_deletions_then_the_check(signed)
    run_checks(w, signed)
    doc = json.loads(json.dumps(receipt(signed, "d1")))
    size = doc["head"]["tree_size"]
    path, later = tmp_path / "receipt.json", tmp_path / "later.json"
    path.write_text(json.dumps(doc))
    for i in range(3):  # the log grows; a later head extends the receipt's
        signed.receive(delete(f"x{i}", f"r02{i}"))
    new = signed.heads.sign()["tree_size"]
    later.write_text(json.dumps(signed.events.consistency(size, new)))
    done = check_alone(path, PUBLIC_KEY, "--head", str(later))
    assert done.returncode == 0 and f"the head over {new} events" in done.stdout, done.stderr

    # the insider rewrites history and has the sidecar sign the rewritten log afresh
    tamper(signed, sql_delete(HEADS))
    rewrite_events(signed, lambda e: e.payload.replace('"kind":"http"', '"kind":"cli"'))
    assert signed.heads.sign() is not None
    later.write_text(json.dumps(signed.events.consistency(size, signed.events.last_seq())))
    done = check_alone(path, PUBLIC_KEY, "--head", str(later))
    assert done.returncode == 1 and "the log was rewritten" in done.stderr, done.stderr


def test_receipts_over_http_for_the_subject_or_the_admin(signed: Ledger) -> None:
    w, _ = two_deletions_then_the_check(signed)
    client = TestClient(build_app(AppContext(ledger=signed, admin_token="admin-token")))
    admin = {"Authorization": "Bearer admin-token"}
    answer = client.post("/v1/requests", content=json.dumps(delete("d3", "r010")),
                         headers=admin)
    assert answer.status_code == 202
    token = answer.json()["receipt_token"]
    assert token == signed.events.receipt_token("d3") and token != signed.events.receipt_token("d1")
    url = "/v1/requests/d3/receipt"
    mine = {"Authorization": f"Bearer {token}"}
    assert client.get(url, headers=mine).status_code == 422  # not applied yet
    assert w.step()
    run_checks(w, signed)
    got = client.get(url, headers=mine)
    assert got.status_code == 200 and checker.check(got.json(), PUBLIC_KEY).ok
    assert client.get(url, headers=admin).status_code == 200
    assert client.get(url).status_code == 401
    assert client.get(url, headers={"Authorization": f"Bearer {signed.events.receipt_token('d1')}"}
                      ).status_code == 403  # another request's token
    assert client.get("/v1/requests/nope/receipt", headers=admin).status_code == 404
    assert client.get("/v1/requests/d3", headers=mine).status_code == 403  # history: admin
    assert client.post("/v1/requests", content=json.dumps(delete("d3", "r010")),
                       headers=admin).json().get("receipt_token") is None  # a duplicate


# ---------------------------------------------------------------------------- the primitives
def test_the_receipts_own_proof_checks_agree_with_the_ledgers() -> None:
    """receipt.py re-implements RFC 9162's checks (it must run alone): on every proof of
    trees up to 33 leaves, and on tampered ones, it says what ledger.merkle says."""
    rng = random.Random(7)
    for n in range(1, 34):
        leaves = [merkle.leaf_hash(rng.randbytes(8)) for _ in range(n)]
        root = merkle.root(leaves)
        for i in range(n):
            proof = merkle.inclusion_proof(leaves, i)
            assert checker.verify_inclusion(leaves[i], i, n, proof, root)
            bad = [*proof[:-1], rng.randbytes(32)] if proof else [rng.randbytes(32)]
            assert checker.verify_inclusion(leaves[i], i, n, bad, root) is \
                merkle.verify_inclusion(leaves[i], i, n, bad, root) is False
        for m in range(1, n + 1):
            proof = merkle.consistency_proof(leaves, m)
            old = merkle.root(leaves[:m])
            assert checker.verify_consistency(m, n, old, root, proof)
            if m < n:
                assert checker.verify_consistency(m, n, root, root, proof) is \
                    merkle.verify_consistency(m, n, root, root, proof) is False
                assert not checker.verify_consistency(m, n, old, root, proof[:-1])


def test_a_receipt_after_a_key_rotation_checks_with_the_key_published_before(
        signed: Ledger) -> None:
    assert signed.receive(delete("d1", "r004")).status == "accepted"
    ids = [r.request_id for r in signed.lifecycle.claim(10, worker="w1")]
    signed.lifecycle.mark_applied(ids, "v000002", {"guarantee": "exact"})
    new = bytes(range(50, 82))
    signed.heads.rotate_key(new)
    assert signed.receive(delete("d2", "r005")).status == "accepted"  # the new key signs it
    doc = json.loads(json.dumps(receipt(signed, "d1")))
    assert doc["head"]["public_key"] == HeadSigner(new).public_key.hex()
    assert len(doc["rotations"]) == 1
    for key in (PUBLIC_KEY, HeadSigner(new).public_key):
        verdict = checker.check(doc, key)
        assert verdict.ok, verdict.problems
    assert any("exactness of v000002: not proven yet" in f for f in verdict.facts)
    # without the rotation the key published before it cannot reach the head's key
    assert not checker.check({**doc, "rotations": []}, PUBLIC_KEY).ok
