"""a funnel's release waits for the row beat's due take holds; funnel functions keep their plans

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-03 09:00:00

``orderly_funnel_release`` locked the funnel's oldest POSTPONED messages with ``SKIP LOCKED``:
when beat's due take held them at that moment (they fell due while their funnel was still
busy), an outcome released nothing and the funnel waited ``postponedIntervalSec`` while other
funnels ran. It now waits for the row, in ``FOR NO KEY UPDATE`` mode: the due take holds
it only for its statement and waits for nothing; a child's insert (the share lock of its
foreign key) and the purge's lock of an open family member (``KEY SHARE``) do not conflict
with it, and ``orderly_parent_check`` locks a parent the same way.

The functions that query tables (``orderly_funnel_blocked``, ``orderly_funnel_free``,
``orderly_funnel_limit``, ``orderly_fair_at``, ``orderly_postponed_due``, ``orderly_orphaned``,
``orderly_lock_funnel_of``)
are PL/pgSQL instead of SQL: the same text, planned once per session instead of in every
statement that calls them (PostgreSQL inlines no SQL function that holds a subquery);
``orderly_funnel_blocked`` has one query per kind of funnel, so that one cached plan serves
every call.

``orderly_finish_many`` writes outcomes over arrays in one statement (one message's, or a
batch's OK outcomes); ``orderly_finish_v2`` (and the older seven-argument
``orderly_finish``) call it for one, for workers of the previous release during a deploy.
"""

from collections.abc import Sequence

from alembic import op

from orderly.worker.db.schema import apply_frozen

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The functions.sql this migration was written for (tests/test_migrations.py).
FUNCTIONS_SHA256 = "455bae6dbd97346672c2012c3a91f20fa26384f51e77c0916d49d26d36aaf635"


def upgrade() -> None:
    apply_frozen(op.execute, "0020")


def downgrade() -> None:
    apply_frozen(op.execute, "0018")
    op.execute(
        "DROP FUNCTION IF EXISTS orderly_finish_many("
        "bigint[], text[], integer[], text[], text[], text[], bigint[], bigint[])"
    )
