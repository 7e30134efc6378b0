"""Benchmark ``MemoryPrefixIndex.match`` on a warm index (a script, not a test).

For 64 and 512 slots, fills the index to 1,000,000 (slot, block) entries, then times ``match`` for a
256-block prompt (a 4k-token prompt at 16 tokens per block) against 8, 64 and 512 candidate slots
in three cases:

* ``miss``: no slot holds block 0 (the walk stops at once);
* ``shared``: every holder has the prompt's first 64 blocks (a shared system prompt);
* ``deep``: each candidate holds a prefix of random length 0..256 of the prompt, so the walk runs
  all 256 blocks and decodes a drop-out at many depths (the worst case).

Prints p50/p99 in µs (median of each over several rounds) and the index memory.

    python -m loadtests.bench.kvindex [--rounds 7] [--calls 2000]
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from kvindex.memory import MemoryPrefixIndex

TOTAL_BLOCKS = 1_000_000
PROMPT_BLOCKS = 256
SHARED_BLOCKS = 64


def build(n_slots: int, rng: np.random.Generator) -> tuple[MemoryPrefixIndex, dict[str, np.ndarray], int]:
    """A full index plus the prompts of each case; returns (index, prompts, traced bytes)."""
    per_slot = TOTAL_BLOCKS // n_slots
    index = MemoryPrefixIndex(per_slot, max_slots=4096)
    deep = rng.integers(0, 2**64, size=PROMPT_BLOCKS, dtype=np.uint64)
    shared = rng.integers(0, 2**64, size=PROMPT_BLOCKS, dtype=np.uint64)
    miss = rng.integers(0, 2**64, size=PROMPT_BLOCKS, dtype=np.uint64)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for slot in range(n_slots):
        # Filler first (least recent), then the prompts' prefixes, so eviction never drops them.
        index.record(slot, rng.integers(0, 2**64, size=per_slot, dtype=np.uint64))
        index.record(slot, shared[:SHARED_BLOCKS])
        index.record(slot, deep[: int(rng.integers(0, PROMPT_BLOCKS + 1))])
    traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return index, {"miss": miss, "shared": shared, "deep": deep}, traced


def time_match(
    index: MemoryPrefixIndex, keys: np.ndarray, slots: np.ndarray, rounds: int, calls: int
) -> tuple[float, float]:
    p50s: list[float] = []
    p99s: list[float] = []
    samples = np.empty(calls, dtype=np.float64)
    for _ in range(rounds):
        for i in range(calls):
            t0 = time.perf_counter_ns()
            index.match(keys, slots)
            samples[i] = time.perf_counter_ns() - t0
        p50s.append(float(np.percentile(samples, 50)) / 1000)
        p99s.append(float(np.percentile(samples, 99)) / 1000)
    return float(np.median(p50s)), float(np.median(p99s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    rng = np.random.default_rng(42)

    print(f"match latency, {PROMPT_BLOCKS}-block prompt, index warm with {TOTAL_BLOCKS:,} entries")
    print(f"{'slots':>6} {'cands':>6} {'case':>7} {'p50 µs':>8} {'p99 µs':>8}")
    memory: list[tuple[int, int, int, int]] = []
    for n_slots in (64, 512):
        index, prompts, traced = build(n_slots, rng)
        memory.append((n_slots, len(index), traced, index.memory_bytes()))
        for n_cands in (8, 64, 512):
            # Candidates beyond n_slots are valid slots the index has never seen (match 0).
            slots = rng.permutation(max(n_slots, n_cands))[:n_cands].astype(np.int32)
            for case, keys in prompts.items():
                p50, p99 = time_match(index, keys, slots, args.rounds, args.calls)
                print(f"{n_slots:>6} {n_cands:>6} {case:>7} {p50:>8.1f} {p99:>8.1f}")
        del index

    print()
    print(f"{'slots':>6} {'entries':>10} {'traced MB':>10} {'B/entry':>8} {'estimate MB':>12}")
    for n_slots, entries, traced, estimate in memory:
        per_entry = traced / entries
        print(f"{n_slots:>6} {entries:>10,} {traced / 1e6:>10.1f} {per_entry:>8.1f} {estimate / 1e6:>12.1f}")


if __name__ == "__main__":
    main()
