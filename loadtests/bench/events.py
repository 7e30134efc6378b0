"""KV-event ingestion rate end to end: publisher process -> ZMQ -> ``KVEventConsumer`` -> sink -> index.

Processes, all on 127.0.0.1:

* **publisher** (a ``multiprocessing`` spawn child): ``--engines`` ``KVEventPublisher`` s (8 by
  default, one PUB + replay ROUTER each, like 8 vLLM engines), publishing vLLM 0.33 ``KVEventBatch``
  es round robin. The workload is generated before the clock starts: 6-10 events per batch (mean
  8), each a ``BlockStored`` of 1-16 fresh chained 64-bit hashes with 16 token ids per block
  (``medium`` GPU), or, with probability 1/4, a ``BlockRemoved`` of the engine's 1-16 oldest held
  hashes. (vLLM's eviction sends one hash per ``BlockRemoved``; grouping them is a simplification.)
* **consumer** (this process, the one measured): ``KVEventConsumer`` with its defaults, driving

  - ``null``: a sink that only counts (consumer + framing + decode cost);
  - ``memory``: ``router.server.app.IndexEventSink`` over a ``MemoryPrefixIndex`` and a ``Pool`` built
    from a small config (the service's precise path);
  - ``redis``: the same ``IndexEventSink`` over ``SharedPrefixIndex`` (a real redis-server, a local
    ``MemoryPrefixIndex`` mirror) through a 4-line adapter: ``IndexEventSink`` calls
    ``record``/``remove``/``drop_slot`` while the shared index's KV-event path is
    ``stored``/``removed``/``cleared`` (and ``removed`` wants an ndarray). Two rates: *applied to
    the local mirror* (last event through the sink) and *flushed to Redis* (after ``await
    flush()``; the background task flushes every 50 ms meanwhile). ``max_pending`` is raised so
    the flush queue never drops writes; its peak is reported (the service default is 100,000).

No silent drops: the publisher runs on credit, never more than ``--window`` events ahead of what the
sink has counted (shared memory), far below the SUB's RCVHWM of 10,000 batches per engine. Every
rate counts events delivered at the sink; lost events, gaps, replays and purges are reported.
Each mode is run ``--runs`` times (fresh publisher process, consumer and index) and the table
shows medians. ``decode_batch`` alone over the same payloads is the lower bound on per-batch cost.

    python -m loadtests.bench.events [--engines 8] [--batches 20000] [--runs 3] [--window 4000]

Bounded: every wait has a deadline (``--run-timeout``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import random
import statistics
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

import msgspec
import numpy as np
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvindex.events import BlockRemoved, BlockStored, KVEventBatch, KVEventConsumer, decode_batch
from kvindex.memory import MemoryPrefixIndex
from kvindex.redis_index import SharedPrefixIndex
from loadtests.servers.redis import RedisServer
from router.server.config import parse_config
from router.state.kv_sink import IndexEventSink
from router.state.pool import Pool

BLOCK_SIZE = 16
REMOVE_SHARE = 0.25
TOKENS = [[(7 * i + 13) % 151_000 for i in range(BLOCK_SIZE * n)] for n in range(17)]

Batch = list[BlockStored | BlockRemoved]


# --- workload (both processes) -------------------------------------------------------------------


def make_workload(engines: int, batches: int, seed: int) -> list[Batch]:
    """``batches`` event lists; batch ``i`` belongs to engine ``i % engines``."""
    rng = random.Random(seed)
    held: list[deque[int]] = [deque() for _ in range(engines)]
    out: list[Batch] = []
    for i in range(batches):
        mine = held[i % engines]
        events: Batch = []
        for _ in range(rng.randint(6, 10)):
            if mine and rng.random() < REMOVE_SHARE:
                k = min(len(mine), rng.randint(1, 16))
                events.append(BlockRemoved(block_hashes=[mine.popleft() for _ in range(k)], medium="GPU"))
                continue
            n = rng.randint(1, 16)
            # A quarter start a new prompt (no parent); the rest extend the engine's last block.
            parent = mine[-1] if mine and rng.random() < 0.75 else None
            hashes = [rng.getrandbits(64) for _ in range(n)]
            mine.extend(hashes)
            events.append(
                BlockStored(
                    block_hashes=hashes,  # type: ignore[arg-type]
                    parent_block_hash=parent,
                    token_ids=TOKENS[n],
                    block_size=BLOCK_SIZE,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                )
            )
        out.append(events)
    return out


def count(batches: list[Batch]) -> tuple[int, int]:
    """(events, blocks)."""
    return sum(len(b) for b in batches), sum(len(e.block_hashes) for b in batches for e in b)


# --- publisher process ----------------------------------------------------------------------------


def publisher_main(
    conn: Connection, delivered: Any, engines: int, batches: int, window: int, seed: int
) -> None:
    asyncio.run(_publish(conn, delivered, engines, batches, window, seed))


async def _publish(
    conn: Connection, delivered: Any, engines: int, batches: int, window: int, seed: int
) -> None:
    from simulator.kv_publisher import KVEventPublisher

    workload = make_workload(engines, batches, seed)
    pubs = [KVEventPublisher(buffer_steps=batches // engines + 64) for _ in range(engines)]
    for pub in pubs:
        await pub.start()
    try:
        conn.send(([(p.endpoint, p.replay_endpoint) for p in pubs], count(workload)))
        # Warm-up until the consumer has seen every engine (ZMQ slow joiner); lost ones are replayed.
        published = 0
        warm = random.Random(seed + 1)
        while not conn.poll(0.02):
            for pub in pubs:
                ev = BlockStored([warm.getrandbits(64)], None, TOKENS[1], BLOCK_SIZE, None, "GPU", None)
                pub.publish([ev])  # type: ignore[list-item]
                published += 1
            await asyncio.sleep(0)  # let the replay servers answer
        assert conn.recv() == "stop-warm"
        conn.send(published)
        assert conn.recv() == "go"
        waited = 0.0
        t0 = time.perf_counter()
        for i, events in enumerate(workload):
            while published - delivered.value > window:
                w0 = time.perf_counter()
                await asyncio.sleep(0.0002)
                waited += time.perf_counter() - w0
            pubs[i % engines].publish(events)
            published += len(events)
            if i % 64 == 63:
                await asyncio.sleep(0)
        conn.send((time.perf_counter() - t0, waited))
        conn.poll(60.0)  # keep the replay sockets up until the consumer is done
    finally:
        for pub in pubs:
            await pub.close()


# --- consumer side ---------------------------------------------------------------------------------


class NullSink:
    """Counts what the consumer delivers; applies nothing."""

    def __init__(self, counter: Any) -> None:
        self.events = self.blocks = 0
        self._counter = counter

    def stored(self, engine: str, block_hashes: list[int], parent: int | None) -> None:
        self.events += 1
        self.blocks += len(block_hashes)
        self._counter.value = self.events

    def removed(self, engine: str, block_hashes: list[int]) -> None:
        self.events += 1
        self.blocks += len(block_hashes)
        self._counter.value = self.events

    def cleared(self, engine: str) -> None:
        self.events += 1

    def covered(self, engine: str, known: bool) -> None:
        pass


class CountingIndexSink(IndexEventSink):
    """The service's ``IndexEventSink``, counting what it applied (the credit the publisher reads)."""

    def __init__(self, pool: Pool, index: MemoryPrefixIndex, counter: Any) -> None:
        super().__init__(pool, index)
        self.events = self.blocks = 0
        self._counter = counter

    def stored(self, engine: str, block_hashes: list[int], parent: int | None) -> None:
        super().stored(engine, block_hashes, parent)
        self.events += 1
        self.blocks += len(block_hashes)
        self._counter.value = self.events

    def removed(self, engine: str, block_hashes: list[int]) -> None:
        super().removed(engine, block_hashes)
        self.events += 1
        self.blocks += len(block_hashes)
        self._counter.value = self.events


class SharedAsPreciseIndex:
    """``IndexEventSink``'s index calls mapped onto ``SharedPrefixIndex``'s KV-event path."""

    def __init__(self, shared: SharedPrefixIndex) -> None:
        self.shared = shared

    def record(self, slot: int, block_keys: np.ndarray) -> None:
        self.shared.stored(slot, block_keys)

    def remove(self, slot: int, block_keys: list[int]) -> None:
        self.shared.removed(slot, np.asarray(block_keys, dtype=np.uint64))

    def drop_slot(self, slot: int) -> None:
        self.shared.cleared(slot)


@dataclass
class RunResult:
    events: int
    blocks: int
    expected_events: int
    applied_s: float  # go -> last event through the sink
    flushed_s: float | None  # go -> flush() done (redis)
    cpu_s: float  # this process (consumer + its ZMQ I/O thread) over applied_s
    publisher_wait_share: float  # publisher time spent waiting for credit
    gaps: int
    replays: int
    purges: int
    errors: int
    peak_pending: int
    dropped_writes: int


def make_pool(engines: int) -> tuple[Pool, int]:
    config = parse_config(
        {
            "model": "m",
            "endpoints": [{"address": f"127.0.0.1:{9000 + i}", "name": f"e{i}"} for i in range(engines)],
        }
    )
    pool = Pool()
    for endpoint in config.endpoints:
        pool.add(endpoint)
    return pool, config.index.capacity_blocks_per_endpoint


async def wait_until(cond: Any, timeout_s: float, what: str, step_s: float = 0.001) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(step_s)


async def one_run(mode: str, args: argparse.Namespace, seed: int, redis_port: int | None) -> RunResult:
    ctx = mp.get_context("spawn")
    delivered = ctx.RawValue("q", 0)
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=publisher_main,
        args=(child, delivered, args.engines, args.batches, args.window, seed),
        daemon=True,
    )
    proc.start()
    client: aioredis.Redis | None = None
    shared: SharedPrefixIndex | None = None
    consumer: KVEventConsumer | None = None
    try:
        if not parent.poll(args.run_timeout):
            raise TimeoutError("publisher did not start")
        endpoints, (expected_events, _) = parent.recv()
        pool, capacity = make_pool(args.engines)
        sink: NullSink | CountingIndexSink
        if mode == "null":
            sink = NullSink(delivered)
        elif mode == "memory":
            sink = CountingIndexSink(pool, MemoryPrefixIndex(capacity), delivered)
        else:
            assert redis_port is not None
            client = aioredis.Redis(host="127.0.0.1", port=redis_port, retry=Retry(NoBackoff(), 0))
            await client.flushall()

            def slot_of(name: str) -> int | None:
                endpoint = pool.endpoints.get(name)
                return None if endpoint is None else endpoint.slot

            shared = SharedPrefixIndex(
                client,
                MemoryPrefixIndex(capacity),
                slot_names=lambda slot: pool.by_slot[slot].id,  # type: ignore[union-attr]
                slot_of=slot_of,
                max_pending=100_000_000,
                write_timeout_s=10.0,
            )
            await shared.start()
            sink = CountingIndexSink(pool, cast(MemoryPrefixIndex, SharedAsPreciseIndex(shared)), delivered)
        consumer = KVEventConsumer(sink)
        for i, (endpoint, replay) in enumerate(endpoints):
            consumer.add_engine(f"e{i}", endpoint, replay)
        await consumer.start()
        c = consumer
        await wait_until(
            lambda: all(s.last_seq is not None for s in c.stats().values()), args.run_timeout, "subscriptions"
        )
        parent.send("stop-warm")
        if not parent.poll(args.run_timeout):
            raise TimeoutError("publisher did not stop the warm-up")
        warm_events = parent.recv()
        await wait_until(lambda: sink.events >= warm_events, args.run_timeout, "warm-up events")
        if shared is not None:
            assert await shared.flush()
        base_events, base_blocks = sink.events, sink.blocks
        base = {name: s for name, s in consumer.stats().items()}
        target = base_events + expected_events
        peak = 0

        def done() -> bool:
            nonlocal peak
            if shared is not None:
                peak = max(peak, shared.pending)
            return sink.events >= target

        cpu0 = time.process_time()
        t0 = time.perf_counter()
        parent.send("go")
        with contextlib.suppress(TimeoutError):  # reported as lost events below
            await wait_until(done, args.run_timeout, "all events")
        applied_s = time.perf_counter() - t0
        cpu_s = time.process_time() - cpu0
        flushed_s = None
        if shared is not None:
            assert await shared.flush()
            flushed_s = time.perf_counter() - t0
        if not parent.poll(args.run_timeout):
            raise TimeoutError("publisher did not finish")
        pub_s, waited = parent.recv()
        stats = consumer.stats()
        diff = {
            k: sum(getattr(stats[n], k) - getattr(base[n], k) for n in stats)
            for k in ("gaps", "replays", "purges", "errors", "malformed")
        }
        return RunResult(
            events=sink.events - base_events,
            blocks=sink.blocks - base_blocks,
            expected_events=expected_events,
            applied_s=applied_s,
            flushed_s=flushed_s,
            cpu_s=cpu_s,
            publisher_wait_share=waited / pub_s if pub_s else 0.0,
            gaps=diff["gaps"],
            replays=diff["replays"],
            purges=diff["purges"],
            errors=diff["errors"] + diff["malformed"],
            peak_pending=peak,
            dropped_writes=shared.dropped_writes if shared is not None else 0,
        )
    finally:
        if consumer is not None:
            await consumer.stop()
        if shared is not None:
            await shared.close()
        if client is not None:
            await client.aclose()
        with contextlib.suppress(OSError):  # the publisher may be gone already
            parent.send("bye")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()


def decode_cost(args: argparse.Namespace) -> tuple[float, int, int, int]:
    """Median µs per batch for ``decode_batch`` over the run's payloads; also (batches, events, blocks)."""
    workload = make_workload(args.engines, min(args.batches, 5000), 1)
    enc = msgspec.msgpack.Encoder()
    payloads = [enc.encode(KVEventBatch(ts=time.time(), events=b, data_parallel_rank=0)) for b in workload]  # type: ignore[arg-type]
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for p in payloads:
            decode_batch(p)
        times.append(time.perf_counter() - t0)
    events, blocks = count(workload)
    return statistics.median(times) / len(payloads) * 1e6, len(payloads), events, blocks


async def main(args: argparse.Namespace) -> None:
    us_per_batch, n_dec, dec_events, dec_blocks = decode_cost(args)
    results: dict[str, list[RunResult]] = {m: [] for m in args.modes}
    with tempfile.TemporaryDirectory() as workdir:
        server = None
        if "redis" in args.modes:
            server = RedisServer(Path(workdir))
            server.start()
        try:
            for run in range(args.runs):  # interleaved, so drift hits every mode alike
                for mode in args.modes:
                    results[mode].append(
                        await one_run(mode, args, 100 + run, server.port if server is not None else None)
                    )
        finally:
            if server is not None:
                server.kill()

    ev_per_batch = dec_events / n_dec
    rows: list[tuple[str, float, float, float, str, str]] = []
    rows.append(
        (
            "decode_batch only (lower bound)",
            1e6 / us_per_batch * ev_per_batch,
            1e6 / us_per_batch * dec_blocks / n_dec,
            us_per_batch,
            "-",
            "-",
        )
    )
    labels = {
        "null": "consumer -> counting sink (no index)",
        "memory": "consumer -> IndexEventSink -> MemoryPrefixIndex",
        "redis": "consumer -> IndexEventSink -> Shared: local mirror",
    }
    for mode, runs in results.items():
        eps = [r.events / r.applied_s for r in runs]
        bps = [r.blocks / r.applied_s for r in runs]
        med = statistics.median(eps)
        spread = f"{min(eps) / 1e3:.0f}-{max(eps) / 1e3:.0f}k"
        cpu = f"{statistics.median(r.cpu_s / r.applied_s for r in runs) * 100:.0f}%"
        rows.append((labels[mode], med, statistics.median(bps), 1e6 / med * ev_per_batch, cpu, spread))
        if mode == "redis":
            feps = [r.events / r.flushed_s for r in runs if r.flushed_s]
            fbps = [r.blocks / r.flushed_s for r in runs if r.flushed_s]
            fmed = statistics.median(feps)
            fspread = f"{min(feps) / 1e3:.0f}-{max(feps) / 1e3:.0f}k"
            rows.append(
                (
                    "  ... flushed to Redis (after flush())",
                    fmed,
                    statistics.median(fbps),
                    1e6 / fmed * ev_per_batch,
                    "-",
                    fspread,
                )
            )

    print(
        f"KV-event ingestion, {args.engines} engines, {args.batches:,} batches/run "
        f"(~{ev_per_batch:.1f} events, ~{dec_blocks / dec_events:.1f} blocks/event), "
        f"median of {args.runs} runs, credit window {args.window:,} events"
    )
    width = max(len(r[0]) for r in rows)
    head = f"{'events/s':>10} {'blocks/s':>11} {'µs/batch':>9} {'cons.CPU':>8} {'ev/s range':>11}"
    print(f"{'path':<{width}} {head}")
    print(f"{'-' * width} {'-' * 10} {'-' * 11} {'-' * 9} {'-' * 8} {'-' * 11}")
    for name, eps, bps, us, cpu, spread in rows:
        print(f"{name:<{width}} {eps:>10,.0f} {bps:>11,.0f} {us:>9.1f} {cpu:>8} {spread:>11}")
    print()
    print("delivery (per mode, summed over runs): events delivered/published, gaps, replays, purges, errors;")
    print("publisher share of time waiting for credit (median); Redis peak queued blocks, dropped writes")
    for mode, runs in results.items():
        line = (
            f"  {mode:<6} {sum(r.events for r in runs):,}/{sum(r.expected_events for r in runs):,}"
            f"  gaps {sum(r.gaps for r in runs)}  replays {sum(r.replays for r in runs)}"
            f"  purges {sum(r.purges for r in runs)}  errors {sum(r.errors for r in runs)}"
            f"  publisher waiting {statistics.median(r.publisher_wait_share for r in runs) * 100:.0f}%"
        )
        if mode == "redis":
            line += (
                f"  peak queue {max(r.peak_pending for r in runs):,} blocks"
                f"  dropped {sum(r.dropped_writes for r in runs)}"
            )
        print(line)


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--batches", type=int, default=20_000, help="batches per run, all engines together")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--window", type=int, default=4000, help="events the publisher may be ahead of the sink"
    )
    parser.add_argument(
        "--modes", nargs="+", choices=("null", "memory", "redis"), default=["null", "memory", "redis"]
    )
    parser.add_argument("--run-timeout", type=float, default=30.0)
    asyncio.run(main(parser.parse_args()))


if __name__ == "__main__":
    cli()
