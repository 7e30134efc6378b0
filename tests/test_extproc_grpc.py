"""The ext_proc gRPC server itself: health names, readiness, garbage on the wire."""

from __future__ import annotations

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import router_for

from loadtests.simengine import EngineSpec, SimCluster, TimeModel

pytestmark = pytest.mark.integration
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NAMES = ["liveness", "readiness", "", "inference-extension", "envoy.service.ext_proc.v3.ExternalProcessor"]


async def test_health_answers_every_name_on_both_ports_and_readiness_follows_the_app() -> None:
    async with SimCluster([EngineSpec("e0", "prefill-decode", time=TimeModel(speed=20))]) as cluster:
        extproc = {"enabled": True, "port": 0, "health_port": 0}
        data = {
            "endpoints": [{"address": cluster.address("e0")}],
            "proxy": {"enabled": False},
            "extproc": extproc,
        }
        async with router_for(data) as (app, _):
            for port in (app.health_port, app.extproc_port):
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = health_pb2_grpc.HealthStub(channel)
                    for name in NAMES:
                        answer = await stub.Check(health_pb2.HealthCheckRequest(service=name))
                        assert answer.status == SERVING, name
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.Check(health_pb2.HealthCheckRequest(service="something-else"))
                    assert err.value.code() == grpc.StatusCode.NOT_FOUND
            await app.health.set_ready(False)  # what stop() does first
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.health_port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                assert (
                    await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
                ).status == NOT_SERVING
                assert (await stub.Check(health_pb2.HealthCheckRequest(service="liveness"))).status == SERVING


async def test_garbage_on_the_stream_is_a_grpc_error_and_the_server_keeps_serving() -> None:
    async with SimCluster([EngineSpec("e0", "prefill-decode", time=TimeModel(speed=20))]) as cluster:
        extproc = {"enabled": True, "port": 0, "health_port": 0}
        data = {
            "endpoints": [{"address": cluster.address("e0")}],
            "proxy": {"enabled": False},
            "extproc": extproc,
        }
        async with (
            router_for(data) as (app, _),
            grpc.aio.insecure_channel(f"127.0.0.1:{app.extproc_port}") as channel,
        ):
            raw = channel.stream_stream(
                "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                request_serializer=lambda b: b,
                response_deserializer=pb.ProcessingResponse.FromString,
            )
            call = raw(iter([b"\xff\xff\xff not a protobuf"]))
            with pytest.raises(grpc.aio.AioRpcError):
                async for _ in call:
                    pass
            # A well-formed stream right after is routed normally.
            stub = pb_grpc.ExternalProcessorStub(channel)
            body = orjson.dumps({"model": "sim-model", "prompt": "hi " * 20})
            messages = [
                pb.ProcessingRequest(request_headers=pb.HttpHeaders()),
                pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
            ]
            responses = [r async for r in stub.Process(iter(messages))]
            assert responses[0].HasField("request_headers")
            assert app.pool.outstanding in (0, 1)


async def test_metrics_listener_serves_the_router_metrics() -> None:
    import aiohttp

    async with SimCluster([EngineSpec("e0", "prefill-decode", time=TimeModel(speed=20))]) as cluster:
        data = {
            "endpoints": [{"address": cluster.address("e0")}],
            "proxy": {"enabled": False},
            "metrics": {"enabled": True, "port": 0},
        }
        async with router_for(data) as (app, _), aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{app.metrics_port}/metrics") as resp:
                text = await resp.text()
            assert 'llm_d_epp_ready_endpoints{name="pd-router"} 1.0' in text
            assert "pd_router_outstanding_reservations 0.0" in text
