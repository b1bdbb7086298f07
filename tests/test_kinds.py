"""Every test has exactly one kind (tests/kinds.py), and the kind its fixtures allow."""

from __future__ import annotations

import pytest

from tests import kinds
from tests.conftest import collected


@pytest.mark.parametrize(
    ("module", "fixtures", "marked", "expected"),
    [
        ("tests.test_retry", [], [], ["unit"]),
        ("tests.test_retry", ["tmp_path", "recorder"], ["parametrize"], ["unit"]),
        ("tests.test_intake", ["db", "intake"], [], ["integration"]),
        ("tests.test_tracking", ["redis_client"], [], ["integration"]),
        ("tests.test_e2e", ["procs", "db", "redis_client"], [], ["e2e"]),
        ("tests.test_pubsub", ["cli", "db"], [], ["e2e"]),
        ("tests.test_report_html", ["browser"], [], ["e2e"]),
        ("tests.test_cli", [], [], ["e2e"]),  # a module that starts processes its own way
        ("tests.test_report", [], ["unit"], ["unit"]),  # its own marker wins
        ("tests.test_sink", [], ["e2e", "unit"], ["e2e", "unit"]),
    ],
)
def test_the_kind_follows_from_fixtures_module_and_markers(
    module: str, fixtures: list[str], marked: list[str], expected: list[str]
) -> None:
    assert kinds.kinds_of(module, fixtures, marked) == expected


def test_every_collected_test_has_exactly_one_kind_and_keeps_to_it(
    request: pytest.FixtureRequest,
) -> None:
    """Over everything this run collected (before ``-m`` chose among them)."""
    items = collected(request.config)
    assert request.node in items
    wrong = []
    for item in items:
        found = [m.name for m in item.iter_markers() if m.name in kinds.KINDS]
        if len(found) != 1:
            wrong.append(f"{item.nodeid}: kinds {found}")
            continue
        beyond = kinds.contradictions(found[0], getattr(item, "fixturenames", ()))
        if beyond:
            wrong.append(f"{item.nodeid}: {found[0]} but uses {sorted(beyond)}")
    assert wrong == []
