"""Flower as orderly's dashboard: basic auth, and a real worker's tasks seen in headless Chromium.

Screenshots of the workers and tasks pages are written to ``artifacts/`` at the repository's
root.
"""

from __future__ import annotations

import base64
import os
import secrets
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from sqlalchemy import Engine

from tests.browser import chromium
from tests.helpers import message, states, wait_until
from tests.stack import Stack
from tooling.processes import BIN, ROOT, ProcessGroup, free_port, wait_http

ARTIFACTS = ROOT / "artifacts"
USER = "orderly"
WORKER = f"flower-w1@{socket.gethostname()}"
MESSAGES = 5


class Flower:
    """A ``celery -A orderly.worker flower`` process on a free port, with a random password."""

    def __init__(self, procs: ProcessGroup, cwd: Path | None = None) -> None:
        self.port = free_port()
        self.password = secrets.token_urlsafe(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.managed = procs.start(
            "flower",
            [str(BIN / "celery"), "-A", "orderly.worker", "flower"],
            {
                "ORDERLY_FLOWER_USER": USER,
                "ORDERLY_FLOWER_PASSWORD": self.password,
                "ORDERLY_FLOWER_ADDRESS": "127.0.0.1",
                "ORDERLY_FLOWER_PORT": str(self.port),
            },
            cwd=cwd,
        )
        # /healthcheck answers without credentials: it tells when Flower is up.
        wait_http(f"{self.url}/healthcheck", self.managed, timeout=60)
        self.http = httpx.Client(base_url=self.url, auth=(USER, self.password), timeout=10)

    def authorization(self) -> str:
        token = base64.b64encode(f"{USER}:{self.password}".encode()).decode()
        return f"Basic {token}"

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    with chromium(1400, 1000) as driver:
        yield driver


def page_text(driver: webdriver.Chrome) -> str:
    return str(driver.find_element(By.TAG_NAME, "body").text)


def screenshot(driver: webdriver.Chrome, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    assert driver.save_screenshot(str(path)), f"no screenshot {path}"
    print(f"screenshot: {path}")
    return path


def test_flower_started_elsewhere_still_asks_for_the_password(
    procs: ProcessGroup, tmp_path: Path
) -> None:
    """Started outside the repository (no configuration file in sight), Flower still runs with
    orderly's basic auth, address and port."""
    flower = Flower(procs, cwd=tmp_path)
    assert httpx.get(f"{flower.url}/workers", timeout=10).status_code == 401
    assert flower.http.get("/workers").status_code == 200
    bare = subprocess.run(
        [str(BIN / "celery"), "-A", "orderly.worker", "flower"],
        cwd=tmp_path,
        env={**os.environ, "ORDERLY_FLOWER_PASSWORD": "", "ORDERLY_FLOWER_PORT": str(free_port())},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bare.returncode != 0 and "ORDERLY_FLOWER_PASSWORD" in bare.stderr


def test_flower_refuses_to_start_without_a_password() -> None:
    port = free_port()
    # Set and empty: an environment variable wins over a developer's .env.
    env = {**os.environ, "ORDERLY_FLOWER_PASSWORD": "", "ORDERLY_FLOWER_PORT": str(port)}
    done = subprocess.run(
        [str(BIN / "celery"), "-A", "orderly.worker", "flower"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "ORDERLY_FLOWER_PASSWORD" in done.stderr
    assert "Visit me" not in done.stdout + done.stderr


def test_flower_shows_orderly_workers_and_tasks_behind_basic_auth(
    stack: Stack, db: Engine, browser: webdriver.Chrome
) -> None:
    stack.worker("flower-w1", concurrency=1, node="flower-node")
    flower = Flower(stack.procs)

    # Flower's event receiver is live once it has counted the worker's heartbeat: only then
    # are the tasks' events sure to reach it.
    online = f'flower_worker_online{{worker="{WORKER}"}} 1.0'
    wait_until(lambda: online in flower.metrics(), 60, "Flower to see the worker online")

    from orderly.worker.celery import enqueue_processing
    from orderly.worker.runtime import get_runtime

    intake = get_runtime().intake(enqueue_processing)
    ids = [
        intake.submit(message(n, service="bench", operation="noop")).msg_id for n in range(MESSAGES)
    ]
    wait_until(lambda: all(states(db).get(i) == "OK" for i in ids), 60, "messages to be OK")

    # Basic auth guards the dashboard and its API; /metrics and /healthcheck stay open.
    assert httpx.get(f"{flower.url}/").status_code == 401
    assert httpx.get(f"{flower.url}/api/workers").status_code == 401
    assert httpx.get(f"{flower.url}/", auth=(USER, "wrong")).status_code == 401
    assert httpx.get(f"{flower.url}/", auth=("someone", flower.password)).status_code == 401
    assert flower.http.get("/").status_code == 200
    assert httpx.get(f"{flower.url}/healthcheck").text == "OK"
    succeeded = (
        f'flower_events_total{{task="orderly.process.message",type="task-succeeded",'
        f'worker="{WORKER}"}} {MESSAGES}.0'
    )
    wait_until(lambda: succeeded in flower.metrics(), 30, "Flower to count the tasks")

    # What the dashboard shows of a task's arguments: its message id, nothing else.
    tasks = flower.http.get("/api/tasks", params={"taskname": "orderly.process.message"}).json()
    assert sorted(t["args"] for t in tasks.values()) == sorted(f"({i},)" for i in ids)
    assert {t["state"] for t in tasks.values()} == {"SUCCESS"}
    assert flower.password not in flower.managed.log_path.read_text(errors="replace")

    # Credentials in the URL load the page, but Chrome then refuses the page's own fetch()
    # calls (a request URL may not carry credentials): the header goes on every request.
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd(
        "Network.setExtraHTTPHeaders", {"headers": {"Authorization": flower.authorization()}}
    )
    wait = WebDriverWait(browser, 30)

    browser.get(f"{flower.url}/workers")
    wait.until(lambda d: WORKER in page_text(d))
    assert "Online" in page_text(browser)
    workers_png = screenshot(browser, "flower-workers.png")

    browser.get(f"{flower.url}/tasks")
    wait.until(lambda d: page_text(d).count("orderly.process.message") >= MESSAGES)
    text = page_text(browser)
    assert "SUCCESS" in text
    assert WORKER in text
    tasks_png = screenshot(browser, "flower-tasks.png")

    for png in (workers_png, tasks_png):
        assert png.stat().st_size > 10_000, f"{png} looks empty"
