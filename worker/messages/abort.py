"""Stopping the handler of a message cancelled while it runs: the cancel's announcement, and
each worker process's listener that aborts the run (worker.core.limits stops it).

After the cancel's transaction commits, :func:`announce` appends the cancelled ids to one
Redis stream (``PROCESS_ABORTS_KEY``, trimmed to the last ``KEEP_MS``). Every worker process
that runs handlers has one listener thread, started by its first run, blocked in ``XREAD``
on the stream from the last entry it read. An id heard while the process runs that message
sets the run's :class:`~worker.core.limits.Abort` (the handler sees ``ctx.aborted``, and is
stopped after ``ORDERLY_ABORT_GRACE_MS``) once :func:`claim_gone` confirms the message is no
longer PROCESSING: an id announced before a re-drive, and claimed again since, aborts
nothing. Ids heard in the last ``REMEMBER_S`` are remembered, so a run that begins after its
cancel was heard (a batch's later message) is aborted before its handler starts.

Why a stream, and not a pub/sub channel or a poll of the row:

- nothing is lost when the listener reconnects: it reads on from its last entry id, so an
  announcement made while it was away is read when it is back (pub/sub would drop it, and
  needs a key per message and a check of it when a handler starts to make up for that);
- a handler costs no Redis or database round trip when it starts or ends: a dictionary
  entry, and the SIGALRM handler its time limit installs anyway (installed now for a handler
  without a limit too: some 10 microseconds); an idle listener costs one blocked connection
  per process and no CPU (a poll of the row costs a query every few hundred milliseconds for
  every long handler, and is only as quick as its period);
- an abort arrives within a few milliseconds of the commit.

A listener away for longer than ``KEEP_MS`` misses what was trimmed meanwhile: such a handler
runs on until it returns or its time limit stops it, and its outcome is dropped, as when
Redis is unreachable at the cancel. No Celery here: the runtime wires it, the processor uses it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis
from sqlalchemy import Engine

from orderly.models import MessageState
from orderly.models.keys import PROCESS_ABORTS_KEY
from orderly.worker.core.clients import redis_client
from orderly.worker.core.clock import SYSTEM, Clock, now_ms
from orderly.worker.core.limits import Abort
from orderly.worker.core.retry import MAX_ATTEMPTS, RetryPolicy
from orderly.worker.db.queries import sql

log = logging.getLogger(__name__)

# How long the stream keeps an announcement: the longest a listener may be away and still
# hear it when it is back.
KEEP_MS = 600_000
# How long a process remembers an id it heard, for a run of that message that begins later
# (a batch starts its handlers within a second or so of its claim); at most REMEMBER_MAX ids.
REMEMBER_S = 60.0
REMEMBER_MAX = 10_000
# How long one XREAD blocks: the longest a closed listener takes to notice.
BLOCK_MS = 5_000
READ_COUNT = 500
# Waits between reconnections (ms): 100, 200, 400, ... at most 5 s.
RECONNECT = RetryPolicy(delay_ms=50, multiplier=2.0, attempts=MAX_ATTEMPTS, max_delay_ms=5_000)


def announce(
    client: redis.Redis,
    msg_ids: Sequence[int],
    *,
    key: str = PROCESS_ABORTS_KEY,
    clock: Clock = SYSTEM,
) -> bool:
    """Tell the workers that these messages were cancelled (call it after the commit). False
    when Redis failed (logged): the cancel stands, and a handler of one of them runs on until
    it returns or its time limit stops it; its outcome is dropped then."""
    if not msg_ids:
        return True
    oldest = now_ms(clock) - KEEP_MS
    try:
        with client.pipeline(transaction=False) as pipe:
            for msg_id in msg_ids:
                pipe.xadd(key, {"msg": str(int(msg_id))}, minid=oldest, approximate=True)
            pipe.pexpire(key, KEEP_MS)  # an idle stream goes away
            pipe.execute()
    except redis.RedisError as exc:
        log.warning("the cancel of messages %s was not announced to the workers: %s", msg_ids, exc)
        return False
    return True


def claim_gone(engine: Engine, msg_id: int) -> bool:
    """Whether a message announced cancelled is no longer PROCESSING (the run is the
    cancelled one); a run of it after a re-drive finds it PROCESSING."""
    with engine.connect() as conn:
        found = conn.execute(sql("message_state_of"), {"id": msg_id, "owned": None}).first()
    return found is None or found.state != MessageState.PROCESSING


def listening_client(url: str, connect_timeout_s: float) -> redis.Redis:
    """A client of its own for the listener: its reads block, and a dead connection must
    show up as a timeout a little after a read's block ends."""
    return redis_client(
        url, socket_connect_timeout=connect_timeout_s, socket_timeout=BLOCK_MS / 1000 + 5
    )


class AbortBook:
    """Which messages this process runs now, and the cancels heard lately: no I/O of its own
    but ``confirm`` (:func:`claim_gone`), called when a heard id is one that runs."""

    def __init__(
        self,
        confirm: Callable[[int], bool],
        grace_s: float,
        *,
        clock: Clock = SYSTEM,
        remember_s: float = REMEMBER_S,
        remember_max: int = REMEMBER_MAX,
    ) -> None:
        Abort(grace_s)  # the grace's check, here at once rather than at the first run
        self._confirm = confirm
        self._grace_s = grace_s
        self._clock = clock
        self._remember_s = remember_s
        self._remember_max = remember_max
        self._lock = threading.Lock()
        # A thread pool may run several at once; prefork children one.
        self._running: dict[int, Abort] = {}
        self._heard: dict[int, float] = {}  # msg_id -> when heard (monotonic), oldest first

    @contextlib.contextmanager
    def running(self, msg_id: int) -> Iterator[Abort]:
        """The abort of a run of ``msg_id``: set when its cancel is heard meanwhile, or at
        once when it was heard before the run began."""
        abort = Abort(self._grace_s)
        with self._lock:
            self._running[msg_id] = abort
            heard = msg_id in self._heard
        try:
            if heard:
                self._stop(msg_id, abort)
            yield abort
        finally:
            with self._lock:
                if self._running.get(msg_id) is abort:
                    del self._running[msg_id]

    def heard(self, msg_id: int) -> None:
        """The cancel of ``msg_id`` was announced."""
        now = self._clock.monotonic()
        with self._lock:
            self._heard.pop(msg_id, None)
            self._heard[msg_id] = now
            self._forget(now)
            abort = self._running.get(msg_id)
        if abort is not None:
            self._stop(msg_id, abort)

    def remembered(self) -> list[int]:
        """The ids heard and still remembered, oldest first."""
        with self._lock:
            self._forget(self._clock.monotonic())
            return list(self._heard)

    def _forget(self, now: float) -> None:
        while self._heard:
            oldest, at = next(iter(self._heard.items()))
            if now - at < self._remember_s and len(self._heard) <= self._remember_max:
                return
            del self._heard[oldest]

    def _stop(self, msg_id: int, abort: Abort) -> None:
        if abort.is_set():
            return
        try:
            gone = self._confirm(msg_id)
        except Exception:
            log.exception("could not check whether message %s was cancelled; not aborted", msg_id)
            return
        if gone and abort.set():
            log.info("message %s was cancelled while its handler ran: aborting it", msg_id)


class AbortListener:
    """A thread reading the abort stream from where it left off (at first: ``REMEMBER_S``
    back), reconnecting after a failure; each announced id goes to ``heard``. The clock
    gives the first entry id (Redis's time and this process's agree within that margin)."""

    def __init__(
        self,
        connect: Callable[[], redis.Redis],
        heard: Callable[[int], None],
        *,
        key: str = PROCESS_ABORTS_KEY,
        clock: Clock = SYSTEM,
        block_ms: int = BLOCK_MS,
    ) -> None:
        self._connect = connect
        self._heard = heard
        self._key = key
        self._clock = clock
        self._block_ms = block_ms
        self._closed = threading.Event()
        self.connected = threading.Event()  # set while it has a connection that answered
        self.connections = 0  # how many it made (tests watch reconnections)
        self._failures = 0  # in a row, since the last connection that answered
        # The last entry read (at first: REMEMBER_S back): a reconnection reads on from it.
        self._last = f"{max(0, now_ms(clock) - round(REMEMBER_S * 1000))}-0"
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="orderly-aborts", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop (within one read's block)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self._read()
            except Exception as exc:
                self._failures += 1
                if self._failures == 1 and isinstance(exc, redis.RedisError):
                    log.warning("the abort listener lost Redis (%s); reconnecting", exc)
                elif self._failures == 1:
                    log.exception("the abort listener failed; starting again")
                self._closed.wait(RECONNECT.delay(min(self._failures, MAX_ATTEMPTS)) / 1000)

    def _read(self) -> None:
        """Read until closed, on from the last entry read: what was announced while the
        listener was away is read now (the stream keeps it)."""
        client = self._connect()
        try:
            client.ping()
            if self._failures:
                log.info("the abort listener reads again from entry %s", self._last)
            self._failures = 0
            self.connections += 1
            self.connected.set()
            while not self._closed.is_set():
                reply: Any = client.xread(
                    {self._key: self._last}, count=READ_COUNT, block=self._block_ms
                )
                for _stream, entries in reply or []:
                    for entry_id, fields in entries:
                        self._last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                        self._deliver(self._last, fields)
        finally:
            self.connected.clear()
            client.close()

    def _deliver(self, entry_id: str, fields: dict[Any, Any]) -> None:
        raw: Any = fields.get(b"msg", fields.get("msg"))
        try:
            msg_id = int(raw)
        except (TypeError, ValueError):
            log.warning("abort stream entry %s names no message: %r", entry_id, fields)
            return
        try:
            self._heard(msg_id)
        except Exception:
            log.exception("the abort of message %s failed", msg_id)


class AbortWatch:
    """This process's aborts: the book, and the listener its first run starts (a forked
    child starts its own). ``grace_s``: ORDERLY_ABORT_GRACE_MS."""

    def __init__(
        self,
        connect: Callable[[], redis.Redis],
        confirm: Callable[[int], bool],
        grace_s: float,
        *,
        key: str = PROCESS_ABORTS_KEY,
        clock: Clock = SYSTEM,
        block_ms: int = BLOCK_MS,
    ) -> None:
        if not (math.isfinite(grace_s) and grace_s >= 0):
            raise ValueError(f"the abort grace must be zero or more seconds: {grace_s}")
        self._connect = connect
        self._confirm = confirm
        self.grace_s = grace_s
        self._key = key
        self._clock = clock
        self._block_ms = block_ms
        self._pid = -1
        self._start_lock = threading.Lock()
        self._book: AbortBook | None = None
        self._listener: AbortListener | None = None

    def running(self, msg_id: int) -> contextlib.AbstractContextManager[Abort]:
        """The abort of a run of ``msg_id`` in this process (see :meth:`AbortBook.running`)."""
        return self.started()[0].running(msg_id)

    def started(self) -> tuple[AbortBook, AbortListener]:
        """The book and its listener in this process, started on the first call."""
        if self._pid != os.getpid():
            with self._start_lock:
                if self._pid != os.getpid():
                    book = AbortBook(self._confirm, self.grace_s, clock=self._clock)
                    listener = AbortListener(
                        self._connect,
                        book.heard,
                        key=self._key,
                        clock=self._clock,
                        block_ms=self._block_ms,
                    )
                    listener.start()
                    self._book, self._listener = book, listener
                    self._pid = os.getpid()
        assert self._book is not None and self._listener is not None
        return self._book, self._listener

    def close(self) -> None:
        """Stop this process's listener, if it started one."""
        if self._listener is not None and self._pid == os.getpid():
            self._listener.close()
