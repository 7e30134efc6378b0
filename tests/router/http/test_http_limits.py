"""Every HTTP listener bounds the request head and keeps serving; /metrics and /debug answer only
to their bearer tokens when those are set."""

from __future__ import annotations

import asyncio

import aiohttp
from helpers import router_on_sim

from router.http.server import MAX_HEADERS, MAX_REQUEST_LINE
from simulator.engine import EngineSpec


async def status_of(port: int, head: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    await writer.drain()
    status = await asyncio.wait_for(reader.readline(), 5.0)
    writer.close()
    return int(status.split()[1])


async def test_oversized_heads_are_refused_and_the_listeners_keep_serving() -> None:
    sections = {"metrics": {"enabled": True, "port": 0}}
    async with router_on_sim([EngineSpec("e0", "prefill-decode")], sections) as (_, app, base):
        many = b"".join(b"x-h%d: v\r\n" % i for i in range(MAX_HEADERS + 20))
        long_path = b"/v1/" + b"a" * (MAX_REQUEST_LINE + 10)
        huge_field = b"x-big: " + b"b" * 20000 + b"\r\n"
        heads = (
            b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n",
            b"GET " + long_path + b" HTTP/1.1\r\nHost: x\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + huge_field + b"\r\n",
        )
        for port in (app.proxy_port, app.metrics_port):
            for head in heads:
                assert await status_of(port, head) == 400
        async with aiohttp.ClientSession() as http:
            body = {"model": "sim-model", "prompt": "hello", "max_tokens": 2}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 200
            async with http.get(f"http://127.0.0.1:{app.metrics_port}/metrics") as resp:
                assert resp.status == 200


async def test_metrics_and_debug_views_need_their_tokens_when_set() -> None:
    sections = {"metrics": {"enabled": True, "port": 0, "token": "m-secret"}, "admin": {"token": "a-secret"}}
    async with (
        router_on_sim([EngineSpec("e0", "prefill-decode")], sections) as (_, app, _base),
        aiohttp.ClientSession() as http,
    ):
        url = f"http://127.0.0.1:{app.metrics_port}"
        for path, token in (("/metrics", "m-secret"), ("/debug/pool", "a-secret")):
            async with http.get(url + path) as resp:
                assert resp.status == 401
            async with http.get(url + path, headers={"Authorization": "Bearer wrong"}) as resp:
                assert resp.status == 401
            async with http.get(url + path, headers={"Authorization": f"Bearer {token}"}) as resp:
                assert resp.status == 200
        # The admin verbs stay off unless admin.enabled: a token alone only guards the view.
        async with http.post(
            url + "/admin/groups/e0/drain", headers={"Authorization": "Bearer a-secret"}
        ) as resp:
            assert resp.status == 404


async def test_no_prompt_text_reaches_the_logs_below_debug(caplog) -> None:  # type: ignore[no-untyped-def]
    secret = "confidential-patient-record-7731"
    caplog.set_level("INFO")
    async with (
        router_on_sim([EngineSpec("e0", "prefill-decode")]) as (cluster, _app, base),
        aiohttp.ClientSession() as http,
    ):
        bad = b'{"model": "sim-model", "prompt": "' + secret.encode() + b'", "max_tokens": "x"}'
        async with http.post(f"{base}/v1/completions", data=bad) as resp:
            assert resp.status == 400
        await cluster.engines["e0"].shutdown()  # the engine fails the next request
        async with http.post(f"{base}/v1/completions", json={"model": "sim-model", "prompt": secret}) as resp:
            assert resp.status >= 500
    assert caplog.records  # the failure was logged...
    assert not any(secret in record.getMessage() for record in caplog.records)  # ...without the prompt
