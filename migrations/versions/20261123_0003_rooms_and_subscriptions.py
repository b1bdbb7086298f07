"""rooms and subscriptions: publish/subscribe delivery, published_messages, queue log

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 08:11:59.925113
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "room",
        sa.Column("room_id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("message_expiration_ms", sa.BigInteger(), nullable=True),
        sa.Column("delivery_delay_ms", sa.Integer(), nullable=False),
        sa.Column("delivery_delay_multiplier", sa.Float(), nullable=False),
        sa.Column("delivery_attempts", sa.Integer(), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "ACTIVE",
                "PAUSED",
                name="room_status",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("delivery_attempts >= 0", name=op.f("ck_room_attempts")),
        sa.CheckConstraint("delivery_delay_ms >= 1", name=op.f("ck_room_delay")),
        sa.CheckConstraint("delivery_delay_multiplier >= 1.01", name=op.f("ck_room_multiplier")),
        sa.CheckConstraint(
            "message_expiration_ms IS NULL OR message_expiration_ms >= 0", name=op.f("ck_room_exp")
        ),
        sa.PrimaryKeyConstraint("room_id", name=op.f("pk_room")),
        sa.UniqueConstraint("name", name=op.f("uq_room_name")),
    )
    op.create_table(
        "event_type",
        sa.Column("event_type_id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("room_id", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["room_id"], ["room.room_id"], name=op.f("fk_event_type_room_id_room")
        ),
        sa.PrimaryKeyConstraint("event_type_id", name=op.f("pk_event_type")),
        sa.UniqueConstraint("room_id", "name", name=op.f("uq_event_type_room_id_name")),
    )
    op.create_table(
        "publisher",
        sa.Column("publisher_id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("room_id", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.ForeignKeyConstraint(
            ["room_id"], ["room.room_id"], name=op.f("fk_publisher_room_id_room")
        ),
        sa.PrimaryKeyConstraint("publisher_id", name=op.f("pk_publisher")),
        sa.UniqueConstraint("room_id", "name", name=op.f("uq_publisher_room_id_name")),
    )
    op.create_table(
        "event",
        sa.Column("event_id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("correlation_id", sa.String(length=64), nullable=False),
        sa.Column("room_id", sa.BigInteger(), nullable=False),
        sa.Column("event_type_id", sa.BigInteger(), nullable=True),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("routing_key", sa.String(length=255), nullable=False),
        sa.Column("payload", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("publisher_id", sa.BigInteger(), nullable=True),
        sa.Column("user_id", sa.String(length=100), nullable=True),
        sa.Column("impersonator_id", sa.String(length=100), nullable=True),
        sa.Column("token", sa.Text(), nullable=True),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deliver_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("unroutable", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(
            ["event_type_id"],
            ["event_type.event_type_id"],
            name=op.f("fk_event_event_type_id_event_type"),
        ),
        sa.ForeignKeyConstraint(
            ["publisher_id"],
            ["publisher.publisher_id"],
            name=op.f("fk_event_publisher_id_publisher"),
        ),
        sa.ForeignKeyConstraint(["room_id"], ["room.room_id"], name=op.f("fk_event_room_id_room")),
        sa.PrimaryKeyConstraint("event_id", name=op.f("pk_event")),
        sa.UniqueConstraint("correlation_id", name=op.f("uq_event_correlation_id")),
    )
    op.create_table(
        "event_type_version",
        sa.Column("event_type_id", sa.BigInteger(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("json_schema", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["event_type_id"],
            ["event_type.event_type_id"],
            name=op.f("fk_event_type_version_event_type_id_event_type"),
        ),
        sa.PrimaryKeyConstraint("event_type_id", "version", name=op.f("pk_event_type_version")),
    )
    op.create_table(
        "subscription",
        sa.Column("subscription_id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("room_id", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column(
            "kind",
            sa.Enum(
                "PUSH",
                "PULL",
                "HANDLER",
                name="subscription_kind",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("push_url", sa.String(length=1000), nullable=True),
        sa.Column("handler", sa.String(length=200), nullable=True),
        sa.Column("event_type_id", sa.BigInteger(), nullable=True),
        sa.Column("routing_key_pattern", sa.String(length=255), nullable=True),
        sa.Column("delivery_delay_ms", sa.Integer(), nullable=True),
        sa.Column("delivery_delay_multiplier", sa.Float(), nullable=True),
        sa.Column("delivery_attempts", sa.Integer(), nullable=True),
        sa.Column("timeout_ms", sa.Integer(), nullable=False),
        sa.Column("visibility_timeout_ms", sa.Integer(), nullable=False),
        sa.Column("order_key", sa.String(length=200), nullable=True),
        sa.Column(
            "status",
            sa.Enum(
                "ACTIVE",
                "PAUSED",
                name="subscription_status",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "(kind = 'PUSH') = (push_url IS NOT NULL)"
            " AND (kind = 'HANDLER') = (handler IS NOT NULL)",
            name=op.f("ck_subscription_destination"),
        ),
        sa.CheckConstraint(
            "delivery_attempts IS NULL OR delivery_attempts >= 0",
            name=op.f("ck_subscription_attempts"),
        ),
        sa.CheckConstraint(
            "delivery_delay_ms IS NULL OR delivery_delay_ms >= 1",
            name=op.f("ck_subscription_delay"),
        ),
        sa.CheckConstraint(
            "delivery_delay_multiplier IS NULL OR delivery_delay_multiplier >= 1.01",
            name=op.f("ck_subscription_multiplier"),
        ),
        sa.ForeignKeyConstraint(
            ["event_type_id"],
            ["event_type.event_type_id"],
            name=op.f("fk_subscription_event_type_id_event_type"),
        ),
        sa.ForeignKeyConstraint(
            ["room_id"], ["room.room_id"], name=op.f("fk_subscription_room_id_room")
        ),
        sa.PrimaryKeyConstraint("subscription_id", name=op.f("pk_subscription")),
        sa.UniqueConstraint("room_id", "name", name=op.f("uq_subscription_room_id_name")),
    )
    op.create_table(
        "delivery",
        sa.Column("delivery_id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("event_id", sa.BigInteger(), nullable=False),
        sa.Column("subscription_id", sa.BigInteger(), nullable=False),
        sa.Column(
            "state",
            sa.Enum(
                "PENDING",
                "IN_PROCESS",
                "DELIVERED",
                "DEAD",
                "EXPIRED",
                name="delivery_state",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("pull", sa.Boolean(), nullable=False),
        sa.Column("order_value", sa.String(length=255), nullable=True),
        sa.Column("receipt", sa.String(length=64), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("scheduled_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("claim", sa.String(length=32), nullable=True),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["event_id"], ["event.event_id"], name=op.f("fk_delivery_event_id_event")
        ),
        sa.ForeignKeyConstraint(
            ["subscription_id"],
            ["subscription.subscription_id"],
            name=op.f("fk_delivery_subscription_id_subscription"),
        ),
        sa.PrimaryKeyConstraint("delivery_id", name=op.f("pk_delivery")),
        sa.UniqueConstraint(
            "event_id", "subscription_id", name=op.f("uq_delivery_event_id_subscription_id")
        ),
    )
    op.create_index(
        "ix_delivery_claimed",
        "delivery",
        ["claimed_at"],
        unique=False,
        postgresql_where=sa.text("state = 'IN_PROCESS'"),
    )
    op.create_index(
        "ix_delivery_due",
        "delivery",
        ["scheduled_at"],
        unique=False,
        postgresql_where=sa.text("state = 'PENDING' AND NOT pull"),
    )
    op.create_index(
        "ix_delivery_order",
        "delivery",
        ["subscription_id", "order_value", "delivery_id"],
        unique=False,
        postgresql_where=sa.text("order_value IS NOT NULL AND state IN ('PENDING', 'IN_PROCESS')"),
    )
    op.create_index(
        "ix_delivery_pull",
        "delivery",
        ["subscription_id", "delivery_id"],
        unique=False,
        postgresql_where=sa.text("pull AND state = 'PENDING'"),
    )
    op.create_index(
        "ix_delivery_subscription_state", "delivery", ["subscription_id", "state"], unique=False
    )
    op.create_table(
        "published_messages",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("correlation_id", sa.String(length=64), nullable=False),
        sa.Column("delivery_id", sa.BigInteger(), nullable=True),
        sa.Column("event_id", sa.BigInteger(), nullable=False),
        sa.Column("subscription_id", sa.BigInteger(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "outcome",
            sa.Enum(
                "PENDING",
                "DELIVERED",
                "FAILED",
                "DEAD",
                "EXPIRED",
                name="publish_outcome",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["delivery_id"],
            ["delivery.delivery_id"],
            name=op.f("fk_published_messages_delivery_id_delivery"),
        ),
        sa.ForeignKeyConstraint(
            ["event_id"], ["event.event_id"], name=op.f("fk_published_messages_event_id_event")
        ),
        sa.ForeignKeyConstraint(
            ["subscription_id"],
            ["subscription.subscription_id"],
            name=op.f("fk_published_messages_subscription_id_subscription"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_published_messages")),
    )
    op.create_index(
        "ix_published_messages_delivery", "published_messages", ["delivery_id"], unique=False
    )
    op.create_table(
        "queue_message",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("delivery_id", sa.BigInteger(), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("routing_key", sa.String(length=255), nullable=False),
        sa.Column("scheduled_start_time", sa.DateTime(timezone=True), nullable=True),
        sa.Column("start_time", sa.DateTime(timezone=True), nullable=True),
        sa.Column("end_time", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "state",
            sa.Enum(
                "Pending",
                "In process",
                "Completed",
                "Error",
                name="queue_state",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("exception_id", sa.String(length=64), nullable=True),
        sa.Column("memory_used", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(
            ["delivery_id"],
            ["delivery.delivery_id"],
            name=op.f("fk_queue_message_delivery_id_delivery"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_queue_message")),
    )


def downgrade() -> None:
    op.drop_table("queue_message")
    op.drop_index("ix_published_messages_delivery", table_name="published_messages")
    op.drop_table("published_messages")
    op.drop_index("ix_delivery_subscription_state", table_name="delivery")
    op.drop_index(
        "ix_delivery_pull",
        table_name="delivery",
        postgresql_where=sa.text("pull AND state = 'PENDING'"),
    )
    op.drop_index(
        "ix_delivery_order",
        table_name="delivery",
        postgresql_where=sa.text("order_value IS NOT NULL AND state IN ('PENDING', 'IN_PROCESS')"),
    )
    op.drop_index(
        "ix_delivery_due",
        table_name="delivery",
        postgresql_where=sa.text("state = 'PENDING' AND NOT pull"),
    )
    op.drop_index(
        "ix_delivery_claimed",
        table_name="delivery",
        postgresql_where=sa.text("state = 'IN_PROCESS'"),
    )
    op.drop_table("delivery")
    op.drop_table("subscription")
    op.drop_table("event_type_version")
    op.drop_table("event")
    op.drop_table("publisher")
    op.drop_table("event_type")
    op.drop_table("room")
