"""The online performance model: fits recover known coefficients, impossible fits are rejected,
rare sizes are kept, the prior holds until samples exist, and the export says how far off we were."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.scheduling.costmodel.view import EngineModel
from router.server.compose import learn_settings_from
from router.server.config import parse_config
from router.signals.perf import (
    LearnSettings,
    PerformanceModel,
    SampleBuckets,
    fit_linear,
    fit_nonnegative,
    physical,
)

CONFIGURED = EngineModel(
    prefill_tokens_per_s=20000.0,
    decode_step_base_s=0.004,
    pd_leg_overhead_s=0.003,
    decode_s_per_seq=0.0002,
    decode_s_per_kv_token=2e-7,
    kv_bytes_per_token=131072,
)


def test_prefill_fit_recovers_a_pool_three_times_slower_than_configured() -> None:
    model = PerformanceModel(CONFIGURED, LearnSettings(perf_model=True))  # routes with the fit
    rng = np.random.default_rng(1)
    true_base, true_per_token = 0.006, 3.0 / 20000.0
    for _ in range(200):
        work = float(rng.integers(50, 8000))
        model.observe_prefill(work, (true_base + true_per_token * work) * rng.normal(1.0, 0.05))
    assert model.refit()
    base, per_token = model.prefill.coefficients
    assert per_token == pytest.approx(true_per_token, rel=0.05)
    assert 0 < base < 0.03  # 5 % noise on seconds-long samples hides a 6 ms base
    assert model.engine_model().prefill_tokens_per_s == pytest.approx(20000.0 / 3, rel=0.05)


def test_decode_fit_recovers_batch_and_kv_coefficients() -> None:
    model = PerformanceModel(CONFIGURED, LearnSettings(perf_model=True))
    rng = np.random.default_rng(2)
    true = np.array([0.003, 0.0005, 4e-7])
    for _ in range(300):
        batch = float(rng.integers(1, 64))
        kv = batch * float(rng.integers(200, 4000))
        step = float(true @ (1.0, batch, kv))
        model.observe_tpot(0.0, step * rng.normal(1.0, 0.03), step, batch, kv)
    model.refit()
    assert model.decode.fitted
    np.testing.assert_allclose(model.decode.coefficients, true, rtol=0.15)
    engine = model.engine_model()
    assert engine.decode_s_per_seq == pytest.approx(true[1], rel=0.15)
    assert engine.pd_leg_overhead_s == CONFIGURED.pd_leg_overhead_s  # not learned: kept


def test_a_slope_the_samples_cannot_tell_apart_is_held_at_zero_and_the_other_carries_it() -> None:
    # Every context 2k tokens: the KV held is the batch × 2000, and a prior three times too high
    # per sequence and per KV token pulled the free fit to a negative cost per KV token (refused:
    # the configured shape stood in, three times too slow per sequence).
    configured = replace(
        CONFIGURED, decode_step_base_s=0.0025, decode_s_per_seq=0.0045, decode_s_per_kv_token=1.5e-7
    )
    model = PerformanceModel(configured, LearnSettings(min_samples=8))
    rng = np.random.default_rng(4)
    true = np.array([0.005, 0.0015, 5e-8])
    for _ in range(60):
        batch = float(rng.uniform(1, 9))
        kv = batch * 2000 * rng.normal(1.0, 0.01)
        step = float(true @ (1.0, batch, kv))
        model.observe_tpot(0.0, step * rng.normal(1.0, 0.05), step, batch, kv)
    assert model.refit()
    assert model.decode.accepted == 1 and model.decode.scaled == 0
    base, per_seq, per_kv = model.decode.coefficients
    assert per_kv == 0.0 and per_seq == pytest.approx(true[1] + 2000 * true[2], rel=0.1)
    assert base == pytest.approx(true[0], rel=0.15)
    # One slope alone is never held at zero: fit_nonnegative returns it as the samples say.
    x = np.c_[np.ones(5), np.arange(5.0)]
    assert fit_nonnegative(x, 1.0 - 0.1 * x[:, 1], np.array([1.0, 0.1]), 0.0)[1] < 0


def test_a_fit_with_a_negative_slope_is_rejected_and_the_scaled_prior_stands_in() -> None:
    model = PerformanceModel(CONFIGURED, LearnSettings(min_samples=8, prior_samples=0.0))
    prior = model.prefill.coefficients.copy()
    for work in range(100, 3000, 100):  # bigger prompts faster: nothing physical does that
        model.observe_prefill(float(work), 0.5 - work * 1e-4)
    assert model.refit()
    assert model.prefill.rejected == 1 and model.prefill.last_rejection == "negative slope"
    assert model.prefill.scaled == 1 and model.prefill.accepted == 0
    # The configured shape, scaled: never a negative slope in the picker's hands.
    factor = model.prefill.coefficients / prior
    assert factor[0] == pytest.approx(factor[1]) and factor[0] > 0
    assert physical(np.array([0.0, 1e-5])) == "non-positive base"
    assert physical(np.array([0.01, np.nan])) == "not finite"


def test_noisy_decode_samples_still_learn_that_the_engines_are_three_times_slower() -> None:
    model = PerformanceModel(CONFIGURED, LearnSettings(min_samples=8))
    rng = np.random.default_rng(5)
    prior = model.decode.coefficients.copy()
    for _ in range(60):  # one batch size and context: the shape is not identifiable, the scale is
        batch, kv = 4.0, 4000.0
        step = 3.0 * float(prior @ (1.0, batch, kv)) * rng.lognormal(0.0, 0.3)
        model.observe_tpot(0.0, step, 0.0, batch, kv)
    model.refit()
    predicted = float(model.decode.coefficients @ (1.0, 4.0, 4000.0))
    assert predicted == pytest.approx(3.0 * float(prior @ (1.0, 4.0, 4000.0)), rel=0.15)


def test_the_prior_holds_until_enough_samples_and_when_learning_is_off() -> None:
    model = PerformanceModel(CONFIGURED, LearnSettings(perf_model=True, min_samples=16))
    for work in range(10):
        model.observe_prefill(100.0 + 500 * work, 1.0)
    assert not model.refit() and not model.prefill.fitted
    assert model.engine_model() == CONFIGURED
    frozen = PerformanceModel(CONFIGURED, LearnSettings(perf_model=False, min_samples=2))
    for work in range(40):
        frozen.observe_prefill(100.0 + 500 * work, 0.01 + 0.001 * work)
    frozen.refit()
    assert frozen.prefill.fitted and frozen.engine_model() == CONFIGURED


def test_each_learned_correction_has_its_own_switch_and_learn_false_turns_all_off() -> None:
    def parts(**signals: bool) -> dict[str, bool]:
        config = parse_config({"model": "m", "endpoints": [{"address": "10.0.0.1:8000"}], "signals": signals})
        learn = learn_settings_from(config)
        names = ("perf_model", "engine_speed", "token_ratio", "cached_evidence")
        return {name: getattr(learn, name) for name in names}

    # Off by default (none beat the configured model on the routing benchmarks); learn: true
    # turns on each part its own switch leaves on.
    assert parts() == dict.fromkeys(parts(), False)
    assert parts(learn=True) == dict.fromkeys(parts(), True)
    assert parts(learn=False, learn_token_ratio=True) == dict.fromkeys(parts(), False)
    for name in parts():
        assert parts(learn=True, **{f"learn_{name}": False}) == {other: other != name for other in parts()}


def test_a_few_samples_move_the_fit_a_little_many_move_it_all_the_way() -> None:
    true_per_token = 4.0 / 20000.0

    def fitted_after(n: int) -> float:
        model = PerformanceModel(CONFIGURED, LearnSettings(min_samples=2, prior_samples=4.0))
        for work in np.linspace(100, 6000, n):
            model.observe_prefill(float(work), 0.004 + true_per_token * float(work))
        model.refit()
        return float(model.prefill.coefficients[1])

    few, many = fitted_after(4), fitted_after(400)
    assert 1.0 / 20000.0 < few < many
    assert many == pytest.approx(true_per_token, rel=0.05)


def test_buckets_keep_rare_long_prompts_through_a_flood_of_short_ones() -> None:
    buckets = SampleBuckets(2, 2.0 ** np.arange(7, 18), per_bucket=8)
    buckets.add(30000.0, (1.0, 30000.0), 2.0)
    for _ in range(1000):
        buckets.add(200.0, (1.0, 200.0), 0.01)
    x, y = buckets.arrays()
    assert len(buckets) == 9 == len(y)
    assert 30000.0 in x[:, 1] and 2.0 in y


def test_fit_leaves_a_direction_without_samples_at_the_prior() -> None:
    prior = np.array([0.004, 0.0002, 2e-7])
    x = np.array([[1.0, 8.0, 8000.0]] * 50)  # one batch size, one context: per_seq and per_kv unidentified
    y = x @ np.array([0.004, 0.0002, 6e-7])
    fitted = fit_linear(x, y, prior, 1.0)
    assert np.isfinite(fitted).all() and (fitted > 0).all()
    assert float(x[0] @ fitted) == pytest.approx(float(y[0]), rel=0.02)


def test_export_names_coefficients_fits_errors_and_prediction_ratios() -> None:
    model = PerformanceModel(CONFIGURED, LearnSettings(min_samples=4, prior_samples=0.0))
    for work in (200.0, 800.0, 3000.0, 6000.0, 12000.0):
        model.observe_prefill(work, 0.004 + work / 10000.0)
    model.observe_ttft(0.0, 0.3, 0.1, 0.3)  # three times slower than predicted
    model.observe_tpot(0.0, 0.02, 0.02, 4.0, 4000.0)
    model.refit()

    class Collect:
        def describe(self) -> list:
            return []

        def collect(self):  # type: ignore[no-untyped-def]
            return model.collect()

    registry = CollectorRegistry()
    registry.register(Collect())
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    coefficient = {
        (s.labels["role"], s.labels["term"]): s.value
        for s in families["pd_router_perf_model_coefficient"].samples
    }
    assert coefficient[("prefill", "seconds_per_token")] == pytest.approx(1e-4, rel=0.05)
    assert set(coefficient) >= {("decode", "seconds_per_seq"), ("decode", "seconds_per_kv_token")}
    fits = {
        (s.labels["role"], s.labels["result"]): s.value for s in families["pd_router_perf_model_fits"].samples
    }
    assert fits[("prefill", "accepted")] == 1.0
    ratio = families["pd_router_prediction_ratio"]
    assert ratio.type == "histogram"
    buckets = {
        (s.labels["measure"], s.labels["le"]): s.value for s in ratio.samples if s.name.endswith("_bucket")
    }
    assert buckets[("ttft", "2.0")] == 0.0 and buckets[("ttft", "4.0")] == 1.0
    assert buckets[("tpot", "1.1")] == 1.0
    assert families["pd_router_perf_model_error"].samples[0].value < 0.05
