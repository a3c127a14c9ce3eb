"""Directories left by processes that died mid-job, found by the pid in their names."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_dead_dirs(parent: Path, prefix: str) -> list[Path]:
    """Remove the directories `parent/<prefix><pid>-...` whose process is gone."""
    removed = []
    for d in sorted(parent.glob(f"{prefix}*")) if parent.is_dir() else []:
        pid = d.name.removeprefix(prefix).split("-", 1)[0]
        if d.is_dir() and not (pid.isdigit() and pid_alive(int(pid))):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed
