"""The decode sidecar over real HTTP: a prefill and a decode simulated engine on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from aiohttp import web
from helpers import eventually, sse_events
from multidict import CIMultiDict

from loadtests.servers.ports import free_port
from router.http.exchange import PREFILL_KV_TRANSFER_PARAMS
from router.http.headers import read_prefill_timing
from router.sidecar.allow import PrefillAllowList, first_prefiller
from router.sidecar.server import SidecarServer
from simulator.engine import EngineSpec, SimCluster, TimeModel

PROMPT = "The quick brown fox jumps over the lazy dog. " * 40


@contextlib.asynccontextmanager
async def sidecar_on_sim(
    allow: list[str] | None = None, *, speed: float = 20.0, max_body_bytes: int = 65536
) -> AsyncIterator[tuple[SimCluster, str]]:
    """Engines p0 (prefill) and d0 (decode), a sidecar in front of d0; yields (cluster, base_url)."""
    specs = [EngineSpec("p0", "prefill"), EngineSpec("d0", "decode")]
    specs = [dataclasses.replace(spec, time=TimeModel(speed=speed)) for spec in specs]
    async with SimCluster(specs) as cluster:
        sidecar = SidecarServer(
            cluster.address("d0"),
            "127.0.0.1",
            0,
            ["127.0.0.1"] if allow is None else allow,
            max_body_bytes=max_body_bytes,
        )
        async with sidecar:
            yield cluster, f"http://127.0.0.1:{sidecar.port}"


def completion(**extra: object) -> dict:
    return {"model": "sim-model", "prompt": PROMPT, "max_tokens": 8, **extra}


def seen_count(cluster: SimCluster) -> int:
    return sum(len(engine.requests_seen) for engine in cluster.engines.values())


# -- the allow list ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entries", "target", "permitted"),
    [
        (["10.0.0.0/8"], "10.1.2.3:8000", True),
        (["10.0.0.0/8"], "11.0.0.1:8000", False),
        (["fd00::/8"], "[fd00::7]:8000", True),
        (["fd00::/8"], "[fe80::7]:8000", False),
        (["::1/128"], "[::1]:9", True),
        (["10.0.0.0/8"], "[::ffff:10.0.0.1]:8000", True),  # the same host, spelled as IPv6
        (["10.0.0.5"], "10.0.0.5:1", True),  # bare IP: any port
        (["10.0.0.5"], "10.0.0.5:65535", True),
        (["10.0.0.5"], "10.0.0.6:1", False),
        (["::1"], "[::1]:8000", True),
        (["10.0.0.5:8000"], "10.0.0.5:8000", True),  # ip:port: exactly that port
        (["10.0.0.5:8000"], "10.0.0.5:8001", False),
        (["[::1]:8000"], "[::1]:8000", True),
        (["[::1]:8000"], "[::1]:8001", False),
        (["0.0.0.0/0"], "localhost:8000", False),  # names are never resolved, so never permitted
        (["0.0.0.0/0"], "metadata.google.internal:80", False),
        (["0.0.0.0/0"], "10.0.0.1", False),  # no port
        (["0.0.0.0/0"], "10.0.0.1:0", False),
        (["0.0.0.0/0"], "10.0.0.1:99999", False),
        (["0.0.0.0/0"], "10.0.0.1:８０", False),  # non-ASCII digits
        (["0.0.0.0/0"], "10.0.0.1:80/path", False),
        (["0.0.0.0/0"], "user@10.0.0.1:80", False),
        (["::/0"], "::1:8000", False),  # unbracketed IPv6 with a port is ambiguous
        ([], "10.0.0.1:8000", False),  # empty list: fail closed
    ],
)
def test_allow_list(entries: list[str], target: str, permitted: bool) -> None:
    assert PrefillAllowList(entries).permits(target) is permitted


@pytest.mark.parametrize(
    "entry", ["prefill-0.svc:8000", "10.0.0.1/33", "10.0.0.1/8", "10.0.0.1:x", "", "1.2.3"]
)
def test_invalid_allow_entry_raises_naming_it(entry: str) -> None:
    with pytest.raises(ValueError, match="invalid prefill allow entry") as info:
        PrefillAllowList(["10.0.0.0/8", entry])
    assert repr(entry) in str(info.value)


@pytest.mark.parametrize(
    ("entries", "peer", "permitted"),
    [
        (["127.0.0.0/8"], "127.0.0.1", True),
        (["10.0.0.5"], "10.0.0.5", True),
        (["10.0.0.5:8000"], "10.0.0.5", True),  # a peer's source port is any: its IP is what counts
        (["10.0.0.5:8000"], "10.0.0.6", False),
        (["10.0.0.0/8"], "::ffff:10.0.0.1", True),
        (["10.0.0.0/8"], "11.0.0.1", False),
        (["0.0.0.0/0"], "", False),
        (["0.0.0.0/0"], "localhost", False),
        ([], "127.0.0.1", False),
    ],
)
def test_peers_that_may_send_a_prefill_leg(entries: list[str], peer: str, permitted: bool) -> None:
    assert PrefillAllowList(entries).permits_peer(peer) is permitted


def test_first_prefiller_takes_the_first_entry_and_strips_the_legacy_scheme() -> None:
    assert first_prefiller(["10.0.0.1:8000, 10.0.0.2:8000"]) == "10.0.0.1:8000"
    assert first_prefiller(["http://10.0.0.1:8000", "10.0.0.2:8000"]) == "10.0.0.1:8000"
    assert first_prefiller([" , ", "10.0.0.2:8000"]) == "10.0.0.2:8000"
    assert first_prefiller([]) is None


# -- the P/D exchange over HTTP ------------------------------------------------------------------


@pytest.mark.integration
async def test_prefill_header_runs_the_prefill_leg_then_the_local_decode_leg() -> None:
    async with sidecar_on_sim() as (cluster, base), aiohttp.ClientSession() as http:
        p0, d0 = cluster.engines["p0"], cluster.engines["d0"]
        headers = {"x-prefiller-host-port": cluster.address("p0"), "X-Request-Id": "req-7"}
        async with http.post(f"{base}/v1/completions", json=completion(), headers=headers) as resp:
            assert resp.status == 200
            assert resp.headers["x-pd-sidecar-prefill"] == "remote"
            assert resp.headers["X-Request-Id"] == "req-7"
            # The leg's time and the prefill engine's counts, for a picker behind Envoy to learn
            # the prefill speed from (the engine's own usage: cached tokens counted too).
            timing = read_prefill_timing(resp.headers["Server-Timing"])
            assert timing is not None and timing.seconds > 0
            assert timing.prompt_tokens is not None and timing.prompt_tokens > 0
            assert timing.cached_tokens is not None
            raw = await resp.read()
            # A whole answer goes out in one piece with its length, not chunked.
            assert resp.headers["Content-Length"] == str(len(raw)) and "Transfer-Encoding" not in resp.headers
            answer = orjson.loads(raw)
        assert answer["usage"]["completion_tokens"] == 8
        [(_, p_headers, p_body)] = p0.requests_seen
        assert p_body["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
        assert p_body["max_tokens"] == 1 and p_body["stream"] is False and p_body["prompt"] == PROMPT
        [(_, d_headers, d_body)] = d0.requests_seen
        assert d_body["max_tokens"] == 8 and d_body.get("stream", False) is False
        params = d_body["kv_transfer_params"]
        assert params["remote_engine_id"] == "p0" and params["remote_port"] == p0.port
        assert params["do_remote_prefill"] is True and params["remote_block_ids"]
        assert p_headers["x-request-id"] == d_headers["x-request-id"] == "req-7"
        for seen in (p_headers, d_headers):
            assert "x-prefiller-host-port" not in seen
        assert p0.stats.remote_prefills_served == 1
        assert d0.stats.remote_prefills_received == 1


@pytest.mark.integration
async def test_the_prefill_sees_exactly_the_params_returned_and_both_legs_share_a_generated_id() -> None:
    async with sidecar_on_sim() as (cluster, base), aiohttp.ClientSession() as http:
        # Repeated headers, the first with the legacy http:// form: the first entry wins.
        headers = CIMultiDict(
            [
                ("x-prefiller-host-port", f"http://{cluster.address('p0')}"),
                ("x-prefiller-host-port", "10.9.9.9:1"),
            ]
        )
        body = {"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3}
        async with http.post(f"{base}/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200 and resp.headers["x-pd-sidecar-prefill"] == "remote"
            rid = resp.headers["X-Request-Id"]
            assert len(rid) == 32 and int(rid, 16) >= 0  # made here: 32 hex digits
            assert (await resp.json())["object"] == "chat.completion"
        [(_, p_headers, _)] = cluster.engines["p0"].requests_seen
        [(path, d_headers, d_body)] = cluster.engines["d0"].requests_seen
        assert path == "/v1/chat/completions" and d_body["max_tokens"] == 3
        assert rid and p_headers["x-request-id"] == d_headers["x-request-id"] == rid
        assert cluster.engines["d0"].stats.remote_prefills_received == 1


@pytest.mark.integration
async def test_streaming_through_the_sidecar_is_intact() -> None:
    async with sidecar_on_sim() as (cluster, base), aiohttp.ClientSession() as http:
        headers = {"x-prefiller-host-port": cluster.address("p0")}
        body = completion(stream=True, stream_options={"include_usage": True})
        async with http.post(f"{base}/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            events = await sse_events(resp)
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 8
        assert sum(1 for e in events if isinstance(e, dict) and e.get("choices")) == 8
        [(_, _, d_body)] = cluster.engines["d0"].requests_seen
        assert d_body["stream"] is True and d_body["stream_options"] == {"include_usage": True}
        [(_, _, p_body)] = cluster.engines["p0"].requests_seen
        assert p_body["stream"] is False and "stream_options" not in p_body


@pytest.mark.integration
async def test_no_header_is_one_plain_request_to_the_decode_engine() -> None:
    async with sidecar_on_sim() as (cluster, base), aiohttp.ClientSession() as http:
        async with http.post(f"{base}/v1/completions", json=completion()) as resp:
            assert resp.status == 200 and resp.headers["x-pd-sidecar-prefill"] == "local"
            assert "Server-Timing" not in resp.headers  # no prefill leg, nothing timed
            assert (await resp.json())["usage"]["completion_tokens"] == 8
        assert not cluster.engines["p0"].requests_seen
        [(_, _, d_body)] = cluster.engines["d0"].requests_seen
        assert d_body == completion()


@pytest.mark.integration
async def test_forbidden_prefill_targets_get_403_and_nothing_is_sent() -> None:
    async with sidecar_on_sim(["10.0.0.0/8"]) as (cluster, base), aiohttp.ClientSession() as http:
        port = cluster.engines["p0"].port
        for target in ["169.254.169.254:80", f"localhost:{port}", f"127.0.0.1:{port}", "10.0.0.1"]:
            headers = {"x-prefiller-host-port": target}
            async with http.post(f"{base}/v1/completions", json=completion(), headers=headers) as resp:
                assert resp.status == 403, target
                error = (await resp.json())["error"]
            assert error["code"] == "prefill_target_forbidden" and error["type"] and "param" in error
        assert seen_count(cluster) == 0


@pytest.mark.integration
async def test_exact_ip_port_allow_refuses_another_port_on_the_same_host() -> None:
    async with SimCluster([EngineSpec("p0", "prefill"), EngineSpec("d0", "decode")]) as cluster:
        allow = [cluster.address("p0")]
        async with SidecarServer(cluster.address("d0"), "127.0.0.1", 0, allow) as sidecar:
            base = f"http://127.0.0.1:{sidecar.port}"
            async with aiohttp.ClientSession() as http:
                headers = {"x-prefiller-host-port": cluster.address("d0")}
                async with http.post(f"{base}/v1/completions", json=completion(), headers=headers) as resp:
                    assert resp.status == 403
        assert seen_count(cluster) == 0


@contextlib.asynccontextmanager
async def sidecar_per_pod(allow: list[str]) -> AsyncIterator[tuple[SimCluster, dict[str, str]]]:
    """Two prefill-decode engines, each behind its own sidecar; yields (cluster, name -> sidecar)."""
    specs = [EngineSpec(name, "prefill-decode", time=TimeModel(speed=20.0)) for name in ("e0", "e1")]
    async with SimCluster(specs) as cluster, contextlib.AsyncExitStack() as stack:
        sidecars = {}
        for spec in specs:
            server = SidecarServer(cluster.address(spec.name), "127.0.0.1", 0, allow)
            await stack.enter_async_context(server)
            sidecars[spec.name] = f"127.0.0.1:{server.port}"
        yield cluster, sidecars


@pytest.mark.integration
async def test_a_pair_between_two_sidecar_fronted_pods_runs_its_prefill_leg_through_the_peer() -> None:
    async with sidecar_per_pod(["127.0.0.1"]) as (cluster, sidecars), aiohttp.ClientSession() as http:
        headers = {"x-prefiller-host-port": sidecars["e0"]}  # the prefill pod's pool address
        body = completion(stream=True)
        async with http.post(f"http://{sidecars['e1']}/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
            assert resp.headers["x-pd-sidecar-prefill"] == "remote"  # not failed-local: e0 computed it
            assert (await resp.read()).rstrip().endswith(b"data: [DONE]")
        e0, e1 = cluster.engines["e0"], cluster.engines["e1"]
        [(_, p_headers, p_body)] = e0.requests_seen
        assert p_body["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
        assert "x-pd-prefill-leg" not in p_headers  # the marker stops at the peer's sidecar
        assert e0.stats.remote_prefills_served == 1 and e1.stats.remote_prefills_received == 1


PREFILL_LEG = {"x-pd-prefill-leg": "1", "content-type": "application/json"}


def prefill_leg(**changes: object) -> dict:
    """A prefill leg's body as a peer's sidecar sends it (``changes`` applied)."""
    leg = {**completion(), "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}
    return leg | changes


@pytest.mark.integration
@pytest.mark.parametrize(
    ("allow", "headers", "body", "status"),
    [
        # A client's kv_transfer_params, without the marker only a peer's sidecar sets: as before.
        (["127.0.0.1"], {"content-type": "application/json"}, prefill_leg(), 400),
        (["10.0.0.0/8"], PREFILL_LEG, prefill_leg(), 403),  # not from a peer on the allow list
        (["127.0.0.1"], {**PREFILL_LEG, "x-prefiller-host-port": "127.0.0.1:9"}, prefill_leg(), 400),
        # Params that would make the engine pull KV from a host: only a decode leg has them.
        (
            ["127.0.0.1"],
            PREFILL_LEG,
            prefill_leg(kv_transfer_params={**PREFILL_KV_TRANSFER_PARAMS, "remote_host": "10.6.6.6"}),
            400,
        ),
        (["127.0.0.1"], PREFILL_LEG, prefill_leg(max_tokens=500), 400),
        (["127.0.0.1"], PREFILL_LEG, prefill_leg(stream=True), 400),
        (["127.0.0.1"], PREFILL_LEG, prefill_leg(max_completion_tokens=500), 400),
    ],
)
async def test_a_prefill_leg_is_accepted_only_from_a_peer_in_its_exact_shape(
    allow: list[str], headers: dict[str, str], body: dict, status: int
) -> None:
    async with sidecar_per_pod(allow) as (cluster, sidecars), aiohttp.ClientSession() as http:
        url = f"http://{sidecars['e0']}/v1/completions"
        async with http.post(url, json=body, headers=headers) as resp:
            assert resp.status == status
            assert (await resp.json())["error"]["message"]
        assert seen_count(cluster) == 0


@pytest.mark.integration
async def test_a_peers_prefill_leg_reaches_the_engine_unchanged_and_its_answer_comes_back() -> None:
    async with sidecar_per_pod(["127.0.0.1"]) as (cluster, sidecars), aiohttp.ClientSession() as http:
        headers = {**PREFILL_LEG, "X-Request-Id": "leg-1"}
        url = f"http://{sidecars['e0']}/v1/completions"
        async with http.post(url, json=prefill_leg(), headers=headers) as resp:
            assert resp.status == 200 and resp.headers["x-pd-sidecar-prefill"] == "prefill-leg"
            params = (await resp.json())["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "e0"
        [(_, seen_headers, seen_body)] = cluster.engines["e0"].requests_seen
        assert seen_body == prefill_leg() and seen_headers["x-request-id"] == "leg-1"


@pytest.mark.integration
async def test_dead_prefill_engine_falls_back_to_local_prefill() -> None:
    async with sidecar_on_sim() as (cluster, base), aiohttp.ClientSession() as http:
        headers = {"x-prefiller-host-port": cluster.address("p0")}
        await cluster.kill("p0")
        async with http.post(f"{base}/v1/completions", json=completion(), headers=headers) as resp:
            assert resp.status == 200
            assert resp.headers["x-pd-sidecar-prefill"] == "failed-local"
            assert "Server-Timing" not in resp.headers  # a failed leg is no prompt's compute time
            assert (await resp.json())["usage"]["completion_tokens"] == 8
        d0 = cluster.engines["d0"]
        [(_, _, d_body)] = d0.requests_seen
        assert "kv_transfer_params" not in d_body
        assert d0.stats.remote_prefills_received == 0 and d0.stats.requests_served == 1


@pytest.mark.integration
async def test_dead_decode_engine_is_a_502_json_error() -> None:
    async with sidecar_on_sim() as (cluster, base), aiohttp.ClientSession() as http:
        await cluster.kill("d0")
        async with http.post(f"{base}/v1/completions", json=completion()) as resp:
            assert resp.status == 502
            assert (await resp.json())["error"]["code"] == "upstream_failed"
        async with http.get(f"{base}/metrics") as resp:
            assert resp.status == 502


@pytest.mark.integration
@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b"{not json", 400, "bad_request"),
        (b"[1, 2]", 400, "bad_request"),
        (b"", 400, "bad_request"),
        (
            b'{"model": "sim-model", "prompt": "hi", "kv_transfer_params": {"remote_host": "10.1.1.1"}}',
            400,
            "",
        ),
        (b'{"model": "sim-model", "prompt": "' + b"x" * 70000 + b'"}', 413, "too_large"),
    ],
)
async def test_bad_bodies_are_refused_before_any_leg(raw: bytes, status: int, code: str) -> None:
    async with sidecar_on_sim() as (cluster, base), aiohttp.ClientSession() as http:
        for headers in ({}, {"x-prefiller-host-port": cluster.address("p0")}):
            headers["content-type"] = "application/json"
            async with http.post(f"{base}/v1/completions", data=raw, headers=headers) as resp:
                assert resp.status == status
                error = (await resp.json())["error"]
            assert error["message"] and error["code"] == (code or "bad_request")
            if not code:
                assert "kv_transfer_params" in error["message"]
        assert seen_count(cluster) == 0


@pytest.mark.integration
async def test_other_paths_pass_through_to_the_decode_engine() -> None:
    async with sidecar_on_sim() as (cluster, base), aiohttp.ClientSession() as http:
        d0 = cluster.engines["d0"]
        async with http.get(f"{base}/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert await resp.text() == d0.metrics_text()
        async with http.get(f"{base}/v1/models") as resp:
            assert resp.status == 200
            assert [m["id"] for m in (await resp.json())["data"]] == ["sim-model"]
        async with http.get(
            f"{base}/health", headers={"x-prefiller-host-port": "169.254.169.254:80"}
        ) as resp:
            assert resp.status == 200
        async with http.post(f"{base}/tokenize", json={"prompt": "hi"}) as resp:
            assert resp.status == 404  # the engine's answer, not the sidecar's
        async with http.get(f"{base}/v1/completions") as resp:
            assert resp.status == 405
        assert seen_count(cluster) == 0


@pytest.mark.integration
async def test_client_disconnect_cancels_the_decode_leg() -> None:
    async with sidecar_on_sim(speed=2.0) as (cluster, base):
        d0 = cluster.engines["d0"]
        headers = {"x-prefiller-host-port": cluster.address("p0")}
        async with aiohttp.ClientSession() as http:
            body = completion(max_tokens=2000, stream=True)
            resp = await http.post(f"{base}/v1/completions", json=body, headers=headers)
            assert resp.status == 200
            assert (await resp.content.readline()).startswith(b"data: ")
            assert d0.num_running == 1
            resp.close()  # hang up mid-stream
        await eventually(lambda: d0.num_running == 0 and d0.num_waiting == 0, what="decode leg cancelled")


@contextlib.asynccontextmanager
async def running_sidecar(
    decode: str, port: int, drain_timeout_s: float
) -> AsyncIterator[asyncio.Task[None]]:
    """A sidecar served by a task (as ``pd-router sidecar`` does until SIGTERM); cancelling the task
    leaves the server's context, which drains in-flight streams."""
    ready = asyncio.Event()
    server = SidecarServer(decode, "127.0.0.1", port, ["10.0.0.0/8"], drain_timeout_s=drain_timeout_s)

    async def serve() -> None:
        async with server:
            ready.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(serve())
    try:
        await asyncio.wait_for(ready.wait(), timeout=5.0)
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.integration
async def test_stopping_the_sidecar_lets_an_in_flight_stream_finish_then_stops_listening() -> None:
    specs = [EngineSpec("d0", "decode", time=TimeModel(speed=1.0))]  # slow enough to be mid-stream
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    async with SimCluster(specs) as cluster, aiohttp.ClientSession() as http:
        async with running_sidecar(cluster.address("d0"), port, drain_timeout_s=5.0) as task:
            async with http.get(f"{base}/health") as resp:
                assert resp.status == 200
            async with http.post(
                f"{base}/v1/completions", json=completion(max_tokens=40, stream=True)
            ) as resp:
                assert (await resp.content.readline()).startswith(b"data: ")
                task.cancel()
                events = await sse_events(resp)
            assert events[-1] == "[DONE]"
            assert sum(1 for e in events if isinstance(e, dict) and e.get("choices")) == 39
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with pytest.raises(aiohttp.ClientConnectionError):
            await http.get(f"{base}/health")


@pytest.mark.integration
async def test_a_stream_longer_than_the_drain_grace_is_cut_and_the_engine_freed() -> None:
    specs = [EngineSpec("d0", "decode", time=TimeModel(speed=1.0))]
    port = free_port()
    async with SimCluster(specs) as cluster, aiohttp.ClientSession() as http:
        d0 = cluster.engines["d0"]
        async with running_sidecar(cluster.address("d0"), port, drain_timeout_s=0.1) as task:
            body = completion(max_tokens=5000, stream=True)
            async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                await resp.content.readline()
                task.cancel()
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await eventually(lambda: d0.num_running == 0, what="engine request cancelled")


def test_sidecar_server_rejects_a_bad_allow_entry_before_listening() -> None:
    with pytest.raises(ValueError, match="prefill-0"):
        SidecarServer("127.0.0.1:8200", "127.0.0.1", 0, ["prefill-0:8000"])


@pytest.mark.integration
async def test_passthrough_keeps_method_path_query_headers_body_and_status() -> None:
    seen: list[tuple[str, str, dict[str, str], bytes]] = []

    async def echo(request: web.Request) -> web.Response:
        headers = {k.lower(): v for k, v in request.headers.items()}
        seen.append((request.method, request.raw_path, headers, await request.read()))
        response = web.Response(status=201, body=b"made", headers={"x-engine": "yes", "Set-Cookie": "a=1"})
        response.headers.add("Set-Cookie", "b=2")
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        engine = f"127.0.0.1:{runner.addresses[0][1]}"
        async with (
            SidecarServer(engine, "127.0.0.1", 0, ["127.0.0.1"]) as sidecar,
            aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http,
        ):
            headers = {"x-custom": "1", "x-prefiller-host-port": "127.0.0.1:1", "x-pd-router-decode": "d9"}
            url = f"http://127.0.0.1:{sidecar.port}/tokenize/a%2Fb?x=1&y=%20"
            async with http.put(url, data=b"raw bytes", headers=headers) as resp:
                assert resp.status == 201 and await resp.read() == b"made"
                assert resp.headers["x-engine"] == "yes"
                assert resp.headers.getall("Set-Cookie") == ["a=1", "b=2"]
    finally:
        await runner.cleanup()
    [(method, path, got, body)] = seen
    assert (method, path, body) == ("PUT", "/tokenize/a%2Fb?x=1&y=%20", b"raw bytes")
    assert got["x-custom"] == "1"
    assert "x-prefiller-host-port" not in got and "x-pd-router-decode" not in got
