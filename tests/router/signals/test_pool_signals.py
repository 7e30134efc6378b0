"""Pool saturation and load per stage, and the drop-in pool gauges, from the pool's arrays."""

from __future__ import annotations

import math

import pytest
from helpers import PD_TWO_RACKS, SINGLE_PODS, Metrics, make_config, make_pool
from prometheus_client import CollectorRegistry, generate_latest

from router.signals.saturation import SaturationSettings, SignalsCollector, stage_signals

NOW = 100.0
S = SaturationSettings(queue_threshold=5.0, kv_threshold=0.8)


def pd_pool(**metrics):
    config = make_config(PD_TWO_RACKS)
    pool = make_pool(config, metrics, NOW)
    pool.stale_after_s = 1e9
    return pool


def test_each_stage_scores_its_own_pods_and_effective_is_the_worst() -> None:
    pool = pd_pool(
        p0=Metrics(waiting=5, kv_usage=0.1),  # queue-saturated: 1.0
        p1=Metrics(waiting=0, kv_usage=0.4),  # 0.5
        d0=Metrics(waiting=0, kv_usage=0.8),  # KV-saturated: 1.0
        d1=Metrics(waiting=10, kv_usage=0.0),  # 2.0: not clamped
    )
    prefill, decode = stage_signals(pool, "prefill", S, NOW), stage_signals(pool, "decode", S, NOW)
    assert prefill.saturation == pytest.approx(0.75) and decode.saturation == pytest.approx(1.5)
    assert prefill.waiting == 5 and decode.waiting == 10
    assert decode.kv_max == pytest.approx(0.8) and decode.kv_mean == pytest.approx(0.4)
    assert decode.kv_stddev == pytest.approx(math.sqrt(2 * 0.4**2))  # sample std-dev (n - 1)


def test_a_stale_or_unknown_endpoint_counts_as_saturated_and_an_empty_stage_too() -> None:
    pool = pd_pool(d0=Metrics(waiting=None, kv_usage=None))  # unknown: fails closed
    assert stage_signals(pool, "decode", S, NOW).saturation == pytest.approx(0.5)
    pool.stale_after_s = 1.0
    assert stage_signals(pool, "decode", S, NOW + 10).saturation == pytest.approx(1.0)  # all stale
    pool.admitted[:] = False
    empty = stage_signals(pool, "prefill", S, NOW)
    assert empty.endpoints == 0 and empty.saturation == 1.0


def test_a_prefill_decode_pod_counts_in_both_stages_and_queued_tokens_are_ours_or_scraped() -> None:
    config = make_config(SINGLE_PODS)
    pool = make_pool(config, {"e0": Metrics(waiting=2)}, NOW)
    pool.stale_after_s = 1e9
    pool.queued_prefill_tokens[pool.endpoints["e1"].slot] = 3000.0
    for stage in ("prefill", "decode"):
        signals = stage_signals(pool, stage, S, NOW)
        assert signals.endpoints == 3
        assert signals.queued_prompt_tokens == pytest.approx(2 * pool.typical_prompt_tokens + 3000.0)


def test_our_own_queued_requests_in_the_scraped_queue_are_not_counted_again() -> None:
    # e0's scrape shows 3 waiting, 2 of them ours with mostly cached prompts (500 uncached tokens
    # between them): the signal is the one request from elsewhere at the typical size, as the
    # picker's queue term prices it, not 3 whole prompts.
    config = make_config(SINGLE_PODS)
    pool = make_pool(config, {"e0": Metrics(waiting=3)}, NOW)
    pool.stale_after_s = 1e9
    slot = pool.endpoints["e0"].slot
    pool.queued_prefill_tokens[slot] = 500.0
    pool.waiting_ours[slot] = 2.0
    signals = stage_signals(pool, "prefill", S, NOW)
    assert signals.queued_prompt_tokens == pytest.approx(pool.typical_prompt_tokens)
    assert signals.waiting == 3  # the scraped count itself is still exported as scraped


def test_the_exposition_has_both_families_with_their_labels() -> None:
    pool = pd_pool(p0=Metrics(waiting=4, kv_usage=0.5, running=3))
    registry = CollectorRegistry()
    registry.register(SignalsCollector(pool, "qwen"))
    text = generate_latest(registry).decode()
    for family in (
        "llm_d_epp_flow_control_pool_saturation",
        "inference_extension_flow_control_pool_saturation",
    ):
        for stage in ("prefill", "decode", "effective"):
            assert f'{family}{{inference_pool="qwen",stage="{stage}"}}' in text
    assert (
        'llm_d_epp_ready_endpoints{name="qwen"} 4.0' in text
        and 'inference_pool_ready_pods{name="qwen"} 4.0' in text
    )
    assert 'llm_d_epp_average_queue_size{name="qwen"} 1.0' in text
    assert 'inference_pool_average_queue_size{name="qwen"} 1.0' in text
    assert 'llm_d_epp_average_running_requests{name="qwen"} 0.75' in text
    assert 'llm_d_epp_std_dev_queue_size{name="qwen"} 2.0' in text
    assert 'llm_d_epp_per_endpoint_queue_size{model_server_endpoint="p0",name="qwen"} 4.0' in text
    assert 'inference_pool_per_pod_queue_size{model_server_pod="p0",name="qwen"} 4.0' in text
    assert 'pd_router_pool_kv_usage{role="prefill",stat="max"} 0.5' in text


def test_predicted_latency_follows_the_queue_and_the_batch() -> None:
    from helpers import make_picker

    from router.signals.saturation import predicted_latency

    config = make_config(PD_TWO_RACKS, slo={"ttft_ms": 500, "tpot_ms": 50})
    idle = make_pool(config, {}, NOW)
    busy = make_pool(config, {n: Metrics(waiting=20, running=60) for n in ("p0", "p1", "d0", "d1")}, NOW)
    for pool in (idle, busy):
        pool.stale_after_s = 1e9
    cm = make_picker(config, idle).cost_model
    ttft = [predicted_latency(p, cm, "prefill", 256, 16, NOW) for p in (idle, busy)]
    tpot = [predicted_latency(p, cm, "decode", 256, 16, NOW) for p in (idle, busy)]
    assert 0 < ttft[0] < ttft[1] and 0 < tpot[0] < tpot[1]
    # Decode pods that compute prompts half their time (local prefills) decode at half speed.
    for name in ("d0", "d1"):
        busy.prefill_rate[busy.endpoints[name].slot] = config.engine.prefill_tokens_per_s / 2
    assert predicted_latency(busy, cm, "decode", 256, 16, NOW) == pytest.approx(2 * tpot[1])
    busy.prefill_rate[:] = 0.0
    # One prefill pod free again: the best candidate sets the pool's predicted TTFT.
    busy.waiting[busy.endpoints["p1"].slot] = 0
    assert predicted_latency(busy, cm, "prefill", 256, 16, NOW) == pytest.approx(ttft[0])
    registry = CollectorRegistry()
    registry.register(SignalsCollector(busy, "qwen", lambda: cm))
    text = generate_latest(registry).decode()
    assert f'pd_router_pool_predicted_seconds{{measure="ttft",role="prefill"}} {ttft[0]}' in text
    assert 'pd_router_pool_predicted_seconds{measure="tpot",role="decode"}' in text
    # Given the recent mix's prompt (as the prefill load is predicted), the export prices it.
    long = predicted_latency(busy, cm, "prefill", 256, 16, NOW, 8000.0)
    assert long is not None and long > ttft[0]
    mixed = CollectorRegistry()
    mixed.register(SignalsCollector(busy, "qwen", lambda: cm, prompt_tokens=lambda: 8000.0))
    assert (
        f'pd_router_pool_predicted_seconds{{measure="ttft",role="prefill"}} {long}'
        in generate_latest(mixed).decode()
    )
    busy.admitted[:] = False  # no candidate: unknown, not zero
    text = generate_latest(registry).decode()
    assert "pd_router_pool_predicted_seconds{" not in text
