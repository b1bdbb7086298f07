"""The baseline: a raw Celery task that does nothing, on orderly's app and queue."""

from __future__ import annotations

from orderly.worker.celery import app


@app.task(name="orderly.process.bench_noop")
def bench_noop(n: int) -> None:
    """Nothing: what Celery alone costs per task on this broker."""
