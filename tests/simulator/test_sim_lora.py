"""The simulated engine's LoRA adapters: GPU slots evicted least recently used first, a load that
stalls the step, and ``vllm:lora_requests_info`` as vLLM exports it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from helpers import eventually

from router.observe.scrape import parse_vllm_metrics
from router.request.types import LoraInfo
from simulator.engine import EngineSpec, SimCluster, TimeModel

LOAD_S = 0.2
SPEC = EngineSpec("e0", "prefill-decode", lora_adapters=("a", "b", "c"), max_loras=2, lora_load_s=LOAD_S)


@pytest.fixture
async def engine() -> AsyncIterator[tuple[SimCluster, str]]:
    async with SimCluster([SPEC]) as cluster:
        yield cluster, cluster.address("e0")


async def complete(session: aiohttp.ClientSession, address: str, model: str, max_tokens: int = 2) -> float:
    """Seconds until the answer is complete."""
    start = time.monotonic()
    body = {"model": model, "prompt": f"a question for {model} " * 8, "max_tokens": max_tokens}
    async with session.post(f"http://{address}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
    return time.monotonic() - start


async def test_a_load_stalls_once_and_the_least_recently_used_adapter_is_evicted(
    engine: tuple[SimCluster, str],
) -> None:
    cluster, address = engine
    sim = cluster.engines["e0"]
    async with aiohttp.ClientSession() as session:
        assert await complete(session, address, "a") >= LOAD_S  # the load stalled the step
        await complete(session, address, "a")
        await complete(session, address, "sim-model")  # the base model needs no slot
        assert sim.stats.lora_loads == 1  # a was resident the second time
        await complete(session, address, "b")
        await complete(session, address, "c")  # two slots: a, used longest ago, makes room
        assert sim.stats.lora_loads == 3
        await complete(session, address, "b")
        assert sim.stats.lora_loads == 3  # b still resident
        assert await complete(session, address, "a") >= LOAD_S
        assert sim.stats.lora_loads == 4


async def test_an_adapter_waits_for_a_slot_while_every_slot_runs_another() -> None:
    spec = EngineSpec("e0", "prefill-decode", lora_adapters=("a", "b"), max_loras=1, lora_load_s=0.0)
    async with SimCluster([spec]) as cluster, aiohttp.ClientSession() as session:
        address = cluster.address("e0")
        long = asyncio.create_task(complete(session, address, "a", max_tokens=40))
        engine = cluster.engines["e0"]
        await eventually(lambda: engine.num_running == 1, 5, "a running")
        took_b = asyncio.create_task(complete(session, address, "b"))
        await complete(session, address, "sim-model")  # passes the waiting b
        assert not took_b.done() and not long.done()
        await long
        await took_b


async def test_lora_requests_info_names_running_and_waiting_adapters_as_vllm_does() -> None:
    spec = EngineSpec(
        "e0", "prefill-decode", lora_adapters=("a", "b"), max_loras=1, lora_load_s=0.0, time=TimeModel()
    )
    async with SimCluster([spec]) as cluster, aiohttp.ClientSession() as session:
        address = cluster.address("e0")
        async with session.get(f"http://{address}/metrics") as resp:
            assert parse_vllm_metrics(await resp.text()).lora == LoraInfo(1)  # idle
        long = asyncio.create_task(complete(session, address, "a", max_tokens=60))
        engine = cluster.engines["e0"]
        await eventually(lambda: engine.num_running == 1, 5, "a running")
        waiting = asyncio.create_task(complete(session, address, "b"))
        await eventually(lambda: engine.num_waiting == 1, 5, "b waiting for the slot")
        async with session.get(f"http://{address}/metrics") as resp:
            text = await resp.text()
        assert text.count("vllm:lora_requests_info{") >= 2  # the earlier, idle label set stays
        assert parse_vllm_metrics(text).lora == LoraInfo(1, running=("a",), waiting=("b",))
        await asyncio.gather(long, waiting)


def test_without_adapters_no_lora_series() -> None:
    from simulator.engine import SimEngine

    assert "lora_requests_info" not in SimEngine(EngineSpec("e0", "prefill-decode")).metrics_text()
