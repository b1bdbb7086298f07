"""Beat's watch for a lost Redis, at no cost while nothing changes (on a plain Redis).

The shards' markers (worker.rebuild) are read through a key watch (worker.core.keywatch): a
FLUSHALL, a marker deleted, evicted or rewritten, the server restarting or the connection
failing wakes the watch at once, which then looks (``rebuild.rebuild_if_lost``: the markers,
the server's run_id, a rebuild if Redis lost its state). While nothing changes it sends
nothing; every ``fallback_s`` it reads the markers again (one EXISTS) in case a connection
died without a word, and looks fully when one is missing or the watch had to connect anew.
While Redis has not its state back (another beat rebuilding, a rebuild that failed), or a
look could not say, it looks every ``poll_s``. A Redis that refuses client tracking, or on
which the watch keeps failing while looks succeed (a proxy, a client library it does not
know), is looked at every ``poll_s``, as beat's redis-watch agent does on a Redis Cluster.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from orderly.worker import rebuild
from orderly.worker.core.errors import first_line
from orderly.worker.core.keywatch import KeyWatch, TrackingRefused

log = logging.getLogger(__name__)

# How long the watch waits for a change before it reads the markers again anyway.
FALLBACK_S = 10.0
# While something keeps failing (Redis down), one line at most this often.
REPEAT_LOG_S = 30.0
# The watch failing this many times in a row while looks succeed: looked at by polling.
WATCH_FAILURES = 3


class LossWatch:
    def __init__(
        self,
        client: redis.Redis,
        markers: list[str],
        look: Callable[[], rebuild.RebuildReport | None],
        *,
        poll_s: float,
        fallback_s: float = FALLBACK_S,
    ) -> None:
        self._watch = KeyWatch(client)
        self._markers = markers
        self._look_now = look
        self.poll_s = poll_s
        self.fallback_s = fallback_s
        # whether the last look found Redis holding its state (every marker ready, the
        # server the one that wrote them): beat's sweep repairs single conversations only then
        self.holds_state = False
        self.polling = False
        self.looks = 0
        self._logged = 0.0
        self._failures = 0

    def run(self, stopping: threading.Event) -> None:
        """Watch until ``stopping`` is set (then :meth:`close` ends a wait at once)."""
        changed = True
        while not stopping.is_set():
            try:
                if self.polling:
                    self._look()
                    stopping.wait(self.poll_s)
                    continue
                # armed before the look: a change after it ends the next wait
                present, fresh = self._watch.arm(self._markers)
                self._failures = 0
                if changed or fresh or present < len(self._markers) or not self.holds_state:
                    self._look()
                changed = self._watch.wait(self.fallback_s if self.holds_state else self.poll_s)
            except TrackingRefused as exc:
                log.warning(
                    "Redis refuses client tracking (%s): beat looks for a lost Redis every %.3f s",
                    exc,
                    self.poll_s,
                )
                self.polling = True
            except Exception as exc:
                if stopping.is_set():
                    break  # closed while waiting
                changed = True
                now = time.monotonic()
                if now - self._logged >= REPEAT_LOG_S:
                    self._logged = now
                    log.warning("watching Redis for a loss failed: %s", first_line(exc))
                self._look_after_failure(exc)
                stopping.wait(self.poll_s)

    def _look_after_failure(self, exc: Exception) -> None:
        """The watch failed: look anyway (through the look's own connection); should the
        watch keep failing while looks succeed, poll from now on."""
        try:
            self._look()
        except Exception:
            self._failures = 0  # Redis itself fails: the watch is not to blame
            return
        self._failures += 1
        if self._failures >= WATCH_FAILURES:
            log.warning(
                "watching Redis's markers keeps failing (%s): beat looks for a lost Redis "
                "every %.3f s",
                first_line(exc),
                self.poll_s,
            )
            self.polling = True

    def _look(self) -> None:
        """Look (the markers, the server's run): while it runs, and when it fails, Redis is
        not known to hold its state (beat's sweep waits)."""
        self.looks += 1
        self.holds_state = False
        report = self._look_now()
        self.holds_state = report is None or (report.done and report.marked_ready)

    def close(self) -> None:
        self._watch.close()
