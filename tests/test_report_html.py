"""The report's HTML page: built from hand-made rows (no Spark, no database), checked for its
structure, escaping and self-containment, then opened in headless Chromium.

The browser test saves a full-page screenshot to ``artifacts/report.png`` at the repository's
root.
"""

from __future__ import annotations

import base64
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver

from orderly.reports.data import AggregateRows, ReportData
from orderly.reports.render import MAX_TABLE_ROWS, render_html, write_html
from tests.browser import chromium

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
EVIL = '<script>alert("x")</script>'
PNG = b"\x89PNG\r\n\x1a\n"

# --- a realistic report, by hand ------------------------------------------------------------

SERVICES = (("billing", "charge", 900), ("shipping", "dispatch", 300), (EVIL, "notify", 20))
STATES = {"OK": 1.0, "FAILED": 0.02, "CANCEL": 0.01, "PARTLY_FAILED": 0.03, "PROCESSING": 0.005}


def _throughput() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for hour in (8, 9, 10, 11, 13, 14, 15, 16, 17):  # 12:00 was quiet: a gap in the chart
        for service, operation, base in SERVICES:
            for state, share in STATES.items():
                messages = int(base * share * (1 + (hour % 5) / 4))
                if messages:
                    when = f"2026-11-23 {hour:02d}:00"
                    names = {"service_name": service, "operation_name": operation}
                    rows.append({"hour": when, **names, "state": state, "messages": messages})
    return rows


def _attempts() -> list[dict[str, Any]]:
    shape = {"billing-sync": (5100, 60, 20, 8, 3, 1), "pager": (180, 60, 30, 15, 8, 4, 2, 1)}
    return [
        {"room": "orders", "subscription": sub, "attempt": n + 1, "deliveries": count}
        for sub, counts in shape.items()
        for n, count in enumerate(counts)
    ]


def _publish() -> list[dict[str, Any]]:
    outcomes = {
        ("orders", "billing-sync"): {"DELIVERED": 5100, "FAILED": 130, "DEAD": 40, "PENDING": 50},
        ("orders", "audit"): {"DELIVERED": 5200},
        ("alerts", "pager"): {"DELIVERED": 250, "FAILED": 70, "DEAD": 20, "EXPIRED": 25},
    }
    return [
        {"room": room, "subscription": sub, "outcome": outcome, "attempts": attempts}
        for (room, sub), by_outcome in outcomes.items()
        for outcome, attempts in by_outcome.items()
    ]


def _aggregate(name: str, columns: str, rows: list[tuple[Any, ...]]) -> AggregateRows:
    names = tuple(columns.split())
    title = f"{name.replace('_', ' ').capitalize()} in the window"
    return AggregateRows(name, title, names, [dict(zip(names, r, strict=True)) for r in rows])


def full_report() -> ReportData:
    latency = "service_name operation_name messages mean_ms p50_ms p95_ms p99_ms max_ms"
    deliveries = "room subscription deliveries delivered dead expired pending mean_attempts "
    conversations = "conversations requests responses delivered cancelled_groups awaited "
    aggregates = [
        AggregateRows(
            "throughput_hourly",
            "Messages per hour by service, operation and state",
            ("hour", "service_name", "operation_name", "state", "messages"),
            _throughput(),
        ),
        _aggregate(
            "latency",
            latency,
            [
                ("billing", "charge", 12345, 85.23, 41.25, 1234.5, 2950.0, 8100.7),
                ("shipping", "dispatch", 3400, 40.0, 22.5, 96.75, 180.2, 950.0),
                ("conversation", "response", 600, 12.1, 8.0, 35.5, 61.0, 120.0),
                (EVIL, "notify", 20, 2.5, 1.9, 4.4, 5.0, 5.1),
            ],
        ),
        _aggregate(
            "failures",
            "failed_error_code source_system messages final_failed",
            [
                ("E_HTTP_502", "erp", 17, 2),
                ("E_POSTPONED_TOO_LONG", None, 3, 3),
                ("E_TIMEOUT", "crm", 120, 30),
                ("E_TIMEOUT", "erp", 80, 11),
                ("E_VALIDATION", "crm", 45, 45),
            ],
        ),
        _aggregate(
            "failed_counts",
            "failed_count messages",
            [(0, 15000), (1, 410), (2, 96), (3, 12), (5, 2)],
        ),
        _aggregate(
            "funnels",
            "kind funnels messages postponed_now failed_postponed_too_long p50_ms p95_ms p99_ms",
            [
                ("funnel", 38, 1520, 12, 3, 120.5, 950.25, 2400.0),
                ("guaranteed order", 4, 800, 0, 0, 60.0, 310.0, 700.0),
            ],
        ),
        _aggregate(
            "external_calls",
            "operation_name state calls failures mean_ms",
            [
                ("charge_card", "FAILED", 12, 36, 5020.0),
                ("charge_card", "FAILED_END", 3, 15, 9000.5),
                ("charge_card", "OK", 900, 35, 210.4),
                ("charge_card", "PROCESSING", 5, 0, None),
                ("lookup_customer", "FAILED", 40, 80, 1200.0),
                ("lookup_customer", "OK", 1500, 12, 95.25),
            ],
        ),
        _aggregate(
            "nodes",
            "node_id code messages share",
            [(1, "node-a", 9000, 0.5625), (2, "node-b", 6000, 0.375), (3, "?", 1000, 0.0625)],
        ),
        _aggregate(
            "deliveries",
            deliveries + "max_attempts",
            [
                ("alerts", "pager", 300, 250, 20, 25, 5, 2.4, 8),
                ("orders", "audit", 5200, 5200, 0, 0, 0, 1.0, 1),
                ("orders", "billing-sync", 5200, 5100, 40, 10, 50, 1.08, 6),
            ],
        ),
        AggregateRows(
            "delivery_attempts",
            "Attempts distribution per subscription",
            ("room", "subscription", "attempt", "deliveries"),
            _attempts(),
        ),
        AggregateRows(
            "publish_log",
            "Publish attempts by outcome (published_messages)",
            ("room", "subscription", "outcome", "attempts"),
            _publish(),
        ),
        _aggregate(
            "consumer_log",
            "routing_key state messages mean_ms max_ms",
            [
                ("alerts.raised", "Completed", 250, 30.5, 800.0),
                ("orders.created", "Completed", 5100, 12.3, 480.0),
                ("orders.created", "Error", 40, 150.0, 2000.0),
                ("orders.created", "In process", 3, None, None),
            ],
        ),
        _aggregate(
            "exchanges",
            "requests responses failed p50_ms p95_ms p99_ms",
            [(2400, 2380, 25, 80.0, 640.5, 1900.0)],
        ),
        _aggregate(
            "conversations",
            conversations + "release_p50_ms release_p95_ms release_p99_ms",
            [(150, 150, 600, 580, 6, 42, 35.5, 820.25, 1500.0)],
        ),
    ]
    return ReportData(
        run_id="20261123-180000-abc123",
        generated_at=datetime(2026, 11, 23, 18, 0, 5, tzinfo=UTC),
        since=datetime(2026, 11, 23, 8, tzinfo=UTC),
        until=datetime(2026, 11, 23, 18, tzinfo=UTC),
        aggregates=aggregates,
        rows_read={"message": 16_600, "delivery": 10_700, "published_messages": 10_985},
        seconds=42.7,
        master="local[2]",
    )


NAMES = [a.name for a in full_report().aggregates]

# --- reading the page back ------------------------------------------------------------------


class Page(HTMLParser):
    """What a reader finds per section: images, table cells, text; and any unbalanced tag."""

    VOID = frozenset({"area", "base", "br", "col", "hr", "img", "input", "link", "meta", "wbr"})

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.sections: list[str] = []
        self.images: dict[str, list[str]] = defaultdict(list)
        self.cells: dict[str, list[str]] = defaultdict(list)
        self.text: dict[str, str] = defaultdict(str)
        self.feed(html)
        self.close()

    @property
    def section(self) -> str:
        return self.sections[-1] if "section" in self.stack else ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "section":
            self.sections.append(attributes.get("id") or "")
        if tag == "img":
            self.images[self.section].append(attributes.get("src") or "")
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if self.stack and self.stack[-1] == tag:
            self.stack.pop()
        else:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")

    def handle_data(self, data: str) -> None:
        if self.stack[-1:] == ["style"]:
            return
        self.text[self.section] += data + " "
        if self.stack and self.stack[-1] in ("td", "th"):
            self.cells[self.section].append(data)


def well_formed(html: str) -> Page:
    assert html.startswith("<!DOCTYPE html>")
    page = Page(html)
    assert page.errors == []
    assert page.stack == [], f"unclosed: {page.stack}"
    return page


# --- tests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_html() -> str:
    """The page of ``full_report()``, drawn once: its charts take a second or two."""
    return render_html(full_report())


def test_every_aggregate_has_a_section_a_chart_and_its_values(full_html: str) -> None:
    html = full_html
    page = well_formed(html)

    assert page.sections == NAMES
    assert "chart-error" not in html
    for name in NAMES:
        (src,) = page.images[name]
        assert src.startswith("data:image/png;base64,"), name
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG), name
    # Numbers as people read them: ms with one decimal, shares as %, thousands separators.
    assert {"billing", "charge", "12,345", "85.2", "1,234.5", "2,950.0"} <= set(
        page.cells["latency"]
    )
    assert {"56.2%", "37.5%", "6.2%", "node-a"} <= set(page.cells["nodes"])
    assert {"15,000", "E_TIMEOUT"} <= set(page.cells["failed_counts"] + page.cells["failures"])
    assert {"1.08", "5,200", "—"} <= set(page.cells["deliveries"] + page.cells["failures"])
    assert "—" in page.cells["consumer_log"]  # no duration yet: a dash, not "None"
    # Single-row aggregates are cards, not a one-line table.
    assert "2,380" in page.text["exchanges"] and "640.5" in page.text["exchanges"]
    assert "820.2" in page.text["conversations"] and not page.cells["conversations"]


def test_header_and_headline_cards(full_html: str) -> None:
    report = full_report()
    page = well_formed(full_html)
    header = page.text[""]

    total = sum(r["messages"] for r in report.get("throughput_hourly").rows)
    ok = sum(r["messages"] for r in report.get("throughput_hourly").rows if r["state"] == "OK")
    for expected in (
        report.run_id,
        "2026-11-23 08:00:00 UTC → 2026-11-23 18:00:00 UTC",
        "2026-11-23 18:00:05 UTC",
        "local[2]",
        "42.7 s",
        "message 16,600",
        "published_messages 10,985",
        f"{total:,}",
        f"{ok / total:.1%}",
        "p95 latency (ms)",
        "1,234.5",  # of the busiest service: billing.charge
        "billing.charge, the busiest",
        "265",  # messages with an error code
        "91 finally FAILED",
        "of 10,700 deliveries",
        "release p95 820.2 ms",
    ):
        assert expected in header, expected


def test_values_are_escaped_and_the_page_is_self_contained(full_html: str) -> None:
    html = full_html

    assert "<script" not in html.lower()
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in html
    page = well_formed(html)
    assert EVIL in page.cells["latency"]  # shown as text, exactly as it was
    assert "http://" not in html and "https://" not in html
    assert " src=" not in html.replace(' src="data:image/png;base64,', "")


def test_a_big_table_is_capped() -> None:
    report = full_report()
    rows = [{"failed_count": n, "messages": 1000 - n} for n in range(MAX_TABLE_ROWS + 321)]
    big = replace(report.get("failed_counts"), rows=rows)
    aggregates = [big if a.name == "failed_counts" else a for a in report.aggregates]
    html = render_html(replace(report, aggregates=aggregates))

    page = well_formed(html)
    assert len(page.cells["failed_counts"]) == 2 * (MAX_TABLE_ROWS + 1)  # header + rows
    assert "321 more rows not shown" in page.text["failed_counts"]


def test_a_month_of_hours_is_drawn_as_filled_stacks_of_the_same_sums() -> None:
    import numpy as np
    from matplotlib.patches import StepPatch

    from orderly.reports.render import DENSE, _failed_counts, _throughput

    hours = [f"2026-11-{1 + h // 24:02d} {h % 24:02d}:00" for h in range(24 * 30)]
    rows = [
        {"hour": hour, "service_name": s, "operation_name": "op", "state": state, "messages": n}
        for i, hour in enumerate(hours)
        for s, state, n in (("a", "OK", 100 + i % 24), ("b", "OK", 7), ("a", "FAILED", i % 5))
    ]
    fig = _throughput(rows)
    assert fig is not None and len(hours) > DENSE
    # One filled outline per state (not a bar per hour and state), each on the one below.
    steps = [p for p in fig.axes[0].patches if isinstance(p, StepPatch)]
    assert len(steps) == len(fig.axes[0].patches) == 2
    tops = {str(p.get_label()): p.get_data() for p in steps}  # (values, edges, baseline)
    (ok, ok_edges, _), (failed, _, failed_base) = tops["OK"], tops["FAILED"]
    assert list(ok) == [107 + i % 24 for i in range(len(hours))]
    assert list(np.asarray(failed_base)) == list(ok)  # stacked on the one below
    assert list(failed) == [107 + i % 24 + i % 5 for i in range(len(hours))]
    assert list(ok_edges) == [i - 0.5 for i in range(len(hours) + 1)]
    # Only the hours: another flat chart of as many columns keeps a bar each (coloured one
    # by one, on a log scale).
    counts = [{"failed_count": n, "messages": 1000 - n} for n in range(DENSE + 5)]
    bars = _failed_counts(counts)
    assert bars is not None and len(bars.axes[0].patches) == DENSE + 5


def test_an_empty_report_is_valid_html_with_no_data_in_each_section() -> None:
    report = full_report()
    empty = replace(
        report,
        since=None,
        until=None,
        rows_read={},
        aggregates=[replace(a, rows=[]) for a in report.aggregates],
    )
    html = render_html(empty)

    page = well_formed(html)
    assert page.sections == NAMES
    assert "all time" in page.text[""]
    for name in NAMES:
        assert "no data in this window" in page.text[name], name
        assert not page.images[name] and not page.cells[name], name


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    with chromium(1400, 2000) as driver:
        yield driver


def test_the_page_in_chromium_loads_every_chart(tmp_path: Path, browser: webdriver.Chrome) -> None:
    path = write_html(full_report(), tmp_path / "out" / "report.html")
    assert path.is_file()

    browser.get(path.as_uri())
    sections = browser.execute_script(
        "return Array.from(document.querySelectorAll('section')).map(s => s.id)"
    )
    assert sections == NAMES
    images = browser.execute_script(
        "return Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.alt])"
    )
    assert len(images) == len(NAMES)
    assert all(complete and width > 0 for complete, width, _ in images), images

    # The whole page, not just the window: the capture extends past the viewport.
    height = browser.execute_script("return document.documentElement.scrollHeight")
    shot = browser.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": 1400, "height": height, "scale": 1},
        },
    )
    ARTIFACTS.mkdir(exist_ok=True)
    png = ARTIFACTS / "report.png"
    png.write_bytes(base64.b64decode(shot["data"]))
    print(f"screenshot: {png}")
    assert png.stat().st_size > 50_000, f"{png} looks empty"
