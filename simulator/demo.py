"""``pd-router demo``: a simulated 2 prefill + 2 decode cluster, the proxy, a shared-prefix run.

Everything runs in this process on 127.0.0.1: four simulated vLLM engines (two racks, a fast link
inside a rack and a slow one across), the router's proxy in front of them, and an open-loop
client. It prints what the router chose and why, then exits (``--keep`` keeps serving).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from router.server.app import App
from router.server.cli import run
from router.server.compose import build
from router.server.config import LinksConfig, PoolConfig, parse_config
from simulator.cluster import engine_model_for, link_cost_from
from simulator.engine import EngineSpec, SimCluster, TimeModel
from simulator.workloads.client import Result, Summary, run_workload
from simulator.workloads.generate import shared_prefix

DEMO_LINKS = {
    "same": {"latency_ms": 0.2, "bandwidth_gbytes_per_s": 25.0},
    "default": {"latency_ms": 2.0, "bandwidth_gbytes_per_s": 2.0},
}
DEMO_TIME = TimeModel(speed=1.0)
KV_BYTES_PER_TOKEN = 131072


def demo_specs() -> list[EngineSpec]:
    return [
        EngineSpec("prefill-a", "prefill", link="rack-a", time=DEMO_TIME),
        EngineSpec("prefill-b", "prefill", link="rack-b", time=DEMO_TIME),
        EngineSpec("decode-a", "decode", link="rack-a", time=DEMO_TIME),
        EngineSpec("decode-b", "decode", link="rack-b", time=DEMO_TIME),
    ]


def demo_config(cluster: SimCluster, port: int) -> PoolConfig:
    endpoints = [
        {"address": cluster.address(name), "role": e.spec.role, "link": e.spec.link, "name": name}
        for name, e in cluster.engines.items()
    ]
    return parse_config(
        {
            "model": "sim-model",
            "endpoints": endpoints,
            "links": DEMO_LINKS,
            "engine": engine_model_for(DEMO_TIME, KV_BYTES_PER_TOKEN),
            "slo": {"ttft_ms": 500, "tpot_ms": 50},
            "scrape": {"interval_ms": 200, "stale_after_ms": 2000},
            "proxy": {"port": port, "debug_headers": True},
        }
    )


class Progress:
    def __init__(self, total: int, width: int = 40) -> None:
        self.total = total
        self.width = width
        self.done = 0
        self.failed = 0

    def __call__(self, result: Result) -> None:
        self.done += 1
        self.failed += not result.ok
        tty = sys.stderr.isatty()
        # A terminal gets one redrawn line; a log file gets a line per tenth of the run.
        if not tty and self.done % max(1, self.total // 10) and self.done != self.total:
            return
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        end = "\n" if not tty or self.done == self.total else ""
        sys.stderr.write(f"\r  [{bar}] {self.done}/{self.total} requests, {self.failed} failed{end}")
        sys.stderr.flush()


def render(summary: Summary) -> str:
    ms = 1000.0
    rows = [
        ("requests", f"{len(summary.ok)} ok / {len(summary.results)} sent"),
        (
            "TTFT p50 / p99",
            f"{summary.pct('ttft_s', 0.5) * ms:.1f} / {summary.pct('ttft_s', 0.99) * ms:.1f} ms",
        ),
        (
            "TPOT p50 / p99",
            f"{summary.pct('tpot_s', 0.5) * ms:.2f} / {summary.pct('tpot_s', 0.99) * ms:.2f} ms",
        ),
        ("prefix-cache hit rate", f"{summary.hit_rate:.1%} of prompt tokens"),
        ("output throughput", f"{summary.throughput:.0f} tokens/s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["", "pd-router demo — shared-prefix workload on 2 prefill + 2 decode (simulated)", ""]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    example: dict[str, str] = {}
    for result in summary.ok:
        example[f"{result.prefill or '-'} -> {result.decode}"] = result.reason  # the latest: a warm cache
    lines += ["", "  chosen (prefill -> decode)   requests  why (one example)"]
    lines += [f"  {pair.ljust(27)}  {n:>8}  {example[pair]}" for pair, n in summary.pairs().most_common()]
    return "\n".join(lines) + "\n"


async def run_demo(requests: int = 120, keep: bool = False, port: int = 0, seed: int = 0) -> int:
    async with SimCluster(demo_specs(), link_cost_from(LinksConfig.model_validate(DEMO_LINKS))) as cluster:
        config = demo_config(cluster, port)
        async with App(build(config, seed=seed)) as app:
            base = f"http://127.0.0.1:{app.proxy_port}"
            sys.stderr.write(f"pd-router proxy on {base}; sending {requests} requests\n")
            workload = shared_prefix(
                requests, n_prefixes=8, prefix_tokens=2048, suffix_tokens=48, rate=20.0, seed=seed
            )
            summary = await run_workload(base, workload, on_done=Progress(requests))
            sys.stdout.write(render(summary))
            if keep:
                sys.stdout.write(
                    f"\nServing until Ctrl-C. Try:\n  curl -s {base}/v1/completions"
                    " -H 'content-type: application/json'"
                    ' -d \'{"model": "sim-model", "prompt": "Hello", "max_tokens": 8}\'\n'
                    f"  curl -s {base}/metrics | grep pd_router_\n"
                )
                sys.stdout.flush()
                await asyncio.Event().wait()
            return 0 if len(summary.ok) == len(summary.results) else 1


def command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``pd-router demo`` (joins the CLI through the ``pd_router.commands`` entry points)."""
    demo = sub.add_parser("demo", help="simulated 2 prefill + 2 decode cluster, proxy and a workload")
    demo.add_argument("--requests", type=int, default=120)
    demo.add_argument("--port", type=int, default=0, help="proxy port (0: any free port)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--keep", action="store_true", help="keep serving after the run, for curl")
    demo.set_defaults(run=_run_demo, default_log_level="warning")


def _run_demo(args: argparse.Namespace) -> int:
    return run(run_demo(requests=args.requests, keep=args.keep, port=args.port, seed=args.seed))
