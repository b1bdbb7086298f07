"""Tables and enums of orderly's PostgreSQL store (data only, no behaviour)."""

from orderly.models.api_key import ApiKey, ChannelAckSecret
from orderly.models.base import Base
from orderly.models.channel import Channel
from orderly.models.configuration import Configuration
from orderly.models.enums import (
    FINAL_STATES,
    BindingType,
    ConfigDataType,
    ExternalCallState,
    MessageState,
    NodeState,
)
from orderly.models.external_call import ExternalCall
from orderly.models.funnel_limit import FunnelLimit
from orderly.models.message import Message
from orderly.models.metric_total import MetricTotal
from orderly.models.node import Node
from orderly.models.pubsub import (
    Delivery,
    DeliveryState,
    Event,
    EventType,
    EventTypeVersion,
    LogException,
    Outcome,
    PublishedMessage,
    Publisher,
    QueueMessage,
    QueueState,
    Room,
    Status,
    Subscription,
    SubscriptionKind,
)
from orderly.models.report import ReportWatermark
from orderly.models.request_response import Request, Response
from orderly.models.schedule import Schedule
from orderly.models.signing_secret import SIGNING_KINDS, SigningSecret
from orderly.models.source_system import CONFIRMATION_OPERATION, SourceSystem

__all__ = [
    "CONFIRMATION_OPERATION",
    "FINAL_STATES",
    "SIGNING_KINDS",
    "ApiKey",
    "Base",
    "BindingType",
    "Channel",
    "ChannelAckSecret",
    "ConfigDataType",
    "Configuration",
    "Delivery",
    "DeliveryState",
    "Event",
    "EventType",
    "EventTypeVersion",
    "ExternalCall",
    "ExternalCallState",
    "FunnelLimit",
    "LogException",
    "Message",
    "MessageState",
    "MetricTotal",
    "Node",
    "NodeState",
    "Outcome",
    "PublishedMessage",
    "Publisher",
    "QueueMessage",
    "QueueState",
    "ReportWatermark",
    "Request",
    "Response",
    "Room",
    "Schedule",
    "SigningSecret",
    "SourceSystem",
    "Status",
    "Subscription",
    "SubscriptionKind",
]
