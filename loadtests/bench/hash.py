"""Benchmark vLLM-exact block hashing (``VllmBlockHasher.keys``) for a 4k-token prompt (a script, not a test).

For each supported algo and block size, hashes a fresh random 4096-token prompt per call (so
nothing is cached between calls) and prints p50/p99 µs per prompt and µs per block.

    python -m loadtests.bench.hash [--tokens 4096] [--calls 300]
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from kvindex.vllm_hash import HashAlgo, VllmBlockHasher


def time_keys(hasher: VllmBlockHasher, prompts: list[list[int]]) -> np.ndarray:
    """Seconds per ``hasher.keys`` call, one call per prompt."""
    hasher.keys(prompts[0])  # warm-up: first-call costs are not per-request costs
    out = np.empty(len(prompts))
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        hasher.keys(prompt)
        out[i] = time.perf_counter() - start
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens")
    parser.add_argument("--calls", type=int, default=300, help="timed prompts per row")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    # Token ids of a ~150k-entry vocabulary, like recent Llama/Qwen tokenizers.
    prompts = [[rng.randrange(150_000) for _ in range(args.tokens)] for _ in range(args.calls)]
    print(f"{'algo':<12} {'block':>5} {'blocks':>6} {'p50 µs':>9} {'p99 µs':>9} {'µs/block':>9}")
    for algo in HashAlgo:
        for block_size in (16, 64):
            hasher = VllmBlockHasher(algo, block_size)
            secs = time_keys(hasher, prompts) * 1e6
            n_blocks = args.tokens // block_size
            p50, p99 = np.percentile(secs, [50, 99])
            per_block = p50 / n_blocks
            print(f"{algo.value:<12} {block_size:>5} {n_blocks:>6} {p50:>9.0f} {p99:>9.0f} {per_block:>9.2f}")


if __name__ == "__main__":
    main()
