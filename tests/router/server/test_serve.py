"""``pd-router serve`` as a real process, and byte-exact stream pass-through."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import eventually, router_for

from loadtests.servers.ports import free_port
from router.server.cli import until_signal
from simulator.engine import EngineSpec, SimCluster, TimeModel

pytestmark = pytest.mark.integration

METRICS = (Path(__file__).parents[2] / "data" / "vllm_metrics.txt").read_text()
# Odd chunk boundaries, a multi-byte character split across chunks, and no trailing [DONE]
# newline convention assumed: the proxy must not re-frame anything.
CHUNKS = [b'data: {"choices":[{"text":"h', b"\xc3", b'\xa9llo"}]}\n', b"\n", b"data: [DONE]\n\n", b": tail\n"]


async def _fixed_engine() -> tuple[web.AppRunner, str]:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in CHUNKS:
            await response.write(chunk)
            await asyncio.sleep(0.005)
        return response

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"127.0.0.1:{runner.addresses[0][1]}"


async def test_stream_bytes_pass_through_unchanged() -> None:
    runner, address = await _fixed_engine()
    try:
        endpoints = [{"address": address, "role": "prefill-decode"}]
        async with router_for({"endpoints": endpoints}) as (_, base), aiohttp.ClientSession() as http:
            body = {"model": "sim-model", "prompt": "hi", "stream": True}
            async with http.post(f"http://{address}/v1/completions", json=body) as resp:
                direct = await resp.read()
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.headers["Content-Type"] == "text/event-stream"
                proxied = await resp.read()
        assert direct == b"".join(CHUNKS)
        assert proxied == direct
    finally:
        await runner.cleanup()


async def test_serve_drains_in_flight_streams_on_sigterm(tmp_path: Path) -> None:
    spec = EngineSpec("e0", "prefill-decode", time=TimeModel(speed=4.0))
    async with SimCluster([spec]) as cluster:
        port = free_port()
        config = tmp_path / "pool.yaml"
        address = cluster.address("e0")
        config.write_text(
            f"model: sim-model\nendpoints:\n  - {{address: '{address}', role: prefill-decode}}\n"
            f"proxy: {{port: {port}, drain_timeout_s: 20}}\nscrape: {{interval_ms: 100}}\n"
            "shutdown: {lame_duck_s: 0}\n"  # straight to draining (the lame duck has its own test)
        )
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.server.cli", "serve", "--config", str(config),
            stderr=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        try:
            assert proc.stderr is not None
            while b"proxy listening" not in (line := await asyncio.wait_for(proc.stderr.readline(), 20)):
                assert line, "pd-router serve exited before listening"
            async with aiohttp.ClientSession() as http:
                body = {"model": "sim-model", "prompt": "drain me " * 20, "max_tokens": 200, "stream": True}
                async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.content.readline()
                    proc.send_signal(signal.SIGTERM)
                    rest = await resp.read()
                assert rest.rstrip().endswith(b"data: [DONE]")
                assert rest.count(b'"text"') >= 190  # the stream finished, not cut
                with pytest.raises(aiohttp.ClientConnectionError):
                    await http.get(f"http://127.0.0.1:{port}/health")
            assert await asyncio.wait_for(proc.wait(), 20) == 0
            await eventually(lambda: cluster.engines["e0"].num_running == 0, what="engine idle")
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


@contextlib.asynccontextmanager
async def extproc_serve(
    tmp_path: Path, engine: str, lame_duck_s: float
) -> AsyncIterator[tuple[asyncio.subprocess.Process, int, int]]:
    """``pd-router serve`` with the ext_proc and health listeners only, in a real process, once it
    listens; yields (process, ext_proc port, health port). Killed if still running at the end."""
    grpc_port, health_port = free_port(), free_port()
    config = tmp_path / "pool.yaml"
    config.write_text(
        f"model: sim-model\nendpoints:\n  - {{address: '{engine}'}}\n"
        f"proxy: {{enabled: false}}\nshutdown: {{lame_duck_s: {lame_duck_s}}}\n"
    )
    args = ["--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.server.cli", "serve", "--config", str(config), *args,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        while b"ext_proc listening" not in (line := await asyncio.wait_for(proc.stderr.readline(), 20)):
            assert line, "pd-router serve exited before listening"
        yield proc, grpc_port, health_port
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_serve_answers_ext_proc_and_health_in_a_real_process(tmp_path: Path) -> None:
    """The gRPC listeners as ``pd-router serve`` runs them (uvloop when installed), then SIGTERM."""
    async with (
        SimCluster([EngineSpec("e0", "prefill-decode", time=TimeModel(speed=20))]) as cluster,
        extproc_serve(tmp_path, cluster.address("e0"), lame_duck_s=0) as (proc, grpc_port, health_port),
    ):
        for port in (grpc_port, health_port):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                check = health_pb2_grpc.HealthStub(channel).Check
                answer = await check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
        assert await routed(grpc_port) == cluster.address("e0")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0


async def test_sigterm_keeps_answering_while_not_ready_for_the_lame_duck_period(tmp_path: Path) -> None:
    """Envoy learns a replica is leaving from its health checks: for ``shutdown.lame_duck_s`` after
    SIGTERM the picker answers NOT_SERVING yet still routes every stream it is sent, and only then
    stops accepting and exits, so no request arrives at a closed port while the gateway catches up."""
    async with (
        SimCluster([EngineSpec("e0", "prefill-decode", time=TimeModel(speed=20))]) as cluster,
        extproc_serve(tmp_path, cluster.address("e0"), lame_duck_s=3) as (proc, grpc_port, health_port),
    ):

        async def readiness() -> int:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
                check = health_pb2_grpc.HealthStub(channel).Check
                return (await check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)).status

        assert await readiness() == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.stderr is not None
        while b"lame duck" not in (line := await asyncio.wait_for(proc.stderr.readline(), 10)):
            assert line, "pd-router serve exited without a lame-duck period"
        assert await readiness() == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await routed(grpc_port) == cluster.address("e0")  # still routing while the gateway moves away
        assert proc.returncode is None
        assert await asyncio.wait_for(proc.wait(), 20) == 0


async def routed(grpc_port: int) -> str:
    """Where the picker on ``grpc_port`` routes one completion (one ext_proc stream)."""
    body = b'{"model": "sim-model", "prompt": "hello there"}'
    messages = [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders()),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
    ]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        process = pb_grpc.ExternalProcessorStub(channel).Process
        responses = [r async for r in process(iter(messages), timeout=5)]
    routing = responses[0].request_headers.response.header_mutation.set_headers
    headers = {h.header.key: h.header.raw_value.decode() for h in routing}
    assert set(headers) == {"x-gateway-destination-endpoint"}
    return headers["x-gateway-destination-endpoint"]


async def test_a_started_server_moves_what_starting_made_out_of_the_collectors_way() -> None:
    """``until_signal`` (``pd-router serve``, the sidecar) freezes the heap once the server has
    started: the collector's full passes then walk only what serving makes."""

    class Server:
        async def __aenter__(self) -> Server:
            return self

        async def __aexit__(self, *_: object) -> None:
            return None

    gc.unfreeze()
    serving = asyncio.create_task(until_signal(Server()))
    try:
        await eventually(lambda: gc.get_freeze_count() > 0, what="the heap frozen once started")
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        gc.unfreeze()
