"""Per-shard SISA bounds on the served path: the guard job computes them in the
background, each is tied to the shard network it covers, an update refuses the bound of
the shard it retrained until the job recomputes it, and every answer certified at any
moment survives every single deletion (checked against every LOO network)."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from jobs import sealing
from jobs.guard.lucid.shard_bounds import ensemble_loo_set
from jobs.orchestration.registry import Registry
from jobs.orchestration.served_model import ShardVoteModel
from jobs.orchestration.worker import Worker, WorkerConfig
from ledger.store import Ledger
from tests.conftest import seed
from tests.idp.test_sisa_bounds import _brute_force_stable
from tests.test_worker import _drain

# the guard job bounding shards through the worker: minutes together
pytestmark = pytest.mark.slow

SISA = {"n_shards": 3, "epochs_per_slice": 3, "hidden": [8]}


def _queries(model: ShardVoteModel, X: np.ndarray) -> np.ndarray:
    rng = np.random.default_rng(3)
    return np.vstack([X, rng.random((300, X.shape[1]))]).astype(np.float32)


def _assert_sound(model: ShardVoteModel, Q: np.ndarray) -> np.ndarray:
    """Certified answers are stable under every single deletion; returns `certain`."""
    ens = model.learner
    cls, certain = model.certain(Q)
    loos = [ensemble_loo_set(ens, s) for s in range(len(ens.shard_sizes_))]
    stable = _brute_force_stable(ens, loos, Q)
    assert not (certain & ~stable).any(), int((certain & ~stable).sum())
    S, C = len(ens.shard_sizes_), len(ens.classes_)
    from jobs.guard.label_guard import sisa_certain

    _, free = sisa_certain(ens.shard_logits(Q), np.full((S, C), np.inf), ens.active_shards_)
    assert not (free & ~certain).any()  # bounds only add certain answers
    return certain


@pytest.fixture
def seeded90(ledger: Ledger) -> Ledger:
    seed(ledger, n=90)
    return ledger


@pytest.mark.parametrize("n_slices", [1, 2], ids=["one-slice", "sliced"])
def test_the_guard_job_bounds_each_shard_and_an_update_refuses_the_retrained_one(
        seeded90: Ledger, n_slices: int) -> None:
    ledger = seeded90
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    w = Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                         guard_after_idle_s=0.0, shard_bound_s=2.0))
    w.bootstrap("sisa", {**SISA, "n_slices": n_slices})
    assert reg.load(reg.current().version).learner.config_["schedule"] == "loo"
    guard = reg.current().manifest["guard"]
    assert guard["shard_bound"] == "per-shard" and guard["bound"]["complete"] is False
    assert not any(row["current"] for row in guard["bound"]["shards"])  # all fragile

    _drain(w, timeout_s=300)  # the guard job computes every shard's bound
    cur = reg.current()
    assert cur.manifest["change"]["op"] == "guard"
    rows = cur.manifest["guard"]["bound"]["shards"]
    assert cur.manifest["guard"]["bound"]["complete"] is True
    assert all(r["current"] and len(r["beta"]) == 3 and r["status"] and r["loo_hash"]
               for r in rows)
    model = reg.load(cur.version)
    assert isinstance(model, ShardVoteModel) and model.guard_complete
    X, _ = ledger.records.data([f"r{i:03d}" for i in range(90)])
    Q = _queries(model, X)
    _assert_sound(model, Q)

    ledger.receive({"request_id": "d1", "op": "delete", "record_ids": ["r004"]})
    assert w.step()
    cur = reg.current()
    assert cur.manifest["change"]["op"] == "update"
    rows = cur.manifest["guard"]["bound"]["shards"]
    assert [r["current"] for r in rows].count(False) == 1  # the shard that held r004
    model = reg.load(cur.version)
    assert not model.guard_complete
    _assert_sound(model, Q)  # the retrained shard counts as fragile meanwhile

    _drain(w, timeout_s=300)
    cur = reg.current()
    assert cur.manifest["change"]["op"] == "guard" and cur.manifest["guard"]["bound"][
        "complete"] is True
    _assert_sound(reg.load(cur.version), Q)


def test_bounds_are_kept_only_for_the_networks_they_were_computed_on(
        seeded90: Ledger, tmp_path) -> None:
    """Saved with the version (sealed under its key); loaded onto an ensemble whose shard
    changed, that shard's bound is refused (+inf), the others' kept."""
    X, y = seeded90.records.data([f"r{i:03d}" for i in range(90)])
    ids = np.array([f"r{i:03d}" for i in range(90)], dtype=object)
    model = ShardVoteModel.train("sisa", ids, X, y, params=SISA)
    assert not model.guard_complete
    for _ in range(3):  # about a second's worth of shards per call, at least one
        model.refresh_guard(bound_s=1.0)
    assert model.guard_complete
    key = sealing.new_key()
    with sealing.sealed_with(key):
        model.save(tmp_path / "v")
    changed = ShardVoteModel.train("sisa", ids, X, y, params={
        **SISA, "random_state": model.learner.random_state})
    assert changed.learner.content_hash() == model.learner.content_hash()
    gone = "r004"
    (s,), _ = changed.learner.locate([gone])
    changed.learner.delete([gone])
    with sealing.sealed_with(key):
        changed.load_guard(tmp_path / "v" / "guard")
    current = changed.bounds.current(changed.learner)
    assert not current[s] and current.sum() == len(current) - 1
    assert np.isinf(changed.bounds.for_ensemble(changed.learner)[s]).all()
    # the same on the model that computed them, after it answered: an update in place
    # (the worker's) refuses the retrained shard's bound at once
    model.certain(X)
    model.learner.delete([gone])
    rows = model.guard_record()["bound"]["shards"]
    assert not model.guard_complete and [r["current"] for r in rows].count(False) == 1
    assert not rows[s]["current"]


def test_shards_whose_loo_set_is_too_large_stay_fragile(seeded90: Ledger, monkeypatch) -> None:
    """A shard whose LOO set is estimated above LOO_MAX_SECONDS on the CPU is not bounded:
    it stays fragile (+inf, sound), the manifest row says why, and the guard counts as
    complete, so the worker does not start guard jobs for it again and again."""
    import jobs.orchestration.served_model as served
    from jobs.guard.lucid.shard_bounds import shard_loo_work
    from jobs.orchestration.guard_pass import guard_coarse as _guard_coarse

    X, y = seeded90.records.data([f"r{i:03d}" for i in range(90)])
    ids = np.array([f"r{i:03d}" for i in range(90)], dtype=object)
    model = ShardVoteModel.train("sisa", ids, X, y, params=SISA, fit_guard=False)
    works = [shard_loo_work(model.learner, s) for s in range(3)]
    big = {s for s, w in enumerate(works) if w == max(works)}  # over the cap, just
    monkeypatch.setattr(served, "LOO_MAX_SECONDS",
                        max(works) * (1 - 1e-9) * served.LOO_SECONDS_PER_UNIT)
    for _ in range(3):  # about a second's worth of shards per call, at least one
        model.refresh_guard(bound_s=1.0)
    rec = model.guard_record()
    rows = rec["bound"]["shards"]
    for r in rows:
        if r["shard"] in big:
            assert "LOO set too large" in r["skipped"] and not r["current"]
        else:
            assert r["current"] and "skipped" not in r
    assert model.guard_complete and rec["bound"]["complete"] and not _guard_coarse(rec)
    _assert_sound(model, _queries(model, X))


def test_bounds_computed_for_a_superseded_version_carry_over_to_unchanged_shards(
        seeded90: Ledger) -> None:
    """A guard job that finishes after an update published a newer version still holds
    valid bounds for the shards the update did not retrain: they are published with the
    current version at once (answers improve during a stream), and the next job bounds
    the retrained shard."""
    ledger = seeded90
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    w = Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                         guard_after_idle_s=0.0, shard_bound_s=2.0))
    first = w.bootstrap("sisa", SISA)
    ens = reg.load(first).learner
    # a record of the last shard: the job bounds shard 0 first
    gone = next(r for r in ens.record_ids_.tolist() if ens.locate([r])[0][0] == 2)
    assert w.step() and w.busy  # the guard job for the first version is computing
    ledger.receive({"request_id": "d1", "op": "delete", "record_ids": [gone]})
    assert w.step()  # the deletion is published meanwhile
    update = reg.current()
    assert update.manifest["change"]["op"] == "update" and w.busy
    _drain(w, timeout_s=300)
    versions = w.registry.lineage()[::-1]  # oldest first
    assert [v.manifest["change"]["op"] for v in versions[:2]] == ["train", "update"]
    assert all(v.manifest["change"]["op"] == "guard" for v in versions[2:])
    carried = versions[2].manifest
    assert carried["change"]["guard"]["carried_from"] == first
    rows = carried["guard"]["bound"]["shards"]
    assert rows[0]["current"] and not rows[2]["current"]  # shard 2 was retrained
    # later jobs bound the rest, one version each, and each keeps what was bounded
    done = [sum(r["current"] for r in v.manifest["guard"]["bound"]["shards"])
            for v in versions[2:]]
    assert done == sorted(done) and versions[-1].manifest["guard"]["bound"]["complete"]
    model = reg.load(reg.current().version)
    X, _ = ledger.records.data([r for r in ens.record_ids_.tolist() if r != gone])
    _assert_sound(model, _queries(model, X))


@pytest.mark.processes
def test_obliviate_worker_publishes_shard_bounds_and_the_service_serves_them(tmp_path
                                                                             ) -> None:
    """From the real processes: `obliviate worker --shard-bound` bounds every shard in its
    guard jobs, and `obliviate serve` serves the version that holds them (/v1/models)."""
    from tests.sidecar import Sidecar

    with Sidecar(tmp_path, learner="sisa") as sc:
        first = sc.models()["current"]["manifest"]["guard"]
        assert first["shard_bound"] == "per-shard" and first["bound"]["complete"] is False
        sc.start_worker("--shard-bound", "1")
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            m = sc.models()
            if (m["current"]["manifest"]["guard"]["bound"]["complete"]
                    and m["serving"]["version"] == m["current"]["version"]):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"shard bounds not served: {m['current']['manifest']['guard']}")
        rows = m["current"]["manifest"]["guard"]["bound"]["shards"]
        assert all(r["current"] and r["beta"] for r in rows)
        assert m["current"]["manifest"]["change"]["op"] == "guard"
