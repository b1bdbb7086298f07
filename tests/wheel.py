"""orderly as a user installs it: the wheel built from the image's sources (what the
Dockerfile copies, ``tests.image_context``), installed with its core dependencies into a fresh
virtualenv outside the repository. A pytest plugin (``pytest_plugins = ["tests.wheel"]``): the
fixture ``installed`` builds it once a session."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.image_context import build_wheel


@dataclass(frozen=True)
class Installed:
    venv: Path
    wheel: Path

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment with the venv first on PATH and nothing of the checkout
        or of the tests' own orderly settings (they come from ``extra`` only)."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV")
            and not k.startswith(("ORDERLY_", "AURA_QUEUE_", "AURA_LOGGING_"))
        }
        env["PATH"] = f"{self.bin}:{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(self.venv)
        return {**env, **extra}


def build_and_install(root: Path) -> Installed:
    """Build the wheel from what the Dockerfile copies (the image's own sources, a copy: a
    build in place leaves build/ and *.egg-info behind) and install it, core dependencies
    only, into ``root/venv``."""
    wheel = build_wheel(root)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # Not the tests' PYTHONPATH: with the checkout on it, pip would take the checkout's
    # orderly for installed and install nothing.
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", str(wheel)],
        check=True,
        timeout=900,
        cwd=root,
        env=clean,
    )
    if not (venv / "bin" / "orderly").exists():
        raise AssertionError(f"the wheel installed no orderly command into {venv}")
    return Installed(venv=venv, wheel=wheel)


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """A virtualenv with the wheel built from this checkout, core dependencies only."""
    return build_and_install(tmp_path_factory.mktemp("install"))
