"""Every operator error is one line with the fix, from the real command (issue 28).

Each case runs `obliviate` (or `alembic`) as a process and holds it to: exit status
(1: something it needs is not there; 2: a setting or an argument to change), one
line on stderr, no traceback, and the words that say what to change. Covered: a
broker that is not there (within 10 s, naming the address and the setting), a
metrics port in use, an unknown learner parameter, a PostgreSQL database that does
not exist, `alembic` run directly, and the demo given a work dir that holds
something it did not make, or options it does not use.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.demo.processes import OBLIVIATE, free_port
from service.demo.walkthrough import DEMO_MARKER, fresh_workdir
from tests.conftest import _PG_REASON, POSTGRES_URL

# `obliviate` and `alembic` as processes
pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "OBLIVIATE_DATABASE_URL": f"sqlite:///{tmp_path / 'ledger.db'}",
            "OBLIVIATE_HMAC_KEY_FILE": str(tmp_path / "hmac.key"),
            "OBLIVIATE_LEDGER_SIGNING_KEY_FILE": str(tmp_path / "signing.key")}


def one_line_error(env: dict[str, str], *args: str, status: int,
                   program: tuple[str, ...] = OBLIVIATE) -> str:
    """Run the command; assert its exit status and a single line on stderr, no traceback;
    return that line."""
    out = subprocess.run([*program, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == status, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("command", [["produce", "--count", "1"], ["consume"]])
def test_a_broker_that_is_not_there_is_named_within_10_s(env: dict[str, str],
                                                         command: list[str]) -> None:
    address = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    no_metrics = ["--metrics-port", "0"] if command == ["consume"] else []
    line = one_line_error(env, *command, *no_metrics, "--bootstrap", address, status=1)
    assert time.monotonic() - t0 < 10
    assert f"cannot reach a Kafka broker at {address}" in line
    assert "--bootstrap or OBLIVIATE_KAFKA_BOOTSTRAP" in line


@pytest.mark.parametrize(("command", "setting"), [
    (["consume"], "OBLIVIATE_CONSUMER_METRICS_PORT"),
    (["worker"], "OBLIVIATE_WORKER_METRICS_PORT")])
def test_a_metrics_port_in_use_names_the_port_and_the_setting(
        env: dict[str, str], busy_port: int, command: list[str], setting: str) -> None:
    line = one_line_error(env, *command, "--metrics-port", str(busy_port), status=2)
    assert f"cannot serve metrics on 127.0.0.1:{busy_port}" in line
    assert f"--metrics-port or {setting}" in line


def test_an_unknown_learner_parameter_lists_the_valid_ones(env: dict[str, str]) -> None:
    subprocess.run([*OBLIVIATE, "ledger", "init", "--dataset", "iris"], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=120)
    line = one_line_error(env, "model", "train", "--learner", "dare", "--params",
                          '{"bogus": 5}', status=2)
    assert "unknown parameter(s) of the dare learner: 'bogus'" in line
    assert "valid:" in line and "n_estimators" in line and "max_depth" in line


@pytest.mark.skipif(_PG_REASON is not None, reason=str(_PG_REASON))
def test_a_database_that_does_not_exist_says_how_to_create_it(env: dict[str, str],
                                                              tmp_path: Path) -> None:
    url = POSTGRES_URL.rsplit("/", 1)[0] + "/obliviate_not_created"
    env = {**env, "OBLIVIATE_KEY_STORE_DIR": str(tmp_path / "keys")}
    line = one_line_error(env, "ledger", "verify", "--db", url, status=1)
    assert 'database "obliviate_not_created" does not exist' in line
    assert "createdb" in line and "obliviate_not_created`" in line
    assert "server is running" not in line


def test_alembic_run_directly_says_to_run_ledger_migrate(env: dict[str, str]) -> None:
    alembic = str(Path(sys.executable).parent / "alembic")
    line = one_line_error(env, "upgrade", "head", status=2, program=(alembic,))
    assert "obliviate ledger migrate" in line


def test_the_demo_refuses_a_work_dir_it_did_not_make(env: dict[str, str],
                                                     tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    line = one_line_error(env, "demo", "--workdir", str(mine), status=2)
    assert f"--workdir {mine} is not empty and not a previous demo's" in line
    assert (mine / "notes.txt").read_text() == "mine"
    # a previous demo's is emptied and marked again; an empty one is taken
    old = tmp_path / "old"
    old.mkdir()
    (old / DEMO_MARKER).write_text("")
    (old / "ledger.db").write_text("old")
    assert fresh_workdir(old) == old.resolve()
    assert sorted(p.name for p in old.iterdir()) == [DEMO_MARKER]
    assert (fresh_workdir(tmp_path / "new") / DEMO_MARKER).is_file()


def test_the_demo_offers_no_option_it_ignores(env: dict[str, str]) -> None:
    out = subprocess.run([*OBLIVIATE, "demo", "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert not {"--db", "--bootstrap", "--topic"} & set(out.stdout.split())
    line = one_line_error(env, "--db", "sqlite:///x.db", "demo", status=2)
    assert "--db is not used" in line
