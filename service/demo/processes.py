"""Starting and stopping the sidecar's processes on one machine (demo, tests, benchmarks).

Each process is the real command a deployment runs (`obliviate serve`, `obliviate
worker`, `obliviate consume`), with its output in a log file, so what is exercised here
is what runs in production. See docs/development.md (What `make demo` does)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


OBLIVIATE = (sys.executable, "-m", "service.cli")


class ManagedProcess:
    """One subprocess (by default `obliviate ARGS`); stopped with SIGTERM, then SIGKILL."""

    def __init__(self, args: list[str], env: Mapping[str, str], log_path: Path,
                 program: Sequence[str] = OBLIVIATE, cwd: Path | None = None) -> None:
        self.args = args
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen([*program, *args], env={**os.environ, **env},
                                         stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                         start_new_session=True)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait_http(self, url: str, timeout_s: float = 90.0) -> None:
        """Wait until `url` answers 200; raise with the log's tail if it never does."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if not self.running():
                raise RuntimeError(f"`{' '.join(self.args)}` exited with "
                                   f"{self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM the process group (BentoML has children); SIGKILL if it lingers."""
        if self.running():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.running():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def sidecar_env(workdir: Path, database_url: str, kafka_bootstrap: str | None = None,
                **settings: str) -> dict[str, str]:
    """Environment for the sidecar's processes: one ledger, one model store, one metrics dir.

    `settings` are more OBLIVIATE_* values by any layer's settings field name (e.g.
    learner="sisa").
    """
    (workdir / "prometheus").mkdir(parents=True, exist_ok=True)
    env = {"OBLIVIATE_DATABASE_URL": database_url,
           "OBLIVIATE_HMAC_KEY_FILE": str(workdir / "hmac.key"),
           "OBLIVIATE_LEDGER_SIGNING_KEY_FILE": str(workdir / "ledger-signing.key"),
           "OBLIVIATE_ADMIN_TOKEN_FILE": str(workdir / "admin.token"),
           "OBLIVIATE_KEY_STORE_DIR": str(workdir / "keys"),
           "OBLIVIATE_MODEL_STORE": str(workdir / "models"),
           "BENTOML_HOME": str(workdir / "bentoml"), "BENTOML_DO_NOT_TRACK": "true",
           "PROMETHEUS_MULTIPROC_DIR": str(workdir / "prometheus")}
    if kafka_bootstrap is not None:
        env["OBLIVIATE_KAFKA_BOOTSTRAP"] = kafka_bootstrap
    env.update({f"OBLIVIATE_{k.upper()}": str(v) for k, v in settings.items()})
    return env


class LocalSidecar:
    """`obliviate serve`, `worker` and (with a broker) `consume`, started and stopped together."""

    def __init__(self, workdir: Path, env: Mapping[str, str], *, consumer: bool = True,
                 worker_args: Sequence[str] = ()) -> None:
        self.workdir = workdir
        self.env = dict(env)
        self.port, self.worker_port, self.consumer_port = free_port(), free_port(), free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._consumer = consumer
        self._worker_args = list(worker_args)
        self.procs: dict[str, ManagedProcess] = {}

    def start(self, timeout_s: float = 120.0) -> LocalSidecar:
        w = self.workdir
        self.procs["service"] = ManagedProcess(["serve", "--port", str(self.port)], self.env,
                                               w / "service.log")
        self.procs["worker"] = ManagedProcess(
            ["worker", "--metrics-port", str(self.worker_port), *self._worker_args], self.env,
            w / "worker.log")
        if self._consumer:
            self.procs["consumer"] = ManagedProcess(
                ["consume", "--metrics-port", str(self.consumer_port)], self.env,
                w / "consumer.log")
        try:
            self.procs["service"].wait_http(f"{self.base_url}/readyz", timeout_s)
        except Exception:
            self.stop()
            raise
        return self

    def dead(self) -> str | None:
        """The name of a process that stopped on its own, if any."""
        return next((name for name, p in self.procs.items() if not p.running()), None)

    def stop(self) -> dict[str, int]:
        return {name: p.stop() for name, p in self.procs.items()}

    def __enter__(self) -> LocalSidecar:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
