"""The worker and the registry: requests in, verified versions out, on both databases."""

from __future__ import annotations

import json
import time
import uuid

import numpy as np
import pytest
from prometheus_client import REGISTRY
from sqlalchemy import select

from jobs.orchestration.consistency import verify_registry
from jobs.orchestration.guarded_answers import PROMISES, GuardedAnswers
from jobs.orchestration.registry import PublishConflict, Registry
from jobs.orchestration.served_model import ForestModel, ServedModel
from jobs.orchestration.update_pass import plan as _plan
from jobs.orchestration.worker import Worker, WorkerConfig
from ledger.chain import utc_now
from ledger.forgotten import forgotten
from ledger.models import RecordPayload, Request, TrainingRecord
from ledger.store import Ledger
from service import service_metrics as metrics
from service.model_holder import ModelHolder

# the worker in-process through whole updates and checks: minutes together
pytestmark = pytest.mark.slow

SMALL = {"dare": {"n_estimators": 8, "max_depth": 4, "k": 5},
         "sisa": {"n_shards": 3, "epochs_per_slice": 3, "hidden": [8]}}


def _worker(ledger: Ledger, name: str = "w1", registry: Registry | None = None,
            window_s: float = 0.0) -> Worker:
    reg = registry or Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    return Worker(ledger, reg, WorkerConfig(name=name, batch_window_s=window_s,
                                            guard_process=False, guard_after_idle_s=0.0))


def _drain(worker: Worker, timeout_s: float = 60.0) -> None:
    """Step until there is nothing to do and no guard job is computing."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not worker.step():
            if not worker.busy:
                return
            time.sleep(0.02)
    raise AssertionError("the worker did not run out of work")


def _events(ledger: Ledger, request_id: str) -> list[dict]:
    return ledger.history(request_id)["events"]


def test_a_guard_update_out_of_time_is_published_sound_then_completed(
        seeded60: Ledger) -> None:
    """With no time to grow subtrees (guard_grow_s=0) the deletion is still published at
    once with a sound guard, marked not complete; the idle pass refits it and publishes
    the completed guard as a version of its own, verifying the request there."""
    ledger = seeded60
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    w = Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                         guard_after_idle_s=0.0, guard_grow_s=0.0))
    w.bootstrap("dare", {"n_estimators": 8, "max_depth": 6, "k": 5})
    ledger.receive({"request_id": "d1", "op": "delete", "record_ids": ["r001", "r002"]})
    assert w.step()
    cur = w.registry.current()
    assert cur.manifest["change"]["op"] == "update"
    assert cur.manifest["guard"]["ready"] is True
    assert cur.manifest["guard"]["bound"]["complete"] is False
    model = w.registry.load(cur.version)
    assert model.guard_ready and not model.guard_complete
    holder = ModelHolder(reg)  # the service says so on its dashboard gauge
    assert holder.refresh() and metrics.GUARD_COMPLETE._value.get() == 0.0
    assert metrics.GUARD_MODE._value.get() == 1.0
    _drain(w)
    assert holder.refresh() and metrics.GUARD_COMPLETE._value.get() == 1.0
    last = w.registry.current()
    assert [v.manifest["change"]["op"] for v in w.registry.lineage()] == [
        "guard", "update", "train"]
    assert last.manifest["guard"]["bound"]["complete"] is True
    assert last.manifest["content_hash"] == cur.manifest["content_hash"]
    assert [e["kind"] for e in _events(ledger, "d1")][-1] == "verified"


@pytest.mark.parametrize("kind", ["dare", "sisa"])
def test_deletion_becomes_a_verified_version(seeded60: Ledger, kind: str) -> None:
    ledger = seeded60
    w = _worker(ledger)
    v1 = w.bootstrap(kind, SMALL[kind])
    assert ledger.receive({"request_id": "d1", "op": "delete", "record_ids": ["r001"]}
                          ).status == "accepted"
    assert ledger.receive({"request_id": "d2", "op": "delete", "subject_id": "s05"}
                          ).status == "accepted"
    _drain(w)

    kinds = {rid: [e["kind"] for e in _events(ledger, rid)] for rid in ("d1", "d2")}
    assert kinds["d1"] == ["received", "claimed", "applied", "verified"]
    assert kinds["d2"] == ["received", "claimed", "applied", "verified"]
    applied = [e for e in _events(ledger, "d1") if e["kind"] == "applied"][0]
    verified = [e for e in _events(ledger, "d1") if e["kind"] == "verified"][0]
    assert applied["payload"]["guarantee"] == "exact"
    assert verified["payload"]["exactness"]["exact"] is True

    # the lineage: train -> update, published with its guard up to date (never noise-all);
    # the exactness check then verifies the requests on that same version
    lineage = w.registry.lineage()
    assert [v.manifest["change"]["op"] for v in lineage] == ["update", "train"]
    assert lineage[-1].version == v1 and lineage[0].parent == v1
    assert applied["model_version"] == verified["model_version"] == lineage[0].version
    assert lineage[0].manifest["guard"]["ready"] is True

    # the served version no longer holds the records, and its raw data is gone
    model = w.registry.load(w.registry.current().version)
    gone = {"r001", "r015", "r016", "r017"}
    assert not gone & set(model.learner.record_ids_.tolist())
    assert model.learner.verify().exact
    with ledger.engine.connect() as conn:
        rows = conn.execute(select(TrainingRecord.__table__)
                            .where(TrainingRecord.__table__.c.record_id.in_(gone))).all()
        left = conn.execute(select(RecordPayload.__table__)
                            .where(RecordPayload.__table__.c.record_id.in_(gone))).all()
    assert len(rows) == len(gone) and all(r.state == "purged" for r in rows) and not left

    # the manifest names the training set by the Merkle root of its fingerprints
    count, root = ledger.records.digest(model.learner.record_ids_.tolist())
    assert lineage[0].manifest["training_set"] == {"count": 56, "merkle_root": root}
    assert count == 56
    assert ledger.verify().ok


GAME_SMALL = {"hidden": [8], "epochs": 5, "rounds": 5, "attack_steps": 50,
              "third_fraction": 0.25}


def test_game_deletion_is_served_approximate_at_once_then_replaced_by_an_exact_retrain(
        seeded60: Ledger) -> None:
    """The game's update is published and served at once (`approximate`, the request
    `applied`); the guard job retrains the network from scratch, checks that retrain by
    content hash and publishes it in its place (`exact`); only then is the request
    `verified`. Answers and the answer counter say which was served."""
    ledger = seeded60
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    w = Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                         guard_after_idle_s=0.0, evaluate=True))
    v1 = w.bootstrap("game", GAME_SMALL)
    _drain(w)
    assert reg.current().version == v1  # exact as trained: nothing owed
    assert reg.current().manifest["forgetting"] == "exact"
    model = reg.load(v1)
    held = set(model.holdout_ids().tolist())
    assert held and model.guard_record()["rule"] == "none"
    forget = [r for r in model.learner.record_ids_.tolist() if r not in held][:3]
    assert ledger.receive({"request_id": "g1", "op": "delete", "record_ids": forget}
                          ).status == "accepted"
    assert w.step()  # the update pass: the game's version is published at once
    approx = reg.current()
    assert approx.manifest["forgetting"] == "approximate"
    assert ledger.history("g1")["request"]["status"] == "applied"
    served = reg.load(approx.version)
    assert not set(forget) & set(served.learner.record_ids_.tolist())
    X = np.random.default_rng(0).random((5, 4))
    before = {p: _answers(p) for p in PROMISES}
    labels, cost = GuardedAnswers().answer(GuardedAnswers().bind(approx, served), X)
    assert cost.promises == ("approximate",) * 5 and len(labels) == 5
    metrics.count_answers(cost)
    assert _answers("approximate") == before["approximate"] + 5

    _drain(w)
    exact = reg.current()
    change = exact.manifest["change"]
    assert change["op"] == "exact_retrain" and change["replaces"] == [approx.version]
    assert exact.manifest["parent"] == approx.version
    assert exact.manifest["forgetting"] == "exact"
    check = change["exactness"]  # the retrain, retrained again: the same bits
    assert check["exact"] is True and check["served_hash"] == check["retrained_hash"]
    assert check["served_hash"] == exact.manifest["content_hash"]
    replaced = reg.load(exact.version)
    assert replaced.learner.exact_ and replaced.learner.verify().exact
    assert set(replaced.learner.record_ids_.tolist()) == set(
        served.learner.record_ids_.tolist())
    labels, cost = GuardedAnswers().answer(GuardedAnswers().bind(exact, replaced), X)
    assert cost.promises == ("exact",) * 5

    events = {e["kind"]: e for e in _events(ledger, "g1")}
    assert list(events) == ["received", "claimed", "applied", "verified"]
    assert events["applied"]["model_version"] == approx.version
    assert events["applied"]["payload"]["guarantee"] == "approximate"
    ev = events["applied"]["payload"]["evaluation"]
    for key in ("acc_test", "acc_forget", "mia_forget", "priaa_frozen", "priaa_retrained",
                "acc_test_original"):
        assert key in ev and (ev[key] is None or 0.0 <= ev[key] <= 1.0), key
    verified = events["verified"]
    assert verified["model_version"] == exact.version
    assert verified["payload"]["exactness"]["exact"] is True
    assert verified["payload"]["replaces"] == [approx.version]
    # the deletion's report links the approximate version to the retrain that replaced it
    chain = forgotten(ledger, "g1")["exactness_chain"]
    assert chain["covered"] is True and chain["checked"]["version"] == exact.version
    assert chain["links"] == [{"version": exact.version, "parent": approx.version,
                               "event_seq": verified["seq"], "kind": "verified",
                               "change": "exact retrain", "guarantee": "exact"}]
    # the ledger and the registry agree on every publication, the retrain's included
    assert verify_registry(ledger, reg) == [] and ledger.verify().ok

    # two deletions in a row: the retrain of the second version replaces both
    live = [r for r in replaced.learner.record_ids_.tolist() if r not in held]
    for i, rid in enumerate(live[:2]):
        ledger.receive({"request_id": f"g{i + 2}", "op": "delete", "record_ids": [rid]})
        assert w.step()
    second, first, before_them = reg.lineage(limit=3)
    assert before_them.version == exact.version
    assert [first.manifest["forgetting"], second.manifest["forgetting"]] == ["approximate"] * 2
    _drain(w)
    again = reg.current()
    assert again.manifest["change"]["replaces"] == [second.version, first.version]
    assert again.manifest["forgetting"] == "exact"
    assert {ledger.history(f"g{i}")["request"]["status"] for i in (2, 3)} == {"verified"}
    assert forgotten(ledger, "g2")["exactness_chain"]["checked"]["version"] == again.version


def test_superseded_versions_are_destroyed_under_a_stream_that_never_pauses(
        seeded60: Ledger) -> None:
    """Retention runs at most once a second whether or not a batch came: a stream that
    never lets the worker idle still sees superseded versions destroyed after their grace
    (else a full model store would fail every publish, so every pass, for ever)."""
    from jobs.orchestration.retention import destroyed_versions

    ledger = seeded60
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    w = Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                         guard_after_idle_s=3600.0, destroy_grace_s=0.0))
    w.bootstrap("dare", SMALL["dare"])
    for i in range(3):
        ledger.receive({"request_id": f"s{i}", "op": "delete", "record_ids": [f"r{i:03d}"]})
        time.sleep(1.05)  # the retention pass's own throttle
        assert w.step() and not ledger.lifecycle.requests_with_status("received")
    assert len(destroyed_versions(reg)) >= 2


def _answers(promise: str) -> float:
    return REGISTRY.get_sample_value("obliviate_answers_total", {"promise": promise}) or 0.0


def test_evaluation_is_skipped_with_a_reason_without_held_out_records(seeded60: Ledger
                                                                       ) -> None:
    ledger = seeded60
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    w = Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                         guard_after_idle_s=0.0, evaluate=True))
    w.bootstrap("dare", SMALL["dare"])
    ledger.receive({"request_id": "d1", "op": "delete", "record_ids": ["r001"]})
    _drain(w)
    applied = [e for e in _events(ledger, "d1") if e["kind"] == "applied"][0]
    assert "no non-members" in applied["payload"]["evaluation"]["skipped"]


def test_additions_are_learned_and_the_guard_follows(seeded60: Ledger) -> None:
    ledger = seeded60
    w = _worker(ledger)
    w.bootstrap("dare", SMALL["dare"])
    res = ledger.receive({"request_id": "a1", "op": "add", "subject_id": "snew",
                          "payload": {"records": [
        {"record_id": "n1", "features": [0.1, 0.2, 0.3, 0.4], "label": 1},
        {"record_id": "n2", "features": [0.9, 0.8, 0.7, 0.6], "label": 2}]}})  # fmt: skip
    assert res.status == "accepted", res.reason
    _drain(w)
    model = w.registry.load(w.registry.current().version)
    assert {"n1", "n2"} <= set(model.learner.record_ids_.tolist())
    assert model.guard_ready
    assert ledger.history("a1")["request"]["status"] == "verified"


def test_a_stream_without_pause_is_answered_by_guarded_versions(seeded60: Ledger) -> None:
    """Requests keep coming, so the idle exactness check never starts: still every version
    the worker publishes carries its guard, brought up to date with the update itself, so
    no answer of the stream falls back to noise-all."""
    ledger = seeded60
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    w = Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                         guard_after_idle_s=3600.0))
    w.bootstrap("dare", SMALL["dare"])
    for i in range(1, 5):
        assert ledger.receive({"request_id": f"d{i}", "op": "delete",
                               "record_ids": [f"r{i:03d}"]}).status == "accepted"
        assert w.step()
        cur = reg.current()
        assert cur.manifest["change"]["op"] == "update" and cur.manifest["guard"]["ready"]
        served = reg.load(cur.version)
        assert served.guard_ready and served.guard.mode == "sound"
    assert [v.manifest["change"]["op"] for v in reg.lineage()] == ["update"] * 4 + ["train"]
    assert not ledger.lifecycle.requests_with_status("verified")  # the check waits for a pause
    _drain(_worker(ledger, registry=reg))  # a pause: every request verified on its version
    for i in range(1, 5):
        events = _events(ledger, f"d{i}")
        assert [e["kind"] for e in events] == ["received", "claimed", "applied", "verified"]
        assert events[3]["model_version"] == reg.current().version
    assert len(reg.lineage()) == 5


def test_a_stream_without_pause_is_verified_within_the_max_wait(seeded60: Ledger) -> None:
    """Requests keep coming: once applied requests have waited guard_max_wait_s, the check
    starts anyway, and versions published while it runs do not cancel it: it verifies the
    requests applied when it started, on the version it checked, which holds them."""
    ledger = seeded60
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    w = Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                         guard_after_idle_s=3600.0, guard_max_wait_s=0.3))
    w.bootstrap("dare", SMALL["dare"])

    def delete(i: int) -> None:
        assert ledger.receive({"request_id": f"d{i}", "op": "delete",
                               "record_ids": [f"r{i:03d}"]}).status == "accepted"
        while ledger.history(f"d{i}")["request"]["status"] == "received":
            assert w.step()
        w.guard.last_update = time.monotonic()  # no pause, ever

    delete(1)
    checked = reg.current().version
    assert not w.step() and not w.busy  # young: no check yet
    time.sleep(0.35)
    assert w.step() and w.busy  # due: the check of `checked` starts, for d1
    delete(2)  # a newer version meanwhile: the check goes on
    end, i = time.monotonic() + 60, 3
    while ledger.history("d1")["request"]["status"] != "verified":
        assert time.monotonic() < end and i < 40, "d1 was never verified"
        delete(i)
        i += 1
        time.sleep(0.05)
    [verified] = [e for e in _events(ledger, "d1") if e["kind"] == "verified"]
    assert verified["model_version"] == checked and verified["payload"]["in_place"]
    assert verified["payload"]["exactness"]["exact"] is True
    assert reg.current().version != checked  # newer versions kept coming meanwhile
    assert all(v.manifest["change"]["op"] == "update" for v in reg.lineage()[:-1])


def test_a_guard_update_that_fails_holds_no_deletion_back(seeded60: Ledger,
                                                          monkeypatch) -> None:
    """The deletion is published at once with a stale guard (noise-all, sound); the guard
    is refitted in the background and published as its own version."""
    ledger = seeded60
    w = _worker(ledger)
    w.bootstrap("dare", SMALL["dare"])

    def broken(self, deleted=(), added=(), grow_seconds=None):
        raise RuntimeError("a bug in the guard")

    monkeypatch.setattr(ForestModel, "update_guard", broken)
    ledger.receive({"request_id": "d1", "op": "delete", "record_ids": ["r001"]})
    assert w.step()
    cur = w.registry.current()
    assert cur.manifest["change"]["op"] == "update" and not cur.manifest["guard"]["ready"]
    assert cur.manifest["change"]["guard"]["error"] == "update failed"
    assert "r001" not in reg_ids(w, cur.version)
    _drain(w)
    assert [v.manifest["change"]["op"] for v in w.registry.lineage()] == [
        "guard", "update", "train"]
    assert w.registry.current().manifest["guard"]["ready"] is True
    assert ledger.history("d1")["request"]["status"] == "verified"


def reg_ids(w: Worker, version: str) -> set[str]:
    return set(w.registry.load(version).learner.record_ids_.tolist())


@pytest.mark.parametrize("same_batch", [True, False])
def test_a_deletion_overlapping_an_earlier_one_removes_the_rest(seeded60: Ledger,
                                                                same_batch: bool) -> None:
    """All are accepted while r002 is live (x1 claimed, not yet applied); in one batch
    or in the next, r002 and r003 end up gone and every request verified."""
    ledger = seeded60
    w = _worker(ledger)
    w.bootstrap("sisa", SMALL["sisa"])
    ledger.receive({"request_id": "x1", "op": "delete", "record_ids": ["r002"]})
    first = [] if same_batch else ledger.lifecycle.claim(10, "w1")
    for rid, ids in (("x2", ["r002", "r003"]), ("x3", ["r002"])):
        assert ledger.receive({"request_id": rid, "op": "delete", "record_ids": ids}
                              ).status == "accepted"
    if first:
        w.updates.apply(first)  # x1 applied: r002 purged before x2 and x3 are claimed
    _drain(w)
    for rid in ("x1", "x2", "x3"):
        assert ledger.history(rid)["request"]["status"] == "verified", rid
    model = w.registry.load(w.registry.current().version)
    assert not {"r002", "r003"} & set(model.learner.record_ids_.tolist())
    assert model.learner.verify().exact
    applied = [e for e in _events(ledger, "x2") if e["kind"] == "applied"][0]
    assert len(applied["payload"]["purged_record_hashes"]) == 2
    with ledger.engine.connect() as conn:
        by = dict(conn.execute(select(TrainingRecord.__table__.c.record_id,
                                      TrainingRecord.__table__.c.purged_by)
                               .where(TrainingRecord.__table__.c.record_id.in_(
                                   ["r002", "r003"]))).all())
    assert by == {"r002": "x1", "r003": "x2"}
    assert ledger.verify().ok


def test_a_request_the_model_cannot_apply_fails_with_a_reason() -> None:
    """A deletion of a record the model never held that no deletion purged (its addition
    not applied yet, say) fails whole; an addition of a held record fails too."""
    def req(rid: str, op: str, ids: list[str]) -> Request:
        return Request(request_id=rid, op=op, record_ids=ids, status="claimed",
                       received_at=utc_now(), received_seq=1, source="test")

    batch = [req("a", "delete", ["r1", "n9"]), req("b", "add", ["r2"]),
             req("c", "delete", ["r1", "gone"]), req("d", "add", ["n1"]),
             req("e", "delete", ["n1"])]
    ok, failed, updates = _plan(batch, {"r1", "r2"}, purged={"gone"})
    assert [r.request_id for r in ok] == ["d", "c", "e"]
    assert [(r.request_id, why) for r, why in failed] == [
        ("b", "record 'r2' is already in the model"), ("a", "record 'n9' is not in the model")]
    assert [(op, ids.tolist()) for op, ids in updates] == [("add", ["n1"]),
                                                           ("delete", ["r1", "n1"])]


def test_a_second_worker_never_builds_on_a_stale_version(seeded60: Ledger) -> None:
    ledger = seeded60
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    a, b = _worker(ledger, "a", reg), _worker(ledger, "b", reg)
    a.bootstrap("sisa", SMALL["sisa"])
    ledger.receive({"request_id": "p1", "op": "delete", "record_ids": ["r010"]})
    ledger.receive({"request_id": "p2", "op": "delete", "record_ids": ["r020"]})
    batch_a = ledger.lifecycle.claim(1, "a")
    batch_b = ledger.lifecycle.claim(1, "b")
    stale = a.loaded.get()  # a reads v1 as current ...
    b.updates.apply(batch_b)  # ... b publishes v2 from v1 meanwhile ...
    a.loaded.get = lambda: stale  # type: ignore[method-assign]
    with pytest.raises(PublishConflict):
        a.updates.apply(batch_a)  # ... so a's v2-from-v1 must not become current
    del a.loaded.get
    assert ledger.history("p1")["request"]["status"] == "claimed"
    _drain(a)  # a retakes its claim and builds on the new current version
    _drain(b)
    current = reg.load(reg.current().version)
    held = set(current.learner.record_ids_.tolist())
    assert not {"r010", "r020"} & held
    chain = reg.lineage()
    assert all(v.parent == nxt.version for v, nxt in zip(chain, chain[1:], strict=False))
    for rid in ("p1", "p2"):
        assert [e["kind"] for e in _events(ledger, rid)].count("applied") == 1


def test_manifest_records_what_rebuilds_the_version(seeded60: Ledger) -> None:
    w = _worker(seeded60)
    w.bootstrap("dare", SMALL["dare"])
    cur = w.registry.current()
    m = cur.manifest
    assert m["learner"] == "dare" and m["guarantee"] == "exact"
    assert m["seed"] == m["params"]["random_state"] > 0  # drawn afresh, never a default
    assert m["params"]["n_estimators"] == 8 and m["parent"] is None
    assert m["guard"]["rule"] == "forest-loo" and m["guard"]["ready"]
    assert m["ledger_seq"] >= 1
    path = w.registry.path(cur.version)
    assert json.loads((path / "manifest.json").read_text())["content_hash"] == m["content_hash"]
    # retraining from the manifest's parameters reproduces the content hash
    live = seeded60.records.live()
    again = ServedModel.train("dare", live.record_ids, live.X, live.y, m["params"])
    assert again.learner.content_hash() == m["content_hash"]
    assert np.array_equal(again.learner.record_ids_, w.registry.load(cur.version)
                          .learner.record_ids_)


def test_batching_window_claims_each_request_once(seeded60: Ledger) -> None:
    ledger = seeded60
    w = _worker(ledger, "win", window_s=0.05)
    w.bootstrap("sisa", SMALL["sisa"])
    for i in range(5):
        ledger.receive({"request_id": f"b{i}", "op": "delete", "record_ids": [f"r{30 + i:03d}"]})
    _drain(w)
    for i in range(5):
        assert ledger.history(f"b{i}")["request"]["status"] == "verified"
    assert [v.manifest["change"]["op"] for v in w.registry.lineage()] == ["update", "train"]


@pytest.mark.parametrize("bad", [{"guard_max_wait_s": -1.0}, {"batch_window_s": float("nan")},
                                 {"max_batch": 0}])
def test_worker_settings_are_checked(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        WorkerConfig(**bad)
