"""periodic schedules that produce messages

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-02 09:00:00

``schedule``: a name, a five-field cron expression read in an IANA time zone, the template of
the message produced at each due instant (service, operation, source system, a payload
template and the optional message fields), an enabled flag, the next due instant (NULL while
disabled), the last one produced and its message, and why the last production was refused.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "schedule",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("cron", sa.String(100), nullable=False),
        sa.Column("time_zone", sa.String(64), server_default="UTC", nullable=False),
        sa.Column("service", sa.String(100), nullable=False),
        sa.Column("operation", sa.String(100), nullable=False),
        sa.Column("source_system", sa.String(100), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("object_id", sa.String(100), nullable=True),
        sa.Column("entity_type", sa.String(100), nullable=True),
        sa.Column("process_id", sa.String(100), nullable=True),
        sa.Column("funnel_value", sa.String(255), nullable=True),
        sa.Column("funnel_component_id", sa.String(255), nullable=True),
        sa.Column("guaranteed_order", sa.Boolean(), server_default="false", nullable=False),
        sa.Column("exclude_failed_state", sa.Boolean(), server_default="false", nullable=False),
        sa.Column("priority", sa.SmallInteger(), nullable=True),
        sa.Column("enabled", sa.Boolean(), server_default="true", nullable=False),
        sa.Column("next_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_msg_id", sa.BigInteger(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.CheckConstraint("enabled = (next_at IS NOT NULL)", name=op.f("ck_schedule_next_at")),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_schedule")),
    )
    op.create_index(
        "ix_schedule_next_at",
        "schedule",
        ["next_at"],
        postgresql_where=sa.text("next_at IS NOT NULL"),
    )
    op.create_index("ix_schedule_source_system", "schedule", ["source_system"])


def downgrade() -> None:
    op.drop_index("ix_schedule_source_system", table_name="schedule")
    op.drop_index("ix_schedule_next_at", table_name="schedule")
    op.drop_table("schedule")
