"""orderly's Lua scripts (``worker/lua``), registered once per Redis client and run by name.

Each script is one atomic check-and-act; the shared library (``_lib.lua``) is prepended to
every one. A script refuses with an error reply whose first word is a code; :meth:`run`
turns it into the exception ``orderly.worker.core.errors`` maps it to.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import redis

from orderly.worker.core.clients import OrderingRedis
from orderly.worker.core.errors import from_script_error

LUA_DIR = Path(__file__).resolve().parent.parent / "lua"
SCRIPT_NAMES = (
    # conversations
    "register_request",
    "add_response",
    "advance",
    "ack",
    "expire",
    "awaited",
    "rebuild_conversation",
    "drain_release",
    # operators' conversation operations (worker/conversations/operations.py)
    "conv_delete",
    "conv_set_awaited",
    "conv_awaited_date",
    "conv_remove_at",
    "conv_remove_due",
    # the Redis marker (worker/rebuild.py)
    "epoch_ready",
    # due sets and leases
    "due_take",
    "due_settle",
    "due_release",
    "lease_take",
    "lease_give_up",
    # the wake-up of workers for due messages (worker/wake.py)
    "wake",
    "wake_swap",
    # message tracking and service lifecycle
    "track_register",
    "track_done",
    "track_monitor",
    "service_register",
    "service_renew",
    "service_restore",
)


@cache
def source(name: str) -> str:
    if name not in SCRIPT_NAMES:
        raise KeyError(f"no Lua script named {name!r}")
    library = (LUA_DIR / "_lib.lua").read_text()
    return library + "\n" + (LUA_DIR / f"{name}.lua").read_text()


def as_text(value: Any) -> str:
    """A Redis reply value as text (clients may or may not be set to decode replies)."""
    return value.decode() if isinstance(value, bytes) else str(value)


class Scripts:
    """Registered scripts of one Redis client: ``scripts.run("advance", keys, args)``."""

    def __init__(self, client: OrderingRedis) -> None:
        self.client = client
        self._scripts = {name: client.register_script(source(name)) for name in SCRIPT_NAMES}

    def run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return self._scripts[name](keys=keys, args=args)
        except redis.ResponseError as exc:
            mapped = from_script_error(str(exc))
            if mapped is None:
                raise
            raise mapped from None
