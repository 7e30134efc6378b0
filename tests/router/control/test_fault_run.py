"""A randomized fault run on Kubernetes discovery while traffic flows: ranks lose Ready and come
back, revisions diverge and converge, leaders drain and return. Counted from the engines' own
logs (when each request reached them), no request may reach a group from the moment the router
revoked it (plus the time a request picked just before takes to arrive) until the test repaired it.
How fast a revocation follows the watch event is not timed here (a loaded machine delays it); the
poll for it is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import aiohttp
from helpers import eventually

from loadtests.servers.kube import LWS_INDEX, LWS_KEY, LWS_REVISION, LWS_SIZE, NS, pod, pool, serving
from router.control.discovery.kubernetes import KubernetesDiscovery
from router.control.gate import CANARY_HEADER
from router.server.app import App
from router.server.compose import build
from router.server.config import parse_config
from simulator.engine import EngineSpec, SimCluster, TimeModel

GROUPS = 3
FAULTS = 24
# A request picked just before the revocation may still reach the engine: one forward.
IN_FLIGHT_S = 0.1


def rank(
    group: int, index: int, port: int, *, ready: bool = True, revision: str = "r1", draining: bool = False
):
    labels = {LWS_KEY: f"g{group}", LWS_INDEX: str(index), LWS_REVISION: revision}
    # Every pod shares the loopback IP: active-ports gives each leader its own engine's port.
    annotations = {LWS_SIZE: "2", "llm-d.ai/active-ports": str(port)}
    name = f"g{group}-0" if index == 0 else f"g{group}-0-{index}"
    return pod(name, "127.0.0.1", labels=labels, annotations=annotations, ready=ready, deleting=draining)


async def traffic(base: str, stop: asyncio.Event, answered: list[int]) -> None:
    body = {"model": "sim-model", "prompt": "fault run " * 10, "max_tokens": 1}
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                await resp.read()
                answered.append(resp.status)
            await asyncio.sleep(0.002)


async def test_no_request_reaches_a_group_outside_an_admitted_epoch() -> None:
    rng = random.Random(7)
    specs = [EngineSpec(f"e{i}", "prefill-decode", time=TimeModel(speed=50.0)) for i in range(GROUPS)]
    async with serving() as kube, SimCluster(specs) as cluster:
        ports = [int(cluster.address(f"e{i}").rsplit(":", 1)[1]) for i in range(GROUPS)]
        kube.put("pools", pool("qwen", ports=tuple(ports)))
        for g in range(GROUPS):
            kube.put("pods", rank(g, 0, ports[g]))
            kube.put("pods", rank(g, 1, ports[g]))
        config = parse_config(
            {
                "model": "sim-model",
                "kubernetes": {"namespace": NS, "pool_name": "qwen"},
                "proxy": {"port": 0},
                "scrape": {"interval_ms": 50, "stale_after_ms": 5000},
                "gate": {
                    "checks": ["ranks", "revision", "kv_capacity", "canary"],
                    "canary_min_interval_s": 0,
                    "retry_base_s": 0.02,
                    "retry_max_s": 0.1,
                },
            }
        )
        source = KubernetesDiscovery(kube.client(), NS, pool_name="qwen", backoff_initial_s=0.01)
        broken: dict[int, list[tuple[float, float]]] = {g: [] for g in range(GROUPS)}  # forbidden windows
        async with App(build(config, discovery=source)) as app:
            assert app.control is not None
            base = f"http://127.0.0.1:{app.proxy_port}"
            await eventually(
                lambda: all(r.state.value == "admitted" for r in app.control.groups.values()),
                5,
                "all admitted",
            )
            stop = asyncio.Event()
            answered: list[int] = []
            clients = [asyncio.create_task(traffic(base, stop, answered)) for _ in range(3)]
            try:
                for _ in range(FAULTS):
                    g = rng.randrange(GROUPS)
                    record = app.control.groups[f"g{g}"]
                    await eventually(
                        lambda r=record: r.state.value == "admitted", 5, "admitted before a fault"
                    )
                    slots = [app.parts.pool.endpoints[i].slot for i in record.endpoint_ids]
                    fault = rng.choice(["not-ready", "revision", "drain"])
                    if fault == "not-ready":
                        kube.put("pods", rank(g, 1, ports[g], ready=False))
                    elif fault == "revision":
                        kube.put("pods", rank(g, 1, ports[g], revision="r2"))
                    else:
                        kube.put("pods", rank(g, 0, ports[g], draining=True))
                    await eventually(lambda s=slots: not app.parts.pool.admitted[s].any(), 5, "revoked")
                    revoked = time.monotonic()
                    # traffic keeps flowing meanwhile, past the in-flight allowance
                    await asyncio.sleep(IN_FLIGHT_S + rng.uniform(0.05, 0.15))
                    broken[g].append((revoked + IN_FLIGHT_S, time.monotonic()))
                    kube.put("pods", rank(g, 0, ports[g]))
                    kube.put("pods", rank(g, 1, ports[g]))
            finally:
                stop.set()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.gather(*clients)

    served = 0
    violations: list[tuple[int, float]] = []
    for g in range(GROUPS):
        for arrived, headers in cluster.engines[f"e{g}"].arrivals:
            if CANARY_HEADER in headers:
                continue
            served += 1
            if any(begin <= arrived < end for begin, end in broken[g]):
                violations.append((g, arrived))
    assert violations == []
    # The run had teeth: real traffic to every group, and every group broken at least once.
    assert served > 100 and all(broken.values())
    assert answered.count(200) >= served - 5  # the rest: 503s while every group was down at once
