"""States of messages, external calls and nodes, with the named sets the mechanisms use."""

from __future__ import annotations

import enum


class MessageState(enum.StrEnum):
    NEW = "NEW"  # accepted and stored; a processing task has been (or is being) enqueued
    IN_QUEUE = "IN_QUEUE"  # handed (again) to the broker by the pool, repair or an operator
    PROCESSING = "PROCESSING"  # claimed by a worker under a row lock
    OK = "OK"  # processed successfully
    PARTLY_FAILED = "PARTLY_FAILED"  # last try failed; the pool tries again
    FAILED = "FAILED"  # finally failed, no further processing
    WAITING = "WAITING"  # a parent waiting for its children
    WAITING_FOR_RES = "WAITING_FOR_RES"  # waiting for a response from an external system
    CANCEL = "CANCEL"  # cancelled by an operator or an external system
    POSTPONED = "POSTPONED"  # held back by a funnel / guaranteed order


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
