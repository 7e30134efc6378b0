"""Benchmark ``SharedPrefixIndex`` on a real redis-server (a script, not a test).

Starts a throwaway ``redis-server`` on a free loopback port (or uses ``--port`` of a running one,
which it FLUSHes), then:

1. **ingestion**: records ``--blocks`` distinct blocks (256-block prompts spread over 64
   endpoints) and times the batched flush, in blocks/s; also the ``record`` cost on the caller.
2. **memory**: Redis ``used_memory`` delta per block with one holder, and per extra holder.
3. **lookup**: ``await lookup(...)`` for a 256-block prompt (4k tokens at 16 tokens per block)
   against 64 candidate endpoints on the warm index, p50/p99 in µs, in four cases:

   * ``miss``: nobody holds block 0 (the script stops at once);
   * ``shared-4``: 4 endpoints hold the whole prompt, 60 hold nothing;
   * ``deep``: every candidate holds a random-length prefix (the walk runs to the longest);
   * ``all-64``: all 64 candidates hold the whole prompt (256 blocks x 64 fields, the worst case).

   A PING round trip is printed as the floor (client + loopback).
4. **requests on shared prefixes**: ``--requests`` prompts of 256 blocks, the first 192 one of 8
   system prompts, over 4 endpoints, each recorded and flushed alone (as at a low rate); Redis CPU
   and HSETs per request when every prompt is written whole (``rewrite_after_s=0``, as before
   ``RecentWrites``) and with the default, side by side in one run (alternating rounds).

    python -m loadtests.bench.redis_index [--blocks 102400] [--calls 2000] [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvindex.memory import MemoryPrefixIndex
from kvindex.redis_index import SharedPrefixIndex

ENDPOINTS = 64
PROMPT_BLOCKS = 256


@contextlib.contextmanager
def redis_server(port: int | None) -> Iterator[int]:
    if port is not None:
        yield port
        return
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    with tempfile.TemporaryDirectory() as workdir:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        proc = subprocess.Popen([*args, "--dir", workdir], stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                        sock.sendall(b"PING\r\n")
                        if sock.recv(16).startswith(b"+PONG"):
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.01)
            yield port
        finally:
            proc.kill()
            proc.wait()


def make_index(client: aioredis.Redis, *, whole_prompts: bool = False, **options: Any) -> SharedPrefixIndex:
    """``whole_prompts``: as the router builds it (its lookups may bisect); else they walk."""
    names = [f"ep{i}" for i in range(ENDPOINTS)]
    by_name = {n: i for i, n in enumerate(names)}
    return SharedPrefixIndex(
        client,
        MemoryPrefixIndex(1_000_000, max_slots=ENDPOINTS, whole_prompts=whole_prompts),
        slot_names=names.__getitem__,
        slot_of=by_name.get,
        max_pending=10_000_000,  # the warm-up enqueues everything before one flush
        lookup_timeout_s=1.0,
        write_timeout_s=30.0,
        **options,
    )


async def flushed(index: SharedPrefixIndex) -> None:
    """A flush that must reach Redis (not an ``assert``: ``python -O`` would skip the flush too)."""
    if not await index.flush():
        raise RuntimeError("the flush to Redis failed: the figures would be wrong")


async def redis_cpu_s(client: aioredis.Redis) -> float:
    cpu = await client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


async def shared_prefix_requests(
    client: aioredis.Redis, requests: int, rewrite_after_s: float | None, namespace: str
) -> tuple[float, float]:
    """Redis CPU ms and HSETs per request for ``requests`` shared-prefix prompts (section 4)."""
    rng = np.random.default_rng(11)
    systems = rng.integers(0, 2**64, size=(8, 192), dtype=np.uint64)
    index = make_index(client, whole_prompts=True, rewrite_after_s=rewrite_after_s, namespace=namespace)
    await client.config_resetstat()
    cpu = await redis_cpu_s(client)
    for i in range(requests):
        question = rng.integers(0, 2**64, size=PROMPT_BLOCKS - 192, dtype=np.uint64)
        index.record(i % 4, np.concatenate([systems[i % 8], question]))
        await flushed(index)
    cpu = await redis_cpu_s(client) - cpu
    hsets = int((await client.info("commandstats")).get("cmdstat_hset", {}).get("calls", 0))
    return cpu / requests * 1e3, hsets / requests


async def used_memory(client: aioredis.Redis) -> int:
    return int((await client.info("memory"))["used_memory"])


async def percentiles(call: Callable[[], Awaitable[object]], calls: int) -> tuple[float, float]:
    for _ in range(min(100, calls)):
        await call()
    samples = np.empty(calls)
    for i in range(calls):
        t0 = time.perf_counter_ns()
        await call()
        samples[i] = time.perf_counter_ns() - t0
    return float(np.percentile(samples, 50)) / 1e3, float(np.percentile(samples, 99)) / 1e3


async def main(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(7)
    with redis_server(args.port) as port:
        client = aioredis.Redis(host="127.0.0.1", port=port, retry=Retry(NoBackoff(), 0))
        await client.flushdb()
        writer = make_index(client)
        readers = {"walk": make_index(client), "bisect": make_index(client, whole_prompts=True)}
        rows: list[tuple[str, str]] = []

        # 1+2. ingestion of distinct blocks, one holder each, and memory per block.
        base = await used_memory(client)
        filler = rng.integers(0, 2**64, size=args.blocks, dtype=np.uint64)
        prompts = filler.reshape(-1, PROMPT_BLOCKS) if args.blocks % PROMPT_BLOCKS == 0 else [filler]
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            writer.record(i % ENDPOINTS, prompt)
        t_enq = time.perf_counter() - t0
        t0 = time.perf_counter()
        await flushed(writer)
        t_flush = time.perf_counter() - t0
        one = await used_memory(client) - base
        rows.append(("record() on the caller, per 256-block prompt", f"{t_enq / len(prompts) * 1e6:.1f} µs"))
        rows.append(("flush ingestion, distinct blocks", f"{args.blocks / t_flush:,.0f} blocks/s"))
        for i, prompt in enumerate(prompts):  # a second holder on every block
            writer.record((i + 1) % ENDPOINTS, prompt)
        t0 = time.perf_counter()
        await flushed(writer)
        t_flush2 = time.perf_counter() - t0
        two = await used_memory(client) - base
        rows.append(
            ("flush ingestion, 2nd holder on existing blocks", f"{args.blocks / t_flush2:,.0f} blocks/s")
        )
        rows.append(("Redis memory per block, one holder", f"{one / args.blocks:.0f} B"))
        rows.append(("Redis memory per extra holder of a block", f"{(two - one) / args.blocks:.0f} B"))
        rows.append(("Redis keys after warm-up", f"{await client.dbsize():,}"))

        # 3. lookups on the warm index.
        cands = np.arange(ENDPOINTS, dtype=np.int32)
        cases: dict[str, np.ndarray] = {}
        cases["miss"] = rng.integers(0, 2**64, size=PROMPT_BLOCKS, dtype=np.uint64)
        shared = rng.integers(0, 2**64, size=PROMPT_BLOCKS, dtype=np.uint64)
        for slot in range(4):
            writer.record(slot, shared)
        cases["shared-4"] = shared
        deep = rng.integers(0, 2**64, size=PROMPT_BLOCKS, dtype=np.uint64)
        for slot in range(ENDPOINTS):
            writer.record(slot, deep[: int(rng.integers(0, PROMPT_BLOCKS + 1))])
        cases["deep"] = deep
        full = rng.integers(0, 2**64, size=PROMPT_BLOCKS, dtype=np.uint64)
        for slot in range(ENDPOINTS):
            writer.record(slot, full)
        cases["all-64"] = full
        await flushed(writer)

        p50, p99 = await percentiles(client.ping, args.calls)
        rows.append(("PING round trip (floor)", f"p50 {p50:.0f} µs, p99 {p99:.0f} µs"))
        for case, keys in cases.items():
            walked, bisected = [await r.lookup(keys, cands) for r in readers.values()]
            assert walked.tolist() == bisected.tolist(), case
            rows.append((f"lookup {case} (256 blocks x 64 cand., max depth {int(walked.max())})", ""))
            p50s = {}
            for how, reader in readers.items():
                p50, p99 = await percentiles(lambda r=reader, keys=keys: r.lookup(keys, cands), args.calls)
                p50s[how] = p50
                rows.append((f"  {how}", f"p50 {p50:.0f} µs, p99 {p99:.0f} µs"))
            rows.append(("  bisect / walk, p50", f"{p50s['bisect'] / p50s['walk']:.2f}"))
            p50, p99 = await percentiles(
                lambda keys=keys, r=readers["bisect"]: asyncio.sleep(0, r.match(keys, cands)), args.calls
            )
            rows.append(
                (f"  sync match {case} on the mirror afterwards", f"p50 {p50:.1f} µs, p99 {p99:.1f} µs")
            )
        assert all(r.fallback_lookups == 0 and r.redis_errors == 0 for r in readers.values())

        # 4. shared-prefix requests, every prompt written whole against RecentWrites, alternating.
        measured: dict[str, list[tuple[float, float]]] = {"whole": [], "recent": []}
        for turn in range(3):
            for how, rewrite_after_s in (("whole", 0.0), ("recent", None)):
                namespace = f"req{turn}{how}"
                measured[how].append(
                    await shared_prefix_requests(client, args.requests, rewrite_after_s, namespace)
                )
        rows.append((f"{args.requests} requests on 8 shared 192-block prefixes (medians of 3)", ""))
        cpu_ms = {how: float(np.median([m[0] for m in runs])) for how, runs in measured.items()}
        labels = {"whole": "every prompt written whole", "recent": "blocks written lately not rewritten"}
        for how, label in labels.items():
            hsets = float(np.median([m[1] for m in measured[how]]))
            rows.append((f"  {label}", f"Redis CPU {cpu_ms[how]:.3f} ms, {hsets:.0f} HSETs per request"))
        rows.append(("  not rewritten / whole, Redis CPU", f"{cpu_ms['recent'] / cpu_ms['whole']:.2f}"))
        await client.aclose()

    width = max(len(name) for name, _ in rows)
    print(f"SharedPrefixIndex on redis-server, {args.blocks:,} warm blocks, {ENDPOINTS} endpoints")
    print(f"{'measure':<{width}}  value")
    print(f"{'-' * width}  {'-' * 28}")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=102_400)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=2000, help="section 4's requests per round")
    parser.add_argument("--port", type=int, default=None, help="use a running redis-server (it is FLUSHed)")
    args = parser.parse_args()
    for option in ("blocks", "calls", "requests"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1")
    asyncio.run(main(args))


if __name__ == "__main__":
    cli()
