"""Client sink: a real HTTP server standing in for a chat client's channel (or a PUSH
subscriber). It records every delivery orderly makes to it and answers with configurable,
reproducible behaviour.

- ``behaviour``: how it answers (probabilities, rules, seed);
- ``state``: what it records, and the ACKs it sends back;
- ``server``: the HTTP server;
- ``client``: ``Sink`` (served from a thread, for tests and benchmarks) and ``main``.
"""

from tooling.sink.behaviour import Behaviour, BehaviourError, Rule
from tooling.sink.client import Sink, main

__all__ = ["Behaviour", "BehaviourError", "Rule", "Sink", "main"]
