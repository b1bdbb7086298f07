"""Waiting for keys of one Redis to change, at no cost while they do not.

Redis's client tracking (``CLIENT TRACKING ... REDIRECT``, Redis 6 and later): the server
remembers the keys a tracking connection has read and tells a connection subscribed to
``__redis__:invalidate`` when one of them changes: written, deleted, expired, evicted, or all
of them at once by FLUSHALL or FLUSHDB. A change is told once; reading the keys again
(:meth:`KeyWatch.arm`) asks to be told of the next one. The server restarting, or either
connection failing, ends a wait too: whatever was watched may be gone, the caller looks.

Both connections are the watch's own (a plain Redis; a Redis Cluster tracks per node, which
this does not do). A server that refuses tracking (an older Redis, a service that disables
CLIENT) raises :class:`TrackingRefused` from :meth:`KeyWatch.arm`: the caller polls instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import redis

CHANNEL = "__redis__:invalidate"
# What a pool passes its connections beside their address and options (redis-py 8).
_POOLS = ("maint_notifications", "orig_", "himport_registry")


class TrackingRefused(RuntimeError):
    """The server does not offer client tracking."""


class KeyWatch:
    def __init__(self, client: redis.Redis) -> None:
        pool = client.connection_pool
        self._make = pool.connection_class
        # RESP2: the invalidations come as messages of the subscribed connection (without the
        # pool's own helpers, which ask for RESP3)
        given = {k: v for k, v in pool.connection_kwargs.items() if not k.startswith(_POOLS)}
        self._kwargs: dict[str, Any] = {**given, "protocol": 2}
        self._sub: Any = None
        self._trk: Any = None

    @property
    def connected(self) -> bool:
        return self._trk is not None

    def _connect(self) -> None:
        self.close()
        sub = self._make(**self._kwargs)
        trk = self._make(**self._kwargs)
        try:
            sub.connect()
            sub.send_command("CLIENT", "ID")
            client_id = sub.read_response()
            sub.send_command("SUBSCRIBE", CHANNEL)
            sub.read_response()
            trk.connect()
            trk.send_command("CLIENT", "TRACKING", "on", "REDIRECT", client_id)
            trk.read_response()
        except redis.ResponseError as exc:
            sub.disconnect()
            trk.disconnect()
            raise TrackingRefused(str(exc)) from exc
        except BaseException:
            sub.disconnect()
            trk.disconnect()
            raise
        self._sub, self._trk = sub, trk

    def arm(self, keys: Sequence[str]) -> tuple[int, bool]:
        """Read ``keys`` on the tracking connection (one EXISTS), so that a change to any of
        them ends :meth:`wait`: how many of them exist, and whether the watch connected anew
        for it (the server may have restarted since the last look). Raises what Redis
        raises (the connections are then closed; the next arm connects again)."""
        fresh = not self.connected
        try:
            if fresh:
                self._connect()
            self._trk.send_command("EXISTS", *keys)
            return int(self._trk.read_response()), fresh
        except BaseException:
            self.close()
            raise

    def wait(self, timeout_s: float) -> bool:
        """Until an armed key changes, the connection fails, or ``timeout_s`` passes: whether
        something happened (arm again before the next wait)."""
        if self._sub is None:
            return True
        try:
            if not self._sub.can_read(timeout=timeout_s):
                return False
            while self._sub.can_read(timeout=0):
                self._sub.read_response()
        except (redis.RedisError, OSError):
            self.close()
        return True

    def close(self) -> None:
        for conn in (self._sub, self._trk):
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.disconnect()
        self._sub = self._trk = None
