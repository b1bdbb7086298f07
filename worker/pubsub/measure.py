"""What one delivery attempt itself allocated: the peak of Python's traced memory while it
ran, above what was traced when it began (tracemalloc), not the process's resident size.

Tracing runs only while an attempt runs (it slows allocations down): the first attempt in the
process starts it, the last one running stops it (unless it was tracing before, e.g. under
PYTHONTRACEMALLOC). Attempts running at once in threads of one process share the tracer, so
each one's peak includes what the others allocated meanwhile.
"""

from __future__ import annotations

import threading
import tracemalloc

_lock = threading.Lock()
_running = 0
_ours = False


class Measure:
    """``with Measure() as m: ...``; then ``m.bytes`` is the peak allocated inside (also
    when the block raised)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._base = 0

    def __enter__(self) -> Measure:
        global _running, _ours
        with _lock:
            if _running == 0 and not tracemalloc.is_tracing():
                tracemalloc.start()
                _ours = True
            _running += 1
            tracemalloc.reset_peak()
            self._base = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc: object) -> None:
        global _running, _ours
        with _lock:
            peak = tracemalloc.get_traced_memory()[1]
            _running -= 1
            if _running == 0 and _ours:
                tracemalloc.stop()
                _ours = False
        self.bytes = max(0, peak - self._base)
