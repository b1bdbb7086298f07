"""The configuration table: typed values, mandatory, regex validation, start-up check."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, text

from orderly.worker import configuration
from orderly.worker.configuration import ConfigReader
from orderly.worker.core.errors import ConfigurationError


def test_defaults_are_seeded_and_read_typed(db: Engine) -> None:
    reader = ConfigReader(db, ttl_seconds=0)
    assert reader.get_int("asynch.countPartlyFailsBeforeFailed") == 3
    assert reader.get_int("asynch.partlyFailedIntervalSec") == 60
    assert reader.get_int("asynch.postponedIntervalSec") == 5
    assert reader.get_int("asynch.repairRepeatTimeSec") == 300
    configuration.check_consistency(db)


def test_current_value_wins_and_unset_restores_the_default(db: Engine) -> None:
    configuration.set_value(db, "asynch.repairRepeatTimeSec", "42")
    reader = ConfigReader(db, ttl_seconds=0)
    assert reader.get_int("asynch.repairRepeatTimeSec") == 42
    configuration.set_value(db, "asynch.repairRepeatTimeSec", None)
    assert reader.get_int("asynch.repairRepeatTimeSec") == 300


@pytest.mark.parametrize(
    ("code", "value", "needle"),
    [
        ("asynch.repairRepeatTimeSec", "0", "does not match"),
        ("asynch.repairRepeatTimeSec", "ten", "does not match"),
        ("asynch.countPartlyFailsBeforeFailed", "-1", "does not match"),
        ("no.such.item", "1", "no such configuration item"),
    ],
)
def test_invalid_values_are_refused_and_nothing_changes(
    db: Engine, code: str, value: str, needle: str
) -> None:
    with pytest.raises(ConfigurationError, match=needle):
        configuration.set_value(db, code, value)
    with db.connect() as conn:
        assert (
            conn.execute(
                text("SELECT count(*) FROM configuration WHERE current_value IS NOT NULL")
            ).scalar_one()
            == 0
        )


def test_a_value_must_convert_to_its_data_type(db: Engine) -> None:
    with db.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO configuration (code, category_code, default_value, data_type,"
                " mandatory) VALUES ('x.ratio', 'x', '0.5', 'FLOAT', true)"
            )
        )
    configuration.set_value(db, "x.ratio", "1.25")
    with pytest.raises(ConfigurationError, match="not a valid FLOAT"):
        configuration.set_value(db, "x.ratio", "lots")


def test_startup_check_names_every_inconsistent_row(db: Engine) -> None:
    with db.begin() as conn:
        conn.execute(
            text(
                "UPDATE configuration SET current_value = 'abc' "
                "WHERE code = 'asynch.partlyFailedIntervalSec'"
            )
        )
        conn.execute(
            text(
                "INSERT INTO configuration (code, category_code, data_type, mandatory) "
                "VALUES ('x.required', 'x', 'STRING', true)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO configuration (code, category_code, default_value, data_type, "
                "mandatory, validation) VALUES ('x.flag', 'x', 'maybe', 'BOOLEAN', false, NULL)"
            )
        )
    with pytest.raises(ConfigurationError) as info:
        configuration.startup_check(db)
    text_ = str(info.value)
    assert "asynch.partlyFailedIntervalSec: current value 'abc'" in text_
    assert "x.required: mandatory but has neither current nor default value" in text_
    assert "x.flag: default value 'maybe' is not a valid BOOLEAN" in text_


def test_operator_values_survive_the_seeding_of_defaults(db: Engine) -> None:
    configuration.set_value(db, "asynch.postponedIntervalSec", "9")
    configuration.ensure_defaults(db)
    assert ConfigReader(db, ttl_seconds=0).get_int("asynch.postponedIntervalSec") == 9
