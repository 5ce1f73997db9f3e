"""A throwaway ``redis-server`` on 127.0.0.1 and a free port, for tests and benchmarks."""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

__all__ = ["RedisCluster", "RedisServer"]


def _die_with_parent() -> None:
    """In the child before exec: on Linux, get SIGTERM when the parent dies, even if it is killed
    (a killed test run or benchmark must not leave a server behind)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port(cluster: bool) -> int:
    """A free port on 127.0.0.1; for a cluster node one whose bus port (10,000 above) is free too."""
    while True:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", random.randint(20_000, 55_000) if cluster else 0))
            except OSError:
                continue
            port = probe.getsockname()[1]
        if not cluster:
            return port
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10_000))
            except OSError:
                continue
        return port


class RedisServer:
    """Start ``redis-server`` (no persistence, loopback only) and stop it on exit.

    :raises RuntimeError: no ``redis-server`` on the PATH, or it did not start.
    """

    def __init__(self, *, cluster: bool = False) -> None:
        self._cluster = cluster
        self._binary = shutil.which("redis-server")
        if self._binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        self.port = _free_port(cluster)
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
                *(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"] if self._cluster else []),
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


class RedisCluster:
    """A throwaway Redis Cluster: three primaries on 127.0.0.1 (no replicas), slots spread over them.

    :raises RuntimeError: ``redis-server`` or ``redis-cli`` missing, or the cluster did not form.
    """

    def __init__(self, nodes: int = 3) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (apt-get install -y redis-server)")
        self.servers: list[RedisServer] = []
        try:
            for _ in range(nodes):
                self.servers.append(RedisServer(cluster=True))
            addresses = [f"127.0.0.1:{server.port}" for server in self.servers]
            made = subprocess.run(
                [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if made.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {made.stdout[-500:]} {made.stderr[-500:]}")
            self._wait_until_ok(cli)
        except BaseException:
            self.stop()
            raise
        self.url = f"redis://127.0.0.1:{self.servers[0].port}/0"

    def _wait_until_ok(self, cli: str) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = [
                subprocess.run(
                    [cli, "-p", str(server.port), "cluster", "info"], capture_output=True, text=True, timeout=10
                ).stdout
                for server in self.servers
            ]
            if all("cluster_state:ok" in state for state in states):
                return
            time.sleep(0.2)
        raise RuntimeError("the Redis cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
