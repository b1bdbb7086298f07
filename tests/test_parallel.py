"""The suite runs on pytest-xdist workers (run.sh): each worker its own Redis DB, the base
DB of ORDERLY_TEST_REDIS_URL plus its index, and its own database."""

from __future__ import annotations

import os

import pytest

from tests.conftest import TEST_DB, TEST_REDIS_URL, worker_redis_url


@pytest.mark.parametrize(
    ("base", "worker", "expected"),
    [
        ("redis://127.0.0.1:6379/13", None, "redis://127.0.0.1:6379/13"),
        ("redis://127.0.0.1:6379/13", "gw0", "redis://127.0.0.1:6379/13"),
        ("redis://127.0.0.1:6379/13", "gw2", "redis://127.0.0.1:6379/15"),
        ("redis://127.0.0.1:6379/1", "gw1", "redis://127.0.0.1:6379/2"),
        ("redis://:pw@127.0.0.1:6380", "gw3", "redis://:pw@127.0.0.1:6380/3"),
    ],
)
def test_each_worker_has_the_base_db_plus_its_index(
    base: str, worker: str | None, expected: str
) -> None:
    assert worker_redis_url(base, worker) == expected


def test_a_worker_past_the_last_db_is_refused() -> None:
    with pytest.raises(RuntimeError, match="Redis DB 16"):
        worker_redis_url("redis://127.0.0.1:6379/13", "gw3")


def test_this_process_uses_its_workers_db_and_a_database_of_its_own() -> None:
    base = os.environ.get("ORDERLY_TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
    assert worker_redis_url(base, os.environ.get("PYTEST_XDIST_WORKER")) == TEST_REDIS_URL
    assert os.environ["ORDERLY_REDIS_URL"] == TEST_REDIS_URL
    assert os.environ["ORDERLY_DATABASE_URL"].endswith(f"/{TEST_DB}")
