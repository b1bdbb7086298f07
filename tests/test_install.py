"""orderly as a user installs it: the wheel, with the core extra only, in a fresh virtualenv
outside the repository, runs migrate, the API and a worker, and processes a message with a
handler of the user's own module; ``orderly up`` starts and stops its three processes and leaves
none behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from sqlalchemy import Engine, create_engine, make_url, text

from orderly.worker.celery import enqueue_processing
from orderly.worker.runtime import get_runtime
from tests.conftest import PG_ADMIN_URL, TEST_DB_URL, TEST_REDIS_URL
from tests.helpers import message, processes_with, wait_until
from tooling.processes import BIN, free_port

if TYPE_CHECKING:
    from tests.wheel import Installed

# The fixture ``installed`` (imported by pytest first, so that its asserts are rewritten).
pytest_plugins = ["tests.wheel"]


HANDLERS = """
from orderly.worker.handlers import MessageContext, registry


@registry.register("shop", "ship")
def ship(ctx: MessageContext) -> None:
    ctx.custom_data = "shipped by my own handler"
"""


def test_the_core_wheel_runs_outside_the_repository(installed: Installed, tmp_path: Path) -> None:
    bin_ = installed.bin
    listed = subprocess.run(
        [str(bin_ / "pip"), "list", "--format", "freeze"], capture_output=True, text=True
    ).stdout.lower()
    # The core: no Spark, no matplotlib, no Flower.
    for heavy in ("pyspark", "matplotlib", "flower"):
        assert f"{heavy}==" not in listed, heavy
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "my_handlers.py").write_text(textwrap.dedent(HANDLERS))
    database = f"orderly_install_{uuid.uuid4().hex[:8]}"
    url = make_url(TEST_DB_URL).set(database=database).render_as_string(hide_password=False)
    env = installed.env(
        ORDERLY_DATABASE_URL=url,
        ORDERLY_REDIS_URL=TEST_REDIS_URL,
        ORDERLY_HANDLER_MODULES="my_handlers",
        PYTHONPATH=str(work),
        ORDERLY_API_PORT=str(free_port()),
        ORDERLY_API_WORKERS="2",
        ORDERLY_NODE_CODE=f"install-{database}",
    )

    def orderly(*args: str) -> str:
        done = subprocess.run(
            [str(bin_ / "orderly"), *args], capture_output=True, text=True, env=env, cwd=work
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    assert orderly("--version").strip() == "orderly 0.1.0"
    orderly("migrate", "--create-database")
    token = orderly("key", "create", "installer", "--scope", "produce", "--scope", "operate")
    procs = []
    try:
        for argv in (["api"], ["worker", "--concurrency", "1"]):
            procs.append(
                subprocess.Popen(
                    [str(bin_ / "orderly"), *argv],
                    env=env,
                    cwd=work,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        api = f"http://127.0.0.1:{env['ORDERLY_API_PORT']}"
        http = httpx.Client(
            base_url=api, timeout=10, headers={"Authorization": f"Bearer {token.strip()}"}
        )

        def up() -> bool:
            try:
                return http.get("/health").status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 90, "the installed API answers")
        # ORDERLY_API_WORKERS: two processes serve the port, under the one started.
        api_pid = procs[0].pid
        kids = Path(f"/proc/{api_pid}/task/{api_pid}/children").read_text().split()
        served = [k for k in kids if "spawn_main" in Path(f"/proc/{k}/cmdline").read_text()]
        assert len(served) == 2
        made = http.post("/messages", json=message(1, service="shop", operation="ship"))
        assert made.status_code == 201, made.text
        msg_id = made.json()["msg_id"]

        def done() -> bool:
            return bool(http.get(f"/messages/{msg_id}").json()["state"] == "OK")

        wait_until(done, 90, "the message processed by the installed worker")
        assert http.get(f"/messages/{msg_id}").json()["custom_data"] == "shipped by my own handler"
        # The console's templates and static files came with the wheel.
        console = http.get(f"/console/messages/{msg_id}")
        assert console.status_code == 200 and "shipped by my own handler" in console.text
        assert "--accent" in http.get("/console/static/console.css").text
        assert "figures.json" in http.get("/console/static/figures.js").text
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def up_env(db: object) -> Iterator[dict[str, str]]:
    marker = f"up-{uuid.uuid4().hex[:10]}"
    yield {
        **os.environ,
        "ORDERLY_API_PORT": str(free_port()),
        "ORDERLY_NODE_CODE": marker,
        "ORDERLY_UP_TEST_MARKER": marker,
    }


def test_orderly_up_starts_three_processes_and_ctrl_c_stops_them_all(
    up_env: dict[str, str], tmp_path: Path, db: Engine
) -> None:
    marker = up_env["ORDERLY_UP_TEST_MARKER"]
    log = tmp_path / "up.log"
    with log.open("w") as out:
        up = subprocess.Popen(
            [str(BIN / "orderly"), "up", "--concurrency", "1"],
            env=up_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        api = f"http://127.0.0.1:{up_env['ORDERLY_API_PORT']}/health"

        def ready() -> bool:
            text = log.read_text()
            try:
                answered = httpx.get(api, timeout=2).status_code == 200
            except httpx.HTTPError:
                answered = False
            return answered and "worker | " in text and "ready." in text and "beat   | " in text

        wait_until(ready, 120, "orderly up: API answering, worker ready, beat logging")
        assert len(processes_with(marker)) >= 4  # up, api, worker (and its pool), beat
        # A task in hand when Ctrl-C comes is finished, not lost (a warm shutdown).
        intake = get_runtime().intake(enqueue_processing)
        body = message(1, service="test", operation="script", payload='{"sleep": 3}')
        msg_id = intake.submit(body).msg_id
        wait_until(lambda: _state(db, msg_id) == "PROCESSING", 60, "the message in hand")
        up.send_signal(signal.SIGINT)  # Ctrl-C
        assert up.wait(90) == 0, log.read_text()[-3000:]
        assert _state(db, msg_id) == "OK", log.read_text()[-3000:]
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
        for pid in processes_with(marker):  # its children run in sessions of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    # Nothing left behind (a stopped process may take a moment to be reaped).
    wait_until(lambda: not processes_with(marker), 10, "no process of orderly up left")
    text = log.read_text()
    assert "api    | " in text and "worker | " in text, text[-2000:]
    assert "WorkerLostError" not in text


def _state(db: Engine, msg_id: int) -> str:
    with db.connect() as conn:
        return str(
            conn.execute(
                text("SELECT state FROM message WHERE msg_id = :id"), {"id": msg_id}
            ).scalar_one()
        )


@pytest.mark.parametrize(
    ("argv", "extra"),
    [(["report"], "reports"), (["flower"], "dashboard")],
    ids=["report", "flower"],
)
def test_a_command_whose_extra_is_missing_names_it_in_one_line(
    installed: Installed, tmp_path: Path, argv: list[str], extra: str
) -> None:
    done = subprocess.run(
        [str(installed.bin / "orderly"), *argv],
        capture_output=True,
        text=True,
        env=installed.env(ORDERLY_FLOWER_PASSWORD="a-long-enough-password"),
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], (
        f"more than one line: {done.stderr}"
    )
    assert f"pip install 'orderly[{extra}]'" in done.stderr
    assert done.stdout == ""
