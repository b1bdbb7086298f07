"""What ships for monitoring in deploy/: the Prometheus alert rules pass ``promtool check rules``
and their unit tests (``promtool test rules``: each alert fires on its series and not before),
and every metric the rules and the Grafana dashboard query is one the collector exposes."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import redis
import yaml
from sqlalchemy import Engine

from orderly.api.metrics import families
from orderly.models.keys import BridgeKeys, TrackKeys
from orderly.worker.celery import AGENTS_QUEUE, DELIVER_QUEUE, PROCESS_QUEUE
from orderly.worker.observe import broker_figures, gather
from tests.conftest import IN_CI

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
RULE_FILES = sorted(DEPLOY.glob("*rules*.yml"))
DASHBOARD = DEPLOY / "grafana" / "orderly-dashboard.json"
# Prometheus' own series a rule may use beside orderly's.
PROMETHEUS_OWN = {"up"}
_METRIC = re.compile(r"\b(orderly_[a-z0-9_]+)\b")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    if exe is None:
        if IN_CI:
            pytest.fail("promtool is not installed (Debian's prometheus package)")
        pytest.skip("promtool is not installed (Debian's prometheus package)")
    return subprocess.run(
        [exe, *args], capture_output=True, text=True, cwd=DEPLOY, timeout=120, check=False
    )


def exposed(db: Engine, redis_client: redis.Redis) -> set[str]:
    """Every sample name a scrape can show, read off the collector's families with every
    source up (a family's name plus what its type adds: _total, _bucket, _sum, _count)."""
    figures = gather(
        db,
        redis_client,
        BridgeKeys(),
        redis_client,
        TrackKeys(),
        functools.partial(
            broker_figures, redis_client, (PROCESS_QUEUE, AGENTS_QUEUE, DELIVER_QUEUE)
        ),
    )
    assert not figures.errors
    names: set[str] = set()
    for family in families(figures):
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names.update(f"{family.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


def rule_exprs() -> list[str]:
    found: list[str] = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            found.extend(rule["expr"] for rule in group["rules"])
    return found


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def test_the_rules_pass_promtools_check() -> None:
    assert RULE_FILES == [DEPLOY / "orderly-rules.yml"]
    done = promtool("check", "rules", *map(str, RULE_FILES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 10 rules found" in done.stdout


def test_each_alert_fires_on_its_series_and_not_before() -> None:
    done = promtool("test", "rules", "alert-tests.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    tested = {
        test["alertname"]
        for case in yaml.safe_load((DEPLOY / "alert-tests.yml").read_text())["tests"]
        for test in case["alert_rule_test"]
    }
    alerts = {
        rule["alert"]
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
    }
    assert alerts - tested == {"OrderlyApiDown"}  # Prometheus' own `up`, nothing of orderly's


def test_a_broken_rule_is_refused_by_the_check(tmp_path: Path) -> None:
    broken = tmp_path / "broken-rules.yml"
    broken.write_text((DEPLOY / "orderly-rules.yml").read_text().replace("> 300", "> > 300", 1))
    assert promtool("check", "rules", str(broken)).returncode != 0


def unknown(exprs: list[str], names: set[str]) -> list[tuple[str, set[str]]]:
    """The queries naming a metric the collector does not expose, with those names (or
    naming no metric at all, Prometheus' own ``up`` aside)."""
    found = []
    for expr in exprs:
        used = set(_METRIC.findall(expr))
        if not used and not PROMETHEUS_OWN & set(re.findall(r"\b[a-z_]+\b", expr)):
            found.append((expr, used))
        elif used - names:
            found.append((expr, used - names))
    return found


def test_rules_and_dashboard_query_only_metrics_the_collector_exposes(
    db: Engine, redis_client: redis.Redis
) -> None:
    assert unknown([*rule_exprs(), *dashboard_exprs()], exposed(db, redis_client)) == []
    # and the dashboard shows throughput, failures and backlog at the least
    dashboard = " ".join(dashboard_exprs())
    for needed in (
        "orderly_messages_processed_total",
        "orderly_handler_duration_seconds_bucket",
        "orderly_messages_due_lag_seconds",
        "orderly_conversation_release_seconds_bucket",
        "orderly_deliveries_sent_total",
        "orderly_http_requests_total",
    ):
        assert needed in dashboard, needed


def test_a_query_of_a_name_the_collector_lacks_is_caught(
    db: Engine, redis_client: redis.Redis
) -> None:
    names = exposed(db, redis_client)
    wrong = "rate(orderly_messages_processed[5m])"  # a counter is exposed as …_total
    right = "rate(orderly_messages_processed_total[5m])"
    assert unknown([wrong, right, "sum(1)", 'up{job="x"}'], names) == [
        (wrong, {"orderly_messages_processed"}),
        ("sum(1)", set()),
    ]
