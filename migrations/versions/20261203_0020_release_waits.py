"""a funnel's release waits for the row beat's due take holds

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-03 09:00:00

``orderly_funnel_release`` locked the funnel's oldest POSTPONED messages with ``SKIP LOCKED``:
when beat's due take held them at that moment (they fell due while their funnel was still
busy), an outcome released nothing and the funnel waited ``postponedIntervalSec`` while other
funnels ran. It now waits for the row (the due take never waits itself, so this cannot
deadlock).
"""

from collections.abc import Sequence

from alembic import op

from orderly.worker.db.schema import apply_frozen

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The functions.sql this migration was written for (tests/test_migrations.py).
FUNCTIONS_SHA256 = "4c0c2e9734a0462ba15529bdec8da3ced24060a64926a8a04d9e76095e252ce4"


def upgrade() -> None:
    apply_frozen(op.execute, "0020")


def downgrade() -> None:
    apply_frozen(op.execute, "0018")
