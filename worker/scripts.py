"""orderly's Lua scripts, loaded once by name (each with the shared library first)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import redis

LUA_DIR = Path(__file__).resolve().parent / "lua"
SCRIPT_NAMES = (
    # conversations
    "register_request",
    "add_response",
    "advance",
    "ack",
    "expire",
    "due",
    "awaited",
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


class Scripts:
    """Registered scripts of one Redis client: ``scripts.run("advance", keys, args)``."""

    def __init__(self, client: redis.Redis) -> None:
        self._scripts = {name: client.register_script(source(name)) for name in SCRIPT_NAMES}

    def run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return self._scripts[name](keys=keys, args=args)
