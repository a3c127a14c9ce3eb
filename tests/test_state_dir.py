"""State in one place: a ledger's model versions live beside it, under its identity.

The real `obliviate` commands, each in its own working directory with the default
state dir (`.obliviate/`), on one machine and one BENTOML_HOME:

- starting over works: init, train, verify; `rm -rf .obliviate`; init and train again
  (no "v000001 is in the store already"), and verify says OK;
- a second ledger beside it, sharing the first one's model store directory: both
  verify OK (neither takes the other's v000001 for an edited manifest), and both
  workers keep running through a deletion, each publishing its own v000002.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from service.demo.processes import OBLIVIATE, ManagedProcess
from tests.sidecar import PRIVATE_ENV, without_private_env
from tests.waiting import wait_for

# `obliviate` commands and workers, as processes
pytestmark = pytest.mark.processes

TRAIN = ("model", "train", "--learner", "sisa", "--params", '{"n_shards": 2}')


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    """The caller's environment without its OBLIVIATE_*/BENTOML_* settings: the defaults,
    one BENTOML_HOME for every ledger of the test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(PRIVATE_ENV)}
    return {**env, "BENTOML_HOME": str(tmp / "bentoml"), "BENTOML_DO_NOT_TRACK": "true",
            **extra}


def _run(cwd: Path, env: dict[str, str], *args: str) -> str:
    out = subprocess.run([*OBLIVIATE, *args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, f"obliviate {' '.join(args)}: {out.stderr[-3000:]}"
    return out.stdout


def _start(cwd: Path, env: dict[str, str]) -> None:
    _run(cwd, env, "ledger", "init", "--dataset", "iris")
    assert "current version: v000001" in _run(cwd, env, *TRAIN)
    assert "ledger OK" in _run(cwd, env, "ledger", "verify")


def _current(cwd: Path, env: dict[str, str]) -> str:
    return json.loads(_run(cwd, env, "model", "show"))["version"]


def test_starting_over_and_two_ledgers_side_by_side(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    env_a = _env(tmp_path)
    _start(a, env_a)
    assert list((a / ".obliviate" / "models").glob("*/obliviate/v000001"))
    assert not (tmp_path / "bentoml" / "models" / "obliviate").exists()

    shutil.rmtree(a / ".obliviate")  # starting over
    _start(a, env_a)

    # a second ledger in its own state dir, its versions in the first one's store
    env_b = _env(tmp_path, OBLIVIATE_MODEL_STORE=str(a / ".obliviate" / "models"))
    _start(b, env_b)
    assert len(list((a / ".obliviate" / "models").glob("*/obliviate/v000001"))) == 2
    assert "ledger OK" in _run(a, env_a, "ledger", "verify")

    workers = [ManagedProcess(["worker", "--metrics-port", "0", "--batch-window", "0"],
                              env, d / "worker.log", cwd=d,
                              program=(*without_private_env(env), *OBLIVIATE))
               for d, env in ((a, env_a), (b, env_b))]
    try:
        for d, env in ((a, env_a), (b, env_b)):
            _run(d, env, "submit", json.dumps({"request_id": f"del-{d.name}", "op": "delete",
                                               "record_ids": ["r007"]}))
        for d, env in ((a, env_a), (b, env_b)):
            wait_for(lambda d=d, env=env: _current(d, env) >= "v000002", 240,
                     f"{d.name}'s worker to publish a new version")
        assert all(w.running() for w in workers), [w.log_tail() for w in workers]
        for d, env in ((a, env_a), (b, env_b)):
            assert "ledger OK" in _run(d, env, "ledger", "verify")
    finally:
        for w in workers:
            w.stop()
