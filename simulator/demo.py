"""``pd-router demo``: a simulated 2 prefill + 2 decode cluster, the proxy, and a mixed workload
routed twice: by least-loaded balancing, then by pd-router.

Everything runs in this process on 127.0.0.1: four simulated vLLM engines (two racks, a fast link
inside a rack and a slow one across), the router's proxy in front of them, and an open-loop
client. Each policy gets a fresh cluster and the same requests at the same times. It prints both
side by side and what pd-router chose and why, then exits (``--keep`` keeps pd-router serving).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from router.server.app import App
from router.server.cli import run
from router.server.compose import build
from router.server.config import LinksConfig, PoolConfig, parse_config
from simulator.cluster import engine_model_for, link_cost_from
from simulator.engine import EngineSpec, SimCluster, TimeModel
from simulator.workloads.client import Result, Summary, run_workload
from simulator.workloads.generate import WorkItem, Workload, shared_prefix, text

DEMO_LINKS = {
    "same": {"latency_ms": 0.2, "bandwidth_gbytes_per_s": 25.0},
    "default": {"latency_ms": 2.0, "bandwidth_gbytes_per_s": 2.0},
}
DEMO_TIME = TimeModel(speed=1.0)
KV_BYTES_PER_TOKEN = 131072
JOINT, BASELINE = "joint", "least-loaded"  # picker.policy: pd-router's joint choice, the baseline
SHOWN = {JOINT: "pd-router", BASELINE: "least-loaded"}
DOC_SHARE = 1 / 3  # of the requests: a cold document rather than a question on a shared prompt


def demo_specs() -> list[EngineSpec]:
    return [
        EngineSpec("prefill-a", "prefill", link="rack-a", time=DEMO_TIME),
        EngineSpec("prefill-b", "prefill", link="rack-b", time=DEMO_TIME),
        EngineSpec("decode-a", "decode", link="rack-a", time=DEMO_TIME),
        EngineSpec("decode-b", "decode", link="rack-b", time=DEMO_TIME),
    ]


def demo_config(cluster: SimCluster, port: int, policy: str = JOINT) -> PoolConfig:
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
            "picker": {"policy": policy},
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


@dataclass(frozen=True, slots=True)
class Run:
    """One policy's pass over the demo workload: the client's view and the engines' counters."""

    policy: str
    summary: Summary
    computed_tokens: int  # prompt tokens the engines computed (the rest came from a cache or a transfer)
    links: dict[str, str]  # engine name -> rack label

    @property
    def computed_share(self) -> float:
        sent = sum(r.prompt_tokens for r in self.summary.ok)
        return self.computed_tokens / sent if sent else 0.0

    def pairs(self) -> tuple[int, int]:
        """Requests answered by a P/D pair, and how many of those moved their KV across racks."""
        pairs = [r for r in self.summary.ok if r.prefill]
        across = sum(1 for r in pairs if self.links.get(r.prefill) != self.links.get(r.decode))
        return len(pairs), across


def demo_workload(requests: int, seed: int) -> Workload:
    """Questions on 8 shared 2k-token system prompts, and one request in three a cold 3k-token
    document to summarise at length: warm prompts reward staying where the prefix is cached, cold
    ones a prefill pod in the decode pod's own rack."""
    rng = random.Random(seed + 1)
    chat = shared_prefix(requests, n_prefixes=8, prefix_tokens=2048, suffix_tokens=48, rate=20.0, seed=seed)
    items = []
    for item in chat.items:
        if rng.random() < DOC_SHARE:
            body = {**item.body, "prompt": "Summarise this document:\n" + text(rng, 3000), "max_tokens": 128}
            item = WorkItem(item.at_s, item.path, body)
        items.append(item)
    return Workload("demo", items)


def _ms(summary: Summary, attr: str, digits: int) -> str:
    return f"{summary.pct(attr, 0.5) * 1000:.{digits}f} / {summary.pct(attr, 0.99) * 1000:.{digits}f} ms"


def render(ours: Run, baseline: Run | None = None) -> str:
    runs = [ours] if baseline is None else [ours, baseline]

    def row(name: str, value: Callable[[Run], str]) -> str:
        return f"  {name.ljust(24)}" + "".join(value(run).ljust(20) for run in runs).rstrip()

    def pairs(run: Run) -> str:
        n, across = run.pairs()
        return f"{n} ({across} cross-rack)"

    lines = [
        "",
        "pd-router demo — shared system prompts and cold documents, 2 prefill + 2 decode pods (simulated)",
        "",
        row("", lambda run: run.policy),
        row("requests", lambda run: f"{len(run.summary.ok)} ok / {len(run.summary.results)} sent"),
        row("TTFT p50 / p99", lambda run: _ms(run.summary, "ttft_s", 1)),
        row("TPOT p50 / p99", lambda run: _ms(run.summary, "tpot_s", 2)),
        row("prompt tokens computed", lambda run: f"{run.computed_share:.1%}"),
        row("P/D pairs", pairs),
        row("output throughput", lambda run: f"{run.summary.throughput:.0f} tokens/s"),
    ]
    if baseline is not None:
        ratio = [ours.summary.pct("ttft_s", q) / baseline.summary.pct("ttft_s", q) for q in (0.5, 0.99)]
        lines += [
            "",
            f"  Same requests: pd-router's TTFT is {ratio[0]:.2f}× least-loaded's at p50 "
            f"and {ratio[1]:.2f}× at p99.",
        ]
    example: dict[str, str] = {}
    for result in ours.summary.ok:
        example[f"{result.prefill or '-'} -> {result.decode}"] = result.reason  # the latest: a warm cache
    lines += ["", "  pd-router's routes (prefill -> decode)   requests  why (one example)"]
    lines += [
        f"  {pair.ljust(38)}  {n:>8}  {example[pair]}" for pair, n in ours.summary.pairs().most_common()
    ]
    return "\n".join(lines) + "\n"


@contextlib.asynccontextmanager
async def serving(policy: str, port: int, seed: int) -> AsyncIterator[tuple[SimCluster, str]]:
    """The four engines and the proxy in front of them, routing with ``policy``: (cluster, base URL)."""
    async with SimCluster(demo_specs(), link_cost_from(LinksConfig.model_validate(DEMO_LINKS))) as cluster:
        config = demo_config(cluster, port, policy)
        async with App(build(config, seed=seed)) as app:
            yield cluster, f"http://127.0.0.1:{app.proxy_port}"


async def measure(policy: str, cluster: SimCluster, base: str, workload: Workload) -> Run:
    """The workload through the proxy at ``base``, and what the cluster's engines computed for it."""
    sys.stderr.write(f"{SHOWN[policy]} proxy on {base}; sending {len(workload.items)} requests\n")
    summary = await run_workload(base, workload, on_done=Progress(len(workload.items)))
    engines = cluster.engines.values()
    computed = sum(engine.stats.prefill_tokens_computed for engine in engines)
    return Run(SHOWN[policy], summary, computed, {engine.spec.name: engine.spec.link for engine in engines})


async def run_demo(
    requests: int = 120, keep: bool = False, port: int = 0, seed: int = 0, baseline: bool = True
) -> int:
    """The demo workload balanced by least-loaded (unless not ``baseline``), then routed by
    pd-router through a fresh cluster: the same requests at the same times."""
    workload = demo_workload(requests, seed)
    balanced = None
    if baseline:
        async with serving(BASELINE, 0, seed) as (cluster, base):
            balanced = await measure(BASELINE, cluster, base, workload)
    async with serving(JOINT, port, seed) as (cluster, base):
        ours = await measure(JOINT, cluster, base, workload)
        sys.stdout.write(render(ours, balanced))
        if keep:
            sys.stdout.write(
                f"\nServing until Ctrl-C. Try:\n  curl -s {base}/v1/completions"
                " -H 'content-type: application/json'"
                ' -d \'{"model": "sim-model", "prompt": "Hello", "max_tokens": 8}\'\n'
                f"  curl -s {base}/metrics | grep pd_router_\n"
            )
            sys.stdout.flush()
            await asyncio.Event().wait()
    runs = (ours,) if balanced is None else (ours, balanced)
    return 0 if all(len(run.summary.ok) == len(run.summary.results) for run in runs) else 1


def command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``pd-router demo`` (joins the CLI through the ``pd_router.commands`` entry points)."""
    demo = sub.add_parser(
        "demo", help="simulated 2 prefill + 2 decode cluster, proxy and a workload, against least-loaded"
    )
    demo.add_argument("--requests", type=_at_least_one, default=120)
    demo.add_argument("--port", type=int, default=0, help="proxy port (0: any free port)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--keep", action="store_true", help="keep serving after the run, for curl")
    demo.add_argument(
        "--no-baseline", dest="baseline", action="store_false", help="skip the least-loaded run"
    )
    demo.set_defaults(run=_run_demo, default_log_level="warning")


def _at_least_one(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a whole number of requests, at least 1, not {value!r}")
    return n


def _run_demo(args: argparse.Namespace) -> int:
    return run(
        run_demo(
            requests=args.requests, keep=args.keep, port=args.port, seed=args.seed, baseline=args.baseline
        )
    )
