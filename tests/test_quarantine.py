"""No request stops the worker: a request the learner cannot take is quarantined (failed,
with the reason), the deletions behind it are applied and verified as usual, and an error
that is no request's fault (the disk, the database) fails nothing and is retried."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import text

from jobs.orchestration import worker_metrics as metrics
from jobs.orchestration.registry import Registry
from jobs.orchestration.worker import Worker, WorkerConfig
from ledger.store import Ledger
from service.demo.processes import ManagedProcess
from tests.conftest import HMAC_KEY, seed
from tests.waiting import wait_for

PARAMS = {"dare": {"n_estimators": 8, "max_depth": 4, "k": 5},
          "sisa": {"n_shards": 3, "epochs_per_slice": 3, "hidden": [8]},
          "mlp": {"hidden": [8], "epochs": 6, "batch_size": 8},
          "game": {"hidden": [8], "epochs": 5, "rounds": 5, "attack_steps": 50,
                   "third_fraction": 0.25}}
# What the learners refuse, as the ledger's payload row holds features (float64 bytes):
# features beyond float32 (the network learners train in float32), and for DaRE, which
# takes any finite float64, an infinity
POISON = {"dare": [np.inf, 0.5, 0.5, 0.5], "sisa": [1e40, 0.5, 0.5, 0.5],
          "mlp": [1e40, 0.5, 0.5, 0.5], "game": [1e40, 0.5, 0.5, 0.5]}


def _worker(ledger: Ledger, store: str | None = None, **config: float) -> Worker:
    """`store`: a model store of the test's own (default: the session's, which the other
    pytest-xdist process writes to as well)."""
    reg = Registry(ledger.engine, name=f"m{uuid.uuid4().hex[:8]}", store=store)
    return Worker(ledger, reg, WorkerConfig(name="w1", batch_window_s=0.0, guard_process=False,
                                            guard_after_idle_s=0.0, **config))


def _drain(worker: Worker, timeout_s: float = 90.0) -> None:
    """Step until nothing is left to do; every pass must go through (no back-off)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        did = worker.step()
        assert worker.trouble.in_a_row == 0, "a pass failed"
        if not did:
            if not worker.busy:
                return
            time.sleep(0.02)
    raise AssertionError("the worker did not run out of work")


def add(ledger: Ledger, request_id: str, record_id: str,
        poison: list[float] | None = None) -> None:
    """An addition of one record; with `poison`, its stored data is replaced by those
    features, in the clear, as a ledger written before intake refused such values (and
    before additions were sealed) would hold them."""
    res = ledger.receive({"request_id": request_id, "op": "add", "subject_id": "snew",
                          "payload": {"records": [{"record_id": record_id,
                                                   "features": [0.5, 0.5, 0.5, 0.5],
                                                   "label": 1}]}})
    assert res.status == "accepted", res.reason
    if poison is not None:
        with ledger.engine.begin() as conn:
            conn.execute(text("DELETE FROM sealed_payloads WHERE record_id = :r"),
                         {"r": record_id})
            conn.execute(text("INSERT INTO record_payloads (record_id, features, label) "
                              "VALUES (:r, :f, 1)"),
                         {"f": np.array(poison, dtype="<f8").tobytes(), "r": record_id})


def delete(ledger: Ledger, request_id: str, *record_ids: str) -> None:
    res = ledger.receive({"request_id": request_id, "op": "delete",
                          "record_ids": list(record_ids)})
    assert res.status == "accepted", res.reason


def status(ledger: Ledger, request_id: str) -> str:
    return ledger.history(request_id)["request"]["status"]


def quarantined(op: str = "add") -> float:
    return metrics.QUARANTINED.labels(op=op)._value.get()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dare", "sisa", "mlp", "game"])
def test_a_poison_addition_is_quarantined_and_the_deletion_behind_it_verified(
        seeded60: Ledger, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    ledger = seeded60
    w = _worker(ledger)
    w.bootstrap(kind, PARAMS[kind])
    before = quarantined()
    add(ledger, "p1", "n1", POISON[kind])
    delete(ledger, "d1", "r001")
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, "obliviate.worker"):
        _drain(w)  # one batch: the addition raises in the learner, the deletion does not
    assert status(ledger, "d1") == "verified"
    assert time.monotonic() - t0 < 60
    failed = [e for e in ledger.history("p1")["events"] if e["kind"] == "failed"]
    assert status(ledger, "p1") == "failed" and len(failed) == 1
    assert failed[0]["payload"]["reason"].startswith("the learner cannot apply it: ")
    assert quarantined() == before + 1
    served = w.registry.load(w.registry.current().version)
    ids = set(served.learner.record_ids_.tolist())
    assert "r001" not in ids and "n1" not in ids
    # the log line names no request or record
    line = next(r.getMessage() for r in caplog.records if "quarantined" in r.getMessage())
    assert "p1" not in line and "n1" not in line
    # the next requests flow as usual, on the next batch
    delete(ledger, "d2", "r002")
    _drain(w)
    assert status(ledger, "d2") == "verified"


def test_the_good_requests_of_a_batch_are_applied_around_the_poison(seeded60: Ledger
                                                                    ) -> None:
    """Two poison additions among good additions and deletions, claimed as one batch: the
    batch is halved down to the two, which fail; everything else is applied and verified,
    and a deletion of a record only a quarantined addition named fails with its reason."""
    ledger = seeded60
    w = _worker(ledger)
    w.bootstrap("sisa", PARAMS["sisa"])
    before = quarantined()
    add(ledger, "a1", "n1")
    add(ledger, "p1", "n2", POISON["sisa"])
    delete(ledger, "d1", "r001", "r002")
    add(ledger, "a2", "n3")
    add(ledger, "p2", "n4", POISON["sisa"])
    delete(ledger, "d2", "r003")
    delete(ledger, "d3", "n4")
    _drain(w)
    assert {r: status(ledger, r) for r in ("a1", "p1", "d1", "a2", "p2", "d2", "d3")} == {
        "a1": "verified", "p1": "failed", "d1": "verified", "a2": "verified",
        "p2": "failed", "d2": "verified", "d3": "failed"}
    assert quarantined() == before + 2
    applied = {e["model_version"] for r in ("a1", "d1", "a2", "d2")
               for e in ledger.history(r)["events"] if e["kind"] == "applied"}
    assert len(applied) == 1  # one version for the whole batch
    served = w.registry.load(w.registry.current().version)
    ids = set(served.learner.record_ids_.tolist())
    assert {"n1", "n3"} <= ids and not {"n2", "n4", "r001", "r002", "r003"} & ids
    assert served.learner.verify().exact


@pytest.mark.slow
def test_a_disk_that_fails_fails_no_request_and_the_worker_retries(
        seeded60: Ledger, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """The model store cannot be written (its staging directory is a file): the pass fails
    through no request's fault, so nothing is marked failed, the error is counted and
    logged in one line, the worker backs off; once the disk is back the deletion goes
    through."""
    ledger = seeded60
    # its own store: the session's staging directory is the other test process's too,
    # which recreated it between the rename below and the file written in its place
    w = _worker(ledger, store=str(tmp_path / "models"), backoff_s=0.05, max_backoff_s=0.2)
    w.bootstrap("dare", PARAMS["dare"])
    staging = w.registry.store.home / "obliviate-staging"
    aside = staging.with_name(f"staging-aside-{uuid.uuid4().hex[:6]}")
    if staging.exists():
        staging.rename(aside)
    errors = metrics.PASS_ERRORS._value.get()
    delete(ledger, "d1", "r001")
    try:
        staging.write_bytes(b"not a directory")
        with caplog.at_level(logging.INFO, "obliviate.worker"):
            for _ in range(3):
                assert w.step() is False  # failed (never raised), or still backing off
                time.sleep(0.25)
        assert status(ledger, "d1") == "claimed"
        assert metrics.PASS_ERRORS._value.get() >= errors + 2
        assert w.trouble.in_a_row >= 2
        lines = [r for r in caplog.records if "through no request's fault" in r.getMessage()]
        assert lines and all(r.exc_info is None for r in lines)
    finally:
        staging.unlink()
        if aside.exists():
            aside.rename(staging)
    wait_for(lambda: not w.trouble.waiting(), 10, "the worker's back-off to end")
    _drain(w)
    assert status(ledger, "d1") == "verified"
    kinds = [e["kind"] for e in ledger.history("d1")["events"]]
    assert "failed" not in kinds and kinds.count("applied") == 1


@pytest.mark.processes
def test_the_real_worker_quarantines_and_keeps_forgetting(db_url: str, tmp_path: Path
                                                          ) -> None:
    """`obliviate worker` (SISA, which used to exit on such an addition and exit again on
    every restart): the poison fails, the deletions before and after it are verified, and
    the process is still running."""
    ledger = Ledger(db_url, HMAC_KEY)
    seed(ledger, n=60)
    model = f"m{uuid.uuid4().hex[:8]}"
    Worker(ledger, Registry(ledger.engine, model)).bootstrap("sisa", PARAMS["sisa"])
    add(ledger, "p1", "n1", POISON["sisa"])
    delete(ledger, "d1", "r001")
    env = {"OBLIVIATE_DATABASE_URL": db_url, "OBLIVIATE_MODEL_NAME": model,
           "OBLIVIATE_HMAC_KEY_HEX": HMAC_KEY.hex(),
           "OBLIVIATE_HMAC_KEY_FILE": str(tmp_path / "k")}
    proc = ManagedProcess(["worker", "--name", "real", "--batch-window", "0",
                           "--metrics-port", "0", "--shard-bound", "0"], env,
                          tmp_path / "worker.log")
    try:
        end = time.monotonic() + 120
        while status(ledger, "d1") != "verified":
            assert proc.running(), proc.log_tail()
            assert time.monotonic() < end, proc.log_tail()
            time.sleep(0.2)
        assert status(ledger, "p1") == "failed"
        delete(ledger, "d2", "r002")
        end = time.monotonic() + 60
        while status(ledger, "d2") != "verified":
            assert proc.running(), proc.log_tail()
            assert time.monotonic() < end, proc.log_tail()
            time.sleep(0.2)
    finally:
        rc = proc.stop(timeout_s=30)
    log = (tmp_path / "worker.log").read_text()
    assert rc == 0, log[-3000:]
    assert "quarantined a request (add) the learner cannot apply" in log
    assert "Traceback" not in log
    ledger.close()
