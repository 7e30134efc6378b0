"""The simulated vLLM engine over real HTTP on 127.0.0.1: wire formats, cache, queueing, P/D, faults."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from helpers import eventually
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from router.http.exchange import PREFILL_KV_TRANSFER_PARAMS
from simulator.engine import EngineSpec, SimCluster, SimEngine, TimeModel, run_sim

pytestmark = pytest.mark.integration

FAST = TimeModel(speed=20.0)
MODEL = "sim-model"
# ~500 tokens at 4 chars/token: about 31 full 16-token blocks.
LONG_PROMPT = "".join(f"The quick brown fox {i} jumps over the lazy dog. " for i in range(40))


@pytest.fixture
async def cluster() -> AsyncIterator[SimCluster]:
    specs = [
        EngineSpec(name="pd0", role="prefill-decode", time=FAST),
        EngineSpec(name="p0", role="prefill", link="rack-a", time=FAST),
        EngineSpec(name="d0", role="decode", link="rack-b", time=FAST),
    ]
    async with SimCluster(specs) as c:
        yield c


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


async def post(
    session: aiohttp.ClientSession,
    address: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> tuple[int, CIMultiDict[str], Any]:
    async with session.post(f"http://{address}{path}", data=orjson.dumps(body), headers=headers) as resp:
        return resp.status, CIMultiDict(resp.headers), orjson.loads(await resp.read())


async def sse_events(resp: aiohttp.ClientResponse) -> list[bytes]:
    raw = await resp.read()
    assert raw.endswith(b"\n\n")
    events = raw.split(b"\n\n")[:-1]
    assert all(e.startswith(b"data: ") for e in events)
    return [e[len(b"data: ") :] for e in events]


async def metrics(session: aiohttp.ClientSession, address: str) -> str:
    async with session.get(f"http://{address}/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


def sample(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


async def test_completion_non_streaming(cluster: SimCluster, session: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "prompt": "Hello there, how are you today?", "max_tokens": 5}
    status, headers, data = await post(
        session, cluster.address("pd0"), "/v1/completions", body, {"X-Request-Id": "abc-123"}
    )
    assert status == 200
    assert headers["X-Request-Id"] == "abc-123"
    assert data["id"] == "cmpl-abc-123"
    assert data["object"] == "text_completion"
    assert data["model"] == MODEL
    assert isinstance(data["created"], int)
    [choice] = data["choices"]
    assert choice["index"] == 0
    assert choice["text"] == "tok0 tok1 tok2 tok3 tok4"
    assert choice["finish_reason"] == "length"
    usage = data["usage"]
    assert usage["prompt_tokens"] == 8  # 30 chars / 4 chars per token, rounded up
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == 13
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert data["kv_transfer_params"] is None
    engine = cluster.engines["pd0"]
    assert engine.stats.requests_served == 1
    path, seen_headers, seen_body = engine.requests_seen[-1]
    assert path == "/v1/completions"
    assert seen_headers["x-request-id"] == "abc-123"
    assert seen_body == body


async def test_chat_non_streaming_defaults_to_16_tokens(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "min_tokens": 2}
    status, _, data = await post(session, cluster.address("pd0"), "/v1/chat/completions", body)
    assert status == 200
    assert data["object"] == "chat.completion"
    assert data["id"].startswith("chatcmpl-")
    [choice] = data["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"].split() == [f"tok{i}" for i in range(16)]
    assert choice["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 16


async def test_completion_streaming_sse(cluster: SimCluster, session: aiohttp.ClientSession) -> None:
    body = {
        "model": MODEL,
        "prompt": LONG_PROMPT,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    url = f"http://{cluster.address('pd0')}/v1/completions"
    async with session.post(url, data=orjson.dumps(body), headers={"X-Request-Id": "s1"}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-Request-Id"] == "s1"
        events = await sse_events(resp)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    token_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert [c["choices"][0]["text"] for c in token_chunks] == ["tok0", " tok1", " tok2", " tok3"]
    assert all(c["object"] == "text_completion" and c["id"] == "cmpl-s1" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in token_chunks] == [None, None, None, "length"]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 4
    assert usage_chunk["usage"]["prompt_tokens"] == -(-len(LONG_PROMPT) // 4)


async def test_chat_streaming_uses_deltas_and_no_usage_by_default(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    url = f"http://{cluster.address('pd0')}/v1/chat/completions"
    async with session.post(url, data=orjson.dumps(body)) as resp:
        events = await sse_events(resp)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[1:]) == "tok0 tok1 tok2"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)


async def test_a_chat_streams_first_byte_comes_once_its_prompt_is_computed(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    """As vLLM: the role chunk goes out with the first token, not on arrival (the router reads a
    stream's first byte as the end of its prefill)."""
    engine = cluster.engines["pd0"]
    served = engine.stats.generation_tokens
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "y" * 40_000}],
        "max_tokens": 2,
        "stream": True,
    }
    url = f"http://{cluster.address('pd0')}/v1/chat/completions"
    async with session.post(url, data=orjson.dumps(body)) as resp:
        first = await resp.content.readuntil(b"\n\n")
        assert orjson.loads(first[len(b"data: ") : -2])["choices"][0]["delta"]["role"] == "assistant"
        assert engine.stats.generation_tokens > served  # its 10k-token prompt was computed already
        await resp.read()


async def test_stream_chunks_arrive_before_the_end(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    engine = cluster.engines["pd0"]
    body = {"model": MODEL, "prompt": "x" * 40, "max_tokens": 100_000 // 100, "stream": True}
    url = f"http://{cluster.address('pd0')}/v1/completions"
    async with session.post(url, data=orjson.dumps(body)) as resp:
        first = await resp.content.readuntil(b"\n\n")
        assert orjson.loads(first[len(b"data: ") : -2])["choices"][0]["text"] == "tok0"
        # The first chunk was flushed while the engine was still generating the rest.
        assert engine.num_running == 1


async def test_second_identical_prompt_hits_prefix_cache(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    engine = cluster.engines["pd0"]
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 2}
    _, _, first = await post(session, cluster.address("pd0"), "/v1/completions", body)
    computed_first = engine.stats.prefill_tokens_computed
    _, _, second = await post(session, cluster.address("pd0"), "/v1/completions", body)
    computed_second = engine.stats.prefill_tokens_computed - computed_first
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert computed_first == prompt_tokens
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (len(LONG_PROMPT) // 64) * 16  # every full block
    assert computed_second == prompt_tokens - cached < computed_first
    assert engine.stats.cached_tokens_hit == cached
    text = await metrics(session, cluster.address("pd0"))
    assert sample(text, "vllm:prefix_cache_hits_total") == cached
    assert sample(text, "vllm:prefix_cache_queries_total") == 2 * prompt_tokens
    assert sample(text, "vllm:prompt_tokens_total") == 2 * prompt_tokens


async def test_cache_hit_is_capped_below_the_prompt_length(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": "y" * 128, "max_tokens": 1}  # exactly two full blocks
    await post(session, cluster.address("pd0"), "/v1/completions", body)
    _, _, second = await post(session, cluster.address("pd0"), "/v1/completions", body)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 31  # vLLM computes >= 1 token


async def test_requests_wait_when_kv_is_full(session: aiohttp.ClientSession) -> None:
    # 8 blocks of 16 tokens: only a couple of ~40-token requests fit at once.
    spec = EngineSpec(name="tiny", role="prefill-decode", num_gpu_blocks=8, time=TimeModel(speed=2.0))
    async with SimCluster([spec]) as c:
        engine = c.engines["tiny"]
        address = c.address("tiny")
        bodies = [{"model": MODEL, "prompt": f"{i} " * 80, "max_tokens": 24} for i in range(6)]
        tasks = [asyncio.create_task(post(session, address, "/v1/completions", b)) for b in bodies]
        seen_waiting: list[float] = []

        async def waiting_in_metrics() -> bool:
            text = await metrics(session, address)
            seen_waiting.append(sample(text, "vllm:num_requests_waiting"))
            return seen_waiting[-1] > 0 and sample(text, "vllm:kv_cache_usage_perc") > 0.5

        await eventually(waiting_in_metrics)
        assert engine.kv_blocks_used <= spec.num_gpu_blocks
        assert engine.num_running < len(bodies)
        results = await asyncio.gather(*tasks)
        assert [status for status, _, _ in results] == [200] * len(bodies)
        assert all(data["usage"]["completion_tokens"] == 24 for _, _, data in results)
        assert engine.num_waiting == engine.num_running == engine.kv_blocks_used == 0
        assert engine.stats.requests_served == len(bodies)


async def test_prompt_longer_than_kv_capacity_is_rejected(session: aiohttp.ClientSession) -> None:
    spec = EngineSpec(name="tiny", role="prefill-decode", num_gpu_blocks=2, time=FAST)
    async with SimCluster([spec]) as c:
        body = {"model": MODEL, "prompt": "z" * 200, "max_tokens": 4}
        status, _, data = await post(session, c.address("tiny"), "/v1/completions", body)
    assert status == 400
    assert "maximum context length" in data["error"]["message"]


async def test_metrics_exposition_parses_with_vllm_names(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    await post(session, cluster.address("pd0"), "/v1/completions", {"model": MODEL, "prompt": "hi"})
    text = await metrics(session, cluster.address("pd0"))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:cache_config_info": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
    }
    for name, kind in expected.items():
        assert families[name].type == kind, name
        for s in families[name].samples:
            assert s.labels["model_name"] == MODEL and s.labels["engine"] == "0"
    [info] = families["vllm:cache_config_info"].samples
    assert info.value == 1
    assert info.labels["block_size"] == "16"
    assert info.labels["num_gpu_blocks"] == "2048"
    assert info.labels["enable_prefix_caching"] == "True"
    [success] = families["vllm:request_success"].samples
    assert success.labels["finished_reason"] == "length" and success.value == 1
    assert sample(text, "vllm:generation_tokens_total") == 16
    ttft = {s.name: s for s in families["vllm:time_to_first_token_seconds"].samples}
    assert ttft["vllm:time_to_first_token_seconds_count"].value == 1
    assert ttft["vllm:time_to_first_token_seconds_sum"].value > 0


def remote_decode_params() -> dict[str, Any]:
    """What a router sends with the prefill leg (vLLM's NIXL request shape)."""
    return dict(PREFILL_KV_TRANSFER_PARAMS)


def p_data_params(data: dict[str, Any]) -> dict[str, Any]:
    return {"kv_transfer_params": data["kv_transfer_params"]}


async def test_two_leg_prefill_decode(cluster: SimCluster, session: aiohttp.ClientSession) -> None:
    prefill, decode = cluster.engines["p0"], cluster.engines["d0"]
    request = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 6}
    prefill_leg = {**request, "max_tokens": 1, "stream": False, "kv_transfer_params": remote_decode_params()}
    status, _, p_data = await post(session, cluster.address("p0"), "/v1/completions", prefill_leg)
    assert status == 200
    params = p_data["kv_transfer_params"]
    prompt_tokens = p_data["usage"]["prompt_tokens"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "p0"
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == prefill.port
    assert params["tp_size"] == 1
    assert len(params["remote_block_ids"]) == -(-prompt_tokens // 16)
    assert all(isinstance(b, int) for b in params["remote_block_ids"])
    assert prefill.stats.prefill_tokens_computed == prompt_tokens

    decode_leg = {**request, "stream": True, "kv_transfer_params": params}
    url = f"http://{cluster.address('d0')}/v1/completions"
    async with session.post(
        url, data=orjson.dumps({**decode_leg, "stream_options": {"include_usage": True}})
    ) as r:
        assert r.status == 200
        events = await sse_events(r)
    usage = orjson.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 6
    locally = decode.stats.prefill_tokens_computed
    assert decode.stats.remote_prefills_received == 1
    assert decode.stats.remote_prefill_fallbacks == 0
    assert 0 < locally < 16  # only the partial tail block is recomputed
    assert usage["prompt_tokens_details"]["cached_tokens"] == prompt_tokens - locally
    # The transferred blocks now live in the decode engine's prefix cache (multi-turn reuse).
    plain = {**request, "max_tokens": 1}
    _, _, again = await post(session, cluster.address("pd0"), "/v1/completions", plain)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a different engine
    assert decode.cached_blocks >= len(LONG_PROMPT) // 64
    first_transfer = decode.stats.kv_tokens_transferred
    assert first_transfer == len(params["remote_block_ids"]) * 16
    # Next turn on the same decode engine: its own cache already holds every full block.
    _, _, p_data = await post(session, cluster.address("p0"), "/v1/completions", prefill_leg)
    await post(session, cluster.address("d0"), "/v1/completions", {**request, **p_data_params(p_data)})
    assert decode.stats.remote_prefills_received == 2
    assert decode.stats.kv_tokens_transferred - first_transfer == 16  # only the partial tail block


async def test_decode_leg_waits_for_kv_while_holding_blocks(session: aiohttp.ClientSession) -> None:
    transfer = asyncio.Event()

    def slow_link(a: str, b: str) -> tuple[float, float]:
        transfer.set()
        return (3600.0, 25e9)  # never completes within the test: the request stays in transfer

    specs = [EngineSpec(name="p", role="prefill", time=FAST), EngineSpec(name="d", role="decode", time=FAST)]
    async with SimCluster(specs, link_cost=slow_link) as c:
        request = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 2}
        prefill_leg = {**request, "max_tokens": 1, "kv_transfer_params": remote_decode_params()}
        _, _, p_data = await post(session, c.address("p"), "/v1/completions", prefill_leg)
        decode_leg = {**request, "kv_transfer_params": p_data["kv_transfer_params"]}
        task = asyncio.create_task(post(session, c.address("d"), "/v1/completions", decode_leg))
        await asyncio.wait_for(transfer.wait(), 10)
        engine = c.engines["d"]
        assert engine.num_waiting == 1 and engine.num_running == 0
        assert engine.kv_blocks_used > 0
        text = await metrics(session, c.address("d"))
        assert sample(text, "vllm:num_requests_waiting") == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await eventually(lambda: engine.kv_blocks_used == 0 and engine.num_waiting == 0)


async def test_decode_leg_with_dead_remote_recomputes(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    decode = cluster.engines["d0"]
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [1, 2, 3],
        "remote_engine_id": "nobody",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "tp_size": 1,
    }
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 2, "kv_transfer_params": params}
    status, _, data = await post(session, cluster.address("d0"), "/v1/completions", body)
    assert status == 200
    assert decode.stats.remote_prefill_fallbacks == 1
    assert decode.stats.remote_prefills_received == 0
    assert decode.stats.prefill_tokens_computed == data["usage"]["prompt_tokens"]


async def test_role_violations_are_400(cluster: SimCluster, session: aiohttp.ClientSession) -> None:
    base = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    status, _, data = await post(
        session,
        cluster.address("d0"),
        "/v1/completions",
        {**base, "kv_transfer_params": remote_decode_params()},
    )
    assert status == 400
    assert set(data["error"]) == {"message", "type", "param", "code"}
    remote = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_port": cluster.engines["p0"].port}
    status, _, _ = await post(
        session, cluster.address("p0"), "/v1/completions", {**base, "kv_transfer_params": remote}
    )
    assert status == 400
    # A plain request is fine on every role.
    for name in ("p0", "d0", "pd0"):
        status, _, _ = await post(session, cluster.address(name), "/v1/completions", base)
        assert status == 200


@pytest.mark.parametrize(
    ("path", "raw", "status"),
    [
        ("/v1/completions", b'{"model": "other", "prompt": "x"}', 404),
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", b'{"model": "sim-model"}', 400),
        ("/v1/chat/completions", b'{"model": "sim-model", "prompt": "x"}', 400),
        ("/v1/completions", b'{"model": "sim-model", "prompt": "x", "max_tokens": 0}', 400),
        ("/v1/completions", b'{"model": "sim-model", "prompt": "x", "stream": "yes"}', 400),
    ],
)
async def test_bad_requests(
    cluster: SimCluster, session: aiohttp.ClientSession, path: str, raw: bytes, status: int
) -> None:
    url = f"http://{cluster.address('pd0')}{path}"
    async with session.post(url, data=raw, headers={"X-Request-Id": "bad"}) as resp:
        assert resp.status == status
        assert resp.headers["X-Request-Id"] == "bad"
        error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status


async def test_models_and_health(cluster: SimCluster, session: aiohttp.ClientSession) -> None:
    address = cluster.address("pd0")
    async with session.get(f"http://{address}/v1/models") as resp:
        data = await resp.json()
    assert data["object"] == "list"
    assert data["data"][0]["id"] == MODEL and data["data"][0]["object"] == "model"
    async with session.get(f"http://{address}/health") as resp:
        assert resp.status == 200
        assert await resp.read() == b""


async def test_kill_cuts_stream_and_revive_serves_on_same_port(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    old: SimEngine = cluster.engines["pd0"]
    address = cluster.address("pd0")
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 100_000 // 50, "stream": True}
    with pytest.raises(aiohttp.ClientError):
        async with session.post(f"http://{address}/v1/completions", data=orjson.dumps(body)) as resp:
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")
            await cluster.kill("pd0")
            while True:
                chunk = await resp.content.readuntil(b"\n\n")
                assert chunk != b"data: [DONE]\n\n", "stream finished although the engine was killed"
    assert not old.alive
    with pytest.raises(aiohttp.ClientConnectionError):
        async with session.get(f"http://{address}/health") as resp:
            await resp.read()

    await cluster.revive("pd0")
    new = cluster.engines["pd0"]
    assert new is not old and new.port == old.port and cluster.address("pd0") == address
    status, _, _ = await post(session, address, "/v1/completions", {"model": MODEL, "prompt": "hello"})
    assert status == 200
    assert new.stats.requests_served == 1


async def test_stall_delays_responses(cluster: SimCluster, session: aiohttp.ClientSession) -> None:
    engine = cluster.engines["pd0"]
    url = f"http://{cluster.address('pd0')}/metrics"
    engine.set_stall(30.0)
    with pytest.raises(asyncio.TimeoutError):
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=0.2)) as resp:
            await resp.read()
    engine.set_stall(0.0)
    async with session.get(url) as resp:
        assert resp.status == 200


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="role"):
        EngineSpec(name="x", role="both")
    with pytest.raises(ValueError, match="speed"):
        TimeModel(speed=0)
    with pytest.raises(ValueError, match="unique"):
        SimCluster([EngineSpec(name="x", role="decode"), EngineSpec(name="x", role="prefill")])


async def test_kv_growth_preempts_and_streams_stay_consistent(session: aiohttp.ClientSession) -> None:
    # Two 40-token prompts growing to 80 tokens each need 10 blocks; only 8 exist, so one is preempted
    # (recompute) and must resume its stream without repeating or skipping a token.
    spec = EngineSpec(name="tiny", role="prefill-decode", num_gpu_blocks=8, time=TimeModel(speed=1.0))
    async with SimCluster([spec]) as c:
        engine = c.engines["tiny"]
        url = f"http://{c.address('tiny')}/v1/completions"

        async def stream(i: int) -> list[str]:
            body = {"model": MODEL, "prompt": f"{i} " * 80, "max_tokens": 40, "stream": True}
            async with session.post(url, data=orjson.dumps(body)) as resp:
                events = await sse_events(resp)
            return [orjson.loads(e)["choices"][0]["text"] for e in events[:-1]]

        results = await asyncio.gather(*(stream(i) for i in range(3)))
        expected = ["tok0"] + [f" tok{i}" for i in range(1, 40)]
        assert results == [expected] * 3
        assert engine.stats.preemptions >= 1
        assert engine.stats.generation_tokens == 3 * 40
        assert engine.kv_blocks_used == 0 and engine.num_running == engine.num_waiting == 0
        assert engine.cached_blocks <= spec.num_gpu_blocks


async def test_run_sim_serves_until_cancelled(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="simulator.engine")
    task = asyncio.create_task(run_sim([EngineSpec(name="solo", role="prefill-decode", time=FAST)]))

    async def announced() -> bool:
        return any("sim engine solo role=prefill-decode" in r.getMessage() for r in caplog.records)

    await eventually(announced)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert any("sim engine solo stopped" in r.getMessage() for r in caplog.records)


async def test_running_requests_share_prompt_blocks_like_vllm(session: aiohttp.ClientSession) -> None:
    spec = EngineSpec(name="e", role="prefill-decode", time=TimeModel(speed=2.0))
    async with SimCluster([spec]) as c:
        engine = c.engines["e"]
        body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 200, "stream": True}

        async def first_line() -> aiohttp.ClientResponse:
            resp = await session.post(f"http://{c.address('e')}/v1/completions", json=body)
            await resp.content.readline()
            return resp

        one = await first_line()
        alone = engine.kv_blocks_used
        two = await first_line()
        assert engine.num_running == 2
        # The second request adds only its private tail and generated blocks, not the ~31 prompt blocks.
        assert engine.kv_blocks_used - alone < 5 < alone
        one.close()
        two.close()
        await eventually(lambda: engine.num_running == 0)
        assert engine.kv_blocks_used == 0


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "x"},
                    {"type": "image_url"},
                    {"type": "text", "text": "y"},
                ],
            }
        ],
        [{"role": "assistant", "content": None}, {"role": "user", "content": ""}],
    ],
)
def test_the_simulated_chat_template_renders_as_the_router_flattens(messages) -> None:
    # The router's approximate index and the engine's prefix cache see the same prompt text, so
    # benchmarks compare routing, not two renderings. (The engine has its own code for it.)
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from router.request.parse import prompt_text
    from simulator.engine import CHAT_TEMPLATE

    rendered = (
        ImmutableSandboxedEnvironment(keep_trailing_newline=True)
        .from_string(CHAT_TEMPLATE)
        .render(messages=messages)
    )
    assert rendered == prompt_text({"messages": messages})


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/messages",
            {
                "model": "sim-model",
                "max_tokens": 4,
                "system": [{"type": "text", "text": "be brief"}],
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}],
                    },
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                    },
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": "42"}],
                    },
                ],
            },
        ),
        ("/v1/responses", {"instructions": "be brief", "input": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_the_engine_renders_messages_and_responses_bodies_as_the_router_reads_them(
    path: str, body: dict
) -> None:
    from router.request.parse import parse_request
    from router.request.types import RequestLimits

    engine = SimEngine(EngineSpec("e0", "prefill-decode"))
    routed = parse_request(
        orjson.dumps(body), RequestLimits(1 << 20, 1 << 20, 16, 16, 4.0), path=path, pool_model="m"
    )
    assert engine._chat_text(body, path.rsplit("/", 1)[-1]) == routed.prompt
