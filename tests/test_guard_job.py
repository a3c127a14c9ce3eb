"""Guard jobs in the worker's warm process: results, reuse, cancellation, a dead process."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_breast_cancer

from jobs import sealing
from jobs.orchestration.guard_job import GuardJob, GuardProcess
from jobs.orchestration.served_model import ServedModel

# the guard's own process, spawned, cancelled and killed
pytestmark = pytest.mark.processes

KEY = sealing.new_key()


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A version's directory, and what the worker passes with it: its manifest."""
    X, y = load_breast_cancer(return_X_y=True)
    X = (X - X.min(0)) / np.ptp(X, 0)
    ids = np.array([f"r{i:03d}" for i in range(150)], dtype=object)
    model = ServedModel.train("dare", ids, X[:150], y[:150],
                              {"n_estimators": 5, "max_depth": 4, "k": 5}, fit_guard=False)
    path = tmp_path_factory.mktemp("version")
    with sealing.sealed_with(KEY):  # as the registry stores a version
        model.save(path)
    return path, {"learner": "dare", "content_hash": model.learner.content_hash(),
                  "guard": {"content_hash": model.guard_hash()}}


def _wait(job: GuardJob, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while not job.done():
        assert time.monotonic() < end, "the guard job did not finish"
        time.sleep(0.05)


def test_jobs_run_one_after_another_in_the_same_process(stored: tuple[Path, dict]) -> None:
    version_dir, manifest = stored
    proc = GuardProcess()
    try:
        proc.start()
        pid = proc._proc.pid
        for _ in range(2):
            job = GuardJob("v1", version_dir, KEY, manifest, verify=True, process=proc)
            _wait(job)
            res = job.result()
            assert res.guard["ready"] is True and res.check["exact"] is True
            assert res.guard_dir.is_dir()
            job.discard()
            assert proc._proc.pid == pid  # warm: no new process per job
        GuardJob("v1", version_dir, KEY, manifest, verify=True, process=proc)
        with pytest.raises(RuntimeError, match="still running"):
            GuardJob("v1", version_dir, KEY, manifest, verify=True, process=proc)
    finally:
        proc.close()
    assert proc._proc is None


def test_a_cancelled_job_takes_its_process_along_and_a_fresh_one_waits(
        stored: tuple[Path, dict]) -> None:
    version_dir, manifest = stored
    proc = GuardProcess()
    try:
        job = GuardJob("v1", version_dir, KEY, manifest, verify=True, process=proc)
        old = proc._proc
        job.cancel()
        assert not old.is_alive() and not job.dir.exists()
        assert proc._proc is not old and proc._proc.is_alive()
        job = GuardJob("v2", version_dir, KEY, manifest, verify=False, process=proc)
        _wait(job)
        assert job.result().check == {}
    finally:
        proc.close()


def test_a_process_killed_mid_job_reports_no_result_and_is_replaced(
        stored: tuple[Path, dict]) -> None:
    version_dir, manifest = stored
    proc = GuardProcess()
    try:
        job = GuardJob("v1", version_dir, KEY, manifest, verify=True, process=proc)
        os.kill(proc._proc.pid, 9)
        _wait(job)
        with pytest.raises(RuntimeError, match="died without a result"):
            job.result()
        job = GuardJob("v2", version_dir, KEY, manifest, verify=True, process=proc)
        _wait(job)
        assert job.result().check["exact"] is True
    finally:
        proc.close()
