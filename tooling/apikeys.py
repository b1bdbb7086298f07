"""API keys for the main job, the benchmarks and the tests' processes: a fresh key, as the
headers a client sends."""

from __future__ import annotations

import uuid

from sqlalchemy import Engine

from orderly.worker import keys


def bearer(engine: Engine, name: str | None = None, *scopes: str) -> dict[str, str]:
    """``Authorization`` for a new key named ``name`` (default: a unique name) with ``scopes``
    (default: every scope)."""
    _, token = keys.create_key(
        engine,
        {"name": name or f"tooling-{uuid.uuid4().hex[:12]}", "scopes": list(scopes or keys.SCOPES)},
    )
    return {"Authorization": f"Bearer {token}"}
