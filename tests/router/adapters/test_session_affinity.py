"""Session affinity end to end, through the proxy and through a real Envoy (ext_proc), on
simulated engines over real HTTP: a conversation whose prefix the router's index has forgotten
(an index of one block per engine) still goes back to the pod that holds it, unless load says
otherwise; a request without the header is routed on load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gateway import gateway
from helpers import eventually, keep_busy, router_on_sim

from simulator.engine import EngineSpec, SimCluster, TimeModel

pytestmark = pytest.mark.integration

FAST = TimeModel(speed=20.0)
SPECS = [EngineSpec(f"e{i}", "prefill-decode", num_gpu_blocks=2048, time=FAST) for i in range(3)]
# The index forgets every conversation at once: only the session remembers where it is.
FORGETFUL = {"index": {"capacity_blocks_per_endpoint": 1}}
SYSTEM = "You are a careful assistant who answers in full sentences. " * 120


def chat(*turns: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}]
    for i, turn in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": turn})
    return {"model": "sim-model", "messages": messages, "max_tokens": 4}


def served(cluster: SimCluster) -> dict[str, int]:
    return {name: len(engine.requests_seen) for name, engine in cluster.engines.items()}


async def a_session_stays_home_while_load_alone_would_move_it(
    cluster: SimCluster, app: Any, url: str, http: aiohttp.ClientSession
) -> None:
    session = {"x-session-id": "chat-42"}
    before = served(cluster)
    async with http.post(f"{url}/v1/chat/completions", json=chat("Hello?"), headers=session) as resp:
        assert resp.status == 200
        await resp.read()
    home = next(name for name, n in served(cluster).items() if n > before[name])
    _, headers, _ = cluster.engines[home].requests_seen[-1]
    assert headers.get("x-session-id") == "chat-42"  # a client header: forwarded as it came
    await eventually(lambda: app.parts.pool.sessions.home("h:chat-42") is not None, what="the home kept")

    long = await keep_busy(http, cluster, app, home)  # on load alone the next turn goes elsewhere

    async def turn(headers: dict[str, str]) -> tuple[str, int]:
        seen = served(cluster)
        body = chat("Hello?", "Hello! How can I help?", "Tell me more.")
        async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
            cached = (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
        return next(name for name, n in served(cluster).items() if n > seen[name]), cached

    pod, cached = await turn(session)
    assert pod == home and cached > 1000  # the conversation's prefix, found where it was left
    pod, _ = await turn({})
    assert pod != home  # without the session, the busy pod is avoided
    routes = app.parts.pool.sessions.routes
    assert (routes["new"], routes["home"]) == (1, 1)
    text = app.parts.metrics.exposition()[0].decode()
    assert 'pd_router_session_routes_total{outcome="home"} 1.0' in text
    long.cancel()


async def test_through_the_proxy() -> None:
    async with router_on_sim(SPECS, FORGETFUL) as (cluster, app, base), aiohttp.ClientSession() as http:
        await a_session_stays_home_while_load_alone_would_move_it(cluster, app, base, http)


async def test_through_envoy(tmp_path: Path) -> None:
    async with gateway(tmp_path, specs=SPECS, **FORGETFUL) as gw, aiohttp.ClientSession() as http:
        await a_session_stays_home_while_load_alone_would_move_it(gw.cluster, gw.app, gw.url, http)


async def test_an_invalid_session_id_is_ignored_and_counted() -> None:
    async with router_on_sim(SPECS, FORGETFUL) as (_cluster, app, base), aiohttp.ClientSession() as http:
        for bad in ("x" * 129, "has space", "tab\tin"):
            async with http.post(
                f"{base}/v1/chat/completions", json=chat("Hi?"), headers={"x-session-id": bad}
            ) as resp:
                assert resp.status == 200
                await resp.read()
        assert app.parts.pool.sessions.routes["invalid"] == 3 and len(app.parts.pool.sessions) == 0
