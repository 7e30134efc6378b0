"""Predictions corrected by what engines report: the token estimate converges on the engines'
count, an engine that evicted loses those blocks from the index, and streamed answers carry the
usage the router asked for without the client seeing it."""

from __future__ import annotations

import random

import aiohttp
import numpy as np
import orjson
import pytest
from helpers import eventually, router_on_sim, sse_events

from loadtests.sim.engine import EngineSpec
from router.signals.calibration import TokenCalibration, evicted_blocks


def test_the_ratio_converges_on_what_engines_count_and_waits_for_enough_answers() -> None:
    calibration = TokenCalibration(min_samples=8)
    rng = random.Random(0)
    for i in range(200):
        estimated = rng.randint(100, 4000)  # characters / 4
        reported = round(estimated * 4 / 6 * rng.uniform(0.97, 1.03))  # the tokenizer: 6 chars a token
        calibration.observe(estimated, reported)
        if i < 7:
            assert calibration.ratio == 1.0  # too few answers to trust
    assert calibration.ratio == pytest.approx(4 / 6, rel=0.03)
    assert calibration.scale(600) == pytest.approx(400, abs=12)
    calibration.observe(100, 10_000)  # a wild answer moves it a little, bounded
    assert calibration.ratio < 0.9


def test_evicted_blocks_only_when_the_engine_had_far_less() -> None:
    assert evicted_blocks(held_tokens=1600, reported_cached=1600, tokens_per_block=16) is None
    assert evicted_blocks(held_tokens=1600, reported_cached=1000, tokens_per_block=16) is None  # > half
    assert evicted_blocks(held_tokens=1600, reported_cached=320, tokens_per_block=16) == (20, 100)
    assert evicted_blocks(held_tokens=1600, reported_cached=0, tokens_per_block=16) == (0, 100)
    assert evicted_blocks(held_tokens=15, reported_cached=0, tokens_per_block=16) is None  # within a block


async def test_token_estimate_calibrates_on_a_pool_whose_tokenizer_is_coarser() -> None:
    specs = [EngineSpec("e0", "prefill-decode", chars_per_token=6.0)]  # the config says 4
    async with router_on_sim(specs) as (_cluster, app, base), aiohttp.ClientSession() as http:
        rng = random.Random(1)
        for i in range(12):
            text = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(800, 4000)))
            body = {"model": "sim-model", "prompt": f"{i} {text}", "max_tokens": 2}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
        assert app.scaling.tokens.ratio == pytest.approx(4 / 6, rel=0.05)
        # The next prompt is estimated in the engines' tokens: 6,000 characters are ~1,000.
        flight = app.flow.start({})
        request = flight.parse(b'{"model": "sim-model", "prompt": "' + b"x" * 6000 + b'"}')
        assert request.prompt_tokens == pytest.approx(1000, rel=0.05)
        assert request.block_tokens == pytest.approx(16 * 4 / 6, rel=0.05)


async def test_an_engine_that_evicted_makes_the_index_keep_less_for_it() -> None:
    specs = [EngineSpec("e0", "prefill-decode")]
    async with router_on_sim(specs) as (cluster, app, base), aiohttp.ClientSession() as http:

        async def send(prompt: str) -> dict:
            body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                return await resp.json()

        old = [f"old prompt {i} " * 100 for i in range(3)]
        for prompt in old:
            await send(prompt)
        slot = app.pool.endpoints["e0"].slot
        shared = "shared system prompt " * 200
        await send(shared)
        recorded = app.index.slot_blocks(slot)
        assert cluster.engines["e0"].reset_prefix_cache()  # the engine drops it all behind our back
        answer = await send(shared)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # That answer said "nothing cached" where the index said the whole prompt: the index now
        # keeps that many blocks fewer for e0, the least recently used (the old prompts) first,
        # while the head of the prompt just recomputed stays.
        parse = app.flow.start({}).parse
        blocks = parse(orjson.dumps({"model": "sim-model", "prompt": shared})).block_keys
        await eventually(
            lambda: app.index.slot_blocks(slot) == recorded - len(blocks), 5.0, "the index shrunk for e0"
        )
        for prompt in old:
            keys = parse(orjson.dumps({"model": "sim-model", "prompt": prompt})).block_keys
            assert int(app.index.match(keys, np.array([slot]))[0]) == 0
        assert int(app.index.match(blocks, np.array([slot]))[0]) > 0.9 * len(blocks)
        ratio = app.scaling.perf.ratios["cached_tokens"]
        assert int(ratio[0]) >= 1  # reported 0 of what the index said: the lowest bucket


async def test_streamed_answers_carry_the_usage_the_router_asked_for_and_the_client_did_not() -> None:
    specs = [EngineSpec("e0", "prefill-decode")]
    async with router_on_sim(specs) as (cluster, app, base), aiohttp.ClientSession() as http:
        body = {"model": "sim-model", "prompt": "hello " * 100, "max_tokens": 5, "stream": True}
        async with http.post(f"{base}/v1/completions", json=body) as resp:
            events = await sse_events(resp)
        assert events[-1] == "[DONE]"
        assert all("usage" not in e or e["usage"] is None for e in events[:-1] if isinstance(e, dict))
        _, _, seen = cluster.engines["e0"].requests_seen[-1]
        assert seen["stream_options"] == {"include_usage": True}  # asked for on the client's behalf
        assert app.scaling.tokens.samples == 1  # and read: the prompt's true token count
        asked = {**body, "stream_options": {"include_usage": True}}
        async with http.post(f"{base}/v1/completions", json=asked) as resp:
            events = await sse_events(resp)
        assert events[-2]["usage"]["completion_tokens"] == 5  # the client asked: it gets it
