"""Every test is of one kind, so that a quick run can leave out the slow end-to-end tests.

- ``unit``: no PostgreSQL, no Redis, no process of its own.
- ``integration``: the real PostgreSQL and/or Redis, driven in the test's own process.
- ``e2e``: starts real processes: orderly's API, workers or beat (``procs``, ``stack``), the
  ``orderly`` command (``cli``), Flower, Chromium, Spark, or servers of its own
  (``redis_server``, ``pg_server``, ``redis_cluster``, ``pgbouncer``).

The kind follows from the fixtures a test uses. A module whose tests start processes
without such a fixture is named in :data:`E2E_MODULES`; a test the rule would file wrongly
carries its kind's marker itself. The conftest checks at run time that a test does nothing
beyond its kind (see :func:`tests.conftest._kind_guard`).
"""

from __future__ import annotations

from collections.abc import Iterable

UNIT, INTEGRATION, E2E = "unit", "integration", "e2e"
KINDS = (UNIT, INTEGRATION, E2E)

E2E_FIXTURES = frozenset(
    {
        "procs",
        "stack",
        "cli",
        "browser",
        "spark",
        "redis_server",
        "pg_server",
        "redis_cluster",
        "pgbouncer",
    }
)
STORE_FIXTURES = frozenset({"pg_engine", "db", "redis_client", "orderly_engine"})
# Their tests start processes in their own ways: the `orderly` command, docker-compose, Flower,
# Spark (through the report's own entry points as well as the ``spark`` fixture), promtool,
# pip and an installed orderly.
E2E_MODULES = frozenset(
    {
        "tests.test_cli",
        "tests.test_compose",
        "tests.test_flower_browser",
        "tests.test_image",
        "tests.test_install",
        "tests.test_monitoring",
        "tests.test_docs",
        "tests.test_readme",
        "tests.test_report",
    }
)


def auto_kind(module: str, fixtures: Iterable[str]) -> str:
    """The kind a test has by the fixtures it uses (all of them, fixtures' fixtures too)."""
    used = set(fixtures)
    if used & E2E_FIXTURES or module in E2E_MODULES:
        return E2E
    if used & STORE_FIXTURES:
        return INTEGRATION
    return UNIT


def kinds_of(module: str, fixtures: Iterable[str], marked: Iterable[str]) -> list[str]:
    """The kinds a test ends up with: those it is marked with, else the one its fixtures say."""
    explicit = sorted({m for m in marked if m in KINDS})
    return explicit or [auto_kind(module, fixtures)]


def contradictions(kind: str, fixtures: Iterable[str]) -> set[str]:
    """The fixtures a test of this kind may not use."""
    used = set(fixtures)
    if kind == UNIT:
        return used & (E2E_FIXTURES | STORE_FIXTURES)
    if kind == INTEGRATION:
        return used & E2E_FIXTURES
    return set()
