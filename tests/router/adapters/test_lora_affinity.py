"""LoRA affinity through the proxy, over real HTTP against simulated engines: a request whose
``model`` names an adapter goes to the pod that has it loaded, or the only pod that serves it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from gateway import gateway
from helpers import eventually, router_on_sim

from router.http.headers import DEBUG_DECODE
from router.scheduling.costmodel.view import ADAPTER_RESIDENT
from simulator.engine import EngineSpec

ADAPTERS = ("sql-lora", "chat-lora")
# One adapter slot per pod, and a load that stalls a step for 2 s (100 ms at the test's speed 20).
LORA = {"lora_adapters": ADAPTERS, "max_loras": 1, "lora_load_s": 2.0}
SECTIONS = {"strict_model": False, "engine": {"lora_load_ms": 100.0}}


def pods(**overrides: dict) -> list[EngineSpec]:
    return [
        EngineSpec(
            f"pod-{i}", "prefill-decode", num_gpu_blocks=1024, **{**LORA, **overrides.get(f"pod-{i}", {})}
        )
        for i in range(3)
    ]


async def completion(
    session: aiohttp.ClientSession, url: str, model: str, words: str, max_tokens: int = 4
) -> str:
    body = {"model": model, "prompt": f"{words} " * 40, "max_tokens": max_tokens}
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers[DEBUG_DECODE]


async def test_requests_for_an_adapter_go_to_the_busy_pod_that_has_it_loaded() -> None:
    async with router_on_sim(pods(), SECTIONS) as (cluster, app, base), aiohttp.ClientSession() as session:
        # Another client keeps chat-lora running on pod-2: the scrape reports it there, and pod-2
        # is the busiest pod, where load alone would not send anything.
        engine = f"http://{cluster.address('pod-2')}/v1/completions"
        long = asyncio.create_task(completion(session, engine, "chat-lora", "elsewhere", max_tokens=400))
        pool = app.parts.pool
        slot = np.array([pool.endpoints["pod-2"].slot])

        def scraped_running() -> bool:
            state = pool.lora.states("chat-lora", slot)
            return state is not None and state[0] == ADAPTER_RESIDENT

        await eventually(scraped_running, what="chat-lora scraped running on pod-2")
        url = f"{base}/v1/completions"
        chosen = [await completion(session, url, "chat-lora", f"question {i}") for i in range(4)]
        assert chosen == ["pod-2"] * 4
        # The base model is no adapter: it avoids the busy pod.
        assert await completion(session, url, "sim-model", "base question") != "pod-2"
        assert not long.done()
        long.cancel()


async def test_an_adapter_only_one_pod_serves_goes_there() -> None:
    only_pod_1 = {"pod-0": {"lora_adapters": ("chat-lora",)}, "pod-2": {"lora_adapters": ("chat-lora",)}}
    async with (
        router_on_sim(pods(**only_pod_1), SECTIONS) as (_, app, base),
        aiohttp.ClientSession() as session,
    ):
        await eventually(lambda: "sql-lora" in app.parts.pool.lora.rows, what="model lists read")
        url = f"{base}/v1/completions"
        chosen = [await completion(session, url, "sql-lora", f"question {i}") for i in range(4)]
        assert chosen == ["pod-1"] * 4


async def test_a_strict_pool_serves_the_adapters_its_engines_list_and_no_other_name() -> None:
    async with (
        router_on_sim(pods(), {**SECTIONS, "strict_model": True}) as (_, app, base),
        aiohttp.ClientSession() as session,
    ):
        await eventually(lambda: app.parts.pool.lora.serves("sql-lora"), what="model lists read")
        url = f"{base}/v1/completions"
        assert await completion(session, url, "sql-lora", "question") in {"pod-0", "pod-1", "pod-2"}
        body = {"model": "no-such-lora", "prompt": "question", "max_tokens": 4}
        async with session.post(url, json=body) as resp:
            assert resp.status == 404, await resp.text()


@pytest.mark.parametrize("mode", ["full-duplex", "buffered"])
async def test_through_envoy_an_adapter_only_one_pod_serves_goes_there(tmp_path: Path, mode: str) -> None:
    only_pod_1 = {"pod-0": {"lora_adapters": ("chat-lora",)}, "pod-2": {"lora_adapters": ("chat-lora",)}}
    specs = pods(**only_pod_1)
    async with (
        gateway(tmp_path, mode, specs, engine=SECTIONS["engine"]) as gw,
        aiohttp.ClientSession() as http,
    ):
        await eventually(lambda: gw.app.parts.pool.lora.serves("sql-lora"), what="model lists read")
        for i in range(4):
            body = {"model": "sql-lora", "prompt": f"question {i} " * 40, "max_tokens": 4}
            async with http.post(f"{gw.url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
        served = {
            name: sum(1 for _, _, body in e.requests_seen if body and "sql-lora" in str(body))
            for name, e in gw.cluster.engines.items()
        }
        assert served["pod-1"] == 4 and served["pod-0"] == served["pod-2"] == 0
