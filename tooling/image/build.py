"""The images ``python -m tooling.image`` (``./run.sh image``) runs, built here without pulling
any image: a Debian bookworm base made with Debian's own tools (``mmdebstrap`` to a tarball,
cached in ``ORDERLY_IMAGE_CACHE``, default ``/var/cache/orderly-image`` as root and
``~/.cache/orderly-image`` otherwise; ``podman import``), orderly's image from the
repository's ``Dockerfile`` on it, a derived image with a handler module of its own (as the
Dockerfile tells users to do), and an image of Debian's PostgreSQL and Redis on the same base.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tooling.processes import ROOT

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
