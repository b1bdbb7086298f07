"""The report as one self-contained HTML page: headline figures, then per aggregate a chart
and the table of its rows.

Everything is inline (CSS, charts as base64 PNG, no JavaScript), so the file can be mailed
or archived and opened anywhere without network access. Charts are drawn on matplotlib's Agg
canvas directly rather than through pyplot: no global backend or figure registry is touched,
so rendering neither needs a display nor leaks figures from one report to the next.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orderly.reports.data import AggregateRows, ReportData
from orderly.reports.style import COLOURS, CSS, PALETTE

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Row = dict[str, Any]
Chart = Callable[[list[Row]], "Figure | None"]
Card = tuple[str, str, str, str]  # label, value, note, tone ("", "ok" or "bad")
MAX_TABLE_ROWS = 200  # a big report stays light; the full rows are in the report's data
TOP = 15  # categories drawn per chart, the busiest first; the table has them all
TOP_SERIES = 6  # series beyond this are summed as "other", so a legend stays readable
WIDTH, HEIGHT, DPI = 9.0, 3.5, 100
# Above this many hours a stacked hourly series is drawn as one filled outline (touching
# columns), not a bar each: the bars would be a few pixels wide, and thousands cost seconds.
DENSE = 96
PCTS = ("p50_ms", "p95_ms", "p99_ms")
SINGLE_ROW = frozenset({"exchanges", "conversations"})  # shown as cards, not as a table

# --- formatting -----------------------------------------------------------------------------


def _numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(value: Any) -> float:
    """A value as a float for drawing; None (no data) draws as nothing."""
    return float(value) if _numeric(value) else 0.0


def fmt(column: str, value: Any) -> str:
    """A cell as people read it: ms with 1 decimal, shares as %, thousands separators."""
    if value is None:
        return "—"
    if not _numeric(value):
        return str(value)
    if column.endswith("_ms"):
        return f"{value:,.1f}"
    if column == "share":
        return f"{value:.1%}"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.2f}"


def _label(column: str) -> str:
    return column.replace("_ms", " (ms)").replace("_", " ")


def _when(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if value else "…"


# --- charts ---------------------------------------------------------------------------------


def _figure(height: float = HEIGHT, cols: int = 1) -> tuple[Figure, list[Axes]]:
    """A figure on the Agg canvas, its axes without the top and right frame."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, cols, i + 1) for i in range(cols)]
    for ax in axes:
        ax.spines[["top", "right"]].set_visible(False)
        ax.tick_params(labelsize=9)
        ax.set_axisbelow(True)
    return fig, axes


def _png(fig: Figure, alt: str) -> str:
    buffer = io.BytesIO()
    # No "Software" text chunk: the page then holds no URL at all, even inside a PNG.
    fig.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img class="chart" alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def _pivot(
    rows: Sequence[Row],
    index: Callable[[Row], str],
    series: Callable[[Row], str],
    value: str,
    order: Sequence[str] | None = None,
) -> tuple[list[str], dict[str, list[float]]]:
    """Sums ``value`` into index by series; without ``order`` the busiest TOP indexes first."""
    cells: dict[tuple[str, str], float] = {}
    for row in rows:
        key = (index(row), series(row))
        cells[key] = cells.get(key, 0.0) + _number(row.get(value))
    totals: dict[str, float] = {}
    names: dict[str, float] = {}
    for (i, s), v in cells.items():
        totals[i] = totals.get(i, 0.0) + v
        names[s] = names.get(s, 0.0) + v
    labels = list(order) if order is not None else sorted(totals, key=lambda i: -totals[i])[:TOP]
    ranked = sorted(names, key=lambda s: -names[s])
    kept = ranked if len(ranked) <= TOP_SERIES else ranked[: TOP_SERIES - 1]
    out = {s: [cells.get((i, s), 0.0) for i in labels] for s in kept}
    if len(kept) < len(ranked):
        out["other"] = [sum(cells.get((i, s), 0.0) for s in ranked[len(kept) :]) for i in labels]
    return labels, out


def _bars(
    ax: Axes,
    labels: list[str],
    series: dict[str, list[float]],
    flat: bool,
    grouped: bool,
    log: float,
    dense: bool = False,
) -> None:
    """Stacked or grouped bars (horizontal unless ``flat``), one colour per series; a log
    scale when the largest value is ``log`` times the smallest positive one. ``dense``
    (flat, stacked, linear): past DENSE columns each series is one filled outline."""
    positions = list(range(len(labels)))
    width = 0.8 / len(series) if grouped else 0.8
    base = [0.0] * len(labels)
    for n, (name, values) in enumerate(series.items()):
        at = [p + ((n - (len(series) - 1) / 2) * width if grouped else 0) for p in positions]
        colour = COLOURS.get(name.upper().replace(" ", "_"), PALETTE[n % len(PALETTE)])
        label = name.removesuffix("_ms")
        if dense and flat and not grouped and len(labels) > DENSE:
            top = [b + v for b, v in zip(base, values, strict=True)]
            edges = [p - 0.5 for p in positions] + [len(positions) - 0.5]
            ax.stairs(top, edges, baseline=base, fill=True, color=colour, label=label)
        elif flat:
            ax.bar(at, values, width=width, bottom=base, color=colour, label=label)
        else:
            ax.barh(at, values, height=width, left=base, color=colour, label=label)
        if not grouped:
            base = [b + v for b, v in zip(base, values, strict=True)]
    if flat:
        step = max(1, math.ceil(len(labels) / 16))  # at most ~16 tick labels
        crowded = sum(len(label) for label in labels[::step]) > 90
        ax.set_xticks(positions[::step], labels[::step], rotation=30 if crowded else 0)
        ax.grid(axis="y", alpha=0.3)
    else:
        ax.set_yticks(positions, labels)
        ax.invert_yaxis()  # the first (busiest) on top
        ax.grid(axis="x", alpha=0.3)
    positive = [v for values in series.values() for v in values if v > 0]
    if positive and max(positive) / min(positive) >= log:
        (ax.set_yscale if flat else ax.set_xscale)("log")
    if len(series) > 1:
        handles, names = ax.get_legend_handles_labels()
        if flat and not grouped:  # the legend in the order of the stack, top first
            handles, names = handles[::-1], names[::-1]
        ax.legend(
            handles, names, fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1, 1)
        )


def _chart(
    labels: list[str],
    series: dict[str, list[float]],
    title: str,
    x: str,
    y: str = "",
    flat: bool = False,
    grouped: bool = False,
    log: float = math.inf,
    dense: bool = False,
) -> Figure | None:
    """One bar chart, or None when there is nothing to draw; horizontal ones grow with bars."""
    if not labels or not any(v for values in series.values() for v in values):
        return None
    slots = len(labels) * (1 + (len(series) - 1) / 2 if grouped else 1)
    fig, (ax,) = _figure(HEIGHT if flat else max(2.2, 0.32 * slots + 1.2))
    _bars(ax, labels, series, flat, grouped, log, dense)
    ax.set(title=title, xlabel=x, ylabel=y)
    return fig


def _hours(rows: Sequence[Row]) -> list[str]:
    """Every hour from the first to the last, so quiet hours show as gaps, not vanish."""
    seen = sorted({str(r["hour"]) for r in rows})
    try:
        first, last = (datetime.strptime(h, "%Y-%m-%d %H:%M") for h in (seen[0], seen[-1]))
    except ValueError:
        return seen
    count = int((last - first).total_seconds() // 3600) + 1
    if count > 24 * 62:  # bars would be thinner than a pixel: draw the hours there are
        return seen
    return [(first + timedelta(hours=n)).strftime("%Y-%m-%d %H:%M") for n in range(count)]


def _text(*columns: str) -> Callable[[Row], str]:
    """A row's label: its values in ``columns``, joined; a missing value shows as "—"."""
    return lambda row: " / ".join(str(v) if (v := row.get(c)) is not None else "—" for c in columns)


_sub, _state = _text("room", "subscription"), _text("state")


def _stacked(index: tuple[str, ...], series: str, value: str, title: str) -> Chart:
    """Horizontal bars of ``value`` per ``index``, stacked by ``series``, the busiest on top."""
    return lambda rows: _chart(*_pivot(rows, _text(*index), _text(series), value), title, value)


def _columns(rows: Sequence[Row], columns: Sequence[str]) -> dict[str, list[float]]:
    return {c: [_number(r.get(c)) for r in rows] for c in columns}


def _busiest(rows: list[Row], column: str) -> list[Row]:
    return sorted(rows, key=lambda r: -_number(r.get(column)))[:TOP]


def _throughput(rows: list[Row]) -> Figure | None:
    hours, series = _pivot(rows, lambda r: str(r["hour"]), _state, "messages", _hours(rows))
    short = [h[5:] if len(h) == 16 else h for h in hours]  # the year is in the header
    title = "Messages per hour by state (all services)"
    return _chart(short, series, title, "hour (UTC)", "messages", flat=True, dense=True)


def _latency(rows: list[Row]) -> Figure | None:
    top = _busiest(rows, "p95_ms")
    labels = [f"{r['service_name']}.{r['operation_name']}" for r in top]
    title = "Latency percentiles per service.operation (highest p95 first)"
    return _chart(labels, _columns(top, PCTS), title, "ms", grouped=True, log=100)


def _failed_counts(rows: list[Row]) -> Figure | None:
    ordered = sorted(rows, key=lambda r: _number(r.get("failed_count")))
    labels = [fmt("failed_count", r.get("failed_count")) for r in ordered]
    title = "Messages by number of failed tries"
    series = _columns(ordered, ["messages"])
    fig = _chart(labels, series, title, "failed_count", "messages", flat=True, log=50)
    if fig is not None:  # never failed in green, retried in orange
        for patch, row in zip(fig.axes[0].patches, ordered, strict=True):
            patch.set_facecolor(COLOURS["OK" if not row.get("failed_count") else "PARTLY_FAILED"])
    return fig


def _funnels(rows: list[Row]) -> Figure | None:
    kinds = [str(r["kind"]) for r in rows]
    fig, axes = _figure(cols=2)
    counts = ("messages", "postponed_now", "failed_postponed_too_long")
    titles = ("Messages", "End-to-end wait (ms)")
    for ax, columns, title in zip(axes, (counts, PCTS), titles, strict=True):
        _bars(ax, kinds, _columns(rows, columns), flat=True, grouped=True, log=100)
        ax.set_title(title)
    return fig


def _nodes(rows: list[Row]) -> Figure | None:
    top = _busiest(rows, "share")
    labels = [f"{r.get('code')} (#{r.get('node_id')})" for r in top]
    title, x = "Share of finished messages per node", "share of finished messages"
    fig = _chart(labels, _columns(top, ["share"]), title, x)
    if fig is not None:
        ax = fig.axes[0]
        ax.bar_label(ax.containers[0], fmt="{:.1%}", padding=3, fontsize=8)  # type: ignore[arg-type]
        ax.xaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
        ax.margins(x=0.12)
    return fig


def _deliveries(rows: list[Row]) -> Figure | None:
    top = _busiest(rows, "deliveries")
    series = _columns(top, ("delivered", "dead", "expired", "pending"))
    return _chart([_sub(r) for r in top], series, "Deliveries per subscription", "deliveries")


def _delivery_attempts(rows: list[Row]) -> Figure | None:
    def attempt(r: Row) -> str:
        return str(int(_number(r.get("attempt"))))

    order = sorted({attempt(r) for r in rows}, key=int)
    labels, series = _pivot(rows, attempt, _sub, "deliveries", order)
    title = "Deliveries by number of attempts, per subscription"
    # Grouped, not stacked: a log scale distorts stacks.
    return _chart(labels, series, title, "attempts", "deliveries", True, True, log=100)


def _percentiles(prefix: str, title: str) -> Chart:
    """A small chart of the one row's p50/p95/p99."""

    def chart(rows: list[Row]) -> Figure | None:
        values = [_number(rows[0].get(prefix + p)) for p in PCTS]
        if not any(values):
            return None
        fig, (ax,) = _figure(height=1.9)
        colours = [COLOURS[p.upper()] for p in PCTS]
        bars = ax.barh([p[:3] for p in PCTS], values, color=colours, height=0.6)
        ax.bar_label(bars, labels=[f"{v:,.1f} ms" for v in values], padding=3, fontsize=8)
        ax.invert_yaxis()
        ax.margins(x=0.15)
        ax.set(title=title, xlabel="ms")
        return fig

    return chart


CHARTS: dict[str, Chart] = {
    "throughput_hourly": _throughput,
    "latency": _latency,
    "failures": _stacked(
        ("failed_error_code",), "source_system", "messages", "Error codes by source system"
    ),
    "failed_counts": _failed_counts,
    "funnels": _funnels,
    "external_calls": _stacked(
        ("operation_name",), "state", "calls", "External calls by operation and state"
    ),
    "nodes": _nodes,
    "deliveries": _deliveries,
    "delivery_attempts": _delivery_attempts,
    "publish_log": _stacked(
        ("room", "subscription"), "outcome", "attempts", "Publish attempts by outcome"
    ),
    "consumer_log": _stacked(
        ("routing_key",), "state", "messages", "Consumed messages per routing key by state"
    ),
    "exchanges": _percentiles("", "Response time of external exchanges"),
    "conversations": _percentiles("release_", "Conversation release latency"),
}


# --- HTML -----------------------------------------------------------------------------------


def _cards(cards: list[Card]) -> str:
    items = "".join(
        f'<div class="card {tone}"><div class="l">{escape(label)}</div>'
        f'<div class="v">{escape(value)}</div><div class="n">{escape(note)}</div></div>'
        for label, value, note, tone in cards
    )
    return f'<div class="cards">{items}</div>'


def _rows(report: ReportData, name: str) -> list[Row]:
    return next((a.rows for a in report.aggregates if a.name == name), [])


def _total(rows: list[Row], column: str) -> int:
    return int(sum(_number(r.get(column)) for r in rows))


def headline(report: ReportData) -> list[Card]:
    """The figures a reader wants first, each derived from the aggregates' rows."""
    flow = _rows(report, "throughput_hourly")
    total, ok = (
        _total(flow, "messages"),
        _total([r for r in flow if r["state"] == "OK"], "messages"),
    )
    share = f"{ok / total:.1%}" if total else "—"
    cards = [
        ("messages", f"{total:,}", "received in the window", ""),
        ("finished OK", share, f"{ok:,} messages", "ok"),
    ]
    if latency := _rows(report, "latency"):
        # Percentiles do not add up across services: overall only when there is one.
        top = max(latency, key=lambda r: _number(r.get("messages")))
        which = f"{top['service_name']}.{top['operation_name']}, the busiest"
        note = "all services" if len(latency) == 1 else which
        cards.append(("p95 latency (ms)", fmt("p95_ms", top.get("p95_ms")), note, ""))
    failures, deliveries = _rows(report, "failures"), _rows(report, "deliveries")
    final, dead = _total(failures, "final_failed"), _total(deliveries, "dead")
    failed = f"{_total(failures, 'messages'):,}"
    cards.append(("failures", failed, f"{final:,} finally FAILED", "bad" if final else ""))
    note = f"of {_total(deliveries, 'deliveries'):,} deliveries"
    cards.append(("dead-lettered", f"{dead:,}", note, "bad" if dead else ""))
    if talks := _rows(report, "conversations"):
        p95 = fmt("release_p95_ms", talks[0].get("release_p95_ms"))
        value = fmt("conversations", talks[0].get("conversations"))
        cards.append(("conversations", value, f"release p95 {p95} ms", ""))
    return cards


def _table(aggregate: AggregateRows) -> str:
    shown, columns = aggregate.rows[:MAX_TABLE_ROWS], aggregate.columns
    # Numbers are right-aligned, so their digits line up.
    align = {c: ' class="num"' if any(_numeric(r.get(c)) for r in shown) else "" for c in columns}
    head = "".join(f"<th{align[c]}>{escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>"
        + "".join(f"<td{align[c]}>{escape(fmt(c, r.get(c)))}</td>" for c in columns)
        + "</tr>"
        for r in shown
    )
    more = len(aggregate.rows) - len(shown)
    tail = f'<p class="sub">{more:,} more rows not shown</p>' if more > 0 else ""
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    return f'<div class="scroll">{table}</div>{tail}'


def chart_html(aggregate: AggregateRows) -> str:
    """The aggregate's chart as an inline image ("" when there is nothing to draw). The
    slow part of a report's page: the job draws each chart as soon as its rows are there."""
    if not aggregate.rows or aggregate.name not in CHARTS:
        return ""
    try:
        figure = CHARTS[aggregate.name](aggregate.rows)
    except (KeyError, TypeError, ValueError) as exc:
        # One odd aggregate should not cost the whole report: its table still shows.
        return f'<p class="empty chart-error">no chart: {escape(repr(exc))}</p>'
    return _png(figure, aggregate.title) if figure is not None else ""


def _section(aggregate: AggregateRows, chart: str | None = None) -> str:
    name, rows = aggregate.name, aggregate.rows
    title = f"<h2>{escape(aggregate.title)}<code>{escape(name)}</code></h2>"
    parts = [f'<section id="{escape(name)}">{title}']
    if not rows:
        return parts[0] + '<p class="empty">no data in this window</p></section>'
    parts.append(f'<p class="sub">{len(rows):,} row{"s" if len(rows) != 1 else ""}</p>')
    single = name in SINGLE_ROW and len(rows) == 1
    if single:
        parts.append(
            _cards([(_label(c), fmt(c, rows[0].get(c)), "", "") for c in aggregate.columns])
        )
    parts.append(chart_html(aggregate) if chart is None else chart)
    parts.append(("" if single else _table(aggregate)) + "</section>")
    return "".join(parts)


def render_html(report: ReportData, charts: Mapping[str, str] | None = None) -> str:
    """The whole report as one HTML document, with nothing to fetch; ``charts`` holds
    charts already drawn (``chart_html``) by aggregate name, the others are drawn here."""
    drawn = charts or {}
    window = f"{_when(report.since)} → {_when(report.until)}"
    meta = {
        "window": "all time" if report.since is None and report.until is None else window,
        "generated": _when(report.generated_at),
        "Spark": report.master,
        "took": f"{report.seconds:,.1f} s",
    }
    read = "".join(f"<span>{escape(t)} {n:,}</span>" for t, n in report.rows_read.items())
    nav = "".join(
        f'<a href="#{escape(a.name)}">{escape(a.name)} ({len(a.rows):,})</a>'
        for a in report.aggregates
    )
    title = escape(f"orderly report {report.run_id}")
    return "".join(
        [
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{title}</title><style>{CSS}</style></head><body><main>",
            f'<header><h1>{title}</h1><ul class="meta">',
            "".join(f"<li>{escape(k)} <b>{escape(v)}</b></li>" for k, v in meta.items()),
            f'</ul><div class="chips">rows held in memory: {read or "none"}</div></header>',
            _cards(headline(report)),
            f"<nav>{nav}</nav>",
            *(_section(a, drawn.get(a.name)) for a in report.aggregates),
            "</main></body></html>\n",
        ]
    )


def write_html(
    report: ReportData, path: Path | str, charts: Mapping[str, str] | None = None
) -> Path:
    """Writes the page (UTF-8), creating its folder; returns where it went."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render_html(report, charts), encoding="utf-8")
    return target
