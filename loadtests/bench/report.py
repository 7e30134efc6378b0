"""One command for the published benchmark report: routing policies and overheads → docs/benchmarks.md.

Runs, in this order and all on 127.0.0.1:

1. the routing policy comparison of ``loadtests.bench.routing`` (every scenario's own policies, the
   same seeded workload per policy, a fresh simulated cluster per run), plus one run of pd-router
   against ``pd-router-static`` with engines slower than configured (``--misconfigure``);
2. ``pick()``'s cost (``loadtests.bench.pick``);
3. the proxy against the engine directly (``loadtests.bench.proxy``), and the proxy with tracing
   off and on (``loadtests.bench.proxy --tracing``; with ``--tracing-baseline-src``, also the
   router at that source tree, e.g. the commit before a change);
4. a real Envoy with pd-router as its ext_proc picker against the same Envoy routing directly
   (``loadtests.bench.envoy``).

and writes one markdown file (the machine, the date, the command, the commit, a table per scenario,
the overhead tables, each benchmark's own text output) with PNG plots beside it in a folder named
after it (``docs/benchmarks/`` for ``docs/benchmarks.md``; plots need matplotlib, the ``bench``
extra — without it the tables are written alone).

    python -m loadtests.bench.report                       # full run (~10-12 minutes on 2 cores)
    python -m loadtests.bench.report --quick               # small samples (~1.5 minutes)
    python -m loadtests.bench.report --quick --scenarios a --policies round-robin,pd-router \\
        --requests 12 --overhead pick --out /tmp/bench.md  # a smoke run

Every benchmark is bounded by its own request counts and timeouts; this adds none of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import logging
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests.bench import envoy as envoy_bench
from loadtests.bench import pick as pick_bench
from loadtests.bench import proxy as proxy_bench
from loadtests.bench import routers as routers_bench
from loadtests.bench import routing
from simulator.engine import TimeModel
from simulator.workloads.client import Result, Summary

REPO = Path(__file__).resolve().parents[2]
MS = 1000.0
OVERHEADS = ("pick", "proxy", "tracing", "envoy", "routers")


@dataclass(frozen=True)
class Sizes:
    """How much each benchmark runs. The full run is sized to fit ~10-12 minutes on 2 cores; most of it
    is the routing comparison at the scenarios' own request counts (their loads were chosen there)."""

    requests: int  # requests per routing run; 0: each scenario's default
    unloaded_k: int  # requests sent one at a time for the unloaded TTFT (cold and warm each)
    proxy_scale: float
    envoy_modes: tuple[str, ...]
    envoy_concurrency: tuple[int, ...]
    envoy_repeats: int
    envoy_requests: int
    envoy_requests_c1: int
    pick_picks: int
    pick_rounds: int
    pick_sizes: tuple[int, ...]
    routers: tuple[str, ...]  # the standalone proxy against these (the Rust routers install from PyPI)
    routers_rounds: int
    routers_scale: float


# Envoy at --concurrency 1 only: on 2 cores a second worker thread competes with the router and
# the client for the same cores, and the envoy bench's own default already compares both.
FULL = Sizes(
    *(0, 6, 2.0, envoy_bench.MODES, (1,), 3, 2000, 600, 2000, 3, pick_bench.POOL_SIZES),
    *(routers_bench.ROUTERS, 3, 1.0),
)
QUICK = Sizes(20, 2, 0.1, ("full-duplex",), (1,), 1, 300, 100, 200, 1, (8, 64), ("pd-router",), 1, 0.1)

# One colour per policy in every plot, so a policy is recognisable across panels.
COLOURS = {
    "round-robin": "#8c8c8c",
    "least-loaded": "#e69f00",
    "independent": "#cc79a7",
    "cache-aware": "#009e73",
    "weighted-score": "#d55e00",
    "pd-router": "#0072b2",
    "pd-router-rigid": "#56b4e9",
    "pd-router-static": "#a6761d",
    "reference": "#000000",
}
BASELINES = ("round-robin", "least-loaded", "independent", "cache-aware")
JOINT = "pd-router"

# Decision kinds, in stacking order (the decode pod's role and the two pods' links tell them apart).
KINDS = (
    "pair, same rack",
    "pair, cross-rack",
    "single pod",
    "local prefill",
    "whole on prefill pod",
    "failed",
)
KIND_COLOURS = ("#0072b2", "#d55e00", "#009e73", "#56b4e9", "#cc79a7", "#bbbbbb")


# -- running the benchmarks ------------------------------------------------------------------------


@dataclass
class ScenarioRuns:
    """One scenario at one rate: every policy's run, the unloaded TTFT and the routing bench's table."""

    scenario: routing.Scenario
    rate: float
    requests: int
    unloaded: tuple[float, float]  # cold, warm p50 TTFT (s)
    runs: list[routing.Run]
    text: str  # routing.render's table, verbatim
    misconfigure: float = 1.0

    @property
    def title(self) -> str:
        if self.misconfigure != 1.0:
            return f"{self.scenario.title}, engines {self.misconfigure:g}× slower than configured"
        return self.scenario.title

    @property
    def short(self) -> str:
        """A panel title for the plots."""
        key = f"({self.scenario.key})"
        if self.misconfigure == 1.0:
            return self.scenario.title
        return f"{key} engines {self.misconfigure:g}× slower than configured"


@dataclass
class Report:
    started: dt.datetime
    argv: list[str]
    quick: bool
    sizes: Sizes
    tm: TimeModel
    machine: dict[str, str] = field(default_factory=dict)
    scenarios: list[ScenarioRuns] = field(default_factory=list)
    pick: list[tuple[int, str, dict[str, tuple[float, float]]]] = field(default_factory=list)
    proxy: proxy_bench.ProxyResults | None = None
    proxy_args: argparse.Namespace | None = None
    tracing: list[proxy_bench.VariantCell] | None = None
    tracing_args: argparse.Namespace | None = None
    envoy: envoy_bench.Results | None = None
    envoy_args: argparse.Namespace | None = None
    routers: routers_bench.Rows | None = None
    errors: dict[str, str] = field(default_factory=dict)  # section -> what went wrong
    seconds: dict[str, float] = field(default_factory=dict)  # section -> wall seconds
    load_after: str = ""
    others_cpu: str = ""  # how much CPU other processes took while this ran


def _log(message: str) -> None:
    sys.stderr.write(f"  {message}\n")
    sys.stderr.flush()


async def run_routing(
    keys: str, policies: list[str], sizes: Sizes, tm: TimeModel, seed: int, misconfigure: float
) -> list[ScenarioRuns]:
    """``routing``'s scenarios, each policy on the same workload; then the misconfigured pair."""
    out: list[ScenarioRuns] = []
    plan: list[tuple[routing.Scenario, list[str], float]] = [
        (routing.SCENARIOS[key], policies or list(routing.SCENARIOS[key].policies), 1.0) for key in keys
    ]
    if misconfigure != 1.0 and (not policies or JOINT in policies):
        # The learning comparison on the first scenario asked for ("a" by default): only pd-router
        # and the same router without its online model differ here, so only they run.
        plan.append((routing.SCENARIOS[keys[0]], [JOINT, "pd-router-static"], misconfigure))
    unloaded_of: dict[str, tuple[float, float]] = {}
    for scn, names, factor in plan:
        n = sizes.requests or scn.requests
        workload = scn.workload(n, scn.rate, seed)
        if scn.key not in unloaded_of:  # the engines' speed, whatever the router was told
            unloaded_of[scn.key] = await routing.unloaded_ttft(scn, tm, seed, k=sizes.unloaded_k)
        unloaded = unloaded_of[scn.key]
        runs = []
        for policy in names:
            t0 = time.perf_counter()
            run = await routing.run_policy(scn, policy, workload, tm, seed, 120.0, factor)
            s = run.summary
            tag = scn.key if factor == 1.0 else f"{scn.key} ×{factor:g}"
            _log(
                f"[{tag}] {policy}: {len(s.ok)}/{len(s.results)} ok, p50 TTFT "
                f"{s.pct('ttft_s', 0.5) * MS:.1f} ms ({time.perf_counter() - t0:.0f} s)"
            )
            runs.append(run)
        link_of = {spec.name: spec.link for spec in scn.specs(tm)}
        text = routing.render(scn, tm, scn.rate, runs, unloaded, link_of)
        out.append(ScenarioRuns(scn, scn.rate, len(workload.items), unloaded, runs, text, factor))
    return out


def run_pick(sizes: Sizes, seed: int) -> list[tuple[int, str, dict[str, tuple[float, float]]]]:
    cells = []
    for n, kind, stats in pick_bench.measure(sizes.pick_picks, sizes.pick_rounds, sizes.pick_sizes, seed):
        _log(f"pick: {n} endpoints, {kind} prompts: p50 {stats['pick'][0]:.1f} µs")
        cells.append((n, kind, stats))
    return cells


def run_proxy(sizes: Sizes) -> tuple[argparse.Namespace, proxy_bench.ProxyResults]:
    args = proxy_bench.parser().parse_args(["--scale", f"{sizes.proxy_scale:g}"])
    return args, proxy_bench.run(args)


def run_tracing(sizes: Sizes, baseline_src: str) -> tuple[argparse.Namespace, list[proxy_bench.VariantCell]]:
    argv = ["--tracing", "--scale", f"{sizes.proxy_scale / 2:g}", "--rounds", "3"]
    args = proxy_bench.parser().parse_args([*argv, "--baseline-src", baseline_src] if baseline_src else argv)
    return args, proxy_bench.run_variants(args)


def run_envoy(sizes: Sizes) -> tuple[argparse.Namespace, envoy_bench.Results]:
    argv = [
        "--modes",
        *sizes.envoy_modes,
        "--envoy-concurrency",
        *map(str, sizes.envoy_concurrency),
        "--repeats",
        str(sizes.envoy_repeats),
        "--requests",
        str(sizes.envoy_requests),
        "--requests-c1",
        str(sizes.envoy_requests_c1),
    ]
    args = envoy_bench.parser().parse_args(argv)
    return args, envoy_bench.run(args)


@contextlib.contextmanager
def kept_affinity() -> Iterator[None]:
    """The proxy and Envoy benchmarks pin this process to the client's core; give it all back after."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        yield
    finally:
        if cpus is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, cpus)


def _section(report: Report, name: str, fn: Callable[[], None]) -> None:
    """Run one benchmark; a failure is written into the report (and the exit code) rather than
    losing the sections already measured."""
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # any failure of a benchmark belongs in its section
        logging.exception("%s benchmark failed", name)
        report.errors[name] = f"{type(exc).__name__}: {exc}"
    report.seconds[name] = time.perf_counter() - t0


# -- the machine -----------------------------------------------------------------------------------


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def _ram() -> str:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 1024**2:.1f} GiB"
    return "unknown"


def _envoy_version() -> str:
    try:
        out = subprocess.run(
            [envoy_bench.envoy.envoy_binary(), "--version"], capture_output=True, text=True, timeout=20
        ).stdout
    except (ImportError, OSError, subprocess.SubprocessError):
        return "not installed"
    found = re.search(r"version:\s*(\S+)", out)
    if not found:
        return out.strip() or "unknown"
    # "<sha>/<version>/<state>/<build type>/<TLS>": the release first, the rest as detail.
    parts = found.group(1).split("/")
    if len(parts) < 2:
        return parts[0]
    return f"{parts[1]} ({', '.join([parts[0][:12], *parts[2:]])})"


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _load() -> str:
    if not hasattr(os, "getloadavg"):
        return "unknown"
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def _machine_busy_s() -> float:
    """CPU seconds all cores have spent busy since boot (``/proc/stat``); nan where unknown."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return float("nan")
    # user nice system idle iowait irq softirq steal: everything but idle and iowait is busy.
    ticks = [int(x) for x in fields[:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and every child it has reaped (the benchmarks' engines, proxies,
    routers and Envoys are all reaped before their section ends)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass
class Contention:
    """Whether the numbers had the machine to themselves: the CPU other processes used meanwhile.
    The simulated engines run on wall-clock time, so a busy neighbour slows every policy's run."""

    wall0: float = field(default_factory=time.monotonic)
    busy0: float = field(default_factory=_machine_busy_s)
    own0: float = field(default_factory=_own_cpu_s)

    def summary(self) -> str:
        wall = time.monotonic() - self.wall0
        others = (_machine_busy_s() - self.busy0) - (_own_cpu_s() - self.own0)
        cores = os.cpu_count() or 1
        if others != others or wall <= 0:
            return "unknown"
        others = max(0.0, others)
        share = others / (wall * cores)
        return f"{others:.0f} CPU-s in {wall:.0f} s = {share:.0%} of the machine's {cores} cores"


def machine() -> dict[str, str]:
    cores = os.cpu_count() or 0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    try:
        import uvloop

        loop = f"uvloop {uvloop.__version__}"
    except ImportError:
        loop = "asyncio"
    commit = _git("rev-parse", "HEAD") or "unknown"
    changed = _git("status", "--porcelain", "--untracked-files=no")
    if changed:
        # Say so rather than pretend the numbers belong to the commit alone.
        commit += f" (plus uncommitted changes to {len(changed.splitlines())} tracked files)"
    return {
        "CPU": _cpu_model(),
        "cores": f"{cores} ({usable} usable by this process)",
        "RAM": _ram(),
        "OS": f"{platform.system()} {platform.release()}",
        "Python": f"{platform.python_implementation()} {platform.python_version()}, event loop {loop}",
        "Envoy": _envoy_version(),
        "commit": commit,
        "load average (1/5/15 min) at start": _load(),
    }


# -- tables ----------------------------------------------------------------------------------------


def _f(value: float, digits: int = 1) -> str:
    if value != value:
        return "–"
    if math.isinf(value):
        return "∞"
    return f"{value:,.{digits}f}"


def _x(value: float) -> str:
    """A ratio, as ``1.23×``."""
    return "–" if value != value or math.isinf(value) else f"{value:.2f}×"


def _pct(value: float) -> str:
    return "–" if value != value else f"{100.0 * value:.1f}%"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool] = ()) -> list[str]:
    align = [("---:" if (right[i] if i < len(right) else i > 0) else ":---") for i in range(len(headers))]
    out = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


def _goodput(sr: ScenarioRuns, s: Summary, tm: TimeModel) -> float:
    scn = sr.scenario
    return routing.goodput(s, scn.goodput_ttft_s / tm.speed, scn.goodput_tpot_s / tm.speed)


def hit_rate(run: routing.Run) -> float:
    """Share of the prompt tokens answered that no engine had to compute (prefix-cache hits).

    From the engines' own counters, not the answers' ``cached_tokens``: a pair's decode leg reports
    the KV it was sent as cached, which would make every pair look like a cache hit."""
    prompt = sum(r.prompt_tokens for r in run.summary.ok)
    if not prompt:
        return float("nan")
    # A pair's decode leg recomputes the prompt's last partial block, and failed requests computed
    # work no answer counts: a few tokens may tip a cold run just below zero.
    return max(0.0, 1.0 - run.prefill_tokens_computed / prompt)


def decision_kind(result: Result, role: dict[str, str], link: dict[str, str]) -> str:
    """What the router did with one request, from the pods its answer names."""
    if not result.ok:
        return "failed"
    if result.prefill:
        same = link.get(result.prefill) == link.get(result.decode)
        return "pair, same rack" if same else "pair, cross-rack"
    return {
        "prefill-decode": "single pod",
        "decode": "local prefill",
        "prefill": "whole on prefill pod",
    }.get(role.get(result.decode, ""), "failed")


def decisions(sr: ScenarioRuns, s: Summary, tm: TimeModel) -> Counter[str]:
    specs = sr.scenario.specs(tm)
    role = {spec.name: spec.role for spec in specs}
    link = {spec.name: spec.link for spec in specs}
    return Counter(decision_kind(r, role, link) for r in s.results)


def scenario_table(sr: ScenarioRuns, tm: TimeModel) -> list[str]:
    by = {run.name: run.summary for run in sr.runs}
    joint = by.get(JOINT)
    j50 = joint.pct("ttft_s", 0.5) if joint else float("nan")
    j99 = joint.pct("ttft_s", 0.99) if joint else float("nan")
    rows = []
    for run in sr.runs:
        s = run.summary
        p50, p90, p99 = (s.pct("ttft_s", q) for q in (0.5, 0.9, 0.99))
        kinds = decisions(sr, s, tm)
        mix = ", ".join(f"{k} {100.0 * kinds[k] / len(s.results):.0f}%" for k in KINDS if kinds[k])
        rows.append(
            [
                f"`{s.name}`",
                f"{len(s.ok)}/{len(s.results)}",
                _f(p50 * MS),
                _f(p90 * MS),
                _f(p99 * MS),
                _f(s.pct("tpot_s", 0.5) * MS, 2),
                _pct(hit_rate(run)),
                _pct(_goodput(sr, s, tm)),
                _x(_ratio(p50, j50)),
                _x(_ratio(p99, j99)),
                mix,
            ]
        )
    headers = [
        "policy",
        "ok",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "TTFT p99 ms",
        "TPOT p50 ms",
        "cache hit rate",
        "goodput",
        "p50 vs pd-router",
        "p99 vs pd-router",
        "decisions",
    ]
    return table(headers, rows, [False, *([True] * 9), False])


def headline(report: Report) -> list[str]:
    """Per scenario: pd-router against the best baseline and against the full-information reference."""
    tm = report.tm
    rows = []
    for sr in report.scenarios:
        by = {run.name: run.summary for run in sr.runs}
        hits = {run.name: hit_rate(run) for run in sr.runs}
        joint = by.get(JOINT)
        if joint is None or sr.misconfigure != 1.0:
            continue
        bases = [by[name] for name in BASELINES if name in by]
        best = min(bases, key=lambda s: s.pct("ttft_s", 0.5)) if bases else None
        ref = by.get("reference")
        rigid = by.get("pd-router-rigid")
        j50 = joint.pct("ttft_s", 0.5)
        row = [
            sr.scenario.title,
            _f(j50 * MS),
            f"`{best.name}` {_f(best.pct('ttft_s', 0.5) * MS)}" if best else "–",
            _x(_ratio(j50, best.pct("ttft_s", 0.5))) if best else "–",
            _x(_ratio(joint.pct("ttft_s", 0.99), ref.pct("ttft_s", 0.99))) if ref else "–",
            _pct(_goodput(sr, joint, tm))
            + (f" (rigid {_pct(_goodput(sr, rigid, tm))})" if rigid is not None else ""),
            _pct(_goodput(sr, best, tm)) if best else "–",
            _pct(hits[JOINT]) + (f" vs {_pct(hits[best.name])}" if best else ""),
        ]
        rows.append(row)
    if not rows:
        return []
    headers = [
        "scenario",
        "pd-router TTFT p50 ms",
        "best baseline, p50 ms",
        "p50 ratio",
        "p99 vs reference",
        "pd-router goodput",
        "best baseline goodput",
        "hit rate (pd-router vs best baseline)",
    ]
    return table(headers, rows, [False, True, False, True, True, True, True, True])


def proxy_table(results: proxy_bench.ProxyResults) -> list[str]:
    rows = []
    for cell in results.cells:
        d50, p50 = cell.direct.pct(0.5) * MS, cell.proxied.pct(0.5) * MS
        d99, p99 = cell.direct.pct(0.99) * MS, cell.proxied.pct(0.99) * MS
        errors = cell.direct.errors + cell.proxied.errors
        rows.append(
            [
                cell.mode,
                str(cell.concurrency),
                str(cell.requests) + (f" ({errors} errors)" if errors else ""),
                _f(d50, 3),
                _f(p50, 3),
                _x(_ratio(p50, d50)),
                _f(d99, 3),
                _f(p99, 3),
                _x(_ratio(p99, d99)),
                _f(cell.direct_rps, 0),
                _f(cell.proxy_rps, 0),
                _x(_ratio(cell.proxy_rps, cell.direct_rps)),
                _f(cell.cpu_ms, 3),
            ]
        )
    headers = [
        "mode",
        "conc",
        "requests",
        "direct p50 ms",
        "proxied p50 ms",
        "p50 ratio",
        "direct p99 ms",
        "proxied p99 ms",
        "p99 ratio",
        "direct req/s",
        "proxied req/s",
        "req/s ratio",
        "proxy CPU ms/req",
    ]
    return table(headers, rows)


def tracing_table(cells: list[proxy_bench.VariantCell]) -> list[str]:
    names = list(cells[0].p50_ms)
    columns = (
        ("p50 ms", "p50_ms", 3),
        ("p99 ms", "p99_ms", 3),
        ("req/s", "rps", 0),
        ("CPU ms/req", "cpu_ms", 3),
    )
    headers = ["mode", "conc", "requests"] + [f"{title} {name}" for title, _, _ in columns for name in names]
    rows = [
        [cell.mode, str(cell.concurrency), str(cell.requests)]
        + [_f(getattr(cell, attribute)[name], digits) for _, attribute, digits in columns for name in names]
        for cell in cells
    ]
    return table(headers, rows)


def envoy_table(results: envoy_bench.Results) -> list[str]:
    rows = []
    order = {load: i for i, load in enumerate(envoy_bench.LOADS)}
    cells = sorted(
        {(mode, ec, load) for mode, ec, _, load in results}, key=lambda c: (c[0], c[1], order[c[2]])
    )
    for mode, ec, load in cells:
        base = results[(mode, ec, "direct", load)]
        b50, b99, brps = (envoy_bench._median(base, a) for a in ("p50", "p99", "rps"))
        routed = (*envoy_bench.PATHS[1:], envoy_bench.TRACED)
        for path in [p for p in routed if (mode, ec, p, load) in results]:
            samples = results[(mode, ec, path, load)]
            p50, p99, rps = (envoy_bench._median(samples, a) for a in ("p50", "p99", "rps"))
            errors = sum(s.errors for s in samples) + sum(s.errors for s in base)
            rows.append(
                [
                    mode,
                    str(ec),
                    envoy_bench._label(load) + (f" ({errors} errors)" if errors else ""),
                    path,
                    _f(b50, 3),
                    _f(p50, 3),
                    _x(_ratio(p50, b50)),
                    _f(b99, 3),
                    _f(p99, 3),
                    _x(_ratio(p99, b99)),
                    _f(brps, 0),
                    _f(rps, 0),
                    _x(_ratio(rps, brps)),
                    _f(envoy_bench._median(samples, "router_ms"), 3),
                ]
            )
    headers = [
        "body mode",
        "Envoy threads",
        "load",
        "path",
        "direct p50 ms",
        "routed p50 ms",
        "p50 ratio",
        "direct p99 ms",
        "routed p99 ms",
        "p99 ratio",
        "direct req/s",
        "routed req/s",
        "req/s ratio",
        "pd-router CPU ms/req",
    ]
    return table(headers, rows, [False, True, False, False, *([True] * 10)])


def pick_table(cells: list[tuple[int, str, dict[str, tuple[float, float]]]]) -> list[str]:
    # How the cost grows with the pool is the machine-independent part: each cell against the
    # smallest pool's, same prompt kind, same run.
    smallest: dict[str, float] = {}
    for _, kind, stats in cells:
        smallest.setdefault(kind, stats["total"][0])
    rows = [
        [
            str(n),
            kind,
            *(_f(stats[name][q], 1) for name in ("pick", "record", "total") for q in (0, 1)),
            _x(_ratio(stats["total"][0], smallest[kind])),
        ]
        for n, kind, stats in cells
    ]
    headers = ["endpoints", "prompt", "pick p50 µs", "pick p99 µs"]
    headers += ["record p50 µs", "record p99 µs", "total p50 µs", "total p99 µs"]
    headers.append(f"total p50 vs {cells[0][0]} endpoints" if cells else "ratio")
    return table(headers, rows, [True, False, *([True] * 7)])


# -- plots -----------------------------------------------------------------------------------------


def _grid(plt: Any, panels: int, width: float = 4.4, height: float = 3.0) -> tuple[Any, list[Any]]:
    cols = min(3, panels)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[panels:]:
        ax.set_visible(False)
    return fig, flat[:panels]


def plots(report: Report, folder: Path, dpi: int) -> dict[str, str] | str:
    """Write the PNGs; returns {name: file name}, or why none were written."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: files only
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        return "matplotlib is not installed (the `bench` extra): no plots"
    if not report.scenarios:
        return "no routing results: no plots"
    folder.mkdir(parents=True, exist_ok=True)
    tm = report.tm
    written: dict[str, str] = {}

    fig, axes = _grid(plt, len(report.scenarios))
    for ax, sr in zip(axes, report.scenarios, strict=True):
        for run in sr.runs:
            values = sorted(r.ttft_s * MS for r in run.summary.ok)
            if not values:
                continue
            ys = [(i + 1) / len(run.summary.results) for i in range(len(values))]
            style = "--" if run.name == "reference" else "-"
            ax.step(values, ys, where="post", label=run.name, color=COLOURS.get(run.name), ls=style, lw=1.4)
        ax.set_xscale("log")
        # Plain numbers at 1-2-5 steps: matplotlib's default minor labels overlap on short ranges.
        ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("TTFT, ms (log)")
        ax.set_ylabel("share of requests")
        ax.set_ylim(0, 1.0)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(sr.short, fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("TTFT CDF per policy (failed requests never reach 1.0)", fontsize=10)
    fig.tight_layout()
    written["ttft_cdf"] = _save(fig, plt, folder / "ttft_cdf.png", dpi)

    fig, axes = _grid(plt, len(report.scenarios), height=2.8)
    for ax, sr in zip(axes, report.scenarios, strict=True):
        names = [run.name for run in sr.runs]
        rates = [100.0 * hit_rate(run) for run in sr.runs]
        bars = ax.bar(range(len(names)), rates, color=[COLOURS.get(n, "#777777") for n in names])
        ax.bar_label(bars, fmt="%.0f%%", fontsize=7)
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=7)
        ax.set_ylim(0, 105)
        ax.set_ylabel("prompt tokens cached, %")
        ax.set_title(sr.short, fontsize=9)
    fig.suptitle("Prefix-cache hit rate per policy", fontsize=10)
    fig.tight_layout()
    written["cache_hit_rate"] = _save(fig, plt, folder / "cache_hit_rate.png", dpi)

    fig, axes = _grid(plt, len(report.scenarios), height=3.0)
    seen: set[str] = set()
    for ax, sr in zip(axes, report.scenarios, strict=True):
        names = [run.name for run in sr.runs]
        bottom = [0.0] * len(names)
        counts = [decisions(sr, run.summary, tm) for run in sr.runs]
        totals = [max(1, len(run.summary.results)) for run in sr.runs]
        for kind, colour in zip(KINDS, KIND_COLOURS, strict=True):
            shares = [100.0 * c[kind] / t for c, t in zip(counts, totals, strict=True)]
            if not any(shares):
                continue
            label = kind if kind not in seen else None
            seen.add(kind)
            ax.bar(range(len(names)), shares, bottom=bottom, color=colour, label=label)
            bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=7)
        ax.set_ylim(0, 100)
        ax.set_ylabel("share of requests, %")
        ax.set_title(sr.short, fontsize=9)
    fig.legend(loc="lower center", ncol=len(seen), fontsize=8, frameon=False)
    fig.suptitle("Routing decisions by kind", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    written["decisions"] = _save(fig, plt, folder / "decisions.png", dpi)
    return written


def _save(fig: Any, plt: Any, path: Path, dpi: int) -> str:
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path.name


# -- the markdown ----------------------------------------------------------------------------------


def _details(summary: str, text: str) -> list[str]:
    return [
        "<details>",
        f"<summary>{summary}</summary>",
        "",
        "```",
        text.strip("\n"),
        "```",
        "</details>",
        "",
    ]


def render_markdown(report: Report, images: dict[str, str] | str, folder: str) -> str:
    took = sum(report.seconds.values())
    quick = " (**quick run: small samples, a smoke test only**)" if report.quick else ""
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `loadtests/bench/report.py` on {report.started:%Y-%m-%d %H:%M} UTC in "
        f"{took / 60:.1f} minutes{quick}. "
        "Regenerate with the command below; every number here comes from that one run.",
        "",
        "**Read the ratios, not the absolute numbers.** Machines differ by up to 3× in speed, and "
        "other work on the same machine moves absolute times; each ratio compares two things "
        "measured side by side in the same run on the same machine, so it is what carries over. "
        "The absolute numbers are context for this machine. The routing results run on simulated "
        "engines (`simulator/`: a batching time model, a prefix cache, KV transfers over modelled "
        "links) — they compare policies, they are not GPU measurements.",
        "",
        "## Machine and run",
        "",
        *table(["what", "value"], [[k, v] for k, v in report.machine.items()], [False, False]),
        f"| load average at the end | {report.load_after} |",
        f"| CPU used by other processes during the run | {report.others_cpu} |",
        f"| date (UTC) | {report.started:%Y-%m-%d %H:%M:%S} |",
        "| wall time per section | "
        + ", ".join(f"{name} {secs:.0f} s" for name, secs in report.seconds.items())
        + " |",
        "",
        "The simulated engines keep wall-clock time, so CPU that other processes take during the "
        "run slows the routing runs (the policies alike, though not equally) and the overhead "
        "cells; the CPU row above says how much there was.",
        "",
        "Routing quality in virtual time (deterministic, and what the defaults rest on) is in "
        "[quality.md](quality.md); the autoscaling replay and repeated bursts are in "
        "[autoscaling.md](autoscaling.md).",
        "",
        "Command (from the repository root):",
        "",
        # tests/test_docs_commands.py runs every unmarked shell block of the docs: this one is long.
        "<!-- doc-test: help: a 10-minute benchmark that rewrites this file -->",
        "```sh",
        "python3 -m loadtests.bench.report" + (" " + shlex.join(report.argv) if report.argv else ""),
        "```",
        "",
    ]
    if report.errors:
        lines += ["## Failures", ""]
        lines += [f"* **{name}** failed: `{error}`" for name, error in report.errors.items()]
        lines.append("")
    lines += _routing_section(report, images, folder)
    lines += _overhead_section(report)
    return "\n".join(lines).rstrip("\n") + "\n"


def _routing_section(report: Report, images: dict[str, str] | str, folder: str) -> list[str]:
    if not report.scenarios:
        return []
    tm = report.tm
    lines = [
        "## Routing policies on the simulated cluster",
        "",
        "`loadtests.bench.routing`: every policy gets exactly the same seeded requests at the same "
        "arrival times against a fresh simulated cluster (empty caches). `pd-router` is the joint "
        "prefill/decode picker; `round-robin`, `least-loaded`, `independent` (prefill and decode "
        "pods chosen separately, on pd-router's prices) and `cache-aware` (the SGLang and vLLM "
        "routers' default policy: the longest cached prefix over 0.3 of the prompt, else the least "
        "loaded) are its baselines; `reference` is a full-information picker that "
        "reads the simulator's exact state and plays each engine forward — the bound to measure "
        "against, not a deployable policy; `pd-router-rigid` is pd-router without role-flexible "
        "P/D (prefill pods never serve whole requests); `pd-router-learning` and "
        "`pd-router-static` are pd-router with and without its learned corrections. Goodput is "
        "the share "
        f"of requests with TTFT ≤ {routing.GOODPUT_TTFT_S * MS / tm.speed:g} ms and TPOT ≤ "
        f"{routing.GOODPUT_TPOT_S * MS / tm.speed:g} ms. Cache hit rate is the share of the answered "
        "prompt tokens that no engine had to compute (the simulated engines' counters; the routing "
        "bench's own `hit rate` column, in the collapsed blocks, counts what the answers report as "
        "cached, which for a P/D pair includes the KV sent from the prefill pod). Ratios are against "
        "`pd-router` in the same scenario (below 1: faster than pd-router).",
        "",
    ]
    top = headline(report)
    if top:
        lines += ["### At a glance", "", *top, ""]
    if isinstance(images, str):
        lines += [f"_{images}._", ""]
    else:
        lines += [
            "### Plots",
            "",
            f"![TTFT CDF per policy]({folder}/{images['ttft_cdf']})",
            "",
            f"![Prefix-cache hit rate per policy]({folder}/{images['cache_hit_rate']})",
            "",
            f"![Routing decisions by kind]({folder}/{images['decisions']})",
            "",
            "Decision kinds: **pair** — a prefill pod computes the prompt and its KV moves to a "
            "decode pod (same rack or across racks); **single pod** — one prefill-decode pod does "
            "both; **local prefill** — a decode pod computes the prompt itself (no prefill leg, "
            "usually because it already holds the prefix); **whole on prefill pod** — a prefill pod "
            "serves the whole request (role-flexible P/D, pd-router's default).",
            "",
        ]
    for sr in report.scenarios:
        cold, warm = sr.unloaded
        lines += [
            f"### {sr.title}",
            "",
            f"{sr.requests} requests at {sr.rate:g} req/s{' base' if sr.scenario.key == 'd' else ''}; "
            f"{sr.scenario.params}. Unloaded TTFT (one request at a time on an idle cluster): cold "
            f"{cold * MS:.1f} ms, warm {warm * MS:.1f} ms.",
            "",
            *scenario_table(sr, tm),
            "",
            *_details("the routing bench's own table, prediction errors and targets", sr.text),
        ]
    return lines


def _overhead_section(report: Report) -> list[str]:
    if (
        report.proxy is None
        and report.envoy is None
        and not report.pick
        and not report.tracing
        and report.routers is None
    ):
        return []
    lines = [
        "## Overheads",
        "",
        "Each ratio is routed ÷ direct, both measured back to back in this run on the same "
        "zero-delay null engine with the same client: what pd-router adds, relative to what the "
        "path costs without it. The engine answers instantly, so these are the worst case: with a "
        "real model behind it the same added milliseconds are a far smaller share of a request.",
        "",
    ]
    if report.proxy is not None and report.proxy_args is not None:
        a = report.proxy_args
        lines += [
            "### OpenAI proxy vs the engine directly",
            "",
            "`loadtests.bench.proxy`: small completions over keep-alive connections (closed loop "
            f"at concurrency `conc`), the proxy pinned to CPU {a.proxy_cpu}, engine and client on "
            f"CPU {a.client_cpu}; one `prefill-decode` endpoint (every request is picked). Proxy "
            "CPU is its process's user + system time per request.",
            "",
            *proxy_table(report.proxy),
            "",
            *_details("the proxy bench's own output", "\n".join(proxy_bench.render(a, report.proxy))),
        ]
    if report.tracing and report.tracing_args is not None:
        a = report.tracing_args
        lines += [
            "### Tracing overhead",
            "",
            "`loadtests.bench.proxy --tracing`: the proxy's cells (no direct runs) through "
            + ("`base` (the router at `--tracing-baseline-src`), " if a.baseline_src else "")
            + "`off` (`tracing.enabled: false`) and `on` (`tracing.enabled: true`, every request "
            "sampled, two spans per request exported in batches over OTLP/HTTP to the null engine, "
            f"which drops them), each proxy pinned to CPU {a.proxy_cpu} in turn; medians of "
            f"{a.rounds} rounds with the order of the proxies rotating.",
            "",
            *tracing_table(report.tracing),
            "",
            *_details(
                "the tracing bench's own output", "\n".join(proxy_bench.render_variants(a, report.tracing))
            ),
        ]
    if report.envoy is not None and report.envoy_args is not None:
        a = report.envoy_args
        lines += [
            "### Envoy with pd-router as ext_proc picker vs the same Envoy routing directly",
            "",
            "`loadtests.bench.envoy`: a real Envoy (the example configs in `examples/envoy/`) in "
            f"front of {a.endpoints} null-engine endpoints; `direct` is the same config without the "
            "ext_proc filter (a static round-robin cluster); `extproc` is pd-router picking every "
            "request and following its response, Envoy reaching it over TLS (the default); `ep-h2c` "
            "the same in cleartext (`extproc` ÷ `ep-h2c` is the cost of TLS); `ep-norsp` TLS with "
            "`extproc.response_processing: false`. Medians of "
            f"{a.repeats} interleaved repeats per cell; loads are closed loops at 1/16/64 "
            "connections and 16 connections paced at 1,500 req/s.",
            "",
            *envoy_table(report.envoy),
            "",
            *_details("the Envoy bench's own output", "\n".join(envoy_bench.report(a, report.envoy))),
        ]
    if report.routers is not None:
        lines += [
            "### The standalone proxy against the Rust routers",
            "",
            "`loadtests.bench.routers`: two zero-delay workers behind each router in turn "
            "(sglang-router and vllm-router from their PyPI wheels, both with `--policy cache_aware`; "
            "pd-router as `pd-router serve` runs it), the router pinned to its own core, the workers "
            "and the client on the other; non-streaming completions; each figure the median of "
            "alternating rounds; CPU is the router process's (and its children's) per request. "
            f"`{routers_bench.FLOOR}` is not a router: aiohttp's server and client forwarding each "
            "request to the workers in turn, with no decision and no bookkeeping. "
            f"`{routers_bench.AIOHTTP_LEGS}` is pd-router with its engine legs through aiohttp's client "
            "(`proxy.http_client: aiohttp`) instead of its own (`builtin`, the default).",
            "",
            *routers_bench.render(report.routers),
            "",
        ]
    if report.pick:
        lines += [
            "### `Picker.pick()`",
            "",
            "`loadtests.bench.pick`: the whole pick (candidate gather, prefix lookup, the P×D cost "
            "matrix, argmin, fallbacks, reservation) on 4k-token prompts against an index warm with "
            f"{pick_bench.INDEX_BLOCKS:,} blocks; `record` is the optimistic index update that runs "
            f"right after the pick; {report.sizes.pick_picks} picks × {report.sizes.pick_rounds} "
            "rounds per cell, the median round's percentiles.",
            "",
            *pick_table(report.pick),
            "",
        ]
    return lines


# -- main ------------------------------------------------------------------------------------------


def build(args: argparse.Namespace, argv: list[str]) -> Report:
    sizes = QUICK if args.quick else FULL
    if args.requests:
        sizes = dataclasses.replace(sizes, requests=args.requests)
    tm = TimeModel(speed=1.0)
    contention = Contention()
    report = Report(dt.datetime.now(dt.UTC), argv, args.quick, sizes, tm)
    report.machine = machine()
    overheads = [o for o in args.overhead.split(",") if o]

    def do_routing() -> None:
        report.scenarios = proxy_bench._client_run(
            run_routing(args.scenarios, args.policies, sizes, tm, args.seed, args.misconfigure)
        )

    def do_pick() -> None:
        report.pick = run_pick(sizes, args.seed)

    def do_proxy() -> None:
        with kept_affinity():
            report.proxy_args, report.proxy = run_proxy(sizes)

    def do_envoy() -> None:
        with kept_affinity():
            report.envoy_args, report.envoy = run_envoy(sizes)

    def do_tracing() -> None:
        with kept_affinity():
            report.tracing_args, report.tracing = run_tracing(sizes, args.tracing_baseline_src)

    def do_routers() -> None:
        argv = ["--routers", ",".join(sizes.routers), "--rounds", str(sizes.routers_rounds)]
        with kept_affinity():
            report.routers = routers_bench.run(
                routers_bench.parser().parse_args([*argv, "--scale", str(sizes.routers_scale)])
            )

    if args.scenarios:
        _section(report, "routing", do_routing)
    steps = {
        "pick": do_pick,
        "proxy": do_proxy,
        "tracing": do_tracing,
        "envoy": do_envoy,
        "routers": do_routers,
    }
    for name in OVERHEADS:
        if name in overheads:
            _section(report, name, steps[name])
    report.load_after = _load()
    report.others_cpu = contention.summary()
    return report


# Below this line the markdown is written by hand (measurements with their own commands, such as
# old-against-new comparisons): a new report keeps it.
KEPT = "<!-- Written by hand from here on: the report keeps it when it rewrites the file. -->"


def with_kept(text: str, old: str) -> str:
    """``text`` followed by the hand-written end of ``old`` (from ``KEPT`` on), if it has one."""
    at = old.find(KEPT)
    return text if at < 0 else text.rstrip("\n") + "\n\n" + old[at:]


def write(report: Report, out: Path, dpi: int) -> list[Path]:
    """The markdown and its plots; returns every file written."""
    folder = out.parent / out.stem
    images = plots(report, folder, dpi)
    out.parent.mkdir(parents=True, exist_ok=True)
    old = out.read_text() if out.exists() else ""
    out.write_text(with_kept(render_markdown(report, images, out.stem), old))
    pngs = [folder / name for name in images.values()] if isinstance(images, dict) else []
    return [out, *pngs]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.report",
        description="Run the routing policy comparison and the overhead benchmarks; write a markdown "
        "report with tables and PNG plots.",
    )
    parser.add_argument("--out", default="docs/benchmarks.md", help="markdown file (plots go beside it)")
    parser.add_argument("--quick", action="store_true", help="small samples (~1.5 minutes): a smoke run")
    parser.add_argument(
        "--scenarios",
        default="".join(routing.SCENARIOS),
        help=f"routing scenarios (default: {''.join(routing.SCENARIOS)}; '' skips routing)",
    )
    parser.add_argument(
        "--policies",
        default="",
        help="comma-separated policies run on every scenario (default: each scenario's own)",
    )
    parser.add_argument("--requests", type=int, default=0, help="requests per routing run (default: sized)")
    parser.add_argument(
        "--misconfigure",
        type=float,
        default=3.0,
        help="also run pd-router vs pd-router-static with engines this × slower than configured, "
        "on the first scenario (1: skip)",
    )
    parser.add_argument(
        "--overhead",
        default=",".join(OVERHEADS),
        help=f"comma-separated overhead benchmarks to run, of {', '.join(OVERHEADS)} ('' for none)",
    )
    parser.add_argument(
        "--tracing-baseline-src",
        default="",
        help="a source tree of the router the tracing overhead also runs (e.g. the commit before)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dpi", type=int, default=80, help="PNG resolution")
    args = parser.parse_args(argv)
    unknown = set(args.scenarios) - set(routing.SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {sorted(unknown)}; choose from {sorted(routing.SCENARIOS)}")
    args.policies = [p for p in args.policies.split(",") if p]
    bad = set(args.policies) - set(routing.POLICIES)
    if bad:
        parser.error(f"unknown policy(ies) {sorted(bad)}; choose from {', '.join(routing.POLICIES)}")
    bad = {o for o in args.overhead.split(",") if o} - set(OVERHEADS)
    if bad:
        parser.error(f"unknown overhead benchmark(s) {sorted(bad)}; choose from {', '.join(OVERHEADS)}")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    report = build(args, argv)
    for path in write(report, Path(args.out), args.dpi):
        _log(f"wrote {path}")
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
