"""What one delivery attempt itself allocated: the peak of Python's traced memory while it
ran, above what was traced when it began (tracemalloc), not the process's resident size.

Tracing runs only while attempts run (it slows allocations down): the first holder in the
process starts it, the last one stops it (unless it was tracing before, e.g. under
PYTHONTRACEMALLOC). A batch holds it across its attempts (:func:`tracing`), so tracing starts
once per batch, not once per attempt. Attempts running at once in threads of one process
share the tracer, so each one's peak includes what the others allocated meanwhile.
"""

from __future__ import annotations

import contextlib
import threading
import tracemalloc
from collections.abc import Iterator

_lock = threading.Lock()
_holders = 0
_ours = False


def _hold() -> None:
    global _holders, _ours
    if _holders == 0 and not tracemalloc.is_tracing():
        tracemalloc.start()
        _ours = True
    _holders += 1


def _release() -> None:
    global _holders, _ours
    _holders -= 1
    if _holders == 0 and _ours:
        tracemalloc.stop()
        _ours = False


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Tracing on for a block of attempts (a batch)."""
    with _lock:
        _hold()
    try:
        yield
    finally:
        with _lock:
            _release()


class Measure:
    """``with Measure() as m: ...``; then ``m.bytes`` is the peak allocated inside (also
    when the block raised)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._base = 0

    def __enter__(self) -> Measure:
        with _lock:
            _hold()
            tracemalloc.reset_peak()
            self._base = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc: object) -> None:
        with _lock:
            peak = tracemalloc.get_traced_memory()[1]
            _release()
        self.bytes = max(0, peak - self._base)
