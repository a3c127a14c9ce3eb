"""A worker killed (SIGKILL) mid-update loses nothing and applies nothing twice."""

from __future__ import annotations

import random
import time
import uuid
from pathlib import Path

import pytest

from jobs.orchestration.registry import Registry, VersionUnavailable
from jobs.orchestration.worker import Worker
from ledger.store import Ledger
from service.demo.processes import ManagedProcess
from tests.conftest import HMAC_KEY, seed
from tests.waiting import wait_for

# `obliviate worker` processes, killed
pytestmark = pytest.mark.processes


def _start_worker(db_url: str, model: str, key_file: Path, log: Path, name: str = "crashy",
                  grace_s: float = 30.0) -> ManagedProcess:
    # BENTOML_HOME comes from this process (conftest): the test loads what the worker saves
    env = {"OBLIVIATE_DATABASE_URL": db_url, "OBLIVIATE_MODEL_NAME": model,
           "OBLIVIATE_HMAC_KEY_HEX": HMAC_KEY.hex(), "OBLIVIATE_HMAC_KEY_FILE": str(key_file),
           "OBLIVIATE_DESTROY_GRACE_S": str(grace_s)}
    return ManagedProcess(["worker", "--name", name, "--batch-window", "0",
                           "--max-batch", "3", "--metrics-port", "0"], env, log)


def _assert_current_loads_whole(registry: Registry) -> None:
    """The version the pointer names loads with its manifest's hash. Another worker may
    publish a deletion between reading the pointer and loading (the old version is then
    unavailable on purpose, as the service's and worker's loaders expect): read again."""
    for _ in range(20):
        cur = registry.current()
        try:
            model = registry.load(cur.version)
        except VersionUnavailable:
            assert registry.current().seq > cur.seq, f"{cur.version} unavailable while current"
            continue
        assert model.learner.content_hash() == cur.manifest["content_hash"]
        return
    raise AssertionError("the current version never loaded: it moved on 20 reads in a row")


def test_sigkill_at_any_point_loses_nothing(db_url: str, tmp_path: Path) -> None:
    ledger = Ledger(db_url, HMAC_KEY)
    seed(ledger, n=120)
    model = f"m{uuid.uuid4().hex[:8]}"
    registry = Registry(ledger.engine, model)
    Worker(ledger, registry).bootstrap("dare", {"n_estimators": 20, "max_depth": 6, "k": 5})
    rng = random.Random(7)
    log = tmp_path / "worker.log"
    sent: list[str] = []
    next_record = 0
    for wave in range(6):
        for _ in range(6):
            rid = f"del-{wave}-{len(sent)}"
            res = ledger.receive({"request_id": rid, "op": "delete",
                                  "record_ids": [f"r{next_record:03d}"]})
            assert res.status == "accepted"
            sent.append(rid)
            next_record += 1
        proc = _start_worker(db_url, model, tmp_path / "k", log)
        try:
            # kill somewhere inside the work on this wave: after a claim, at a random moment
            wait_for(lambda w=wave: any(ledger.history(r)["request"]["status"] != "received"
                                         for r in sent if r.startswith(f"del-{w}-")),
                      60, "the worker to claim")
            time.sleep(rng.uniform(0.0, 0.8))
        finally:
            proc.kill()  # SIGKILL to the worker and its guard process
        # whatever the moment, the current version loads whole
        cur = registry.current()
        assert registry.load(cur.version).learner.content_hash() == cur.manifest["content_hash"]

    proc = _start_worker(db_url, model, tmp_path / "k", log)
    try:
        wait_for(lambda: all(ledger.history(r)["request"]["status"] == "verified"
                              for r in sent), 120, "every request to be verified")
    finally:
        assert proc.stop(timeout_s=30) == 0, proc.log_tail()

    for rid in sent:
        kinds = [e["kind"] for e in ledger.history(rid)["events"]]
        assert kinds.count("applied") == 1, (rid, kinds)
        assert kinds.count("verified") == 1, (rid, kinds)
    chain = registry.lineage(1000)
    assert all(v.parent == older.version for v, older in zip(chain, chain[1:], strict=False))
    served = registry.load(chain[0].version)
    live = ledger.records.live()
    assert sorted(served.learner.record_ids_.tolist()) == sorted(live.record_ids.tolist())
    assert served.learner.verify().exact
    assert ledger.verify().ok
    ledger.close()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_three_workers_killed_at_random_keep_one_linear_lineage(db_url: str,
                                                                 tmp_path: Path) -> None:
    """Several workers on PostgreSQL (deploy/k8s/worker.yaml runs replicas): version numbers
    are allocated atomically, no worker removes a version another published, every request
    is applied exactly once, and versions that held deleted records are destroyed once."""
    ledger = Ledger(db_url, HMAC_KEY)
    seed(ledger, n=150)
    model = f"m{uuid.uuid4().hex[:8]}"
    registry = Registry(ledger.engine, model)
    Worker(ledger, registry).bootstrap("dare", {"n_estimators": 10, "max_depth": 5, "k": 5})
    rng = random.Random(11)

    def start(i: int) -> ManagedProcess:
        return _start_worker(db_url, model, tmp_path / "k", tmp_path / f"worker{i}.log",
                             name=f"w{i}", grace_s=1.0)

    procs = {i: start(i) for i in range(3)}
    wait_for(lambda: all("started" in p.log_tail() for p in procs.values()), 120,
              "three workers to start")
    sent: list[str] = []
    try:
        for wave in range(10):
            for _ in range(9):  # three claims of three: the workers build side by side
                rid = f"del-{len(sent)}"
                assert ledger.receive({"request_id": rid, "op": "delete",
                                       "record_ids": [f"r{len(sent):03d}"]}
                                      ).status == "accepted"
                sent.append(rid)
            time.sleep(rng.uniform(0.1, 1.0))
            if wave % 2:
                victim = rng.randrange(3)
                procs[victim].kill()
                procs[victim] = start(victim)
            if wave % 3 == 2:  # now and then the current version must load whole
                _assert_current_loads_whole(registry)
        wait_for(lambda: all(ledger.history(r)["request"]["status"] == "verified"
                              for r in sent), 240, "every request to be verified")
        # the grace period, and a retention pass of some worker
        wait_for(lambda: all(v.destroyed_at is not None for v in registry.lineage(1000)
                             if v.superseded_by_deletion), 60,
                 "every version a deletion superseded to be destroyed")
    finally:
        for p in procs.values():
            p.kill()

    for rid in sent:
        kinds = [e["kind"] for e in ledger.history(rid)["events"]]
        assert kinds.count("applied") == 1 and kinds.count("verified") == 1, (rid, kinds)
    chain = registry.lineage(1000)
    assert all(v.parent == older.version and v.seq > older.seq
               for v, older in zip(chain, chain[1:], strict=False)), "one linear lineage"
    cur = registry.current()
    assert cur.version == chain[0].version
    served = registry.load(cur.version)  # the pointer's version loads, holding the live set
    assert sorted(served.learner.record_ids_.tolist()) == sorted(
        ledger.records.live().record_ids.tolist())
    stored = set(registry.stored_versions())
    for v in chain:
        if v.destroyed_at is None and v.superseded_by_deletion is None:
            assert v.version in stored and registry.load(v.version) is not None
        elif v.destroyed_at is not None:
            assert v.version not in stored
    destroyed = [e["model_version"] for e in ledger.events.export() if e["kind"] == "destroyed"]
    assert len(destroyed) == len(set(destroyed)), "a version destroyed twice"
    assert ledger.verify().ok
    ledger.close()
