"""Directories of dead processes are removed by lock and age, never by pid: a pid is
reused (pid 1 in a container), a lock dies with its process.

The processes here are real and really killed (SIGKILL): a model store writer mid-save,
and a worker with its guard process mid-job; "the next start" runs the cleanup a
worker runs when it starts (:meth:`jobs.orchestration.worker.Worker.warm_up`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from jobs.orchestration.guard_job import JOB_DIR_PREFIX, remove_orphaned_job_dirs
from jobs.orchestration.leftovers import LOCK_SUFFIX, LOCKLESS_AGE_S, make_dir
from jobs.orchestration.served_model import KIND_FILE

# workers and writers killed as processes
pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
# the cleanup a worker's start runs, in the environment (TMPDIR, BENTOML_HOME) given
NEXT_START = """
from jobs.orchestration.guard_job import remove_orphaned_job_dirs
from jobs.orchestration.model_store import VersionStore
for d in [*remove_orphaned_job_dirs(), *VersionStore("obliviate").remove_leftovers()]:
    print("removed", d)
"""


@pytest.fixture
def tmpdir_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A temporary directory and a model store of the test's own, for this process
    (tempfile's) and for the processes it starts (their environment)."""
    tmp, home = tmp_path / "tmp", tmp_path / "bentoml"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return {**os.environ, "TMPDIR": str(tmp), "BENTOML_HOME": str(home),
            "BENTOML_DO_NOT_TRACK": "true", "PYTHONPATH": str(ROOT)}


def _start(code: str, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def _holder(parent: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], Path]:
    """A process that makes a job directory, writes into it and keeps working there."""
    proc = _start("""
        import sys, time
        from pathlib import Path
        from jobs.orchestration.leftovers import make_dir
        d = make_dir(Path(sys.argv[1]), sys.argv[2])
        (d.path / "half.npz").write_bytes(b"half a guard")
        print(d.path, flush=True)
        time.sleep(600)
    """, env, str(parent), JOB_DIR_PREFIX)
    return proc, Path(proc.stdout.readline().strip())


def test_a_dead_owners_directory_goes_though_its_pid_lives_on(tmpdir_env) -> None:
    """A directory whose process was SIGKILLed is removed, and so are directories named
    after live pids (pid 1, this test's own: what a reused pid looks like) whose lock no
    one holds; one without a lock file goes once it is older than the stated age."""
    tmp = Path(tempfile.gettempdir())
    proc, killed = _holder(tmp, tmpdir_env)
    _kill(proc)
    reused = []
    for pid in (1, os.getpid()):
        d = Path(tempfile.mkdtemp(prefix=f"{JOB_DIR_PREFIX}{pid}-"))
        (d / "guard").mkdir()
        Path(f"{d}{LOCK_SUFFIX}").touch()  # as its killed owner left it: unlocked
        reused.append(d)
    old = Path(tempfile.mkdtemp(prefix=f"{JOB_DIR_PREFIX}1-"))  # no lock file at all
    _age(old, LOCKLESS_AGE_S + 60)
    young = Path(tempfile.mkdtemp(prefix=f"{JOB_DIR_PREFIX}1-"))  # may be locked any moment
    removed = remove_orphaned_job_dirs()
    assert sorted(removed) == sorted([killed, *reused, old])
    assert sorted(p.name for p in tmp.iterdir()) == [young.name]


def test_a_live_owners_directory_stays_however_old(tmpdir_env) -> None:
    """A directory whose owner is alive and holds its lock is kept, in another process or
    in this one, at any age; it goes once the owner is gone."""
    tmp = Path(tempfile.gettempdir())
    proc, theirs = _holder(tmp, tmpdir_env)
    try:
        mine = make_dir(tmp, JOB_DIR_PREFIX)
        for d in (theirs, mine.path):
            _age(d, LOCKLESS_AGE_S * 10)
        assert remove_orphaned_job_dirs() == []
        assert theirs.is_dir() and (theirs / "half.npz").exists() and mine.path.is_dir()
        mine.release()
        assert sorted(p.name for p in tmp.iterdir()) == sorted(
            [theirs.name, theirs.name + LOCK_SUFFIX])
    finally:
        _kill(proc)
    assert remove_orphaned_job_dirs() == [theirs]
    assert list(tmp.iterdir()) == []


def test_a_model_store_writer_killed_mid_save_leaves_nothing_after_the_next_start(
        tmpdir_env, tmp_path) -> None:
    """A writer SIGKILLed while it fills a version leaves its staging directory and
    BentoML's own temporary copy (``bentoml-model-obliviate-*``), held by no one; the
    next start removes both and their lock files, and the version written before
    stays whole."""
    proc = _start("""
        import time
        from jobs.orchestration.model_store import VersionStore
        store = VersionStore("obliviate")
        store.write("v000001", {}, {}, lambda d: (d / "model.bin").write_bytes(b"v1"))
        def fill(d):
            (d / "model.bin").write_bytes(b"half of v2")
            print(d, flush=True)
            time.sleep(600)
        store.write("v000002", {}, {}, fill)
    """, tmpdir_env)
    bento_tmp = Path(proc.stdout.readline().strip())
    _kill(proc)
    tmp, home = Path(tmpdir_env["TMPDIR"]), Path(tmpdir_env["BENTOML_HOME"])
    assert bento_tmp.parent == tmp and bento_tmp.name.startswith("bentoml-model-obliviate-")
    assert (bento_tmp / "model.bin").read_bytes() == b"half of v2"
    staging = home / "obliviate-staging"
    assert [p for p in staging.iterdir() if p.is_dir()]  # the killed writer's

    start = subprocess.run([sys.executable, "-c", NEXT_START], env=tmpdir_env, cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert start.returncode == 0, start.stderr
    assert f"removed {bento_tmp}" in start.stdout
    assert list(tmp.iterdir()) == [] and list(staging.iterdir()) == []
    v1 = home / "models" / "obliviate" / "v000001"
    assert (v1 / "model.bin").read_bytes() == b"v1" and (v1 / "model.yaml").is_file()
    assert not (home / "models" / "obliviate" / "v000002").exists()


def test_a_worker_killed_mid_guard_job_leaves_nothing_after_the_next_start(
        tmpdir_env, tmp_path) -> None:
    """The guard process holds its job directory's lock too: after its worker is
    SIGKILLed mid-job the directory stays while the guard process works in it; the guard
    process then exits on its own (it would otherwise finish a job nobody reads: here,
    one blocked on a FIFO for ever), and the next start removes the directory."""
    version = tmp_path / "version"
    version.mkdir()
    os.mkfifo(version / KIND_FILE)  # loading the version blocks until it is written
    proc = _start("""
        import sys, time
        from pathlib import Path
        from jobs.orchestration.guard_job import GuardJob, GuardProcess
        process = GuardProcess()
        manifest = {"learner": "dare", "content_hash": "-", "guard": {"content_hash": None}}
        job = GuardJob("v1", Path(sys.argv[1]), bytes(32), manifest, verify=True,
                       process=process)
        print(job.dir, process._proc.pid, flush=True)
        time.sleep(600)
    """, tmpdir_env, str(version))
    job_dir, guard_pid = proc.stdout.readline().split()
    writer = _open_when_read(version / KIND_FILE)  # the guard process is in the job
    try:
        _kill(proc)
        assert remove_orphaned_job_dirs() == [] and Path(job_dir).is_dir()
        end = time.monotonic() + 30
        while _alive(int(guard_pid)):
            assert time.monotonic() < end, "the guard process outlived its worker"
            time.sleep(0.1)
        while remove_orphaned_job_dirs() != [Path(job_dir)]:  # the kernel lets go of it
            assert time.monotonic() < end, "the job directory stayed held"
            time.sleep(0.1)
        assert list(Path(tmpdir_env["TMPDIR"]).iterdir()) == []
    finally:
        os.close(writer)


def _open_when_read(fifo: Path, timeout_s: float = 60.0) -> int:
    """A write end of `fifo`, once a process has opened it to read (it then blocks)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader yet
            assert time.monotonic() < end, "nothing opened the FIFO"
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, waiting for init to reap it, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
