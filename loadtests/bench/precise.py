"""Approximate vs precise prefix locality on a cluster where guessing goes wrong (a script).

Four simulated ``prefill-decode`` engines tokenize with a real (tiny, trained here) tokenizer, key
their prefix caches by vLLM-exact block hashes and publish vLLM KV events. The workload has more
shared prefixes than the engines' KV can hold (evictions) and one engine restarts half-way (its
cache is lost). The same seeded requests at the same times go through:

* ``approximate``: the router remembers where it sent each prompt (an LRU per engine);
* ``precise``: the router follows the engines' own KV events (and falls back to the approximate
  guess only for engines whose event stream is incomplete).

Printed per mode: TTFT p50/p99, the engines' prefix-cache hit rate, and how often the router's
predicted cached prefix was wrong by more than a block ("misses": it expected a hit that was not
there). ``python -m loadtests.bench.precise [--requests 600] [--rate 30]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import tempfile
from pathlib import Path
from typing import Any

from router.server.app import App
from router.server.compose import build
from router.server.config import parse_config
from simulator.cluster import engine_model_for
from simulator.engine import EngineSpec, SimCluster, TimeModel
from simulator.tiny_tokenizer import train_tiny_tokenizer
from simulator.workloads.client import Summary, run_workload
from simulator.workloads.generate import shared_prefix

BLOCKS_PER_ENGINE = 512  # 8k tokens of KV: the 24 prefixes below (~24k tokens) do not fit on one
PREFIXES, PREFIX_TOKENS, SUFFIX_TOKENS = 24, 768, 48
_CACHED = re.compile(r": (\d+)/(\d+) prompt tokens cached")


def specs(tokenizer: str, time_model: TimeModel) -> list[EngineSpec]:
    return [
        EngineSpec(
            f"e{i}",
            "prefill-decode",
            tokenizer=tokenizer,
            kv_events=True,
            num_gpu_blocks=BLOCKS_PER_ENGINE,
            time=time_model,
        )
        for i in range(4)
    ]


def config(cluster: SimCluster, tokenizer: str, time_model: TimeModel, precise: bool) -> Any:
    endpoints = []
    for name, engine in cluster.engines.items():
        endpoint: dict[str, Any] = {"address": cluster.address(name), "name": name}
        if precise:
            endpoint["kv_events"] = {
                "endpoint": engine.kv_events_endpoint,
                "replay_endpoint": engine.kv_replay_endpoint,
            }
        endpoints.append(endpoint)
    data: dict[str, Any] = {
        "model": "sim-model",
        "endpoints": endpoints,
        "engine": engine_model_for(time_model, 131072),
        "slo": {"ttft_ms": 500, "tpot_ms": 50},
        "scrape": {"interval_ms": 200},
        "proxy": {"port": 0, "debug_headers": True},
        # The approximate guess may remember as much as the engines could hold.
        "index": {"capacity_blocks_per_endpoint": BLOCKS_PER_ENGINE},
    }
    if precise:
        data["index"]["precise"] = {"tokenizer": tokenizer, "rebuild_after_s": 2.0}
    return parse_config(data)


async def run_mode(precise: bool, tokenizer: str, requests: int, rate: float, seed: int) -> Summary:
    time_model = TimeModel(speed=1.0)
    async with contextlib.AsyncExitStack() as stack:
        cluster = await stack.enter_async_context(SimCluster(specs(tokenizer, time_model)))
        app = await stack.enter_async_context(
            App(build(config(cluster, tokenizer, time_model, precise), seed=seed))
        )
        if precise:
            await _until_covered(app, cluster)
        workload = shared_prefix(
            requests, n_prefixes=PREFIXES, prefix_tokens=PREFIX_TOKENS, suffix_tokens=SUFFIX_TOKENS,
            max_tokens=16, rate=rate, seed=seed,
        )  # fmt: skip
        restart_at = workload.items[len(workload.items) // 2].at_s

        async def restart() -> None:
            await asyncio.sleep(restart_at)
            await cluster.revive("e0")  # a crash + restart: the engine's cache is gone

        restarting = asyncio.create_task(restart())
        base = f"http://127.0.0.1:{app.proxy_port}"
        summary = await run_workload(base, workload, name="precise" if precise else "approximate")
        await restarting
        return summary


async def _until_covered(app: App, cluster: SimCluster) -> None:
    slots = [e.slot for e in app.parts.pool.endpoints.values()]
    for _ in range(500):  # a subscriber misses batches published before it joined: publish until seen
        if app.parts.pool.kv_covered[slots].all():
            return
        for engine in cluster.engines.values():
            engine.reset_prefix_cache()
        await asyncio.sleep(0.01)
    raise RuntimeError("KV events never covered every engine")


def misses(summary: Summary, block_tokens: int = 16) -> float:
    """Share of requests whose predicted cached prefix exceeded the engine's by more than a block."""
    wrong = total = 0
    for result in summary.ok:
        match = _CACHED.search(result.reason)
        if match is None:
            continue
        total += 1
        predicted = int(match.group(1))
        wrong += predicted > result.cached_tokens + block_tokens
    return wrong / total if total else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--rate", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = str(train_tiny_tokenizer(Path(tmp) / "tokenizer.json"))
        results = [
            asyncio.run(run_mode(p, tokenizer, args.requests, args.rate, args.seed)) for p in (False, True)
        ]
    print(
        f"\napproximate vs precise locality — 4 prefill-decode engines × {BLOCKS_PER_ENGINE * 16} KV tokens, "
        f"{PREFIXES} prefixes × {PREFIX_TOKENS} tokens, {args.requests} requests at {args.rate:g} req/s, "
        "engine e0 restarts half-way"
    )
    print(f"  {'mode':12} {'ok':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'hit rate':>9} {'misses':>7}")
    for s in results:
        print(
            f"  {s.name:12} {len(s.ok):>4}/{len(s.results):<4} {s.pct('ttft_s', 0.5) * 1000:>7.1f}ms "
            f"{s.pct('ttft_s', 0.99) * 1000:>7.1f}ms {s.hit_rate:>8.1%} {misses(s):>6.1%}"
        )


if __name__ == "__main__":
    main()
