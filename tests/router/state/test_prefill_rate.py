"""Each pod's recent prompt-token rate (``Pool.note_prefill``, the ``prefill_rate`` feature): what
stretches the TPOT predicted for answers on a pod that also computes prompts."""

from __future__ import annotations

import math

import pytest
from helpers import Clock, Metrics

from router.server.config import EndpointConfig
from router.state.pool import Pool

WINDOW_S = 1.0


def pd_pool(clock: Clock) -> tuple[Pool, int, int]:
    pool = Pool(clock=clock, prefill_rate_window_s=WINDOW_S)
    for name, role in (("p0", "prefill"), ("d0", "decode")):
        pool.add(EndpointConfig(name=name, address=f"127.0.0.1:{8000 + len(pool.endpoints)}", role=role))
    return pool, pool.endpoints["p0"].slot, pool.endpoints["d0"].slot


def test_a_prompt_counts_when_routed_on_the_pod_that_will_compute_it() -> None:
    clock = Clock()
    pool, p0, d0 = pd_pool(clock)
    pair = pool.reserve(d0, p0, prefill_tokens=1000.0, kv_tokens=1200.0)
    local = pool.reserve(d0, None, prefill_tokens=300.0, kv_tokens=400.0)
    # Routed, about to be computed: the stall is coming, so the picks that follow see it.
    assert pool.prefill_rate[p0] == pytest.approx(1000.0 / WINDOW_S)  # the pair's prefill pod
    assert pool.prefill_rate[d0] == pytest.approx(300.0 / WINDOW_S)  # the pod that computes it itself
    for reservation in (pair, local):
        reservation.finish_prefill()
        reservation.release()
    assert pool.prefill_rate[p0] == pytest.approx(1000.0 / WINDOW_S)  # counted once, not given back


def test_the_rate_fades_at_each_scrape_once_prompts_stop() -> None:
    clock = Clock()
    pool, p0, _ = pd_pool(clock)
    pool.reserve(p0, None, prefill_tokens=500.0, kv_tokens=0.0)
    clock.now += WINDOW_S
    pool.apply_metrics(pool.endpoints["p0"], Metrics(), clock.now)
    assert pool.prefill_rate[p0] == pytest.approx(500.0 / WINDOW_S * math.exp(-1.0))
    clock.now += 10 * WINDOW_S
    pool.apply_metrics(pool.endpoints["p0"], Metrics(), clock.now)
    assert pool.prefill_rate[p0] < 0.01


def test_steady_prompts_read_as_their_rate_and_a_removed_pod_starts_over() -> None:
    clock = Clock()
    pool, p0, _ = pd_pool(clock)
    for _ in range(200):  # 400 tokens every 0.1 s: 4,000 tokens/s
        clock.now += 0.1
        pool.reserve(p0, None, prefill_tokens=400.0, kv_tokens=0.0)
    # The estimate just after a prompt sits at its upper edge: within the step one prompt adds.
    assert 4000.0 <= pool.prefill_rate[p0] <= 4000.0 + 400.0 / WINDOW_S
    pool.remove("p0")
    assert pool.prefill_rate[p0] == 0.0 and math.isnan(pool.prefill_rate_at[p0])
