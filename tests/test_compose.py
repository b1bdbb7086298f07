"""docker-compose.yml is valid for Debian's docker-compose (there is no Docker engine here)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import IN_CI

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {"redis", "postgres", "migrate", "api", "worker", "beat", "flower"}


def compose(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("docker-compose")
    if exe is None:
        if IN_CI:
            pytest.fail("docker-compose is not installed")
        pytest.skip("docker-compose is not installed")
    return subprocess.run(
        [exe, "-f", str(path), *args], capture_output=True, text=True, cwd=path.parent, timeout=60
    )


def test_compose_file_is_valid_and_has_every_service() -> None:
    done = compose(ROOT / "docker-compose.yml", "config", "--services")
    assert done.returncode == 0, done.stderr
    assert set(done.stdout.split()) == SERVICES


def test_services_wait_for_healthy_stores_and_the_migration() -> None:
    done = compose(ROOT / "docker-compose.yml", "config")
    assert done.returncode == 0, done.stderr
    # api, worker, beat and flower wait for redis and postgres; migrate for postgres
    assert done.stdout.count("condition: service_healthy") == 4 * 2 + 1
    assert "condition: service_completed_successfully" in done.stdout


def test_a_broken_file_is_refused(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    text = (ROOT / "docker-compose.yml").read_text()
    broken.write_text(text.replace("    image: redis:7\n", "    image: [redis, 7]\n", 1))
    assert compose(broken, "config", "-q").returncode != 0
