"""Synthetic data: millions of consistent rows in every table orderly writes, in seconds.

``generate`` writes N ``message`` rows (business messages, parents with their children,
conversations of requests and responses) spread over a time window with a daily rhythm, and
in proportion to them the rows orderly would have written around them: external calls and
confirmations, the ``request``/``response`` log of their exchanges, and publish/subscribe
traffic (events, deliveries, one ``published_messages`` row per attempt, the handler queue
log). The values follow what the mechanisms in ``worker`` write (states, error codes and
descriptions, the conversation service and its sources, HARD bindings, attempt numbering).

Rows are streamed to ``COPY ... FROM STDIN`` (text format) with the primary keys assigned
here, so that every reference is known before its row is written; the whole run is one
transaction under table locks, and the identity sequences are moved past the new keys. As a
superuser it skips the per-row foreign-key triggers (most of COPY's cost) and checks the new
references set-wise before the commit instead. The same seed, N, window and database state
give the same rows.
"""

from tooling.generate.columns import _KEYED, TABLES, GenerateReport
from tooling.generate.rows import _Generator
from tooling.generate.run import generate

__all__ = ["TABLES", "_KEYED", "GenerateReport", "_Generator", "generate"]
