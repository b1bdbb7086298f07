"""a funnel's release waits for the row beat's due take holds; funnel functions keep their plans

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-03 09:00:00

``orderly_funnel_release`` locked the funnel's oldest POSTPONED messages with ``SKIP LOCKED``:
when beat's due take held them at that moment (they fell due while their funnel was still
busy), an outcome released nothing and the funnel waited ``postponedIntervalSec`` while other
funnels ran. It now waits for the row (the due take never waits itself, so this cannot
deadlock).

The functions that query tables (``orderly_funnel_blocked``, ``orderly_funnel_free``,
``orderly_funnel_limit``, ``orderly_fair_at``, ``orderly_postponed_due``, ``orderly_orphaned``)
are PL/pgSQL instead of SQL: the same text, planned once per session instead of in every
statement that calls them (PostgreSQL inlines no SQL function that holds a subquery).
"""

from collections.abc import Sequence

from alembic import op

from orderly.worker.db.schema import apply_frozen

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The functions.sql this migration was written for (tests/test_migrations.py).
FUNCTIONS_SHA256 = "bc0033120cafa8a1f6a08a4b0e88ab175e55beed3d1be8028dcc08a8a725cd6b"


def upgrade() -> None:
    apply_frozen(op.execute, "0020")


def downgrade() -> None:
    apply_frozen(op.execute, "0018")
