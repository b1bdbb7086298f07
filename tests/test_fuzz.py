"""The API fuzzed over its OpenAPI document by schemathesis, against a live API process on the
real PostgreSQL and Redis, without a key and with a key holding every scope: no 5xx, answers
that match the document, and nothing written by a request without a key or by the requests
the document says are invalid."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import redis
from sqlalchemy import Engine, text

from tests.helpers import stored_keys
from tests.stack import Stack
from tooling.processes import BIN

# Enough cases per operation that the runs with a key send more than 5,000 requests in all.
MAX_EXAMPLES = 150
# Without a key every operation but /health and /ready is refused before it reads its input.
ANONYMOUS_EXAMPLES = 25
SEED = "20261124"


def _tables(db: Engine) -> dict[str, int]:
    with db.connect() as conn:
        names = conn.execute(
            text("SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")
        ).scalars()
        return {
            n: int(conn.execute(text(f'SELECT count(*) FROM "{n}"')).scalar_one())
            for n in names
            # the metrics' running totals count every request, refused ones too
            if n not in ("alembic_version", "metric_total")
        }


def _run(stack: Stack, cwd: Path, *args: str, examples: int = MAX_EXAMPLES) -> int:
    done = subprocess.run(
        [
            str(BIN / "st"),
            "run",
            f"{stack.url}/openapi.json",
            "--max-examples",
            str(examples),
            "--seed",
            SEED,
            # One worker thread: hypothesis describes its strategies with ast.parse, and
            # CPython 3.11's AST depth counter is shared between threads (two threads parsing
            # at once fail with "AST constructor recursion depth mismatch").
            "--workers",
            "1",
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
    shown = " ".join(a if not a.startswith("Authorization") else "Authorization: ..." for a in args)
    print(f"schemathesis {shown}: {generated.group(0)}")
    return int(generated.group(1))


def test_fuzzing_finds_no_5xx_no_schema_violation_and_refused_requests_write_nothing(
    stack: Stack, db: Engine, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # A long poll answers after 50 ms at most here: the fuzzer's thousands of requests are
    # not made to wait 20 s each for an event nobody publishes.
    stack.env(ORDERLY_PULL_MAX_WAIT_MS="50")
    stack.start_api()
    assert stack.http.post("/rooms", json={"name": "r"}).status_code == 201
    rows, keys = _tables(db), stored_keys(redis_client)
    checks = "not_a_server_error,content_type_conformance,response_schema_conformance"
    # No key: valid and invalid input alike refused, and nothing changed.
    anonymous = _run(
        stack, tmp_path, "--mode", "all", "--checks", checks, examples=ANONYMOUS_EXAMPLES
    )
    assert _tables(db) == rows
    assert stored_keys(redis_client) == keys
    # Every run with the key leaves out revoking a key: the run's links would find the run's own
    # key in GET /keys and revoke it (tests/test_auth.py covers revocation).
    key = f"Authorization: Bearer {stack.token}"
    keep_key = ("--exclude-operation-id", "revoke_key")
    # Invalid by the document: each must be refused (4xx) and change nothing.
    refused = _run(
        stack,
        tmp_path,
        "-H",
        key,
        *keep_key,
        "--mode",
        "negative",
        "--phases",
        "fuzzing",
        "--checks",
        "not_a_server_error,negative_data_rejection,content_type_conformance,"
        "response_schema_conformance",
    )
    assert _tables(db) == rows
    assert stored_keys(redis_client) == keys
    # Valid by the document: never a 5xx, and every answer as documented.
    accepted = _run(stack, tmp_path, "-H", key, *keep_key, "--mode", "positive", "--checks", checks)
    total = refused + accepted
    print(
        f"fuzzing: {anonymous} requests without a key; with one {total} "
        f"({refused} invalid, {accepted} valid); 0 failures"
    )
    assert total >= 5000
