"""A three-node Redis Cluster of the test's own: three ``redis-server --cluster-enabled yes``
processes on free ports, joined by ``redis-cli --cluster create``, torn down whatever happens.

``with LocalCluster() as cluster:`` yields once every node reports ``cluster_state:ok``;
``cluster.client()`` is a redis-py ``RedisCluster`` on it, ``cluster.node_clients()`` plain
clients of each node (to see where keys landed).
"""

from __future__ import annotations

import contextlib
import functools
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import redis
from redis.cluster import ClusterNode, RedisCluster

from tooling.servers import ServerUnavailable

# A cluster node also listens on its port + 10000 (the cluster bus): both must be free, and
# the bus port a valid one, so ports are drawn below 55536 rather than from the ephemeral range.
BUS_OFFSET = 10_000


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def node_port(taken: list[int]) -> int:
    """A port that is free, with its cluster bus port free too."""
    for _ in range(1000):
        port = random.randrange(20_000, 30_000)
        if port not in taken and _free(port) and _free(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free pair of ports (port, port + 10000) found")


class LocalCluster:
    def __init__(self, nodes: int = 3) -> None:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            raise ServerUnavailable("redis-server (and redis-cli) are not installed")
        self._server, self._cli = server, cli
        self.dir = Path(tempfile.mkdtemp(prefix="orderly-cluster-"))
        self.ports: list[int] = []
        self._count = nodes
        self._procs: list[subprocess.Popen[bytes]] = []

    @property
    def nodes_setting(self) -> str:
        """ORDERLY_REDIS_CLUSTER_NODES for this cluster."""
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> LocalCluster:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        for n in range(self._count):
            port = node_port(self.ports)
            folder = self.dir / str(port)
            folder.mkdir()
            argv = [
                self._server,
                "--bind", "127.0.0.1",
                "--port", str(port),
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", "5000",
                "--dir", str(folder),
                "--save", "",
                "--appendonly", "no",
                "--daemonize", "no",
            ]  # fmt: skip
            with (folder / "redis.log").open("ab") as log:
                self._procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
            self.ports.append(port)
            self._wait(functools.partial(self._answers, port), f"node {n} on port {port}")
        create = [self._cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports]]
        done = subprocess.run(
            [*create, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed: {done.stdout!r} {done.stderr!r}"
            )

        def ok() -> bool:
            for port in self.ports:
                with self._plain(port) as node:
                    info = node.execute_command("CLUSTER INFO")
                if (info.get("cluster_state") if isinstance(info, dict) else None) != "ok":
                    return False
            return True

        self._wait(ok, "cluster_state:ok on every node")

    def _answers(self, port: int) -> bool:
        with self._plain(port) as node:
            return bool(node.ping())

    def _plain(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)

    def _wait(self, check: Callable[[], bool], what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            for proc in self._procs:
                if proc.poll() is not None:
                    logs = [p.read_text()[-500:] for p in self.dir.glob("*/redis.log")]
                    raise RuntimeError(f"a cluster node exited; its logs end: {logs}")
            try:
                if check():
                    return
            except redis.RedisError as exc:
                last = exc
            time.sleep(0.05)
        raise RuntimeError(f"{what} not reached within {timeout}s" + (f": {last}" if last else ""))

    def client(self) -> RedisCluster:
        return RedisCluster(
            startup_nodes=[
                ClusterNode("127.0.0.1", p)  # type: ignore[no-untyped-call]
                for p in self.ports
            ],
            socket_timeout=5,
        )

    def node_clients(self) -> list[redis.Redis]:
        return [self._plain(p) for p in self.ports]

    def flush(self) -> None:
        for node in self.node_clients():
            node.flushall()
            node.close()

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(20)
        self._procs = []
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
