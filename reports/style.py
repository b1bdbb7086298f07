"""The report page's look: one colour per state in every chart, the palette of the other
series, and the page's inline CSS."""

from __future__ import annotations

# One colour per state in every chart: green done, red failed, grey cancelled, orange retrying,
# blues for work in flight. Looked up by the upper-cased name, spaces as underscores.
_STATE_COLOURS = """
#2e9e44 OK DELIVERED COMPLETED, #d62728 FAILED ERROR, #8c1d1d DEAD FAILED_END, #9a9a9a CANCEL,
#ff8c1a PARTLY_FAILED, #9467bd POSTPONED, #a6761d EXPIRED, #cfcfcf OTHER, #bcbddc WAITING,
#9ecae1 PENDING NEW P50_MS, #6baed6 IN_QUEUE, #3182bd PROCESSING IN_PROCESS, #4292c6 P95_MS,
#08306b P99_MS, #756bb1 WAITING_FOR_RES"""
COLOURS = {
    n: c for group in _STATE_COLOURS.split(",") for c, *names in [group.split()] for n in names
}
PALETTE = ("#4c72b0", "#dd8452", "#55a868", "#8172b3", "#937860", "#da8bc3", "#64b5cd", "#ccb974")

CSS = """
:root{--ink:#1f2933;--muted:#66727f;--line:#e2e6eb;--ok:#2e9e44;--bad:#d62728;--acc:#4c72b0}
*{box-sizing:border-box} h1{font-size:26px;margin:0 0 6px}
body{margin:0;background:#f3f5f8;color:var(--ink);
 font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif}
main{max-width:1080px;margin:0 auto;padding:28px 28px 56px}
.meta{display:flex;flex-wrap:wrap;gap:4px 22px;margin:0;padding:0;list-style:none}
.meta,.chips,.sub,.card .l,.card .n{color:var(--muted)} .meta b{color:var(--ink);font-weight:600}
.chips{margin:8px 0 0;font-size:12px} .chips span{display:inline-block;background:#e6ebf1;
 color:var(--ink);border-radius:10px;padding:1px 9px;margin:2px 4px 2px 0}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(158px,1fr));gap:12px;
 margin:20px 0}
.card{background:#fff;border:1px solid var(--line);border-top:4px solid var(--acc);
 border-radius:8px;padding:9px 14px}
.card.ok{border-top-color:var(--ok)} .card.bad{border-top-color:var(--bad)}
.card .l,.card .n{font-size:12px} .card .v{font-size:24px;font-weight:650;margin:1px 0}
section .cards{grid-template-columns:repeat(auto-fill,minmax(128px,1fr));margin:14px 0 4px}
section .card .v{font-size:20px} .card .v,.num{font-variant-numeric:tabular-nums}
nav{display:flex;flex-wrap:wrap;gap:4px 16px;font-size:13px;margin:0 0 6px}
nav a{color:var(--acc);text-decoration:none} .sub{font-size:12px;margin:2px 0 0}
section{background:#fff;border:1px solid var(--line);border-radius:10px;padding:18px 22px;
 margin:18px 0} section h2{font-size:17px;margin:0}
section h2 code{font-size:12px;color:var(--muted);font-weight:400;margin-left:10px}
img.chart{display:block;max-width:100%;height:auto;margin:14px auto 10px}
.empty{color:var(--muted);font-style:italic;margin:14px 0 4px}
.scroll{max-height:440px;overflow:auto;border:1px solid var(--line);border-radius:6px}
table{border-collapse:collapse;width:100%;font-size:13px} .num{text-align:right}
th{position:sticky;top:0;background:#eef2f6;text-align:left;font-weight:600}
th,td{padding:4px 10px;border-bottom:1px solid var(--line);white-space:nowrap}
tbody tr:nth-child(even){background:#f9fafb}
"""
