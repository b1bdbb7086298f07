"""seed constraints: message.envelope NOT NULL, a failed response names its reason

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-06 16:00:00

The seed's message table has ``envelope`` NOT NULL ("the whole input request"): a message
stored without an envelope of its own now keeps the message as received (its JSON). Rows
stored before get one built from their columns (their payload as a JSON string). The seed's
response table: a failed response has its ``failed_reason``, and one without an envelope has
its reason (two CHECKs); older rows that break them get the reason "(not recorded)" and, with
neither, an empty envelope.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0026"
down_revision: str | None = "0025"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        """
        UPDATE message SET envelope = json_strip_nulls(json_build_object(
               'service', service_name, 'operation', operation_name,
               'source_system', source_system, 'correlation_id', correlation_id,
               'msg_timestamp', msg_timestamp, 'object_id', object_id,
               'entity_type', entity_type, 'process_id', process_id,
               'payload', payload))::text
         WHERE envelope IS NULL
        """
    )
    op.alter_column("message", "envelope", nullable=False)
    op.execute(
        "UPDATE response SET failed_reason = '(not recorded)' "
        "WHERE failed AND failed_reason IS NULL"
    )
    op.execute(
        "UPDATE response SET res_envelope = '' WHERE res_envelope IS NULL AND failed_reason IS NULL"
    )
    op.create_check_constraint(
        op.f("ck_response_failed_reason"), "response", "NOT failed OR failed_reason IS NOT NULL"
    )
    op.create_check_constraint(
        op.f("ck_response_envelope_or_reason"),
        "response",
        "res_envelope IS NOT NULL OR failed_reason IS NOT NULL",
    )


def downgrade() -> None:
    op.drop_constraint(op.f("ck_response_envelope_or_reason"), "response", type_="check")
    op.drop_constraint(op.f("ck_response_failed_reason"), "response", type_="check")
    op.alter_column("message", "envelope", nullable=True)
