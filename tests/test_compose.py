"""docker-compose.yml as Debian's docker-compose resolves it, read as data: services, their
commands, health checks, restart policies, volumes, dependencies, published ports and the
worker's stop grace (there is no Docker engine here to start them); the metrics-key service's
own command run for real against the test database."""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import Engine

from orderly.worker import keys
from orderly.worker.core.errors import Unauthenticated
from orderly.worker.settings import get_settings
from orderly.worker.supervisor import Supervisor
from tests.conftest import IN_CI
from tooling.processes import BIN

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {
    "redis",
    "postgres",
    "migrate",
    "metrics-key",
    "api",
    "worker",
    "beat",
    "flower",
    "prometheus",
    "grafana",
}
# The file refuses to be used without Flower's and Grafana's passwords.
FLOWER_ENV = {
    "ORDERLY_FLOWER_PASSWORD": "compose-test-password",
    "ORDERLY_GRAFANA_PASSWORD": "compose-test-grafana",
}


def compose(
    path: Path, *args: str, env: Mapping[str, str] = FLOWER_ENV
) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("docker-compose")
    if exe is None:
        if IN_CI:
            pytest.fail("docker-compose is not installed")
        pytest.skip("docker-compose is not installed")
    full_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ORDERLY_FLOWER_", "ORDERLY_GRAFANA_"))
    }
    full_env.update(env)
    return subprocess.run(
        [exe, "-f", str(path), *args],
        capture_output=True,
        text=True,
        cwd=path.parent,
        timeout=60,
        env=full_env,
    )


def resolved() -> dict[str, Any]:
    """``docker-compose config`` (anchors merged, variables filled) as data."""
    done = compose(ROOT / "docker-compose.yml", "config")
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = yaml.safe_load(done.stdout)
    return found


ORDERLY = {"api", "worker", "beat", "flower"}
ONE_SHOT = {"migrate", "metrics-key"}
LONG_RUNNING = SERVICES - ONE_SHOT


def test_compose_file_is_valid_and_has_every_service() -> None:
    assert set(resolved()["services"]) == SERVICES


def test_services_wait_for_healthy_stores_and_the_migration() -> None:
    services = resolved()["services"]
    for name in ORDERLY:
        assert services[name]["depends_on"] == {
            "redis": {"condition": "service_healthy"},
            "postgres": {"condition": "service_healthy"},
            "migrate": {"condition": "service_completed_successfully"},
        }, name
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["migrate"]["command"] == ["orderly", "migrate"]


def test_every_long_running_service_restarts_and_the_stores_and_orderly_report_health() -> None:
    services = resolved()["services"]
    for name in LONG_RUNNING:
        # A worker told to exit (orderly node stop --exit) exits 0 and stays down.
        expected = "on-failure" if name == "worker" else "unless-stopped"
        assert services[name]["restart"] == expected, name
    for name in ONE_SHOT:
        assert services[name]["restart"] == "no", name
    for name in ORDERLY | {"redis", "postgres"}:
        test = services[name]["healthcheck"]["test"]
        assert test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, name
    # The worker and beat are healthy while their node's heartbeat is recent.
    for name in ("worker", "beat"):
        assert services[name]["healthcheck"]["test"] == ["CMD", "orderly", "node", "alive"]
    # orderly's own runners, with orderly's settings.
    for name in ORDERLY:
        assert services[name]["command"][:2] == ["orderly", name], name
    # Beat exactly once: nothing scales it.
    assert "scale" not in services["beat"] and "deploy" not in services["beat"]
    # No Celery command line of its own: the Celery app is orderly.worker, behind the runners.
    for name, service in services.items():
        assert "celery" not in " ".join(service.get("command") or []), name


def _seconds(duration: str) -> float:
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * scale[u] for n, u in parts)


def test_the_worker_has_time_for_its_warm_shutdown() -> None:
    """docker-compose stop waits stop_grace_period before SIGKILL: longer than the supervisor
    waits for its Celery workers to finish the tasks in hand, itself longer than a handler may
    run (its time limit and kill grace, by default)."""
    worker = resolved()["services"]["worker"]
    supervisor_grace = inspect.signature(Supervisor.stop).parameters["grace_s"].default
    settings = get_settings()
    handler_s = (settings.handler_time_limit_ms + settings.handler_kill_grace_ms) / 1000
    assert handler_s < supervisor_grace < _seconds(worker["stop_grace_period"])


def test_volumes_for_the_stores_and_the_reports() -> None:
    config = resolved()
    services = config["services"]
    assert {"redisdata", "pgdata", "reports"} <= set(config["volumes"])

    def mounts(name: str) -> dict[str, str]:
        return {v.split(":")[1]: v.split(":")[0] for v in services[name].get("volumes", [])}

    assert mounts("redis")["/data"] == "redisdata"
    assert mounts("postgres")["/var/lib/postgresql/data"] == "pgdata"
    for name in ORDERLY:
        assert mounts(name)["/app/reports-out"] == "reports", name


def test_published_ports_are_on_the_hosts_loopback() -> None:
    services = resolved()["services"]
    published = {
        name: [str(p) for p in service.get("ports", [])] for name, service in services.items()
    }
    expected = {"api", "flower", "prometheus", "grafana"}
    assert {n for n, ports in published.items() if ports} == expected
    for name, ports in published.items():
        for port in ports:
            assert port.startswith("127.0.0.1:"), (name, port)


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

    flower = resolved()["services"]["flower"]
    assert flower["environment"]["ORDERLY_FLOWER_PASSWORD"] == "compose-test-password"
    assert flower["environment"]["ORDERLY_FLOWER_ADDRESS"] == "0.0.0.0"
    # Flower's options come from the Celery app, not from a file it may not find.
    assert flower["command"] == ["orderly", "flower"]


KEY_DIR, KEY_FILE = "/app/metrics-key", "orderly-metrics-key"


def test_prometheus_scrapes_the_api_with_a_key_and_flower() -> None:
    config = resolved()
    prometheus = config["services"]["prometheus"]
    assert prometheus["image"].startswith("prom/prometheus:")
    mounted = {v.split(":")[1]: v.split(":")[0] for v in prometheus["volumes"]}
    assert mounted["/etc/prometheus/prometheus.yml"].endswith("/deploy/prometheus.yml")
    # The key comes from the volume metrics-key fills, not from a file a fresh clone lacks.
    key_mount = next(m for m, source in mounted.items() if source == "metricskey")
    assert "metricskey" in config["volumes"]
    assert not [s for s in mounted.values() if "orderly-metrics-key" in s]
    assert prometheus["depends_on"]["metrics-key"] == {
        "condition": "service_completed_successfully"
    }
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert jobs["orderly-api"]["static_configs"] == [{"targets": ["api:8000"]}]
    assert jobs["orderly-api"]["authorization"] == {
        "type": "Bearer",
        "credentials_file": f"{key_mount}/{KEY_FILE}",
    }
    assert jobs["flower"]["static_configs"] == [{"targets": ["flower:5555"]}]
    assert all(job["metrics_path"] == "/metrics" for job in jobs.values())
    # orderly's alert rules, mounted where the configuration loads them from
    assert mounted["/etc/prometheus/orderly-rules.yml"].endswith("/deploy/orderly-rules.yml")
    assert scrape["rule_files"] == ["/etc/prometheus/orderly-rules.yml"]


def test_grafana_needs_its_password_and_shows_orderlys_dashboard_from_prometheus(
    tmp_path: Path,
) -> None:
    copy = tmp_path / "docker-compose.yml"
    copy.write_text((ROOT / "docker-compose.yml").read_text())
    refused = compose(copy, "config", "-q", env={"ORDERLY_FLOWER_PASSWORD": "x"})
    assert refused.returncode != 0 and "ORDERLY_GRAFANA_PASSWORD" in refused.stderr

    grafana = resolved()["services"]["grafana"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "compose-test-grafana"
    mounted = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    provisioning = Path(mounted["/etc/grafana/provisioning"])
    assert provisioning == ROOT / "deploy" / "grafana" / "provisioning"
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    assert [d["url"] for d in sources["datasources"]] == ["http://prometheus:9090"]
    providers = yaml.safe_load((provisioning / "dashboards" / "orderly.yml").read_text())
    folder = providers["providers"][0]["options"]["path"]
    dashboard = next(source for m, source in mounted.items() if m.startswith(folder + "/"))
    assert Path(dashboard) == ROOT / "deploy" / "grafana" / "orderly-dashboard.json"


def test_redis_keeps_an_append_only_file_on_a_volume() -> None:
    command = " ".join(resolved()["services"]["redis"]["command"])
    assert "--appendonly yes" in command and "--appendfsync everysec" in command


def test_the_metrics_key_is_made_on_the_first_up_and_kept(db: Engine, tmp_path: Path) -> None:
    """The metrics-key service's own command, run with orderly's CLI against the test
    database (its volume a directory here): the first run makes a key with the metrics scope,
    a second leaves it as it is."""
    service = resolved()["services"]["metrics-key"]
    assert service["image"] == "orderly:latest"
    assert f"metricskey:{KEY_DIR}:rw" in service["volumes"]
    assert service["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    shell, flags, script = service["command"]
    assert (shell, flags) == ("sh", "-ec") and KEY_DIR in script
    volume = tmp_path / "metricskey"
    volume.mkdir()
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}

    def up() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [shell, flags, script.replace(KEY_DIR, str(volume))],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    first = up()
    assert first.returncode == 0, first.stdout + first.stderr
    token = (volume / KEY_FILE).read_text().strip()
    assert keys.authenticate(db, token, scope="metrics").name == "prometheus"
    assert [k["name"] for k in keys.list_keys(db)] == ["prometheus"]
    again = up()
    assert again.returncode == 0, again.stdout + again.stderr
    assert (volume / KEY_FILE).read_text().strip() == token
    assert len(keys.list_keys(db)) == 1
    assert sorted(p.name for p in volume.iterdir()) == [KEY_FILE]
    # The volume lost, the database kept: the old key goes and a new one takes its place.
    (volume / KEY_FILE).unlink()
    renewed = up()
    assert renewed.returncode == 0, renewed.stdout + renewed.stderr
    fresh = (volume / KEY_FILE).read_text().strip()
    assert fresh != token
    assert keys.authenticate(db, fresh, scope="metrics").name == "prometheus"
    with pytest.raises(Unauthenticated):
        keys.authenticate(db, token, scope="metrics")
