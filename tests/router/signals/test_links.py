"""Link bandwidths learned from answered P/D pairs: the weighted median shrugs off queue waits and
small transfers, nothing moves before enough answers, and on real HTTP a router told only rack
labels learns the slow link between them, exports it and (when applied) prices pairs with it."""

from __future__ import annotations

import random

import aiohttp
import numpy as np
import pytest
from helpers import router_for

from router.scheduling.costmodel.link import LinkCosts
from router.server.config import LinksConfig
from router.signals.links import MIN_BYTES, LinkLearner, weighted_median
from simulator.cluster import engine_model_for, link_cost_from
from simulator.engine import EngineSpec, SimCluster, TimeModel

PRIOR = LinkCosts(same=(0.00005, 50e9), default=(0.0005, 12.5e9))
GB = 1e9


def test_the_weighted_median_follows_the_weight_not_the_count() -> None:
    values = np.array([1.0, 2.0, 100.0])
    assert weighted_median(values, np.array([1.0, 1.0, 1.0])) == 2.0
    assert weighted_median(values, np.array([1.0, 1.0, 10.0])) == 100.0


def test_a_slow_link_is_learned_through_queue_waits_and_noisy_small_transfers() -> None:
    learner = LinkLearner(PRIOR, apply=True, window=32, min_samples=8)
    rng = random.Random(0)
    for i in range(40):
        size = rng.uniform(200e6, 600e6)
        wait = 0.2 if i % 5 == 0 else 0.0  # one answer in five also queued on the decode pod
        learner.observe("rack-b", "rack-a", size, 0.0005 + size / (3 * GB) + wait)
        # Small transfers: mostly a step of noise either way, they must not drag the estimate.
        learner.observe("rack-a", "rack-b", 25e6, rng.uniform(-0.004, 0.004))
    bandwidth = learner.learned()[("rack-a", "rack-b")]  # one class, either direction
    assert 2.7 * GB < bandwidth < 3.3 * GB


def test_nothing_moves_before_enough_answers_and_tiny_transfers_teach_nothing() -> None:
    learner = LinkLearner(PRIOR, apply=True, min_samples=8)
    for _ in range(7):
        learner.observe("a", "a", 300e6, 0.1)
    learner.observe("a", "b", MIN_BYTES - 1, 5.0)
    assert learner.learned() == {} and learner.version == 0
    assert learner.costs(PRIOR) is PRIOR
    learner.observe("a", "a", 300e6, 0.1)
    assert learner.version == 1
    assert learner.learned()[("a", "a")] == pytest.approx(300e6 / (0.1 - 0.00005))


def test_learned_bandwidths_price_only_when_applied() -> None:
    observed = LinkLearner(PRIOR, apply=False, min_samples=2)
    applied = LinkLearner(PRIOR, apply=True, min_samples=2)
    for learner in (observed, applied):
        for _ in range(2):
            learner.observe("a", "b", 300e6, 0.0005 + 0.1)
    assert observed.costs(PRIOR) is PRIOR
    table = applied.costs(PRIOR).table({"a": 0, "b": 1})
    assert table.bytes_per_s[0, 1] == table.bytes_per_s[1, 0] == pytest.approx(3 * GB)
    assert table.latency_s[0, 1] == PRIOR.default[0]  # the configured latency stays
    assert table.bytes_per_s[0, 0] == PRIOR.same[1]  # classes without answers keep their prior


@pytest.mark.integration
async def test_a_router_told_only_rack_labels_learns_the_slow_link_between_them() -> None:
    true_links = {
        "same": {"latency_ms": 0.05, "bandwidth_gbytes_per_s": 25.0},
        "default": {"latency_ms": 1.0, "bandwidth_gbytes_per_s": 2.0},
    }
    tm = TimeModel(speed=20.0)
    specs = [
        EngineSpec("p-a", "prefill", link="rack-a", time=tm),
        EngineSpec("d-b", "decode", link="rack-b", time=tm),
    ]
    sections = {
        "endpoints": [],
        "engine": engine_model_for(tm, specs[0].kv_bytes_per_token),
        "picker": {"allow_local_prefill": False},
        "signals": {
            "learn": True,
            "learn_links": True,
            "learn_perf_model": False,
            "learn_engine_speed": False,
        },
    }
    rng = random.Random(1)
    async with SimCluster(specs, link_cost_from(LinksConfig.model_validate(true_links))) as cluster:
        sections["endpoints"] = [
            {"address": cluster.address(s.name), "role": s.role, "link": s.link, "name": s.name}
            for s in specs
        ]
        async with router_for(sections) as (app, base), aiohttp.ClientSession() as http:
            for _ in range(10):  # one at a time, every prompt new: the whole prompt crosses racks
                prompt = "".join(rng.choice("abcdefgh ") for _ in range(6000))
                body = {"model": "sim-model", "prompt": prompt, "max_tokens": 4, "stream": True}
                async with http.post(f"{base}/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-pd-router-prefill"] == "p-a"
                    await resp.read()
            learned = app.parts.links.learned()[("rack-a", "rack-b")]
            # The configured default says 12.5 GB/s; the link does 2 (HTTP and steps add a little).
            assert 1.0 * GB < learned < 2.6 * GB
            table = app.parts.picker._link_table()
            assert table.bytes_per_s[0, 1] == pytest.approx(learned)
            async with http.get(f"{base}/metrics") as resp:
                text = await resp.text()
            assert (
                'pd_router_link_learned_bandwidth_bytes_per_second{link_a="rack-a",link_b="rack-b"}' in text
            )
