"""N picker replicas over one pool, in virtual time: does routing stay as good as one replica's?

A gateway spreads requests over the picker replicas (Envoy: its ext_proc cluster's hosts, round
robin). A replica knows only what it routed unless the replicas share through Redis
(``index.redis``: the prefix index, and the in-flight reservations every
``index.redis.share_load_ms``). Here N routers, each built as the service builds itself, run in one
process on the quality harness's virtual clock over the same simulated engines; requests are dealt
to them round robin; Redis is an in-process fakeredis server the N share, so every run is
deterministic. Each row: TTFT p50/p90/p99 and goodput, and p90 over one replica's in the same run.

Near saturation a router's own seed (how it breaks exact ties) moves a run's p90 as much as a
workload seed does: one replica's (b) p90 on workload seed 4 is 332–582 ms over four router seeds.
``--router-seeds N`` runs every workload seed with N router seeds and pools them, so a row's ratio
to one replica is not one draw of that spread; the per-run p90s (min–max) go to stderr.

One workload seed can be ten times another's p90 near saturation, so a pooled p90 mostly says
which seeds saturate. ``paired`` compares each run with one replica's run of the same workload
(and router) seed instead: the median of the per-run p90 ratios.

``--envoy`` runs the same comparison as processes on the wall clock: each replica a
``pd-router serve`` process, one real Envoy whose ext_proc cluster has every replica as a host
(round robin, the example configuration), a real redis-server for the shared setups, the engines
serving real HTTP. On a small machine the replicas, Envoy, the engines and the load share the
cores, so read its ratios, not its milliseconds, and run it more than once. Its rows also say what
sharing costs: each replica's time per decision, and the CPU all the replicas and redis-server
spent per request while the requests ran (``/proc``). ``--lone`` adds one replica given a Redis.

    python -m loadtests.bench.replicas                        # (a) and (b), 1/2/4 replicas
    python -m loadtests.bench.replicas --scenarios b --replicas 1,2 --seeds 0,1
    python -m loadtests.bench.replicas --seeds 0,1,2,3,4,5 --router-seeds 3  # 18 runs a row
    python -m loadtests.bench.replicas --envoy --scenarios ab --replicas 1,2,4
    python -m loadtests.bench.replicas --envoy --scenarios a --replicas 1,4 --lone --no-independent
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import aiohttp
import fakeredis

from loadtests.bench.proxy import process_cpu_s
from loadtests.bench.quality import MS, VIRTUAL_OVERRIDES, RouterUnderTest, _drive, local_exchange
from loadtests.bench.scenarios import (
    HOP_S,
    SCENARIOS,
    Scenario,
    config_data,
    goodput,
    router_links,
    scaled_links,
)
from loadtests.servers.envoy import in_front_of_picker, run_envoy
from loadtests.servers.picker import PickerProcess
from loadtests.servers.redis import RedisServer
from router.adapters.openai import Proxy
from router.server import app as app_module
from router.server.app import App
from router.server.compose import build
from router.server.config import LinksConfig, PoolConfig, parse_config
from simulator.cluster import link_cost_from
from simulator.engine import SimCluster, TimeModel
from simulator.local_net import LocalSession
from simulator.virtual_clock import run_virtual
from simulator.workloads.client import Summary, percentile, run_workload

# The engines' scrape interval of the replicas behind Envoy: the configuration's default, as in the
# virtual runs (config_data). PickerProcess's own 50 ms multiplies the scrapes' CPU by the replicas,
# on the machine the engines and Envoy share.
SCRAPE_MS = PoolConfig.model_fields["scrape"].default.interval_ms


class _FakeRedis(fakeredis.FakeAsyncRedis):
    """fakeredis without INFO, which the shared prefix index reads a restart from (the run_id)."""

    async def info(self, section: str | None = None, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"run_id": "in-process"}


@dataclass(frozen=True)
class Setup:
    replicas: int
    shared: bool  # through one Redis: prefix index and reservations; else each on its own
    push: bool = True  # shared: ``index.redis.push`` (others' writes pushed, the default; else asked for)

    @property
    def name(self) -> str:
        if self.replicas == 1:
            return "1 replica, with Redis" if self.shared else "1 replica"
        if not self.shared:
            return f"{self.replicas} replicas, independent"
        return f"{self.replicas} replicas, " + ("shared" if self.push else "shared, asked")

    def redis(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """The shared setups' ``index.redis`` beyond its URL: ``settings`` and this setup's push."""
        return {**settings, "push": self.push}


def setups(
    counts: Sequence[int], push: Sequence[bool] = (True,), independent: bool = True, lone: bool = False
) -> list[Setup]:
    """One replica (and, with ``lone``, one given a Redis, as a deployment scaled down to one),
    then per count N > 1 the shared setups (asked and/or pushed, as ``push`` lists) and, with
    ``independent``, N replicas sharing nothing."""
    out = []
    for n in counts:
        if n == 1:
            out += [Setup(1, False), *([Setup(1, True)] if lone else [])]
            continue
        out += [Setup(n, True, p) for p in push]
        if independent:
            out.append(Setup(n, False))
    return out


async def _run(
    scn: Scenario,
    setup: Setup,
    seed: int,
    tm: TimeModel,
    hop_s: float,
    redis_settings: Mapping[str, Any],
    requests: int,
    router_seed: int = 0,
) -> Summary:
    workload = scn.workload(requests, scn.rate, seed)
    physical, links = scaled_links(scn.links, tm.speed), router_links(scn, tm.speed)
    link_cost = link_cost_from(LinksConfig.model_validate(physical)) if physical else None
    server = fakeredis.FakeServer()

    def fake_redis(url: str, password: str | None) -> Any:
        return _FakeRedis(server=server)

    async with SimCluster(scn.specs(tm), link_cost, in_process=True) as cluster:
        session = LocalSession(cluster, hop_s=hop_s)
        endpoints = [(n, cluster.address(n), e.spec.role, e.spec.link) for n, e in cluster.engines.items()]
        data = config_data(endpoints, tm, links, {"policy": "joint"})
        if setup.shared:
            data.setdefault("index", {})["redis"] = {"url": "redis://fake", **setup.redis(redis_settings)}
        with mock.patch.object(app_module, "upstream_session", lambda: session):
            async with contextlib.AsyncExitStack() as stack:
                proxies = []
                for i in range(setup.replicas):
                    config = parse_config(json.loads(json.dumps(data)), list(VIRTUAL_OVERRIDES))
                    parts = build(config, seed=_router_seed(seed, router_seed, i), redis=fake_redis)
                    app = await stack.enter_async_context(App(parts))
                    exchange = local_exchange(session, config.proxy)
                    proxies.append(Proxy(app.parts.flow, exchange, lambda: True, debug_headers=True))
                turn = itertools.cycle(proxies)

                async def dealt(request: Any) -> Any:
                    return await next(turn).completions(request)

                router = RouterUnderTest(dealt, proxies[0].max_body_bytes, "flow")
                return await _drive(router, workload, setup.name)


def _router_seed(seed: int, router_seed: int, replica: int) -> int:
    """Replica ``replica``'s seed: distinct per workload seed, router seed and replica (router
    seed 0 keeps the seeds every earlier run of this benchmark used)."""
    return seed * 100 + replica + 1_000_000 * router_seed


def run_setup(
    scn: Scenario,
    setup: Setup,
    seed: int,
    *,
    hop_s: float = HOP_S,
    redis_settings: Mapping[str, Any] | None = None,
    requests: int | None = None,
    router_seed: int = 0,
) -> Summary:
    """One setup on one scenario (``requests``: the scenario's own count by default) in a fresh
    virtual loop; ``redis_settings``: the shared setups' ``index.redis`` beyond its URL (such as
    ``share_load_ms``; the defaults otherwise); ``router_seed``: which draw of the routers' own
    seeds."""
    run = _run(
        scn, setup, seed, TimeModel(), hop_s, redis_settings or {}, requests or scn.requests, router_seed
    )
    return run_virtual(run, seed=seed)


class EnvoyRun(NamedTuple):
    """One setup's run behind Envoy: its requests, and what the replicas and Redis spent on them."""

    summary: Summary
    decision_s: float  # the replicas' own time deciding (parse, producers, pick), summed
    decisions: int
    router_cpu_s: float  # the replicas' processes, user + system, while the requests ran
    redis_cpu_s: float  # redis-server's, likewise (0 without one)


async def _run_behind_envoy(
    scn: Scenario,
    setup: Setup,
    seed: int,
    requests: int,
    workdir: Path,
    redis_settings: Mapping[str, Any],
    scrape_ms: float,
) -> EnvoyRun:
    tm = TimeModel()
    workload = scn.workload(requests, scn.rate, seed)
    link_cost = link_cost_from(LinksConfig.model_validate(scn.links)) if scn.links else None
    async with contextlib.AsyncExitStack() as stack:
        cluster = await stack.enter_async_context(SimCluster(scn.specs(tm), link_cost))
        endpoints = [(n, cluster.address(n), e.spec.role, e.spec.link) for n, e in cluster.engines.items()]
        data = config_data(endpoints, tm, router_links(scn, tm.speed), {"policy": "joint"})
        # The replicas' own listeners and scraping (PickerProcess) over the scenario's pool and model.
        settings = {key: value for key, value in data.items() if key not in ("proxy", "scrape")}
        settings["scrape"] = {"interval_ms": scrape_ms}
        redis: RedisServer | None = None
        if setup.shared:
            redis = RedisServer(workdir)
            redis.start()
            stack.callback(redis.kill)
            settings["index"] = {
                **settings.get("index", {}),
                "redis": {
                    "url": f"redis://127.0.0.1:{redis.port}/0",
                    **setup.redis(redis_settings),
                },
            }
        pickers = [
            PickerProcess(workdir / f"picker{i}", [], settings=settings) for i in range(setup.replicas)
        ]
        for picker in pickers:
            stack.push_async_callback(picker.kill)
            await picker.start()
        first, *others = pickers
        config, listen, admin = in_front_of_picker("buffered", first.port, replicas=[p.port for p in others])
        await stack.enter_async_context(run_envoy(config, workdir, admin))
        pids = [picker.pid for picker in pickers]

        def cpu_s() -> tuple[float, float]:
            return sum(map(process_cpu_s, pids)), 0.0 if redis is None else process_cpu_s(redis.pid)

        router0, redis0 = cpu_s()
        summary = await run_workload(f"http://127.0.0.1:{listen}", workload, name=setup.name)
        router1, redis1 = cpu_s()
        seconds, decisions = 0.0, 0
        for picker in pickers:  # every replica's own time per decision (parse, producers, pick)
            spent, count = await _pick_duration(picker.metrics_port)
            seconds, decisions = seconds + spent, decisions + count
        return EnvoyRun(summary, seconds, decisions, router1 - router0, redis1 - redis0)


async def _pick_duration(port: int) -> tuple[float, int]:
    """``pd_router_pick_duration_seconds``' sum and count from a replica's metrics listener."""
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    values = dict(
        line.split()[:2] for line in text.splitlines() if line.startswith("pd_router_pick_duration")
    )
    total = float(values.get("pd_router_pick_duration_seconds_sum", 0.0))
    return total, int(float(values.get("pd_router_pick_duration_seconds_count", 0)))


def run_setup_behind_envoy(
    scn: Scenario,
    setup: Setup,
    seed: int,
    *,
    redis_settings: Mapping[str, Any] | None = None,
    requests: int | None = None,
    scrape_ms: float = SCRAPE_MS,
) -> EnvoyRun:
    """One setup as processes behind a real Envoy, on the wall clock (see the module's docstring)."""
    with tempfile.TemporaryDirectory(prefix="replicas-") as workdir:
        run = _run_behind_envoy(
            scn, setup, seed, requests or scn.requests, Path(workdir), redis_settings or {}, scrape_ms
        )
        return asyncio.run(run)


def row(scn: Scenario, setup: Setup, summaries: list[Summary], one_p90: float | None) -> dict[str, Any]:
    ttft = [r.ttft_s for s in summaries for r in s.ok]
    total = sum(len(s.results) for s in summaries)
    ok = sum(len(s.ok) for s in summaries)
    good = sum(goodput(s, scn.goodput_ttft_s, scn.goodput_tpot_s) * len(s.results) for s in summaries)
    good /= max(1, total)
    p90 = percentile(ttft, 0.9) * MS if ttft else float("nan")
    return {
        "scenario": scn.key,
        "setup": setup.name,
        "ok": f"{ok}/{total}",
        "ttft_p50_ms": percentile(ttft, 0.5) * MS if ttft else float("nan"),
        "ttft_p90_ms": p90,
        "ttft_p99_ms": percentile(ttft, 0.99) * MS if ttft else float("nan"),
        "goodput": good,
        "p90_vs_one": p90 / one_p90 if one_p90 else float("nan"),
    }


def paired_ratio(runs: Sequence[float], one_replica: Sequence[float] | None) -> float:
    """The median over runs of each run's p90 over one replica's run of the same seeds: the
    workloads' own spread (one seed saturates, another does not) stays out of each ratio, and one
    wild run moves the median less than it moves a pooled p90."""
    if not one_replica or len(runs) != len(one_replica):
        return float("nan")
    ratios = [mine / one for mine, one in zip(runs, one_replica, strict=True) if one > 0]
    return float(statistics.median(ratios)) if ratios else float("nan")


def print_table(rows: list[dict[str, Any]]) -> None:
    """TTFT p50/p90/p99 ms, goodput, p90 over one replica's (pooled, and paired run by run); behind
    Envoy also the replicas' time per decision and the CPU the replicas (all of them) and Redis spent
    per request."""

    def ms(r: dict[str, Any], key: str) -> str:
        return "" if r.get(key) is None else f"{r[key]:.2f}"

    print(
        f"  {'scenario':<9}{'setup':<26}{'ok':>10}{'p50':>9}{'p90':>9}{'p99':>9}{'goodput':>9}{'p90/1':>8}"
        f"{'paired':>8}{'decision ms':>13}{'CPU ms/req':>12}{'Redis ms/req':>14}"
    )
    for r in rows:
        print(
            f"  {r['scenario']:<9}{r['setup']:<26}{r['ok']:>10}{r['ttft_p50_ms']:>9.1f}"
            f"{r['ttft_p90_ms']:>9.1f}{r['ttft_p99_ms']:>9.1f}{r['goodput']:>8.1%}{r['p90_vs_one']:>8.2f}"
            f"{r['paired_vs_one']:>8.2f}"
            f"{ms(r, 'decision_ms'):>13}{ms(r, 'router_cpu_ms'):>12}{ms(r, 'redis_cpu_ms'):>14}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scenarios", default="ab", help="scenario keys (default: a, shared prefixes; b, chat)"
    )
    parser.add_argument("--replicas", default="1,2,4", help="replica counts (default: 1,2,4)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds, pooled per row")
    parser.add_argument(
        "--share-load-ms", type=float, help="index.redis.share_load_ms (default: its default)"
    )
    parser.add_argument(
        "--push",
        choices=("off", "on", "both"),
        default="on",
        help="index.redis.push for the shared setups: on (pushed, the router's default), off (asked), "
        "or both side by side",
    )
    parser.add_argument(
        "--no-independent", action="store_true", help="leave out the replicas that share nothing"
    )
    parser.add_argument(
        "--lone",
        action="store_true",
        help="add one replica given a Redis (a deployment scaled down to one), beside one without",
    )
    parser.add_argument(
        "--router-seeds",
        type=int,
        default=1,
        help="router seeds per workload seed, pooled per row (virtual only; default 1)",
    )
    parser.add_argument("--requests", type=int, help="requests per run (default: the scenario's)")
    parser.add_argument(
        "--envoy", action="store_true", help="processes behind a real Envoy on the wall clock instead"
    )
    parser.add_argument(
        "--scrape-ms",
        type=float,
        default=SCRAPE_MS,
        help=f"--envoy: each replica's engine scrape interval (default {SCRAPE_MS:g}, the configuration's)",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead")
    args = parser.parse_args(argv)
    if args.router_seeds < 1:
        parser.error("--router-seeds must be at least 1")
    if args.envoy and args.router_seeds > 1:
        parser.error("--router-seeds is for the virtual runs: behind Envoy each run's timing differs anyway")
    counts = sorted({int(n) for n in args.replicas.split(",")} | {1})
    seeds = [int(s) for s in args.seeds.split(",")]
    redis: dict[str, Any] = {} if args.share_load_ms is None else {"share_load_ms": args.share_load_ms}
    push = {"off": (False,), "on": (True,), "both": (False, True)}[args.push]
    rows = []
    for key in args.scenarios:
        scn = SCENARIOS[key]
        one_p90: float | None = None
        one_runs: list[float] | None = None
        for setup in setups(counts, push, independent=not args.no_independent, lone=args.lone):
            costs: dict[str, float] = {}
            if args.envoy:
                runs = [
                    run_setup_behind_envoy(
                        scn,
                        setup,
                        seed,
                        redis_settings=redis,
                        requests=args.requests,
                        scrape_ms=args.scrape_ms,
                    )
                    for seed in seeds
                ]
                summaries = [run.summary for run in runs]
                requests = max(1, sum(len(run.summary.results) for run in runs))
                decisions = max(1, sum(run.decisions for run in runs))
                costs = {
                    "decision_ms": sum(r.decision_s for r in runs) / decisions * MS,
                    "router_cpu_ms": sum(r.router_cpu_s for r in runs) / requests * MS,
                    "redis_cpu_ms": sum(r.redis_cpu_s for r in runs) / requests * MS,
                }
            else:
                summaries = [
                    run_setup(scn, setup, seed, redis_settings=redis, requests=args.requests, router_seed=r)
                    for seed in seeds
                    for r in range(args.router_seeds)
                ]
            result = {**row(scn, setup, summaries, one_p90), **costs}
            each = [s.pct("ttft_s", 0.9) * MS for s in summaries]
            if setup == Setup(1, False):
                one_p90, one_runs = result["ttft_p90_ms"], each
                result["p90_vs_one"] = 1.0
            result["run_p90_ms"] = each
            result["paired_vs_one"] = paired_ratio(each, one_runs)
            rows.append(result)
            if not args.json:
                print(
                    f"  [{key}] {setup.name}: p90 TTFT {result['ttft_p90_ms']:.1f} ms"
                    f" (runs: {min(each):.1f}–{max(each):.1f})",
                    file=sys.stderr,
                )
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
