"""Routing quality on the simulated cluster: pd-router vs baseline policies, same seeded workload.

For every scenario, every policy gets exactly the same requests at exactly the same arrival times
(``loadtests.workloads.generate``, seeded) against a FRESH simulated cluster (empty caches, fresh counters),
one policy after another in this process. The router is given the simulator's speed model
(``engine_model_for``) and the same link table the simulator uses, so predictions are fair.

Scenarios:
  a  4 × prefill-decode pods, shared-prefix workload (many long system prompts, short questions)
  b  4 × prefill-decode pods, multi-turn chat (every turn resends the conversation)
  c  2 prefill + 2 decode on two racks (fast links inside a rack, slow across), long shared prefixes

Also measures the "unloaded TTFT": a few requests of the same shape sent one at a time on an idle
cluster, cold (never-seen prompt) and warm (the same prompt again), so the reader can check how
loaded a run was (the issue's condition: round-robin's p50 TTFT ≥ 3 × the cold unloaded TTFT).

    python -m loadtests.bench.routing                      # all scenarios, default size (~3 min)
    python -m loadtests.bench.routing --scenarios a --rate 30 --requests 1200
    python -m loadtests.bench.routing --scenarios a --sweep 20,30,40   # round-robin load sweep
    python -m loadtests.bench.routing --misconfigure 3   # engines 3× slower than configured:
                                                         # pd-router learning vs pd-router-static

Everything listens on 127.0.0.1. Every run is bounded by its request count and ``--run-timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtests.sim.cluster import engine_model_for, link_cost_from
from loadtests.sim.engine import EngineSpec, SimCluster, TimeModel
from loadtests.workloads.client import Summary, run_workload, send
from loadtests.workloads.generate import WorkItem, Workload, multi_turn, shared_prefix
from router.app import App
from router.config import LinksConfig, PoolConfig, parse_config

KV_BYTES_PER_TOKEN = 131072  # 128 KiB/token: Llama-3-8B class (32 layers × 8 KV heads × 128 × 2 × bf16)
MS = 1000.0


@dataclass
class Scenario:
    key: str
    title: str
    specs: Callable[[TimeModel], list[EngineSpec]]
    workload: Callable[[int, float, int], Workload]  # (requests, rate, seed)
    policies: list[str]
    rate: float  # default arrival rate, requests/s (chosen from a sweep; see the report)
    requests: int  # default request count
    links: dict[str, Any] = field(default_factory=dict)  # physical link table (before speed scaling)
    params: str = ""  # one line of parameters for the table header


# -- scenario definitions --------------------------------------------------------------------------

# (a)/(b): 1024 blocks × 16 = 16k tokens of KV per pod, so one pod cannot hold every system prompt
# (16 × 2k tokens) — the realistic regime where scattering a prefix over all pods costs cache hits.
PD_POOL_BLOCKS = 1024
A_PREFIXES, A_PREFIX_TOKENS, A_SUFFIX_TOKENS, A_MAX_TOKENS = 16, 2048, 64, 16
B_TURNS, B_SYSTEM, B_USER, B_ANSWER = 4, 1024, 256, 32

# (c): two racks; 25 GB/s inside a rack (NVLink/RDMA within a node group), 3 GB/s across.
C_LINKS = {
    "same": {"latency_ms": 0.05, "bandwidth_gbytes_per_s": 25.0},
    "default": {"latency_ms": 1.0, "bandwidth_gbytes_per_s": 3.0},
}
C_BLOCKS = 2048
C_PREFIXES, C_PREFIX_TOKENS, C_SUFFIX_TOKENS, C_MAX_TOKENS = 8, 4096, 192, 16


def _pd_pool(tm: TimeModel) -> list[EngineSpec]:
    return [
        EngineSpec(f"pod-{i}", "prefill-decode", link="rack-a", num_gpu_blocks=PD_POOL_BLOCKS, time=tm)
        for i in range(4)
    ]


def _two_racks(tm: TimeModel) -> list[EngineSpec]:
    return [
        EngineSpec(f"{role}-{rack}", role, link=f"rack-{rack}", num_gpu_blocks=C_BLOCKS, time=tm)
        for role in ("prefill", "decode")
        for rack in ("a", "b")
    ]


def _shared(prefixes: int, prefix_tokens: int, suffix: int, max_tokens: int) -> Callable[..., Workload]:
    def make(n: int, rate: float, seed: int) -> Workload:
        return shared_prefix(
            n,
            n_prefixes=prefixes,
            prefix_tokens=prefix_tokens,
            suffix_tokens=suffix,
            max_tokens=max_tokens,
            rate=rate,
            seed=seed,
        )

    return make


def _chat(n: int, rate: float, seed: int) -> Workload:
    wl = multi_turn(
        max(1, n // B_TURNS),
        turns=B_TURNS,
        system_tokens=B_SYSTEM,
        user_tokens=B_USER,
        answer_tokens=B_ANSWER,
        rate=rate,
        seed=seed,
    )
    return wl


SCENARIOS: dict[str, Scenario] = {
    "a": Scenario(
        "a",
        "(a) 4 × prefill-decode, shared-prefix",
        _pd_pool,
        _shared(A_PREFIXES, A_PREFIX_TOKENS, A_SUFFIX_TOKENS, A_MAX_TOKENS),
        ["round-robin", "least-loaded", "pd-router"],
        rate=40.0,
        requests=600,
        params=(
            f"{A_PREFIXES} prefixes × {A_PREFIX_TOKENS} tok + {A_SUFFIX_TOKENS} tok question, "
            f"max_tokens {A_MAX_TOKENS}; {PD_POOL_BLOCKS * 16} KV tokens/pod"
        ),
    ),
    "b": Scenario(
        "b",
        "(b) 4 × prefill-decode, multi-turn chat",
        _pd_pool,
        _chat,
        ["round-robin", "least-loaded", "pd-router"],
        rate=50.0,
        requests=600,
        params=(
            f"{B_TURNS} turns/session, system {B_SYSTEM} tok, user {B_USER} tok/turn, "
            f"answer {B_ANSWER} tok; {PD_POOL_BLOCKS * 16} KV tokens/pod"
        ),
    ),
    "c": Scenario(
        "c",
        "(c) 2 prefill + 2 decode on 2 racks, long shared prefixes",
        _two_racks,
        _shared(C_PREFIXES, C_PREFIX_TOKENS, C_SUFFIX_TOKENS, C_MAX_TOKENS),
        ["round-robin", "independent", "pd-router"],
        rate=10.0,
        requests=300,
        links=C_LINKS,
        params=(
            f"{C_PREFIXES} prefixes × {C_PREFIX_TOKENS} tok + {C_SUFFIX_TOKENS} tok, max_tokens "
            f"{C_MAX_TOKENS}; KV {KV_BYTES_PER_TOKEN // 1024} KiB/token; links in-rack "
            f"{C_LINKS['same']['bandwidth_gbytes_per_s']:g} GB/s + {C_LINKS['same']['latency_ms']:g} ms, "
            f"cross-rack {C_LINKS['default']['bandwidth_gbytes_per_s']:g} GB/s + "
            f"{C_LINKS['default']['latency_ms']:g} ms; {C_BLOCKS * 16} KV tokens/pod"
        ),
    ),
}


# -- running ---------------------------------------------------------------------------------------


def scaled_links(links: dict[str, Any], speed: float) -> dict[str, Any]:
    """Link costs in wall-clock terms at ``speed``.

    The simulator divides compute time by ``speed`` but not KV-transfer time, so the link table is
    scaled the same way here (bandwidth × speed, latency ÷ speed) to keep transfer/compute ratios
    physical. Router and simulator get the same scaled table.
    """
    out: dict[str, Any] = {}
    for name in ("same", "default"):
        if name in links:
            cost = links[name]
            out[name] = {
                "latency_ms": cost["latency_ms"] / speed,
                "bandwidth_gbytes_per_s": cost["bandwidth_gbytes_per_s"] * speed,
            }
    return out


def make_config(
    cluster: SimCluster,
    tm: TimeModel,
    links: dict[str, Any],
    policy: str = "joint",
    *,
    misconfigure: float = 1.0,
    learn: bool = True,
) -> PoolConfig:
    """``misconfigure``: the configured engine claims this × the simulator's real speed (3 = the
    engines are three times slower than the operator wrote); ``learn``: the online model may
    correct it."""
    endpoints = [
        {"address": cluster.address(name), "role": e.spec.role, "link": e.spec.link, "name": name}
        for name, e in cluster.engines.items()
    ]
    speed = tm.speed
    data: dict[str, Any] = {
        "model": "sim-model",
        "endpoints": endpoints,
        "engine": claimed_engine(engine_model_for(tm, KV_BYTES_PER_TOKEN), misconfigure),
        "signals": {"learn": learn, "tick_ms": max(50.0, 1000.0 / speed)},
        # SLOs scale with simulated time so the TTFT-vs-TPOT balance of the cost does not change.
        "slo": {"ttft_ms": 500.0 / speed, "tpot_ms": 50.0 / speed},
        "scrape": {"interval_ms": max(50.0, 200.0 / speed), "stale_after_ms": 5000},
        "proxy": {"port": 0, "debug_headers": True},
        "picker": {"policy": policy},
    }
    if links:
        data["links"] = links
    return parse_config(data)


def claimed_engine(true: dict[str, Any], factor: float) -> dict[str, Any]:
    """The engine section of an operator who believes the engines ``factor`` × faster."""
    if factor == 1.0:
        return true
    slower = ("decode_step_base_ms", "decode_ms_per_seq", "decode_ms_per_1k_kv_tokens")
    return {
        **true,
        "prefill_tokens_per_s": true["prefill_tokens_per_s"] * factor,
        **{key: true[key] / factor for key in slower},
    }


# Bench label -> ``picker.policy`` (pd-router is the joint choice; the others are its baselines).
POLICIES = {
    "round-robin": "round-robin",
    "least-loaded": "least-loaded",
    "independent": "independent",
    "pd-router": "joint",
    "pd-router-static": "joint",  # the same without the online model (only with --misconfigure)
}


async def run_policy(
    scn: Scenario,
    policy: str,
    workload: Workload,
    tm: TimeModel,
    seed: int,
    timeout_s: float,
    misconfigure: float = 1.0,
) -> Summary:
    links = scaled_links(scn.links, tm.speed)
    link_cost = link_cost_from(LinksConfig.model_validate(links)) if links else None
    async with SimCluster(scn.specs(tm), link_cost) as cluster:
        config = make_config(
            cluster,
            tm,
            links,
            POLICIES[policy],
            misconfigure=misconfigure,
            learn=policy != "pd-router-static",
        )
        async with App(config, seed=seed) as app:
            base = f"http://127.0.0.1:{app.proxy_port}"
            run = run_workload(base, workload, name=policy, timeout_s=timeout_s)
            return await asyncio.wait_for(run, timeout=timeout_s + workload.items[-1].at_s + 10.0)


def _sample(scn: Scenario, k: int, seed: int) -> list[WorkItem]:
    """``k`` requests of the workload's shape whose prompts no other request shares (cold)."""
    items = []
    for i in range(k):
        wl = scn.workload(B_TURNS if scn.key == "b" else 1, 1.0, seed + 7919 * (i + 1))
        # Multi-turn: cycle through turn depths so the sample covers short and long conversations.
        items.append(wl.items[i % len(wl.items)])
    return items


async def unloaded_ttft(scn: Scenario, tm: TimeModel, seed: int, k: int = 6) -> tuple[float, float]:
    """(cold p50, warm p50) TTFT in seconds of ``k`` requests sent one at a time on an idle cluster."""
    links = scaled_links(scn.links, tm.speed)
    link_cost = link_cost_from(LinksConfig.model_validate(links)) if links else None
    cold: list[float] = []
    warm: list[float] = []
    async with SimCluster(scn.specs(tm), link_cost) as cluster:
        config = make_config(cluster, tm, links)
        async with (
            App(config, seed=seed) as app,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30.0)) as session,
        ):
            base = f"http://127.0.0.1:{app.proxy_port}"
            for item in _sample(scn, k, seed):
                for out in (cold, warm):
                    result = await send(session, base, item)
                    if result.ok:
                        out.append(result.ttft_s)
                    await asyncio.sleep(0.05)  # let the engine and the router settle between requests
    return statistics.median(cold), statistics.median(warm)


# -- reporting -------------------------------------------------------------------------------------


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if value != value else f"{value:.{digits}f}"


def _cross_rack(summary: Summary, link_of: dict[str, str]) -> str:
    """Share of requests whose KV crossed racks (pairs only), and share served with no prefill leg."""
    ok = summary.ok
    if not ok:
        return "-"
    pairs = [r for r in ok if r.prefill]
    cross = sum(1 for r in pairs if link_of.get(r.prefill) != link_of.get(r.decode))
    local = len(ok) - len(pairs)
    return f"{100.0 * cross / len(ok):.0f}% / {100.0 * local / len(ok):.0f}%"


def render(
    scn: Scenario,
    tm: TimeModel,
    rate: float,
    summaries: list[Summary],
    unloaded: tuple[float, float],
    link_of: dict[str, str],
) -> str:
    cold, warm = unloaded
    n = len(summaries[0].results) if summaries else 0
    lines = [
        "",
        f"{scn.title} — {n} requests at {rate:g} req/s (Poisson), speed ×{tm.speed:g}",
        f"  {scn.params}",
        f"  unloaded TTFT (one request at a time, idle cluster): cold p50 {cold * MS:.1f} ms, "
        f"warm p50 {warm * MS:.1f} ms",
        "",
    ]
    pd = scn.key == "c"
    header = (
        f"  {'policy':<16} {'ok':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
        f"{'hit rate':>8} {'out tok/s':>9} {'p50/RR':>7} {'p99/RR':>7}"
    )
    if pd:
        header += f"  {'cross/no-P':>11}"
    lines += [header, "  " + "-" * (len(header) - 2)]
    rr = next((s for s in summaries if s.name == "round-robin"), None)
    rr50 = rr.pct("ttft_s", 0.5) if rr else float("nan")
    rr99 = rr.pct("ttft_s", 0.99) if rr else float("nan")
    for s in summaries:
        p50, p99 = s.pct("ttft_s", 0.5), s.pct("ttft_s", 0.99)
        row = (
            f"  {s.name:<16} {len(s.ok):>4}/{len(s.results):<4} {_fmt(p50 * MS):>9} {_fmt(p99 * MS):>9} "
            f"{_fmt(s.pct('tpot_s', 0.5) * MS, 2):>9} {_fmt(s.pct('tpot_s', 0.99) * MS, 2):>9} "
            f"{s.hit_rate:>8.1%} {s.throughput:>9.0f} {_fmt(p50 / rr50, 2):>7} {_fmt(p99 / rr99, 2):>7}"
        )
        if pd:
            row += f"  {_cross_rack(s, link_of):>11}"
        lines.append(row)
    for s in summaries:
        failed = Counter(f"HTTP {r.status}: {r.error[:90]}" for r in s.results if not r.ok)
        for what, count in failed.most_common(3):
            lines.append(f"  {s.name} failed {count}× — {what}")
    lines += ["", *_verdict(scn, summaries, cold)]
    return "\n".join(lines) + "\n"


def _verdict(scn: Scenario, summaries: list[Summary], cold: float) -> list[str]:
    by = {s.name: s for s in summaries}
    out = []
    pd = by.get("pd-router")
    rr = by.get("round-robin")
    if pd is None:
        return out
    p50 = pd.pct("ttft_s", 0.5)
    if rr is not None and scn.key in ("a", "b"):
        rr50 = rr.pct("ttft_s", 0.5)
        load = rr50 / cold
        out.append(
            f"  load: round-robin p50 TTFT = {load:.1f} × cold unloaded TTFT "
            f"({'meets' if load >= 3.0 else 'BELOW'} the ≥ 3× load condition)"
        )
        ratio = p50 / rr50
        out.append(
            f"  target p50(pd-router) ≤ 0.5 × p50(round-robin): {ratio:.2f} × "
            f"-> {'PASS' if ratio <= 0.5 else 'FAIL'}"
        )
        ll = by.get("least-loaded")
        if ll is not None:
            a, b = pd.pct("ttft_s", 0.99), ll.pct("ttft_s", 0.99)
            out.append(
                f"  target p99(pd-router) ≤ p99(least-loaded): {a * MS:.1f} vs {b * MS:.1f} ms "
                f"-> {'PASS' if a <= b else 'FAIL'}"
            )
    ind = by.get("independent")
    if ind is not None:
        i50 = ind.pct("ttft_s", 0.5)
        gain = 1.0 - p50 / i50
        out.append(
            f"  target p50(pd-router) ≥ 30% lower than independent: {gain:.0%} lower "
            f"-> {'PASS' if gain >= 0.30 else 'FAIL'}"
        )
    return out


def _maybe_png(path: str, results: dict[str, list[Summary]]) -> None:
    try:
        import matplotlib  # optional: the tables are the result

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return  # no matplotlib: the printed tables are the result
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (title, summaries) in zip(axes[0], results.items(), strict=True):
        names = [s.name for s in summaries]
        p50 = [s.pct("ttft_s", 0.5) * MS for s in summaries]
        p99 = [s.pct("ttft_s", 0.99) * MS for s in summaries]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], p50, width=0.4, label="TTFT p50")
        ax.bar([i + 0.2 for i in x], p99, width=0.4, label="TTFT p99")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=9)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


# -- main ------------------------------------------------------------------------------------------


async def main_async(args: argparse.Namespace) -> int:
    tm = TimeModel(speed=args.speed)
    results: dict[str, list[Summary]] = {}
    failed = 0
    for key in args.scenarios:
        scn = SCENARIOS[key]
        n = args.requests or scn.requests
        rates = [float(r) for r in args.sweep.split(",")] if args.sweep else [args.rate or scn.rate]
        policies = ["round-robin"] if args.sweep else [p for p in scn.policies if p in args.policies]
        if args.misconfigure != 1.0 and "pd-router" in policies and not args.sweep:
            policies.append("pd-router-static")
        started = time.perf_counter()
        unloaded = await unloaded_ttft(scn, tm, args.seed)
        for rate in rates:
            workload = scn.workload(n, rate, args.seed)
            summaries = []
            for policy in policies:
                t0 = time.perf_counter()
                summary = await run_policy(
                    scn, policy, workload, tm, args.seed, args.run_timeout, args.misconfigure
                )
                failed += len(summary.results) - len(summary.ok)
                sys.stderr.write(
                    f"  [{key}] {policy} @ {rate:g} req/s: {len(summary.ok)}/{len(summary.results)} ok, "
                    f"p50 TTFT {summary.pct('ttft_s', 0.5) * MS:.1f} ms "
                    f"({time.perf_counter() - t0:.0f} s)\n"
                )
                summaries.append(summary)
            link_of = {spec.name: spec.link for spec in scn.specs(tm)}
            sys.stdout.write(render(scn, tm, rate, summaries, unloaded, link_of))
            sys.stdout.flush()
            results[f"{scn.title} @ {rate:g}/s"] = summaries
        sys.stderr.write(f"  [{key}] scenario took {time.perf_counter() - started:.0f} s\n")
    if args.png:
        _maybe_png(args.png, results)
    return 0 if failed == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.routing",
        description="Compare routing policies on the simulated cluster (same seeded workload, fresh "
        "cluster per policy). Prints one table per scenario.",
    )
    parser.add_argument("--scenarios", default="abc", help="which scenarios to run, e.g. 'ac' (default: abc)")
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated subset of policies (each scenario runs the ones that apply)",
    )
    parser.add_argument("--requests", type=int, default=0, help="requests per run (default: per scenario)")
    parser.add_argument("--rate", type=float, default=0.0, help="arrival rate req/s (default: per scenario)")
    parser.add_argument(
        "--sweep", default="", help="comma-separated rates: run round-robin only at each (load search)"
    )
    parser.add_argument(
        "--speed", type=float, default=1.0, help="simulated-time speed-up (link costs scale alike)"
    )
    parser.add_argument(
        "--misconfigure",
        type=float,
        default=1.0,
        help="configure the engines as this × faster than they are (3: three times slower than "
        "written); adds pd-router-static, the same router without the online performance model",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-timeout", type=float, default=120.0, help="per-request client timeout, s")
    parser.add_argument("--png", default="", help="write a TTFT bar chart here (needs matplotlib)")
    args = parser.parse_args(argv)
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {sorted(unknown)}; choose from {sorted(SCENARIOS)}")
    args.policies = [p for p in args.policies.split(",") if p]
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        import uvloop  # optional, as in the router CLI
    except ImportError:
        return asyncio.run(main_async(args))
    return uvloop.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
