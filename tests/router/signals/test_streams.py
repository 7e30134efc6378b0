"""Load while long generations run: the TPOT of answers still streaming counts, not only that of
answers that ended (one whole generation late), each TTFT counts at its first token and each
prefill leg's time teaches the prefill fit when the leg answers."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest
from helpers import SINGLE_PODS, eventually, make_config, make_picker, make_pool, router_on_sim

from router.flow.flight import RequestFlow
from router.observe.metrics import RouterMetrics
from router.server.compose import learn_settings_from
from router.signals.perf import PerformanceModel
from router.signals.scaling import PoolSignals
from router.signals.streams import LiveStreams
from simulator.engine import EngineSpec


class Stream:
    def __init__(self, first_at: float | None, events: int) -> None:
        self.first_at = first_at
        self.events = events


def test_running_streams_give_their_seconds_per_token_so_far() -> None:
    now = [100.0]
    streams = LiveStreams(limit=3, clock=lambda: now[0])
    steady = Stream(90.0, 100)  # 0.1 s a token
    stalled = Stream(99.0, 2)  # 0.5 s a token: waiting for its third
    fresh = Stream(99.9, 1)  # one token tells no rate
    for stream in (steady, stalled, fresh):
        streams.add(stream)
    streams.add(Stream(0.0, 5))  # over the limit: not held
    assert len(streams) == 3
    assert streams.tpot_p90() == pytest.approx(0.1 + 0.9 * (0.5 - 0.1))
    streams.discard(stalled)
    streams.discard(stalled)  # idempotent
    assert streams.tpot_p90() == pytest.approx(0.1)
    streams.discard(steady)
    assert streams.tpot_p90() is None


def test_a_streamed_answers_ttft_counts_at_its_first_token_unless_it_was_moved() -> None:
    config = make_config(SINGLE_PODS[:2])
    pool = make_pool(config)
    pool.stale_after_s = 1e9  # unit tests run on wall-clock time
    picker = make_picker(config, pool)
    perf = PerformanceModel(picker.cost_model.model, learn_settings_from(config))
    signals = PoolSignals(pool, perf, lambda: picker.cost_model, lambda _: None)
    flow = RequestFlow(picker, RouterMetrics(pool, "t"), config.request_limits(), config.model, (), signals)
    body = orjson.dumps({"model": "m", "prompt": "hello there", "stream": True, "max_tokens": 8})
    token = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
    served = {SINGLE_PODS[0]["address"]}
    flight = flow.start({})
    flight.parse(body, frozenset(served))
    flight.pick()
    flight.responded(200)
    flight.body(b": keep-alive\n\n")  # no token yet
    assert perf.ttft.count == 0
    flight.body(token)
    assert perf.ttft.count == 1  # the answer is still streaming
    flight.body(token)
    flight.close()
    assert perf.ttft.count == 1  # once per answer
    moved = flow.start({})  # its engine failed before answering: the time is not one engine's
    moved.parse(body, frozenset(served))
    moved.pick()
    moved.retarget(decode=pool.endpoints[SINGLE_PODS[1]["name"]])
    moved.responded(200)
    moved.body(token)
    moved.close()
    assert perf.ttft.count == 1


@pytest.mark.integration
async def test_decode_load_rises_and_prompts_count_while_long_answers_stream_not_after_them() -> None:
    specs = [EngineSpec("p0", "prefill"), EngineSpec("d0", "decode")]
    sections = {
        "slo": {"ttft_ms": 2000, "tpot_ms": 1.0},
        "signals": {"tick_ms": 50},
        "picker": {"allow_local_prefill": False},  # every answer a P/D pair: a prefill leg each
    }
    read: list[int] = [0] * 6
    release = asyncio.Event()
    async with (
        router_on_sim(specs, sections, speed=1.0) as (_cluster, app, base),
        aiohttp.ClientSession() as http,
    ):

        async def stream(i: int) -> None:
            body = {"model": "sim-model", "prompt": f"q{i} " * 50, "max_tokens": 2000, "stream": True}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 200
                async for _line in resp.content:
                    read[i] += 1
                    if release.is_set():
                        break

        tasks = [asyncio.create_task(stream(i)) for i in range(len(read))]
        try:
            await eventually(lambda: min(read) > 40, 20.0, "every stream well under way")
            scaling = app.parts.scaling
            now = time.monotonic()
            assert scaling.perf.tpot.p90(now) is None  # no answer has ended
            # Yet every answer's first token is in the observed TTFT (prefill load) already.
            assert scaling.perf.ttft.count == len(read)
            # Each one's prefill part is its prefill leg, short of the TTFT (the decode leg's
            # first token comes after it): what the prefill load reads.
            assert scaling.perf.prefill_part.count == len(read)
            # And each prefill leg's time is a sample of the prefill fit (the capacity per
            # replica), taken when the leg answered, not held back until its answer ends.
            assert len(scaling.perf.prefill.samples) == len(read)
            prefill_part, ttft = scaling.observed_latency("prefill", now), scaling.perf.ttft.p90(now)
            assert prefill_part is not None and ttft is not None and prefill_part < ttft
            observed = scaling.observed_latency("decode", now)
            assert observed is not None and observed > 0.001
            assert scaling.load("decode") >= observed / 0.001 * 0.99
            async with http.get(f"{base}/metrics") as resp:
                text = await resp.text()
            assert 'pd_router_pool_observed_seconds{measure="tpot",role="decode"}' in text
            prefill_series = 'pd_router_pool_observed_seconds{measure="prefill",role="prefill"}'
            assert f"{prefill_series} {prefill_part}" in text
        finally:
            release.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        # Cancelled streams leave the set: nothing is held for them.
        await eventually(lambda: len(app.parts.scaling.streams) == 0, 10.0, "the streams forgotten")
