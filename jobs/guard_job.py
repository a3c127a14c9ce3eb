"""Refitting a version's guard, and checking its exactness, in the background.

Both can take seconds to minutes (the forest guard runs one exact deletion per
record; the exactness check retrains from scratch), so the worker runs them
in a separate, low-priority process while it keeps applying requests. A job
whose version stopped being current is terminated at once: its result could
never be published.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.served_model import ServedModel

RESULT_FILE = "result.json"
ERROR_FILE = "error.txt"
GUARD_SUBDIR = "guard"


@dataclass(frozen=True)
class GuardResult:
    guard: dict[str, Any]  # the guard's manifest record (rule, bound summary, seconds)
    check: dict[str, Any]  # the exactness check (or, approximate, the gap), empty if not asked
    guard_dir: Path  # fitted guard state, for ServedModel.load_guard


def fit_guard(version_path: str, out_dir: str, verify: bool) -> None:
    """Refit a stored version's guard and check exactness; results go to `out_dir`."""
    out = Path(out_dir)
    try:
        model = ServedModel.load(version_path)
        guard = model.refresh_guard()
        check: dict[str, Any] = {}
        if verify:
            rep = model.learner.verify()
            check = {"guarantee": model.learner.guarantee, "exact": rep.exact,
                     "served_hash": rep.served_hash, "retrained_hash": rep.retrained_hash,
                     "seconds": round(rep.seconds, 6)}
            if model.learner.guarantee != "exact":
                check["gap_to_retrain"] = rep.detail  # what "approximate" measured to be
        model.save_guard(out / GUARD_SUBDIR)
        tmp = out / (RESULT_FILE + ".tmp")
        tmp.write_text(json.dumps({"guard": guard, "check": check}))
        tmp.replace(out / RESULT_FILE)
    except Exception:  # reported to the worker, which logs it and retries later
        (out / ERROR_FILE).write_text(traceback.format_exc())


def _fit_guard_niced(version_path: str, out_dir: str, verify: bool) -> None:
    os.nice(19)  # updates come first: this only takes CPU the worker leaves idle
    fit_guard(version_path, out_dir, verify)


class GuardJob:
    """One background refit of `version` (in a spawned process, or a thread for tests)."""

    def __init__(self, version: str, version_path: Path, verify: bool,
                 separate_process: bool = True) -> None:
        self.version = version
        self.dir = Path(tempfile.mkdtemp(prefix="obliviate-guard-"))
        args = (str(version_path), str(self.dir), verify)
        self._runner: mp.process.BaseProcess | threading.Thread
        if separate_process:
            self._runner = mp.get_context("spawn").Process(target=_fit_guard_niced, args=args,
                                                           daemon=True)
        else:
            self._runner = threading.Thread(target=fit_guard, args=args, daemon=True)
        self._runner.start()

    def done(self) -> bool:
        return not self._runner.is_alive()

    def result(self) -> GuardResult:
        """The finished job's result; RuntimeError with the child's traceback if it failed."""
        if (self.dir / RESULT_FILE).exists():
            data = json.loads((self.dir / RESULT_FILE).read_text())
            return GuardResult(data["guard"], data["check"], self.dir / GUARD_SUBDIR)
        err = self.dir / ERROR_FILE
        raise RuntimeError(err.read_text() if err.exists() else
                           f"the guard job for {self.version} died without a result")

    def cancel(self) -> None:
        if isinstance(self._runner, mp.process.BaseProcess) and self._runner.is_alive():
            self._runner.terminate()
            self._runner.join(5)
        self.discard()

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
