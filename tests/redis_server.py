"""A throwaway ``redis-server`` on 127.0.0.1 and a free port, for tests and benchmarks."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

__all__ = ["RedisServer"]


def _die_with_parent() -> None:
    """In the child before exec: on Linux, get SIGTERM when the parent dies, even if it is killed
    (a killed test run or benchmark must not leave a server behind)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class RedisServer:
    """Start ``redis-server`` (no persistence, loopback only) and stop it on exit.

    :raises RuntimeError: no ``redis-server`` on the PATH, or it did not start.
    """

    def __init__(self) -> None:
        self._binary = shutil.which("redis-server")
        if self._binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.TemporaryDirectory(prefix="kvshift-redis-")
        self._start()

    def _start(self) -> None:
        self._process = subprocess.Popen(
            [
                self._binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._dir.name,
                "--protected-mode",
                "yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if self._process.poll() is not None:
                    break
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def restart(self) -> None:
        """Stop the server and start it again on the same port: without persistence, it comes back empty."""
        self._process.terminate()
        self._process.wait(timeout=10)
        self._start()

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
