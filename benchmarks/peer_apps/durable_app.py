"""The floor of a durable HTTP intake: a bare ASGI app that reads a JSON body, INSERTs it with
the driver orderly uses (psycopg2) and COMMITs, one transaction per request, then answers 201
(``uvicorn benchmarks.peer_apps.durable_app:app``; its database: ``DURABLE_DATABASE_URL``).
Its connections are one per thread of the default thread pool, as a plain sync handler's."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import anyio
import psycopg2  # type: ignore[import-untyped]

from benchmarks.peer_apps.asgi_app import intake_app

_local = threading.local()
DSN = os.environ.get("DURABLE_DATABASE_URL", "postgresql://postgres@127.0.0.1/orderly_bench")


def _conn() -> Any:
    found = getattr(_local, "conn", None)
    if found is None:
        found = _local.conn = psycopg2.connect(DSN)
        with found.cursor() as cur:
            cur.execute(
                "CREATE TABLE IF NOT EXISTS durable_intake"
                " (id bigserial PRIMARY KEY, correlation_id text UNIQUE, body jsonb)"
            )
        found.commit()
    return found


def _insert(body: bytes) -> int:
    data = json.loads(body)
    conn = _conn()
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO durable_intake (correlation_id, body) VALUES (%s, %s)"
            " ON CONFLICT (correlation_id) DO NOTHING RETURNING id",
            (data.get("correlation_id"), body.decode()),
        )
        row = cur.fetchone()
    conn.commit()
    return int(row[0]) if row else 0


async def _stored(body: bytes) -> int:
    return await anyio.to_thread.run_sync(_insert, body)


app = intake_app(_stored)
