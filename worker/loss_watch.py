"""Beat's watch for a lost Redis, at no cost while nothing changes (on a plain Redis).

The shards' markers (worker.rebuild) are read through a key watch (worker.core.keywatch): a
FLUSHALL, a marker deleted, evicted or rewritten, the server restarting or the connection
failing wakes the watch at once, which then looks (``rebuild.rebuild_if_lost``: the markers,
the server's run_id, a rebuild if Redis lost its state). While nothing changes it sends
nothing; every ``fallback_s`` it reads the markers again (one EXISTS) in case a connection
died without a word, and looks fully when one is missing or the watch had to connect anew.
While Redis has not its state back (another beat rebuilding, a rebuild that failed) it
looks every ``poll_s``. A Redis that refuses client tracking is looked at every ``poll_s``,
as beat's redis-watch agent does on a Redis Cluster.
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
                if changed or fresh or present < len(self._markers):
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
                self.holds_state = False
                changed = True
                now = time.monotonic()
                if now - self._logged >= REPEAT_LOG_S:
                    self._logged = now
                    log.warning("watching Redis for a loss failed: %s", first_line(exc))
                stopping.wait(self.poll_s)

    def _look(self) -> None:
        self.looks += 1
        report = self._look_now()
        self.holds_state = report is None or (report.done and report.marked_ready)

    def close(self) -> None:
        self._watch.close()
