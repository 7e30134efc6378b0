"""Benchmark ``parse_vllm_metrics`` against prometheus_client's parser (a script, not a test).

Parses ``tests/data/vllm_metrics.txt`` (a two-engine vLLM exposition with histograms, ~320
lines) and prints µs per parse, p50/p99 over many runs. The prometheus_client column is the
cost of the same extraction through ``text_string_to_metric_families`` (every family parsed,
then the wanted samples picked out), i.e. what a generic parser would cost per scrape.

    python -m loadtests.bench.scrape [--runs 3000]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from router.observe.scrape import parse_vllm_metrics

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "data" / "vllm_metrics.txt"
WANTED = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:cache_config_info",
}


def with_prometheus_client(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in WANTED:
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def timings(fn: Callable[[str], object], text: str, runs: int) -> tuple[float, float]:
    samples = np.empty(runs, dtype=np.float64)
    for i in range(runs):
        t0 = time.perf_counter_ns()
        fn(text)
        samples[i] = time.perf_counter_ns() - t0
    return float(np.percentile(samples, 50)) / 1000, float(np.percentile(samples, 99)) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3000)
    args = parser.parse_args()
    text = FIXTURE.read_text()
    lines = text.count("\n")
    print(f"fixture: {lines} lines, {len(text):,} bytes")
    print(f"{'parser':>28} {'p50 µs':>8} {'p99 µs':>8}")
    results = []
    for label, fn, runs in (
        ("parse_vllm_metrics", parse_vllm_metrics, args.runs),
        ("prometheus_client", with_prometheus_client, max(1, args.runs // 10)),
    ):
        fn(text)  # warm up
        p50, p99 = timings(fn, text, runs)
        results.append(p50)
        print(f"{label:>28} {p50:>8.1f} {p99:>8.1f}")
    print(f"speed-up at p50: {results[1] / results[0]:.0f}x")


if __name__ == "__main__":
    main()
