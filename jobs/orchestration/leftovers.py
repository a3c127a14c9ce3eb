"""Working directories that outlive a killed process, told apart by a lock, not a pid.

A pid is reused (pid 1 in every container); an exclusive ``flock`` on ``<dir>.lock`` is
released by the kernel however its holder dies. Cleanup removes a directory whose lock it
can take, and one without a lock file once older than :data:`LOCKLESS_AGE_S`.
See docs/security.md (Guarantees and the tests that hold them)."""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from types import TracebackType

LOCK_SUFFIX = ".lock"
# how old a directory without a lock file must be before it counts as abandoned: far
# longer than the moment between its creation and its owner's lock, and than a job of
# a release that did not lock its directories yet (a guard job takes minutes)
LOCKLESS_AGE_S = 3600.0
_TMP_PREFIX = ".obliviate-lock-"


class OwnedDir:
    """A directory this process works in, and the lock that keeps others from removing
    it; :meth:`release` removes both."""

    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self._fd: int | None = lock_fd

    def fileno(self) -> int:
        """The lock's file descriptor (to pass to a process that works in the directory)."""
        if self._fd is None:
            raise ValueError(f"{self.path} was released")
        return self._fd

    def release(self) -> None:
        """Remove the directory, then its lock file, then let go of the lock."""
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        _lock_path(self.path).unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> OwnedDir:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def make_dir(parent: Path, prefix: str) -> OwnedDir:
    """A new directory ``parent/<prefix><pid>-<random>``, locked before it exists (the
    pid only keeps earlier releases, whose cleanup went by it, from removing it)."""
    parent.mkdir(parents=True, exist_ok=True)
    path = parent / f"{prefix}{os.getpid()}-{secrets.token_hex(8)}"
    fd = _create_locked(_lock_path(path))
    try:
        path.mkdir(mode=0o700)
    except BaseException:
        _lock_path(path).unlink(missing_ok=True)
        os.close(fd)
        raise
    return OwnedDir(path, fd)


def adopt_dir(path: Path) -> OwnedDir:
    """Hold a directory another library just created for this process (until the lock
    is taken, only its age keeps cleanup away)."""
    return OwnedDir(path, _create_locked(_lock_path(path)))


def remove_abandoned(parent: Path, prefix: str,
                     lockless_age_s: float = LOCKLESS_AGE_S) -> list[Path]:
    """Remove the directories ``parent/<prefix>*`` that no live process holds (their
    lock file's lock can be taken, or they have none and are older than
    `lockless_age_s`), lock files left without a directory, and lock files a process
    died creating. Returns the directories removed."""
    if not parent.is_dir():
        return []
    removed = []
    for d in sorted(parent.glob(f"{prefix}*")):
        if d.is_dir() and not d.is_symlink() and _remove(d, _lock_path(d), lockless_age_s):
            removed.append(d)
    for lock in parent.glob(f"{prefix}*{LOCK_SUFFIX}"):
        if not lock.with_name(lock.name.removesuffix(LOCK_SUFFIX)).exists():
            _remove(lock, lock, float("inf"))
    for tmp in parent.glob(f"{_TMP_PREFIX}*"):
        if _age(tmp) >= lockless_age_s:
            _remove(tmp, tmp, float("inf"))
    return removed


def _remove(path: Path, lock: Path, lockless_age_s: float) -> bool:
    """Remove `path` (and `lock`) if no process holds `lock`; True if it is gone."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        if _age(path) < lockless_age_s:
            return False
        fd = None
    except OSError:  # another user's, or not a file: not ours to judge
        return False
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its owner is alive
        os.close(fd)
        return False
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        lock.unlink(missing_ok=True)
    finally:
        if fd is not None:
            os.close(fd)
    return not path.exists()


def _create_locked(path: Path) -> int:
    """Create `path` and return a descriptor holding its exclusive lock. The file is
    made and locked under a temporary name and then linked into place, so `path` is
    never seen unlocked while its creator lives."""
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.link(tmp, path)
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.unlink(tmp)
    return fd


def _lock_path(d: Path) -> Path:
    return d.with_name(d.name + LOCK_SUFFIX)


def _age(p: Path) -> float:
    try:
        return time.time() - p.lstat().st_mtime
    except FileNotFoundError:
        return float("inf")
