"""The container image: its build context makes the wheel (every run, no container tools
needed), and, opted in, the image built and run for real (``./run.sh image``)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.image_context import (
    ROOT,
    build_wheel,
    ignore_rules,
    ignored,
    instructions,
    product_files,
)

# --- the tests ------------------------------------------------------------------------------------


def test_the_base_is_a_build_argument_and_the_context_keeps_secrets_and_tooling_out() -> None:
    steps = instructions((ROOT / "Dockerfile").read_text())
    (base,) = [args for word, args in steps if word == "FROM"]
    assert base.startswith("${") and ("ARG", f"{base[2:-1]}=python:3.11-slim-bookworm") in steps
    rules = ignore_rules(ROOT)
    for left_out in (".git", ".venv", ".env", "tests", "tooling", "site", "worker/__pycache__/x"):
        assert ignored(rules, left_out), left_out
    for kept in ("pyproject.toml", "README.md", "orderly/__init__.py", "worker/lua/x.lua"):
        assert not ignored(rules, kept), kept


def test_the_wheel_builds_from_exactly_what_the_dockerfile_copies(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    dist_info = {t for t in tops if re.fullmatch(r"orderly-[^/-]+\.dist-info", t)}
    assert len(dist_info) == 1 and tops == {"orderly", *dist_info}, sorted(tops)
    missing = sorted(product_files() - set(names))
    assert missing == [], f"in the checkout, not in the wheel: {missing}"


IMAGE_TOOLS = ("podman", "mmdebstrap")


def test_the_image_builds_and_runs_a_message_and_a_conversation(tmp_path: Path) -> None:
    """tooling/image/: a local Debian base, the Dockerfile built on it, PostgreSQL and
    Redis in containers, and the API, a worker and beat from the image processing a message
    and delivering a conversation's response. Minutes, not seconds: opted in."""
    if os.environ.get("ORDERLY_TEST_IMAGE") != "1":
        pytest.skip(
            "builds and runs the container image (minutes): run `./run.sh image`, "
            "or set ORDERLY_TEST_IMAGE=1"
        )
    missing = [tool for tool in IMAGE_TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: `./run.sh image` installs them")
    done = subprocess.run(
        [sys.executable, "-m", "tooling.image", "--log-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-4000:]
    assert "image check passed" in done.stdout
    assert re.search(r"message \d+ OK: custom_data 'stamped inside the image'", done.stdout)
    assert re.search(r"response rs-1 delivered to .* message \d+ OK", done.stdout)
