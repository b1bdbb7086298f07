"""Tables and enums of orderly's PostgreSQL store (data only, no behaviour)."""

from models.api_key import ApiKey, ChannelAckSecret
from models.base import Base
from models.channel import Channel
from models.configuration import Configuration
from models.enums import (
    FINAL_STATES,
    BindingType,
    ConfigDataType,
    ExternalCallState,
    MessageState,
    NodeState,
)
from models.external_call import ExternalCall
from models.message import Message
from models.node import Node
from models.pubsub import (
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
from models.report import ReportWatermark
from models.request_response import Request, Response
from models.source_system import CONFIRMATION_OPERATION, SourceSystem

__all__ = [
    "CONFIRMATION_OPERATION",
    "FINAL_STATES",
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
    "LogException",
    "Message",
    "MessageState",
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
    "SourceSystem",
    "Status",
    "Subscription",
    "SubscriptionKind",
]
