from __future__ import annotations

import json
from collections import Counter

import pytest
from pydantic import ValidationError
from redis.crc import key_slot

from orderly.worker.settings import Settings

SEED_DEFAULTS = {
    "AURA_QUEUE_MANAGER_AWAITED_MESSAGE_TTL": ("awaited_message_ttl", 900_000),
    "AURA_QUEUE_MANAGER_AWAITED_MESSAGES_BY_TURN": ("awaited_messages_by_turn", 15),
    "AURA_QUEUE_MANAGER_AWAITED_MESSAGES_INTERVAL": ("awaited_messages_interval", 20_000),
    "AURA_QUEUE_MANAGER_AWAITED_RETRIES_FACTOR": ("awaited_retries_factor", 1),
    "AURA_QUEUE_MANAGER_AWAITED_TIME_WHEN_RETRIES_END": ("awaited_time_when_retries_end", 5000),
    "AURA_QUEUE_MANAGER_CHECK_QUEUE_INTERVAL": ("check_queue_interval", 1000),
    "AURA_QUEUE_MANAGER_CONCURRENT": ("concurrent", 25),
    "AURA_QUEUE_MANAGER_CONCURRENT_FACTOR": ("concurrent_factor", 2),
    "AURA_QUEUE_MANAGER_INTERVAL": ("interval", 200),
    "AURA_QUEUE_MANAGER_MAX_PENDING_TTL": ("max_pending_ttl", 30_000),
    "AURA_QUEUE_MANAGER_MAX_PENDING_TTL_MARGIN": ("max_pending_ttl_margin", 5000),
    "AURA_QUEUE_MANAGER_MAX_RETRIES": ("max_retries", 100),
    "AURA_QUEUE_MANAGER_MESSAGE_TTL": ("message_ttl", 10_000),
    "AURA_QUEUE_MANAGER_SENT_MESSAGE_TTL": ("sent_message_ttl", 5000),
    "AURA_QUEUE_MANAGER_DATABASE": ("queue_database", "REDIS"),
    "AURA_QUEUE_MANAGER_METRICS_PARTIAL_INTERVAL": ("metrics_partial_interval", 30_000),
}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in SEED_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.replace("QUEUE_MANAGER", "QUEUE_QUEUE_MANAGER"), raising=False)
    monkeypatch.chdir("/")  # no .env file
    return monkeypatch


def test_seed_variables_have_the_seed_defaults(clean_env: pytest.MonkeyPatch) -> None:
    settings = Settings()
    for attr, default in SEED_DEFAULTS.values():
        assert getattr(settings, attr) == default, attr


@pytest.mark.parametrize("name", sorted(SEED_DEFAULTS))
def test_each_seed_variable_is_read_under_its_name(
    clean_env: pytest.MonkeyPatch, name: str
) -> None:
    attr, default = SEED_DEFAULTS[name]
    value = "REDIS" if isinstance(default, str) else "7"
    clean_env.setenv(name, value)
    if name.endswith("CHECK_QUEUE_INTERVAL"):  # the idle wait is at least the busy one
        clean_env.setenv("AURA_QUEUE_MANAGER_INTERVAL", value)
    assert str(getattr(Settings(), attr)) in (value, "7.0")


def test_double_queue_spelling_of_the_seed_is_accepted(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("AURA_QUEUE_QUEUE_MANAGER_MESSAGE_TTL", "1234")
    assert Settings().message_ttl == 1234


def test_mongodb_is_refused_with_a_clear_message(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("AURA_QUEUE_MANAGER_DATABASE", "MONGODB")
    with pytest.raises(ValidationError, match="MONGODB is not supported"):
        Settings()


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("AURA_QUEUE_MANAGER_MESSAGE_TTL", "soon", "AURA_QUEUE_MANAGER_MESSAGE_TTL"),
        ("AURA_QUEUE_MANAGER_CONCURRENT", "0", "greater than or equal to 1"),
        ("ORDERLY_DATABASE_URL", "mysql://x/y", "postgresql"),
        ("ORDERLY_REDIS_URL", "http://x", "redis://"),
        ("ORDERLY_MAX_PAYLOAD_BYTES", "-5", "ORDERLY_MAX_PAYLOAD_BYTES"),
    ],
)
def test_bad_values_are_refused(
    clean_env: pytest.MonkeyPatch, name: str, value: str, needle: str
) -> None:
    clean_env.setenv(name, value)
    with pytest.raises(ValidationError) as info:
        Settings()
    assert needle in str(info.value)


def test_env_example_documents_every_variable() -> None:
    from pathlib import Path

    example = (Path(__file__).parent.parent / ".env.example").read_text()
    documented = {
        line.split("=", 1)[0].lstrip("# ").strip() for line in example.splitlines() if "=" in line
    }
    for field in Settings.model_fields.values():
        alias = field.validation_alias
        names = getattr(alias, "choices", [alias])
        assert str(names[0]) in documented, names[0]


def test_channels_are_read_as_json_and_checked(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("ORDERLY_CHANNELS", '{"whatsapp": "http://127.0.0.1:9000/in"}')
    assert Settings().channels == {"whatsapp": "http://127.0.0.1:9000/in"}
    clean_env.setenv("ORDERLY_CHANNELS", '{"whatsapp": "ftp://host/in"}')
    with pytest.raises(ValidationError, match="whatsapp"):
        Settings()
    # An origin is at most 100 characters, like a channel row's (and its ACK secret's).
    clean_env.setenv("ORDERLY_CHANNELS", json.dumps({"o" * 101: "http://127.0.0.1:9000/in"}))
    with pytest.raises(ValidationError, match="over 100 characters"):
        Settings()
    clean_env.setenv("ORDERLY_CHANNELS", "not json")
    with pytest.raises(ValidationError, match="ORDERLY_CHANNELS"):
        Settings()


def test_a_flower_password_with_a_comma_is_refused() -> None:
    # Flower splits its basic_auth option on commas: "pa,ss" would admit the password "pa".
    with pytest.raises(ValidationError, match="comma"):
        Settings(ORDERLY_FLOWER_PASSWORD="pa,ss")
    assert Settings(ORDERLY_FLOWER_PASSWORD="pa-ss").flower_password.get_secret_value() == "pa-ss"


def test_the_shard_count_spreads_over_a_cluster_by_default(clean_env: pytest.MonkeyPatch) -> None:
    assert Settings().bridge_keys.shards == 16  # one Redis: fewer sets to walk
    clean_env.setenv("ORDERLY_REDIS_CLUSTER", "true")
    clean_env.setenv("ORDERLY_REDIS_CLUSTER_NODES", "127.0.0.1:7000")
    keys = Settings().bridge_keys
    assert keys.shards == 64
    # Three primaries that split the slots as redis-cli --cluster create does (0-5460,
    # 5461-10922, 10923-16383) hold 21, 21 and 22 of the shards.
    slots = [key_slot(shard.base.encode()) for shard in keys.every_shard]
    thirds = Counter(0 if slot <= 5460 else 1 if slot <= 10922 else 2 for slot in slots)
    assert sorted(thirds.values()) == [21, 21, 22]
    clean_env.setenv("ORDERLY_REDIS_SHARDS", "8")
    assert Settings().bridge_keys.shards == 8  # said: what was said


def test_a_plain_postgresql_url_means_psycopg2() -> None:
    for given in ("postgresql://u@h:5432/d", "postgres://u@h:5432/d"):
        assert (
            Settings(ORDERLY_DATABASE_URL=given).database_url == "postgresql+psycopg2://u@h:5432/d"
        )
    kept = "postgresql+psycopg2://u@h/d"
    assert Settings(ORDERLY_DATABASE_URL=kept).database_url == kept
