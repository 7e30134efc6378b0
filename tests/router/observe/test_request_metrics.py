"""The drop-in request series (llm-d's and the Inference Extension's names), through the proxy."""

from __future__ import annotations

import aiohttp
from helpers import eventually, router_on_sim
from prometheus_client import CollectorRegistry

from router.observe.metrics import MAX_MODEL_LABELS, MAX_PRIORITY_LABELS, RequestMetrics
from simulator.engine import EngineSpec


def sample(app, name: str, **labels: str) -> float:
    value = app.parts.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_requests_are_counted_under_both_families_with_ttft_and_errors() -> None:
    specs = [EngineSpec("e0", "prefill-decode")]
    async with router_on_sim(specs) as (_, app, base), aiohttp.ClientSession() as http:
        headers = {"x-llm-d-inference-fairness-id": "team-a"}
        for stream in (False, False, True):
            body = {"model": "sim-model", "prompt": "hi " * 20, "max_tokens": 4, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            async with http.post(f"{base}/v1/completions", json=body, headers=headers) as resp:
                assert resp.status == 200
                await resp.read()
        async with http.post(f"{base}/v1/completions", data=b"{not json", headers=headers) as resp:
            assert resp.status == 400
        llm_d = {
            "model_name": "sim-model",
            "target_model_name": "sim-model",
            "fairness_id": "team-a",
            "priority": "0",
        }
        await eventually(lambda: sample(app, "llm_d_epp_request_total", **llm_d) == 3, 5, "counted")
        gie = {"model_name": "sim-model", "target_model_name": "sim-model", "priority": "0"}
        assert sample(app, "inference_objective_request_total", **gie) == 3
        assert sample(app, "llm_d_epp_request_running", **llm_d) == 0
        assert sample(app, "inference_objective_running_requests", model_name="sim-model") == 0
        assert sample(app, "llm_d_epp_request_ttft_seconds_count", **llm_d, streaming="false") == 2
        assert sample(app, "llm_d_epp_request_ttft_seconds_count", **llm_d, streaming="true") == 1
        assert sample(app, "llm_d_epp_request_duration_seconds_count", **llm_d) == 3
        # What the answers reported: usage from two JSON bodies and one streamed usage chunk.
        model = {"model_name": "sim-model", "target_model_name": "sim-model"}
        for ours, theirs in (
            ("input_tokens", "input_tokens"),
            ("output_tokens", "output_tokens"),
            ("cached_tokens", "prompt_cached_tokens"),
        ):
            assert sample(app, f"llm_d_epp_request_{ours}_count", **llm_d) == 3
            assert sample(app, f"inference_objective_{theirs}_count", **model) == 3
        assert sample(app, "llm_d_epp_request_output_tokens_sum", **llm_d) == 12
        assert sample(app, "llm_d_epp_request_ntpot_seconds_count", **llm_d) == 3
        assert sample(app, "inference_objective_normalized_time_per_output_token_seconds_count", **model) == 3
        assert sample(app, "llm_d_epp_request_streaming_tpot_seconds_count", **llm_d) == 1
        assert sample(app, "inference_objective_request_tpot_seconds_count", **model) == 1
        bad = {
            "model_name": "unknown",
            "target_model_name": "unknown",
            "fairness_id": "team-a",
            "priority": "0",
        }
        assert sample(app, "llm_d_epp_request_error_total", **bad, error_code="bad_request") == 1
        assert (
            sample(
                app,
                "inference_objective_request_error_total",
                model_name="unknown",
                target_model_name="unknown",
                error_code="bad_request",
            )
            == 1
        )


def test_label_values_are_capped() -> None:
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry)
    for i in range(MAX_MODEL_LABELS):
        metrics.bind(f"m{i}", f"f{i}", i % MAX_PRIORITY_LABELS, False)
    overflow = metrics.bind("one-more", "and-another", 0, False)
    assert overflow is metrics.bind("other", "other", 0, False)  # new values fold into "other"
    assert metrics.bind("m3", "f3", 3, False) is metrics.bind("m3", "f3", 3, False)  # bound once
    # Clients choose the priority: past the cap a new one is "other", errors included.
    flood = metrics.bind("m1", "f1", 10_000, False)
    assert flood.labels == ("m1", "m1", "f1", "other")
    metrics.error(flood, "no_capacity")
    labels = {"model_name": "m1", "target_model_name": "m1", "fairness_id": "f1", "priority": "other"}
    assert (
        registry.get_sample_value("llm_d_epp_request_error_total", {**labels, "error_code": "no_capacity"})
        == 1
    )
