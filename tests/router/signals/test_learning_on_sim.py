"""The performance model learns on real HTTP: streamed answers from simulated engines three times
slower than configured re-price the picker, and the metrics show predicted against observed."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
from helpers import eventually, router_on_sim

from simulator.cluster import engine_model_for
from simulator.engine import EngineSpec, TimeModel

pytestmark = pytest.mark.integration

SPEED = 4.0
SPECS = [
    EngineSpec("p0", "prefill", link="a"),
    EngineSpec("p1", "prefill", link="a"),
    EngineSpec("d0", "decode", link="a"),
    EngineSpec("d1", "decode", link="a"),
]


async def test_streamed_answers_teach_the_model_and_reprice_the_picker() -> None:
    true = engine_model_for(TimeModel(speed=SPEED), 131072)
    configured = {**true, "prefill_tokens_per_s": 3 * true["prefill_tokens_per_s"]}
    sections = {
        "engine": configured,
        "signals": {"tick_ms": 50, "min_samples": 12, "learn": True},
        "picker": {"allow_local_prefill": False},
    }
    rng = random.Random(3)
    async with (
        router_on_sim(SPECS, sections, speed=SPEED) as (_cluster, app, base),
        aiohttp.ClientSession() as http,
    ):

        async def one(tokens: int) -> None:
            prompt = "".join(rng.choice("abcdefgh ") for _ in range(tokens * 4))
            body = {"model": "sim-model", "prompt": prompt, "max_tokens": 12, "stream": True}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()

        for tokens in [60, 300, 1200, 2400] * 6:  # one at a time: the prefill leg is the prompt alone
            await one(tokens)
        perf = app.parts.scaling.perf
        await eventually(lambda: perf.prefill.fitted, 10.0, "an accepted prefill fit")
        fitted_rate = 1.0 / float(perf.prefill.coefficients[1])
        # Closer to the engines' real speed than to the configured one (HTTP and step overheads
        # make the observed a little slower than the time model alone).
        assert fitted_rate < 0.6 * configured["prefill_tokens_per_s"]
        assert fitted_rate > 0.5 * true["prefill_tokens_per_s"]
        await eventually(
            lambda: (
                app.parts.picker.cost_model.model.prefill_tokens_per_s
                < configured["prefill_tokens_per_s"] / 2
            ),
            5.0,
            "the picker re-priced by the fit",
        )
        assert len(perf.decode.samples) == 24  # every streamed answer gave a TPOT
        await asyncio.gather(*(one(100) for _ in range(4)))
        async with http.get(f"{base}/metrics") as resp:
            text = await resp.text()
        assert 'pd_router_perf_model_fitted{role="prefill"} 1.0' in text
        assert 'pd_router_prediction_ratio_count{measure="ttft"} 28.0' in text
        assert 'pd_router_pool_observed_seconds{measure="ttft",role="prefill"}' in text
        assert 'pd_router_recommended_replicas{role="decode"}' in text


async def burst_peaks(isl: int, osl: int, n: int, speed: float, tpot_ms: float) -> dict[str, int]:
    """Send ``n`` requests at once to a 1 prefill + 1 decode simulated pool; the highest
    ``desired`` each role reached while they ran."""
    sections = {
        "slo": {"ttft_ms": 1000 / speed, "tpot_ms": tpot_ms / speed},
        # The configured engine model, never one fitted from the burst itself: on a starved machine
        # the legs' times are the machine's, and a fit of them moved prefill to 5 replicas in a
        # burst of 20-token prompts. What this tests is which role's demand each burst raises.
        "signals": {"tick_ms": 50, "backlog_drain_s": 1.0, "learn": False, "min_samples": 1_000_000},
        # A burst of this size keeps the loop busy: generous staleness, so a late scrape on a
        # loaded machine is not mistaken for a dead engine.
        "scrape": {"interval_ms": 50, "timeout_ms": 2000, "stale_after_ms": 5000, "eject_after_failures": 5},
        "picker": {"allow_local_prefill": False},
    }
    # A decode pod with KV for every request of the burst: KV is not what these bursts test.
    specs = [EngineSpec("p0", "prefill", link="a"), EngineSpec("d0", "decode", link="a", num_gpu_blocks=8192)]
    peaks = {"prefill": 0, "decode": 0}
    async with (
        router_on_sim(specs, sections, speed=speed) as (_cluster, app, base),
        aiohttp.ClientSession() as http,
    ):

        async def one(i: int) -> None:
            prompt = f"{i} " + "".join(random.Random(i).choice("abcdefgh ") for _ in range(isl * 4))
            body = {"model": "sim-model", "prompt": prompt, "max_tokens": osl, "ignore_eos": True}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()

        requests = asyncio.gather(*(one(i) for i in range(n)))
        while not requests.done():
            for role, rec in app.parts.scaling.latest.items():
                peaks[role] = max(peaks[role], rec.desired)
            await asyncio.sleep(0.02)
        await requests
    return peaks


async def test_a_burst_of_long_prompts_raises_prefill_and_long_outputs_raise_decode() -> None:
    # 24k prompt tokens at once on one prefill pod of 20k tokens/s.
    isl_burst = await burst_peaks(isl=2000, osl=2, n=12, speed=1.0, tpot_ms=50)
    assert isl_burst["prefill"] >= 2 and isl_burst["decode"] == 1
    # 48 long decodes on one decode pod that meets a 10 ms TPOT SLO with about 25.
    osl_burst = await burst_peaks(isl=20, osl=300, n=48, speed=SPEED, tpot_ms=10)
    assert osl_burst["decode"] >= 2 and osl_burst["prefill"] == 1


async def test_the_prefill_fit_counts_what_the_engine_computed_not_what_the_index_guessed() -> None:
    # One engine whose KV holds one of the two prompts at a time: each prompt evicts the other, so
    # the index (which saw both routed there) guesses them cached, and the engine reports none.
    specs = [EngineSpec("e0", "prefill-decode", link="a", num_gpu_blocks=96)]
    sections = {"signals": {"tick_ms": 50}, "picker": {"allow_local_prefill": True}}
    prompts = ["".join(random.Random(seed).choice("abcdefgh ") for _ in range(4000)) for seed in (1, 2)]
    async with (
        router_on_sim(specs, sections, speed=SPEED) as (_cluster, app, base),
        aiohttp.ClientSession() as http,
    ):
        for prompt in prompts * 4:  # one at a time: no queue ahead of any of them
            body = {"model": "sim-model", "prompt": prompt, "max_tokens": 4, "stream": True}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
        await eventually(lambda: len(app.parts.scaling.perf.prefill.samples) == 8, 10.0, "8 prefill samples")
        work, _ = app.parts.scaling.perf.prefill.samples.arrays()
        # Every prompt (~1,000 tokens) was computed whole; the index guessed the repeats cached.
        assert work[:, 1].min() > 900, work[:, 1]
