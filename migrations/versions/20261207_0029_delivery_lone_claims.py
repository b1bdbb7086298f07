"""a worker's death counts against the delivery it was sending: delivery.lone_claim, isolate

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-07 01:40:00

As 0028 did for messages. ``lone_claim``: the batch that holds (or last held) the delivery
claimed it alone. A worker that dies holding a batch of several cannot say which delivery it
was sending, so the death counts against none of them (towards ORDERLY_WORKER_LOST_LIMIT):
they come back with ``isolate`` set, and each is claimed alone from then on, where a death
does count. ``lone_claim`` is true for the rows there are (a claim made before this counted
its death, as it still does alone); adding both rewrites nothing (constant defaults).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0029"
down_revision: str | None = "0028"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "delivery",
        sa.Column("lone_claim", sa.Boolean(), nullable=False, server_default=sa.true()),
    )
    op.add_column(
        "delivery",
        sa.Column("isolate", sa.Boolean(), nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    for column in ("isolate", "lone_claim"):
        op.drop_column("delivery", column)
