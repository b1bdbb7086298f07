"""The API fuzzed over its OpenAPI document by schemathesis, against a live API process on the
real PostgreSQL and Redis: no 5xx, answers that match the document, and nothing written by
the requests the document says are invalid."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import redis
from sqlalchemy import Engine, text

from tests.stack import Stack
from tooling.processes import BIN

# Enough cases per operation that the two runs send more than 5,000 requests in all.
MAX_EXAMPLES = 150
SEED = "20261124"


def _tables(db: Engine) -> dict[str, int]:
    with db.connect() as conn:
        names = conn.execute(
            text("SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")
        ).scalars()
        return {
            n: int(conn.execute(text(f'SELECT count(*) FROM "{n}"')).scalar_one())
            for n in names
            if n != "alembic_version"
        }


def _run(stack: Stack, cwd: Path, *args: str) -> int:
    done = subprocess.run(
        [
            str(BIN / "st"),
            "run",
            f"{stack.url}/openapi.json",
            "--max-examples",
            str(MAX_EXAMPLES),
            "--seed",
            SEED,
            "--workers",
            "2",
            "--request-timeout",
            "30",
            "--generation-database",
            "none",
            "--no-color",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=cwd,  # schemathesis keeps a cache directory where it runs
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    generated = re.search(r"(\d+) generated, (\d+) passed", out)
    assert generated is not None, out[-3000:]
    assert generated.group(1) == generated.group(2), out[-3000:]
    print(f"schemathesis {' '.join(args)}: {generated.group(0)}")
    return int(generated.group(1))


def test_fuzzing_finds_no_5xx_no_schema_violation_and_refused_requests_write_nothing(
    stack: Stack, db: Engine, redis_client: redis.Redis, tmp_path: Path
) -> None:
    stack.start_api()
    assert stack.http.post("/rooms", json={"name": "r"}).status_code == 201
    rows, keys = _tables(db), redis_client.dbsize()
    # Invalid by the document: each must be refused (4xx) and change nothing.
    refused = _run(
        stack,
        tmp_path,
        "--mode",
        "negative",
        "--phases",
        "fuzzing",
        "--checks",
        "not_a_server_error,negative_data_rejection,content_type_conformance,"
        "response_schema_conformance",
    )
    assert _tables(db) == rows
    assert redis_client.dbsize() == keys
    # Valid by the document: never a 5xx, and every answer as documented.
    accepted = _run(
        stack,
        tmp_path,
        "--mode",
        "positive",
        "--checks",
        "not_a_server_error,content_type_conformance,response_schema_conformance",
    )
    total = refused + accepted
    print(f"fuzzing: {total} requests ({refused} invalid, {accepted} valid), 0 failures")
    assert total >= 5000
