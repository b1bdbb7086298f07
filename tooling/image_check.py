"""Build orderly's container image and run it for real, without pulling any image.

``python -m tooling.image_check`` (``./run.sh image``):

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
import contextlib
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import redis
from sqlalchemy import create_engine
from sqlalchemy.exc import OperationalError

from tooling.processes import ROOT, free_port

# The base's tarball: the system's cache as root, the user's own otherwise.
CACHE = Path(
    os.environ.get("ORDERLY_IMAGE_CACHE")
    or (
        "/var/cache/orderly-image"
        if os.geteuid() == 0
        else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "orderly-image"
    )
)
SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates")
SERVICE_PACKAGES = ("postgresql", "redis-server")
# Certificates this machine added to its trust (a company's or an egress proxy's CA): the local
# base trusts them too, so that pip inside the build reaches PyPI the way the host does.
LOCAL_CAS = Path("/usr/local/share/ca-certificates")
ORDERLY_TAG = "localhost/orderly:image-check"
DERIVED_TAG = "localhost/orderly-image-check-app:latest"
HANDLER_MODULE = "image_handlers"
HANDLERS = '''"""The derived image's own handler module (ORDERLY_HANDLER_MODULES)."""

from orderly.worker.handlers import MessageContext, registry


@registry.register("imagecheck", "stamp")
def stamp(ctx: MessageContext) -> None:
    ctx.custom_data = "stamped inside the image"
'''
DERIVED = f"""FROM {ORDERLY_TAG}
COPY {HANDLER_MODULE}.py /app/handlers/
ENV PYTHONPATH=/app/handlers ORDERLY_HANDLER_MODULES={HANDLER_MODULE}
"""
SERVICES = """FROM {base}
RUN apt-get update \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends {packages} \\
 && rm -rf /var/lib/apt/lists/*
"""
PIP_CONF = r"[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n"  # printf's escapes

_started = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - _started:7.1f}s] {text}", flush=True)


class CheckFailed(RuntimeError):
    pass


def run(argv: Sequence[str], *, timeout: float, capture: bool = False) -> str:
    """Run a command; its output goes to ours unless captured (then its standard output is
    returned). A failure raises."""
    done = subprocess.run(
        list(argv),
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.PIPE if capture else None,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        tail = ((done.stdout or "") + (done.stderr or ""))[-4000:]
        raise CheckFailed(f"exit {done.returncode}: {' '.join(argv)}\n{tail}")
    return done.stdout or ""


# --- the local Debian base --------------------------------------------------------------------


def apt_sources(suite: str = SUITE) -> list[str]:
    """This machine's Debian sources for ``suite`` (and its -updates, -security) as one-line
    entries: the mirrors that answer here. deb.debian.org when the machine has none."""
    entries: list[str] = []
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in files:
        if path.suffix == ".sources" and path.is_file():
            for stanza in path.read_text().split("\n\n"):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if line.strip().startswith("#") or ":" not in line:
                        continue
                    key, _, value = line.partition(":")
                    fields[key.strip().lower()] = value.strip()
                if "deb" not in fields.get("types", "").split():
                    continue
                if fields.get("enabled", "yes").lower() == "no":
                    continue
                for uri in fields.get("uris", "").split():
                    for name in fields.get("suites", "").split():
                        if name == suite or name.startswith(f"{suite}-"):
                            entries.append(f"deb {uri} {name} {fields.get('components', 'main')}")
        elif path.suffix == ".list" or path.name == "sources.list":
            if not path.is_file():
                continue
            for line in path.read_text().splitlines():
                words = line.split("#", 1)[0].split()
                if (
                    len(words) >= 3
                    and words[0] == "deb"
                    and not words[1].startswith("[")
                    and (words[2] == suite or words[2].startswith(f"{suite}-"))
                ):
                    entries.append(" ".join(words))
    return list(dict.fromkeys(entries)) or [
        f"deb http://deb.debian.org/debian {suite} main",
        f"deb http://deb.debian.org/debian {suite}-updates main",
        f"deb http://deb.debian.org/debian-security {suite}-security main",
    ]


def local_cas() -> list[Path]:
    return sorted(LOCAL_CAS.rglob("*.crt")) if LOCAL_CAS.is_dir() else []


def base_key(packages: Sequence[str], sources: Sequence[str], cas: Sequence[Path]) -> str:
    digest = hashlib.sha256(json.dumps([SUITE, list(packages), list(sources)]).encode())
    for ca in cas:
        digest.update(ca.read_bytes())
    return digest.hexdigest()[:12]


def base_tarball(rebuild: bool) -> tuple[Path, str]:
    """The base's tarball (built by mmdebstrap unless cached) and its cache key."""
    sources, cas = apt_sources(), local_cas()
    key = base_key(BASE_PACKAGES, sources, cas)
    tarball = CACHE / f"base-{SUITE}-{key}.tar"
    if tarball.exists() and not rebuild:
        say(f"base tarball cached: {tarball}")
        return tarball, key
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = tarball.with_suffix(".partial.tar")
    hooks: list[str] = []
    if cas:
        hooks.append('mkdir -p "$1/usr/local/share/ca-certificates"')
        hooks += [f"copy-in {ca} /usr/local/share/ca-certificates/" for ca in cas]
        hooks.append('chroot "$1" update-ca-certificates')
        # pip (the image's virtualenv too) checks certificates against the system's store.
        hooks.append(f"printf '{PIP_CONF}' > \"$1/etc/pip.conf\"")
    say(f"building the base with mmdebstrap ({', '.join(BASE_PACKAGES)}) from {sources}")
    run(
        [
            "mmdebstrap",
            "--variant=apt",
            "--format=tar",
            f"--include={','.join(BASE_PACKAGES)}",
            *(f"--customize-hook={hook}" for hook in hooks),
            SUITE,
            str(partial),
            *sources,
        ],
        timeout=1800,
    )
    partial.rename(tarball)
    say(f"base tarball: {tarball} ({tarball.stat().st_size // 2**20} MiB)")
    return tarball, key


# --- podman -----------------------------------------------------------------------------------


@dataclass
class Podman:
    """podman with what this machine needs: runc where the cgroups are v1 or hybrid (crun
    refuses them), and ulimits no higher than ours (without CAP_SYS_RESOURCE a container's
    limits cannot be raised, and podman's defaults are higher)."""

    exe: str = "podman"
    global_args: list[str] = field(default_factory=list)
    limits: list[str] = field(default_factory=list)

    @classmethod
    def here(cls) -> Podman:
        exe = shutil.which("podman")
        if exe is None:
            raise CheckFailed("podman is not installed (./run.sh image installs it)")
        global_args: list[str] = []
        runtime = os.environ.get("ORDERLY_IMAGE_RUNTIME")
        if runtime is None and not Path("/sys/fs/cgroup/cgroup.controllers").exists():
            runtime = "runc" if shutil.which("runc") else None
        if runtime:
            global_args += ["--runtime", runtime]
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        nofile = min(hard, 65536)
        limits = ["--ulimit", f"nofile={min(soft, nofile)}:{nofile}"]
        # A handful of processes in each: far below any limit the runtime itself runs with.
        limits += ["--ulimit", "nproc=4096:4096"]
        return cls(exe, global_args, limits)

    def cmd(self, *args: str) -> list[str]:
        return [self.exe, *self.global_args, *args]

    def image_exists(self, tag: str) -> bool:
        return subprocess.run(self.cmd("image", "exists", tag), check=False).returncode == 0

    def build(
        self, context: Path, tag: str, *extra: str, containerfile: Path | None = None
    ) -> None:
        args = ["build", "--network", "host", *self.limits, "-t", tag, *extra]
        if containerfile is not None:
            args += ["-f", str(containerfile)]
        run(self.cmd(*args, str(context)), timeout=3600)


def base_image(podman: Podman, rebuild: bool) -> tuple[str, str]:
    tarball, key = base_tarball(rebuild)
    tag = f"localhost/orderly-image-base:{key}"
    if rebuild or not podman.image_exists(tag):
        say(f"importing {tarball.name} as {tag}")
        run(podman.cmd("import", str(tarball), tag), timeout=600, capture=True)
    return tag, key


def services_image(podman: Podman, base: str, key: str) -> str:
    tag = f"localhost/orderly-image-services:{key}"
    if not podman.image_exists(tag):
        say(f"building {tag}: Debian's {' and '.join(SERVICE_PACKAGES)} on the base")
        with tempfile.TemporaryDirectory() as tmp:
            file = Path(tmp) / "Containerfile"
            file.write_text(SERVICES.format(base=base, packages=" ".join(SERVICE_PACKAGES)))
            podman.build(Path(tmp), tag, containerfile=file)
    return tag


def orderly_images(podman: Podman, base: str) -> str:
    say(f"podman build of the Dockerfile with BASE_IMAGE={base}")
    podman.build(ROOT, ORDERLY_TAG, "--build-arg", f"BASE_IMAGE={base}")
    say(f"derived image {DERIVED_TAG}: handler module {HANDLER_MODULE} copied in")
    with tempfile.TemporaryDirectory() as tmp:
        context = Path(tmp)
        (context / f"{HANDLER_MODULE}.py").write_text(HANDLERS)
        (context / "Containerfile").write_text(DERIVED)
        podman.build(context, DERIVED_TAG, containerfile=context / "Containerfile")
    return DERIVED_TAG


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


class Receiver(ThreadingHTTPServer):
    """The channel's client: records every POST orderly delivers, answers 200."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ReceiverHandler)
        self.lock = threading.Lock()
        self.deliveries: list[dict[str, Any]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/in"

    def got(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.deliveries)


class _ReceiverHandler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
        with self.server.lock:
            self.server.deliveries.append(
                {"path": self.path, "key": self.headers.get("Idempotency-Key"), "body": body}
            )
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


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


def exercise(podman: Podman, services: str, app: str, log_dir: Path | None) -> None:
    ports = {"pg": free_port(), "redis": free_port(), "api": free_port()}
    say(f"ports: PostgreSQL {ports['pg']}, Redis {ports['redis']}, API {ports['api']}")
    run_id = uuid.uuid4().hex[:8]
    box = Containers(podman, f"orderly-image-check-{run_id}", log_dir)
    try:
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

        env = {
            "ORDERLY_DATABASE_URL": (
                f"postgresql+psycopg2://postgres@127.0.0.1:{ports['pg']}/orderly_image"
            ),
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
        created = orderly(
            "key",
            "create",
            "image-check",
            "--scope",
            "produce",
            "--scope",
            "operate",
            "--scope",
            "admin",
        )
        token = created.strip()  # the token alone on standard output
        say("orderly migrate --create-database and orderly key create ran from the image")

        started = {
            role: box.start(role, app, argv, *env_args, "--env", f"ORDERLY_NODE_CODE={role}")
            for role, argv in (
                ("api", ["orderly", "api"]),
                ("worker", ["orderly", "worker", "--concurrency", "1"]),
                ("beat", ["orderly", "beat"]),
            )
        }
        watch = list(started.values())
        http = httpx.Client(
            base_url=f"http://127.0.0.1:{ports['api']}",
            timeout=10,
            headers={"Authorization": f"Bearer {token}"},
        )

        def api_up() -> bool:
            try:
                return http.get("/health").status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(api_up, 120, "the API's /health", watch, containers=box)
        say("the API answers; worker and beat are running")

        made = http.post(
            "/messages",
            json={
                "service": "imagecheck",
                "operation": "stamp",
                "correlation_id": f"image-{run_id}",
                "source_system": "image-check",
                "msg_timestamp": "2026-01-01T00:00:00+00:00",
                "payload": "{}",
            },
        )
        if made.status_code != 201:
            raise CheckFailed(f"POST /messages: {made.status_code} {made.text}")
        msg_id = made.json()["msg_id"]
        wait_until(
            lambda: http.get(f"/messages/{msg_id}").json()["state"] == "OK",
            120,
            f"message {msg_id} OK",
            watch,
            containers=box,
        )
        custom = http.get(f"/messages/{msg_id}").json()["custom_data"]
        if custom != "stamped inside the image":
            raise CheckFailed(f"message {msg_id} OK but custom_data is {custom!r}")
        say(f"message {msg_id} OK: custom_data {custom!r} from the image's handler module")

        with receiver() as client:
            channel = http.put(
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
            conversation = f"conv-{run_id}"
            request = http.post(
                f"/conversations/{conversation}/requests",
                json={"request_id": "rq-1", "origin": "imagecheck"},
            )
            if request.status_code != 201:
                raise CheckFailed(f"POST .../requests: {request.status_code} {request.text}")
            response = http.post(
                f"/conversations/{conversation}/responses",
                json={
                    "request_id": "rq-1",
                    "response_id": "rs-1",
                    "payload": {"text": "hello from the image"},
                    "last": True,
                },
            )
            if response.status_code != 201:
                raise CheckFailed(f"POST .../responses: {response.status_code} {response.text}")
            response_msg = response.json()["msg_id"]
            wait_until(
                lambda: any(d["body"].get("response_id") == "rs-1" for d in client.got()),
                120,
                "the response delivered to the receiver",
                watch,
                containers=box,
            )
            wait_until(
                lambda: http.get(f"/messages/{response_msg}").json()["state"] == "OK",
                60,
                f"the response's message {response_msg} OK",
                watch,
                containers=box,
            )
            (delivery,) = [d for d in client.got() if d["body"].get("response_id") == "rs-1"]
            body = delivery["body"]
            expected = (conversation, "rq-1", {"text": "hello from the image"}, "rs-1")
            found = (
                body.get("conversation_id"),
                body.get("request_id"),
                body.get("payload"),
                delivery["key"],
            )
            if found != expected:
                raise CheckFailed(f"delivered {delivery}, expected {expected}")
            say(
                f"conversation {conversation}: response rs-1 delivered to {client.url} "
                f"(Idempotency-Key {delivery['key']}), message {response_msg} OK"
            )
        box.dump(tail=None)
    except BaseException:
        box.dump(tail=60)
        raise
    finally:
        box.remove_all()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tooling.image_check", description=__doc__)
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


if __name__ == "__main__":
    sys.exit(main())
