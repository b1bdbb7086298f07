"""The `orderly` command line, run as a real process."""

from __future__ import annotations

import json

import pytest
import redis
from sqlalchemy import Engine, text

from orderly.worker.celery import PROCESS_QUEUE
from orderly.worker.runtime import get_runtime
from tests.helpers import OrderlyCli, count_messages, message, queued


def test_submit_and_show(cli: OrderlyCli, db: Engine, redis_client: redis.Redis) -> None:
    done = cli(
        "submit",
        "--service",
        "test",
        "--operation",
        "script",
        "--correlation-id",
        "cli-1",
        "--source-system",
        "shell",
        "--payload",
        "{}",
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["state"] == "NEW" and answer["result"] == "accepted"
    assert queued(PROCESS_QUEUE) == 1
    shown = json.loads(cli("show", str(answer["msg_id"])).stdout)
    assert shown["correlation_id"] == "cli-1" and shown["source_system"] == "shell"
    again = cli(
        "submit",
        "--json",
        "-",
        stdin=json.dumps(message(0, correlation_id="cli-1", source_system="shell")),
    )
    assert json.loads(again.stdout)["result"] == "already known"
    assert count_messages(db) == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("submit", "--json", "{oops"), "malformed JSON"),
        (
            (
                "submit",
                "--service",
                "nosuch",
                "--operation",
                "x",
                "--correlation-id",
                "c",
                "--source-system",
                "s",
                "--payload",
                "p",
            ),
            "unknown service 'nosuch'",
        ),
        (("submit", "--service", "test", "--operation", "script"), "correlation_id: missing"),
        (("submit", "--json", json.dumps(message(1, msg_timestamp="noon"))), "msg_timestamp"),
    ],
)
def test_bad_submit_exits_2_with_the_problem_and_stores_nothing(
    cli: OrderlyCli, db: Engine, redis_client: redis.Redis, args: tuple[str, ...], needle: str
) -> None:
    done = cli(*args)
    assert done.returncode == 2
    assert needle in done.stderr
    assert count_messages(db) == 0
    assert queued(PROCESS_QUEUE) == 0


def test_config_set_get_and_refusal(cli: OrderlyCli, db: Engine) -> None:
    assert cli("config", "set", "asynch.postponedIntervalSec", "7").returncode == 0
    assert cli("config", "get", "asynch.postponedIntervalSec").stdout.strip() == "7"
    refused = cli("config", "set", "asynch.postponedIntervalSec", "soon")
    assert refused.returncode == 2 and "does not match" in refused.stderr
    assert "asynch.postponedIntervalSec" in cli("config", "list").stdout


def test_track_done_reports_tracked_work_by_its_xid(
    cli: OrderlyCli, db: Engine, redis_client: redis.Redis
) -> None:
    tracker = get_runtime().tracker
    track_id = tracker.register(4242)
    done = cli("track", "done", "4242")
    assert done.returncode == 0 and f"tracking id {track_id}, DONE" in done.stdout
    assert tracker.monitor_turn().done == 1
    again = cli("track", "done", "4242", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["outcome"] == "ALREADY"
    missing = cli("track", "done", "9999")
    assert missing.returncode == 2 and "no tracked message '9999'" in missing.stderr


def test_node_commands_move_the_node(cli: OrderlyCli, db: Engine) -> None:
    with db.begin() as conn:
        conn.execute(text("INSERT INTO node (code, name, state) VALUES ('n1', 'n1', 'RUN')"))
    for command, state in (
        ("drain", "HANDLES_EXISTING_MESSAGES"),
        ("stop", "STOPPED"),
        ("run", "RUN"),
    ):
        assert cli("node", command, "n1").returncode == 0
        with db.connect() as conn:
            got = conn.execute(text("SELECT state FROM node WHERE code='n1'")).scalar_one()
        assert got == state
    assert "n1" in cli("node", "list").stdout
    missing = cli("node", "stop", "ghost")
    assert missing.returncode == 2 and "node 'ghost' does not exist" in missing.stderr


def test_inconsistent_configuration_stops_start_up_with_a_clear_message(
    cli: OrderlyCli, db: Engine
) -> None:
    with db.begin() as conn:
        conn.execute(
            text(
                "UPDATE configuration SET current_value = 'x' "
                "WHERE code = 'asynch.repairRepeatTimeSec'"
            )
        )
    done = cli("migrate")
    assert done.returncode == 2
    assert "invalid configuration: asynch.repairRepeatTimeSec" in done.stderr
    assert "Traceback" not in done.stderr


def test_invalid_settings_are_reported_without_a_traceback(cli: OrderlyCli) -> None:
    done = cli("config", "list", env={"AURA_QUEUE_MANAGER_DATABASE": "MONGODB"})
    assert done.returncode == 2
    assert "MONGODB is not supported" in done.stderr
    assert "Traceback" not in done.stderr


def test_message_commands_list_cancel_redrive_and_source_systems(
    cli: OrderlyCli, db: Engine, redis_client: redis.Redis
) -> None:
    submitted = cli("submit", "--json", json.dumps(message(1, funnel_value="cust-1")))
    msg_id = json.loads(submitted.stdout)["msg_id"]
    missing_note = cli("message", "cancel", str(msg_id))
    assert missing_note.returncode != 0 and "--note" in missing_note.stderr
    done = cli("message", "cancel", str(msg_id), "--note", "duplicate order", "--by", "ann")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["state"] == "CANCEL"
    again = cli("message", "cancel", str(msg_id), "--note", "twice")
    assert again.returncode == 2 and "CANCEL" in again.stderr
    listed = cli("message", "list", "--state", "CANCEL", "--funnel", "cust-1")
    assert listed.returncode == 0 and f"\n│ {msg_id} " in listed.stdout
    bad_state = cli("message", "list", "--state", "DONE")
    assert bad_state.returncode == 2 and "unknown state" in bad_state.stderr
    back = cli("message", "redrive", str(msg_id), "--note", "it was not a duplicate")
    assert json.loads(back.stdout)["state"] == "IN_QUEUE"
    shown = json.loads(cli("message", "show", str(msg_id)).stdout)
    assert [a["action"] for a in shown["audit"]] == ["CANCEL", "REDRIVE"]
    bad_url = cli("source", "set", "crm", "--confirmation-url", "crm.example")
    assert bad_url.returncode == 2 and "confirmation_url" in bad_url.stderr
    assert cli("source", "set", "crm", "--confirmation-url", "http://127.0.0.1:9/c").returncode == 0
    assert "http://127.0.0.1:9/c" in cli("source", "list").stdout


def test_version_and_an_unreachable_service_in_one_line(cli: OrderlyCli, db: Engine) -> None:
    from importlib.metadata import version

    assert cli("--version").stdout.strip() == f"orderly {version('orderly')}"
    for args, env, setting in (
        (
            ("message", "list"),
            {"ORDERLY_DATABASE_URL": "postgresql://x@127.0.0.1:1/x"},
            "ORDERLY_DATABASE_URL",
        ),
        (
            ("conversation", "show", "c1"),
            {"ORDERLY_REDIS_URL": "redis://127.0.0.1:1/0"},
            "ORDERLY_REDIS_URL",
        ),
    ):
        done = cli(*args, env=env)
        assert done.returncode == 2, done.stdout + done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "cannot be reached" in lines[0] and setting in lines[0], lines
        assert "Traceback" not in done.stdout + done.stderr


def test_node_alive_answers_by_the_heartbeat(cli: OrderlyCli, db: Engine) -> None:
    from orderly.worker import nodes

    node_id = nodes.register_node(db, "hb-node")
    nodes.heartbeat(db, node_id)
    assert cli("node", "alive", "hb-node").returncode == 0
    with db.begin() as conn:
        conn.execute(
            text(
                "UPDATE node SET last_heartbeat = now() - interval '1 hour' WHERE code = 'hb-node'"
            )
        )
    stale = cli("node", "alive", "hb-node")
    assert stale.returncode == 1 and "no heartbeat since" in stale.stderr
    assert cli("node", "alive", "nobody").returncode == 1


def test_settings_check_reports_every_problem_at_once(cli: OrderlyCli, db: Engine) -> None:
    ok = cli("settings", "--check")
    assert ok.returncode == 0, ok.stderr
    down = cli(
        "settings",
        "--check",
        env={
            "ORDERLY_DATABASE_URL": "postgresql+psycopg2://x@127.0.0.1:1/x",
            "ORDERLY_REDIS_URL": "redis://127.0.0.1:1/0",
            "ORDERLY_HANDLER_MODULES": "no_such_module",
        },
    )
    assert down.returncode == 2
    named = [line.split(":", 1)[0] for line in down.stderr.strip().splitlines()]
    for setting in ("ORDERLY_DATABASE_URL", "ORDERLY_REDIS_URL", "ORDERLY_HANDLER_MODULES"):
        assert setting in named, down.stderr
    invalid = cli("settings", env={"ORDERLY_API_PORT": "99999", "ORDERLY_LOG_FORMAT": "xml"})
    assert invalid.returncode == 2
    assert "ORDERLY_API_PORT" in invalid.stderr and "ORDERLY_LOG_FORMAT" in invalid.stderr
    secrets = {
        "ORDERLY_TOKEN_SECRET": "s3cr3t-value",
        "ORDERLY_TRACK_REDIS_URL": "redis://:trackpw1@127.0.0.1:6379/3",
        "ORDERLY_HTTP_PROXY": "http://u:proxypw1@127.0.0.1:3128",
    }
    shown = json.loads(cli("settings", env=secrets).stdout)
    assert shown["ORDERLY_TOKEN_SECRET"] == "(set)"
    assert shown["ORDERLY_TRACK_REDIS_URL"] == "redis://:***@127.0.0.1:6379/3"
    assert shown["ORDERLY_TOKEN_TTL_MS"] > 0  # not a secret for holding the word TOKEN
    for value in ("s3cr3t-value", "trackpw1", "proxypw1"):
        assert value not in json.dumps(shown)


def test_lists_as_json_and_full_width_when_piped(cli: OrderlyCli, db: Engine) -> None:
    from orderly.worker import pubsub

    long_name = "a-room-with-a-name-longer-than-a-terminal-is-wide-" + "x" * 45
    pubsub.create_room(db, {"name": long_name})
    pubsub.create_subscription(db, long_name, {"name": "q", "kind": "PULL"})
    piped = cli("room", "list", env={"COLUMNS": ""})
    assert piped.returncode == 0, piped.stderr
    assert any(long_name in line for line in piped.stdout.splitlines())  # not cut, not wrapped
    for args in (
        ("room", "list"),
        ("subscription", "list", long_name),
        ("channel", "list"),
        ("config", "list"),
        ("dead-letter", "list"),
        ("node", "list"),
        ("source", "list"),
        ("schedule", "list"),
        ("message", "list"),
        ("funnel-limit", "list"),
    ):
        done = cli(*args, "--json")
        assert done.returncode == 0, (args, done.stderr)
        assert isinstance(json.loads(done.stdout), list), args
    rooms = json.loads(cli("room", "list", "--json").stdout)
    assert [r["name"] for r in rooms] == [long_name]
    subs = json.loads(cli("subscription", "list", long_name, "--json").stdout)
    assert [(s["name"], s["kind"], s["circuit"]) for s in subs] == [("q", "PULL", "CLOSED")]
