"""docker-compose.yml is valid for Debian's docker-compose (there is no Docker engine here)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.conftest import IN_CI

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {
    "redis",
    "postgres",
    "migrate",
    "api",
    "worker",
    "beat",
    "flower",
    "prometheus",
}
# The file refuses to be used without Flower's password.
FLOWER_ENV = {"ORDERLY_FLOWER_PASSWORD": "compose-test-password"}


def compose(
    path: Path, *args: str, env: Mapping[str, str] = FLOWER_ENV
) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("docker-compose")
    if exe is None:
        if IN_CI:
            pytest.fail("docker-compose is not installed")
        pytest.skip("docker-compose is not installed")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ORDERLY_FLOWER_")}
    full_env.update(env)
    return subprocess.run(
        [exe, "-f", str(path), *args],
        capture_output=True,
        text=True,
        cwd=path.parent,
        timeout=60,
        env=full_env,
    )


def service_block(config: str, name: str) -> str:
    """One service's part of ``docker-compose config`` output (services are indented by 2)."""
    found = re.search(rf"^  {name}:\n((?:    .*\n)*)", config, re.MULTILINE)
    assert found is not None, f"no service {name}"
    return found.group(1)


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


def test_flower_needs_its_password_and_listens_on_every_interface(tmp_path: Path) -> None:
    # A copy away from the repository's root, so that a developer's .env cannot supply it.
    copy = tmp_path / "docker-compose.yml"
    copy.write_text((ROOT / "docker-compose.yml").read_text())
    refused = compose(copy, "config", "-q", env={})
    assert refused.returncode != 0
    assert "ORDERLY_FLOWER_PASSWORD" in refused.stderr

    done = compose(ROOT / "docker-compose.yml", "config")
    assert done.returncode == 0, done.stderr
    flower = service_block(done.stdout, "flower")
    assert "ORDERLY_FLOWER_PASSWORD: compose-test-password" in flower
    assert "ORDERLY_FLOWER_ADDRESS: 0.0.0.0" in flower
    # Flower's options come from the Celery app, not from a file it may not find.
    assert "- flower\n" in flower and "flowerconfig" not in flower
    # The API and Flower are published on the host's loopback only.
    assert "- 127.0.0.1:5555:5555" in flower
    assert "- 127.0.0.1:8000:8000" in service_block(done.stdout, "api")


def test_prometheus_scrapes_the_api_and_flower() -> None:
    done = compose(ROOT / "docker-compose.yml", "config")
    assert done.returncode == 0, done.stderr
    prometheus = service_block(done.stdout, "prometheus")
    assert "image: prom/prometheus:" in prometheus
    assert "deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus
    scrape = (ROOT / "deploy" / "prometheus.yml").read_text()
    assert '- targets: ["api:8000"]' in scrape
    assert '- targets: ["flower:5555"]' in scrape
    assert scrape.count("metrics_path: /metrics") == 2


def test_redis_keeps_an_append_only_file_on_a_volume() -> None:
    done = compose(ROOT / "docker-compose.yml", "config")
    assert done.returncode == 0, done.stderr
    redis_block = service_block(done.stdout, "redis")
    assert re.search(r"--appendonly\W+yes", redis_block), redis_block
    assert re.search(r"--appendfsync\W+everysec", redis_block), redis_block
    assert "redisdata" in redis_block and "/data" in redis_block
