"""The README's quick start, followed as written: its command blocks are read from README.md
(not copied here) and run against the local PostgreSQL and Redis: migrate, the API, a worker,
beat and Flower, the first API key, and a message submitted with curl that ends OK."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, make_url, text

from tests.conftest import PG_ADMIN_URL, TEST_DB_URL
from tests.helpers import processes_with, wait_until
from tooling.processes import BIN, free_port

README = Path(__file__).resolve().parent.parent / "README.md"


def block_after(marker: str) -> list[str]:
    """The command lines of the first ```bash block after ``marker`` (comments dropped, lines
    ending in a backslash joined)."""
    readme = README.read_text()
    start = readme.index(marker)
    found = re.search(r"```bash\n(.*?)```", readme[start:], re.DOTALL)
    assert found is not None, f"no bash block after {marker!r}"
    joined = found.group(1).replace("\\\n", " ")
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


@pytest.fixture
def quick_start_env(db: object) -> Iterator[dict[str, str]]:
    database = f"orderly_readme_{uuid.uuid4().hex[:8]}"
    url = make_url(TEST_DB_URL).set(database=database).render_as_string(hide_password=False)
    yield {
        **os.environ,
        "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
        "ORDERLY_DATABASE_URL": url,
        "ORDERLY_HANDLER_MODULES": "tooling.handlers",
        "ORDERLY_API_PORT": str(free_port()),
        "ORDERLY_FLOWER_PORT": str(free_port()),
        "ORDERLY_FLOWER_PASSWORD": "readme-flower-pw",
        "ORDERLY_NODE_CODE": f"readme-{database}",
    }
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
    admin.dispose()


def _json_values(out: str) -> list[object]:
    """The JSON values curl printed one after another (``curl -s`` ends none with a newline)."""
    decoder, found, i = json.JSONDecoder(), [], 0
    while i < len(out):
        if out[i] in "[{":
            value, i = decoder.raw_decode(out, i)
            found.append(value)
        else:
            i += 1
    return found


def _script(lines: list[str], port: str) -> str:
    """The lines as one shell script for this machine: the commands on PATH, the API's port."""
    joined = "\n".join(lines).replace(".venv/bin/", "")
    return joined.replace("localhost:8000", f"localhost:{port}")


def _bash(lines: list[str], env: dict[str, str], port: str) -> str:
    script = _script(lines, port)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _start(lines: list[str], env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen(
            ["bash", "-c", f"exec {line}"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for line in lines
    ]


def _stop(started: list[subprocess.Popen[bytes]]) -> None:
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in started:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code in (200, 401)
    except httpx.HTTPError:
        return False


def test_the_quick_start_as_the_readme_says(quick_start_env: dict[str, str]) -> None:
    env = quick_start_env
    port = env["ORDERLY_API_PORT"]
    processes = block_after("terminal by terminal:")
    assert processes[0] == "orderly migrate --create-database"
    assert [p.split()[1] for p in processes[1:]] == ["api", "worker", "beat", "flower"]
    key_block = block_after("Create the first\none from the command line")
    submit_block = block_after("Submit a message over HTTP:")

    _bash(processes[:1], env, port)
    started: list[subprocess.Popen[bytes]] = []
    try:
        started = _start(processes[1:], env)
        wait_until(lambda: _answers(f"http://127.0.0.1:{port}/health"), 90, "the API")
        flower = f"http://127.0.0.1:{env['ORDERLY_FLOWER_PORT']}/"
        wait_until(lambda: _answers(flower), 90, "Flower (its password asked for)")
        # The key block and the submit block run in one shell: the key is exported for it.
        out = _bash([*key_block, *submit_block], env, port)
        submitted = next(a for a in _json_values(out) if isinstance(a, dict) and "msg_id" in a)
        assert submitted["state"] in ("NEW", "POSTPONED"), out
        wait_until(
            # PARTLY_FAILED: the demo handler refused this try (it does now and then); either
            # way the worker ran it.
            lambda: _state(env, submitted["msg_id"]) in ("OK", "PARTLY_FAILED"),
            90,
            "the submitted message processed by the worker",
        )
    finally:
        _stop(started)


def _state(env: dict[str, str], msg_id: int) -> str:
    engine = create_engine(env["ORDERLY_DATABASE_URL"])
    try:
        with engine.connect() as conn:
            return str(
                conn.execute(
                    text("SELECT state FROM message WHERE msg_id = :id"), {"id": msg_id}
                ).scalar_one()
            )
    finally:
        engine.dispose()


def _delivered(env: dict[str, str]) -> set[str]:
    engine = create_engine(env["ORDERLY_DATABASE_URL"])
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT s.name FROM delivery d JOIN subscription s USING (subscription_id)"
                    " WHERE d.state = 'DELIVERED'"
                )
            ).scalars()
            return set(rows)
    finally:
        engine.dispose()


def _kill_all_with(marker: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in processes_with(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not processes_with(marker), 30, "the example's processes gone")


def test_the_pub_sub_example_delivers(quick_start_env: dict[str, str], tmp_path: Path) -> None:
    marker = f"readme-pubsub-{uuid.uuid4().hex[:8]}"
    env = {**quick_start_env, "ORDERLY_README_TEST": marker}
    port = env["ORDERLY_API_PORT"]
    migrate = block_after("terminal by terminal:")[:1]
    key = block_after("Create the first\none from the command line")[:1]
    block = block_after("An example that delivers")
    assert any(line.startswith(".venv/bin/orderly up") for line in block)
    sink_port = str(free_port())
    example = [line.replace("8500", sink_port) for line in block]
    log = tmp_path / "example.out"
    try:
        with log.open("wb") as written:
            # A file, not a pipe: what the script leaves in the background keeps it open.
            script = subprocess.Popen(
                ["bash", "-euo", "pipefail", "-c", _script([*migrate, *key, *example], port)],
                env=env,
                cwd=tmp_path,
                stdout=written,
                stderr=subprocess.STDOUT,
            )
        assert script.wait(240) == 0, log.read_text()
        out = log.read_text()
        pulled = [v for v in _json_values(out) if isinstance(v, list) and v]
        assert pulled, out
        assert pulled[0][0]["payload"] == {"id": 7}
        # Event 7 pushed to the sink and consumed by echo (event 8 waits its minute).
        wait_until(lambda: {"billing", "audit"} <= _delivered(env), 60, "billing and audit")
        wait_until(
            lambda: "echo order.created" in (tmp_path / "orderly-up.log").read_text(),
            30,
            "the echo consumer's line in orderly up's log",
        )
    finally:
        _kill_all_with(marker)
