"""Set-up rows (few, inserted normally): worker nodes, rooms, event types, subscriptions."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, text

from orderly.worker.pubsub import topic_matches
from tooling.generate.catalogue import _NODES, _ROOMS, _SUBSCRIPTIONS, _RoomSpec


@dataclass(frozen=True)
class _Sub:
    subscription_id: int
    kind: str
    delay_ms: int
    multiplier: float
    attempts: int
    order_key: str | None


@dataclass(frozen=True)
class _Room:
    room_id: int
    spec: _RoomSpec
    spec_expiration: int | None
    types: tuple[tuple[str, int, tuple[_Sub, ...]], ...]


def _ensure_nodes(conn: Connection, now: datetime) -> tuple[list[tuple[int, float]], int]:
    """The generated worker nodes (reused when present) and how many were added."""
    added = 0
    for code, _ in _NODES:
        added += conn.execute(
            text(
                "INSERT INTO node (code, name, description, state, last_heartbeat)"
                " VALUES (:code, :code, 'generated worker node', 'RUN', :now)"
                " ON CONFLICT DO NOTHING RETURNING node_id"
            ),
            {"code": code, "now": now},
        ).rowcount
    ids: dict[str, int] = {
        str(code): int(node_id)
        for code, node_id in conn.execute(
            text("SELECT code, node_id FROM node WHERE code = ANY(:codes)"),
            {"codes": [code for code, _ in _NODES]},
        ).all()
    }
    return [(int(ids[code]), weight) for code, weight in _NODES if code in ids], added


def _ensure_pubsub(conn: Connection) -> tuple[list[_Room], dict[str, int]]:
    """Rooms, event types (version 1) and subscriptions: reused by name, created if absent."""
    added = {"room": 0, "event_type": 0, "event_type_version": 0, "subscription": 0}

    def insert(table: str, sql: str, params: dict[str, Any]) -> None:
        added[table] += conn.execute(text(sql + " ON CONFLICT DO NOTHING"), params).rowcount

    for spec in _ROOMS:
        insert(
            "room",
            "INSERT INTO room (name, message_expiration_ms, delivery_delay_ms,"
            " delivery_delay_multiplier, delivery_attempts, status)"
            " VALUES (:name, :exp, :delay, :mult, :attempts, 'ACTIVE')",
            {
                "name": spec.name,
                "exp": spec.expiration_ms,
                "delay": spec.delay_ms,
                "mult": spec.multiplier,
                "attempts": spec.attempts,
            },
        )
        room_id = conn.execute(
            text("SELECT room_id FROM room WHERE name = :n"), {"n": spec.name}
        ).scalar_one()
        for name in spec.event_types:
            insert(
                "event_type",
                "INSERT INTO event_type (room_id, name) VALUES (:r, :n)",
                {"r": room_id, "n": name},
            )
            insert(
                "event_type_version",
                "INSERT INTO event_type_version (event_type_id, version, json_schema)"
                " SELECT event_type_id, 1, CAST(:schema AS jsonb) FROM event_type"
                " WHERE room_id = :r AND name = :n",
                {"r": room_id, "n": name, "schema": '{"type": "object"}'},
            )
    for sub in _SUBSCRIPTIONS:
        insert(
            "subscription",
            "INSERT INTO subscription (room_id, name, kind, push_url, handler, event_type_id,"
            " routing_key_pattern, delivery_attempts, timeout_ms, visibility_timeout_ms,"
            " order_key, status)"
            " SELECT r.room_id, :name, :kind, :url, :handler,"
            " (SELECT event_type_id FROM event_type WHERE room_id = r.room_id AND name = :et),"
            " :pattern, :attempts, 5000, 30000, :order_key, 'ACTIVE'"
            " FROM room r WHERE r.name = :room",
            {
                "room": sub.room,
                "name": sub.name,
                "kind": sub.kind,
                "url": f"https://{sub.name}.example.com/events" if sub.kind == "PUSH" else None,
                "handler": sub.name.replace("-", ".") if sub.kind == "HANDLER" else None,
                "et": sub.event_type,
                "pattern": sub.pattern,
                "attempts": sub.attempts,
                "order_key": sub.order_key,
            },
        )
    rooms: list[_Room] = []
    for spec in _ROOMS:
        room = conn.execute(
            text(
                "SELECT room_id, message_expiration_ms, delivery_delay_ms,"
                " delivery_delay_multiplier, delivery_attempts FROM room WHERE name = :n"
            ),
            {"n": spec.name},
        ).one()
        subs = conn.execute(
            text(
                "SELECT subscription_id, kind, event_type_id, routing_key_pattern,"
                " delivery_delay_ms, delivery_delay_multiplier, delivery_attempts, order_key"
                " FROM subscription WHERE room_id = :r AND status = 'ACTIVE'"
                " AND name = ANY(:names) ORDER BY subscription_id"
            ),
            {"r": room.room_id, "names": [s.name for s in _SUBSCRIPTIONS if s.room == spec.name]},
        ).all()
        types = []
        for etype_id, name in conn.execute(
            text(
                "SELECT event_type_id, name FROM event_type"
                " WHERE room_id = :r AND name = ANY(:names) ORDER BY name"
            ),
            {"r": room.room_id, "names": list(spec.event_types)},
        ).all():
            matched = tuple(
                _Sub(
                    s.subscription_id,
                    s.kind,
                    s.delivery_delay_ms or room.delivery_delay_ms,
                    s.delivery_delay_multiplier or room.delivery_delay_multiplier,
                    s.delivery_attempts
                    if s.delivery_attempts is not None
                    else room.delivery_attempts,
                    s.order_key,
                )
                for s in subs
                if (s.event_type_id is None or s.event_type_id == etype_id)
                and (s.routing_key_pattern is None or topic_matches(s.routing_key_pattern, name))
            )
            types.append((str(name), int(etype_id), matched))
        if types:
            rooms.append(
                _Room(room.room_id, spec, room.message_expiration_ms or None, tuple(types))
            )
    return rooms, added
