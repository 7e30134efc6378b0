"""Two router replicas sharing one Redis: each routes on what the other sent where; Redis can go away."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest
from helpers import eventually, keep_busy, router_for

from loadtests.servers.redis import RedisServer
from simulator.engine import EngineSpec, SimCluster, TimeModel

pytestmark = pytest.mark.integration

PROMPT = "a long shared system prompt about routing " * 40


def _sections(cluster: SimCluster, redis: RedisServer, push: bool = True) -> dict:
    endpoints = [{"address": cluster.address(name), "name": name} for name in cluster.engines]
    # A loaded CI machine can stall a round trip past the default 50 ms, and these tests are about
    # what the replicas share, not about the timeout.
    redis_section = {"url": f"redis://127.0.0.1:{redis.port}/0", "lookup_timeout_ms": 2000, "push": push}
    return {"endpoints": endpoints, "index": {"redis": redis_section}}


async def _ask(http: aiohttp.ClientSession, base: str, prompt: str) -> tuple[str, str]:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
    async with http.post(f"{base}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-pd-router-decode"], resp.headers["x-pd-router-reason"]


@pytest.mark.parametrize("push", [True, False], ids=["pushed", "asked"])
async def test_a_replica_routes_on_what_the_other_replica_sent_where(redis: RedisServer, push: bool) -> None:
    specs = [EngineSpec(f"e{i}", "prefill-decode", time=TimeModel(speed=20)) for i in range(4)]
    async with SimCluster(specs) as cluster, aiohttp.ClientSession() as http:
        sections = _sections(cluster, redis, push)
        async with router_for(sections) as (a, base_a), router_for(sections) as (b, base_b):
            first, _ = await _ask(http, base_a, PROMPT)
            assert await a.parts.shared.flush()  # replica A's writes are in Redis (and published)
            if push:  # B applies them to its own view as they come, and asks Redis for nothing
                await eventually(lambda: b.parts.shared.applied_pushes > 0, 5, "B applied A's writes")
            # The client can have its answer before A releases the request: until A says so, B
            # would count A's finished prompt as still queued on `first`.
            await eventually(lambda: not a.parts.pool.inflight_requests.any(), 5, "A released")
            await a.parts.shared_load.exchange()
            # B never routed this prompt: only what A shared can tell it that `first` holds it.
            chosen, reason = await _ask(http, base_b, PROMPT + " question")
            assert chosen == first
            cached = int(reason.split(": ")[1].split("/")[0])
            assert cached >= len(PROMPT) // 4 - 16
            assert b.parts.shared.pushed == push  # pushed: B answered from its own view, no round trip


async def test_a_replica_counts_what_the_other_has_in_flight(redis: RedisServer) -> None:
    specs = [EngineSpec(f"e{i}", "prefill-decode", time=TimeModel(speed=1)) for i in range(2)]
    async with SimCluster(specs) as cluster, aiohttp.ClientSession() as http:
        sections = _sections(cluster, redis)
        async with router_for(sections) as (_, base_a), router_for(sections) as (b, _):
            body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 400, "stream": True}
            async with http.post(f"{base_a}/v1/completions", json=body) as resp:  # decoding for seconds
                assert resp.status == 200
                name = resp.headers["x-pd-router-decode"]
                slot = b.parts.pool.endpoints[name].slot

                def seen_by_b() -> int:
                    return int(b.parts.pool.candidates(np.array([slot])).inflight_requests[0])

                await eventually(lambda: seen_by_b() == 1, 5, "B counts A's request on its pod")
                assert b.parts.pool.inflight_requests[slot] == 0  # as A's, not as its own
                assert b.parts.shared_load.replicas == 2
                await resp.read()
            await eventually(lambda: seen_by_b() == 0, 5, "B stops counting it once it ended")


async def test_redis_stopping_and_coming_back_fails_no_request(redis: RedisServer) -> None:
    specs = [EngineSpec(f"e{i}", "prefill-decode", time=TimeModel(speed=20)) for i in range(3)]
    async with (
        SimCluster(specs) as cluster,
        aiohttp.ClientSession() as http,
        router_for(_sections(cluster, redis)) as (app, base),
    ):

        async def load(n: int, tag: str) -> None:
            for i in range(n):
                await _ask(http, base, f"{tag} {i % 5} " * 50)

        await load(10, "before")
        redis.kill()
        await asyncio.gather(load(10, "during"), load(10, "during-too"))  # every one answered 200
        assert not app.parts.shared.healthy
        redis.restart()
        await eventually(lambda: app.parts.shared.healthy, 10, "shared index back on Redis")
        await load(10, "after")


async def test_shared_index_health_is_exported(redis: RedisServer) -> None:
    specs = [EngineSpec("e0", "prefill-decode", time=TimeModel(speed=20))]
    async with (
        SimCluster(specs) as cluster,
        aiohttp.ClientSession() as http,
        router_for(_sections(cluster, redis)) as (_, base),
        http.get(f"{base}/metrics") as resp,
    ):
        assert "pd_router_shared_index_healthy 1.0" in await resp.text()


@pytest.mark.parametrize("share", [True, False])
async def test_keda_reading_either_replica_sees_the_pool_s_demand(redis: RedisServer, share: bool) -> None:
    """KEDA keeps one connection per scaler address, so behind one Service it reads one replica:
    with every request routed by replica A, replica B's recommendation must still be the pool's
    (through the Redis both share). Without sharing, B recommends for the nothing it routed."""
    import grpc

    from router.adapters.keda import externalscaler_pb2 as pb

    specs = [
        EngineSpec(n, role, time=TimeModel(speed=20)) for n, role in (("p0", "prefill"), ("d0", "decode"))
    ]
    async with SimCluster(specs) as cluster, aiohttp.ClientSession() as http:
        sections = {
            "endpoints": [
                {"address": cluster.address(s.name), "name": s.name, "role": s.role} for s in specs
            ],
            "index": {"redis": {"url": f"redis://127.0.0.1:{redis.port}/0"}},
            # The router's model: prefill is slow, so 40 prompts/s of ~1k tokens need many replicas.
            "engine": {"prefill_tokens_per_s": 2000.0},
            "signals": {
                "tick_ms": 50,
                "level_window_s": 2.0,
                "trend_window_s": 8.0,
                "share_demand": share,
            },
            "keda": {"enabled": True, "port": 0},
        }
        async with router_for(sections) as (a, base_a), router_for(sections) as (b, _):

            async def one(i: int) -> None:
                body = {"model": "sim-model", "prompt": f"request {i} " + "words " * 800, "max_tokens": 2}
                async with http.post(f"{base_a}/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()

            for start in range(0, 40, 8):
                await asyncio.gather(*(one(i) for i in range(start, start + 8)))
            await eventually(
                lambda: a.parts.scaling.latest["prefill"].recommended > 2, 10, "A asking for prefill"
            )
            async with grpc.aio.insecure_channel(f"127.0.0.1:{b.keda.port}") as channel:
                get_metrics = channel.unary_unary(
                    "/externalscaler.ExternalScaler/GetMetrics",
                    request_serializer=lambda m: m.SerializeToString(),
                    response_deserializer=pb.GetMetricsResponse.FromString,
                )
                ref = pb.ScaledObjectRef(
                    name="prefill",
                    namespace="llm",
                    scalerMetadata={"role": "prefill", "signal": "recommendedReplicas"},
                )

                async def b_recommends() -> float:
                    answer = await get_metrics(pb.GetMetricsRequest(scaledObjectRef=ref))
                    return answer.metricValues[0].metricValueFloat

                if share:
                    await eventually(
                        lambda: b_recommends_above(b_recommends, 2), 10, "B recommending for A's arrivals"
                    )
                    # Both entries fresh on the board (a loaded machine can read it between A's
                    # publishes, when A's entry has just aged: polled, not read once).
                    await eventually(
                        lambda: b.parts.scaling.shared.replicas == 2, 10, "B seeing both replicas"
                    )
                else:
                    ticks = b.parts.scaling.clock()
                    await eventually(lambda: b.parts.scaling.clock() > ticks + 0.5, 5, "B ticking")
                    # B counts no arrivals (it may still see the engines' queues, as A does).
                    assert b.parts.scaling.shared is None and b.parts.scaling.own_rates.requests == 0
                    assert await b_recommends() < a.parts.scaling.latest["prefill"].recommended


async def b_recommends_above(read: object, n: float) -> bool:
    return await read() > n  # type: ignore[operator]


async def test_a_responses_follow_up_reaching_the_other_replica_goes_to_the_stored_answer_s_pod(
    redis: RedisServer,
) -> None:
    specs = [
        EngineSpec(f"e{i}", "prefill-decode", num_gpu_blocks=1024, time=TimeModel(speed=20)) for i in range(3)
    ]
    async with SimCluster(specs) as cluster, aiohttp.ClientSession() as http:
        sections = _sections(cluster, redis)
        async with router_for(sections) as (a, base_a), router_for(sections) as (b, base_b):
            first = {"model": "sim-model", "instructions": "Be brief. " * 30, "input": "First?"}
            async with http.post(f"{base_a}/v1/responses", json=first) as resp:
                home = resp.headers["x-pd-router-decode"]
                answer_id = (await resp.json())["id"]
            shared = a.parts.pool.response_homes.shared
            await eventually(lambda: not shared.writes_pending, 5, "A's write done")
            long = await keep_busy(http, cluster, b, home)  # B's load alone would go elsewhere
            follow = {"model": "sim-model", "input": "And then?", "previous_response_id": answer_id}
            async with http.post(f"{base_b}/v1/responses", json=follow) as resp:
                assert resp.status == 200 and resp.headers["x-pd-router-decode"] == home
                await resp.read()
            async with http.post(
                f"{base_b}/v1/responses", json={"model": "sim-model", "input": "x?"}
            ) as resp:
                assert resp.headers["x-pd-router-decode"] != home  # without the id, load decides
                await resp.read()
            long.cancel()


async def test_a_session_keeps_its_home_across_a_router_restart(redis: RedisServer) -> None:
    """A replica started after the one that routed a session's first turn (a restart, or another
    replica) reads the session's home from Redis and sends the next turn there, though that pod is
    busy and the index (one block per engine here) remembers nothing of the conversation."""
    specs = [
        EngineSpec(f"e{i}", "prefill-decode", num_gpu_blocks=2048, time=TimeModel(speed=20)) for i in range(3)
    ]
    system = "You are a careful assistant who answers in full sentences. " * 120
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Hello?"}]
    then = [*first, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "More."}]
    session = {"x-session-id": "chat-7"}
    async with SimCluster(specs) as cluster, aiohttp.ClientSession() as http:
        sections = _sections(cluster, redis)
        sections["index"]["capacity_blocks_per_endpoint"] = 1
        body = {"model": "sim-model", "messages": first, "max_tokens": 2}
        async with router_for(sections) as (a, base_a):
            async with http.post(f"{base_a}/v1/chat/completions", json=body, headers=session) as resp:
                assert resp.status == 200
                home = resp.headers["x-pd-router-decode"]
            shared = a.parts.pool.sessions.shared
            await eventually(lambda: a.parts.pool.sessions.home("h:chat-7") is not None, 5, "A kept it")
            await eventually(lambda: not shared.writes_pending, 5, "A's write done")
        async with router_for(sections) as (b, base_b):
            long = await keep_busy(http, cluster, b, home)  # B's load alone would go elsewhere
            body = {"model": "sim-model", "messages": then, "max_tokens": 2}
            async with http.post(f"{base_b}/v1/chat/completions", json=body, headers=session) as resp:
                assert resp.status == 200 and resp.headers["x-pd-router-decode"] == home
            async with http.post(f"{base_b}/v1/chat/completions", json=body) as resp:
                assert resp.headers["x-pd-router-decode"] != home  # without the session: load decides
            assert b.parts.pool.sessions.routes["home"] == 1
        long.cancel()


async def test_a_stored_response_fetched_through_the_other_replica_s_ext_proc_goes_to_its_pod(
    redis: RedisServer,
) -> None:
    """Behind Envoy a ``GET /v1/responses/{id}`` has no body: the replica that routes it reads the
    answer's home from Redis before its headers are routed (the one that saw the answer wrote it)."""
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    specs = [
        EngineSpec(f"e{i}", "prefill-decode", num_gpu_blocks=1024, time=TimeModel(speed=20)) for i in range(3)
    ]
    async with SimCluster(specs) as cluster, aiohttp.ClientSession() as http:
        sections = {**_sections(cluster, redis), "extproc": {"enabled": True, "port": 0, "health_port": 0}}
        async with router_for(sections) as (a, base_a), router_for(sections) as (b, _):
            async with http.post(
                f"{base_a}/v1/responses", json={"model": "sim-model", "input": "Hi?"}
            ) as resp:
                home = resp.headers["x-pd-router-decode"]
                answer_id = (await resp.json())["id"]
            shared = a.parts.pool.response_homes.shared
            await eventually(lambda: not shared.writes_pending, 5, "A's write done")
            long = await keep_busy(http, cluster, b, home)  # B's load alone would go elsewhere
            header = base_pb2.HeaderValue
            get = pb.ProcessingRequest(
                request_headers=pb.HttpHeaders(
                    headers=base_pb2.HeaderMap(
                        headers=[
                            header(key=":method", raw_value=b"GET"),
                            header(key=":path", raw_value=f"/v1/responses/{answer_id}".encode()),
                        ]
                    ),
                    end_of_stream=True,
                )
            )
            async with grpc.aio.insecure_channel(f"127.0.0.1:{b.extproc_port}") as channel:
                (answer,) = [r async for r in pb_grpc.ExternalProcessorStub(channel).Process(iter([get]))]
            routing = {
                h.header.key: h.header.raw_value.decode() or h.header.value
                for h in answer.request_headers.response.header_mutation.set_headers
            }
            assert routing["x-gateway-destination-endpoint"] == cluster.address(home)
            long.cancel()
