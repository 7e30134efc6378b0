"""The standalone proxy over real HTTP against simulated engines on 127.0.0.1."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from helpers import (
    SHAPES_SYSTEM,
    anthropic_body,
    eventually,
    keep_busy,
    responses_body,
    router_on_sim,
    sse_events,
)

from router.http.exchange import PREFILL_KV_TRANSFER_PARAMS
from simulator.engine import EngineSpec

pytestmark = pytest.mark.integration

PD_SPECS = [
    EngineSpec("p0", "prefill", link="a"),
    EngineSpec("p1", "prefill", link="b"),
    EngineSpec("d0", "decode", link="a"),
    EngineSpec("d1", "decode", link="b"),
]
SINGLE_SPECS = [EngineSpec(f"e{i}", "prefill-decode") for i in range(3)]
ALWAYS_PAIR = {"picker": {"allow_local_prefill": False}}
PROMPT = "The quick brown fox jumps over the lazy dog. " * 40


# The engine legs' two HTTP clients (``proxy.http_client``): what the proxy does with an engine's
# answer, its failure or a client's hang-up does not depend on which one carried the leg.
CLIENTS = pytest.mark.parametrize("client", ["builtin", "aiohttp"])


def legs_via(client: str) -> dict:
    return {"proxy": {"port": 0, "debug_headers": True, "drain_timeout_s": 2, "http_client": client}}


def completion(prompt: str = PROMPT, **extra: object) -> dict:
    return {"model": "sim-model", "prompt": prompt, "max_tokens": 8, **extra}


@CLIENTS
async def test_pd_request_runs_prefill_leg_then_decode_leg_with_the_transfer_params(client: str) -> None:
    async with (
        router_on_sim(PD_SPECS, {**ALWAYS_PAIR, **legs_via(client)}) as (cluster, app, base),
        aiohttp.ClientSession() as http,
    ):
        headers = {"X-Request-Id": "req-42"}
        async with http.post(f"{base}/v1/completions", json=completion(stream=True), headers=headers) as resp:
            assert resp.status == 200
            prefill_name = resp.headers["x-pd-router-prefill"]
            decode_name = resp.headers["x-pd-router-decode"]
            events = await sse_events(resp)
        assert events[-1] == "[DONE]" and len(events) > 2
        engines = cluster.engines
        _, p_headers, p_body = engines[prefill_name].requests_seen[-1]
        assert p_body["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
        assert p_body["max_tokens"] == 1 and p_body["min_tokens"] == 1 and p_body["stream"] is False
        assert p_headers["x-request-id"] == "req-42"
        _, d_headers, d_body = engines[decode_name].requests_seen[-1]
        assert d_headers["x-request-id"] == "req-42"
        assert d_body["stream"] is True and d_body["max_tokens"] == 8 and d_body["prompt"] == PROMPT
        params = d_body["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_engine_id"] == prefill_name
        assert params["remote_port"] == engines[prefill_name].port
        assert engines[decode_name].stats.remote_prefills_received == 1
        await eventually(lambda: app.parts.pool.outstanding == 0, what="reservation released")


async def test_prefill_decode_pool_sends_one_plain_request_to_one_pod() -> None:
    async with router_on_sim(SINGLE_SPECS) as (cluster, _app, base), aiohttp.ClientSession() as http:
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi " * 50}], "max_tokens": 4}
        async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            raw = await resp.read()
            answer = orjson.loads(raw)
            chosen = resp.headers["x-pd-router-decode"]
            # A whole answer goes out in one piece with its length, not chunked.
            assert resp.headers["Content-Length"] == str(len(raw)) and "Transfer-Encoding" not in resp.headers
            # The request id the proxy made (none was sent): 32 hex digits, sent to the engine too.
            request_id = resp.headers["X-Request-Id"]
            assert len(request_id) == 32 and int(request_id, 16) >= 0
        assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 4
        assert "x-pd-router-prefill" not in resp.headers
        _, engine_headers, seen = cluster.engines[chosen].requests_seen[-1]
        assert "kv_transfer_params" not in seen and engine_headers["x-request-id"] == request_id
        assert sum(len(e.requests_seen) for e in cluster.engines.values()) == 1


async def test_repeated_prefix_goes_back_to_the_pod_that_cached_it() -> None:
    async with router_on_sim(SINGLE_SPECS) as (_cluster, _app, base), aiohttp.ClientSession() as http:
        chosen = set()
        cached = []
        for i in range(5):
            async with http.post(
                f"{base}/v1/completions", json=completion(PROMPT + f" question {i}")
            ) as resp:
                chosen.add(resp.headers["x-pd-router-decode"])
                cached.append((await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert len(chosen) == 1
        assert cached[0] == 0 and min(cached[1:]) > 400


async def test_client_cannot_steer_routing_with_internal_headers_or_kv_params() -> None:
    async with router_on_sim(SINGLE_SPECS) as (cluster, _app, base), aiohttp.ClientSession() as http:
        forged = {
            "x-prefiller-host-port": "169.254.169.254:80",
            "x-gateway-destination-endpoint": "10.0.0.9:1",
        }
        async with http.post(f"{base}/v1/completions", json=completion(), headers=forged) as resp:
            assert resp.status == 200
            chosen = resp.headers["x-pd-router-decode"]
        _, headers, _ = cluster.engines[chosen].requests_seen[-1]
        assert not set(forged) & set(headers)
        steer = completion(kv_transfer_params={"do_remote_prefill": True, "remote_host": "10.1.1.1"})
        async with http.post(f"{base}/v1/completions", json=steer) as resp:
            assert resp.status == 400
            assert "kv_transfer_params" in (await resp.json())["error"]["message"]


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b"{not json", 400, "bad_request"),
        (b"[1, 2]", 400, "bad_request"),
        (b'{"prompt": "hi"}', 400, "bad_request"),
        (b'{"model": "sim-model"}', 400, "bad_request"),
        (b'{"model": "sim-model", "prompt": "hi", "max_tokens": -3}', 400, "bad_request"),
        (b'{"model": "other-model", "prompt": "hi"}', 404, "model_not_found"),
        (b'{"model": "sim-model", "prompt": "' + b"x" * 70000 + b'"}', 413, "too_large"),
    ],
)
async def test_bad_requests_get_openai_errors_and_the_next_request_succeeds(
    raw: bytes, status: int, code: str
) -> None:
    limits = {"limits": {"max_body_bytes": 65536}}
    async with router_on_sim(SINGLE_SPECS, limits) as (_, app, base), aiohttp.ClientSession() as http:
        headers = {"content-type": "application/json"}
        async with http.post(f"{base}/v1/completions", data=raw, headers=headers) as resp:
            assert resp.status == status
            error = (await resp.json())["error"]
            assert error["code"] == code and error["message"]
        async with http.post(f"{base}/v1/completions", json=completion()) as resp:
            assert resp.status == 200
        assert app.parts.pool.outstanding == 0


async def test_no_capacity_is_503_with_retry_after() -> None:
    async with router_on_sim(SINGLE_SPECS) as (cluster, app, base), aiohttp.ClientSession() as http:
        for name in list(cluster.engines):
            await cluster.kill(name)
        await eventually(lambda: len(app.parts.pool.candidate_slots()) == 0, what="all endpoints ejected")
        async with http.post(f"{base}/v1/completions", json=completion()) as resp:
            assert resp.status == 503
            assert int(resp.headers["Retry-After"]) >= 1
            assert (await resp.json())["error"]["code"] == "no_capacity"
        async with http.get(f"{base}/health") as resp:
            assert resp.status == 503


@CLIENTS
async def test_dead_decode_pod_fails_over_before_the_first_byte(client: str) -> None:
    # Kill a pod the scraper still believes healthy: the proxy must retry on the fallback.
    sections = {"scrape": {"interval_ms": 60000, "eject_after_failures": 2}, **legs_via(client)}
    async with router_on_sim(SINGLE_SPECS, sections) as (cluster, app, base), aiohttp.ClientSession() as http:
        await cluster.kill("e0")
        await cluster.kill("e1")
        pool = app.parts.pool

        def ejected() -> set[str]:
            return {e.id for e in pool.endpoints.values() if pool.ejected[e.slot]}

        for i in range(30):  # picks are random among equals: bounded until both dead pods were tried
            body = completion(f"distinct prompt {i} " * 30, stream=True)  # no locality pull
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["x-pd-router-decode"] == "e2"
                assert (await sse_events(resp))[-1] == "[DONE]"
            if ejected() == {"e0", "e1"}:
                break
        assert ejected() == {"e0", "e1"}
        assert pool.outstanding == 0


@CLIENTS
async def test_dead_prefill_pod_fails_over_to_the_next_prefill(client: str) -> None:
    async with (
        router_on_sim(PD_SPECS, {**ALWAYS_PAIR, "scrape": {"interval_ms": 60000}, **legs_via(client)}) as (
            cluster,
            app,
            base,
        ),
        aiohttp.ClientSession() as http,
    ):
        await cluster.kill("p0")
        for _ in range(4):
            async with http.post(f"{base}/v1/completions", json=completion()) as resp:
                assert resp.status == 200
                assert resp.headers["x-pd-router-prefill"] == "p1"
        assert cluster.engines["p1"].stats.remote_prefills_served >= 4
        assert app.parts.pool.outstanding == 0


@CLIENTS
async def test_engine_dying_mid_stream_ends_the_stream_with_an_error_event(client: str) -> None:
    async with (
        router_on_sim(SINGLE_SPECS, legs_via(client), speed=2.0) as (cluster, app, base),
        aiohttp.ClientSession() as http,
    ):
        async with http.post(f"{base}/v1/completions", json=completion(max_tokens=400, stream=True)) as resp:
            chosen = resp.headers["x-pd-router-decode"]
            first = await resp.content.readline()
            assert first.startswith(b"data: ")
            await cluster.kill(chosen)
            events = await sse_events(resp)
        assert isinstance(events[-1], dict) and events[-1]["error"]["code"] == "upstream_disconnected"
        await eventually(lambda: app.parts.pool.outstanding == 0, what="reservation released")


@CLIENTS
async def test_client_disconnect_cancels_upstream_and_releases_the_reservation(client: str) -> None:
    async with router_on_sim(SINGLE_SPECS, legs_via(client), speed=2.0) as (cluster, app, base):
        async with aiohttp.ClientSession() as http:
            resp = await http.post(f"{base}/v1/completions", json=completion(max_tokens=2000, stream=True))
            chosen = resp.headers["x-pd-router-decode"]
            await resp.content.readline()
            assert app.parts.pool.outstanding == 1
            engine = cluster.engines[chosen]
            assert engine.num_running == 1
            resp.close()  # hang up mid-stream
        await eventually(lambda: app.parts.pool.outstanding == 0, what="reservation released")
        await eventually(lambda: engine.num_running == 0, what="upstream request cancelled")
        slot = app.parts.pool.endpoints[chosen].slot
        assert app.parts.pool.inflight_requests[slot] == 0 and app.parts.pool.reserved_kv_tokens[slot] == 0


async def test_stale_endpoint_gets_no_traffic_and_returns_when_fresh() -> None:
    async with router_on_sim(SINGLE_SPECS) as (cluster, app, base), aiohttp.ClientSession() as http:
        cluster.engines["e0"].set_stall(2.0)  # every scrape of e0 now times out
        e0 = app.parts.pool.endpoints["e0"]
        await eventually(
            lambda: e0.slot not in app.parts.pool.candidate_slots(), what="e0 leaves the candidates"
        )
        for i in range(6):
            async with http.post(f"{base}/v1/completions", json=completion(f"prompt {i} " * 30)) as resp:
                assert resp.status == 200 and resp.headers["x-pd-router-decode"] != "e0"
        cluster.engines["e0"].set_stall(0.0)
        await eventually(lambda: e0.slot in app.parts.pool.candidate_slots(), what="e0 returns")


async def test_streaming_is_passed_through_unchanged_and_concurrent_requests_all_succeed() -> None:
    async with router_on_sim(PD_SPECS) as (_cluster, app, base), aiohttp.ClientSession() as http:

        async def one(i: int) -> list:
            body = completion(
                f"conversation {i % 5} " * 60, stream=True, stream_options={"include_usage": True}
            )
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 200
                return await sse_events(resp)

        results = await asyncio.gather(*(one(i) for i in range(40)))
        for events in results:
            assert events[-1] == "[DONE]"
            assert events[-2]["usage"]["completion_tokens"] == 8
            assert sum(1 for e in events if isinstance(e, dict) and e.get("choices")) == 8
        assert app.parts.pool.outstanding == 0


async def test_models_health_and_metrics() -> None:
    async with router_on_sim(PD_SPECS) as (_, _app, base), aiohttp.ClientSession() as http:
        async with http.get(f"{base}/v1/models") as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == ["sim-model"]
        async with http.get(f"{base}/health") as resp:
            assert resp.status == 200
        async with http.post(f"{base}/v1/completions", json=completion()) as resp:
            assert resp.status == 200
        async with http.get(f"{base}/metrics") as resp:
            text = await resp.text()
        assert 'pd_router_requests_total{outcome="ok"} 1.0' in text
        assert "llm_d_epp_ready_endpoints" in text and "pd_router_pick_duration_seconds_bucket" in text


# --- other request shapes: the Messages and Responses APIs, batches, APIs the router does not read ---


async def named_events(resp: aiohttp.ClientResponse) -> list[str]:
    """The event names of a named-event SSE stream (Anthropic's, the Responses API's), in order."""
    return [line[7:].strip().decode() async for line in resp.content if line.startswith(b"event: ")]


async def test_messages_stream_through_a_pd_pair_and_its_tokens_are_counted() -> None:
    async with router_on_sim(PD_SPECS, ALWAYS_PAIR) as (cluster, app, base), aiohttp.ClientSession() as http:
        async with http.post(f"{base}/v1/messages", json=anthropic_body("Why?", stream=True)) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            prefill_name, decode_name = (
                resp.headers["x-pd-router-prefill"],
                resp.headers["x-pd-router-decode"],
            )
            raw = await resp.read()
        events = [block.split(b"\n", 1)[0] for block in raw.strip().split(b"\n\n")]
        assert events[0] == b"event: message_start" and events[-1] == b"event: message_stop"
        assert events.count(b"event: content_block_delta") == 6
        engines = cluster.engines
        _, _, p_body = engines[prefill_name].requests_seen[-1]
        assert p_body["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
        assert p_body["max_tokens"] == 1 and p_body["stream"] is False
        assert "min_tokens" not in p_body  # not a field of the Messages API
        _, _, d_body = engines[decode_name].requests_seen[-1]
        assert d_body["kv_transfer_params"]["remote_engine_id"] == prefill_name
        assert d_body["system"] == anthropic_body("")["system"] and "stream_options" not in d_body
        assert engines[decode_name].stats.remote_prefills_received == 1
        perf = app.parts.scaling.perf
        await eventually(lambda: perf.tpot.count == 1, what="TPOT observed from the Messages stream")
        await eventually(lambda: app.parts.pool.outstanding == 0, what="reservation released")


async def test_messages_json_answers_and_a_shared_system_prompt_goes_back_to_its_pod() -> None:
    async with router_on_sim(SINGLE_SPECS) as (cluster, app, base), aiohttp.ClientSession() as http:
        chosen = []
        long = None
        for i in range(4):
            async with http.post(f"{base}/v1/messages", json=anthropic_body(f"question {i}")) as resp:
                assert resp.status == 200
                answer = await resp.json()
                chosen.append(resp.headers["x-pd-router-decode"])
            assert answer["type"] == "message" and answer["content"][0]["type"] == "text"
            assert answer["usage"]["output_tokens"] == 6 and answer["usage"]["input_tokens"] > 300
            if long is None:  # the home is made the busiest pod: load alone would leave it
                long = await keep_busy(http, cluster, app, chosen[0])
        assert chosen == [chosen[0]] * 4  # the system prompt's blocks were cached there
        other = anthropic_body("question", system=[{"type": "text", "text": "Another system prompt. " * 60}])
        async with http.post(f"{base}/v1/messages", json=other) as resp:
            assert resp.headers["x-pd-router-decode"] != chosen[0]  # nothing cached: load decides
            await resp.read()
        long.cancel()
        # Anthropic requires max_tokens: refused at the router, as vLLM would.
        body = anthropic_body("no limit")
        del body["max_tokens"]
        async with http.post(f"{base}/v1/messages", json=body) as resp:
            assert resp.status == 400 and "max_tokens" in (await resp.json())["error"]["message"]
        await eventually(lambda: app.parts.pool.outstanding == 0, what="reservations released")


async def test_responses_are_routed_to_one_pod_even_when_pairs_are_preferred() -> None:
    # vLLM's Responses answer carries no kv_transfer_params, so no prefill leg could hand its KV over.
    async with router_on_sim(PD_SPECS, ALWAYS_PAIR) as (cluster, app, base), aiohttp.ClientSession() as http:
        async with http.post(f"{base}/v1/responses", json=responses_body("Why?", stream=True)) as resp:
            assert resp.status == 200
            assert "x-pd-router-prefill" not in resp.headers
            decode_name = resp.headers["x-pd-router-decode"]
            names = await named_events(resp)
        assert names[:2] == ["response.created", "response.in_progress"]
        assert names.count("response.output_text.delta") == 6 and names[-1] == "response.completed"
        _, _, seen = cluster.engines[decode_name].requests_seen[-1]
        assert "kv_transfer_params" not in seen and seen["input"] == "Why?"
        assert sum(len(cluster.engines[p].requests_seen) for p in ("p0", "p1")) == 0
        async with http.post(f"{base}/v1/responses", json=responses_body("And?")) as resp:
            answer = await resp.json()
        assert answer["object"] == "response" and answer["usage"]["output_tokens"] == 6
        assert answer["output"][0]["content"][0]["type"] == "output_text"
        perf = app.parts.scaling.perf
        await eventually(lambda: perf.tpot.count == 1, what="TPOT observed from the Responses stream")
        await eventually(lambda: app.parts.pool.outstanding == 0, what="reservations released")


async def test_a_batch_of_string_prompts_is_answered_by_one_pod() -> None:
    async with router_on_sim(PD_SPECS, ALWAYS_PAIR) as (cluster, app, base), aiohttp.ClientSession() as http:
        prompts = [SHAPES_SYSTEM + "first", SHAPES_SYSTEM + "second", SHAPES_SYSTEM + "third"]
        body = {"model": "sim-model", "prompt": prompts, "max_tokens": 4}
        async with http.post(f"{base}/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert "x-pd-router-prefill" not in resp.headers
            answer = await resp.json()
        assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
        assert answer["usage"]["completion_tokens"] == 12
        async with http.post(f"{base}/v1/completions", json={**body, "stream": True}) as resp:
            events = await sse_events(resp)
        assert events[-1] == "[DONE]"
        assert sorted({e["choices"][0]["index"] for e in events[:-1] if isinstance(e, dict)}) == [0, 1, 2]
        assert sum(len(cluster.engines[p].requests_seen) for p in ("p0", "p1")) == 0
        await eventually(lambda: app.parts.pool.outstanding == 0, what="reservations released")


async def test_other_apis_are_forwarded_on_load_alone_unless_a_strict_pool_cannot_check_the_model() -> None:
    lenient = {"strict_model": False}
    async with router_on_sim(SINGLE_SPECS, lenient) as (cluster, app, base), aiohttp.ClientSession() as http:
        # No body at all: one pod gets it, and answers it itself.
        async with http.post(f"{base}/reset_prefix_cache") as resp:
            assert resp.status == 200 and resp.headers["x-pd-router-decode"] in cluster.engines
        # A JSON body the router does not read goes on unchanged, with its content type; the
        # engine's own answer (this one serves no embeddings) comes back as it is.
        raw = b'{"input": ["a", "b"], "encoding_format": "float"}'
        async with http.post(
            f"{base}/v1/embeddings", data=raw, headers={"content-type": "application/json"}
        ) as resp:
            assert resp.status == 404 and resp.headers["x-pd-router-decode"] in cluster.engines
        await eventually(lambda: app.parts.pool.outstanding == 0, what="reservations released")
    async with router_on_sim(SINGLE_SPECS) as (_cluster, _app, base), aiohttp.ClientSession() as http:
        async with http.post(f"{base}/v1/embeddings", json={"input": "a"}) as resp:
            assert resp.status == 400 and "model" in (await resp.json())["error"]["message"]
        async with http.post(f"{base}/v1/embeddings", json={"model": "other", "input": "a"}) as resp:
            assert resp.status == 404 and "x-pd-router-decode" not in resp.headers  # the router's 404
        async with http.post(f"{base}/v1/embeddings", json={"model": "sim-model", "input": "a"}) as resp:
            assert resp.status == 404 and "x-pd-router-decode" in resp.headers  # routed; the engine's 404


async def test_a_messages_stream_cut_mid_way_ends_with_an_anthropic_error_event() -> None:
    async with (
        router_on_sim(SINGLE_SPECS, speed=2.0) as (cluster, app, base),
        aiohttp.ClientSession() as http,
    ):
        body = anthropic_body("Why?", 400, stream=True)
        async with http.post(f"{base}/v1/messages", json=body) as resp:
            assert (await resp.content.readline()).startswith(b"event: message_start")
            await cluster.kill(resp.headers["x-pd-router-decode"])
            last = (await resp.read()).rstrip().rsplit(b"\n\n", 1)[-1]
        name, data = last.split(b"\n", 1)
        assert name == b"event: error" and orjson.loads(data[6:])["error"]["type"] == "api_error"
        await eventually(lambda: app.parts.pool.outstanding == 0, what="reservation released")


async def test_a_response_s_follow_up_goes_back_to_the_engine_that_stored_it() -> None:
    """vLLM keeps a stored Responses answer in the memory of the engine that gave it: a request
    naming it as previous_response_id goes there, busy or not (in streams and in JSON)."""
    specs = [EngineSpec(f"e{i}", "prefill-decode", num_gpu_blocks=1024) for i in range(3)]
    async with router_on_sim(specs) as (cluster, app, base), aiohttp.ClientSession() as http:
        async with http.post(f"{base}/v1/responses", json=responses_body("First?", stream=True)) as resp:
            home = resp.headers["x-pd-router-decode"]
            await resp.read()
        async with http.post(f"{base}/v1/responses", json=responses_body("Second?")) as resp:
            second = await resp.json()
            second_home = resp.headers["x-pd-router-decode"]
        ids = [rid for rid, _ in app.parts.pool.response_homes._homes.items()]
        assert len(ids) == 2 and second["id"] == ids[1]
        long = await keep_busy(http, cluster, app, home)
        for _ in range(3):
            # Only the new turn is sent (vLLM prepends what it stored): nothing for locality to find.
            follow = {"model": "sim-model", "input": "And then?", "previous_response_id": ids[0]}
            async with http.post(f"{base}/v1/responses", json=follow) as resp:
                assert resp.status == 200 and resp.headers["x-pd-router-decode"] == home
                await resp.read()
        plain = {"model": "sim-model", "input": "And then?"}
        async with http.post(f"{base}/v1/responses", json=plain) as resp:
            assert resp.headers["x-pd-router-decode"] != home  # the busy pod, avoided without the id
            await resp.read()
        follow = {"model": "sim-model", "input": "After the second?", "previous_response_id": second["id"]}
        async with http.post(f"{base}/v1/responses", json=follow) as resp:
            assert resp.headers["x-pd-router-decode"] == second_home
            await resp.read()
        long.cancel()


async def test_a_stored_response_is_retrieved_and_cancelled_on_the_engine_that_stored_it() -> None:
    """``GET /v1/responses/{id}`` (with its query, for a resumed stream), ``POST .../cancel`` (no
    body, even in a strict pool) and ``DELETE`` reach the engine that holds the answer, even while
    it is the busiest; an id no engine gave is answered by one of them (vLLM's own 404)."""
    specs = [EngineSpec(f"e{i}", "prefill-decode", num_gpu_blocks=1024) for i in range(3)]
    async with router_on_sim(specs) as (cluster, app, base), aiohttp.ClientSession() as http:
        async with http.post(f"{base}/v1/responses", json=responses_body("Keep this?")) as resp:
            stored = await resp.json()
            home = resp.headers["x-pd-router-decode"]
        long = await keep_busy(http, cluster, app, home)
        for _ in range(4):
            async with http.get(f"{base}/v1/responses/{stored['id']}?stream=false") as resp:
                assert resp.status == 200 and resp.headers["x-pd-router-decode"] == home
                assert (await resp.json())["id"] == stored["id"]
        async with http.post(f"{base}/v1/responses/{stored['id']}/cancel") as resp:
            assert resp.status == 200 and resp.headers["x-pd-router-decode"] == home
        async with http.get(f"{base}/v1/responses/{stored['id']}/input_items") as resp:
            assert resp.headers["x-pd-router-decode"] == home  # the sim lists no input items: its 404
        async with http.delete(f"{base}/v1/responses/{stored['id']}") as resp:
            assert resp.headers["x-pd-router-decode"] == home  # the sim has no DELETE: its 405
        async with http.get(f"{base}/v1/responses/resp_never_given") as resp:
            assert resp.status == 404 and resp.headers["x-pd-router-decode"] in cluster.engines
        long.cancel()  # sent to the engine directly: the router holds nothing for it
        await eventually(lambda: app.parts.pool.outstanding == 0, what="reservations released")
