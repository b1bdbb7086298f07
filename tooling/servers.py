"""Throwaway Redis and PostgreSQL servers that a test or a benchmark may stop, kill and restart.

The machine's own servers are shared; a fault must be injected into a server of one's own.
``RedisServer`` runs Debian's ``redis-server`` on a free port (no persistence unless asked);
``PostgresServer`` makes an ``initdb`` cluster in a temporary directory and runs it on a free
port (trust authentication, or a password). Both keep their port across restarts, so the
clients that knew the old server find the new one. ``PgBouncer`` runs Debian's ``pgbouncer`` in
front of a PostgreSQL server, in transaction or session pooling. ``RabbitVhost`` is a virtual
host of the machine's RabbitMQ, a broker of one's own.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from urllib.parse import quote, urlsplit

import redis

from tooling.processes import free_port


class ServerUnavailable(RuntimeError):
    """The server's programs are not installed here."""


def _postgres_bindir() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not found:
        raise ServerUnavailable("initdb not found under /usr/lib/postgresql/*/bin")
    return found[-1].parent


def _wait(check: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception as exc:
            last = exc
        time.sleep(0.05)
    raise RuntimeError(f"{what} within {timeout}s" + (f": {last}" if last else ""))


def _stop(proc: subprocess.Popen[bytes] | None, *, kill: bool) -> None:
    """Stop a server's process: SIGKILL when ``kill``, else SIGTERM (SIGKILL after 20 s)."""
    if proc is None or proc.poll() is not None:
        return
    if kill:
        proc.kill()
    else:
        proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


class RedisServer:
    """A ``redis-server`` of one's own: ``with RedisServer() as r: r.url``."""

    def __init__(
        self, *, appendonly: bool = False, port: int | None = None, replica_of: int | None = None
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServerUnavailable("redis-server is not installed")
        self._binary = binary
        self.port = port or free_port()
        self.appendonly = appendonly
        self.replica_of = replica_of  # the port of the primary this one replicates
        self.dir = Path(tempfile.mkdtemp(prefix="orderly-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> RedisServer:
        argv = [
            self._binary,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "always",
            "--daemonize", "no",
        ]  # fmt: skip
        if self.replica_of is not None:
            argv += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        log = (self.dir / "redis.log").open("ab")
        self._proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()

        def up() -> bool:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited; see {self.dir / 'redis.log'}")
            with self.client() as c:
                return bool(c.ping())

        _wait(up, f"redis-server did not answer on port {self.port}", 30)
        return self

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server: SIGKILL when ``kill`` (nothing flushed), else a clean shutdown."""
        proc, self._proc = self._proc, None
        _stop(proc, kill=kill)

    def restart(self, *, kill: bool = True) -> None:
        """Kill (by default) and start again on the same port."""
        self.stop(kill=kill)
        self.start()

    def close(self) -> None:
        self.stop(kill=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class RedisSentinel:
    """A Sentinel of one's own (``redis-server --sentinel``) watching the primary on
    ``primary_port`` as ``service``, with a quorum of one: down after 5 s (not sooner, so a
    busy machine's slow answers start no failover of their own)."""

    def __init__(self, primary_port: int, service: str = "orderly") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServerUnavailable("redis-server is not installed")
        self._binary = binary
        self.port = free_port()
        self.service = service
        self.dir = Path(tempfile.mkdtemp(prefix="orderly-sentinel-"))
        # Sentinel rewrites its configuration file as it learns: one of its own, writable.
        (self.dir / "sentinel.conf").write_text(
            f"bind 127.0.0.1\nport {self.port}\ndir {self.dir}\n"
            f"sentinel monitor {service} 127.0.0.1 {primary_port} 1\n"
            f"sentinel down-after-milliseconds {service} 5000\n"
            f"sentinel failover-timeout {service} 10000\n"
            f"sentinel parallel-syncs {service} 1\n"
        )
        self._proc: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/{self.service}/{db}"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def primary_port(self) -> int:
        with self.client() as c:
            return int(c.sentinel_get_master_addr_by_name(self.service)[1])

    def start(self) -> RedisSentinel:
        argv = [self._binary, str(self.dir / "sentinel.conf"), "--sentinel"]
        log = (self.dir / "sentinel.log").open("ab")
        self._proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()

        def up() -> bool:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"the Sentinel exited; see {self.dir / 'sentinel.log'}")
            return self.primary_port() > 0

        _wait(up, f"the Sentinel did not answer on port {self.port}", 30)
        return self

    def close(self) -> None:
        proc, self._proc = self._proc, None
        _stop(proc, kill=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisSentinel:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class PostgresServer:
    """An ``initdb`` cluster of one's own on a free port: ``with PostgresServer() as pg:``.

    As root, the cluster is made and run as the ``postgres`` user (PostgreSQL refuses root).
    ``password`` makes it ask for one (scram-sha-256); without it every local user is trusted.
    """

    def __init__(self, *, password: str | None = None, port: int | None = None) -> None:
        self._bindir = _postgres_bindir()
        self.port = port or free_port()
        self.password = password
        self.home = Path(tempfile.mkdtemp(prefix="orderly-pg-"))
        self.data = self.home / "data"
        self._as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as_postgres:
            shutil.chown(self.home, "postgres", "postgres")
        self._initialised = False

    def url(self, database: str = "postgres", driver: str = "postgresql+psycopg2") -> str:
        auth = "postgres" if self.password is None else f"postgres:{self.password}"
        return f"{driver}://{auth}@127.0.0.1:{self.port}/{database}"

    def _run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([*self._as_postgres, *argv], check=check, capture_output=True)

    def _initdb(self) -> None:
        argv = [str(self._bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "-A"]
        if self.password is None:
            argv.append("trust")
        else:
            pwfile = self.home / "pw"
            pwfile.write_text(self.password + "\n")
            if self._as_postgres:
                shutil.chown(pwfile, "postgres", "postgres")
            argv += ["scram-sha-256", f"--pwfile={pwfile}"]
        self._run(*argv)
        self._initialised = True

    def start(self) -> PostgresServer:
        if not self._initialised:
            self._initdb()
        options = (
            f"-p {self.port} -k {self.home} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c full_page_writes=off -c max_connections=200"
        )
        done = self._run(
            str(self._bindir / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60",
            "-l", str(self.home / "log"), "-o", options, "start", check=False,
        )  # fmt: skip
        if done.returncode != 0:
            log = (self.home / "log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"PostgreSQL did not start on port {self.port}: {log}")
        return self

    def stop(self, *, mode: str = "fast") -> None:
        """Stop the cluster: ``immediate`` is a crash (no checkpoint), ``fast`` a clean stop."""
        if not self._initialised:
            return
        self._run(str(self._bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop",
                  check=False)  # fmt: skip

    def restart(self, *, mode: str = "immediate") -> None:
        self.stop(mode=mode)
        self.start()

    def close(self) -> None:
        self.stop(mode="immediate")
        shutil.rmtree(self.home, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class PgBouncer:
    """Debian's ``pgbouncer`` on a free port in front of the PostgreSQL at ``target_port``:
    ``with PgBouncer(5432, mode="transaction") as b: b.url(database)``. Every database of the
    server, user ``postgres`` trusted; as root it runs as ``postgres`` (it refuses root)."""

    def __init__(self, target_port: int, *, mode: str = "transaction") -> None:
        binary = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
        if binary is None:
            raise ServerUnavailable("pgbouncer is not installed")
        self._binary = binary
        self.port = free_port()
        self.mode = mode
        self.dir = Path(tempfile.mkdtemp(prefix="orderly-pgbouncer-"))
        self._as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        (self.dir / "users.txt").write_text('"postgres" ""\n')
        (self.dir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={target_port}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.dir / 'users.txt'}\n"
            f"pool_mode = {mode}\ndefault_pool_size = 20\nmax_client_conn = 500\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\n"
        )
        if self._as_postgres:
            for path in (self.dir, *self.dir.iterdir()):
                shutil.chown(path, "postgres", "postgres")
        self._proc: subprocess.Popen[bytes] | None = None

    def url(self, database: str = "postgres", driver: str = "postgresql+psycopg2") -> str:
        return f"{driver}://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> PgBouncer:
        argv = [*self._as_postgres, self._binary, str(self.dir / "pgbouncer.ini")]
        self._proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

        def up() -> bool:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited; see {self.dir / 'pgbouncer.log'}")
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True

        _wait(up, f"pgbouncer did not listen on port {self.port}", 30)
        return self

    def close(self) -> None:
        proc, self._proc = self._proc, None
        _stop(proc, kill=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class RabbitVhost:
    """A virtual host of the machine's RabbitMQ of one's own, made and removed with Debian's
    ``rabbitmqctl`` (as root, or as the user that runs the server): a test run's broker, kept
    apart from every other run's. ``base`` is the server's amqp:// URL without a vhost."""

    def __init__(self, name: str, base: str = "amqp://guest:guest@127.0.0.1:5672") -> None:
        binary = shutil.which("rabbitmqctl") or shutil.which("rabbitmqctl", path="/usr/sbin")
        if binary is None:
            raise ServerUnavailable("rabbitmqctl is not installed")
        # Debian's rabbitmqctl runs only as root or rabbitmq: others go through sudo.
        self._ctl = [binary] if os.geteuid() == 0 else ["sudo", "-n", binary]
        self.name = name
        self.base = base.rstrip("/")
        self.user = urlsplit(self.base).username or "guest"

    @property
    def url(self) -> str:
        return f"{self.base}/{quote(self.name, safe='')}"

    def _run(self, *args: str) -> str:
        done = subprocess.run(
            [*self._ctl, "-q", *args], capture_output=True, text=True, timeout=60, check=False
        )
        if done.returncode != 0:
            raise ServerUnavailable(f"rabbitmqctl {args[0]}: {done.stderr.strip() or done.stdout}")
        return done.stdout

    def create(self) -> RabbitVhost:
        self._run("add_vhost", self.name)
        self._run("set_permissions", "-p", self.name, self.user, ".*", ".*", ".*")
        return self

    def purge_queues(self, names: Sequence[str]) -> None:
        """Empty these queues (one that is not there is no error). They are emptied, not
        deleted: a client that declared a queue once does not declare it again, and would
        publish into nothing."""
        from amqp.exceptions import NotFound
        from kombu.connection import Connection

        with Connection(self.url, connect_timeout=10) as conn:  # type: ignore[no-untyped-call]
            for name in names:
                channel = conn.channel()
                try:
                    channel.queue_purge(name)
                except NotFound:
                    pass
                finally:
                    channel.close()

    def queues(self) -> dict[str, tuple[str, bool, int]]:
        """RabbitMQ's own word on the vhost's queues: name -> (type, durable, ready messages)."""
        listed = self._run(
            "list_queues", "-p", self.name, "--no-table-headers",
            "name", "type", "durable", "messages_ready",
        )  # fmt: skip
        found = {}
        for line in listed.splitlines():
            name, kind, durable, ready = line.split("\t")
            found[name] = (kind, durable == "true", int(ready))
        return found

    def remove(self) -> None:
        self._run("delete_vhost", self.name)

    def __enter__(self) -> RabbitVhost:
        return self.create()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()
