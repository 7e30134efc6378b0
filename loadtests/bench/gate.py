"""Admission latency on Kubernetes discovery (a fake API server) in front of simulated engines.

One LeaderWorkerSet group of two ranks (the leader serves, the worker holds a rank), a client
sending a request every few milliseconds, and repeated cycles of:

* **rank loss → revocation**: the worker's Ready condition goes False in the API server; timed
  until the group's endpoints leave the candidate set (``pool.admitted``), i.e. before the next
  pick can use them. The target is one watch event: no scrape interval, no timer.
* **last rank Ready → first routed request**: the worker becomes Ready again; timed until the
  client's first answer from the engine. The target is ≤ 1 s plus the gate's own checks (the
  canary is reported separately).

    python -m loadtests.bench.gate [--cycles 20] [--checks ranks,revision,kv_capacity,canary]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import statistics
import time
from typing import Any

import aiohttp

from loadtests.servers.kube import LWS_INDEX, LWS_KEY, LWS_SIZE, NS, pod, pool, serving
from router.control.discovery.kubernetes import KubernetesDiscovery
from router.server.app import App
from router.server.compose import build
from router.server.config import parse_config
from simulator.engine import EngineSpec, SimCluster, TimeModel


def worker(ready: bool) -> dict[str, Any]:
    labels = {LWS_KEY: "g1", LWS_INDEX: "1"}
    return pod("g1-0-1", "127.0.0.1", labels=labels, annotations={LWS_SIZE: "2"}, ready=ready)


def leader() -> dict[str, Any]:
    labels = {LWS_KEY: "g1", LWS_INDEX: "0"}
    return pod("g1-0", "127.0.0.1", labels=labels, annotations={LWS_SIZE: "2"})


async def client(base: str, answered: list[float], stop: asyncio.Event, gap_s: float) -> None:
    """Sends requests back to back (a small gap), noting when each 200 arrived."""
    body = {"model": "sim-model", "prompt": "ping " * 20, "max_tokens": 1}
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                await resp.read()
                if resp.status == 200:
                    answered.append(time.perf_counter())
            await asyncio.sleep(gap_s)


async def until(predicate: Any, timeout_s: float) -> float:
    """Seconds until ``predicate()`` holds, polling on every loop turn."""
    started = time.perf_counter()
    while not predicate():
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0)
    return time.perf_counter() - started


async def run(cycles: int, checks: list[str], gap_s: float) -> None:
    spec = EngineSpec("e0", "prefill-decode", time=TimeModel(speed=20.0))
    async with serving() as kube, SimCluster([spec]) as cluster:
        port = int(cluster.address("e0").rsplit(":", 1)[1])
        kube.put("pools", pool("qwen", ports=(port,)))
        kube.put("pods", leader())
        kube.put("pods", worker(ready=True))
        config = parse_config(
            {
                "model": "sim-model",
                "kubernetes": {"namespace": NS, "pool_name": "qwen"},
                "proxy": {"port": 0},
                "scrape": {"interval_ms": 200, "stale_after_ms": 5000},
                "gate": {"checks": checks, "canary_min_interval_s": 0, "retry_base_s": 0.05},
            }
        )
        api = kube.client()
        source = KubernetesDiscovery(api, NS, pool_name="qwen", backoff_initial_s=0.01)
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(api.close)
            app = await stack.enter_async_context(App(build(config, discovery=source)))
            assert app.control is not None
            group = app.control.groups["g1"]
            slot = app.parts.pool.endpoints[next(iter(app.parts.pool.endpoints))].slot
            answered: list[float] = []
            stop = asyncio.Event()
            load = asyncio.create_task(client(f"http://127.0.0.1:{app.proxy_port}", answered, stop, gap_s))
            revoke, first, gate_s, canary = [], [], [], []
            try:
                for _ in range(cycles):
                    await until(lambda: group.state.value == "admitted", 10)
                    kube.put("pods", worker(ready=False))
                    revoke.append(await until(lambda: not app.parts.pool.admitted[slot], 10))
                    await asyncio.sleep(0.05)
                    seen = len(answered)
                    kube.put("pods", worker(ready=True))
                    ready_at = time.perf_counter()
                    await until(lambda n=seen, t=ready_at: len(answered) > n and answered[-1] > t, 10)
                    first.append(next(t for t in answered[seen:] if t > ready_at) - ready_at)
                    gate_s.append(sum(c.seconds for c in group.checks))
                    canary.extend(c.seconds for c in group.checks if c.name == "canary")
            finally:
                stop.set()
                with contextlib.suppress(asyncio.CancelledError):
                    await load

    def row(name: str, values: list[float]) -> str:
        if not values:
            return f"  {name:<44} {'-':>9} {'-':>9} {'-':>9}"
        ms = sorted(v * 1000 for v in values)
        p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
        return f"  {name:<44} {statistics.median(ms):>9.2f} {p90:>9.2f} {ms[-1]:>9.2f}"

    print(f"\nadmission latency — Kubernetes discovery (fake API server), {cycles} cycles, checks {checks}")
    print(f"  {'':<44} {'p50 ms':>9} {'p90 ms':>9} {'max ms':>9}")
    print(row("rank loses Ready -> revoked (off candidates)", revoke))
    print(row("last rank Ready -> first routed request", first))
    print(row("  of which: the gate's checks", gate_s))
    print(row("  of which: the canary", canary))
    rest = [f - g for f, g in zip(first, gate_s, strict=True)]
    print(row("  the rest (watch, barrier, client gap)", rest))
    print(
        f"\n  targets: revocation within one watch event (p50 {statistics.median(revoke) * 1000:.1f} ms); "
        f"first request ≤ 1 s + the gate: {max(rest) * 1000:.0f} ms worst -> "
        f"{'PASS' if max(rest) <= 1.0 else 'FAIL'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.gate", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--checks", default="ranks,revision,kv_capacity,canary")
    parser.add_argument("--gap-ms", type=float, default=5.0, help="client pause between requests")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(run(args.cycles, args.checks.split(","), args.gap_ms / 1000.0))


if __name__ == "__main__":
    main()
