"""functions from worker/store/sql/functions.sql; delivery delays logged; confirmation claims

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24 09:00:00

The store's functions and triggers now live in one canonical file that migrations apply
(``orderly_orphaned`` is new there: the dead-worker check the claim and repair share).
``published_messages.next_delay_ms`` logs each failed attempt's retry wait (the seed's
"next calculated delivery delay"); ``external_call.claim`` is the fencing token of a
confirmation try in flight.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from orderly.worker.store.schema import apply_functions

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The functions.sql this migration was written for (tests/test_migrations.py).
FUNCTIONS_SHA256 = "5faaedc97c9bd842fac9b8549332493b3615290d7b4d877cfa124e539518e925"


def upgrade() -> None:
    op.add_column("published_messages", sa.Column("next_delay_ms", sa.Integer(), nullable=True))
    op.add_column("external_call", sa.Column("claim", sa.String(length=32), nullable=True))
    apply_functions(op.execute)


def downgrade() -> None:
    # The other functions' text is the same as 0004 installed; only the new one goes.
    op.execute("DROP FUNCTION IF EXISTS orderly_orphaned(integer)")
    op.drop_column("external_call", "claim")
    op.drop_column("published_messages", "next_delay_ms")
