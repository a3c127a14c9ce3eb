"""Refitting a version's guard, checking its exactness, and retraining an approximate
version exactly, in the background.

Both take seconds to minutes, so the worker runs them in a separate, low-priority process,
kept warm between jobs (:class:`GuardProcess`), while it keeps applying requests; a job
whose version stopped being current is terminated at once, with its process.
See docs/sidecar.md (The guard job)."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from jobs import sealing
from jobs.orchestration.job_settings import JobSettings
from jobs.orchestration.leftovers import make_dir, remove_abandoned
from jobs.orchestration.served_model import ServedModel, exact_owed, load_as_published

RESULT_FILE = "result.json"
ERROR_FILE = "error.txt"
GUARD_SUBDIR = "guard"
EXACT_SUBDIR = "exact"  # an approximate version's exact replacement (ServedModel.save)
JOB_DIR_PREFIX = "obliviate-guard-"


@dataclass(frozen=True)
class GuardResult:
    guard: dict[str, Any]  # the guard's manifest record (rule, bound summary, seconds)
    check: dict[str, Any]  # the exactness check (or, approximate, the gap), empty if not asked
    guard_dir: Path  # fitted guard state, for ServedModel.load_guard
    exact_dir: Path | None = None  # the exact replacement of an approximate version


def fit_guard(version_path: str, key_hex: str, manifest: dict[str, Any], out_dir: str,
              verify: bool, bound_s: float = 0.0) -> None:
    """Refit a stored version's guard (`bound_s`: seconds per part of a guard that searches
    for bounds, see ServedModel.refresh_guard) and check exactness; results go to
    `out_dir`, the fitted guard sealed under the version's key like the version itself.
    The files must be what `manifest` (vouched for by the ledger) records, else it fails."""
    with sealing.sealed_with(bytes.fromhex(key_hex)):
        _fit_guard(version_path, manifest, out_dir, verify, bound_s)


def _fit_guard(version_path: str, manifest: dict[str, Any], out_dir: str, verify: bool,
               bound_s: float) -> None:
    out = Path(out_dir)
    try:
        model = load_as_published(version_path, manifest)
        guard = model.refresh_guard(bound_s)
        check: dict[str, Any] = {}
        if exact_owed(manifest):
            model, check = _exact_replacement(model, verify)
            model.save(out / EXACT_SUBDIR)
        elif verify:
            # an approximate version owes its exact retrain instead (above): what is
            # checked here claims to be exact, the game's exact retrain too
            rep = model.learner.verify()
            check = {"guarantee": model.forgetting, "exact": rep.exact,
                     "served_hash": rep.served_hash, "retrained_hash": rep.retrained_hash,
                     "seconds": round(rep.seconds, 6)}
        model.save_guard(out / GUARD_SUBDIR)
        tmp = out / (RESULT_FILE + ".tmp")
        tmp.write_text(json.dumps({"guard": guard, "check": check,
                                   "exact": exact_owed(manifest)}))
        tmp.replace(out / RESULT_FILE)
    except Exception:  # reported to the worker, which logs it and retries later
        (out / ERROR_FILE).write_text(traceback.format_exc())


def _exact_replacement(model: ServedModel, verify: bool) -> tuple[ServedModel, dict[str, Any]]:
    """An approximate version retrained from scratch on its live records, and (`verify`)
    that retrain checked the way the exact learners are: retrained once more, content
    hashes compared."""
    t0 = time.perf_counter()
    exact = model.exact_replacement()
    check: dict[str, Any] = {"guarantee": "exact", "retrain_seconds":
                             round(time.perf_counter() - t0, 6)}
    if verify:
        rep = exact.learner.verify()
        check.update(exact=rep.exact, served_hash=rep.served_hash,
                     retrained_hash=rep.retrained_hash, seconds=round(rep.seconds, 6))
    return exact, check


def _serve_jobs(conn: Connection, worker: int) -> None:
    """The warm process: fit one guard per message until the worker closes the pipe.
    Each job comes with its directory's lock, held until the job is done (so the
    directory stays held while this process writes to it, even if the worker is gone)."""
    os.nice(19)  # updates come first: this only takes CPU the worker leaves idle
    JobSettings.from_env().training_device()  # the CUDA memory cap holds for LOO sets too
    threading.Thread(target=_exit_with_parent, args=(worker,), daemon=True).start()
    while True:
        try:
            args = conn.recv()
        except EOFError:  # the worker is gone (stopped, or killed)
            return
        if args is None:
            return
        lock = reduction.recv_handle(conn)
        try:
            fit_guard(*args)
        finally:
            os.close(lock)
        conn.send(True)


def _exit_with_parent(worker: int) -> None:
    """End this process soon after its worker dies (killed mid-job, it would otherwise
    finish a job nobody reads), so that the job's directory is freed for cleanup."""
    while os.getppid() == worker:
        time.sleep(0.5)
    os._exit(1)


class GuardProcess:
    """One spawned, low-priority process that runs guard jobs one at a time."""

    def __init__(self) -> None:
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._busy = False

    def start(self) -> None:
        """Start the process now (it imports its modules while nothing waits for it)."""
        if self._proc is not None and self._proc.is_alive():
            return
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_jobs, args=(child, os.getpid()), daemon=True,
                                 name="obliviate-guard")
        self._proc.start()
        child.close()
        self._conn, self._busy = parent, False

    def submit(self, args: tuple[str, str, dict[str, Any], str, bool, float],
               lock_fd: int) -> None:
        """Run a job; `lock_fd` holds its directory's lock (the process holds it too)."""
        if self._busy:
            raise RuntimeError("the guard process is still running a job")
        self.start()
        self._conn.send(args)
        reduction.send_handle(self._conn, lock_fd, self._proc.pid)
        self._busy = True

    def done(self) -> bool:
        """The job in hand has finished, or its process died (then it has no result)."""
        if not self._busy:
            return True
        if self._conn.poll():
            try:
                self._conn.recv()
            except (EOFError, OSError):  # it died mid-job
                self._forget_process()
        elif not self._proc.is_alive():
            self._forget_process()
        else:
            return False
        self._busy = False
        return True

    def _forget_process(self) -> None:
        self._proc.join(5)
        self._conn.close()
        self._proc, self._conn = None, None

    def kill(self) -> None:
        """Terminate the job in hand; a fresh process is started for the next one."""
        self.close()
        self.start()

    def close(self) -> None:
        if self._proc is not None:
            if self._busy:
                self._proc.terminate()
            else:
                with contextlib.suppress(OSError):  # OSError: it is gone already
                    self._conn.send(None)  # finish (once done importing)
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
            self._forget_process()
        self._busy = False


class GuardJob:
    """One background refit of `version` (whose files must be what `manifest` records): in
    the worker's :class:`GuardProcess`, or in a thread when there is none (tests)."""

    def __init__(self, version: str, version_path: Path, key: bytes,
                 manifest: dict[str, Any], verify: bool, process: GuardProcess | None = None,
                 bound_s: float = 0.0) -> None:
        self.version = version
        self._dir = make_dir(Path(tempfile.gettempdir()), JOB_DIR_PREFIX)
        self.dir = self._dir.path
        args = (str(version_path), key.hex(), manifest, str(self.dir), verify, float(bound_s))
        self._process = process
        self._thread: threading.Thread | None = None
        if process is not None:
            try:
                process.submit(args, self._dir.fileno())
            except Exception:
                self.discard()
                raise
        else:
            self._thread = threading.Thread(target=fit_guard, args=args, daemon=True)
            self._thread.start()

    def done(self) -> bool:
        if self._process is not None:
            return self._process.done()
        return not self._thread.is_alive()

    def result(self) -> GuardResult:
        """The finished job's result; RuntimeError with the child's traceback if it failed."""
        if (self.dir / RESULT_FILE).exists():
            data = json.loads((self.dir / RESULT_FILE).read_text())
            return GuardResult(data["guard"], data["check"], self.dir / GUARD_SUBDIR,
                               self.dir / EXACT_SUBDIR if data.get("exact") else None)
        err = self.dir / ERROR_FILE
        raise RuntimeError(err.read_text() if err.exists() else
                           f"the guard job for {self.version} died without a result")

    def cancel(self) -> None:
        if self._process is not None and not self._process.done():
            self._process.kill()
        self.discard()

    def discard(self) -> None:
        self._dir.release()


def remove_orphaned_job_dirs() -> list[Path]:
    """Remove the job directories no live process holds (their worker and its guard
    process were killed mid-job): they hold a half-fitted guard. Called when a worker
    starts."""
    return remove_abandoned(Path(tempfile.gettempdir()), JOB_DIR_PREFIX)
