"""Two router replicas sharing gate results through a real redis-server: one canary per group
epoch, not per replica, and both admit the same groups; without Redis each gates on its own."""

from __future__ import annotations

import contextlib

import pytest
from helpers import eventually, router_for

from loadtests.servers.redis import RedisServer
from router.control.gate import CANARY_HEADER
from simulator.engine import EngineSpec, SimCluster, TimeModel

pytestmark = pytest.mark.integration


def canaries(cluster: SimCluster, name: str) -> int:
    return sum(1 for _, headers in cluster.engines[name].arrivals if CANARY_HEADER in headers)


def sections(cluster: SimCluster, redis_port: int | None) -> dict:
    endpoints = [{"address": cluster.address(n), "name": n} for n in cluster.engines]
    data: dict = {
        "endpoints": endpoints,
        "gate": {"checks": ["ranks", "kv_capacity", "canary"], "canary_min_interval_s": 0},
    }
    if redis_port is not None:
        data["index"] = {"redis": {"url": f"redis://127.0.0.1:{redis_port}/0"}}
    return data


async def test_replicas_share_one_canary_per_group_epoch(redis: RedisServer) -> None:
    specs = [EngineSpec(n, "prefill-decode", time=TimeModel(speed=20.0)) for n in ("e0", "e1")]
    async with SimCluster(specs) as cluster, contextlib.AsyncExitStack() as stack:
        apps = [
            (await stack.enter_async_context(router_for(sections(cluster, redis.port))))[0] for _ in range(2)
        ]
        for app in apps:
            assert {r.state.value for r in app.control.groups.values()} == {"admitted"}
        assert canaries(cluster, "e0") == 1 and canaries(cluster, "e1") == 1
        second = apps[1].control.groups["e0"].checks
        assert second and "(replica " in second[-1].detail  # the verdict came from the first replica
        # A failure is shared too: both replicas keep the failing engine out.
        cluster.engines["e1"].set_failing(500)
        for app in apps:
            app.control.regate("e1")
        for app in apps:
            await eventually(lambda a=app: a.control.groups["e1"].state.value == "failed", 5, "e1 failed")
        assert canaries(cluster, "e1") == 2  # one more canary for the re-gate, not one per replica


async def test_without_redis_each_replica_gates_on_its_own() -> None:
    specs = [EngineSpec("e0", "prefill-decode", time=TimeModel(speed=20.0))]
    async with SimCluster(specs) as cluster, contextlib.AsyncExitStack() as stack:
        for _ in range(2):
            await stack.enter_async_context(router_for(sections(cluster, None)))
        assert canaries(cluster, "e0") == 2


async def test_redis_going_away_does_not_block_admission(redis: RedisServer) -> None:
    specs = [EngineSpec("e0", "prefill-decode", time=TimeModel(speed=20.0))]
    async with SimCluster(specs) as cluster:
        redis.kill()
        async with router_for(sections(cluster, redis.port)) as (app, _):
            assert app.control.groups["e0"].state.value == "admitted"
            assert canaries(cluster, "e0") == 1


async def test_a_verdict_stored_as_the_claim_is_released_is_not_missed(redis: RedisServer) -> None:
    """The holder stores its verdict and then releases its claim; a replica waiting for it that
    read "no verdict yet" just before the one and "no claim" just after the other must take that
    verdict, not gate again (a second canary for one epoch)."""
    import time

    from redis.asyncio import Redis

    from router.control.shared import SharedGateResults, SharedVerdict

    client = Redis(host="127.0.0.1", port=redis.port)
    holder, waiter = SharedGateResults(client, "pool"), SharedGateResults(client, "pool")
    try:
        assert await holder.claim("g", "fp")
        reads = 0
        get = waiter.get

        async def get_then_finish(group: str, fingerprint: str) -> SharedVerdict | None:
            nonlocal reads
            reads += 1
            verdict = await get(group, fingerprint)
            if reads == 1:  # between this read and the claim check, the holder finishes
                failed = SharedVerdict(False, "canary failed", [], holder.replica, time.time())
                await holder.put("g", "fp", failed)
            return verdict

        waiter.get = get_then_finish  # type: ignore[method-assign]
        verdict = await waiter.wait("g", "fp", newer_than=time.time() - 60)
        assert verdict is not None and (verdict.ok, verdict.by) == (False, holder.replica)
    finally:
        await client.aclose()
