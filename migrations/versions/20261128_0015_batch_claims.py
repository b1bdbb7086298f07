"""batch claims: orderly_lock_funnels_of

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28 09:00:00

A worker claims due messages several at a time and writes their OK outcomes together
(worker.processing ``process_due``); both take the funnel locks of all their messages first,
in key order, through the new ``orderly_lock_funnels_of`` (worker/store/sql/functions.sql).
"""

from collections.abc import Sequence

from alembic import op

from orderly.worker.store.schema import apply_functions

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The functions.sql this migration was written for (tests/test_migrations.py).
FUNCTIONS_SHA256 = "64b2d99a353717cf143e9c1426da4a2166f5ee98aa7ea9d20ae2ad1e7d6afd82"


def upgrade() -> None:
    apply_functions(op.execute)


def downgrade() -> None:
    # The other functions' text is the same as 0006 installed; only the new one goes.
    op.execute("DROP FUNCTION IF EXISTS orderly_lock_funnels_of(bigint[])")
