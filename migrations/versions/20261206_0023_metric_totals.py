"""metric totals: counters and histograms that only grow

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-06 12:00:00

``metric_total``: the running total of each series of GET /metrics' counters and histograms,
added to by every process (worker/totals.py); a purge leaves it alone.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "metric_total",
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("labels", sa.Text(), nullable=False),
        sa.Column("value", sa.Double(), server_default="0", nullable=False),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("name", "labels", name=op.f("pk_metric_total")),
    )


def downgrade() -> None:
    op.drop_table("metric_total")
