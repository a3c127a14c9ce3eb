"""Private prediction mode in the sidecar: seed lineages, their budget, fresh seeds when spent."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest

from jobs.adaptive.budget import BudgetExhausted, BudgetPolicy, SeedBudgets
from jobs.adaptive.composition import epsilon_spent
from jobs.orchestration.registry import PublishConflict, Registry
from jobs.orchestration.worker import Worker, WorkerConfig
from ledger.store import Ledger
from service.model_holder import ModelHolder
from tests.sidecar import Sidecar

SISA = {"n_shards": 3, "epochs_per_slice": 3, "hidden": [8]}
# eps0 = 0.5, (eps, delta) = (2, 1e-5): 4 answers (with so few, delta 1e-5 buys nothing
# over the basic composition: 5 answers are (1.5, 0.059)- or (2.5, 0)-DP)
POLICY = BudgetPolicy(epsilon_per_answer=0.5, epsilon_budget=2.0, delta=1e-5)


def _worker(ledger: Ledger, reg: Registry, budget: BudgetPolicy | None = POLICY) -> Worker:
    return Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                            guard_after_idle_s=0.0, budget=budget))


def _holder(reg: Registry, ledger: Ledger) -> ModelHolder:
    return ModelHolder(reg, budgets=SeedBudgets(ledger.engine, reg.name), reserve_block=1,
                       noise_secret=b"test-noise")


def _queries(n: int) -> np.ndarray:
    return np.random.default_rng(1).random((n, 4))


def test_policy_allows_what_the_composition_allows() -> None:
    n = POLICY.answers_allowed
    assert n == 4
    assert epsilon_spent(n, 0.5, 1e-5) <= 2.0 < epsilon_spent(n + 1, 0.5, 1e-5)


def test_reservations_never_exceed_the_budget(ledger: Ledger) -> None:
    budgets = SeedBudgets(ledger.engine, "m")
    with ledger.engine.begin() as conn:
        budgets.open(conn, "v000001", BudgetPolicy(0.01, 1.0, 1e-6))
    allowed = budgets.get("v000001").answers_allowed
    granted: list[int] = []

    def take() -> None:
        while (g := budgets.reserve("v000001", 7)) > 0:
            granted.append(g)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    b = budgets.get("v000001")
    assert sum(granted) == allowed == b.answers_reserved and b.exhausted
    assert b.spent_ratio <= 1.0 and b.epsilon_spent <= 1.0
    assert budgets.reserve("v000001", 1) == 0
    with pytest.raises(KeyError):
        budgets.reserve("v999999", 1)


def test_answers_are_private_votes_until_the_budget_is_spent(seeded60: Ledger) -> None:
    ledger = seeded60
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    w = _worker(ledger, reg)
    v1 = w.bootstrap("sisa", SISA)
    assert reg.current().manifest["seed_lineage"] == v1
    holder = _holder(reg, ledger)
    holder.refresh()
    assert holder.serving.mode == "private"
    assert w.step() is False  # nothing spent: no retrain
    Q = _queries(4)
    labels = holder.predict(Q[:3])[0]
    assert w.step() is False  # 3 of 4 answers spent: still no retrain
    labels = holder.predict(Q)[0]  # the 4th fresh answer: the whole budget
    assert set(labels.tolist()) <= set(holder.serving.model.classes.tolist())
    again = holder.predict(Q[::-1])[0]  # replays from the memo cost nothing
    assert again.tolist() == labels[::-1].tolist()
    with pytest.raises(BudgetExhausted, match="fresh seeds"):
        holder.predict(_queries(5)[4:])
    assert SeedBudgets(ledger.engine, reg.name).get(v1).exhausted

    # the worker retrains on fresh seeds, once, and says why
    assert w.step() is True
    cur = reg.current()
    assert cur.manifest["change"]["op"] == "retrain" and cur.manifest["seed_lineage"] == cur.version
    assert cur.manifest["seed"] != reg.get(v1).manifest["seed"]
    events = [e for e in ledger.events.export() if e["kind"] == "seeds_rotated"]
    assert len(events) == 1 and events[0]["model_version"] == cur.version
    reason = events[0]["payload"]["change"]["reason"]
    assert reason["lineage"] == v1 and reason["answers"] == 4
    assert reason["epsilon_spent"] <= reason["epsilon_budget"]
    assert w.step() is False  # the new lineage has its whole budget
    holder.refresh()
    assert holder.predict(_queries(5)[4:])[1].version.version == cur.version

    # updates keep the lineage (the seeds did not change)
    ledger.receive({"request_id": "d1", "op": "delete", "record_ids": ["r001"]})
    w.step()
    assert reg.current().manifest["seed_lineage"] == cur.version


def test_a_crash_before_the_retrain_is_published_loses_nothing(seeded60: Ledger,
                                                               monkeypatch) -> None:
    ledger = seeded60
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    v1 = _worker(ledger, reg).bootstrap("sisa", SISA)
    budgets = SeedBudgets(ledger.engine, reg.name)
    budgets.reserve(v1, 10**6)

    def die(*args, **kwargs):
        raise RuntimeError("worker killed")

    crashing = _worker(ledger, reg)
    monkeypatch.setattr(crashing.registry, "publish", die)
    assert crashing.step() is False  # a pass that fails never raises: logged, retried
    monkeypatch.undo()
    assert reg.current().version == v1  # nothing half-published
    assert len(reg.stored_versions()) == 2  # the crashed worker's unpublished files
    restarted = _worker(ledger, reg)
    assert restarted.step() is True  # the retrain on fresh seeds
    time.sleep(1.05)  # the retention pass runs at most once a second
    assert restarted.step() is True  # it sweeps the crashed files (a later seq published)
    assert restarted.step() is False
    kinds = [e["kind"] for e in ledger.events.export()]
    assert kinds.count("seeds_rotated") == 1
    assert reg.current().manifest["seed_lineage"] == reg.current().version


def test_private_mode_starts_on_fresh_seeds(seeded60: Ledger) -> None:
    """A version trained before private mode has no lineage: its seeds may be exposed."""
    ledger = seeded60
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    v1 = _worker(ledger, reg, budget=None).bootstrap("sisa", SISA)
    holder = _holder(reg, ledger)
    holder.refresh()
    with pytest.raises(BudgetExhausted, match="no seed lineage"):
        holder.predict(_queries(1))
    w = _worker(ledger, reg)
    assert w.step() is True
    cur = reg.current()
    assert cur.version != v1 and cur.manifest["seed_lineage"] == cur.version
    why = cur.manifest["change"]["reason"]["why"]
    assert "no seed lineage" in why


def test_a_lost_publication_race_is_retried_on_the_new_version(seeded60: Ledger,
                                                               monkeypatch) -> None:
    ledger = seeded60
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    v1 = _worker(ledger, reg).bootstrap("sisa", SISA)
    SeedBudgets(ledger.engine, reg.name).reserve(v1, 10**6)
    w = _worker(ledger, reg)

    def lose(*args, **kwargs):
        raise PublishConflict("another worker published first")

    monkeypatch.setattr(w.registry, "publish", lose)
    assert w.step() is True  # lost: nothing changes
    monkeypatch.undo()
    assert reg.current().version == v1
    assert w.step() is True and reg.current().manifest["change"]["op"] == "retrain"


@pytest.mark.processes
def test_over_http_answers_stop_at_the_budget_and_resume_on_fresh_seeds(tmp_path) -> None:
    env = {"OBLIVIATE_ANSWERS": "private", "OBLIVIATE_PRIVATE_EPSILON": "0.5",
           "OBLIVIATE_SEED_EPSILON_BUDGET": "2.0", "OBLIVIATE_SEED_DELTA": "1e-5"}
    with Sidecar(tmp_path, learner="sisa", env=env,
                 train_params='{"n_shards": 3, "epochs_per_slice": 3}') as sc:
        rows = np.random.default_rng(2).random((5, 30)).round(4).tolist()
        r = sc.http.post("/v1/predict", json={"instances": rows[:4]})
        assert r.status_code == 200 and r.json()["guard"] == "private"
        v1 = r.json()["model_version"]
        assert sc.http.post("/v1/predict", json={"instances": rows[:2]}).status_code == 200
        r = sc.http.post("/v1/predict", json={"instances": rows[4:]})
        assert r.status_code == 429 and "fresh seeds" in r.text
        metrics = sc.http.get("/metrics").text
        assert "obliviate_adaptive_budget_spent_ratio 1.0" in metrics
        assert "obliviate_guard_refit_pending 0.0" in metrics  # noised by design: no alert
        sc.start_worker()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            r = sc.http.post("/v1/predict", json={"instances": rows[4:]})
            if r.status_code == 200 and r.json()["model_version"] != v1:
                break
            time.sleep(0.5)
        assert r.status_code == 200 and r.json()["model_version"] != v1, r.text
        # a deletion: the public lineage does not say which shard held the record
        assert sc.submit({"request_id": "http-d1", "op": "delete",
                          "record_ids": ["r001"]}).status_code == 202
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            versions = sc.get("/v1/models/lineage", admin=False).json()["versions"]
            ops = [v["manifest"]["change"]["op"] for v in versions]
            if "update" in ops:
                break
            time.sleep(0.5)
        assert "update" in ops, ops
        assert not _keys(versions) & SEED_DEPENDENT, _keys(versions) & SEED_DEPENDENT
        full = sc.get("/v1/models/lineage").json()["versions"]
        assert {"shards", "from_slice"} <= _keys(full)


# what names, or follows from, the shard a record is in: the shard seeds decide it
SEED_DEPENDENT = {"retrained", "shards", "shard", "from_slice", "records_in_retrained_shards",
                  "bound", "beta", "metrics", "seconds", "train_seconds", "shards_checked",
                  "mismatched_checkpoints", "served_differs_from_checkpoint"}


def _keys(doc: object) -> set[str]:
    """Every key of a JSON document, at any depth."""
    if isinstance(doc, dict):
        return set(doc).union(*map(_keys, doc.values()))
    if isinstance(doc, list):
        return set().union(*map(_keys, doc))
    return set()


@pytest.mark.slow
def test_the_public_sees_no_seed_dependent_field_in_private_mode(seeded60: Ledger) -> None:
    """Issue 26: the public lineage named the shards each deleted or added record was
    retrained in (`retrained.shards`, `from_slice`, `records_in_retrained_shards`), and
    each shard's bound; the admin still sees them all."""
    from starlette.testclient import TestClient

    from service.http_api import AppContext, build_app

    ledger = seeded60
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}")
    w = Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                         guard_after_idle_s=0.0, budget=POLICY,
                                         shard_bound_s=1.0))
    w.bootstrap("sisa", {**SISA, "n_slices": 2})
    ledger.receive({"request_id": "d1", "op": "delete", "record_ids": ["r001"]})
    ledger.receive({"request_id": "a1", "op": "add", "subject_id": "s99", "payload": {
        "records": [{"record_id": "n1", "features": [0.1, 0.2, 0.3, 0.4], "label": 1}]}})
    deadline = time.monotonic() + 120  # the update, then the shards' bounds and the check
    while reg.current().manifest["change"]["op"] != "guard" and time.monotonic() < deadline:
        if not w.step():
            time.sleep(0.05)
    token = "private-mode-admin-token-0123456789"
    app = build_app(AppContext(ledger=ledger, registry=reg, admin_token=token, private=True,
                               status=lambda: {"mode": "private"}))
    with TestClient(app) as client:
        public = [client.get(p).json() for p in ("/v1/models", "/v1/models/lineage",
                                                  "/v1/ledger/heads", "/v1/schema")]
        admin = client.get("/v1/models/lineage",
                           headers={"Authorization": f"Bearer {token}"}).json()
    assert not _keys(public) & SEED_DEPENDENT, _keys(public) & SEED_DEPENDENT
    ops = [v["manifest"]["change"]["op"] for v in public[1]["versions"]]
    assert "update" in ops and "guard" in ops, ops
    refit = public[1]["versions"][0]["manifest"]["change"]
    assert refit["op"] == "guard" and refit["guard"] == {
        "rule": "sisa-vote", "ready": True, "n_shards": 3, "shard_bound": "per-shard"}, refit
    update = next(v["manifest"] for v in public[1]["versions"]
                  if v["manifest"]["change"]["op"] == "update")
    assert update["change"] == {"op": "update", "requests": 2, "updates": [
        {"op": "add", "n_records": 1, "guarantee": "exact"},
        {"op": "delete", "n_records": 1, "guarantee": "exact"}],
        "guard": {"rule": "sisa-vote", "ready": True, "n_shards": 3,
                  "shard_bound": "per-shard"}}
    assert update["guard"] == update["change"]["guard"]
    assert update["training_set"]["count"] == 60
    full = next(v["manifest"] for v in admin["versions"]
                if v["manifest"]["change"]["op"] == "update")
    assert {"shards", "from_slice", "records_in_retrained_shards", "bound"} <= _keys(full)
