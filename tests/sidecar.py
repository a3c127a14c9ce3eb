"""Run the real sidecar in tests: a seeded ledger, a first model version, `obliviate serve`
on a free port, and `obliviate worker` (or any other `obliviate` command) as subprocesses.

Not a test module: end-to-end tests, browser tests and benchmarks import it.

    from tests.sidecar import Sidecar

    with Sidecar(tmp_path, learner="sisa") as sc:          # seeds, trains, serves, waits
        sc.start_worker()
        r = sc.submit({"request_id": "r1", "op": "delete", "record_ids": ["r001"]})
        assert r.status_code == 202
        sc.wait_for_status(["r1"], "verified")
        print(sc.predict([[0.5] * 30]))

The processes are :class:`service.demo.processes.ManagedProcess` es (what the demo and the
benchmarks run), and their environment is :func:`service.demo.processes.sidecar_env` of the
workdir: the ledger URL, an HMAC key file, the admin token file and its own BENTOML_HOME
(the model store the service and the workers share; `bentoml serve` keeps its processes'
metric files in it too). On top (:attr:`Sidecar.env`): the admin token itself, and metrics
ports turned off so that several workers and sidecars can run at once (give one with
``start_worker("--metrics-port", ...)``). OBLIVIATE_*/BENTOML_*/PROMETHEUS_MULTIPROC_DIR
variables of the calling process are not passed on (a developer's shell must not leak into
a test); give extra ones with `env=`. Logs go to ``<workdir>/logs/<name>.log``; failures
quote their tail.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

from service.demo.processes import OBLIVIATE, ManagedProcess, free_port, sidecar_env
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TOKEN = "sidecar-test-admin-token-0123456789"
LIFECYCLE = ("received", "claimed", "applied", "verified")
# the calling process's variables that would configure the sidecar's processes
PRIVATE_ENV = ("OBLIVIATE_", "BENTOML_", "PROMETHEUS_MULTIPROC")
T = TypeVar("T")


class SidecarError(RuntimeError):
    """The sidecar (or one of its processes) did not do what a test waited for."""


def without_private_env(env: Mapping[str, str]) -> tuple[str, ...]:
    """`env -u NAME ...`: a program prefix that drops the caller's OBLIVIATE_*/BENTOML_*
    variables that `env` does not set (ManagedProcess starts from os.environ)."""
    names = sorted(k for k in os.environ if k.startswith(PRIVATE_ENV) and k not in env)
    return ("env", *(a for k in names for a in ("-u", k))) if names else ()


class Proc(ManagedProcess):
    """A named :class:`ManagedProcess` of the sidecar, with what its tests wait on."""

    def __init__(self, name: str, args: Sequence[str], env: Mapping[str, str], cwd: Path,
                 log_path: Path) -> None:
        self.name = name
        self._swept = False
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            log.write(f"$ obliviate {' '.join(args)}\n".encode())
        super().__init__(list(args), env, log_path,
                         program=(*without_private_env(env), *OBLIVIATE), cwd=cwd)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_tail(200 * lines).splitlines()[-lines:])

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for it to exit; SidecarError (with the log tail) on timeout."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise SidecarError(f"{self.name} still running after {timeout_s} s; log "
                               f"{self.log_path}:\n{self.tail()}") from None

    def terminate(self) -> None:
        """SIGTERM to its process group (if it still runs) without waiting; :meth:`stop`
        waits."""
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)

    def stop(self, timeout_s: float = 15.0) -> int:
        """ManagedProcess.stop, then SIGKILL to children that outlived it; idempotent."""
        rc = super().stop(timeout_s)
        if not self._swept:  # once: later the group id may belong to someone else
            self._swept = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        return rc

    def __repr__(self) -> str:
        state = "running" if self.running() else f"exited {self.returncode}"
        return f"Proc({self.name!r}, pid={self.pid}, {state})"


class Sidecar:
    """The real sidecar for one test: see the module docstring.

    Arguments:
        workdir: a directory of its own (pytest's ``tmp_path``); logs, the model store,
            the key file and the SQLite database go there.
        database_url: the ledger; default ``sqlite:///<workdir>/ledger.db``. PostgreSQL
            URLs work too (the caller owns the database/schema).
        learner: the first version's learner (``sisa``, ``dare``, ...).
        dataset: a bundled data set name for ``ledger.datasets.load`` (or ``synthetic``),
            or a ``ledger.datasets.Dataset``.
        admin_token: the bearer token admin endpoints take.
        epsilon: the guard's per-query epsilon (OBLIVIATE_EPSILON), service default if None.
        service_workers: BentoML serving processes.
        kafka_bootstrap: OBLIVIATE_KAFKA_BOOTSTRAP for consumers started with
            :meth:`start_process`.
        train_params: hyperparameters for ``obliviate model train --params``.
        env: further environment variables for every process (win over the defaults).
    """

    def __init__(self, workdir: str | Path, *, database_url: str | None = None,
                 learner: str = "sisa", dataset: Any = "breast_cancer",
                 records_per_subject: int = 3, admin_token: str = DEFAULT_TOKEN,
                 epsilon: float | None = None, service_workers: int = 1,
                 kafka_bootstrap: str | None = None, train_params: str | None = None,
                 host: str = "127.0.0.1", port: int | None = None,
                 env: Mapping[str, str] | None = None, cwd: str | Path = REPO,
                 ready_timeout_s: float = 180.0, stop_timeout_s: float = 15.0,
                 http_timeout_s: float = 30.0) -> None:
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_dir = self.workdir / "logs"
        self.database_url = database_url or f"sqlite:///{self.workdir / 'ledger.db'}"
        self.learner = learner
        self.dataset = dataset
        self.records_per_subject = records_per_subject
        self.admin_token = admin_token
        self.train_params = train_params
        self.host = host
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.cwd = Path(cwd)
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.env = self._environment(epsilon, service_workers, kafka_bootstrap, env or {})
        self.bentoml_home = Path(self.env["BENTOML_HOME"])
        # `bentoml serve` keeps its processes' metric files here (and empties it at start)
        self.prometheus_dir = self.bentoml_home / "prometheus_multiproc_dir"
        self.hmac_key_file = Path(self.env["OBLIVIATE_HMAC_KEY_FILE"])
        self.server: Proc | None = None
        self.workers: list[Proc] = []
        self.procs: list[Proc] = []  # everything started, for close()
        self._counts: dict[str, int] = {}
        self.timings: dict[str, float] = {}  # seconds: seed, train, ready (from start())
        self.http = httpx.Client(base_url=self.url, timeout=http_timeout_s)
        self._closed = False
        atexit.register(self.close)  # no orphaned servers if a test run is interrupted

    # ------------------------------------------------------------------ environment
    def _environment(self, epsilon: float | None, service_workers: int,
                     kafka_bootstrap: str | None, extra: Mapping[str, str]) -> dict[str, str]:
        settings = {"admin_token": self.admin_token, "learner": self.learner,
                    "service_workers": str(service_workers), "worker_metrics_port": "0",
                    "consumer_metrics_port": "0"}
        if epsilon is not None:
            settings["epsilon"] = repr(float(epsilon))
        env = sidecar_env(self.workdir, self.database_url, kafka_bootstrap, **settings)
        # BentoML gives `serve` a multiprocess dir of its own; in the other processes the
        # variable would only make prometheus_client write files nobody reads. Without it
        # the worker and the consumer export their metrics as in production.
        env.pop("PROMETHEUS_MULTIPROC_DIR")
        return {**env, "PYTHONUNBUFFERED": "1", **extra}

    @property
    def command(self) -> list[str]:
        """How to run `obliviate` with this interpreter (the project's venv under pytest)."""
        return list(OBLIVIATE)

    # ------------------------------------------------------------------ lifecycle
    def start(self, *, seed: bool = True, train: bool = True, workers: int = 0,
              worker_args: Sequence[str] = ()) -> Sidecar:
        """Seed the ledger, train v1 and start the server (in parallel), wait for /readyz.

        With `workers` > 0 the first worker trains v1 itself (``worker --train``: one
        interpreter start-up fewer than a separate ``model train``; with `train_params`
        ``model train`` does). The other workers start at once and idle until v1 is
        published (nothing is submitted before this returns); all get `worker_args`.
        With train=False the server is started but not waited for (/readyz stays 503
        until some version is published).
        """
        t0 = time.monotonic()
        if seed:
            self.seed()
            self.timings["seed"] = time.monotonic() - t0
        in_worker = train and workers > 0 and not self.train_params
        trainer = (self.start_process("train", self._train_args())
                   if train and not in_worker else None)
        self.start_server(wait=False)
        if in_worker:
            trainer = self.start_worker("--train", "--learner", self.learner, *worker_args)
            workers -= 1
        for _ in range(workers):
            self.start_worker(*worker_args)
        if trainer is not None and not in_worker:
            rc = trainer.wait(self.ready_timeout_s)
            if rc != 0:
                raise SidecarError(f"`obliviate model train` exited {rc}; log "
                                   f"{trainer.log_path}:\n{trainer.tail()}")
            self.timings["train"] = time.monotonic() - t0
        if train:
            self.wait_ready(watch=[trainer] if in_worker and trainer else ())
            self.timings["ready"] = time.monotonic() - t0
        return self

    def seed(self) -> int:
        """Load the data set into the ledger's record store (in this process); its event seq."""
        from ledger import datasets
        from ledger.config import LedgerSettings

        ds = (datasets.load(self.dataset, records_per_subject=self.records_per_subject)
              if isinstance(self.dataset, str) else self.dataset)
        ledger = LedgerSettings(
            database_url=self.database_url, hmac_key_file=str(self.hmac_key_file),
            ledger_signing_key_file=self.env["OBLIVIATE_LEDGER_SIGNING_KEY_FILE"],
            key_store_dir=self.env["OBLIVIATE_KEY_STORE_DIR"]).open_ledger()
        try:
            return ledger.records.load(ds.record_ids, ds.subject_ids, ds.X, ds.y, name=ds.name,
                                       transform=ds.transform)
        finally:
            ledger.close()

    def _train_args(self) -> list[str]:
        args = ["model", "train", "--learner", self.learner]
        if self.train_params:
            args += ["--params", self.train_params]
        return args

    def train(self, timeout_s: float | None = None) -> str:
        """Train and publish the first version now (no-op if one exists); its CLI output."""
        return self.cli(*self._train_args(), timeout_s=timeout_s or self.ready_timeout_s)

    def start_server(self, wait: bool = True) -> Proc:
        """`obliviate serve` on :attr:`port`; waits for /readyz unless wait=False."""
        if self.server is not None and self.server.running():
            raise SidecarError(f"the server is already running: {self.server}")
        self.server = self.start_process(
            "server", ["serve", "--host", self.host, "--port", str(self.port)])
        if wait:
            self.wait_ready()
        return self.server

    def stop_server(self) -> None:
        if self.server is not None:
            self.server.stop(self.stop_timeout_s)

    def restart_server(self) -> Proc:
        self.stop_server()
        return self.start_server()

    def wait_ready(self, timeout_s: float | None = None, watch: Sequence[Proc] = ()) -> None:
        """Until /readyz answers 200; SidecarError with the server log tail otherwise.

        It also fails as soon as a process in `watch` (the one training v1) exits.
        """
        timeout_s = timeout_s or self.ready_timeout_s
        if self.server is None:
            raise SidecarError("the server was not started")
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            if not self.server.running():
                raise SidecarError(f"the server exited ({self.server.returncode}) before it "
                                   f"was ready; log {self.server.log_path}:\n"
                                   f"{self.server.tail(60)}")
            for p in watch:
                if not p.running():
                    raise SidecarError(f"{p.name} exited ({p.returncode}) before the sidecar "
                                       f"was ready; log {p.log_path}:\n{p.tail()}")
            try:
                r = self.http.get("/readyz", timeout=5)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = f"{exc.__class__.__name__}: {exc}"
            time.sleep(0.25)
        raise SidecarError(f"the sidecar at {self.url} was not ready after {timeout_s:.0f} s "
                           f"(last /readyz: {last}); server log {self.server.log_path}:\n"
                           f"{self.server.tail(60)}")

    def start_process(self, name: str, args: Sequence[str],
                      env: Mapping[str, str] | None = None) -> Proc:
        """`obliviate <args>` in the background, logging to logs/<name>[-N].log.

        For anything without a helper of its own, e.g. a Kafka consumer:
        ``sc.start_process("consumer", ["consume", "--group", "g1"])``.
        """
        n = self._counts[name] = self._counts.get(name, 0) + 1
        log = self.log_dir / (f"{name}.log" if n == 1 else f"{name}-{n}.log")
        proc = Proc(name if n == 1 else f"{name}-{n}", args, {**self.env, **(env or {})},
                    self.cwd, log)
        self.procs.append(proc)
        return proc

    def start_worker(self, *args: str, name: str | None = None,
                     max_seconds: float | None = None) -> Proc:
        """`obliviate worker [args]` in the background; each gets a distinct worker name."""
        n = self._counts.get("worker", 0) + 1
        # per-shard SISA bounds take minutes of CPU in the guard job: only the tests
        # about them ask for them
        bounds = () if "--shard-bound" in args else ("--shard-bound", "0")
        argv = ["worker", "--name", name or f"test-worker-{n}", *args, *bounds]
        if max_seconds is not None:
            argv += ["--max-seconds", str(max_seconds)]
        proc = self.start_process("worker", argv)
        self.workers.append(proc)
        return proc

    def stop_worker(self, proc: Proc | None = None) -> int | None:
        """Stop one worker (the newest running one by default); its exit code."""
        if proc is None:
            running = [w for w in self.workers if w.running()]
            if not running:
                return None
            proc = running[-1]
        return proc.stop(self.stop_timeout_s)

    def stop_workers(self) -> None:
        for w in reversed(self.workers):
            w.stop(self.stop_timeout_s)

    def cli(self, *args: str, timeout_s: float = 120.0, check: bool = True) -> str:
        """Run `obliviate <args>` to completion with the sidecar's environment; its output."""
        proc = self.start_process("cli-" + (args[0] if args else "help"), args)
        rc = proc.wait(timeout_s)
        out = proc.log_path.read_text(errors="replace").split("\n", 1)[-1]
        if check and rc != 0:
            raise SidecarError(f"`obliviate {' '.join(args)}` exited {rc}:\n{proc.tail()}")
        return out

    def close(self) -> None:
        """Stop every process it started (newest first) and the HTTP client; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        # Our keep-alive connection first: the server's graceful shutdown waits for it.
        self.http.close()
        for proc in reversed(self.procs):  # all at once, then wait for each
            proc.terminate()
        for proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                proc.stop(self.stop_timeout_s)

    def __enter__(self) -> Sidecar:
        if self.server is None:
            try:
                self.start()
            except BaseException:
                self.close()  # __exit__ is not called when __enter__ fails
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def logs(self, lines: int = 40) -> str:
        """Tails of every process's log, for assertion messages."""
        return "\n".join(f"--- {p.name} ({p.log_path}):\n{p.tail(lines)}" for p in self.procs)

    # ------------------------------------------------------------------ HTTP
    def headers(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.admin_token}"}

    def get(self, path: str, *, admin: bool = True, token: str | None = None,
            **kwargs: Any) -> httpx.Response:
        """GET with the admin token (or `token`); admin=False sends none."""
        headers = {**(self.headers(token) if admin else {}), **kwargs.pop("headers", {})}
        return self.http.get(path, headers=headers, **kwargs)

    def post(self, path: str, json: Any = None, *, admin: bool = True,
             token: str | None = None, **kwargs: Any) -> httpx.Response:
        headers = {**(self.headers(token) if admin else {}), **kwargs.pop("headers", {})}
        return self.http.post(path, json=json, headers=headers, **kwargs)

    def submit(self, request: Mapping[str, Any] | str | bytes,
               token: str | None = None) -> httpx.Response:
        """POST one request to /v1/requests (a dict, or raw JSON text to send as is)."""
        if isinstance(request, str | bytes):
            return self.http.post("/v1/requests", content=request,
                                  headers={**self.headers(token),
                                           "Content-Type": "application/json"})
        return self.post("/v1/requests", dict(request), token=token)

    def predict(self, instances: Any, scaled: bool = True) -> dict[str, Any]:
        """/v1/predict's answer ({labels, model_version, guard}); SidecarError unless 200.
        `instances` in the model's input space (`Dataset.X`) unless `scaled` is False."""
        if hasattr(instances, "tolist"):
            instances = instances.tolist()
        r = self.http.post("/v1/predict", json={"instances": instances, "scaled": scaled})
        return self._json(r, "POST /v1/predict")

    def history(self, request_id: str) -> dict[str, Any] | None:
        """GET /v1/requests/{id}; None if the ledger does not know it."""
        r = self.get(f"/v1/requests/{request_id}")
        return None if r.status_code == 404 else self._json(r, f"GET /v1/requests/{request_id}")

    def subject_requests(self, subject_id: str) -> list[dict[str, Any]]:
        r = self.get(f"/v1/subjects/{subject_id}/requests")
        return self._json(r, f"GET /v1/subjects/{subject_id}/requests")["requests"]

    def models(self) -> dict[str, Any]:
        return self._json(self.http.get("/v1/models"), "GET /v1/models")

    def lineage(self, limit: int = 100) -> list[dict[str, Any]]:
        r = self.http.get("/v1/models/lineage", params={"limit": limit})
        return self._json(r, "GET /v1/models/lineage")["versions"]

    def usage(self, bucket_s: int = 60) -> dict[str, Any]:
        r = self.get("/v1/guard/usage", params={"bucket_s": bucket_s})
        return self._json(r, "GET /v1/guard/usage")

    def _json(self, r: httpx.Response, what: str) -> Any:
        if r.status_code != 200:
            raise SidecarError(f"{what} answered {r.status_code}: {r.text[:500]}\n"
                               + (self.server.tail(30) if self.server else ""))
        return r.json()

    # ------------------------------------------------------------------ waiting
    def wait_until(self, probe: Callable[[], T | None], timeout_s: float = 60.0,
                   what: str = "a condition", interval_s: float = 0.25) -> T:
        """Call `probe` until it returns something truthy (returned); else SidecarError.

        The error names `what`, the last value seen and the tails of the logs; it comes
        early if every worker has exited (nothing would change any more).
        """
        def probed() -> T | None:
            value = probe()
            if not value and self.workers and not any(w.running() for w in self.workers):
                raise SidecarError(f"every worker exited while waiting for {what} "
                                   f"(last: {value!r})\n{self.logs()}")
            return value

        try:
            return wait_for(probed, timeout_s, what, interval_s)
        except AssertionError as exc:
            raise SidecarError(f"{exc}\n{self.logs()}") from None

    def wait_for_status(self, request_ids: Iterable[str], status: str = "verified",
                        timeout_s: float = 60.0, interval_s: float = 0.25
                        ) -> dict[str, dict[str, Any]]:
        """Until every request is in `status` (or a later lifecycle state); their histories.

        Waiting for ``applied`` also accepts ``verified``. Fails at once when a request
        ends up `failed` (or was rejected) instead, with its reason.
        """
        ids = list(request_ids)
        done: dict[str, dict[str, Any]] = {}
        order = LIFECYCLE.index(status) if status in LIFECYCLE else None

        def probe() -> dict[str, dict[str, Any]] | None:
            for rid in ids:
                if rid in done:
                    continue
                h = self.history(rid)
                if h is None:
                    raise SidecarError(f"the ledger has no request {rid!r}")
                now = h["request"]["status"] if h["request"] else "rejected"
                if now == status or (order is not None and now in LIFECYCLE
                                     and LIFECYCLE.index(now) >= order):
                    done[rid] = h
                elif now in ("failed", "rejected") and status not in ("failed", "rejected"):
                    reasons = [e["payload"].get("reason") for e in h["events"]
                               if e["kind"] in ("failed", "rejected")]
                    raise SidecarError(f"request {rid!r} is {now} ({reasons}), not {status}"
                                       f"\n{self.logs()}")
            return done if len(done) == len(ids) else None

        return self.wait_until(probe, timeout_s, f"{ids} to be {status}", interval_s)
