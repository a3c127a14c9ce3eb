"""The mlp learner (one network, LOO swap) and its LUCID guard on the served path.

Exactness is checked by retraining from scratch and comparing bits; the retraining
definition (frozen batch count, tombstones) is the one everywhere and a LOO set trained
with another is refused; every answer the served guard certifies is the answer of every
LOO network, on training rows, random points and points searched to break it; the
worker serves a deletion by swapping in N_-x and the guard job brings the bound back."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from jobs import sealing
from jobs.guard.lucid.falsifier import find_leaking
from jobs.learners.base import DuplicateRecordError, UnknownRecordError
from jobs.learners.mlp.leave_one_out import LeaveOneOutMLP
from jobs.learners.networks.loo_training import schedule_keys, train_loo, train_single
from jobs.orchestration.registry import Registry
from jobs.orchestration.served_model import BOUND_FILE, GuardedMLPModel, ServedModel
from jobs.orchestration.worker import Worker, WorkerConfig
from ledger import datasets
from ledger.store import Ledger
from service import service_metrics as metrics
from service.demo.residue import TraceScanner
from service.model_holder import ModelHolder
from tests.test_worker import _drain, _events

SMALL = {"hidden": [8], "epochs": 6, "batch_size": 8}


def _data(n: int = 48, d: int = 4, seed_: int = 0) -> tuple[list[str], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed_)
    X = rng.random((n, d))
    y = (X[:, 0] + 0.3 * rng.standard_normal(n) > 0.5).astype(int) + (X[:, 1] > 0.8)
    return [f"r{i:03d}" for i in range(n)], X, y


def _learner(**kw) -> LeaveOneOutMLP:
    ids, X, y = _data()
    params = {"hidden": (8,), "epochs": 6, "batch_size": 8, "device": "cpu",
              "random_state": 3, **kw}
    return LeaveOneOutMLP(**params).fit(X, y, record_ids=ids)


def test_a_single_deletion_swaps_in_the_network_a_retrain_gives() -> None:
    m = _learner()
    loo = m.fit_loo()
    expect = loo.loo("r007")
    rep = m.delete(["r007"])
    assert rep.retrained == {"swap": True, "networks": 0}
    assert m.network_.equal(expect) and m.loo_ is None  # the old set saw r007: dropped
    v = m.verify()
    assert v.exact and v.served_hash == v.retrained_hash
    # "retrain without x" is T on the rest with x's key as a tombstone and the frozen B
    ids, X, y = _data()
    keep = [i for i in range(len(ids)) if ids[i] != "r007"]
    alone = train_single(X[keep], y[keep], [ids[i] for i in keep], n_classes=3, hidden=(8,),
                         epochs=6, batch_size=8, lr=m.config_.lr, seed=3,
                         n_batches=m.config_.n_batches,
                         tombstones=schedule_keys(3, ["r007"]).tolist(), device="cpu")
    assert alone.equal(m.network_)


def test_every_update_path_stays_exact() -> None:
    """Swap, retrain without a LOO set, two at once with one, additions, a re-added record
    (its tombstone lifted), a swap of an added record: bit-exact after every step."""
    m = _learner()
    rng = np.random.default_rng(1)
    live = set(m.record_ids_.tolist())
    steps = [("loo", []), ("delete", ["r001"]), ("delete", ["r002"]),
             ("delete", ["r003", "r004"]), ("add", ["n1"]), ("add", ["r001"]), ("loo", []),
             ("delete", ["r005", "r006"]), ("loo", []), ("delete", ["n1"]), ("loo", []),
             ("delete", ["r001"])]
    swaps = []
    for op, ids in steps:
        if op == "loo":
            m.fit_loo()
            continue
        if op == "add":
            m.add(ids, rng.random((len(ids), 4)), rng.integers(0, 3, len(ids)))
            live |= set(ids)
        else:
            swaps.append(m.delete(ids).retrained["swap"])
            live -= set(ids)
        assert m.verify().exact, (op, ids)
        assert set(m.record_ids_.tolist()) == live
    assert swaps == [True, False, False, False, True, True]


def test_a_loo_set_of_another_definition_is_refused() -> None:
    m = _learner()
    m.delete([f"r{i:03d}" for i in range(1, 10)])
    ids, X, y = m.record_ids_.tolist(), m.X_, m.y_
    args = {"n_classes": 3, "hidden": (8,), "epochs": 6, "batch_size": 8, "lr": m.config_.lr,
            "seed": 3, "device": "cpu"}
    tomb = m.tombstones_.tolist()
    ok = train_loo(X, y, ids, n_batches=m.config_.n_batches, tombstones=tomb, **args)
    # B recomputed from the 39 left (what train_single's default would do) is another model
    recomputed = train_loo(X, y, ids, n_batches=-(-len(ids) // 8), tombstones=tomb, **args)
    assert recomputed.config.n_batches == 5 != m.config_.n_batches
    with pytest.raises(ValueError, match="batch count"):
        m.adopt_loo(recomputed)
    with pytest.raises(ValueError, match="tombstones"):
        m.adopt_loo(train_loo(X, y, ids, n_batches=m.config_.n_batches, **args))
    with pytest.raises(ValueError, match="other records"):
        m.adopt_loo(train_loo(X[1:], y[1:], ids[1:], n_batches=m.config_.n_batches,
                              tombstones=tomb, **args))
    m.adopt_loo(ok)
    assert m.loo_ is ok


def test_bad_updates_are_refused_and_change_nothing() -> None:
    m = _learner()
    before = m.content_hash()
    with pytest.raises(UnknownRecordError):
        m.delete(["nope"])
    with pytest.raises(DuplicateRecordError):
        m.add(["r002"], np.zeros((1, 4)), [0])
    with pytest.raises(ValueError, match="unknown label"):
        m.add(["x1"], np.zeros((1, 4)), [7])
    with pytest.raises(ValueError, match="NaN"):
        m.add(["x1"], np.full((1, 4), np.nan), [0])
    assert m.content_hash() == before


def test_save_and_load_keep_the_bits_and_refuse_an_altered_bundle(tmp_path: Path) -> None:
    m = _learner()
    m.delete(["r003", "r004"])
    m.save(tmp_path / "m")
    back = LeaveOneOutMLP.load(tmp_path / "m")
    assert back.content_hash() == m.content_hash() and back.verify().exact
    meta = tmp_path / "m" / "meta.json"
    meta.write_text(meta.read_text().replace('"r005"', '"r995"'))
    with pytest.raises(ValueError, match="content hash"):
        LeaveOneOutMLP.load(tmp_path / "m")


def _served(bound_s: float = 2.0) -> tuple[GuardedMLPModel, np.ndarray]:
    ids, X, y = _data()
    model = ServedModel.train("mlp", np.array(ids, dtype=object), X, y,
                              params={**SMALL, "device": "cpu"})
    assert isinstance(model, GuardedMLPModel) and not model.guard_complete
    model.refresh_guard(bound_s)
    return model, X


@pytest.mark.slow
def test_every_certified_answer_is_every_loo_networks_answer() -> None:
    model, X = _served()
    assert model.guard_complete and model.guard_record()["mode"] == "sound"
    loo = model.learner.loo_
    rng = np.random.default_rng(5)
    betas = model.class_bounds()
    searched = []
    for c in range(loo.n_classes):  # the most confident inputs where a LOO network differs
        leak = find_leaking(loo, c, n_samples=3000, n_starts=16, steps=100, seed=c)
        assert leak.best_margin <= betas[c]
        if leak.best_x is not None:
            searched.append(leak.best_x[None, :])
    Q = np.clip(np.vstack([X, rng.random((3000, X.shape[1])), *searched]), 0, 1)
    Q = Q.astype(np.float32)
    labels, certain = model.certain(Q)
    every = np.argmax(loo.logits(Q), axis=2)  # (networks, queries)
    assert certain.any()
    assert (every[:, certain] == labels[certain]).all()


def test_the_bound_is_kept_only_for_its_network_and_sealed(tmp_path: Path) -> None:
    model, X = _served()
    key = sealing.new_key()
    with sealing.sealed_with(key):
        model.save(tmp_path / "v")
        back = ServedModel.load(tmp_path / "v")
    assert back.guard_complete and back.class_bounds() == model.class_bounds()
    # an edited bound file does not open (AES-GCM); a plain one bound to another
    # network is refused
    path = tmp_path / "v" / "guard" / BOUND_FILE
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 1
    path.write_bytes(bytes(blob))
    with sealing.sealed_with(key), pytest.raises(sealing.SealedFileError):
        ServedModel.load(tmp_path / "v")
    model.save(tmp_path / "plain")
    bound = tmp_path / "plain" / "guard" / BOUND_FILE
    bound.write_text(bound.read_text().replace(model.learner.network_hash_, "0" * 64))
    with pytest.raises(ValueError, match="not the bound of this network"):
        ServedModel.load(tmp_path / "plain")
    # after a swap the version answers in noise-all mode: nothing certified
    model.learner.delete(["r010"])
    assert not model.guard_complete and not model.certain(X)[1].any()
    assert model.guard_record()["mode"] == "noise-all"


@pytest.mark.slow
def test_a_loo_set_too_large_for_the_cpu_is_not_trained(monkeypatch) -> None:
    """The guard job does not train a LOO set estimated above LOO_MAX_SECONDS on the CPU
    (it would hold the exactness check back for hours): the network stays in noise-all
    mode, sound, the manifest says why, and the worker does not keep refining it."""
    import jobs.orchestration.served_model as served
    from jobs.orchestration.guard_pass import guard_coarse as _guard_coarse

    ids, X, y = _data()
    model = ServedModel.train("mlp", np.array(ids, dtype=object), X, y,
                              params={**SMALL, "random_state": 3}, fit_guard=False)
    monkeypatch.setattr(served, "LOO_MAX_SECONDS", 0.0)
    model.refresh_guard(bound_s=1.0)
    rec = model.guard_record()
    assert model.learner.loo_ is None and model.noise_all and rec["mode"] == "noise-all"
    assert "LOO set too large" in rec["bound"]["skipped"] and not _guard_coarse(rec)
    assert not model.certain(X)[1].any()
    monkeypatch.setattr(served, "LOO_MAX_SECONDS", 600.0)  # within the cap: bounded
    model.refresh_guard(bound_s=1.0)
    assert model.guard_complete and "skipped" not in model.guard_record()["bound"]


@pytest.mark.slow
def test_the_worker_swaps_a_deletion_in_and_the_guard_job_bounds_the_rest(
        seeded60: Ledger) -> None:
    ledger = seeded60
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    w = Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                         guard_after_idle_s=0.0, shard_bound_s=1.0,
                                         destroy_grace_s=0.0))
    w.bootstrap("mlp", SMALL)
    assert reg.current().manifest["device"] == "cpu"
    _drain(w, timeout_s=120)  # the guard job trains the LOO set and bounds it
    cur = reg.current()
    assert cur.manifest["change"]["op"] == "guard" and cur.manifest["guard"]["mode"] == "sound"

    ledger.receive({"request_id": "d1", "op": "delete", "record_ids": ["r004"]})
    assert w.step()
    cur = reg.current()
    update = cur.manifest["change"]["updates"][0]
    assert update["retrained"] == {"swap": True, "networks": 0}
    assert cur.manifest["guard"]["mode"] == "noise-all"
    assert not reg.load(cur.version).certain(np.random.default_rng(0).random((50, 4)))[1].any()
    holder = ModelHolder(reg)  # the service says so on its dashboard
    assert holder.refresh() and metrics.GUARD_MODE._value.get() == 0.0

    _drain(w, timeout_s=120)
    cur = reg.current()
    assert cur.manifest["change"]["op"] == "guard" and cur.manifest["guard"]["mode"] == "sound"
    assert holder.refresh() and metrics.GUARD_MODE._value.get() == 1.0
    assert [e["kind"] for e in _events(ledger, "d1")][-1] == "verified"
    verified = [e for e in _events(ledger, "d1") if e["kind"] == "verified"][0]
    assert verified["payload"]["exactness"]["exact"] is True
    model = reg.load(cur.version)
    assert "r004" not in model.learner.record_ids_.tolist()
    assert "r004" not in model.learner.loo_.record_ids.tolist()
    # no stored file holds r004: the served version's LOO set is of the records left, and
    # the versions before the deletion are destroyed (the loop a deployed worker runs)
    w.run(max_seconds=2.0)
    X, _ = ledger.records.data([f"r{i:03d}" for i in range(60) if i != 4])
    gone_x = np.random.default_rng(0).random((60, 4))[4]  # conftest.seed's features of r004
    assert TraceScanner({"r004": gone_x}, kept=X).scan_model_store(reg) == []


def _served_where(sc, done, timeout_s: float = 180.0) -> dict:  # noqa: ANN001 - Sidecar
    """/v1/models once `done(current manifest)` holds for the version being served."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = sc.models()
        if m["serving"]["version"] == m["current"]["version"] and done(m["current"]["manifest"]):
            return m
        time.sleep(0.3)
    raise AssertionError(f"not served in {timeout_s:.0f} s: {m['current']['manifest']['guard']}")


@pytest.mark.processes
def test_obliviate_serve_and_worker_swap_a_deletion_in_and_bound_it_again(tmp_path) -> None:
    """From the real processes: the worker's guard job bounds the network, `obliviate
    serve` answers certified labels with it; a deletion is a swap served in noise-all mode,
    then the guard job bounds the new network and certified answers come back."""
    from tests.sidecar import Sidecar

    with Sidecar(tmp_path, learner="mlp") as sc:
        sc.start_worker("--shard-bound", "1")
        _served_where(sc, lambda man: man["guard"]["mode"] == "sound")
        X = datasets.load(sc.dataset).X[:40]  # the model's input space
        assert sc.predict(X)["guard"] == "sound"
        assert sc.submit({"request_id": "d1", "op": "delete",
                          "record_ids": ["r001"]}).status_code == 202
        m = _served_where(sc, lambda man: man["change"]["op"] == "update")
        update = m["current"]["manifest"]
        assert update["change"]["updates"][0]["retrained"] == {"swap": True, "networks": 0}
        assert update["guard"]["mode"] == "noise-all"
        _served_where(sc, lambda man: man["guard"]["mode"] == "sound"
                      and man["training_set"]["count"] == update["training_set"]["count"])
        assert sc.predict(X)["guard"] == "sound"
        assert sc.history("d1")["request"]["status"] == "verified"
