"""States of messages, external calls and nodes, with the named sets the mechanisms use."""

from __future__ import annotations

import enum

# A message's state: the API's clients read it too, so it lives with them.
from orderly.client.answers import MessageState as MessageState

# No further processing happens from these states.
FINAL_STATES = frozenset({MessageState.OK, MessageState.FAILED, MessageState.CANCEL})


class BindingType(enum.StrEnum):
    HARD = "HARD"  # the child's outcome decides the parent's
    SOFT = "SOFT"  # the child's outcome never affects the parent


class ExternalCallState(enum.StrEnum):
    PROCESSING = "PROCESSING"
    OK = "OK"
    FAILED = "FAILED"
    FAILED_END = "FAILED_END"


class NodeState(enum.StrEnum):
    RUN = "RUN"  # accepts new messages and processes
    HANDLES_EXISTING_MESSAGES = "HANDLES_EXISTING_MESSAGES"  # refuses new input, finishes work
    STOPPED = "STOPPED"  # refuses new input and processes nothing


class ConfigDataType(enum.StrEnum):
    STRING = "STRING"
    INT = "INT"
    FLOAT = "FLOAT"
    BOOLEAN = "BOOLEAN"
