"""Predictions corrected by what engines report: the token estimate converges on the engines'
count (estimates only, robust to an engine whose usage is odd), an engine that evicted loses those
blocks from the index, and streamed answers carry the usage the router asked for without the
client seeing it."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from helpers import SINGLE_PODS, eventually, make_config, make_picker, make_pool, router_on_sim, sse_events

import router.flow.flight
from router.flow.flight import RequestFlow
from router.observe.metrics import RouterMetrics
from router.request.types import RouteRequest
from router.scheduling.extension import Producer
from router.server.compose import learn_settings_from
from router.signals.calibration import TokenCalibration, evicted_blocks, pool_ratio
from router.signals.perf import PerformanceModel
from router.signals.scaling import PoolSignals
from simulator.engine import EngineSpec

E0, E1 = (pod["address"] for pod in SINGLE_PODS[:2])


def test_the_ratio_converges_on_what_engines_count_and_waits_for_enough_answers() -> None:
    calibration = TokenCalibration(min_samples=8)
    rng = random.Random(0)
    for i in range(200):
        estimated = rng.randint(100, 4000)  # characters / 4
        reported = round(estimated * 4 / 6 * rng.uniform(0.97, 1.03))  # the tokenizer: 6 chars a token
        calibration.observe(f"e{i % 3}", estimated, reported)
        if i < 3 * 8 - 3:
            assert calibration.ratio == 1.0  # too few answers from any engine to trust
    assert calibration.ratio == pytest.approx(4 / 6, rel=0.03)
    assert calibration.scale(600) == pytest.approx(400, abs=12)
    calibration.observe("e0", 100, 350)  # a wild answer, plausible on its own: the median holds
    assert calibration.ratio == pytest.approx(4 / 6, rel=0.03)


def test_one_engine_with_odd_usage_does_not_move_the_ratio_of_the_others() -> None:
    calibration = TokenCalibration(min_samples=8)
    rng = random.Random(0)
    for i in range(300):
        estimated = rng.randint(100, 4000)
        honest = round(estimated * 4 / 6 * rng.uniform(0.97, 1.03))
        calibration.observe(f"e{i % 3}", estimated, honest)
        calibration.observe("ones", estimated, 1)  # prompt_tokens: 1 whatever the prompt
        calibration.observe("double", estimated, 2 * honest)  # plausible alone, not beside the others
    assert calibration.ratio == pytest.approx(4 / 6, rel=0.03)
    assert calibration.engine_ratio("ones") is None and calibration.rejected == 300
    assert calibration.engine_ratio("double") == pytest.approx(8 / 6, rel=0.03)
    # Two engines far apart leave no majority: the one nearer the configured estimate wins.
    assert pool_ratio([4 / 6, 8 / 3]) == pytest.approx(4 / 6)
    assert pool_ratio([4 / 6, 0.7]) == pytest.approx((4 / 6 * 0.7) ** 0.5)  # agreeing: their median


LEARNING = {"signals": {"learn": True}}  # off by default


def learning_flow(producers: tuple[Producer, ...] = (), **signals: Any) -> RequestFlow:
    """The flow the service builds, learning from answers, over two idle pods ``E0`` and ``E1``."""
    config = make_config(SINGLE_PODS[:2], signals={"learn": True, **signals})
    pool = make_pool(config)
    pool.stale_after_s = 1e9  # unit tests run on wall-clock time
    picker = make_picker(config, pool)
    perf = PerformanceModel(picker.cost_model.model, learn_settings_from(config))
    learning = PoolSignals(pool, perf, lambda: picker.cost_model, lambda _: None)
    metrics = RouterMetrics(pool, "t")
    return RequestFlow(picker, metrics, config.request_limits(), config.model, producers, learning)


def answered(flow: RequestFlow, i: int, on: str, count: Callable[[int], int]) -> None:
    """Prompt ``i`` answered by the engine at ``on``, which counts ``count(our estimate)`` tokens."""
    flight = flow.start({})
    flight.parse(orjson.dumps({"model": "m", "prompt": f"{i} " + "words " * (50 + 7 * i)}), frozenset({on}))
    flight.pick()
    flight.responded(200)
    usage = {"prompt_tokens": count(flight.estimated_tokens), "completion_tokens": 2}
    flight.body(orjson.dumps({"choices": [], "usage": usage}))
    flight.close()


def six_chars_a_token(estimate: int) -> int:
    return round(estimate * 4 / 6)  # the configuration says 4 characters a token


def picked(flow: RequestFlow) -> RouteRequest:
    """A new 6,000-character prompt as the picker sees it (estimated at 1,500 tokens)."""
    flight = flow.start({})
    request = flight.parse(b'{"model": "m", "prompt": "' + b"x" * 6000 + b'"}', frozenset({E0}))
    flight.pick()
    flight.close()
    return request


def test_an_engine_reporting_one_prompt_token_does_not_move_the_ratio_for_the_others() -> None:
    flow = learning_flow()
    for i in range(24):
        answered(flow, i, E0, six_chars_a_token)
        answered(flow, i, E1, lambda _: 1)  # prompt_tokens: 1, whatever the prompt
    assert flow.signals is not None
    assert flow.signals.tokens.ratio == pytest.approx(4 / 6, rel=0.01)
    request = picked(flow)
    assert request.prompt_tokens == pytest.approx(1000, rel=0.01)
    assert request.block_tokens == pytest.approx(16 * 4 / 6, rel=0.01)


async def test_precise_mode_and_exact_counts_are_never_rescaled(monkeypatch: pytest.MonkeyPatch) -> None:
    class PreciseKeys:  # what ``router.scheduling.producers.PreciseKeys`` gives a request: vLLM block keys
        name = "precise_keys"
        fills = True

        def wanted(self, request: RouteRequest) -> bool:
            return True

        async def produce(self, request: RouteRequest) -> None:
            request.precise_keys = np.arange(len(request.block_keys), dtype=np.uint64)

    flow = learning_flow((PreciseKeys(),))
    for i in range(12):  # approximate requests (no producer ran) teach 6 characters a token
        answered(flow, i, E0, six_chars_a_token)
    assert flow.signals is not None and flow.signals.tokens.ratio == pytest.approx(4 / 6, rel=0.01)
    assert picked(flow).prompt_tokens == pytest.approx(1000, rel=0.01)  # an estimate: calibrated

    flight = flow.start({})
    request = flight.parse(b'{"model": "m", "prompt": "' + b"x" * 6000 + b'"}')
    await flow.prepare(request)
    flight.pick()
    flight.close()
    assert (request.prompt_tokens, request.block_tokens) == (1500, 0.0)  # blocks of exactly 16 tokens

    parse = router.flow.flight.parse_request

    def exact(*args: Any, **kwargs: Any) -> RouteRequest:  # as token ids, or a tokenizer's count
        request = parse(*args, **kwargs)
        request.exact_tokens = True
        return request

    monkeypatch.setattr(router.flow.flight, "parse_request", exact)
    request = picked(flow)
    assert (request.prompt_tokens, request.block_tokens) == (1500, 0.0)
    samples = flow.signals.tokens.samples
    answered(flow, 99, E0, six_chars_a_token)
    assert flow.signals.tokens.samples == samples  # nothing to learn from an exact count


def test_the_token_ratio_has_its_own_switch() -> None:
    flow = learning_flow(learn_token_ratio=False)
    for i in range(12):
        answered(flow, i, E0, six_chars_a_token)
    assert flow.signals is not None and flow.signals.tokens.ratio == pytest.approx(4 / 6, rel=0.01)
    assert picked(flow).prompt_tokens == 1500  # learned and exported, not applied


def test_evicted_blocks_only_when_the_engine_had_far_less() -> None:
    assert evicted_blocks(held_tokens=1600, reported_cached=1600, tokens_per_block=16) is None
    assert evicted_blocks(held_tokens=1600, reported_cached=1000, tokens_per_block=16) is None  # > half
    assert evicted_blocks(held_tokens=1600, reported_cached=320, tokens_per_block=16) == (20, 100)
    assert evicted_blocks(held_tokens=1600, reported_cached=0, tokens_per_block=16) == (0, 100)
    assert evicted_blocks(held_tokens=15, reported_cached=0, tokens_per_block=16) is None  # within a block


async def test_token_estimate_calibrates_on_a_pool_whose_tokenizer_is_coarser() -> None:
    specs = [EngineSpec("e0", "prefill-decode", chars_per_token=6.0)]  # the config says 4
    async with router_on_sim(specs, LEARNING) as (_cluster, app, base), aiohttp.ClientSession() as http:
        rng = random.Random(1)
        for i in range(12):
            text = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(800, 4000)))
            body = {"model": "sim-model", "prompt": f"{i} {text}", "max_tokens": 2}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
        assert app.parts.scaling.tokens.ratio == pytest.approx(4 / 6, rel=0.05)
        # The next prompt is estimated in the engines' tokens: 6,000 characters are ~1,000.
        flight = app.parts.flow.start({})
        request = flight.parse(b'{"model": "sim-model", "prompt": "' + b"x" * 6000 + b'"}')
        flight.pick()
        flight.close()
        assert request.prompt_tokens == pytest.approx(1000, rel=0.05)
        assert request.block_tokens == pytest.approx(16 * 4 / 6, rel=0.05)


async def test_an_engine_that_evicted_makes_the_index_keep_less_for_it() -> None:
    specs = [EngineSpec("e0", "prefill-decode")]
    async with router_on_sim(specs, LEARNING) as (cluster, app, base), aiohttp.ClientSession() as http:

        async def send(prompt: str) -> dict:
            body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                return await resp.json()

        old = [f"old prompt {i} " * 100 for i in range(3)]
        for prompt in old:
            await send(prompt)
        slot = app.parts.pool.endpoints["e0"].slot
        shared = "shared system prompt " * 200
        await send(shared)
        recorded = len(app.parts.index)  # e0's blocks: it is the only engine
        assert cluster.engines["e0"].reset_prefix_cache()  # the engine drops it all behind our back
        answer = await send(shared)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # That answer said "nothing cached" where the index said the whole prompt: the index now
        # keeps that many blocks fewer for e0, the least recently used (the old prompts) first,
        # while the head of the prompt just recomputed stays.
        parse = app.parts.flow.start({}).parse
        blocks = parse(orjson.dumps({"model": "sim-model", "prompt": shared})).block_keys
        await eventually(
            lambda: len(app.parts.index) == recorded - len(blocks), 5.0, "the index shrunk for e0"
        )
        for prompt in old:
            keys = parse(orjson.dumps({"model": "sim-model", "prompt": prompt})).block_keys
            assert int(app.parts.index.match(keys, np.array([slot]))[0]) == 0
        assert int(app.parts.index.match(blocks, np.array([slot]))[0]) > 0.9 * len(blocks)
        ratio = app.parts.scaling.perf.ratios["cached_tokens"]
        assert int(ratio[0]) >= 1  # reported 0 of what the index said: the lowest bucket


async def test_streamed_answers_carry_the_usage_the_router_asked_for_and_the_client_did_not() -> None:
    specs = [EngineSpec("e0", "prefill-decode")]
    async with router_on_sim(specs, LEARNING) as (cluster, app, base), aiohttp.ClientSession() as http:
        body = {"model": "sim-model", "prompt": "hello " * 100, "max_tokens": 5, "stream": True}
        async with http.post(f"{base}/v1/completions", json=body) as resp:
            events = await sse_events(resp)
        assert events[-1] == "[DONE]"
        assert all("usage" not in e or e["usage"] is None for e in events[:-1] if isinstance(e, dict))
        _, _, seen = cluster.engines["e0"].requests_seen[-1]
        assert seen["stream_options"] == {"include_usage": True}  # asked for on the client's behalf
        assert app.parts.scaling.tokens.samples == 1  # and read: the prompt's true token count
        asked = {**body, "stream_options": {"include_usage": True}}
        async with http.post(f"{base}/v1/completions", json=asked) as resp:
            events = await sse_events(resp)
        assert events[-2]["usage"]["completion_tokens"] == 5  # the client asked: it gets it


def test_answers_to_apis_the_router_does_not_read_teach_nothing() -> None:
    flow = learning_flow()
    assert flow.signals is not None
    for i in range(24):  # an embeddings API's body is not its prompt: its size is no estimate
        flight = flow.start({})
        flight.parse(
            orjson.dumps({"model": "m", "input": "x" * (600 + i)}), frozenset({E0}), "/v1/embeddings"
        )
        flight.pick()
        flight.responded(200)
        # A plausible count for a body of that size: were it read as an estimate, it would count.
        usage = {"prompt_tokens": 100 + i, "total_tokens": 100 + i}
        flight.body(orjson.dumps({"data": [], "usage": usage}))
        flight.close()
    assert (flow.signals.tokens.samples, flow.signals.tokens.rejected, flow.signals.tokens.ratio) == (
        0,
        0,
        1.0,
    )
    assert flow.signals.perf.ttft.count == 0
