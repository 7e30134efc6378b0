"""The approximate index holds no more for a pod than its engine's KV cache (vllm:cache_config_info)."""

from __future__ import annotations

import math

import numpy as np
from helpers import SINGLE_PODS, Metrics, make_config

from router.server.compose import build, pool_from


def test_the_pool_tells_each_change_of_a_slots_kv_cache_size_and_its_end() -> None:
    pool = pool_from(make_config(SINGLE_PODS[:2]))
    told: list[tuple[int, float]] = []
    pool.on_capacity = lambda slot, tokens: told.append((slot, tokens))
    e0, e1 = pool.endpoints["e0"], pool.endpoints["e1"]
    pool.apply_metrics(e0, Metrics(num_gpu_blocks=100), 1.0)
    pool.apply_metrics(e0, Metrics(num_gpu_blocks=100), 2.0)  # the same size: nothing to tell
    pool.apply_metrics(e1, Metrics(num_gpu_blocks=None), 2.0)  # unknown as before: nothing either
    pool.apply_metrics(e0, Metrics(num_gpu_blocks=50), 3.0)
    assert told == [(e0.slot, 1600.0), (e0.slot, 800.0)]
    pool.remove("e0")
    assert told[-1][0] == e0.slot and math.isnan(told[-1][1])
    pool.remove("e1")  # never known: nothing to take back
    assert len(told) == 3


def test_a_served_pool_forgets_what_a_pods_cache_cannot_hold() -> None:
    config = make_config(SINGLE_PODS[:1])
    parts = build(config)
    pool, index = parts.pool, parts.index
    endpoint = pool.add(config.endpoints[0])
    prompt = np.arange(1, 301, dtype=np.uint64)  # 300 blocks of 16 tokens
    index.record(endpoint.slot, prompt)
    assert index.match(prompt, np.array([endpoint.slot]))[0] == 300
    # The engine's cache: 100 blocks of 16 tokens. What it cannot hold leaves the index at once:
    # the prompt's first blocks, touched last, are the ones kept.
    pool.apply_metrics(endpoint, Metrics(block_size=16, num_gpu_blocks=100), 1.0)
    assert index.match(prompt, np.array([endpoint.slot]))[0] == 100
    index.record(endpoint.slot, np.arange(1001, 1101, dtype=np.uint64))  # a new 100-block prompt
    assert index.match(prompt, np.array([endpoint.slot]))[0] == 0
    # Its endpoint leaves and another takes the slot, its cache size not known yet: the default.
    pool.remove(endpoint.id)
    again = pool.add(config.endpoints[0])
    assert again.slot == endpoint.slot
    index.record(again.slot, prompt)
    assert index.match(prompt, np.array([again.slot]))[0] == 300
