"""Recommended replicas: the forecast over the ready time, capacity at the SLO, hysteresis, refused
scale-downs (N/(N−1) load, KV), and prefill and decode moving independently on a real pool."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import PD_TWO_RACKS, Metrics, make_config, make_picker, make_pool

from router.signals.perf import LearnSettings, PerformanceModel
from router.signals.scaling import (
    PoolSignals,
    Recommender,
    RoleState,
    ScalingSettings,
    Trend,
    decode_capacity,
    prefill_capacity,
)
from scorers.base import EngineModel

SETTINGS = ScalingSettings(scale_down_window_s=60.0, min_replicas=(1, 1), max_replicas=(10, 10))
ENGINE = EngineModel(
    prefill_tokens_per_s=10000.0,
    decode_step_base_s=0.01,
    pd_leg_overhead_s=0.0,
    decode_s_per_seq=0.001,
    decode_s_per_kv_token=0.0,
    kv_bytes_per_token=1,
)


def state(current: int, demand: float, *, load: float | None = 0.5, kv: float = 0.0) -> RoleState:
    return RoleState(current, demand, capacity=100.0, load=load, kv_used_tokens=kv, kv_capacity_tokens=1000.0)


def test_desired_is_demand_over_capacity_within_bounds() -> None:
    r = Recommender(SETTINGS)
    assert r.recommend(0.0, "prefill", state(2, 250.0), 250.0, 10.0).desired == 3
    assert r.recommend(0.0, "decode", state(2, 5000.0), 5000.0, 10.0).desired == 10  # max_replicas
    assert r.recommend(0.0, "decode", state(2, 0.0), 0.0, 10.0).desired == 1  # min_replicas


def test_broken_slo_asks_for_one_more_whatever_the_model_says() -> None:
    rec = Recommender(SETTINGS).recommend(0.0, "prefill", state(3, 100.0, load=1.4), 100.0, 10.0)
    assert rec.desired == 4 and rec.recommended == 4


def test_a_fresh_recommender_holds_the_running_count_for_one_window() -> None:
    r = Recommender(SETTINGS)
    assert r.recommend(0.0, "decode", state(4, 50.0, load=0.1), 50.0, 10.0).recommended == 4
    assert r.recommend(59.0, "decode", state(4, 50.0, load=0.1), 50.0, 10.0).recommended == 4
    assert r.recommend(61.0, "decode", state(4, 50.0, load=0.1), 50.0, 10.0).recommended == 1


def test_scale_up_at_once_scale_down_only_after_the_window() -> None:
    r = Recommender(SETTINGS)
    assert r.recommend(0.0, "decode", state(2, 450.0), 450.0, 10.0).recommended == 5
    # Demand falls right away: the recommendation holds for the window (no flapping).
    for t in (1.0, 30.0, 59.0):
        rec = r.recommend(t, "decode", state(5, 150.0, load=0.1), 150.0, 10.0)
        assert rec.desired == 2 and rec.recommended == 5
    assert r.recommend(61.0, "decode", state(5, 150.0, load=0.1), 150.0, 10.0).recommended == 2


def test_scale_down_refused_when_the_consolidated_load_breaks_the_slo() -> None:
    r = Recommender(ScalingSettings(scale_down_window_s=0.0))
    # 4 replicas at load 0.7: going to 3 makes it 0.93 (fine), to 2 makes it 1.4 (refused).
    rec = r.recommend(0.0, "prefill", state(4, 150.0, load=0.7), 150.0, 10.0)
    assert rec.desired == 2 and rec.recommended == 3 and rec.refused == "slo"
    # At load 0.8 even one fewer (× 4/3 = 1.07) breaks it: hold at 4.
    rec = r.recommend(1.0, "prefill", state(4, 150.0, load=0.8), 150.0, 10.0)
    assert rec.recommended == 4 and rec.refused == "slo"
    # Light load: the scale-down goes through.
    rec = r.recommend(2.0, "prefill", state(4, 150.0, load=0.2), 150.0, 10.0)
    assert rec.recommended == 2 and rec.refused is None


def test_scale_down_refused_when_the_kv_in_use_would_not_fit() -> None:
    r = Recommender(ScalingSettings(scale_down_window_s=0.0, kv_target=0.8))
    # 2,000 KV tokens in use; a replica holds 1,000 at most 800 of it: 3 replicas needed.
    rec = r.recommend(0.0, "decode", state(5, 50.0, load=0.1, kv=2000.0), 50.0, 10.0)
    assert rec.desired == 1 and rec.recommended == 3 and rec.refused == "kv"


def test_trend_forecasts_a_ramp_over_the_horizon_and_never_forecasts_a_fall() -> None:
    settings = ScalingSettings(level_window_s=5.0, trend_window_s=60.0, max_growth=10.0)
    ramp, fall = Trend(settings), Trend(settings)
    for t in range(60):
        ramp.add(float(t), 100.0 + 10.0 * t)  # +10 per second
        fall.add(float(t), 1000.0 - 10.0 * t)
    level = np.mean([100.0 + 10.0 * t for t in range(54, 60)])  # the last 5 s, ends included
    assert ramp.forecast(59.0, 30.0) == pytest.approx(level + 300.0, rel=0.01)
    assert fall.forecast(59.0, 30.0) == pytest.approx(np.mean([1000.0 - 10.0 * t for t in range(54, 60)]))
    capped = Trend(ScalingSettings(max_growth=2.0))
    for t in range(60):
        capped.add(float(t), 100.0 + 10.0 * t)
    assert capped.forecast(59.0, 3600.0) == pytest.approx(
        2 * np.mean([100.0 + 10.0 * t for t in range(49, 60)])
    )


def test_capacity_per_replica_at_the_slo() -> None:
    perf = PerformanceModel(ENGINE)
    # A 1,000-token prompt takes 0.11 s; with a 1 s TTFT SLO the M/D/1 utilisation is
    # 2h / (s + 2h) with h = 0.89: 0.94, capped at 0.85.
    assert prefill_capacity(perf, 1000.0, 1.0, 0.85) == pytest.approx(0.85 * 1000 / 0.11)
    # A tight SLO (0.2 s): h = 0.09, rho = 0.18 / 0.29.
    assert prefill_capacity(perf, 1000.0, 0.2, 0.85) == pytest.approx(0.18 / 0.29 * 1000 / 0.11)
    # TPOT SLO 50 ms, step 10 ms + 1 ms per sequence: 40 sequences; KV caps it at 8.
    assert decode_capacity(perf, 1000.0, 0.05, 0.0, 0.8) == pytest.approx(40.0)
    assert decode_capacity(perf, 1000.0, 0.05, 10000.0, 0.8) == pytest.approx(8.0)
    assert decode_capacity(perf, 1000.0, 0.005, 0.0, 0.8) == 1.0  # the SLO is below one step


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool_signals(metrics: dict[str, Metrics]) -> tuple[PoolSignals, Clock]:
    config = make_config(PD_TWO_RACKS, slo={"ttft_ms": 1000, "tpot_ms": 50})
    pool = make_pool(config, metrics, 100.0)
    pool.stale_after_s = 1e9
    picker = make_picker(config, pool)
    clock = Clock()
    signals = PoolSignals(
        pool,
        PerformanceModel(picker.cost_model.model, LearnSettings()),
        lambda: picker.cost_model,
        lambda cm: setattr(picker, "cost_model", cm),
        ScalingSettings(scale_down_window_s=0.0, ready_time_s=60.0),
        clock=clock,
    )
    return signals, clock


def test_long_prompts_raise_prefill_and_not_decode_long_outputs_the_reverse() -> None:
    idle = {n: Metrics() for n in ("p0", "p1", "d0", "d1")}
    signals, clock = pool_signals(idle)
    base = signals.tick()
    assert base["prefill"].recommended == base["decode"].recommended == 1
    # A burst of long prompts: 400k uncached tokens per second arrive.
    for _ in range(10):
        clock.now += 1.0
        for _ in range(100):
            signals.demand.arrived(4000.0)
        burst = signals.tick()
    assert burst["prefill"].recommended > 2 and burst["decode"].recommended == 1

    # Long outputs: sequences pile up on the decode pods, prompts are short and few.
    busy = {**idle, "d0": Metrics(running=600, kv_usage=0.3), "d1": Metrics(running=600, kv_usage=0.3)}
    signals, clock = pool_signals(busy)
    for _ in range(10):
        clock.now += 1.0
        signals.demand.arrived(50.0)
        decode_burst = signals.tick()
    assert decode_burst["decode"].recommended > 2 and decode_burst["prefill"].recommended == 1


def test_the_horizon_is_measured_once_the_gate_has_seen_replicas_start() -> None:
    signals, _ = pool_signals({n: Metrics() for n in ("p0", "p1", "d0", "d1")})
    assert signals.horizon_s() == 60.0
    signals.ready_times = lambda: [100.0, 120.0, 300.0]
    assert signals.horizon_s() == pytest.approx(np.quantile([100.0, 120.0, 300.0], 0.9))
    assert math.isfinite(signals.tick()["prefill"].horizon_s)
