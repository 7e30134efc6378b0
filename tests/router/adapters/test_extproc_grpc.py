"""The ext_proc gRPC server itself: health names, readiness, garbage on the wire, the metrics port."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import eventually, router_for

from simulator.engine import EngineSpec, SimCluster, TimeModel

pytestmark = pytest.mark.integration
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NAMES = ["liveness", "readiness", "", "inference-extension", "envoy.service.ext_proc.v3.ExternalProcessor"]


@contextlib.asynccontextmanager
async def extproc_app(**sections: Any) -> AsyncIterator[Any]:
    """One simulated engine and an App serving ext_proc (plus whatever ``sections`` add)."""
    async with SimCluster([EngineSpec("e0", "prefill-decode", time=TimeModel(speed=20))]) as cluster:
        data = {
            "endpoints": [{"address": cluster.address("e0")}],
            "proxy": {"enabled": False},
            "extproc": {"enabled": True, "port": 0, "health_port": 0},
            **sections,
        }
        async with router_for(data) as (app, _):
            yield app


async def status(port: int, name: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return (
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name))
        ).status


async def test_health_answers_every_name_on_both_ports_and_readiness_follows_the_app() -> None:
    async with extproc_app() as app:
        for port in (app.health_port, app.extproc_port):
            for name in NAMES:
                assert await status(port, name) == SERVING, name
            # As the Inference Extension's picker: an answer, not an error.
            assert await status(port, "something-else") == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                listed = await channel.unary_unary(
                    "/grpc.health.v1.Health/List",
                    request_serializer=lambda m: m.SerializeToString(),
                    response_deserializer=health_pb2.HealthListResponse.FromString,
                )(health_pb2.HealthListRequest())
            assert {name: s.status for name, s in listed.statuses.items()} == {
                **dict.fromkeys(NAMES, SERVING),
                "liveness": SERVING,
            }
        app.parts.health.set_ready(False)  # what stop() does first
        assert await status(app.health_port, "readiness") == NOT_SERVING
        assert await status(app.health_port, "liveness") == SERVING


async def test_garbage_on_the_stream_is_a_grpc_error_and_the_server_keeps_serving() -> None:
    async with extproc_app() as app, grpc.aio.insecure_channel(f"127.0.0.1:{app.extproc_port}") as channel:
        raw = channel.stream_stream(
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            request_serializer=lambda b: b,
            response_deserializer=pb.ProcessingResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in raw(iter([b"\xff\xff\xff not a protobuf"])):
                pass
        # A well-formed stream right after is routed, and its reservation released when it ends.
        body = orjson.dumps({"model": "sim-model", "prompt": "hi " * 20})
        messages = [
            pb.ProcessingRequest(request_headers=pb.HttpHeaders()),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
        ]
        responses = [r async for r in pb_grpc.ExternalProcessorStub(channel).Process(iter(messages))]
        routing = responses[0].request_headers.response.header_mutation.set_headers
        assert [h.header.key for h in routing] == ["x-gateway-destination-endpoint"]
        await eventually(lambda: app.parts.pool.outstanding == 0, what="release at stream end")


async def test_metrics_listener_serves_the_router_metrics() -> None:
    async with extproc_app(metrics={"enabled": True, "port": 0}) as app, aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{app.metrics_port}/metrics") as resp:
            text = await resp.text()
        assert 'llm_d_epp_ready_endpoints{name="pd-router"} 1.0' in text
        assert "pd_router_outstanding_reservations 0.0" in text


async def test_ext_proc_over_tls_with_a_self_signed_certificate_and_health_in_the_clear() -> None:
    extproc = {"enabled": True, "port": 0, "health_port": 0, "tls": {"enabled": True, "min_version": "1.3"}}
    async with extproc_app(extproc=extproc) as app:
        tls = app.extproc.tls
        assert tls is not None
        trusted = grpc.ssl_channel_credentials(root_certificates=tls.cert_file.read_bytes())
        # The generated certificate names localhost; the gateway connects by address.
        options = (("grpc.ssl_target_name_override", "localhost"),)
        async with grpc.aio.secure_channel(f"127.0.0.1:{app.extproc_port}", trusted, options) as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="")
            )
            assert answer.status == SERVING
        # The TLS port serves h2c clients too (a gateway configured either way works); the health
        # port stays cleartext for kubelet.
        assert await status(app.extproc_port, "") == SERVING
        assert await status(app.health_port, "readiness") == SERVING


async def test_ext_proc_tls_only_refuses_cleartext_clients() -> None:
    tls = {"enabled": True, "accept_cleartext": False}
    async with extproc_app(extproc={"enabled": True, "port": 0, "health_port": 0, "tls": tls}) as app:
        with pytest.raises(grpc.aio.AioRpcError):
            await status(app.extproc_port, "")
        assert await status(app.health_port, "readiness") == SERVING
