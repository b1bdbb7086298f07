"""The operator's view in the terminal: the figures of ``GET /metrics`` as rich tables."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from orderly.worker.observe import Figures


def print_status(figures: Figures, console: Console) -> None:
    """Print every part of ``figures`` that could be read (a missing part is left out)."""
    if (store := figures.store) is not None:
        table = Table("message state", "count", title="Messages (PostgreSQL)")
        for state, count in store.messages.items():
            table.add_row(state.value, str(count))
        console.print(table)
        table = Table("delivery state", "count", title="Publish/subscribe deliveries")
        for dstate, count in store.deliveries.items():
            table.add_row(dstate.value, str(count))
        table.add_row("delayed (due later)", str(store.deliveries_delayed))
        for circuit, count in store.endpoints.items():
            table.add_row(f"PUSH endpoints {circuit}", str(count))
        console.print(table)
        table = Table("message state", "waiting", title="Messages waiting for their due time")
        for state, count in store.due_waiting.items():
            table.add_row(f"due: {state.value}", str(count))
        table.add_row("earliest due time past (s)", f"{store.due_lag_s:.1f}")
        console.print(table)
        table = Table("conversation responses", "count", title="Late responses (PostgreSQL)")
        table.add_row("delivered late (request expired)", str(store.late_responses))
        console.print(table)
    if (conv := figures.conversations) is not None:
        table = Table("conversations", "value", title="Conversations (Redis)")
        age = conv.oldest_blocked_head_age_s
        for name, value in (
            ("open", conv.open),
            ("blocked", conv.blocked_total),
            *((f"  blocked: {r.value}", n) for r, n in conv.blocked.items()),
            ("ready", conv.ready),
            ("heads in flight", conv.in_flight),
            (
                "oldest blocked head (s)",
                "-" if not conv.blocked_total else "?" if age is None else f"{age:.1f}",
            ),
            ("responses AWAITED", conv.awaited),
            ("responses undelivered", conv.responses_undelivered),
            ("scheduled wake-ups", conv.scheduled),
        ):
            table.add_row(name, str(value))
        console.print(table)
    if (t := figures.tracking) is not None:
        table = Table("tracking", "count", "sum (s)", "max (s)", title="Message tracking")
        for name, h in (("done", t.done), ("timed out", t.timeout)):
            top = "-" if h.max_ms is None else f"{h.max_ms / 1000:.3f}"
            table.add_row(name, str(h.count), f"{h.sum_ms / 1000:.3f}", top)
        for name, count in (
            ("over capacity", t.overflow),
            ("expired", t.expired),
            ("timeout retries", t.retried),
            ("failed for timeouts", t.gave_up),
            ("tracked now", t.listed),
        ):
            table.add_row(name, str(count), "", "")
        console.print(table)
    if figures.workers_alive is not None:
        table = Table("node", "live workers", title="Workers")
        for node, count in figures.workers_alive.items():
            table.add_row(node or "(none)", str(count))
        console.print(table)
    if figures.redis_evicting:
        table = Table("Redis server", title="Redis that may evict orderly's keys")
        for server in figures.redis_evicting:
            table.add_row(server)
        console.print(table)
    if (broker := figures.broker) is not None:
        table = Table("queue", "tasks waiting", title="Broker")
        for queue, count in broker.queues.items():
            table.add_row(queue, str(count))
        if broker.unacked is not None:
            table.add_row("(taken, not acknowledged)", str(broker.unacked))
        console.print(table)
