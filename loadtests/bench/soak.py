"""Soak: minutes of sustained open-loop load through the proxy and/or a real Envoy, with periodic faults.

One process holds the simulated engines (``SimCluster``: 4 ``prefill-decode`` pods), the router
(``router.server.app.App`` with both the OpenAI proxy and the ext_proc server on) and the load client;
Envoy (``loadtests.servers.envoy``, the ``full-duplex`` example config) is the only child.

Each path runs for its share of ``--minutes`` (``both``: the proxy first, then Envoy, the same
router all along). The load is ``simulator.workloads.generate.shared_prefix`` at ``--rate`` req/s
(Poisson arrivals, seeded), sent open loop by ``simulator.workloads.client``. Every
``--fault-every`` seconds a fault starts on one engine (cycling through the pods) and lasts
``--fault-s`` seconds:

* ``500s``    — the engine answers every completion with HTTP 500 (``SimEngine.set_failing``);
* ``restart`` — the engine is crash-stopped (streams cut) and restarted on the same port;
* ``slow``    — every response of the engine starts ``SLOW_STALL_S`` late (``set_stall``).

Every second: requests finished ok / failed in that second, the p99 TTFT of that second's
successes, the RSS of this process (``VmRSS``: router + engines + client; the engines keep no
request log here, their prefix caches and the router's index are bounded, so sustained growth
is a leak), and ``app.parts.pool.outstanding``. The report is a table per
window (default one minute): requests, error rate, error rate outside faults, p99 TTFT outside
faults, RSS; then the drift (last-window p99 / first-window p99, RSS growth). A request "overlaps
a fault" when its lifetime [sent, finished] meets [fault start, fault end + ``--grace-s``].

    python -m loadtests.bench.soak                            # 3 minutes, proxy then Envoy
    python -m loadtests.bench.soak --minutes 2 --path both --png soak.png
    python -m loadtests.bench.soak --minutes 1 --path proxy --rate 40

Everything listens on 127.0.0.1; every phase is bounded by its duration plus the request timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests.bench.routing import KV_BYTES_PER_TOKEN
from loadtests.servers import envoy
from router.server.app import App
from router.server.compose import build
from router.server.config import parse_config
from simulator.cluster import engine_model_for
from simulator.engine import EngineSpec, SimCluster, TimeModel
from simulator.workloads.client import Result, percentile, run_workload
from simulator.workloads.generate import Workload, shared_prefix

MS = 1000.0
ENGINES = 4
FAULT_KINDS = ("500s", "restart", "slow")
SLOW_STALL_S = 0.3
REQUEST_TIMEOUT_S = 30.0

# Outcomes a request overlapping a fault may end with (anything else, or any failure outside a
# fault, is a bug). Proxy: failover before the first byte hides 500s and refused connections;
# what cannot be hidden is a stream cut mid-way (an error event, docs/architecture.md) or a
# rejection from the one table in router/request/rejections.py (502 UpstreamFailed, 503 NoCapacity).
# Envoy has no retry in the example config: the engine's own 500 goes through until the router
# stops picking it, Envoy answers 503 when it cannot connect, and a cut stream is a reset.
ALLOWED: dict[str, frozenset[str]] = {
    "proxy": frozenset({"http_502", "http_503", "stream:upstream_disconnected"}),
    "envoy": frozenset({"http_500", "http_502", "http_503", "reset", "no_tokens"}),
}


def rss_mb() -> float:
    """This process's resident set size (``VmRSS``), MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def outcome(result: Result) -> str:
    """``ok``, ``http_<status>``, ``stream:<error code>``, ``reset`` (connection cut) or ``no_tokens``."""
    if result.ok:
        return "ok"
    if result.status == 0:
        return "reset"
    if result.status != 200:
        return f"http_{result.status}"
    if result.error == "no tokens":
        return "no_tokens"
    for code in ("upstream_disconnected", "upstream_failed", "upstream_error"):
        if code in result.error:
            return f"stream:{code}"
    return f"stream:{result.error[:60]}"


@dataclass
class Fault:
    kind: str
    engine: str
    start_s: float
    end_s: float = math.inf  # set when the engine is healthy again


@dataclass
class Done:
    path: str
    sent_s: float  # offsets from the start of the soak (all phases share one clock)
    done_s: float
    outcome: str
    ttft_s: float


@dataclass
class Tick:
    t_s: float
    path: str
    ok: int
    failed: int
    p99_ttft_ms: float
    rss_mb: float
    outstanding: int


@dataclass
class Soak:
    paths: list[str]
    grace_s: float
    requests: list[Done] = field(default_factory=list)
    ticks: list[Tick] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)  # path -> (start, end)
    outstanding_end: int = -1
    rss_start_mb: float = float("nan")
    rss_end_mb: float = float("nan")

    def in_fault(self, done: Done) -> bool:
        return any(done.sent_s <= f.end_s + self.grace_s and done.done_s >= f.start_s for f in self.faults)

    def unexpected(self) -> list[Done]:
        """Failures outside every fault, or with an outcome their path does not document."""
        return [
            d
            for d in self.requests
            if d.outcome != "ok" and (not self.in_fault(d) or d.outcome not in ALLOWED[d.path])
        ]

    @property
    def rss_growth_mb(self) -> float:
        return self.rss_end_mb - self.rss_start_mb


# -- one soak --------------------------------------------------------------------------------------


def _config(cluster: SimCluster, tm: TimeModel, extproc: bool) -> Any:
    endpoints = [
        {"address": cluster.address(name), "role": "prefill-decode", "name": name} for name in cluster.engines
    ]
    return parse_config(
        {
            "model": "sim-model",
            "endpoints": endpoints,
            "engine": engine_model_for(tm, KV_BYTES_PER_TOKEN),
            "scrape": {
                "interval_ms": 200,
                "timeout_ms": 500,
                "stale_after_ms": 1500,
                "eject_after_failures": 2,
            },
            "proxy": {"port": 0, "debug_headers": True, "drain_timeout_s": 2},
            "extproc": {"enabled": extproc, "port": 0, "health_port": 0},
        }
    )


async def _fault_loop(
    soak: Soak,
    cluster: SimCluster,
    t0: float,
    phase_end: float,
    every_s: float,
    fault_s: float,
    kinds: Sequence[str],
    counter: list[int],
) -> None:
    """Start a fault every ``every_s`` seconds of the phase, as long as it ends ``every_s / 2`` before
    the phase does (so each phase ends clean); one fault at a time."""
    loop = asyncio.get_running_loop()
    phase_start = loop.time() - t0
    k = 1
    while True:
        start = phase_start + k * every_s
        if start + fault_s + every_s / 2 > phase_end:
            return
        await asyncio.sleep(max(0.0, start - (loop.time() - t0)))
        i = counter[0]
        counter[0] += 1
        kind = kinds[(k - 1) % len(kinds)]
        names = sorted(cluster.engines)
        name = names[i % len(names)]
        fault = Fault(kind, name, loop.time() - t0)
        soak.faults.append(fault)
        if kind == "500s":
            cluster.engines[name].set_failing(500)
        elif kind == "slow":
            cluster.engines[name].set_stall(SLOW_STALL_S)
        elif kind == "restart":
            await cluster.kill(name)
        else:
            raise ValueError(f"unknown fault {kind!r}")
        await asyncio.sleep(fault_s)
        if kind == "500s":
            cluster.engines[name].set_failing(None)
        elif kind == "slow":
            cluster.engines[name].set_stall(0.0)
        else:
            await cluster.revive(name)
        fault.end_s = loop.time() - t0
        k += 1


async def _sampler(soak: Soak, app: App, t0: float, path: str, window: list[Done]) -> None:
    """Once a second: what finished in that second, RSS, outstanding (cancelled at the phase's end)."""
    loop = asyncio.get_running_loop()
    next_t = loop.time() + 1.0
    while True:
        await asyncio.sleep(max(0.0, next_t - loop.time()))
        next_t += 1.0
        batch, window[:] = list(window), []
        ok = [d.ttft_s for d in batch if d.outcome == "ok"]
        soak.ticks.append(
            Tick(
                loop.time() - t0,
                path,
                len(ok),
                len(batch) - len(ok),
                percentile(ok, 0.99) * MS,
                rss_mb(),
                app.parts.pool.outstanding,
            )
        )


async def _phase(
    soak: Soak,
    app: App,
    cluster: SimCluster,
    base_url: str,
    path: str,
    t0: float,
    duration_s: float,
    rate: float,
    seed: int,
    every_s: float,
    fault_s: float,
    kinds: Sequence[str],
    counter: list[int],
) -> None:
    loop = asyncio.get_running_loop()
    n = max(1, int(rate * duration_s * 1.3) + 10)
    items = [
        item
        for item in shared_prefix(
            n, n_prefixes=8, prefix_tokens=512, suffix_tokens=64, max_tokens=16, rate=rate, seed=seed
        ).items
        if item.at_s < duration_s
    ]
    start = loop.time() - t0
    soak.phases[path] = (start, start + duration_s)
    window: list[Done] = []

    def on_done(result: Result) -> None:
        now = loop.time() - t0
        done = Done(path, start + result.at_s, now, outcome(result), result.ttft_s)
        soak.requests.append(done)
        window.append(done)

    sampler = asyncio.create_task(_sampler(soak, app, t0, path, window))
    faults = asyncio.create_task(
        _fault_loop(soak, cluster, t0, start + duration_s, every_s, fault_s, kinds, counter)
    )
    try:
        run = run_workload(
            base_url, Workload(f"soak-{path}", items), timeout_s=REQUEST_TIMEOUT_S, on_done=on_done
        )
        await asyncio.wait_for(run, timeout=duration_s + REQUEST_TIMEOUT_S + 10.0)
        await faults
    finally:
        for task in (sampler, faults):
            task.cancel()
        await asyncio.gather(sampler, faults, return_exceptions=True)


@contextlib.asynccontextmanager
async def _envoy_in_front(app: App) -> AsyncIterator[str]:
    """A real Envoy with the full-duplex example config in front of ``app``'s ext_proc; yields its URL.

    The fail-open fallback is a port nobody listens on, so failing open never passes for routing."""
    assert app.extproc_port is not None
    config, listen, admin = envoy.in_front_of_picker("full-duplex", app.extproc_port)
    with tempfile.TemporaryDirectory(prefix="soak-envoy-") as tmp:
        async with envoy.run_envoy(config, Path(tmp), admin):
            yield f"http://127.0.0.1:{listen}"


async def _settle(app: App, deadline_s: float) -> int:
    """Poll until the router holds no reservation, up to ``deadline_s``; the last value seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while app.parts.pool.outstanding != 0 and loop.time() < deadline:
        await asyncio.sleep(0.02)
    return app.parts.pool.outstanding


async def run_soak(
    paths: Sequence[str],
    seconds_per_path: float,
    rate: float,
    *,
    seed: int = 0,
    fault_every_s: float = 15.0,
    fault_s: float = 5.0,
    kinds: Sequence[str] = FAULT_KINDS,
    grace_s: float = 1.0,
    speed: float = 1.0,
) -> Soak:
    """Run each path in turn against one cluster and one router; the whole soak's record."""
    tm = TimeModel(speed=speed)
    specs = [EngineSpec(f"pod-{i}", "prefill-decode", num_gpu_blocks=2048, time=tm) for i in range(ENGINES)]
    soak = Soak(list(paths), grace_s)
    counter = [0]
    # The engines' logs of requests seen (for tests: the last 1,000 bodies each, ~30 MB here, and
    # anew after each restart) would fill during the run and pass for the router's growth.
    cluster = SimCluster(specs, seen_limit=8)
    async with cluster, App(build(_config(cluster, tm, "envoy" in paths), seed=seed)) as app:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        soak.rss_start_mb = rss_mb()
        for i, path in enumerate(paths):
            args = (t0, seconds_per_path, rate, seed + i, fault_every_s, fault_s, kinds, counter)
            if path == "proxy":
                await _phase(soak, app, cluster, f"http://127.0.0.1:{app.proxy_port}", path, *args)
            else:
                async with _envoy_in_front(app) as url:
                    await _phase(soak, app, cluster, url, path, *args)
            sys.stderr.write(f"  {path} phase done ({loop.time() - t0:.0f} s)\n")
        soak.outstanding_end = await _settle(app, 10.0)
        soak.rss_end_mb = rss_mb()
    return soak


# -- report ----------------------------------------------------------------------------------------


def _f(value: float, digits: int = 1) -> str:
    return "-" if value != value else f"{value:.{digits}f}"


def report(soak: Soak, window_s: float = 60.0) -> list[str]:
    header = (
        f"  {'path':<6} {'window s':>11} {'requests':>8} {'failed':>6} {'err %':>6} {'err % out':>9} "
        f"{'p99 TTFT ms':>11} {'RSS MB':>7} {'outst. max':>10}"
    )
    lines = [
        "",
        f"Soak — {ENGINES} simulated prefill-decode pods, shared-prefix load; faults: "
        + ", ".join(f"{f.kind}@{f.engine} {f.start_s:.0f}-{f.end_s:.0f}s" for f in soak.faults),
        "  err % out = error rate of requests overlapping no fault; p99 TTFT of those requests; "
        "RSS of the one process (router + engines + client)",
        "",
        header,
        "  " + "-" * (len(header) - 2),
    ]
    for path in soak.paths:
        start, end = soak.phases[path]
        windows: list[tuple[float, float]] = []
        w0 = start
        while w0 < end:
            w1 = w0 + window_s
            if w1 > end - 1.0:  # a remainder under a second joins this window
                w1 = end
            windows.append((w0, w1))
            w0 = w1
        for a, b in windows:
            reqs = [d for d in soak.requests if d.path == path and a <= d.sent_s < b]
            failed = [d for d in reqs if d.outcome != "ok"]
            clean = [d for d in reqs if not soak.in_fault(d)]
            clean_failed = [d for d in clean if d.outcome != "ok"]
            q = percentile([d.ttft_s for d in clean if d.outcome == "ok"], 0.99) * MS
            ticks = [t for t in soak.ticks if t.path == path and a < t.t_s <= b + 0.5]
            rss = ticks[-1].rss_mb if ticks else float("nan")
            outst = max((t.outstanding for t in ticks), default=0)
            lines.append(
                f"  {path:<6} {f'{a:.0f}-{b:.0f}':>11} {len(reqs):>8} {len(failed):>6} "
                f"{_f(100.0 * len(failed) / len(reqs) if reqs else math.nan, 2):>6} "
                f"{_f(100.0 * len(clean_failed) / len(clean) if clean else math.nan, 2):>9} "
                f"{_f(q):>11} {_f(rss):>7} {outst:>10}"
            )
        # Drift: the last vs the first stretch of the phase (a window, or a quarter of a short phase).
        span = min(window_s, (end - start) / 4)

        def clean_p99(a: float, b: float, path: str = path) -> float:
            ok = [
                d.ttft_s
                for d in soak.requests
                if d.path == path and a <= d.sent_s < b and d.outcome == "ok" and not soak.in_fault(d)
            ]
            return percentile(ok, 0.99) * MS

        first, last = clean_p99(start, start + span), clean_p99(end - span, end)
        drift = last / first if first > 0 else math.nan
        outcomes: dict[str, int] = {}
        for d in soak.requests:
            if d.path == path and d.outcome != "ok":
                outcomes[d.outcome] = outcomes.get(d.outcome, 0) + 1
        lines.append(
            f"  {path:<6} p99 drift (last / first {span:.0f} s) {_f(last)} / {_f(first)} ms = "
            f"{_f(drift, 2)}×; failures: "
            + (", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) or "none")
        )
        lines.append("")
    unexpected = soak.unexpected()
    lines += [
        f"  RSS {_f(soak.rss_start_mb)} MB -> {_f(soak.rss_end_mb)} MB (growth {_f(soak.rss_growth_mb)} MB); "
        f"outstanding at the end {soak.outstanding_end}",
        f"  unexpected failures (outside faults or undocumented outcome): {len(unexpected)}"
        + (
            " — " + ", ".join(f"{d.path} {d.outcome} @{d.sent_s:.1f}s" for d in unexpected[:10])
            if unexpected
            else ""
        ),
    ]
    return lines


def plot(soak: Soak, png: str) -> str:
    """Write the per-second series to ``png``; a message either way (matplotlib is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib not installed: {png} not written"
    t = [tick.t_s for tick in soak.ticks]
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    axes[0].plot(t, [tick.ok for tick in soak.ticks], label="ok / s", color="tab:green")
    axes[0].plot(t, [tick.failed for tick in soak.ticks], label="failed / s", color="tab:red")
    axes[0].set_ylabel("requests / s")
    axes[1].plot(t, [tick.p99_ttft_ms for tick in soak.ticks], color="tab:blue")
    axes[1].set_ylabel("p99 TTFT ms (per s)")
    axes[1].set_yscale("log")
    axes[2].plot(t, [tick.rss_mb for tick in soak.ticks], color="tab:purple", label="RSS MB")
    axes[2].set_ylabel("RSS MB")
    ax2 = axes[2].twinx()
    ax2.plot(t, [tick.outstanding for tick in soak.ticks], color="tab:gray", lw=0.8)
    ax2.set_ylabel("outstanding", color="tab:gray")
    axes[2].set_xlabel("seconds")
    for ax in axes:
        for f in soak.faults:
            ax.axvspan(f.start_s, f.end_s, color="orange", alpha=0.2)
        for path, (a, _) in soak.phases.items():
            ax.axvline(a, color="black", lw=0.6)
            if ax is axes[0]:
                ax.text(a, 0, f" {path}", va="bottom")
    for f in soak.faults:
        axes[0].text(f.start_s, axes[0].get_ylim()[1], f.kind, fontsize=7, va="top")
    axes[0].legend(loc="upper right")
    fig.suptitle("pd-router soak (orange: fault windows)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return f"wrote {png}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.soak",
        description="Sustained load through the proxy and/or Envoy with periodic engine faults.",
    )
    parser.add_argument("--minutes", type=float, default=3.0, help="total duration, split over the paths")
    parser.add_argument("--rate", type=float, default=20.0, help="arrival rate, requests/s")
    parser.add_argument("--path", choices=("proxy", "envoy", "both"), default="both")
    parser.add_argument("--png", default="soak.png", help="per-second plot ('' to skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault-every", type=float, default=15.0, help="seconds between fault starts")
    parser.add_argument("--fault-s", type=float, default=5.0, help="how long each fault lasts")
    parser.add_argument("--grace-s", type=float, default=1.0, help="a fault's window extends this long")
    parser.add_argument("--window", type=float, default=60.0, help="table window, seconds")
    args = parser.parse_args(argv)
    for name in ("minutes", "rate", "fault_every", "fault_s", "window"):
        if getattr(args, name) <= 0:  # a fault every 0 s would never let a phase end
            parser.error(f"--{name.replace('_', '-')} must be above 0")
    paths = ["proxy", "envoy"] if args.path == "both" else [args.path]
    logging.basicConfig(level=logging.ERROR)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    started = time.monotonic()
    soak = runner(
        run_soak(
            paths,
            args.minutes * 60.0 / len(paths),
            args.rate,
            seed=args.seed,
            fault_every_s=args.fault_every,
            fault_s=args.fault_s,
            grace_s=args.grace_s,
        )
    )
    lines = report(soak, args.window)
    lines.append(f"  wall {time.monotonic() - started:.0f} s")
    if args.png:
        lines.append("  " + plot(soak, args.png))
    sys.stdout.write("\n".join(lines) + "\n")
    return 1 if soak.unexpected() or soak.outstanding_end != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
