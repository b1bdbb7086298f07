"""message store

Revision ID: 0001
Revises:
Create Date: 2026-11-22 18:50:17.247387
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "configuration",
        sa.Column("code", sa.String(length=255), nullable=False),
        sa.Column("category_code", sa.String(length=100), nullable=False),
        sa.Column("current_value", sa.String(length=1000), nullable=True),
        sa.Column("default_value", sa.String(length=1000), nullable=True),
        sa.Column(
            "data_type",
            sa.Enum(
                "STRING",
                "INT",
                "FLOAT",
                "BOOLEAN",
                name="config_data_type",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("mandatory", sa.Boolean(), server_default="true", nullable=False),
        sa.Column("validation", sa.String(length=1000), nullable=True),
        sa.Column("description", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("code", name=op.f("pk_configuration")),
    )
    op.create_table(
        "node",
        sa.Column("node_id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("code", sa.String(length=100), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column(
            "state",
            sa.Enum(
                "RUN",
                "HANDLES_EXISTING_MESSAGES",
                "STOPPED",
                name="node_state",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("last_heartbeat", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("node_id", name=op.f("pk_node")),
        sa.UniqueConstraint("code", name=op.f("uq_node_code")),
        sa.UniqueConstraint("name", name=op.f("uq_node_name")),
    )
    op.create_table(
        "message",
        sa.Column("msg_id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("msg_timestamp", sa.DateTime(timezone=True), nullable=False),
        sa.Column("receive_timestamp", sa.DateTime(timezone=True), nullable=False),
        sa.Column("service_name", sa.String(length=100), nullable=False),
        sa.Column("operation_name", sa.String(length=100), nullable=False),
        sa.Column("object_id", sa.String(length=100), nullable=True),
        sa.Column("entity_type", sa.String(length=100), nullable=True),
        sa.Column("correlation_id", sa.String(length=100), nullable=False),
        sa.Column("process_id", sa.String(length=100), nullable=True),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("envelope", sa.Text(), nullable=True),
        sa.Column("source_system", sa.String(length=100), nullable=False),
        sa.Column(
            "state",
            sa.Enum(
                "NEW",
                "IN_QUEUE",
                "PROCESSING",
                "OK",
                "PARTLY_FAILED",
                "FAILED",
                "WAITING",
                "WAITING_FOR_RES",
                "CANCEL",
                "POSTPONED",
                name="message_state",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("failed_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("failed_error_code", sa.String(length=64), nullable=True),
        sa.Column("failed_desc", sa.Text(), nullable=True),
        sa.Column("last_process_timestamp", sa.DateTime(timezone=True), nullable=True),
        sa.Column("start_in_queue_timestamp", sa.DateTime(timezone=True), nullable=True),
        sa.Column("custom_data", sa.Text(), nullable=True),
        sa.Column("parent_msg_id", sa.BigInteger(), nullable=True),
        sa.Column(
            "parent_binding_type",
            sa.Enum(
                "HARD",
                "SOFT",
                name="binding_type",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=True,
        ),
        sa.Column("funnel_value", sa.String(length=255), nullable=True),
        sa.Column("funnel_component_id", sa.String(length=255), nullable=True),
        sa.Column("guaranteed_order", sa.Boolean(), server_default="false", nullable=False),
        sa.Column("exclude_failed_state", sa.Boolean(), server_default="false", nullable=False),
        sa.Column("node_id", sa.BigInteger(), nullable=False),
        sa.Column("processing_pid", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["node_id"], ["node.node_id"], name=op.f("fk_message_node_id_node")
        ),
        sa.ForeignKeyConstraint(
            ["parent_msg_id"],
            ["message.msg_id"],
            name=op.f("fk_message_parent_msg_id_message"),
            ondelete="RESTRICT",
        ),
        sa.PrimaryKeyConstraint("msg_id", name=op.f("pk_message")),
        sa.UniqueConstraint(
            "correlation_id", "source_system", name=op.f("uq_message_correlation_id_source_system")
        ),
    )
    op.create_index(
        "ix_message_funnel",
        "message",
        ["funnel_value", "msg_timestamp"],
        unique=False,
        postgresql_where=sa.text("funnel_value IS NOT NULL"),
    )
    op.create_index(
        "ix_message_object",
        "message",
        ["object_id", "entity_type"],
        unique=False,
        postgresql_where=sa.text("object_id IS NOT NULL"),
    )
    op.create_index(
        "ix_message_parent",
        "message",
        ["parent_msg_id"],
        unique=False,
        postgresql_where=sa.text("parent_msg_id IS NOT NULL"),
    )
    op.create_index(
        "ix_message_pending",
        "message",
        ["state", "last_process_timestamp"],
        unique=False,
        postgresql_where=sa.text("state NOT IN ('OK', 'FAILED', 'CANCEL')"),
    )
    op.create_table(
        "external_call",
        sa.Column("call_id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("msg_id", sa.BigInteger(), nullable=False),
        sa.Column("operation_name", sa.String(length=100), nullable=False),
        sa.Column(
            "state",
            sa.Enum(
                "PROCESSING",
                "OK",
                "FAILED",
                "FAILED_END",
                name="external_call_state",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("entity_id", sa.String(length=255), nullable=False),
        sa.Column("msg_timestamp", sa.DateTime(timezone=True), nullable=False),
        sa.Column("creation_timestamp", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_update_timestamp", sa.DateTime(timezone=True), nullable=False),
        sa.Column("failed_count", sa.Integer(), server_default="0", nullable=False),
        sa.ForeignKeyConstraint(
            ["msg_id"], ["message.msg_id"], name=op.f("fk_external_call_msg_id_message")
        ),
        sa.PrimaryKeyConstraint("call_id", name=op.f("pk_external_call")),
        sa.UniqueConstraint(
            "operation_name", "entity_id", name=op.f("uq_external_call_operation_name_entity_id")
        ),
    )
    op.create_index(op.f("ix_external_call_msg_id"), "external_call", ["msg_id"], unique=False)
    op.create_index(op.f("ix_external_call_state"), "external_call", ["state"], unique=False)
    op.create_table(
        "request",
        sa.Column("req_id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("msg_id", sa.BigInteger(), nullable=True),
        sa.Column("res_join_id", sa.String(length=255), nullable=True),
        sa.Column("uri", sa.String(length=500), nullable=False),
        sa.Column("req_envelope", sa.Text(), nullable=False),
        sa.Column("req_timestamp", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["msg_id"], ["message.msg_id"], name=op.f("fk_request_msg_id_message")
        ),
        sa.PrimaryKeyConstraint("req_id", name=op.f("pk_request")),
        sa.UniqueConstraint("uri", "res_join_id", name=op.f("uq_request_uri_res_join_id")),
    )
    op.create_index(op.f("ix_request_msg_id"), "request", ["msg_id"], unique=False)
    op.create_table(
        "response",
        sa.Column("res_id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("req_id", sa.BigInteger(), nullable=True),
        sa.Column("res_envelope", sa.Text(), nullable=True),
        sa.Column("failed_reason", sa.Text(), nullable=True),
        sa.Column("res_timestamp", sa.DateTime(timezone=True), nullable=False),
        sa.Column("failed", sa.Boolean(), server_default="false", nullable=False),
        sa.Column("msg_id", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(
            ["msg_id"], ["message.msg_id"], name=op.f("fk_response_msg_id_message")
        ),
        sa.ForeignKeyConstraint(
            ["req_id"], ["request.req_id"], name=op.f("fk_response_req_id_request")
        ),
        sa.PrimaryKeyConstraint("res_id", name=op.f("pk_response")),
    )
    op.create_index(op.f("ix_response_msg_id"), "response", ["msg_id"], unique=False)
    op.create_index(op.f("ix_response_req_id"), "response", ["req_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_response_req_id"), table_name="response")
    op.drop_index(op.f("ix_response_msg_id"), table_name="response")
    op.drop_table("response")
    op.drop_index(op.f("ix_request_msg_id"), table_name="request")
    op.drop_table("request")
    op.drop_index(op.f("ix_external_call_state"), table_name="external_call")
    op.drop_index(op.f("ix_external_call_msg_id"), table_name="external_call")
    op.drop_table("external_call")
    op.drop_index(
        "ix_message_pending",
        table_name="message",
        postgresql_where=sa.text("state NOT IN ('OK', 'FAILED', 'CANCEL')"),
    )
    op.drop_index(
        "ix_message_parent",
        table_name="message",
        postgresql_where=sa.text("parent_msg_id IS NOT NULL"),
    )
    op.drop_index(
        "ix_message_object", table_name="message", postgresql_where=sa.text("object_id IS NOT NULL")
    )
    op.drop_index(
        "ix_message_funnel",
        table_name="message",
        postgresql_where=sa.text("funnel_value IS NOT NULL"),
    )
    op.drop_table("message")
    op.drop_table("node")
    op.drop_table("configuration")
