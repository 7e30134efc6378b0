"""Benchmark block hashing for a 4k-token prompt (a script, not a test): vLLM-exact keys
(``VllmBlockHasher.keys``, precise mode) and the approximate index's keys (``kvindex.hashing``:
a text prompt by characters, or token ids), which every request pays before its pick.

For each vLLM algo and block size, hashes a fresh random 4096-token prompt per call (so nothing is
cached between calls) and prints p50/p99 µs per prompt and µs per block; then the approximate keys
of the same prompts (as 64-character blocks of text, ASCII and not, and as 16-id blocks).

``--against TREE`` times the approximate keys of this checkout and of another checkout's
``kvindex/hashing.py`` (``git worktree add /tmp/base <commit>``) in turns, round after round, in
this one process: the medians of the rounds and new ÷ old.

    python -m loadtests.bench.hash [--tokens 4096] [--calls 300]
    python -m loadtests.bench.hash --against /tmp/base
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from kvindex import hashing
from kvindex.vllm_hash import HashAlgo, VllmBlockHasher

TEXT_BLOCK_CHARS = 64  # 16 tokens of 4 characters
IDS_BLOCK = 16


def time_calls(keys: Callable[[Any], np.ndarray], prompts: Sequence[Any]) -> np.ndarray:
    """Seconds per ``keys`` call, one call per prompt (the first also once before, untimed)."""
    keys(prompts[0])  # warm-up: first-call costs are not per-request costs
    out = np.empty(len(prompts))
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        keys(prompt)
        out[i] = time.perf_counter() - start
    return out


Case = tuple[Callable[[Any], np.ndarray], list[Any], int]  # keys of a prompt, the prompts, block size


def approximate_cases(module: ModuleType, prompts: list[list[int]]) -> dict[str, Case]:
    """``{name: (keys function, its prompts, block size)}`` for ``module``'s approximate keys."""
    ascii_texts = [" ".join(map(str, p))[: 4 * len(p)] for p in prompts]
    other_texts = ["Grüße aus 東京! " + t[14:] for t in ascii_texts]  # as long, not ASCII
    by_text = TEXT_BLOCK_CHARS
    return {
        "text": (lambda t: module.text_block_keys(t, by_text), ascii_texts, by_text),
        "text, non-ASCII": (lambda t: module.text_block_keys(t, by_text), other_texts, by_text),
        "token ids": (lambda p: module.token_block_keys(p, IDS_BLOCK), list(prompts), IDS_BLOCK),
    }


def _module_at(tree: Path) -> ModuleType:
    """Another checkout's ``kvindex/hashing.py``, loaded under a name of its own."""
    path = tree / "kvindex" / "hashing.py"
    if not path.exists():
        raise SystemExit(f"--against {tree}: no kvindex/hashing.py there")
    spec = importlib.util.spec_from_file_location("against_hashing", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def against(tree: Path, prompts: list[list[int]], rounds: int) -> None:
    old = approximate_cases(_module_at(tree), prompts)
    new = approximate_cases(hashing, prompts)
    print(f"approximate keys, {len(prompts[0])}-token prompts: p50 µs per prompt, median of {rounds} rounds")
    print(f"{'keys':<16} {'blocks':>6} {'old':>9} {'new':>9} {'new/old':>8}")
    for name, (keys, cases, block) in new.items():
        old_keys, old_cases, _ = old[name]
        if not np.array_equal(keys(cases[0]), old_keys(old_cases[0])):
            print(f"{name:<16} the two trees' keys differ")
            continue
        before: list[float] = []
        after: list[float] = []
        for _ in range(rounds):  # in turns, so both see the machine alike
            before.append(float(np.median(time_calls(old_keys, old_cases))) * 1e6)
            after.append(float(np.median(time_calls(keys, cases))) * 1e6)
        old_us, new_us = statistics.median(before), statistics.median(after)
        print(
            f"{name:<16} {len(cases[0]) // block:>6} {old_us:>9.1f} {new_us:>9.1f} {new_us / old_us:>7.2f}×"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens")
    parser.add_argument("--calls", type=int, default=300, help="timed prompts per row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--against", metavar="TREE", help="the approximate keys beside another checkout's")
    parser.add_argument("--rounds", type=int, default=7, help="with --against: rounds per row")
    args = parser.parse_args(argv)
    for flag in ("tokens", "calls", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}: at least 1")

    rng = random.Random(args.seed)
    # Token ids of a ~150k-entry vocabulary, like recent Llama/Qwen tokenizers.
    prompts = [[rng.randrange(150_000) for _ in range(args.tokens)] for _ in range(args.calls)]
    if args.against:
        against(Path(args.against), prompts, args.rounds)
        return
    print(f"{'algo':<22} {'block':>5} {'blocks':>6} {'p50 µs':>9} {'p99 µs':>9} {'µs/block':>9}")
    for algo in HashAlgo:
        for block_size in (16, 64):
            hasher = VllmBlockHasher(algo, block_size)
            secs = time_calls(hasher.keys, prompts) * 1e6
            _row(algo.value, block_size, args.tokens // block_size, secs)
    for name, (keys, cases, block) in approximate_cases(hashing, prompts).items():
        _row(f"approx {name}", block, len(cases[0]) // block, time_calls(keys, cases) * 1e6)


def _row(name: str, block: int, blocks: int, secs: np.ndarray) -> None:
    p50, p99 = np.percentile(secs, [50, 99])
    print(f"{name:<22} {block:>5} {blocks:>6} {p50:>9.0f} {p99:>9.0f} {p50 / blocks:>9.2f}")


if __name__ == "__main__":
    main()
