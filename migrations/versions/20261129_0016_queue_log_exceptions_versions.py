"""the queue log for every consumer, its exception table, subscriptions by version

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-29 09:00:00

``log_exception`` holds what went wrong in an attempt (type, message, traceback, the delivery
it belongs to); ``queue_message.exception_id`` becomes a foreign key to it (the text ids it
held before pointed at nothing and are cleared) and the log gains the attempt and an index by
delivery. ``published_messages`` gains ``next_attempt_at``: a row is written PENDING when its
attempt is scheduled, so the deliveries open at this upgrade get theirs here. A subscription
may select a version range of its event type (``min_version``/``max_version``).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "log_exception",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column(
            "time", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("type", sa.String(length=200), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("traceback", sa.Text(), nullable=True),
        sa.Column("delivery_id", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["delivery_id"],
            ["delivery.delivery_id"],
            name=op.f("fk_log_exception_delivery_id_delivery"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_log_exception")),
    )
    op.create_index("ix_log_exception_delivery_id", "log_exception", ["delivery_id"])
    op.alter_column(
        "queue_message",
        "exception_id",
        type_=sa.BigInteger(),
        existing_type=sa.String(length=64),
        postgresql_using="NULL",
    )
    op.create_foreign_key(
        op.f("fk_queue_message_exception_id_log_exception"),
        "queue_message",
        "log_exception",
        ["exception_id"],
        ["id"],
        ondelete="SET NULL",
    )
    op.add_column("queue_message", sa.Column("attempt", sa.Integer(), nullable=True))
    op.create_index("ix_queue_message_delivery_id", "queue_message", ["delivery_id"])
    op.add_column(
        "published_messages",
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True),
    )
    # The open deliveries' current attempts, PENDING, as a publish now writes them (a pulled
    # one has had its row since its pull).
    op.execute(
        """
        INSERT INTO published_messages (correlation_id, delivery_id, event_id, subscription_id,
                                        attempt, published_at, next_attempt_at, outcome)
        SELECT e.correlation_id, d.delivery_id, d.event_id, d.subscription_id, d.attempt,
               now(), d.next_attempt_at, 'PENDING'
          FROM delivery d JOIN event e USING (event_id)
         WHERE d.state IN ('PENDING', 'IN_PROCESS')
           AND NOT EXISTS (SELECT 1 FROM published_messages p
                            WHERE p.delivery_id = d.delivery_id AND p.attempt = d.attempt
                              AND p.outcome = 'PENDING')
        """
    )
    op.add_column("subscription", sa.Column("min_version", sa.Integer(), nullable=True))
    op.add_column("subscription", sa.Column("max_version", sa.Integer(), nullable=True))
    op.create_check_constraint(
        op.f("ck_subscription_versions"),
        "subscription",
        "(min_version IS NULL AND max_version IS NULL) OR (event_type_id IS NOT NULL"
        " AND COALESCE(min_version, 1) >= 1"
        " AND COALESCE(min_version, 1) <= COALESCE(max_version, 2147483647))",
    )


def downgrade() -> None:
    op.drop_constraint(op.f("ck_subscription_versions"), "subscription", type_="check")
    op.drop_column("subscription", "max_version")
    op.drop_column("subscription", "min_version")
    op.drop_column("published_messages", "next_attempt_at")
    op.drop_index("ix_queue_message_delivery_id", table_name="queue_message")
    op.drop_column("queue_message", "attempt")
    op.drop_constraint(
        op.f("fk_queue_message_exception_id_log_exception"), "queue_message", type_="foreignkey"
    )
    op.alter_column(
        "queue_message",
        "exception_id",
        type_=sa.String(length=64),
        existing_type=sa.BigInteger(),
        postgresql_using="CAST(exception_id AS varchar(64))",
    )
    op.drop_index("ix_log_exception_delivery_id", table_name="log_exception")
    op.drop_table("log_exception")
