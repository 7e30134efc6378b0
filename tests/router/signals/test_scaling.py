"""Recommended replicas: the forecast over the ready time, capacity at the SLO, hysteresis, refused
scale-downs (N/(N−1) load, KV), and prefill and decode moving independently on a real pool."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from helpers import PD_TWO_RACKS, Clock, Metrics, make_config, make_picker, make_pool

from router.scheduling.costmodel.view import EngineModel
from router.signals.perf import LearnSettings, PerformanceModel
from router.signals.saturation import predicted_latency
from router.signals.scaling import (
    Level,
    PoolSignals,
    Recommender,
    RoleState,
    ScalingSettings,
    decode_capacity,
    prefill_capacity,
    rate_growth,
)
from router.signals.streams import LiveStreams

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


def arrivals(rates: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """One tick a second; ``rates[i]`` arrivals in tick i: the times and the counts so far."""
    return np.arange(len(rates) + 1, dtype=float), np.concatenate([[0.0], np.cumsum(rates)])


def test_rate_growth_extrapolates_a_ramp_of_arrivals_and_never_a_fall() -> None:
    settings = ScalingSettings(level_window_s=5.0, trend_window_s=60.0, max_growth=10.0)
    ramp = [100.0 + 10.0 * t for t in range(60)]  # +10 requests/s every second
    times, requests = arrivals(ramp)
    # The slope of the rate (10 /s²) over 30 s, against today's rate.
    assert rate_growth(times, requests, 690.0, 30.0, settings) == pytest.approx(1.0 + 300.0 / 690.0)
    times, requests = arrivals([1000.0 - 10.0 * t for t in range(60)])
    assert rate_growth(times, requests, 410.0, 30.0, settings) == 1.0
    capped = ScalingSettings(max_growth=2.0, level_window_s=5.0, trend_window_s=60.0)
    times, requests = arrivals(ramp)
    assert rate_growth(times, requests, 690.0, 3600.0, capped) == 2.0


def test_capacity_per_replica_at_the_slo() -> None:
    perf = PerformanceModel(ENGINE)
    # A 1,000-token prompt takes 0.11 s; with a 1 s TTFT SLO the M/D/1 utilisation is
    # 2h / (s + 2h) with h = 0.89: 0.94, capped at 0.85.
    assert prefill_capacity(perf, 1000.0, 1.0, 0.85) == pytest.approx(0.85 * 1000 / 0.11)
    # A tight SLO (0.2 s): h = 0.09, rho = 0.18 / 0.29.
    assert prefill_capacity(perf, 1000.0, 0.2, 0.85) == pytest.approx(0.18 / 0.29 * 1000 / 0.11)
    # A prompt whose compute nears or passes the SLO: the wait is held to half a service (ρ = 1/2),
    # so the capacity moves smoothly with the fitted speed instead of collapsing near the SLO.
    assert prefill_capacity(perf, 1000.0, 0.12, 0.85) == pytest.approx(0.5 * 1000 / 0.11)
    assert prefill_capacity(perf, 1000.0, 0.05, 0.85) == pytest.approx(0.5 * 1000 / 0.11)
    tokens = np.linspace(2000.0, 40000.0, 400)  # service from 0.21 s to 4 s against a 1 s SLO
    capacity = np.array([prefill_capacity(perf, t, 1.0, 0.85) for t in tokens])
    assert (np.abs(np.diff(np.log(capacity))) < 0.05).all()  # no cliff anywhere
    # TPOT SLO 50 ms, step 10 ms + 1 ms per sequence: 40 sequences.
    assert decode_capacity(perf, 1000.0, 0.05, 0.0, 0.8) == pytest.approx(40.0)
    # KV for 8 of them: their steps take 18 ms, 8 / 0.018 = 444 tokens a second, which at the SLO's
    # pace would be 22.2 sequences in flight: the demand's unit (Little's law at the SLO).
    assert decode_capacity(perf, 1000.0, 0.05, 10000.0, 0.8) == pytest.approx(8.0 * 0.05 / 0.018)
    assert decode_capacity(perf, 1000.0, 0.005, 0.0, 0.8) == 1.0  # the SLO is below one step


def pool_signals(metrics: dict[str, Metrics], **sections: Any) -> tuple[PoolSignals, Clock]:
    config = make_config(PD_TWO_RACKS, slo={"ttft_ms": 1000, "tpot_ms": 50}, **sections)
    pool = make_pool(config, metrics, 100.0)
    pool.stale_after_s = 1e9
    picker = make_picker(config, pool)
    clock = Clock(100.0)
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


def test_noise_and_a_single_step_are_not_a_trend_sustained_growth_is() -> None:
    settings = ScalingSettings(level_window_s=5.0, trend_window_s=60.0, max_growth=10.0)
    rng = np.random.default_rng(0)
    noisy = rng.poisson(20.0, 60).astype(float)  # a constant 20 requests/s
    step = [20.0 if t < 40 else 60.0 for t in range(60)]  # a jump: a new level
    ramp = rng.poisson([20.0 + 1.0 * t for t in range(60)]).astype(float)  # +1 request/s per s
    assert rate_growth(*arrivals(list(noisy)), 20.0, 30.0, settings) == 1.0
    assert rate_growth(*arrivals(step), 60.0, 30.0, settings) == 1.0
    grown = rate_growth(*arrivals(list(ramp)), 75.0, 30.0, settings)
    assert grown == pytest.approx(1.0 + 1.0 * 30.0 / 75.0, rel=0.25)
    # Less than a window of history says nothing, however steep.
    times, requests = arrivals([20.0 + 5.0 * t for t in range(30)])
    assert rate_growth(times, requests, 165.0, 30.0, settings) == 1.0


def test_a_flat_poisson_load_seen_through_the_smoothed_rate_is_no_growth() -> None:
    """At 0.5 requests/s the rate spans its last 32 arrivals, 64 s: half the trend window. Tested
    as if its ticks were independent samples, that slow wander read as growth (a third decode
    replica under a flat load in the replay); the arrivals counted per tick are independent."""
    grown = 0
    for seed in range(10):
        signals, clock = pool_signals({n: Metrics() for n in ("p0", "p1", "d0", "d1")})
        rng = np.random.default_rng(seed)
        for _ in range(600):
            clock.now += 1.0
            for _ in range(rng.poisson(0.5)):
                signals.demand.arrived(2000.0, 64)
            signals.tick()
            grown += signals.growth(60.0) > 1.0
    assert grown <= 0.002 * 10 * 600, grown  # 59 of the 6,000 ticks grew with the smoothed rate


def test_a_broken_slo_asks_once_per_overload_not_again_while_the_cure_is_starting() -> None:
    r = Recommender(ScalingSettings(scale_down_window_s=0.0), settle_s=30.0)
    broken = dict(load=1.5)
    assert r.recommend(0.0, "prefill", state(2, 100.0, **broken), 100.0, 60.0).recommended == 3
    # Still broken while the third replica starts: kept (not cancelled), and no fourth.
    for t in (1.0, 30.0, 59.0):
        assert r.recommend(t, "prefill", state(2, 100.0, **broken), 100.0, 60.0).desired == 3
    # The third is admitted: its effect is not in the observed p90 for ``settle_s``.
    for t in (61.0, 90.0):  # held by the refused scale-down, no fourth
        assert r.recommend(t, "prefill", state(3, 100.0, **broken), 100.0, 60.0).recommended == 3
    # Settled and still broken: one more.
    assert r.recommend(92.0, "prefill", state(3, 100.0, **broken), 100.0, 60.0).desired == 4
    # A replica that never came (ready time passed): asked again.
    assert r.recommend(160.0, "prefill", state(3, 100.0, **broken), 100.0, 60.0).desired == 4


def test_a_broken_slo_is_not_answered_when_the_prediction_for_a_request_now_meets_it() -> None:
    r = Recommender(ScalingSettings(scale_down_window_s=0.0))
    lagging = RoleState(2, 100.0, capacity=100.0, load=1.3, confirming_load=0.6)  # observed p90 lags
    assert r.recommend(0.0, "prefill", lagging, 100.0, 60.0).desired == 1
    now_broken = RoleState(2, 100.0, capacity=100.0, load=1.3, confirming_load=1.3)
    assert Recommender(SETTINGS).recommend(0.0, "prefill", now_broken, 100.0, 60.0).desired == 3


@dataclass(eq=False)
class Stream:
    first_at: float
    events: int


def test_decode_asks_one_more_only_when_the_running_streams_confirm_the_predicted_overload() -> None:
    """Decode's observed TPOT counts the streams running now, so it is as timely as the
    prediction: an overload the prediction shows and the streams do not (a batch that never
    forms) asks for no replica, which would be held for a whole window."""
    pods = ("p0", "p1", "d0", "d1")
    # 45 running on each decode pod: a new request's step is 10 ms + 1 ms × 46, over the 50 ms SLO.
    signals, clock = pool_signals(
        {n: Metrics(running=45.0) if n[0] == "d" else Metrics() for n in pods},
        engine={"decode_step_base_ms": 10.0, "decode_ms_per_seq": 1.0},
    )
    signals.streams = LiveStreams(clock=clock)
    stream = Stream(first_at=clock.now - 2.0, events=100)  # 20 ms per token so far
    signals.streams.add(stream)
    calm, _ = signals._decode_state(clock.now)
    assert calm.load is not None and calm.load > 1.0  # the prediction
    assert calm.confirming_load == pytest.approx(0.4)  # the streams

    def desired(state: RoleState) -> int:  # with a forecast the admitted replicas meet
        recommender = Recommender(ScalingSettings(scale_down_window_s=0.0))
        return recommender.recommend(clock.now, "decode", state, 2 * state.capacity, 60.0).desired

    assert desired(calm) == 2
    stream.events = 30  # 67 ms per token: the streams show it too
    broken, _ = signals._decode_state(clock.now)
    assert broken.confirming_load is not None and broken.confirming_load > 1.0
    assert desired(broken) == 3


def test_the_prefill_load_is_predicted_for_the_recent_prompt_mix() -> None:
    """Prompts ten times longer: the prefill load is at once the TTFT of such a prompt (as the
    capacity is), not of the pool's slow average of whole prompts, which lags a change of mix by
    ~50 requests and counts the cached part."""
    signals, clock = pool_signals({n: Metrics() for n in ("p0", "p1", "d0", "d1")})
    signals.tick()
    for _ in range(12):  # 2 requests a second of 8,000 uncached tokens
        clock.now += 1.0
        for _ in range(2):
            signals.demand.arrived(8000.0)
        signals.tick()
    slo = signals.cost_model.objectives.ttft_slo_s
    pool, model = signals.pool, signals.cost_model

    def predicted(tokens: float | None) -> float:
        seconds = predicted_latency(pool, model, "prefill", 256, 16, clock.now, tokens)
        assert seconds is not None
        return seconds / slo

    assert signals.load("prefill") == pytest.approx(predicted(8000.0))
    assert signals.load("prefill") > 3 * predicted(None)  # the pool's average: the configured start


def test_the_prefill_load_observes_each_ttfts_prefill_part_not_its_wait_for_decode() -> None:
    """A P/D pair's first token also waits for a decode slot: with decode short of room the TTFT
    breaks the SLO while the prefill legs are quick. The prefill load reads the legs, as its
    prediction does, so no prefill replica is held (or its scale-down refused) for decode's
    shortage."""
    signals, clock = pool_signals({n: Metrics() for n in ("p0", "p1", "d0", "d1")})  # TTFT SLO 1 s
    for _ in range(20):
        signals.perf.observe_ttft(clock.now, 5.0, 0.1, prefill_seconds=0.2)
    assert signals.perf.ttft.p90(clock.now) == pytest.approx(5.0)
    assert signals.observed_latency("prefill", clock.now) == pytest.approx(0.2)
    load = signals.load("prefill")
    assert load is not None and load < 1.0
    # A pair whose leg the sidecar ran (behind Envoy) has no prefill part to count.
    counted = signals.perf.prefill_part.count
    for _ in range(20):
        signals.perf.observe_ttft(clock.now, 5.0, 0.1, prefill_seconds=None)
    assert signals.perf.prefill_part.count == counted
    # Prompts computed where their answers came from: the whole TTFT is the prefill part.
    for _ in range(20):
        signals.perf.observe_ttft(clock.now, 5.0, 0.1, prefill_seconds=5.0)
    load = signals.load("prefill")
    assert load is not None and load > 1.0


def test_decode_demand_counts_sequences_past_their_prefill_at_the_tpot_slo() -> None:
    signals, clock = pool_signals({n: Metrics() for n in ("p0", "p1", "d0", "d1")})
    pool = signals.pool
    d0, d1, p0 = (pool.endpoints[n].slot for n in ("d0", "d1", "p0"))
    for _ in range(6):  # six requests routed, all still queued for their prefill on p0
        pool.reserve(d0, p0, 1000.0, 1100.0)
    state, _ = signals._decode_state(clock.now)
    assert state.demand == 0.0  # none holds a decode slot yet
    # The decode pods report 10 running each: step 10 ms + 1 ms × 10 = 20 ms, SLO 50 ms.
    for name in ("d0", "d1"):
        pool.apply_metrics(pool.endpoints[name], Metrics(running=10.0), clock.now)
    state, _ = signals._decode_state(clock.now)
    base, per_seq, per_kv = signals.perf.decode.coefficients
    slo = signals.cost_model.objectives.tpot_slo_s
    d0_step, d1_step = base + per_seq * 10 + per_kv * 6 * 1100.0, base + per_seq * 10
    # Little's law at the SLO: each pod's 10 sequences × SLO / its step time.
    assert state.demand == pytest.approx(10 * slo / d0_step + 10 * slo / d1_step)
    assert state.demand > 20  # the pods are faster than the SLO: at it, more would be in flight
    # Overloaded pods (step time over the SLO) count fewer than they hold.
    for name in ("d0", "d1"):
        pool.apply_metrics(pool.endpoints[name], Metrics(running=1000.0), clock.now)
    assert signals._decode_state(clock.now)[0].demand < 2000
    assert d1 != d0


def test_the_rate_spans_more_requests_than_the_mix_and_capacity_uses_the_new_mix() -> None:
    signals, clock = pool_signals({n: Metrics() for n in ("p0", "p1", "d0", "d1")})
    signals.settings = ScalingSettings(
        level_window_s=10.0, trend_window_s=120.0, min_rate_requests=16, min_mix_requests=4
    )

    def arrive(prompt: float, max_tokens: int) -> tuple[float, float, float | None, float]:
        clock.now += 5.0
        signals.demand.arrived(prompt, max_tokens)
        d = signals.demand
        return signals._arrival_rate(clock.now, d.prefill_tokens, d.requests, d.max_tokens)

    for _ in range(60):  # one 500-token request asking for 100 tokens every 5 s for 5 min
        tokens, requests, per_request, answers = arrive(500.0, 100)
    # 10 s holds 2 requests: the rate spans 16 of them (80 s) instead.
    assert requests == pytest.approx(16 / 80.0) and tokens == pytest.approx(100.0)
    assert per_request == pytest.approx(500.0) and answers == pytest.approx(20.0)
    for _ in range(4):  # the same rate, prompts 10× longer and answers 3× longer
        tokens, requests, per_request, answers = arrive(5000.0, 300)
    # Four requests show the new mix; the rate still spans 16 (Poisson noise ≈ 1/√n).
    assert per_request == pytest.approx(5000.0)
    assert requests == pytest.approx(16 / 80.0)
    assert tokens == pytest.approx(16 / 80.0 * 5000.0) and answers == pytest.approx(16 / 80.0 * 300)
    assert signals.demand.typical_uncached < 2000.0  # a slow average would still say short prompts
    signals.prompt_mix = per_request  # as the tick sets it
    state, _ = signals._prefill_state(clock.now, 60.0, tokens)
    assert state.capacity == pytest.approx(prefill_capacity(signals.perf, 5000.0, 1.0, 0.85))


def test_the_backlog_is_spread_over_the_ready_time_when_that_is_longer() -> None:
    signals, clock = pool_signals({n: Metrics() for n in ("p0", "p1", "d0", "d1")})
    pool = signals.pool
    pool.reserve(pool.endpoints["d0"].slot, pool.endpoints["p0"].slot, 60000.0, 60000.0)
    short, _ = signals._prefill_state(clock.now, 10.0, 0.0)
    long, _ = signals._prefill_state(clock.now, 600.0, 0.0)
    assert short.demand == pytest.approx(60000.0 / 30.0)  # backlog_drain_s
    assert long.demand == pytest.approx(60000.0 / 600.0)  # a new replica helps only after 600 s


def test_a_rising_request_rate_raises_both_roles_forecast_a_longer_prompt_mix_does_not() -> None:
    signals, clock = pool_signals({n: Metrics() for n in ("p0", "p1", "d0", "d1")})
    signals.settings = ScalingSettings(scale_down_window_s=0.0, ready_time_s=60.0)
    signals.levels = {role: Level(signals.settings) for role in ("prefill", "decode")}
    for t in range(120):  # the same requests per second, prompts 10× longer half way
        clock.now += 1.0
        for _ in range(20):
            signals.demand.arrived(400.0 if t < 60 else 4000.0)
        steady = signals.tick()
    assert steady["prefill"].forecast == pytest.approx(steady["prefill"].demand, rel=0.05)
    signals, clock = pool_signals({n: Metrics() for n in ("p0", "p1", "d0", "d1")})
    for t in range(135):  # requests per second rising steadily
        clock.now += 1.0
        for _ in range(10 + t // 2):
            signals.demand.arrived(400.0)
        rising = signals.tick()
    assert rising["prefill"].forecast > 1.3 * rising["prefill"].demand


def test_a_flat_load_from_a_fresh_routers_first_tick_is_no_growth() -> None:
    """A fresh router's first rates are over less history than their span: they climb from zero
    under a flat load, which a trend of those rates extrapolated once its window filled (a third
    decode replica under a flat 0.5 req/s in the replay). The arrivals per tick do not climb."""
    signals, clock = pool_signals({n: Metrics() for n in ("p0", "p1", "d0", "d1")})
    growths = []
    for _ in range(140):  # a flat 20 requests per second from the first tick on
        clock.now += 1.0
        for _ in range(20):
            signals.demand.arrived(400.0)
        signals.tick()
        growths.append(signals.growth(60.0))
    assert growths == [1.0] * len(growths)


def test_long_answers_count_for_decode_from_the_first_request_not_once_they_pile_up() -> None:
    idle = {n: Metrics() for n in ("p0", "p1", "d0", "d1")}
    signals, clock = pool_signals(idle)
    signals.tick()  # where the rate starts
    # 3 requests/s asking for 2,000 answer tokens each; nothing is running yet.
    for _ in range(10):
        clock.now += 1.0
        for _ in range(3):
            signals.demand.arrived(100.0, 2000)
        latest = signals.tick()
    # Little's law on arrivals: 6,000 tokens/s at the 50 ms TPOT SLO = 300 sequences in flight,
    # where a replica turns over ~2,650 tokens/s (KV for 82 sequences, 31 ms steps): 3 replicas.
    assert latest["decode"].demand == pytest.approx(300.0, rel=0.05)
    assert latest["decode"].desired == 3 and latest["prefill"].desired == 1
    # Answers that stop at a tenth of max_tokens (EOS) teach the share, and the need shrinks.
    for _ in range(200):
        signals.pool.observe_answer(2000, 200)
    clock.now += 1.0
    assert signals.tick()["decode"].demand < 0.2 * 300.0


def test_a_change_of_prompt_mix_is_one_mix_per_forecast_not_a_jump_to_the_maximum() -> None:
    """After a burst of long prompts and a quiet gap, a burst of short prompts asking for long
    answers must not send prefill to max_replicas in one tick, as dividing the last 10 s of demand
    (the gap's ticks still reading the long prompts' rate) by the capacity for the short prompts
    would (an engine whose fixed step cost dwarfs an 80-token prompt serves few such tokens a
    second)."""
    signals, clock = pool_signals(
        {n: Metrics() for n in ("p0", "p1", "d0", "d1")}, engine={"decode_step_base_ms": 200.0}
    )
    signals.tick()
    for _ in range(150):  # long prompts, 2 a second for longer than the trend window
        clock.now += 1.0
        for _ in range(2):
            signals.demand.arrived(6000.0, 16)
        during = signals.tick()["prefill"].desired
    assert 1 < during < 64
    for _ in range(8):  # quiet
        clock.now += 1.0
        signals.tick()
    for _ in range(48):  # then short prompts asking for long answers, at once
        signals.demand.arrived(80.0, 400)
    for _ in range(15):
        clock.now += 1.0
        after = signals.tick()["prefill"]
        # Never more than the long prompts needed: the short ones need far less prefill.
        assert after.desired <= during, (after.desired, after.forecast, after.capacity)
    assert after.desired <= 2


def test_traffic_at_a_fresh_router_is_a_new_level_not_growth() -> None:
    """A step in the request rate, seen through the rate's 10 s smoothing, is a ramp; with less
    than a trend window of history it must not be extrapolated (it was, to max_growth)."""
    signals, clock = pool_signals({n: Metrics() for n in ("p0", "p1", "d0", "d1")})
    signals.tick()
    for _ in range(12):  # 4 requests a second from nothing, a short pause, 48 more at once
        clock.now += 1.0
        for _ in range(4):
            signals.demand.arrived(6000.0, 16)
        signals.tick()
    clock.now += 3.0
    for _ in range(48):
        signals.demand.arrived(80.0, 400)
    for _ in range(4):
        clock.now += 1.0
        signals.tick()
        assert signals.growth(60.0) == 1.0


def test_another_replica_s_arrivals_count_as_the_pool_s_demand() -> None:
    """With several router replicas each routes a share: the rates the others published (through
    ``SharedDemand``) are added, so every replica recommends for the whole pool."""
    from types import SimpleNamespace

    from router.signals.shared import Rates

    idle = {n: Metrics() for n in ("p0", "p1", "d0", "d1")}
    alone, clock = pool_signals(idle)
    shared, shared_clock = pool_signals(idle)
    # The other replica routes 40 requests/s of 4,000-token prompts asking for 2,000 tokens each.
    shared.shared = SimpleNamespace(others=Rates(160_000.0, 40.0, 80_000.0))  # type: ignore[assignment]
    alone.tick(), shared.tick()  # where the rates start
    for _ in range(10):
        clock.now += 1.0
        shared_clock.now += 1.0
        for signals in (alone, shared):
            signals.demand.arrived(400.0, 10)  # this replica's own share: 1 short request/s
        mine, pooled = alone.tick(), shared.tick()
    assert shared.own_rates.requests == pytest.approx(1.0, rel=0.05)  # what it publishes: its own
    assert pooled["prefill"].demand == pytest.approx(160_400.0, rel=0.05)
    assert pooled["prefill"].recommended > mine["prefill"].recommended == 1
    assert pooled["decode"].recommended > mine["decode"].recommended == 1
    # Capacity for the pool's prompt mix (mostly 4,000-token prompts), not for this replica's.
    pool_mix = prefill_capacity(shared.perf, 160_400.0 / 41.0, 1.0, shared.settings.max_utilization)
    assert pooled["prefill"].capacity == pytest.approx(pool_mix, rel=0.01)
    assert pooled["prefill"].capacity != pytest.approx(mine["prefill"].capacity, rel=0.05)
