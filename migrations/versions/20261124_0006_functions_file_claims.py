"""functions from worker/db/sql/functions.sql; delivery delays logged; confirmation claims

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24 09:00:00

The store's functions and triggers now live in one canonical file, worker/db/sql/functions.sql;
this migration applies the file as it stood then, frozen in migrations/sql/0006_functions.sql
(``orderly_orphaned`` is new there: the dead-worker check the claim and repair share).
``published_messages.next_delay_ms`` logs each failed attempt's retry wait (the seed's
"next calculated delivery delay"); ``external_call.claim`` is the fencing token of a
confirmation try in flight.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from orderly.worker.db.schema import apply_frozen

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The sha256 of migrations/sql/0006_functions.sql, the functions.sql this migration was written
# for (tests/test_migrations.py).
FUNCTIONS_SHA256 = "5faaedc97c9bd842fac9b8549332493b3615290d7b4d877cfa124e539518e925"


def upgrade() -> None:
    op.add_column("published_messages", sa.Column("next_delay_ms", sa.Integer(), nullable=True))
    op.add_column("external_call", sa.Column("claim", sa.String(length=32), nullable=True))
    apply_frozen(op.execute, "0006")


def downgrade() -> None:
    # 0004's functions as 0004 wrote them (the trigger function cleared no external_call.claim
    # then, the column this drops): dropped, and created again from 0004's own text.
    before = op.get_context().script.get_revision("0004").module
    op.execute("DROP FUNCTION IF EXISTS orderly_orphaned(integer)")
    op.execute(before.DROP_FUNCTIONS)
    op.execute(before.FUNCTIONS)
    op.drop_column("external_call", "claim")
    op.drop_column("published_messages", "next_delay_ms")
