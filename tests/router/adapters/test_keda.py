"""KEDA's external scaler over grpcio (KEDA's own client is gRPC too), in front of simulated engines."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import pytest
from helpers import (
    PD_TWO_RACKS,
    eventually,
    make_config,
    make_picker,
    make_pool,
    router_for,
    router_on_sim,
)

from router.adapters.keda import externalscaler_pb2 as pb
from router.adapters.keda.generate import MODULE, generated
from router.adapters.keda.scaler import SIGNALS, BadMetadata, ScalerSignals, selection_of
from router.signals.perf import PerformanceModel
from router.signals.scaling import PoolSignals
from simulator.engine import EngineSpec

SERVICE = "/externalscaler.ExternalScaler/"


def rpc(channel: grpc.aio.Channel, method: str, response: type):
    return channel.unary_unary(
        SERVICE + method,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=response.FromString,
    )


def ref(**metadata: str) -> pb.ScaledObjectRef:
    return pb.ScaledObjectRef(name="decode", namespace="llm", scalerMetadata=metadata)


async def test_the_scaler_answers_keda_per_role_and_signal() -> None:
    specs = [EngineSpec("p0", "prefill"), EngineSpec("d0", "decode")]
    async with (
        router_on_sim(specs, {"keda": {"enabled": True, "port": 0}, "signals": {"tick_ms": 50}}) as (
            _,
            app,
            _base,
        ),
        grpc.aio.insecure_channel(f"127.0.0.1:{app.keda.port}") as channel,
    ):
        spec = await rpc(channel, "GetMetricSpec", pb.GetMetricSpecResponse)(
            ref(role="decode", signal="load", target="0.8")
        )
        (metric,) = spec.metricSpecs
        assert (metric.metricName, metric.targetSizeFloat) == ("decode-load", 0.8)
        assert metric.targetSize == 1  # what KEDA 2.16 and older read (the float fields came in 2.17)
        metrics = rpc(channel, "GetMetrics", pb.GetMetricsResponse)
        request = pb.GetMetricsRequest(
            scaledObjectRef=ref(role="decode", signal="load"), metricName="decode-load"
        )
        (value,) = (await metrics(request)).metricValues
        assert value.metricName == "decode-load" and 0 < value.metricValueFloat < 1  # an idle pool
        assert value.metricValue == 1  # rounded up for KEDA ≤ 2.16
        # Queue up prompts on the prefill pod: its signal moves, the decode pod's does not.
        app.parts.pool.queued_prefill_tokens[app.parts.pool.endpoints["p0"].slot] = 50_000.0
        prefill = pb.GetMetricsRequest(scaledObjectRef=ref(role="prefill", signal="queuedPromptTokens"))
        queued = (await metrics(prefill)).metricValues[0]
        assert queued.metricValueFloat == 50_000.0 and queued.metricValue == 50_000
        decode = pb.GetMetricsRequest(scaledObjectRef=ref(role="decode", signal="queuedPromptTokens"))
        assert (await metrics(decode)).metricValues[0].metricValueFloat == 0.0
        active = rpc(channel, "IsActive", pb.IsActiveResponse)
        assert (await active(ref(role="prefill", signal="queuedPromptTokens", activation="1000"))).result
        assert not (await active(ref(role="decode", signal="queuedPromptTokens", activation="1000"))).result
        # external-push: the current activity at once, then the change.
        stream = channel.unary_stream(
            SERVICE + "StreamIsActive",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.IsActiveResponse.FromString,
        )(ref(role="prefill", signal="queuedPromptTokens", activation="1000"))
        assert (await stream.read()).result is True
        app.parts.pool.queued_prefill_tokens[app.parts.pool.endpoints["p0"].slot] = 0.0
        assert (await stream.read()).result is False
        stream.cancel()
        # The recommendation per role, as the signals tick computed it (the queued prompts above
        # made the prefill backlog something one replica cannot drain in time).
        app.parts.pool.queued_prefill_tokens[app.parts.pool.endpoints["p0"].slot] = 5_000_000.0
        await eventually(
            lambda: app.parts.scaling.latest["prefill"].recommended > 1, 5.0, "a prefill scale-up"
        )
        for role in ("prefill", "decode"):
            request = pb.GetMetricsRequest(scaledObjectRef=ref(role=role, signal="recommendedReplicas"))
            (value,) = (await metrics(request)).metricValues
            assert value.metricValueFloat == app.parts.scaling.latest[role].recommended
        assert app.parts.scaling.latest["decode"].recommended == 1


@pytest.mark.parametrize("signal", SIGNALS)
def test_every_signal_reads_a_number_for_each_role(signal: str) -> None:
    config = make_config(PD_TWO_RACKS)
    pool = make_pool(config)
    picker = make_picker(config, pool)
    model = PerformanceModel(picker.cost_model.model)
    signals = ScalerSignals(pool, PoolSignals(pool, model, lambda: picker.cost_model, lambda _: None))
    assert selection_of({"role": "decode", "signal": signal}).signal == signal
    for role in ("prefill", "decode"):
        assert isinstance(signals.value(role, signal), float)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"signal": "load"}, "role must be one of"),
        ({"role": "decode", "signal": "vibes"}, "signal must be one of"),
        ({"role": "decode", "target": "lots"}, "target must be a number, got 'lots'"),
        ({"role": "decode", "target": "0"}, "target must be between 0.001"),
        ({"role": "decode", "target": "inf"}, "target must be a finite number, got 'inf'"),
        ({"role": "decode", "target": "0.0001"}, "got '0.0001'"),
    ],
)
async def test_bad_metadata_is_invalid_argument_naming_the_key(
    metadata: dict[str, str], message: str
) -> None:
    async with (
        router_on_sim([EngineSpec("e0", "prefill-decode")], {"keda": {"enabled": True, "port": 0}}) as (
            _,
            app,
            _b,
        ),
        grpc.aio.insecure_channel(f"127.0.0.1:{app.keda.port}") as channel,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rpc(channel, "GetMetricSpec", pb.GetMetricSpecResponse)(ref(**metadata))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rpc(channel, "StreamMetricSpec", pb.GetMetricSpecResponse)(ref(role="decode"))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED  # KEDA then polls GetMetricSpec


def test_the_generated_messages_match_the_proto() -> None:
    # Regenerates from proto/externalscaler.proto; a stale module fails here, not in a cluster.
    assert MODULE.read_text() == generated(), "run: python -m router.adapters.keda.generate"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("target", "inf"),
        ("target", "-Infinity"),
        ("target", "1e999"),
        ("target", "nan"),
        ("target", "-1"),
        ("target", "0.0004"),  # KEDA keeps thousandths: this would be a target of 0
        ("target", "1e17"),  # past an int64 of thousandths
        ("activation", "inf"),
        ("activation", "nan"),
        ("activation", "x"),
    ],
)
def test_a_target_or_activation_keda_cannot_use_is_refused_naming_key_and_value(key: str, value: str) -> None:
    with pytest.raises(BadMetadata) as err:
        selection_of({"role": "decode", key: value})
    assert f"metadata {key} must" in str(err.value) and repr(value) in str(err.value)


def test_the_smallest_and_largest_targets_keda_can_hold_are_accepted() -> None:
    assert selection_of({"role": "decode", "target": "0.001"}).target == 0.001
    assert selection_of({"role": "prefill", "target": "9e15", "activation": "-0.5"}).activation == -0.5


def stream_is_active(channel: grpc.aio.Channel, **metadata: str):
    return channel.unary_stream(
        SERVICE + "StreamIsActive",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=pb.IsActiveResponse.FromString,
    )(ref(**metadata))


ZERO = {
    "keda": {"enabled": True, "port": 0},
    "signals": {
        "tick_ms": 50,
        "min_replicas": {"prefill": 0, "decode": 0},
        "scale_down_window_s": 1.0,
        "level_window_s": 1.0,
        "trend_window_s": 4.0,
    },
}


@pytest.mark.integration
async def test_recommended_replicas_scale_a_role_to_zero_and_its_first_request_wakes_it() -> None:
    """The documented scale-to-zero trigger: ``recommendedReplicas`` with activation 0 over
    ``external-push``. Idle, every role is inactive; one request makes both active at once."""
    specs = [EngineSpec("p0", "prefill"), EngineSpec("d0", "decode")]
    async with (
        router_on_sim(specs, ZERO) as (_, app, base),
        grpc.aio.insecure_channel(f"127.0.0.1:{app.keda.port}") as channel,
    ):
        streams = {
            role: stream_is_active(channel, role=role, signal="recommendedReplicas", activation="0")
            for role in ("prefill", "decode")
        }

        async def inactive(stream: object) -> None:
            while (await stream.read()).result:  # type: ignore[attr-defined]
                pass

        for role, stream in streams.items():  # a fresh router holds what runs for one window
            await asyncio.wait_for(inactive(stream), 10.0)
            assert app.parts.scaling.latest[role].recommended == 0
        async with aiohttp.ClientSession() as http:
            body = {"model": "sim-model", "prompt": "wake up " * 100, "max_tokens": 8}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 200
        for stream in streams.values():
            assert (await asyncio.wait_for(stream.read(), 10.0)).result is True
            stream.cancel()


@pytest.mark.integration
async def test_a_pool_at_zero_replicas_wakes_on_the_request_it_could_not_serve() -> None:
    """No admitted endpoint (the workloads are at zero): the request is refused (503), and it
    still counts as demand, so the recommendation leaves zero and KEDA scales the pool up."""
    sections = {**ZERO, "endpoints": [{"address": "127.0.0.1:9", "role": "prefill-decode", "name": "gone"}]}
    async with router_for(sections) as (app, base):
        await eventually(
            lambda: (
                app.parts.scaling.latest.get("decode") is not None
                and app.parts.scaling.latest["decode"].recommended == 0
            ),
            10.0,
            "an idle pool at zero",
        )
        async with aiohttp.ClientSession() as http:
            body = {"model": "sim-model", "prompt": "anyone there? " * 50, "max_tokens": 64}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 503
        await eventually(
            lambda: all(app.parts.scaling.latest[role].recommended >= 1 for role in ("prefill", "decode")),
            5.0,
            "both roles asked for",
        )
