"""The README's quick start and the tutorials, followed as written by a user of the wheel.

Every ```bash block of the quick start (README.md, between its quick-start markers) and of
each tutorial (docs/tutorials/*.md) is read from the file, not copied here, and run as one
shell script: in a fresh virtualenv holding the wheel built from a copy of the checkout
(``tests.wheel``), from a directory outside the checkout, against a database of its own and
the tests' Redis database, given through the variables the blocks read (ORDERLY_DATABASE_URL,
ORDERLY_REDIS_URL, ORDERLY_API_PORT and the example servers' ports). The processes the blocks
start in the background (``orderly up``, the example servers) are found by a marker in their
environment and stopped afterwards. Each test then checks what the document promises."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis
from sqlalchemy import create_engine, make_url, text

from tests.conftest import PG_ADMIN_URL, TEST_DB_URL, TEST_REDIS_URL
from tests.helpers import processes_with, wait_until
from tooling.processes import free_port

if TYPE_CHECKING:
    from tests.wheel import Installed

# The fixture ``installed`` (imported by pytest first, so that its asserts are rewritten).
pytest_plugins = ["tests.wheel"]

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
TUTORIALS = REPO / "docs" / "tutorials"
QUICK_START = re.compile(
    r"<!-- --8<-- \[start:quick-start\] -->(.*)<!-- --8<-- \[end:quick-start\] -->", re.DOTALL
)


def shell_blocks(markdown: str) -> list[str]:
    """The ```bash blocks of a Markdown text, as written."""
    return re.findall(r"^```bash\n(.*?)^```", markdown, re.DOTALL | re.MULTILINE)


def quick_start_blocks() -> list[str]:
    found = QUICK_START.search(README.read_text())
    assert found is not None, "README.md has no quick-start markers"
    return shell_blocks(found.group(1))


def tutorial_blocks(name: str) -> list[str]:
    return shell_blocks((TUTORIALS / name).read_text())


@dataclass
class Run:
    """One document's blocks run as a user would: where, with what, and what came out."""

    work: Path
    env: dict[str, str]
    out: str = ""

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.env['ORDERLY_API_PORT']}"

    def query(self, statement: str, **params: Any) -> list[dict[str, Any]]:
        engine = create_engine(self.env["ORDERLY_DATABASE_URL"])
        try:
            with engine.connect() as conn:
                return [dict(r._mapping) for r in conn.execute(text(statement), params)]
        finally:
            engine.dispose()

    def message(self, **where: str) -> dict[str, Any]:
        clause = " AND ".join(f"{k} = :{k}" for k in where)
        (row,) = self.query(f"SELECT * FROM message WHERE {clause}", **where)
        return row

    def log(self, name: str) -> str:
        path = self.work / name
        return path.read_text() if path.exists() else ""


@pytest.fixture
def user(installed: Installed, tmp_path: Path) -> Iterator[Run]:
    """A user's shell: the installed wheel first on PATH, a working directory outside the
    checkout holding the wheel, a fresh database and the tests' Redis database (emptied)."""
    database = f"orderly_docs_{uuid.uuid4().hex[:8]}"
    url = make_url(TEST_DB_URL).set(database=database).render_as_string(hide_password=False)
    marker = f"docs-run-{uuid.uuid4().hex[:8]}"
    work = tmp_path / "user"
    work.mkdir()
    assert REPO not in work.parents
    shutil.copy(installed.wheel, work / installed.wheel.name)
    client = redis.Redis.from_url(TEST_REDIS_URL)
    client.flushdb()  # the tests' own database only
    client.close()
    env = installed.env(
        ORDERLY_DATABASE_URL=url,
        ORDERLY_REDIS_URL=TEST_REDIS_URL,
        ORDERLY_API_PORT=str(free_port()),
        CHANNEL_PORT=str(free_port()),
        BILLING_PORT=str(free_port()),
        ORDERLY_DOCS_TEST=marker,
        HOME=str(tmp_path),
    )
    try:
        yield Run(work=work, env=env)
    finally:
        _stop_all_with(marker)
        admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
        admin.dispose()


def _stop_all_with(marker: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in processes_with(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not processes_with(marker), 30, "the document's processes gone")


def follow(run: Run, blocks: list[str], timeout: float = 300) -> str:
    """Run the blocks in one shell, stopping at the first command that fails."""
    assert blocks, "no shell block found"
    script = "set -euo pipefail\n" + "\n".join(blocks)
    log = run.work.parent / "script.out"
    with log.open("wb") as written:
        # A file, not a pipe: what the script leaves in the background keeps its output open.
        shell = subprocess.Popen(
            ["bash", "-c", script],
            env=run.env,
            cwd=run.work,
            stdout=written,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        code = shell.wait(timeout)
    except subprocess.TimeoutExpired:
        shell.kill()
        code = shell.wait()
    run.out = log.read_text()
    orderly_log = run.log("orderly.log")[-4000:]
    assert code == 0, f"exit {code}\n{run.out[-4000:]}\n--- orderly.log\n{orderly_log}"
    return run.out


def json_values(out: str) -> list[Any]:
    """The JSON objects and arrays printed one after another (curl ends none with a newline)."""
    decoder, found, i = json.JSONDecoder(), [], 0
    while i < len(out):
        if out[i] in "[{":
            try:
                value, i = decoder.raw_decode(out, i)
            except json.JSONDecodeError:
                i += 1
                continue
            found.append(value)
        else:
            i += 1
    return found


def test_the_quick_start_as_written(user: Run) -> None:
    blocks = quick_start_blocks()
    assert any("pip install orderly-0.1.0-py3-none-any.whl" in b for b in blocks)
    out = follow(user, blocks)
    assert "orderly 0.1.0" in out
    first = user.message(correlation_id="order-1", source_system="webshop")
    assert (first["state"], first["custom_data"]) == ("OK", "shipped box 1")
    # The conversation's response reached the channel once, was answered 202 and ACKed.
    (line,) = user.log("channel.log").splitlines()
    assert line.startswith("ack-rs-1 ") and '"text": "Hi!"' in line
    values = json_values(out)
    acked = [v for v in values if isinstance(v, dict) and set(v) == {"msg_id", "state"}]
    response = user.message(correlation_id="rs-1", source_system="bridge.response")
    assert {"msg_id": response["msg_id"], "state": "OK"} in acked
    assert response["state"] == "OK"
    # The subscription's pull got the event.
    pulled = [v for v in values if isinstance(v, list) and v]
    assert pulled and pulled[-1][0]["payload"] == {"id": 7}, out


def test_the_handler_tutorial_as_written(user: Run) -> None:
    follow(user, tutorial_blocks("first-handler.md"))
    for correlation_id, payload in (("order-1", "box 1"), ("order-2", "box 2")):
        row = user.message(correlation_id=correlation_id, source_system="webshop")
        assert (row["state"], row["custom_data"]) == ("OK", f"shipped {payload}")
    failed = user.message(correlation_id="order-3", source_system="webshop")
    assert failed["failed_error_code"] == "E_EMPTY"
    assert failed["state"] in ("PARTLY_FAILED", "IN_QUEUE", "PROCESSING", "FAILED")
    parent = user.message(correlation_id="order-4", source_system="webshop")
    children = user.query(
        "SELECT state, payload FROM message WHERE parent_msg_id = :id ORDER BY msg_id",
        id=parent["msg_id"],
    )
    assert parent["state"] == "OK"
    assert children == [{"state": "OK", "payload": "box 4a"}, {"state": "OK", "payload": "box 4b"}]


def test_the_conversation_tutorial_as_written(user: Run) -> None:
    follow(user, tutorial_blocks("conversations.md"))
    delivered = [line.split()[:2] for line in user.log("channel.log").splitlines()]
    # rs-3 was sent first but its request came second: it left last.
    assert delivered == [["rq-1", "rs-1"], ["rq-1", "rs-2"], ["rq-2", "rs-3"]]
    query = "SELECT correlation_id, state FROM message WHERE source_system = 'bridge.response'"
    wait_until(
        lambda: all(r["state"] == "OK" for r in user.query(query)), 30, "the responses' rows OK"
    )
    states = user.query(query)
    assert {r["correlation_id"] for r in states} == {"rs-1", "rs-2", "rs-3"}


def test_the_publish_subscribe_tutorial_as_written(user: Run) -> None:
    out = follow(user, tutorial_blocks("publish-subscribe.md"))
    (billed,) = [json.loads(line) for line in user.log("billing.log").splitlines()]
    assert billed["payload"] == {"id": 7} and billed["user"] == "alice"
    assert user.log("audit.log").splitlines() == ['order.created alice {"id": 7}']
    pulled = [v for v in json_values(out) if isinstance(v, list) and v]
    assert pulled and [e["payload"] for e in pulled[-1]] == [{"id": 7}], out
    # Event 8 waits its minute: neither pushed nor pullable yet.
    assert "reminder" not in user.log("billing.log")
