"""One beat runs the agents: the leadership lease against the real Redis, and two beats of two
nodes, one of which runs the agents until it is killed."""

from __future__ import annotations

import signal
import time

import pytest
import redis

from orderly.worker.core.lease import Leadership
from orderly.worker.core.scripts import Scripts
from tests.helpers import ManualClock, wait_until
from tests.stack import Stack
from tooling.processes import wait_for_log

KEY = "test:leader"


def test_one_leads_until_it_resigns(redis_client: redis.Redis) -> None:
    scripts = Scripts(redis_client)
    clock = ManualClock()
    first, second = Leadership(scripts, KEY), Leadership(scripts, KEY, clock=clock)
    assert first.leads() and not second.leads()
    clock.advance(1.0)
    assert first.leads() and not second.leads()  # still, asked again
    first.resign()
    assert not second.leads()  # it asked a moment ago: it asks again a third of a lease later
    clock.advance(1.0)
    assert second.leads() and not first.leads()


def test_a_leader_that_stops_asking_is_followed_when_its_lease_runs_out(
    redis_client: redis.Redis,
) -> None:
    scripts = Scripts(redis_client)
    first, second = Leadership(scripts, KEY, hold_ms=300), Leadership(scripts, KEY, hold_ms=300)
    assert first.leads() and not second.leads()
    started = time.monotonic()
    wait_until(second.leads, 10, "the second to lead")
    assert time.monotonic() - started >= 0.2  # not before the first's lease ran out


def test_a_leader_asks_redis_once_half_its_lease_is_gone(redis_client: redis.Redis) -> None:
    clock = ManualClock()
    leader = Leadership(Scripts(redis_client), KEY, hold_ms=3_000, clock=clock)
    assert leader.leads()
    redis_client.delete(KEY)  # gone: a leader asking Redis would take it again
    clock.advance(1.4)
    assert leader.leads() and not redis_client.exists(KEY)  # not asked
    clock.advance(0.2)  # past half the lease: renewed (here: taken again)
    assert leader.leads() and redis_client.get(KEY) is not None
    assert 0 < redis_client.pttl(KEY) <= 3_000


def test_one_that_does_not_lead_asks_once_a_third_of_a_lease(redis_client: redis.Redis) -> None:
    scripts = Scripts(redis_client)
    clock = ManualClock()
    assert Leadership(scripts, KEY).leads()
    other = Leadership(scripts, KEY, hold_ms=3_000, clock=clock)
    assert not other.leads()
    redis_client.delete(KEY)  # free now: asking would take it
    clock.advance(0.9)
    assert not other.leads() and not redis_client.exists(KEY)  # not asked
    clock.advance(0.2)
    assert other.leads() and redis_client.exists(KEY)


@pytest.mark.e2e
def test_of_two_beats_one_runs_the_agents_and_the_other_follows_it(stack: Stack) -> None:
    stack.start_api()
    first = stack.beat(node="beat-a", name="beat-a")
    second = stack.beat(node="beat-b", name="beat-b")
    runs = "this beat runs the agents"
    wait_until(
        lambda: (runs in first.log_path.read_text()) or (runs in second.log_path.read_text()),
        30,
        "a beat to run the agents",
    )
    time.sleep(1.0)  # the other asks at least a few times meanwhile
    leading, other = (first, second) if runs in first.log_path.read_text() else (second, first)
    assert runs not in other.log_path.read_text()
    assert "leaves another beat the agents" in other.log_path.read_text()
    stack.procs.stop(leading, signal.SIGKILL)
    killed = time.monotonic()
    wait_for_log(other, runs, timeout=30)
    assert time.monotonic() - killed < 10  # the lease (3 s) ran out, the other took it
