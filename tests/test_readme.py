"""The README's quick start, followed as written: its command blocks are read from README.md
(not copied here) and run against the local PostgreSQL and Redis: migrate, the API, a worker,
beat and Flower, the first API key, and a message submitted with curl that ends OK."""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, make_url, text

from tests.conftest import PG_ADMIN_URL, TEST_DB_URL
from tests.helpers import wait_until
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


def _bash(lines: list[str], env: dict[str, str], port: str) -> str:
    script = (
        "\n".join(lines).replace(".venv/bin/", "").replace("localhost:8000", f"localhost:{port}")
    )
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_quick_start_as_the_readme_says(quick_start_env: dict[str, str]) -> None:
    env = quick_start_env
    port = env["ORDERLY_API_PORT"]
    processes = block_after("terminal by terminal:")
    assert processes[0] == "orderly migrate --create-database"
    assert [p.split()[1] for p in processes[1:]] == ["api", "worker", "beat", "flower"]
    key_block = block_after("Create the first\none from the command line")
    submit_block = block_after("Submit a message over HTTP:")

    _bash(processes[:1], env, port)
    started = [
        subprocess.Popen(
            ["bash", "-c", f"exec {line}"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for line in processes[1:]
    ]
    try:

        def answers(url: str) -> bool:
            try:
                return httpx.get(url, timeout=2).status_code in (200, 401)
            except httpx.HTTPError:
                return False

        wait_until(lambda: answers(f"http://127.0.0.1:{port}/health"), 90, "the API")
        flower = f"http://127.0.0.1:{env['ORDERLY_FLOWER_PORT']}/"
        wait_until(lambda: answers(flower), 90, "Flower (its password asked for)")
        # The key block and the submit block run in one shell: the key is exported for it.
        out = _bash([*key_block, *submit_block], env, port)
        submitted = next(a for a in _json_values(out) if isinstance(a, dict) and "msg_id" in a)
        assert submitted["state"] in ("NEW", "POSTPONED"), out
        engine = create_engine(env["ORDERLY_DATABASE_URL"])

        def final() -> bool:
            with engine.connect() as conn:
                state = conn.execute(
                    text("SELECT state FROM message WHERE msg_id = :id"),
                    {"id": submitted["msg_id"]},
                ).scalar_one()
            return state in ("OK", "FAILED", "PARTLY_FAILED")

        wait_until(final, 90, "the submitted message processed by the worker")
        engine.dispose()
    finally:
        for proc in started:
            os.killpg(proc.pid, 15)
        for proc in started:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
