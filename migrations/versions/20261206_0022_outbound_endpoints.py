"""outbound endpoints: attempts as sends, circuits, pacing

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-06 09:00:00

``delivery_attempts`` of rooms and subscriptions now counts sends, as the backoff seed words
it ("maximum number of delivery attempts"; 0: no redelivery, like 1): a stored value above 0
is raised by one, so that every room and subscription keeps the number of sends it had
(``delivery_attempts: 2`` gave three sends and is stored as 3). Downgrading lowers it again.

A PUSH subscription is an endpoint with a health and a pace: ``failures`` in a row and
``failing_since`` (the first of them), ``probe_at`` (its circuit is open: the one probe's
time), ``disabled_at`` and ``disabled_reason`` (failing too long: no sends until an operator
enables it), ``rate_per_s``/``burst`` (a start rate, the one token-bucket limiter) and
``max_in_flight`` (sends at once).

A pulled delivery's visibility deadline is its ``scheduled_at`` from now on (a receipt's
holder may move it): the deliveries pulled before the upgrade get theirs from their pull.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        "UPDATE room SET delivery_attempts = delivery_attempts + 1 WHERE delivery_attempts > 0"
    )
    op.execute(
        "UPDATE subscription SET delivery_attempts = delivery_attempts + 1"
        " WHERE delivery_attempts > 0"
    )
    with op.batch_alter_table("subscription") as table:
        table.add_column(sa.Column("rate_per_s", sa.Float(), nullable=True))
        table.add_column(sa.Column("burst", sa.Integer(), nullable=True))
        table.add_column(sa.Column("max_in_flight", sa.Integer(), nullable=True))
        table.add_column(sa.Column("failures", sa.Integer(), server_default="0", nullable=False))
        table.add_column(sa.Column("failing_since", sa.DateTime(timezone=True), nullable=True))
        table.add_column(sa.Column("probe_at", sa.DateTime(timezone=True), nullable=True))
        table.add_column(sa.Column("disabled_at", sa.DateTime(timezone=True), nullable=True))
        table.add_column(sa.Column("disabled_reason", sa.Text(), nullable=True))
        table.create_check_constraint(
            "pace",
            "(rate_per_s IS NULL) = (burst IS NULL) AND (rate_per_s IS NULL OR"
            " (rate_per_s > 0 AND burst >= 1)) AND (max_in_flight IS NULL OR max_in_flight >= 1)",
        )

    # An ordered key's deliveries go in publish order (event_id): a backfilled delivery of an
    # older event comes before the later ones, whatever its delivery_id.
    op.drop_index("ix_delivery_order", table_name="delivery")
    op.create_index(
        "ix_delivery_order",
        "delivery",
        ["subscription_id", "order_value", "event_id"],
        postgresql_where=sa.text("order_value IS NOT NULL AND state IN ('PENDING', 'IN_PROCESS')"),
    )
    op.create_index("ix_event_room_published", "event", ["room_id", "published_at", "event_id"])
    # A pulled delivery's visibility deadline is now its scheduled_at: the ones pulled before
    # keep the deadline their pull gave them.
    op.execute(
        "UPDATE delivery d SET scheduled_at = d.claimed_at"
        " + make_interval(secs => s.visibility_timeout_ms / 1000.0)"
        " FROM subscription s WHERE s.subscription_id = d.subscription_id"
        " AND d.pull AND d.state = 'IN_PROCESS' AND d.claimed_at IS NOT NULL"
    )


def downgrade() -> None:
    op.drop_index("ix_event_room_published", table_name="event")
    op.drop_index("ix_delivery_order", table_name="delivery")
    op.create_index(
        "ix_delivery_order",
        "delivery",
        ["subscription_id", "order_value", "delivery_id"],
        postgresql_where=sa.text("order_value IS NOT NULL AND state IN ('PENDING', 'IN_PROCESS')"),
    )
    with op.batch_alter_table("subscription") as table:
        table.drop_constraint(op.f("ck_subscription_pace"), type_="check")
        for column in (
            "disabled_reason",
            "disabled_at",
            "probe_at",
            "failing_since",
            "failures",
            "max_in_flight",
            "burst",
            "rate_per_s",
        ):
            table.drop_column(column)
    op.execute(
        "UPDATE room SET delivery_attempts = delivery_attempts - 1 WHERE delivery_attempts > 0"
    )
    op.execute(
        "UPDATE subscription SET delivery_attempts = delivery_attempts - 1"
        " WHERE delivery_attempts > 0"
    )
