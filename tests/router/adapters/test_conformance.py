"""The Gateway API Inference Extension conformance scenarios the picker takes part in, through a
real Envoy, against echo backends like the suite's (``extproc.conformance``): the suite steers with
``test-epp-endpoint-selection`` and checks ``x-conformance-test-served-endpoint``."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from gateway import envoy_with_picker, example_config, gateway, run_envoy
from helpers import eventually

from loadtests.servers.envoy import free_port
from loadtests.servers.kube import NS, pod, pool, serving
from router.control.discovery.kubernetes import KubernetesDiscovery
from router.server.app import App
from router.server.compose import build
from router.server.config import parse_config

pytestmark = pytest.mark.integration

SELECT = "test-epp-endpoint-selection"
SERVED = "x-conformance-test-served-endpoint"
BODY = {"model": "conformance-fake-model", "prompt": "Conformance test request"}


async def _echo(request: web.Request) -> web.Response:
    """What the suite's echo-basic answers: who served, and the request as it arrived."""
    body = await request.read()
    answer = {
        "path": request.path,
        "method": request.method,
        "httpPort": str(request.transport.get_extra_info("sockname")[1]),
        "headers": {k.lower(): v for k, v in request.headers.items()},
        "bodyBytes": len(body),
    }
    response = web.json_response(answer)
    # echo-basic sets the response headers a request asks for in X-Echo-Set-Header ("name:value").
    for item in request.headers.getall("X-Echo-Set-Header", []):
        name, _, value = item.partition(":")
        response.headers[name.strip()] = value.strip()
    return response


@contextlib.asynccontextmanager
async def echo_pods(count: int) -> AsyncIterator[list[str]]:
    """``count`` echo backends on 127.0.0.1 (one host, many ports: a data-parallel pod)."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", _echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    addresses = []
    try:
        for _ in range(count):
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            addresses.append(f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}")  # type: ignore[union-attr]
        yield addresses
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def conformance_gateway(
    tmp_path: Path, mode: str = "full-duplex", conformance: bool = True
) -> AsyncIterator[tuple[Any, str, list[str]]]:
    async with echo_pods(3) as pods:
        endpoints = [{"address": address, "role": "prefill-decode"} for address in pods]
        # One switch: no other setting differs from a production config.
        extproc = {"conformance": conformance}
        async with envoy_with_picker(tmp_path, endpoints, mode, extproc=extproc) as (app, url):
            yield app, url, pods


async def _h2c_echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """echo-basic as an ASGI app, also saying which HTTP version the request arrived over."""
    if scope["type"] != "http":
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    answer = {
        "path": scope["path"],
        "httpPort": str(scope["server"][1]),
        "httpVersion": scope["http_version"],
        "headers": {k.decode().lower(): v.decode() for k, v in scope["headers"]},
        "bodyBytes": size,
    }
    payload = orjson.dumps(answer)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


@contextlib.asynccontextmanager
async def h2c_pods(count: int) -> AsyncIterator[list[str]]:
    """``count`` echo backends speaking HTTP/2 in cleartext (prior knowledge), as a model server
    behind an InferencePool with ``appProtocol: kubernetes.io/h2c``."""
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    addresses = [f"127.0.0.1:{free_port()}" for _ in range(count)]
    config = Config()
    config.bind = addresses
    config.accesslog = config.errorlog = None
    stop = asyncio.Event()
    server = asyncio.create_task(serve(_h2c_echo, config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
    try:
        for address in addresses:
            host, _, port = address.rpartition(":")
            await eventually(lambda h=host, p=int(port): _listening(h, p), 5, f"{address} listening")
        yield addresses
    finally:
        stop.set()
        await server


def _listening(host: str, port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) == 0


async def post(http: aiohttp.ClientSession, url: str, select: str | None) -> tuple[int, str | None, Any]:
    headers = {SELECT: select} if select is not None else {}
    async with http.post(f"{url}/v1/completions", json=BODY, headers=headers) as resp:
        answer = await resp.json(content_type=None) if resp.status == 200 else await resp.text()
        return resp.status, resp.headers.get(SERVED), answer


@pytest.mark.parametrize("mode", ["full-duplex", "buffered"])
async def test_each_selected_endpoint_serves_and_is_reported_back(tmp_path: Path, mode: str) -> None:
    """GatewayDestinationEndpointServed and GatewayFollowingEPPRouting (one endpoint each)."""
    async with conformance_gateway(tmp_path, mode) as (app, url, pods), aiohttp.ClientSession() as http:
        for pod in pods:
            for _ in range(3):
                status, served, answer = await post(http, url, pod)
                assert status == 200
                assert served == pod  # the header the suite checks
                assert f"127.0.0.1:{answer['httpPort']}" == pod  # and who really answered
                assert answer["bodyBytes"] > 0 and answer["headers"].get(SELECT) == pod
        await eventually(lambda: app.parts.pool.outstanding == 0, what="reservations released")


async def test_a_list_of_endpoints_or_a_bare_ip_keeps_every_request_inside_it(tmp_path: Path) -> None:
    """GatewayFollowingEPPRouting (two of three, 10 concurrent) and WithDataParallelism (a bare IP
    is every port of that pod)."""
    async with conformance_gateway(tmp_path) as (app, url, pods), aiohttp.ClientSession() as http:
        allowed = pods[:2]
        results = await asyncio.gather(*(post(http, url, ", ".join(allowed)) for _ in range(30)))
        assert {status for status, _, _ in results} == {200}
        assert {served for _, served, _ in results} <= set(allowed)
        results = await asyncio.gather(*(post(http, url, "127.0.0.1") for _ in range(10)))
        assert {status for status, _, _ in results} == {200}
        assert {served for _, served, _ in results} <= set(pods)
        # Tokens naming another pool's endpoints are skipped; none of ours left: 503.
        status, _, answer = await post(http, url, f"10.255.255.1, {pods[2]}")
        assert status == 200
        status, _, answer = await post(http, url, "10.255.255.1,10.255.255.2:3000")
        assert status == 503 and "no_capacity" in answer
        await eventually(lambda: app.parts.pool.outstanding == 0, what="reservations released")


async def test_requests_without_a_body_and_without_the_header_are_routed(tmp_path: Path) -> None:
    """HTTPRouteMultipleGatewaysDifferentPools: a plain GET, no test header."""
    async with conformance_gateway(tmp_path) as (_, url, pods), aiohttp.ClientSession() as http:
        async with http.get(f"{url}/status") as resp:
            assert resp.status == 200
            assert resp.headers[SERVED] in pods
            assert (await resp.json(content_type=None))["method"] == "GET"
        status, served, _ = await post(http, url, None)
        assert status == 200 and served in pods


async def test_without_the_switch_the_test_header_steers_nothing(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, aiohttp.ClientSession() as http:
        async with http.post(
            f"{gw.url}/v1/completions",
            json={"model": "sim-model", "prompt": "steer me " * 20, "max_tokens": 4},
            headers={SELECT: "10.255.255.1"},  # with the switch: nothing eligible, 503
        ) as resp:
            assert resp.status == 200
            assert SERVED not in resp.headers
        assert sum(gw.served_by().values()) == 1


async def test_data_parallel_ranks_of_an_inference_pool_each_serve_and_are_reported(tmp_path: Path) -> None:
    """GatewayFollowingEPPRoutingWithDataParallelism from a discovered InferencePool: one pod, its
    targetPorts its ranks (each an endpoint); a bare IP reaches every rank, ip:port exactly one."""
    async with echo_pods(3) as ranks, serving() as kube, aiohttp.ClientSession() as http:
        kube.put("pools", pool("conformance", ports=tuple(int(rank.rsplit(":", 1)[1]) for rank in ranks)))
        kube.put("pods", pod("dp-pod", "127.0.0.1"))
        config = parse_config(
            {
                "model": "conformance-fake-model",
                "kubernetes": {"namespace": NS, "pool_name": "conformance"},
                "proxy": {"enabled": False},
                "extproc": {"enabled": True, "port": 0, "health_port": 0, "conformance": True},
                "gate": {"initial_wait_s": 5},
            }
        )
        source = KubernetesDiscovery(kube.client(), NS, pool_name="conformance")
        async with App(build(config, discovery=source)) as app:
            await eventually(lambda: len(app.parts.pool.candidate_slots()) == 3, 5, "three ranks admitted")
            envoy_config, listen, admin = example_config("full-duplex", app.extproc_port, ranks[0])
            async with run_envoy(envoy_config, tmp_path, admin):
                url = f"http://127.0.0.1:{listen}"
                for rank in ranks:
                    status, served, answer = await post(http, url, rank)
                    assert status == 200 and served == rank
                    assert f"127.0.0.1:{answer['httpPort']}" == rank
                results = await asyncio.gather(*(post(http, url, "127.0.0.1") for _ in range(30)))
                assert {status for status, _, _ in results} == {200}
                assert {served for _, served, _ in results} <= set(ranks)
        await eventually(lambda: app.parts.pool.outstanding == 0, what="reservations released")


@pytest.mark.parametrize("mode", ["full-duplex", "buffered"])
async def test_an_h2c_pool_s_selected_endpoints_serve_over_http2(tmp_path: Path, mode: str) -> None:
    """An InferencePool with ``appProtocol: kubernetes.io/h2c``: the gateway speaks HTTP/2 in
    cleartext to the pods; the picker's choice is followed and reported, bodies go both ways."""
    async with (
        h2c_pods(2) as pods,
        envoy_with_picker(
            tmp_path,
            [{"address": address, "role": "prefill-decode"} for address in pods],
            mode,
            h2c_pods=True,
            extproc={"conformance": True},
        ) as (app, url),
        aiohttp.ClientSession() as http,
    ):
        for pod in pods:
            for _ in range(2):
                status, served, answer = await post(http, url, pod)
                assert status == 200, answer
                assert served == pod and f"127.0.0.1:{answer['httpPort']}" == pod
                assert answer["httpVersion"] == "2"  # not HTTP/1.1: the pool's protocol held
                assert answer["bodyBytes"] > 0
        await eventually(lambda: app.parts.pool.outstanding == 0, what="reservations released")
