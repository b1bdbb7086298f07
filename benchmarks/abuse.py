"""The API under abuse: an innocent producer's latency quiet and under a flood of cheap
requests, the API's memory meanwhile, and a sweep of one tenant's key over another's objects.

    python -m benchmarks.abuse [--quick] [--seconds S] [--attack-rate R]

The API (``orderly api``: the product's own uvicorn options, one process), a worker and beat
run on the bench database and Redis DB. The producer sends POST /messages at 50 a second
with a produce key from 127.0.0.1 over one kept connection, each request timed from its send
to its answer: first alone (quiet), then (attack) while anonymous requests arrive at R a
second (default 200) from 127.0.0.2-127.0.0.5, a new connection each, in turn: a well-formed
unknown API key, an unknown ACK id with a well-formed token, a 300 MB body (declared by
Content-Length to the console's sign-in or to POST /messages, or streamed chunked to the
sign-in; sent until the server answers), a console sign-in guess; and while a second
tenant's key floods POST /messages from 127.0.0.6 over 4 connections, each request sent as
soon as the last is answered. The rate limits are the defaults but ORDERLY_RATE_KEY_PER_S
(100, burst 100: above the producer's 50, below the flood). The API's VmRSS is sampled every
50 ms: rss_growth_mb is the peak during the attack over the last sample before it.

The sweep: tenant A's and tenant B's keys are bound (``owns``) to their own source system,
origin and subscriptions; B tries every operation on A's objects (a message, one waiting for
its response, a conversation, a PULL subscription's delivery, a dead letter).
cross_tenant_accepted counts those answered 2xx, and for a listing those that showed any of
A's objects. The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from benchmarks.common import pct, prepare, start_beat, use_bench_services

use_bench_services()  # before the app modules read their settings

import httpx  # noqa: E402

from benchmarks import abuse_sweep  # noqa: E402
from orderly.worker import keys  # noqa: E402
from orderly.worker.runtime import get_runtime  # noqa: E402
from tooling.processes import BIN, Managed, ProcessGroup, free_port, wait_http  # noqa: E402

PRODUCER_PER_S = 50
KEY_PER_S = 100
FLOOD_CONNECTIONS = 4
ATTACKERS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
FLOODER = "127.0.0.6"
KINDS = ("bad_key", "unknown_ack", "oversized", "login_guess")
HUGE = 300_000_000
CHUNK = b"a" * 65_536
# An anonymous request not answered within this counts as "timeout".
ANSWER_S = 10.0


def _status(line: bytes) -> str:
    parts = line.split()
    return parts[1].decode() if len(parts) > 1 else "no answer"


def _anonymous(kind: str, i: int) -> tuple[bytes, bool]:
    """The i-th anonymous request of ``kind``: its head (and small body), and whether a body
    of 300 MB follows (streamed until the server answers)."""
    host = b"Host: 127.0.0.1\r\n"
    if kind == "bad_key":
        body = b'{"service": "bench"}'
        token = f"orderly_{uuid.uuid4().hex[:12]}_{uuid.uuid4().hex}{uuid.uuid4().hex[:11]}"
        return (
            b"POST /messages HTTP/1.1\r\n" + host + f"Authorization: Bearer {token}\r\n".encode()
            + b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body,
            False,
        )  # fmt: skip
    if kind == "unknown_ack":
        token = (uuid.uuid4().hex + uuid.uuid4().hex)[:43]
        return (
            f"POST /acks/{uuid.uuid4()} HTTP/1.1\r\n".encode() + host
            + f"X-Orderly-Ack-Token: {token}\r\nContent-Length: 0\r\n\r\n".encode(),
            False,
        )  # fmt: skip
    if kind == "login_guess":
        body = f"key=orderly_{uuid.uuid4().hex[:12]}_{uuid.uuid4().hex}".encode()
        return (
            b"POST /console/login HTTP/1.1\r\n" + host
            + b"Content-Type: application/x-www-form-urlencoded\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body,
            False,
        )  # fmt: skip
    path, framing = [
        (b"/console/login", f"Content-Length: {HUGE}".encode()),
        (b"/messages", f"Content-Length: {HUGE}".encode()),
        (b"/console/login", b"Transfer-Encoding: chunked"),
    ][(i // len(KINDS)) % 3]
    form = b"Content-Type: application/x-www-form-urlencoded\r\n"
    return b"POST " + path + b" HTTP/1.1\r\n" + host + form + framing + b"\r\n\r\n", True


async def _send_huge(writer: asyncio.StreamWriter, chunked: bool) -> None:
    piece = b"10000\r\n" + CHUNK + b"\r\n" if chunked else CHUNK
    for _ in range(HUGE // len(CHUNK)):
        writer.write(piece)
        await writer.drain()


async def _one(port: int, kind: str, i: int, counts: dict[str, Counter[str]]) -> None:
    source = ATTACKERS[i % len(ATTACKERS)]
    head, huge = _anonymous(kind, i)
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)), ANSWER_S
        )
    except (OSError, TimeoutError):
        counts[kind]["no connection"] += 1
        return
    pump = None
    try:
        writer.write(head)
        if huge:
            pump = asyncio.create_task(_send_huge(writer, b"chunked" in head))
        line = await asyncio.wait_for(reader.readline(), ANSWER_S)
        counts[kind][_status(line)] += 1
    except TimeoutError:
        counts[kind]["timeout"] += 1
    except OSError:
        counts[kind]["reset"] += 1
    finally:
        if pump is not None:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
        writer.close()


async def _attack(port: int, rate: float, seconds: float) -> dict[str, dict[str, int]]:
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    loop = asyncio.get_running_loop()
    started = loop.time()
    tasks = []
    i = 0
    while loop.time() - started < seconds:
        tasks.append(asyncio.create_task(_one(port, KINDS[i % len(KINDS)], i, counts)))
        i += 1
        await asyncio.sleep(max(0.0, started + i / rate - loop.time()))
    await asyncio.gather(*tasks)
    return {kind: dict(c) for kind, c in counts.items()}


async def _flood(port: int, token: str, seconds: float) -> dict[str, int]:
    counts: Counter[str] = Counter()
    deadline = asyncio.get_running_loop().time() + seconds

    async def connection(n: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(FLOODER, 0))
        i = 0
        while asyncio.get_running_loop().time() < deadline:
            body = json.dumps(abuse_sweep.message(f"flood-{n}-{i}-{uuid.uuid4().hex[:6]}", "crm-f"))
            writer.write(
                f"POST /messages HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}"
                f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                f"{body}".encode()
            )
            head = await reader.readuntil(b"\r\n\r\n")
            counts[_status(head.split(b"\r\n", 1)[0])] += 1
            lines = head.lower().split(b"\r\n")
            length = next(int(x.split(b":")[1]) for x in lines if x.startswith(b"content-length"))
            await reader.readexactly(length)
            if b"connection: close" in lines:
                writer.close()
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, local_addr=(FLOODER, 0)
                )
            i += 1
        writer.close()

    await asyncio.gather(*(connection(n) for n in range(FLOOD_CONNECTIONS)))
    return dict(counts)


def attack_process(port: int, rate: float, seconds: float, out: Any) -> None:
    out.send(asyncio.run(_attack(port, rate, seconds)))


def flood_process(port: int, token: str, seconds: float, out: Any) -> None:
    out.send(asyncio.run(_flood(port, token, seconds)))


class Sampler(threading.Thread):
    """The API process's VmRSS every 50 ms, in MiB, with the time of each sample."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.status = Path(f"/proc/{pid}/status")
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def field(self, name: str) -> float:
        for line in self.status.read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) / 1024
        raise RuntimeError(f"{name} not in {self.status}")

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self.samples.append((time.monotonic(), self.field("VmRSS")))


def produce(port: int, token: str, seconds: float, tag: str) -> tuple[list[float], Counter[str]]:
    """POST /messages at PRODUCER_PER_S for ``seconds``: each request's latency (ms), and the
    answers by status."""
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60) as c:
        started = time.monotonic()
        i = 0
        while time.monotonic() - started < seconds:
            body = abuse_sweep.message(f"{tag}-{i}", "crm-p")
            sent = time.perf_counter()
            answer = c.post("/messages", json=body)
            latencies.append((time.perf_counter() - sent) * 1000)
            statuses[str(answer.status_code)] += 1
            i += 1
            time.sleep(max(0.0, started + i / PRODUCER_PER_S - time.monotonic()))
    return latencies, statuses


def start_stack(group: ProcessGroup, port: int) -> tuple[Managed, list[Managed]]:
    """The API as ``orderly api`` runs it, a worker and beat."""
    env = {"ORDERLY_NODE_CODE": "bench-abuse-api", "ORDERLY_API_WORKERS": "1"}
    api = group.start("abuse-api", [str(BIN / "orderly"), "api", "--port", str(port)], env)
    worker = group.start_worker(
        "abuse-w",
        concurrency=1,
        node_code="bench-abuse-w",
        extra_env={"ORDERLY_LOG_LEVEL": "WARNING"},
    )
    beat = start_beat(group, "abuse")
    wait_http(f"http://127.0.0.1:{port}/health", api, 120)
    return api, [worker, beat]


def load() -> float:
    """The machine's 1-minute load average: the figures depend on what else runs."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def figures(latencies: list[float]) -> tuple[float, float]:
    return round(pct(latencies, 0.5), 2), round(pct(latencies, 0.99), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 s phases (under 2 minutes)")
    parser.add_argument("--seconds", type=float, default=None, help="each phase (default 30)")
    parser.add_argument("--attack-rate", type=float, default=200.0, help="anonymous requests/s")
    args = parser.parse_args()
    seconds = args.seconds or (10.0 if args.quick else 30.0)

    # The bench's own limits (the API reads them at start): the flood's key over its limit.
    os.environ["ORDERLY_RATE_KEY_PER_S"] = str(KEY_PER_S)
    os.environ["ORDERLY_RATE_KEY_BURST"] = str(KEY_PER_S)
    os.environ["ORDERLY_OUTBOUND_ALLOW"] = "127.0.0.1"
    r, group = prepare()
    r.flushdb()
    run = uuid.uuid4().hex[:6]
    port = free_port()
    _, admin = keys.create_key(
        get_runtime().engine, {"name": f"abuse-admin-{run}", "scopes": list(keys.SCOPES)}
    )
    spawn = multiprocessing.get_context("spawn")
    try:
        api, _ = start_stack(group, port)
        http = httpx.Client(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {admin}"},
            timeout=60,
        )
        sweep = abuse_sweep.sweep(http, run)
        print(f"cross-tenant: {sweep['accepted']} of {sweep['tried']} not refused", flush=True)
        producer = abuse_sweep.make_key(http, f"abuse-producer-{run}", ["produce"], None)
        flooder = abuse_sweep.make_key(http, f"abuse-flooder-{run}", ["produce"], None)
        produce(port, producer, 2.0, f"warm-{run}")
        load_before = load()
        sampler = Sampler(api.proc.pid)
        sampler.start()
        quiet, quiet_statuses = produce(port, producer, seconds, f"quiet-{run}")
        rss_before = sampler.samples[-1][1]
        attack_started = time.monotonic()
        pipes = []
        loaders = []
        for target, extra in ((attack_process, (args.attack_rate,)), (flood_process, (flooder,))):
            mine, theirs = spawn.Pipe(duplex=False)
            proc = spawn.Process(target=target, args=(port, *extra, seconds, theirs))
            proc.start()
            pipes.append(mine)
            loaders.append(proc)
        attacked, attacked_statuses = produce(port, producer, seconds, f"attack-{run}")
        for pipe, proc in zip(pipes, loaders, strict=True):
            # Each loader stops sending at the phase's end and waits for its answers.
            if not pipe.poll(ANSWER_S * 6):
                raise RuntimeError(f"a load generator gave no figures (exit {proc.exitcode})")
        attack_counts, flood_counts = (p.recv() for p in pipes)
        for proc in loaders:
            proc.join(60)
        http.close()
        sampler.stop.set()
        sampler.join()
        rss_peak = max(mb for t, mb in sampler.samples if t >= attack_started)
        hwm = sampler.field("VmHWM")
        load_after = load()
    finally:
        group.stop_all()
        r.close()

    p50_quiet, p99_quiet = figures(quiet)
    p50_attack, p99_attack = figures(attacked)
    ratio = round(p99_attack / p99_quiet, 3)
    growth = round(rss_peak - rss_before, 1)
    producer_429 = quiet_statuses["429"] + attacked_statuses["429"]
    flooder_429 = flood_counts.get("429", 0)
    print(
        f"producer quiet p50 {p50_quiet} ms p99 {p99_quiet} ms; under attack p50 {p50_attack} ms "
        f"p99 {p99_attack} ms ({ratio}x); API RSS {rss_before:.0f} -> peak {rss_peak:.0f} MB",
        flush=True,
    )
    out = {
        "seconds_per_phase": seconds,
        "attack_rate_per_s": args.attack_rate,
        "producer_per_s": PRODUCER_PER_S,
        "rate_key_per_s": KEY_PER_S,
        "load_1min": [load_before, load_after],
        "p50_quiet_ms": p50_quiet,
        "p99_quiet_ms": p99_quiet,
        "p50_attack_ms": p50_attack,
        "p99_attack_ms": p99_attack,
        "p99_ratio_under_attack": ratio,
        "producer_sent": {"quiet": len(quiet), "attack": len(attacked)},
        "producer_statuses": {"quiet": dict(quiet_statuses), "attack": dict(attacked_statuses)},
        "rss_before_attack_mb": round(rss_before, 1),
        "rss_peak_attack_mb": round(rss_peak, 1),
        "rss_growth_mb": growth,
        "vmhwm_mb": round(hwm, 1),
        "status_counts": attack_counts,
        "flooder_statuses": flood_counts,
        "flooder_429": flooder_429,
        "producer_429": producer_429,
        "cross_tenant_accepted": sweep["accepted"],
        "cross_tenant_tried": sweep["tried"],
        "cross_tenant": sweep["operations"],
        "owns_supported": sweep["owns_supported"],
        "targets_met": {
            "p99_ratio_at_most_2": ratio <= 2,
            "rss_growth_at_most_100_mb": growth <= 100,
            "flooder_limited": flooder_429 > 0,
            "producer_not_limited": producer_429 == 0,
            "no_cross_tenant_access": sweep["accepted"] == 0,
        },
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
