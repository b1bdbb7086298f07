"""batch claims: orderly_lock_funnels_of

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28 09:00:00

A worker claims due messages several at a time and writes their OK outcomes together
(worker.messages.processing ``process_due``); both take the funnel locks of all their
messages first, in key order, through the new ``orderly_lock_funnels_of``:
worker/db/sql/functions.sql as it stood then, frozen in migrations/sql/0015_functions.sql.
"""

from collections.abc import Sequence

from alembic import op

from orderly.worker.db.schema import apply_frozen

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The sha256 of migrations/sql/0015_functions.sql, the functions.sql this migration was written
# for (tests/test_migrations.py).
FUNCTIONS_SHA256 = "64b2d99a353717cf143e9c1426da4a2166f5ee98aa7ea9d20ae2ad1e7d6afd82"


def upgrade() -> None:
    apply_frozen(op.execute, "0015")


def downgrade() -> None:
    # What this one added goes; the rest gets 0006's text back.
    op.execute("DROP FUNCTION IF EXISTS orderly_lock_funnels_of(bigint[])")
    apply_frozen(op.execute, "0006")
