"""The router on Kubernetes discovery (a fake API server) in front of simulated engines: a group
gets traffic only while its current epoch is admitted, counted from the engines' own logs."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from helpers import eventually

from loadtests.servers.kube import LWS_INDEX, LWS_KEY, LWS_SIZE, NS, FakeKube, pod, pool, serving
from router.control.discovery.kubernetes import KubernetesDiscovery
from router.control.gate import CANARY_HEADER
from router.server.app import App
from router.server.compose import build
from router.server.config import parse_config
from simulator.engine import EngineSpec, SimCluster, TimeModel

FAST = TimeModel(speed=20.0)


def served(cluster: SimCluster) -> int:
    return sum(
        1
        for engine in cluster.engines.values()
        for _, headers, _ in engine.requests_seen
        if CANARY_HEADER not in headers
    )


async def statuses(base: str, n: int = 4) -> list[int]:
    out = []
    async with aiohttp.ClientSession() as http:
        for i in range(n):
            body = {"model": "sim-model", "prompt": f"hello {i} " * 20, "max_tokens": 2}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                await resp.read()
                out.append(resp.status)
    return out


def lws(name: str, index: int, *, uid: str | None = None, **kw: Any) -> dict[str, Any]:
    labels = {LWS_KEY: "g1", LWS_INDEX: str(index)}
    return pod(name, "127.0.0.1", uid=uid, labels=labels, annotations={LWS_SIZE: "2"}, **kw)


@contextlib.asynccontextmanager
async def router_on_kube() -> AsyncIterator[tuple[FakeKube, SimCluster, App, str]]:
    specs = [EngineSpec(n, "prefill-decode", time=FAST) for n in ("e0", "e1")]
    async with serving() as kube, SimCluster(specs) as cluster:
        ports = tuple(int(cluster.address(n).rsplit(":", 1)[1]) for n in ("e0", "e1"))
        kube.put("pools", pool("qwen", ports=ports))
        kube.put("pods", lws("g1-0", 0))
        kube.put("pods", lws("g1-0-1", 1, ready=False))  # the worker rank is still starting
        config = parse_config(
            {
                "model": "sim-model",
                "kubernetes": {"namespace": NS, "pool_name": "qwen"},
                "scrape": {"interval_ms": 50, "timeout_ms": 300, "stale_after_ms": 1000},
                "proxy": {"port": 0},
                "gate": {"retry_base_s": 0.05, "initial_wait_s": 5},
            }
        )
        source = KubernetesDiscovery(kube.client(), NS, pool_name="qwen", backoff_initial_s=0.01)
        async with App(build(config, discovery=source)) as app:
            yield kube, cluster, app, f"http://127.0.0.1:{app.proxy_port}"


async def test_traffic_follows_the_admitted_epoch_of_a_kubernetes_group() -> None:
    async with router_on_kube() as (kube, cluster, app, base):
        assert app.ready  # the pool was read; the group is discovered but partial
        assert set(await statuses(base)) == {503} and served(cluster) == 0

        kube.put("pods", lws("g1-0-1", 1))  # the last rank is Ready: gated, then admitted
        await eventually(lambda: app.control.groups["g1"].state.value == "admitted", 5, "admitted")
        await eventually(lambda: len(app.parts.pool.candidate_slots()) == 2, 5, "both ports scraped")
        assert set(await statuses(base)) == {200} and served(cluster) == 4

        kube.put("pods", lws("g1-0-1", 1, uid="uid-replaced"))  # the worker was replaced
        await eventually(lambda: app.control.groups["g1"].epoch == 2, 5, "a new epoch")
        await eventually(lambda: app.control.groups["g1"].state.value == "admitted", 5, "re-admitted")
        assert set(await statuses(base)) == {200} and served(cluster) == 8

        kube.put("pods", lws("g1-0-1", 1, uid="uid-replaced", ready=False))  # a rank lost Ready
        await eventually(lambda: app.control.groups["g1"].state.value != "admitted", 5, "revoked")
        assert set(await statuses(base)) == {503} and served(cluster) == 8

        kube.put("pods", lws("g1-0-1", 1, uid="uid-replaced"))
        await eventually(lambda: app.control.groups["g1"].state.value == "admitted", 5, "admitted again")
        kube.put("pods", lws("g1-0", 0, deleting=True))  # scale-down: the leader is being deleted
        await eventually(lambda: app.control.groups["g1"].state.value == "draining", 5, "draining")
        assert set(await statuses(base)) == {503} and served(cluster) == 8


async def test_not_ready_until_the_pool_has_been_read_once() -> None:
    from grpc_health.v1 import health_pb2

    serving_status = health_pb2.HealthCheckResponse.SERVING

    spec = EngineSpec("e0", "prefill-decode", time=FAST)
    async with serving() as kube, SimCluster([spec]) as cluster:
        port = int(cluster.address("e0").rsplit(":", 1)[1])
        config = parse_config(
            {
                "model": "sim-model",
                "kubernetes": {"namespace": NS, "pool_name": "qwen"},
                "proxy": {"port": 0},
                "extproc": {"enabled": True, "port": 0, "health_port": 0},
                "gate": {"initial_wait_s": 0.3},
            }
        )
        source = KubernetesDiscovery(kube.client(), NS, pool_name="qwen", backoff_initial_s=0.01)
        async with App(build(config, discovery=source)) as app:  # the InferencePool does not exist yet
            assert not app.ready
            assert app.parts.health.statuses["readiness"] != serving_status
            kube.put("pools", pool("qwen", ports=(port,)))
            kube.put("pods", pod("solo", "127.0.0.1"))
            await eventually(lambda: app.ready, 5, "ready once the pool was read")
            assert app.parts.health.statuses["readiness"] == serving_status
            assert set(await statuses(f"http://127.0.0.1:{app.proxy_port}", 2)) == {200}
