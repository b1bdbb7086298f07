"""What message tracking costs a worker, beside a bare Redis round trip in the same run.

    python -m benchmarks.tracking [--quick] [--messages N] [--rounds R]

A worker tracks each message with two scripts (register at the claim, done at the outcome),
one round trip each, unpipelined, as a worker does. The baseline is the same number of bare
round trips (PING): the floor any Redis call pays. The timeout monitor's turn is timed over a
full list (messageCapacity ids) with every id done, and over the same list with every id
timed out. The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.common import BENCH_REDIS
from orderly.models.keys import TrackKeys
from orderly.worker.core.clock import now_ms
from orderly.worker.tracking import Tracker, TrackingPolicy

KEYS = TrackKeys("orderly:bench:track")


def _round(tracker: Tracker, messages: int) -> tuple[float, float]:
    """(register+done per second, bare round trips per second, two per message)."""
    client = tracker.client
    t0 = time.perf_counter()
    for i in range(messages):
        tracker.done(tracker.register(i))
    tracked = messages / (time.perf_counter() - t0)
    tracker.monitor_turn()  # empties the list for the next round
    t0 = time.perf_counter()
    for _ in range(messages):
        client.ping()
        client.ping()
    bare = messages / (time.perf_counter() - t0)
    return tracked, bare


def _monitor_ms(tracker: Tracker, capacity: int, done: bool) -> float:
    start = now_ms()
    ids = [tracker.register(i, now=start) for i in range(capacity)]
    if done:
        for track_id in ids:
            tracker.done(track_id, now=start + 5)
        at = start + 10
    else:
        at = start + tracker.policy.timeout_ms + 1
    t0 = time.perf_counter()
    turn = tracker.monitor_turn(now=at)
    took = (time.perf_counter() - t0) * 1000
    seen = turn.done if done else len(turn.timed_out)
    assert seen == capacity, f"the turn saw {seen} of {capacity}"
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (seconds)")
    parser.add_argument("--messages", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    messages = args.messages or (2_000 if args.quick else 20_000)
    rounds = args.rounds or (2 if args.quick else 5)

    import redis

    client = redis.Redis.from_url(BENCH_REDIS)
    policy = TrackingPolicy(capacity=1000, timeout_ms=10_000, expire_ms=60_000)
    tracker = Tracker(client, KEYS, policy, service="bench")

    def clean() -> None:
        for key in client.scan_iter(f"{KEYS.namespace}:*", count=1000):
            client.delete(key)

    clean()
    try:
        tracked, bare = [], []
        for n in range(1, rounds + 1):
            t, b = _round(tracker, messages)
            tracked.append(t)
            bare.append(b)
            print(f"round {n}: register+done {t:,.0f} msg/s, bare round trips {b:,.0f} pairs/s")
        clean()
        done_ms = _monitor_ms(tracker, policy.capacity, done=True)
        clean()
        timeout_ms = _monitor_ms(tracker, policy.capacity, done=False)
    finally:
        clean()
    t_med, b_med = statistics.median(tracked), statistics.median(bare)
    per_msg_ms = 1000 / t_med
    print(
        f"medians of {rounds} rounds: tracking {per_msg_ms:.3f} ms per message, "
        f"two bare round trips {1000 / b_med:.3f} ms; monitor turn over {policy.capacity} ids: "
        f"{done_ms:.1f} ms all done, {timeout_ms:.1f} ms all timed out"
    )
    print(
        json.dumps(
            {
                "messages": messages,
                "rounds": rounds,
                "register_done_per_s": round(t_med, 1),
                "tracking_ms_per_message": round(per_msg_ms, 4),
                "bare_roundtrip_pairs_per_s": round(b_med, 1),
                "ratio_to_bare": round(t_med / b_med, 3),
                "monitor_turn_ms_1000_done": round(done_ms, 2),
                "monitor_turn_ms_1000_timed_out": round(timeout_ms, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
