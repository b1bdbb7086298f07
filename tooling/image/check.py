"""Build orderly's container image and run it for real, without pulling any image.

``python -m tooling.image`` (``./run.sh image``):

1. a Debian bookworm base built here with Debian's own tools (``mmdebstrap`` to a tarball,
   cached in ``ORDERLY_IMAGE_CACHE``, default ``/var/cache/orderly-image`` as root and
   ``~/.cache/orderly-image`` otherwise; ``podman import``);
2. orderly's image from the repository's ``Dockerfile`` on that base
   (``podman build --build-arg BASE_IMAGE=...``), and a derived image with a handler module
   of its own, as the Dockerfile tells users to do;
3. PostgreSQL and Redis from a second image on the same base (Debian's ``postgresql`` and
   ``redis-server``), then ``orderly migrate --create-database``, ``orderly key create``, the
   API, a worker and beat from orderly's image, every container on the host's network and on
   free ports of its own;
4. a message through the API to the image's handler, until it is OK; a conversation (a
   request and its response on a channel pointing at an HTTP receiver in this process) until
   the response is delivered and its message OK.

Every container is removed at the end; the images stay, so that a second run reuses them.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
from sqlalchemy import create_engine
from sqlalchemy.exc import OperationalError

from tooling.image.build import (
    CheckFailed,
    Podman,
    base_image,
    orderly_images,
    run,
    say,
    services_image,
)
from tooling.processes import free_port
from tooling.sink import Sink

# --- running the containers -------------------------------------------------------------------


@dataclass
class Containers:
    podman: Podman
    prefix: str
    log_dir: Path | None
    names: list[str] = field(default_factory=list)

    def start(self, role: str, image: str, argv: Sequence[str], *run_args: str) -> str:
        name = f"{self.prefix}-{role}"
        args = ["run", "-d", "--name", name, "--network", "host", *self.podman.limits]
        run(self.podman.cmd(*args, *run_args, image, *argv), timeout=120, capture=True)
        self.names.append(name)
        return name

    def running(self, name: str) -> bool:
        state = subprocess.run(
            self.podman.cmd("inspect", "--format", "{{.State.Running}}", name),
            capture_output=True,
            text=True,
            check=False,
        )
        return state.stdout.strip() == "true"

    def logs(self, name: str) -> str:
        done = subprocess.run(
            self.podman.cmd("logs", name), capture_output=True, text=True, check=False
        )
        return done.stdout + done.stderr

    def dump(self, tail: int | None) -> None:
        for name in self.names:
            text = self.logs(name)
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                (self.log_dir / f"{name}.log").write_text(text)
            if tail:
                lines = text.splitlines()[-tail:]
                print(f"----- {name} (last {len(lines)} lines)", flush=True)
                print("\n".join(lines), flush=True)

    def remove_all(self) -> None:
        for name in reversed(self.names):
            subprocess.run(
                self.podman.cmd("rm", "--force", "--time", "5", name),
                capture_output=True,
                check=False,
                timeout=120,
            )
        self.names.clear()


def wait_until(
    check: Callable[[], bool],
    timeout: float,
    what: str,
    watch: Sequence[str] = (),
    *,
    containers: Containers | None = None,
) -> None:
    """Poll ``check`` until it is true; fail at once when a watched container has stopped."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if containers is not None:
            for name in watch:
                if not containers.running(name):
                    raise CheckFailed(f"{name} stopped while waiting for {what}")
        time.sleep(0.25)
    raise CheckFailed(f"timed out after {timeout}s waiting for {what}")


def _pg_ready(port: int) -> bool:
    engine = create_engine(f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres")
    try:
        with engine.connect():
            return True
    except OperationalError:
        return False
    finally:
        engine.dispose()


def _redis_ready(port: int) -> bool:
    try:
        return bool(redis.Redis(host="127.0.0.1", port=port, socket_timeout=2).ping())
    except redis.RedisError:
        return False


@dataclass
class Stack:
    """orderly's containers and the API client of a run."""

    box: Containers
    http: httpx.Client
    watch: list[str]
    run_id: str

    def wait(self, check: Callable[[], bool], timeout: float, what: str) -> None:
        wait_until(check, timeout, what, self.watch, containers=self.box)

    def post(self, path: str, body: dict[str, Any], expect: int = 201) -> dict[str, Any]:
        answer = self.http.post(path, json=body)
        if answer.status_code != expect:
            raise CheckFailed(f"POST {path}: {answer.status_code} {answer.text}")
        found: dict[str, Any] = answer.json()
        return found

    def message(self, msg_id: int) -> dict[str, Any]:
        found: dict[str, Any] = self.http.get(f"/messages/{msg_id}").json()
        return found


def start_services(box: Containers, services: str, ports: dict[str, int]) -> None:
    """Debian's PostgreSQL and Redis, from the services image, until both answer."""
    postgres = box.start(
        "postgres",
        services,
        [
            "sh",
            "-c",
            'bin=$(ls -d /usr/lib/postgresql/*/bin | tail -1) && "$bin/initdb" -D /tmp/pg -A '
            f'trust -U postgres >/dev/null && exec "$bin/postgres" -D /tmp/pg -p {ports["pg"]} '
            "-c listen_addresses=127.0.0.1 -k /tmp",
        ],
        "--user",
        "postgres",
        "--stop-signal",
        "SIGINT",
    )
    redis_box = box.start(
        "redis",
        services,
        ["redis-server", "--port", str(ports["redis"]), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no"],
        "--user",
        "redis",
    )  # fmt: skip
    wait_until(lambda: _pg_ready(ports["pg"]), 120, "PostgreSQL", [postgres], containers=box)
    wait_until(lambda: _redis_ready(ports["redis"]), 60, "Redis", [redis_box], containers=box)
    say("PostgreSQL and Redis (Debian's, in a container) answer")


def start_orderly(podman: Podman, box: Containers, app: str, ports: dict[str, int]) -> Stack:
    """migrate and a key from the image's command line, then the API, a worker and beat."""
    database = f"postgresql+psycopg2://postgres@127.0.0.1:{ports['pg']}/orderly_image"
    env = {
        "ORDERLY_DATABASE_URL": database,
        "ORDERLY_REDIS_URL": f"redis://127.0.0.1:{ports['redis']}/0",
        "ORDERLY_API_HOST": "127.0.0.1",
        "ORDERLY_API_PORT": str(ports["api"]),
        # The receiver of the conversation's channel listens on this machine's loopback.
        "ORDERLY_OUTBOUND_ALLOW": "127.0.0.1",
    }
    env_args = [arg for k, v in env.items() for arg in ("--env", f"{k}={v}")]

    def orderly(*args: str) -> str:
        argv = ["run", "--rm", "--network", "host", *podman.limits, *env_args, app]
        return run(podman.cmd(*argv, "orderly", *args), timeout=600, capture=True)

    orderly("migrate", "--create-database")
    scopes = ("produce", "operate", "admin")
    created = orderly("key", "create", "image-check", *(f"--scope={s}" for s in scopes))
    token = created.strip()  # the token alone on standard output
    say("orderly migrate --create-database and orderly key create ran from the image")
    watch = [
        box.start(role, app, argv, *env_args, "--env", f"ORDERLY_NODE_CODE={role}")
        for role, argv in (
            ("api", ["orderly", "api"]),
            ("worker", ["orderly", "worker", "--concurrency", "1"]),
            ("beat", ["orderly", "beat"]),
        )
    ]
    http = httpx.Client(
        base_url=f"http://127.0.0.1:{ports['api']}",
        timeout=10,
        headers={"Authorization": f"Bearer {token}"},
    )
    stack = Stack(box, http, watch, box.prefix.rsplit("-", 1)[-1])

    def api_up() -> bool:
        try:
            return http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    stack.wait(api_up, 120, "the API's /health")
    say("the API answers; worker and beat are running")
    return stack


def check_message(stack: Stack) -> None:
    """A message to the derived image's handler, until it is OK with the handler's data."""
    made = stack.post(
        "/messages",
        {
            "service": "imagecheck",
            "operation": "stamp",
            "correlation_id": f"image-{stack.run_id}",
            "source_system": "image-check",
            "msg_timestamp": "2026-01-01T00:00:00+00:00",
            "payload": "{}",
        },
    )
    msg_id = made["msg_id"]
    stack.wait(lambda: stack.message(msg_id)["state"] == "OK", 120, f"message {msg_id} OK")
    custom = stack.message(msg_id)["custom_data"]
    if custom != "stamped inside the image":
        raise CheckFailed(f"message {msg_id} OK but custom_data is {custom!r}")
    say(f"message {msg_id} OK: custom_data {custom!r} from the image's handler module")


def check_conversation(stack: Stack) -> None:
    """A request and its response on a channel to a sink in this process, until the response
    is delivered there and its message is OK."""
    with Sink() as client:
        channel = stack.http.put(
            "/channels/imagecheck",
            json={
                "url": client.url,
                "delivery_delay_ms": 20,
                "multiplier": 2.0,
                "attempts": 3,
                "timeout_ms": 2000,
            },
        )
        if channel.status_code != 200:
            raise CheckFailed(f"PUT /channels/imagecheck: {channel.status_code} {channel.text}")
        conversation = f"conv-{stack.run_id}"
        stack.post(
            f"/conversations/{conversation}/requests",
            {"request_id": "rq-1", "origin": "imagecheck"},
        )
        response = stack.post(
            f"/conversations/{conversation}/responses",
            {
                "request_id": "rq-1",
                "response_id": "rs-1",
                "payload": {"text": "hello from the image"},
                "last": True,
            },
        )
        response_msg = response["msg_id"]

        def delivered() -> list[dict[str, Any]]:
            return [a for a in client.arrivals() if a["response_id"] == "rs-1"]

        stack.wait(lambda: bool(delivered()), 120, "the response delivered to the receiver")
        stack.wait(
            lambda: stack.message(response_msg)["state"] == "OK",
            60,
            f"the response's message {response_msg} OK",
        )
        (arrival,) = delivered()
        expected = (conversation, "rq-1", {"text": "hello from the image"}, "rs-1")
        found = (
            arrival["conversation_id"],
            arrival["request_id"],
            arrival["payload"],
            arrival["key"],
        )
        if found != expected:
            raise CheckFailed(f"delivered {arrival}, expected {expected}")
        say(
            f"conversation {conversation}: response rs-1 delivered to {client.url} "
            f"(Idempotency-Key {arrival['key']}), message {response_msg} OK"
        )


def exercise(podman: Podman, services: str, app: str, log_dir: Path | None) -> None:
    ports = {"pg": free_port(), "redis": free_port(), "api": free_port()}
    say(f"ports: PostgreSQL {ports['pg']}, Redis {ports['redis']}, API {ports['api']}")
    box = Containers(podman, f"orderly-image-check-{uuid.uuid4().hex[:8]}", log_dir)
    try:
        start_services(box, services, ports)
        stack = start_orderly(podman, box, app, ports)
        check_message(stack)
        check_conversation(stack)
        box.dump(tail=None)
    except BaseException:
        box.dump(tail=60)
        raise
    finally:
        box.remove_all()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tooling.image", description=__doc__)
    parser.add_argument("--rebuild-base", action="store_true", help="build the base again")
    parser.add_argument("--log-dir", type=Path, help="write each container's log there")
    args = parser.parse_args(argv)
    try:
        podman = Podman.here()
        if shutil.which("mmdebstrap") is None:
            raise CheckFailed("mmdebstrap is not installed (./run.sh image installs it)")
        base, key = base_image(podman, args.rebuild_base)
        services = services_image(podman, base, key)
        app = orderly_images(podman, base)
        exercise(podman, services, app, args.log_dir)
    except (CheckFailed, subprocess.TimeoutExpired) as exc:
        say(f"FAILED: {exc}")
        return 1
    say("image check passed")
    return 0
