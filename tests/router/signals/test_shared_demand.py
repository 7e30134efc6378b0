"""Arrival rates shared between router replicas through a real Redis (``router/signals/shared.py``):
the others' fresh rates are added, stale or malformed entries dropped, and Redis going away
leaves each replica counting its own."""

from __future__ import annotations

import pytest
from helpers import Clock
from redis.asyncio import Redis

from loadtests.servers.redis import RedisServer
from router.signals.shared import Rates, SharedDemand

pytestmark = pytest.mark.integration


async def test_each_replica_adds_the_others_fresh_rates(redis_client: Redis) -> None:
    clock = Clock()
    a, b, c = (SharedDemand(redis_client, "pool", stale_after_s=3.0, clock=clock) for _ in range(3))
    await a.exchange(Rates(1000.0, 2.0, 400.0))
    await b.exchange(Rates(500.0, 1.0, 100.0))
    await c.exchange(Rates(0.0, 0.0, 0.0))
    assert (c.others, c.replicas) == (Rates(1500.0, 3.0, 500.0), 3)
    await a.exchange(Rates(2000.0, 4.0, 800.0))  # a replica's newest rates replace its older ones
    assert (a.others, a.replicas) == (Rates(500.0, 1.0, 100.0), 3)
    await b.exchange(Rates(500.0, 1.0, 100.0))
    assert b.others == Rates(2000.0, 4.0, 800.0)
    assert await redis_client.pttl("pool:demand") > 0  # the hash expires once nobody writes


async def test_a_replica_that_stops_writing_drops_out_and_its_entry_goes(redis_client: Redis) -> None:
    clock = Clock()
    a = SharedDemand(redis_client, "pool", stale_after_s=3.0, clock=clock)
    b = SharedDemand(redis_client, "pool", stale_after_s=3.0, clock=clock)
    await a.exchange(Rates(1000.0, 2.0, 400.0))
    clock.now += 2.0
    await b.exchange(Rates(10.0, 1.0, 10.0))
    assert b.others == Rates(1000.0, 2.0, 400.0)
    clock.now += 2.0  # a last wrote 4 s ago: killed, or cut off from Redis
    await b.exchange(Rates(10.0, 1.0, 10.0))
    assert (b.others, b.replicas) == (Rates(), 1)
    assert await redis_client.hkeys("pool:demand") == [b.board.replica.encode()]


async def test_a_malformed_entry_is_ignored_and_removed(redis_client: Redis) -> None:
    await redis_client.hset("pool:demand", "junk", b"{not json")
    await redis_client.hset("pool:demand", "short", b'{"at": 1000.0, "rates": [1.0]}')
    a = SharedDemand(redis_client, "pool", stale_after_s=3.0, clock=Clock())
    await a.exchange(Rates(1.0, 1.0, 1.0))
    assert (a.others, a.replicas) == (Rates(), 1)
    assert await redis_client.hkeys("pool:demand") == [a.board.replica.encode()]


async def test_pools_sharing_a_redis_keep_apart_by_namespace(redis_client: Redis) -> None:
    clock = Clock()
    qwen = SharedDemand(redis_client, "qwen", stale_after_s=3.0, clock=clock)
    llama = SharedDemand(redis_client, "llama", stale_after_s=3.0, clock=clock)
    await qwen.exchange(Rates(1000.0, 2.0, 400.0))
    await llama.exchange(Rates(5.0, 1.0, 5.0))
    assert (llama.others, llama.replicas) == (Rates(), 1)


async def test_redis_going_away_leaves_each_replica_its_own_rates(
    redis: RedisServer, redis_client: Redis
) -> None:
    clock = Clock()
    a = SharedDemand(redis_client, "pool", stale_after_s=3.0, clock=clock, timeout_s=0.3)
    b = SharedDemand(redis_client, "pool", stale_after_s=3.0, clock=clock, timeout_s=0.3)
    await a.exchange(Rates(1000.0, 2.0, 400.0))
    await b.exchange(Rates(10.0, 1.0, 10.0))
    assert b.replicas == 2
    redis.kill()
    await b.exchange(Rates(10.0, 1.0, 10.0))  # never raises: the tick goes on
    assert (b.others, b.replicas, b.board.errors) == (Rates(), 1, 1)
    redis.start()
    await a.exchange(Rates(1000.0, 2.0, 400.0))
    await b.exchange(Rates(10.0, 1.0, 10.0))
    assert (b.others, b.replicas) == (Rates(1000.0, 2.0, 400.0), 2)
