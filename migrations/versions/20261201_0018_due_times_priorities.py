"""due times, priorities, fair turns and funnel limits

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-01 09:00:00

``message.due_at`` holds when a waiting message is due: a NEW message scheduled for later, a
PARTLY_FAILED one until its retry (``delay * multiplier^attempt``), a POSTPONED one until the
pool looks at it again. ``message.priority`` orders claims (higher first), then
``message.fair_at`` (the place in line: funnels take turns). ``funnel_limit`` lets a funnel
component run more than one message at a time. Messages already PARTLY_FAILED or POSTPONED
become due at once: the ticker takes them up (a funnel still holding one back pushes its due
time on); messages waiting keep their order (``fair_at`` from when they came).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from orderly.worker.db.schema import apply_frozen

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The functions.sql this migration was written for (tests/test_migrations.py).
FUNCTIONS_SHA256 = "89e4fc97b136d29990fd82275954f31414281690ac7308e1cef374032915f068"


def upgrade() -> None:
    op.add_column("message", sa.Column("due_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column(
        "message", sa.Column("priority", sa.SmallInteger(), server_default="0", nullable=False)
    )
    op.add_column("message", sa.Column("fair_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE message SET due_at = now() WHERE state IN ('PARTLY_FAILED', 'POSTPONED')")
    op.execute(
        "UPDATE message SET fair_at = last_process_timestamp"
        " WHERE state NOT IN ('OK', 'FAILED', 'CANCEL')"
    )
    op.create_table(
        "funnel_limit",
        sa.Column("component_id", sa.String(255), primary_key=True),
        sa.Column("max_in_flight", sa.Integer(), nullable=False),
        sa.Column("rate_per_s", sa.Double(), nullable=True),
        sa.Column("burst", sa.Integer(), nullable=True),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "max_in_flight BETWEEN 1 AND 10000", name="ck_funnel_limit_max_in_flight"
        ),
        sa.CheckConstraint(
            "rate_per_s IS NULL OR (rate_per_s > 0 AND rate_per_s <= 100000)",
            name="ck_funnel_limit_rate",
        ),
        sa.CheckConstraint(
            "(rate_per_s IS NULL) = (burst IS NULL)"
            " AND (burst IS NULL OR burst BETWEEN 1 AND 10000)",
            name="ck_funnel_limit_burst",
        ),
    )
    op.create_index(
        "ix_message_ready",
        "message",
        [sa.text("priority DESC"), "fair_at", "msg_id"],
        postgresql_where=sa.text(
            "state IN ('NEW', 'IN_QUEUE') AND due_at IS NULL AND service_name <> 'conversation'"
        ),
    )
    op.create_index(
        "ix_message_due",
        "message",
        ["due_at"],
        postgresql_where=sa.text(
            "due_at IS NOT NULL AND state IN ('NEW', 'IN_QUEUE', 'PARTLY_FAILED', 'POSTPONED')"
        ),
    )
    apply_frozen(op.execute, "0018")


def downgrade() -> None:
    # 0015's text gives back its orderly_finish, funnel release and trigger.
    apply_frozen(op.execute, "0015")
    op.execute(
        "DROP FUNCTION IF EXISTS"
        " orderly_finish_v2(bigint, text, integer, text, text, text, bigint, bigint)"
    )
    for dropped in (
        "orderly_funnel_limit(text)",
        "orderly_funnel_free(text, text)",
        "orderly_fair_at(text, text, bigint)",
        "orderly_postponed_due()",
    ):
        op.execute(f"DROP FUNCTION IF EXISTS {dropped}")
    op.drop_index("ix_message_due", table_name="message")
    op.drop_index("ix_message_ready", table_name="message")
    op.drop_table("funnel_limit")
    op.drop_column("message", "fair_at")
    op.drop_column("message", "priority")
    op.drop_column("message", "due_at")
