"""Benchmark ``Picker.pick()`` (a script, not a test): p50/p99 in µs.

Pools of 8, 64 and 512 endpoints (half prefill, half decode) with scraped metrics, a prefix index
warm with 1,000,000 blocks, and 4k-token prompts (256 blocks of 16 tokens) of two kinds:

* ``shared``: the first 192 blocks are one of 8 shared system prompts held by some pods, the
  last 64 are new (chat/RAG traffic);
* ``novel``: all 256 blocks are new (worst case for recording the pick in the index).

Each pick is released at once, so the pool stays at the same load. ``pick`` covers the whole
``pick()``: candidate gather, prefix lookup, the P×D cost matrix, argmin, fallbacks, reservation,
as the service picks (``explain=False``: no breakdown unless debug headers or a traced request
will read it).
``record`` is the optimistic index update that the service runs right after the pick returns
(``loop.call_soon``), timed separately; ``total`` is both.

    python -m loadtests.bench.pick [--picks 3000] [--rounds 5]

``--against TREE`` compares this checkout's pick with another checkout's (``git worktree add
/tmp/base <commit>``) on a machine other work shares: one worker process per tree, each with the
same pools and prompts, run a batch of picks in turn, so both see the same load; the table gives
the median over batches of each batch's p50 and p99, and new ÷ old.

    python -m loadtests.bench.pick --against /tmp/base [--sizes 8 64 512] [--batches 20]

``--spin SECONDS`` builds the first pool of ``--sizes``, prints ``spinning`` and picks (shared
and novel prompts in turn, each released) for that long: a steady process for a sampling profiler
to attach to once the index is built (docs/benchmarks.md, "pick() hot path", has the command).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import numpy as np

from kvindex.memory import MemoryPrefixIndex
from router.request.types import EngineMetrics, RouteRequest
from router.scheduling.picker import Picker
from router.server.compose import picker_from, pool_from
from router.server.config import parse_config

INDEX_BLOCKS = 1_000_000
PROMPT_BLOCKS = 256
SHARED_BLOCKS = 192


Deferred = list[tuple]


def build(n: int, rng: np.random.Generator) -> tuple[Picker, list[np.ndarray], Deferred]:
    endpoints = [
        {
            "address": f"10.{i // 250}.{i % 250}.1:8000",
            "role": "prefill" if i % 2 else "decode",
            "link": f"rack{i % 4}",
        }
        for i in range(n)
    ]
    config = parse_config(
        {"model": "m", "endpoints": endpoints, "index": {"capacity_blocks_per_endpoint": INDEX_BLOCKS // n}}
    )
    pool = pool_from(config)
    now = time.monotonic() + 3600  # fresh for the whole run
    for endpoint in pool.endpoints.values():
        metrics = EngineMetrics(
            16,
            32768,
            running=float(rng.integers(0, 32)),
            waiting=float(rng.integers(0, 4)),
            kv_usage=float(rng.uniform(0, 0.7)),
            kv_capacity_tokens=16.0 * 32768,
        )
        pool.apply_metrics(endpoint, metrics, now)
    pool.stale_after_s = 1e9
    index = MemoryPrefixIndex(INDEX_BLOCKS // n, whole_prompts=True)  # as compose.build makes it
    systems = [rng.integers(0, 2**63, size=SHARED_BLOCKS, dtype=np.uint64) for _ in range(8)]
    for slot in range(n):
        index.record(slot, rng.integers(0, 2**63, size=INDEX_BLOCKS // n - SHARED_BLOCKS, dtype=np.uint64))
        index.record(slot, systems[slot % 8])
    # The service runs the optimistic record right after the pick; here it is timed separately.
    deferred: Deferred = []
    picker = picker_from(config, pool, index, seed=0, defer=lambda fn, *args: deferred.append((fn, args)))
    return picker, systems, deferred


def time_picks(
    picker: Picker, prompts: list[np.ndarray], deferred: Deferred, rounds: int
) -> dict[str, tuple[float, float]]:
    """Median over rounds of (p50, p99) µs for pick, record and both."""
    stats: dict[str, list[tuple[float, float]]] = {"pick": [], "record": [], "total": []}
    samples = {name: np.empty(len(prompts)) for name in stats}
    for _ in range(rounds):
        for i, keys in enumerate(prompts):
            request = RouteRequest(model="m", prompt_tokens=4096, max_tokens=256, block_keys=keys, body={})
            t0 = time.perf_counter_ns()
            decision = picker.pick(request, explain=False)
            t1 = time.perf_counter_ns()
            for fn, args in deferred:
                fn(*args)
            t2 = time.perf_counter_ns()
            deferred.clear()
            decision.reservation.release()
            samples["pick"][i], samples["record"][i], samples["total"][i] = t1 - t0, t2 - t1, t2 - t0
        for name, values in samples.items():
            stats[name].append((np.percentile(values, 50) / 1000, np.percentile(values, 99) / 1000))
    return {name: tuple(np.median(np.array(v), axis=0)) for name, v in stats.items()}  # type: ignore[misc]


POOL_SIZES = (8, 64, 512)
KINDS = ("shared", "novel")


def measure(
    picks: int, rounds: int, sizes: Sequence[int] = POOL_SIZES, seed: int = 0
) -> Iterator[tuple[int, str, dict[str, tuple[float, float]]]]:
    """``(endpoints, prompt kind, time_picks' stats)`` per cell, yielded as each is measured (the
    CLI prints a row at a time; ``loadtests.bench.report`` keeps them)."""
    rng = np.random.default_rng(seed)
    for n in sizes:
        picker, systems, deferred = build(n, rng)
        for kind in KINDS:
            prompts = []
            for i in range(picks):
                fresh = rng.integers(0, 2**63, size=PROMPT_BLOCKS, dtype=np.uint64)
                if kind == "shared":
                    fresh[:SHARED_BLOCKS] = systems[i % 8]
                prompts.append(fresh)
            yield n, kind, time_picks(picker, prompts, deferred, rounds)


# A worker for ``--against``: only ``build`` and ``RouteRequest``, which every tree compared has.
# Reads a line per batch, answers with that batch's (p50, p99) µs of pick per prompt kind.
_WORKER = """
import inspect, json, sys, time
import numpy as np
from loadtests.bench.pick import PROMPT_BLOCKS, SHARED_BLOCKS, build
from router.request.types import RouteRequest
n, picks = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
picker, systems, deferred = build(n, rng)
prompts = {}
for kind in ("shared", "novel"):
    prompts[kind] = [rng.integers(0, 2**63, size=PROMPT_BLOCKS, dtype=np.uint64) for _ in range(picks)]
    if kind == "shared":
        for i, keys in enumerate(prompts[kind]):
            keys[:SHARED_BLOCKS] = systems[i % 8]
# As the service picks: no breakdown unless something will read it (trees before that always made one).
quiet = {"explain": False} if "explain" in inspect.signature(picker.pick).parameters else {}
print("ready", flush=True)
for _ in sys.stdin:
    out = {}
    for kind, batch in prompts.items():
        took = np.empty(len(batch))
        for i, keys in enumerate(batch):
            request = RouteRequest(model="m", prompt_tokens=4096, max_tokens=256, block_keys=keys, body={})
            t0 = time.perf_counter_ns()
            decision = picker.pick(request, **quiet)
            took[i] = time.perf_counter_ns() - t0
            deferred.clear()
            decision.reservation.release()
        out[kind] = (np.percentile(took, 50) / 1000, np.percentile(took, 99) / 1000)
    print(json.dumps(out), flush=True)
"""


def against(base: str, sizes: Sequence[int], picks: int, batches: int) -> None:
    """Print old (``base``) and new (this checkout) pick µs per size, alternating batches."""
    trees = {"old": base, "new": "."}
    print(
        f"pick() µs, {base} (old) vs this checkout (new), median of {batches} alternating batches of {picks}"
    )
    heads = ("old p50", "old p99", "new p50", "new p99", "p50 new/old", "p99 new/old")
    print(f"{'endpoints':>9}  {'prompt':>6}" + "".join(f"  {h:>{max(8, len(h))}}" for h in heads))
    for n in sizes:
        workers = {
            name: subprocess.Popen(
                [sys.executable, "-c", _WORKER, str(n), str(picks)],
                cwd=tree,
                env={"PYTHONPATH": ".", "PATH": "/usr/bin:/bin"},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for name, tree in trees.items()
        }
        results: dict[str, list[dict[str, list[float]]]] = {name: [] for name in workers}
        for worker in workers.values():
            assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
        for batch in range(batches):
            order = list(workers.items()) if batch % 2 == 0 else list(workers.items())[::-1]
            for name, worker in order:
                assert worker.stdin is not None and worker.stdout is not None
                worker.stdin.write("go\n")
                worker.stdin.flush()
                results[name].append(json.loads(worker.stdout.readline()))
        for worker in workers.values():
            worker.communicate("")
        for kind in KINDS:
            cells = [statistics.median(r[kind][q] for r in results[name]) for name in trees for q in (0, 1)]
            ratios = (cells[2] / cells[0], cells[3] / cells[1])
            print(
                f"{n:>9}  {kind:>6}"
                + "".join(f"  {c:>8.1f}" for c in cells)
                + "".join(f"  {r:>10.2f}×" for r in ratios),
                flush=True,
            )


def spin(n: int, seconds: float) -> None:
    """Pick without pause on an ``n``-endpoint pool for ``seconds`` (for a profiler)."""
    rng = np.random.default_rng(0)
    picker, systems, deferred = build(n, rng)
    prompts = [rng.integers(0, 2**63, size=PROMPT_BLOCKS, dtype=np.uint64) for _ in range(1000)]
    for i, keys in enumerate(prompts[::2]):
        keys[:SHARED_BLOCKS] = systems[i % 8]
    print("spinning", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for keys in prompts:
            request = RouteRequest(model="m", prompt_tokens=4096, max_tokens=256, block_keys=keys, body={})
            decision = picker.pick(request, explain=False)
            deferred.clear()
            decision.reservation.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--picks", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", metavar="TREE", help="compare with another checkout's pick")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(POOL_SIZES))
    parser.add_argument("--batches", type=int, default=20, help="with --against: batches per tree")
    parser.add_argument("--spin", type=float, metavar="SECONDS", help="only pick, for a profiler")
    args = parser.parse_args()
    if args.spin:
        spin(args.sizes[0], args.spin)
        return
    if args.against:
        against(args.against, args.sizes, min(args.picks, 500), args.batches)
        return
    print(f"pick() latency, 4k-token prompts, index warm with {INDEX_BLOCKS:,} blocks")
    header = "".join(f"  {name + ' p50':>10}  {name + ' p99':>10}" for name in ("pick", "record", "total"))
    print(f"{'endpoints':>9}  {'prompt':>6}{header}")
    for n, kind, stats in measure(args.picks, args.rounds, args.sizes):
        cells = "".join(f"  {p50:>10.1f}  {p99:>10.1f}" for p50, p99 in stats.values())
        print(f"{n:>9}  {kind:>6}{cells}")


if __name__ == "__main__":
    main()
