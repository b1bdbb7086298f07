"""The image's build context read as the builder reads it: the Dockerfile's instructions (the
subset it uses) and .dockerignore, and the wheel built from exactly what its COPY lines copy
(``build_wheel``). The image test checks that wheel; ``tests.wheel`` installs it."""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent
# What the wheel carries besides Python modules (pyproject.toml's package-data).
DATA_SUFFIXES = {".py", ".lua", ".sql", ".mako", ".properties", ".html", ".css", ".js"}


# --- the Dockerfile read as the builder reads it (the subset it uses) ---------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments): continuation lines joined, comments left out."""
    found: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        if whole:
            word, _, rest = whole.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def ignore_rules(context: Path) -> list[tuple[bool, re.Pattern[str]]]:
    """.dockerignore as (exception?, pattern): Go's filepath.Match with ``**``; a pattern that
    matches a directory covers everything in it; the last rule that matches decides."""
    path = context / ".dockerignore"
    rules: list[tuple[bool, re.Pattern[str]]] = []
    for raw in path.read_text().splitlines() if path.exists() else []:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = posixpath.normpath(line.lstrip("!").strip()).lstrip("/")
        rules.append((negated, re.compile(f"^{_translate(pattern)}(?:/.*)?$")))
    return rules


def _translate(pattern: str) -> str:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            char = pattern[i]
            out += {"*": "[^/]*", "?": "[^/]"}.get(char, re.escape(char))
            i += 1
    return out


def ignored(rules: list[tuple[bool, re.Pattern[str]]], relative: str) -> bool:
    verdict = False
    for negated, pattern in rules:
        if pattern.match(relative):
            verdict = not negated
    return verdict


@dataclass
class Assembled:
    """What the Dockerfile's COPY lines put in the image (under ``root``), and where its
    ``pip install`` runs."""

    root: Path
    copied: list[str] = field(default_factory=list)
    install: PurePosixPath | None = None


def assemble(dockerfile: Path, context: Path, root: Path) -> Assembled:
    rules = ignore_rules(context)
    done = Assembled(root)
    workdir = PurePosixPath("/")
    for word, args in instructions(dockerfile.read_text()):
        if word == "WORKDIR":
            workdir = workdir / args
        elif word in ("COPY", "ADD"):
            words = json.loads(args) if args.startswith("[") else shlex.split(args)
            flags = [w for w in words if w.startswith("--")]
            assert not [f for f in flags if f.startswith("--from")], "multi-stage COPY"
            *sources, target = [w for w in words if not w.startswith("--")]
            dest = workdir / target
            for source in sources:
                many = len(sources) > 1 or target.endswith("/")
                _copy(context, rules, source, root / str(dest).lstrip("/"), many=many)
                done.copied.append(source)
        elif word == "RUN" and "pip install" in args:
            words = shlex.split(args.split("pip install", 1)[1].split("&&")[0])
            (target,) = [w for w in words if not w.startswith("-")]
            done.install = workdir / target.split("[")[0]
    return done


def _copy(
    context: Path, rules: list[tuple[bool, re.Pattern[str]]], source: str, here: Path, *, many: bool
) -> None:
    src = context / source
    relative = posixpath.normpath(source)
    assert src.exists() or src.is_symlink(), f"COPY {source}: not in the build context"
    assert not ignored(rules, relative), f"COPY {source}: left out by .dockerignore"
    if src.is_dir() and not src.is_symlink():
        # A directory's contents go to the destination; symbolic links stay links.
        for walked, dirs, files in os.walk(src):
            base = Path(walked)
            rel_dir = base.relative_to(context).as_posix()
            dirs[:] = [d for d in dirs if not ignored(rules, f"{rel_dir}/{d}")]
            out = here / base.relative_to(src)
            out.mkdir(parents=True, exist_ok=True)
            for name in [*files, *(d for d in dirs if (base / d).is_symlink())]:
                if ignored(rules, f"{rel_dir}/{name}"):
                    continue
                item = base / name
                if item.is_symlink():
                    (out / name).symlink_to(os.readlink(item))
                else:
                    shutil.copy2(item, out / name)
            dirs[:] = [d for d in dirs if not (base / d).is_symlink()]
    else:
        target = here / src.name if many else here
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def product_files() -> set[str]:
    """Every file of the package ``orderly`` in the checkout, as the wheel names it."""
    found: set[str] = set()
    package = ROOT / "orderly"
    for walked, dirs, files in os.walk(package, followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            path = Path(walked) / name
            if path.suffix in DATA_SUFFIXES or name == "py.typed":
                found.add(f"orderly/{path.relative_to(package).as_posix()}")
    return found


def build_wheel(root: Path) -> Path:
    """The wheel built where the Dockerfile's ``pip install`` runs, from exactly what its COPY
    lines copy (under ``root/image``), into ``root/wheels``."""
    image = assemble(ROOT / "Dockerfile", ROOT, root / "image")
    if image.install is None:
        raise AssertionError("the Dockerfile runs no pip install")
    source = image.root / str(image.install).lstrip("/")
    wheels = root / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
    )
    if built.returncode != 0:
        raise AssertionError(f"copied {image.copied}:\n{built.stdout}{built.stderr}")
    (wheel,) = wheels.glob("orderly-*.whl")
    return wheel
