"""Prometheus exposition of worker.observe's figures: a collector read at scrape time."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from orderly.models.pubsub import DeliveryState
from orderly.worker import readiness
from orderly.worker.observe import Figures, Source, gather
from orderly.worker.runtime import Runtime, get_runtime
from orderly.worker.totals import CATALOGUE, Counter, Total, histogram_totals
from orderly.worker.tracking import Histogram


def runtime_figures(runtime: Runtime | None = None) -> Figures:
    """Gather every figure from the process's own PostgreSQL, Redis and broker."""
    rt = runtime or get_runtime()
    s = rt.settings
    figures = gather(
        rt.engine,
        rt.ordering_redis,
        s.bridge_keys,
        rt.tracking_redis,
        rt.track_keys,
        rt.broker.figures,
    )
    try:
        evicting = [each for client in rt.redis_clients for each in readiness.evicting(client)]
    except Exception:  # a Redis that does not answer is reported by its own part
        return figures
    return dataclasses.replace(figures, redis_evicting=evicting)


def _seconds_histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
    buckets = [
        ("+Inf" if bound == float("inf") else repr(bound / 1000), float(count))
        for bound, count in h.buckets
    ]
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h.sum_ms / 1000)


def families(figures: Figures) -> Iterable[Metric]:
    """The metric families of one gathering (parts whose source failed are left out)."""
    up = GaugeMetricFamily(
        "orderly_source_up", "1 when the source answered this scrape, else 0", labels=["source"]
    )
    for source in Source:
        if source is Source.BROKER and figures.broker is None and source not in figures.errors:
            continue  # a broker without figures (a stub): nothing to read
        up.add_metric([source.value], 0.0 if source in figures.errors else 1.0)
    yield up

    if (store := figures.store) is not None:
        messages = GaugeMetricFamily(
            "orderly_messages", "Messages in the store by state", labels=["state"]
        )
        for state, count in store.messages.items():
            messages.add_metric([state.value], count)
        yield messages
        deliveries = GaugeMetricFamily(
            "orderly_deliveries", "Publish/subscribe deliveries by state", labels=["state"]
        )
        for dstate, count in store.deliveries.items():
            deliveries.add_metric([dstate.value], count)
        yield deliveries
        yield GaugeMetricFamily(
            "orderly_deliveries_delayed",
            "Deliveries PENDING and due in the future ($delay or a retry wait)",
            value=store.deliveries_delayed,
        )
        yield GaugeMetricFamily(
            "orderly_deliveries_dead_lettered",
            "Deliveries dead-lettered (DEAD): attempts spent or refused",
            value=store.deliveries.get(DeliveryState.DEAD, 0),
        )
        unwell = GaugeMetricFamily(
            "orderly_endpoints_unwell",
            "PUSH endpoints by circuit: FAILING (last send failed), OPEN (only probes go),"
            " DISABLED (nothing goes until an operator enables them)",
            labels=["circuit"],
        )
        for circuit, count in store.endpoints.items():
            unwell.add_metric([circuit], count)
        yield unwell
        due = GaugeMetricFamily(
            "orderly_messages_due_waiting",
            "Messages waiting for their due time, by state: NEW scheduled, PARTLY_FAILED retry"
            " waits, POSTPONED, IN_QUEUE retries after a timeout",
            labels=["state"],
        )
        for state, count in store.due_waiting.items():
            due.add_metric([state.value], count)
        yield due
        yield GaugeMetricFamily(
            "orderly_messages_due_lag_seconds",
            "How long the earliest due time of a waiting message is past (0: none is): the"
            " due work's ticker is behind",
            value=store.due_lag_s,
        )

    if figures.totals is not None:
        yield from _totals(figures.totals)

    if (conv := figures.conversations) is not None:
        yield GaugeMetricFamily(
            "orderly_conversations_open",
            "Conversations with an undelivered response",
            value=conv.open,
        )
        yield GaugeMetricFamily(
            "orderly_conversations_blocked",
            "Open conversations whose head response cannot go now",
            value=conv.blocked_total,
        )
        by_reason = GaugeMetricFamily(
            "orderly_conversations_blocked_by_reason",
            "Blocked conversations by what their head waits for",
            labels=["reason"],
        )
        for reason, count in conv.blocked.items():
            by_reason.add_metric([reason.value], count)
        yield by_reason
        yield GaugeMetricFamily(
            "orderly_conversations_ready",
            "Open conversations whose head may go now and no drain has taken yet",
            value=conv.ready,
        )
        yield GaugeMetricFamily(
            "orderly_conversation_heads_in_flight",
            "Conversation heads being sent now",
            value=conv.in_flight,
        )
        if conv.oldest_blocked_head_age_s is not None:
            yield GaugeMetricFamily(
                "orderly_conversation_oldest_blocked_head_age_seconds",
                "Time since the oldest blocked head response reached orderly (0: none blocked)",
                value=conv.oldest_blocked_head_age_s,
            )
        yield GaugeMetricFamily(
            "orderly_conversation_responses_awaited",
            "Responses AWAITED (attempts spent, waiting for the awaited agent)",
            value=conv.awaited,
        )
        yield GaugeMetricFamily(
            "orderly_conversation_responses_undelivered",
            "Responses in Redis not yet delivered: the conversation delivery backlog",
            value=conv.responses_undelivered,
        )
        yield GaugeMetricFamily(
            "orderly_conversations_scheduled",
            "Conversations with a wake-up time (retry wait, ACK deadline, expiring request)",
            value=conv.scheduled,
        )
        yield GaugeMetricFamily(
            "orderly_conversation_responses_awaited_due",
            "pendingMessages members the awaited agent would take now",
            value=conv.awaited_due,
        )

    if (t := figures.tracking) is not None:
        yield _seconds_histogram(
            "orderly_tracked_done_duration_seconds",
            "Tracked messages done: time from register to done",
            t.done,
        )
        yield _seconds_histogram(
            "orderly_tracked_timeout_duration_seconds",
            "Tracked messages timed out: time from register to the monitor's look",
            t.timeout,
        )
        counters = (
            ("orderly_tracked_timeouts", "Tracked messages that timed out", t.timeout.count),
            ("orderly_tracked_overflow", "Messages not tracked: over capacity", t.overflow),
            ("orderly_tracked_expired", "Tracked messages delisted as expired", t.expired),
            ("orderly_timeout_retries", "Retries scheduled after a timeout", t.retried),
            ("orderly_timeout_failed", "Messages failed for their timeouts", t.gave_up),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "orderly_tracked_messages", "Message ids tracked now", value=t.listed
        )
        yield GaugeMetricFamily(
            "orderly_tracked_done_waiting",
            "Done ids the timeout monitor has not counted yet",
            value=t.done_waiting,
        )

    if figures.workers_alive is not None:
        alive = GaugeMetricFamily(
            "orderly_workers_alive", "Live workers by node code", labels=["node"]
        )
        for node, count in figures.workers_alive.items():
            alive.add_metric([node], count)
        yield alive

    if (broker := figures.broker) is not None:
        depth = GaugeMetricFamily(
            "orderly_queue_depth", "Tasks waiting in a broker queue", labels=["queue"]
        )
        for queue, count in broker.queues.items():
            depth.add_metric([queue], count)
        yield depth
        if broker.unacked is not None:
            yield GaugeMetricFamily(
                "orderly_broker_unacked",
                "Tasks taken by workers and not yet acknowledged",
                value=broker.unacked,
            )


def _totals(found: Sequence[Total]) -> Iterable[Metric]:
    """Every counter and histogram of the catalogue, from their running totals (a counter no
    process counted yet is 0, or has no series when it has labels)."""
    for spec in CATALOGUE:
        if isinstance(spec, Counter):
            family = CounterMetricFamily(spec.name, spec.doc, labels=spec.labels)
            series = [t for t in found if t.name == spec.name]
            if not series and not spec.labels:
                family.add_metric([], 0.0)
            for t in series:
                family.add_metric([t.labels.get(label, "") for label in spec.labels], t.value)
            yield family
        else:
            histogram = HistogramMetricFamily(spec.name, spec.doc, labels=spec.labels)
            for h in histogram_totals(spec, found):
                values = [h.labels.get(label, "") for label in spec.labels]
                histogram.add_metric(values, list(h.buckets), h.sum)
            yield histogram


class FiguresCollector(Collector):
    """Gathers the figures afresh on every collect (every scrape)."""

    def __init__(self, source: Callable[[], Figures]) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        return list(families(self._source()))

    def describe(self) -> Iterable[Metric]:
        # No names up front: registering must not gather.
        return []


def make_registry(source: Callable[[], Figures] = runtime_figures) -> CollectorRegistry:
    """A registry of its own (not the process-wide default) holding the figures' collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FiguresCollector(source))
    return registry
