"""Precise mode for pods found by Kubernetes discovery (the fake API server), in front of simulated
engines publishing vLLM-shaped KV events over ZMQ: each pod's stream is followed while it is in the
pool, its events route prompts, and it is unsubscribed and forgotten when the pod leaves or is
replaced (a new UID under the same IP), whose new stream is proven complete before traffic."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from helpers import eventually

from loadtests.servers.kube import NS, FakeKube, pod, pool, serving
from router.control.discovery.kubernetes import KubernetesDiscovery
from router.control.gate import CANARY_HEADER
from router.server.app import App
from router.server.compose import build
from router.server.config import parse_config
from simulator.engine import EngineSpec, SimCluster, TimeModel
from simulator.tiny_tokenizer import tiny_corpus, train_tiny_tokenizer

pytestmark = pytest.mark.integration

SENTENCES = list(tiny_corpus(400))
PROMPT = " ".join(SENTENCES[:30])  # a few hundred tokens the tiny tokenizer knows
NAMES = ("e0", "e1")


def http_port(cluster: SimCluster, name: str) -> int:
    return int(cluster.address(name).rsplit(":", 1)[1])


def engine_pod(cluster: SimCluster, name: str, *, uid: str | None = None) -> dict[str, Any]:
    """The pod of engine ``name`` (every one on 127.0.0.1, each serving its own port): e0 names its
    KV-event sockets by annotation, e1 by container port names."""
    publisher, replay = cluster.engines[name].kv_ports
    annotations = {"llm-d.ai/active-ports": str(http_port(cluster, name))}
    if name == "e0":
        annotations["pd-router.io/kv-events"] = f"tcp://{{ip}}:{publisher}"
        annotations["pd-router.io/kv-events-replay"] = f"tcp://{{ip}}:{replay}"
    obj = pod(name, "127.0.0.1", uid=uid, annotations=annotations)
    if name == "e1":
        ports = [("http", http_port(cluster, name)), ("kv-events", publisher), ("kv-replay", replay)]
        obj["spec"]["containers"][0]["ports"] = [{"name": n, "containerPort": p} for n, p in ports]
    return obj


@contextlib.asynccontextmanager
async def discovered(tmp_path: Path) -> AsyncIterator[tuple[FakeKube, SimCluster, App, str]]:
    tokenizer = str(train_tiny_tokenizer(tmp_path / "tokenizer.json"))
    specs = [
        EngineSpec(n, "prefill-decode", tokenizer=tokenizer, kv_events=True, time=TimeModel(speed=20))
        for n in NAMES
    ]
    async with serving() as kube, SimCluster(specs) as cluster:
        kube.put("pools", pool("qwen", ports=tuple(http_port(cluster, n) for n in NAMES)))
        for name in NAMES:
            kube.put("pods", engine_pod(cluster, name))
        config = parse_config(
            {
                "model": "sim-model",
                "kubernetes": {"namespace": NS, "pool_name": "qwen"},
                "index": {"precise": {"tokenizer": tokenizer, "replay_timeout_s": 0.5}},
                "limits": {"chars_per_token": 4.0},
                "scrape": {"interval_ms": 50, "timeout_ms": 300, "stale_after_ms": 1000},
                "proxy": {"port": 0, "debug_headers": True},
                # The default checks: on Kubernetes in precise mode they end with kv_events.
                "gate": {"retry_base_s": 0.05, "retry_max_s": 0.2, "check_timeout_s": 1, "initial_wait_s": 5},
            }
        )
        source = KubernetesDiscovery(kube.client(), NS, pool_name="qwen", backoff_initial_s=0.01)
        async with App(build(config, discovery=source)) as app:
            yield kube, cluster, app, f"http://127.0.0.1:{app.proxy_port}"


def admitted(app: App, name: str) -> bool:
    endpoint = app.parts.pool.endpoints.get(name)
    return endpoint is not None and bool(app.parts.pool.admitted[endpoint.slot])


def held(app: App, keys: np.ndarray, name: str) -> int:
    """Blocks of ``keys`` the precise index says ``name`` holds."""
    slot = app.parts.pool.endpoints[name].slot
    return int(app.parts.precise_index.match(keys, np.array([slot]))[0])


def traffic(cluster: SimCluster, name: str) -> int:
    """Completions an engine served that were not the gate's canaries."""
    return sum(1 for _, headers, _ in cluster.engines[name].requests_seen if CANARY_HEADER not in headers)


async def complete(http: aiohttp.ClientSession, base: str, prompt: str = PROMPT) -> aiohttp.ClientResponse:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
    async with http.post(f"{base}/v1/completions", json=body) as resp:
        await resp.read()
        assert resp.status == 200
        return resp


def kv_series(text: str, name: str) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if f'endpoint="{name}"' in line
        and (line.startswith("pd_router_kv_events_") or line.startswith("pd_router_endpoint_kv_covered"))
    ]


async def test_a_discovered_pods_events_route_a_prompt_and_go_with_the_pod(tmp_path: Path) -> None:
    async with discovered(tmp_path) as (kube, cluster, app, base), aiohttp.ClientSession() as http:
        kv_events, groups = app.parts.kv_events, app.control.groups
        await eventually(lambda: all(admitted(app, n) for n in NAMES), 10, "both pods admitted")
        # Idle engines: known to hold nothing from their replay sockets, so the gate let them in.
        for name in NAMES:
            assert kv_events.follows(name)
            assert [c.name for c in groups[name].checks][-1] == "kv_events" and groups[name].checks[-1].ok

        # The prompt is cached on e1 behind the router's back: only e1's own events can say so.
        keys = app.parts.precise_keys.tokenizer.block_keys_sync(PROMPT)
        await complete(http, f"http://{cluster.address('e1')}")
        await eventually(lambda: held(app, keys, "e1") == len(keys), 10, "e1's BlockStored events")
        assert held(app, keys, "e0") == 0
        resp = await complete(http, base)
        assert resp.headers["x-pd-router-decode"] == "e1"
        assert f": {len(keys) * 16}/" in resp.headers["x-pd-router-reason"]

        async with http.get(f"{base}/metrics") as metrics:
            assert kv_series(await metrics.text(), "e1")
        slot = app.parts.pool.endpoints["e1"].slot
        [task] = [t for t in asyncio.all_tasks() if t.get_name() == "kv-events:e1"]

        kube.delete("pods", "e1")  # scaled away
        await eventually(lambda: "e1" not in app.parts.pool.endpoints, 5, "e1 out of the pool")
        assert not kv_events.follows("e1") and "e1" not in kv_events.stats()
        await eventually(task.done, 5, "e1's socket task to end")
        assert app.parts.precise_index.match(keys, np.array([slot]))[0] == 0  # its entries are gone
        async with http.get(f"{base}/metrics") as metrics:
            text = await metrics.text()
        assert kv_series(text, "e1") == [] and kv_series(text, "e0")
        # e0 still routes, from its own (empty) view.
        resp = await complete(http, base)
        assert resp.headers["x-pd-router-decode"] == "e0"


async def test_a_pod_replaced_under_the_same_ip_is_followed_anew_and_gated_on_its_events(
    tmp_path: Path,
) -> None:
    async with discovered(tmp_path) as (kube, cluster, app, base), aiohttp.ClientSession() as http:
        kv_events, groups = app.parts.kv_events, app.control.groups
        await eventually(lambda: all(admitted(app, n) for n in NAMES), 10, "both pods admitted")
        keys = app.parts.precise_keys.tokenizer.block_keys_sync(PROMPT)
        await complete(http, f"http://{cluster.address('e1')}")
        await eventually(lambda: held(app, keys, "e1") == len(keys), 10, "the old engine's events")
        old_stats = kv_events.stats()["e1"]
        assert old_stats.events > 0

        # The pod is replaced: a new engine on the same IP and ports, a new pod UID. Its replay
        # socket is held, so its stream cannot be proven complete yet.
        await cluster.revive("e1")
        cluster.engines["e1"]._publisher.hold_replays()
        kube.put("pods", engine_pod(cluster, "e1", uid="uid-e1-replacement"))
        await eventually(lambda: groups["e1"].epoch == 2, 5, "a new epoch for the replacement")
        # The old stream's entries went with the old endpoint; the new stream is another one.
        assert held(app, keys, "e1") == 0
        assert kv_events.stats()["e1"].events == 0 and kv_events.stats()["e1"].restarts == 0

        def failed_on_kv_events() -> bool:
            checks = groups["e1"].checks
            return bool(checks) and checks[-1].name == "kv_events" and not checks[-1].ok

        await eventually(failed_on_kv_events, 10, "the gate waiting on the new stream")
        served_before = traffic(cluster, "e1")
        for i in range(6):
            other = " ".join(SENTENCES[100 + 10 * i : 130 + 10 * i])  # not the prompt e1 will hold
            assert (await complete(http, base, other)).headers["x-pd-router-decode"] == "e0"
        assert not admitted(app, "e1") and traffic(cluster, "e1") == served_before

        cluster.engines["e1"]._publisher.release_replays()  # its history: nothing published yet
        await eventually(lambda: admitted(app, "e1"), 10, "the replacement admitted")
        assert groups["e1"].checks[-1].name == "kv_events" and groups["e1"].checks[-1].ok
        # The new engine's own events are what the index holds for it now.
        await complete(http, f"http://{cluster.address('e1')}")
        await eventually(lambda: held(app, keys, "e1") == len(keys), 10, "the new engine's events")
        resp = await complete(http, base)
        assert resp.headers["x-pd-router-decode"] == "e1"


def consecutive_free_ports(count: int, start: int = 20000) -> list[int]:
    """``count`` bases, each free together with base + 1 on 127.0.0.1 (data-parallel ranks' ports)."""
    bases: list[int] = []
    port = start
    while len(bases) < count:
        with contextlib.ExitStack() as stack:
            try:
                for p in (port, port + 1):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", p))
            except OSError:
                port += 2
                continue
        bases.append(port)
        port += 2
    return bases


async def test_a_data_parallel_pods_ranks_each_route_on_their_own_events(tmp_path: Path) -> None:
    """One pod, two vLLM data-parallel ranks: rank r serves on the r-th port and publishes on the
    annotated publisher's port + r. Each rank's endpoint follows its own stream."""
    tokenizer = str(train_tiny_tokenizer(tmp_path / "tokenizer.json"))
    http_base, events_base, replay_base = consecutive_free_ports(3)
    specs = [
        EngineSpec(
            f"rank{r}",
            "prefill-decode",
            port=http_base + r,
            tokenizer=tokenizer,
            kv_events=True,
            kv_events_port=events_base + r,
            kv_replay_port=replay_base + r,
            time=TimeModel(speed=20),
        )
        for r in range(2)
    ]
    annotations = {
        "pd-router.io/kv-events": f"tcp://*:{events_base}",
        "pd-router.io/kv-events-replay": f"tcp://{{ip}}:{replay_base}",
    }
    async with serving() as kube, SimCluster(specs) as cluster, aiohttp.ClientSession() as http:
        kube.put("pools", pool("qwen", ports=(http_base, http_base + 1)))
        kube.put("pods", pod("dp", "127.0.0.1", annotations=annotations))
        config = parse_config(
            {
                "model": "sim-model",
                "kubernetes": {"namespace": NS, "pool_name": "qwen"},
                "index": {"precise": {"tokenizer": tokenizer, "replay_timeout_s": 0.5}},
                "scrape": {"interval_ms": 50, "timeout_ms": 300, "stale_after_ms": 1000},
                "proxy": {"port": 0, "debug_headers": True},
                "gate": {"retry_base_s": 0.05, "retry_max_s": 0.2, "check_timeout_s": 1, "initial_wait_s": 5},
            }
        )
        source = KubernetesDiscovery(kube.client(), NS, pool_name="qwen", backoff_initial_s=0.01)
        async with App(build(config, discovery=source)) as app:
            ranks = [f"dp@127.0.0.1:{http_base + r}" for r in range(2)]
            await eventually(lambda: all(admitted(app, n) for n in ranks), 10, "both ranks admitted")
            assert all(app.parts.kv_events.follows(n) for n in ranks)
            keys = app.parts.precise_keys.tokenizer.block_keys_sync(PROMPT)
            await complete(http, f"http://{cluster.address('rank1')}")  # behind the router's back
            await eventually(lambda: held(app, keys, ranks[1]) == len(keys), 10, "rank 1's events")
            assert held(app, keys, ranks[0]) == 0  # not credited to the other rank
            resp = await complete(http, f"http://127.0.0.1:{app.proxy_port}")
            assert resp.headers["x-pd-router-decode"] == ranks[1]
