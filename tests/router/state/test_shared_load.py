"""Reservations shared between router replicas through a real Redis (``router/state/shared_load.py``):
each replica's candidates carry what the others have in flight, a replica that stops writing drops
out, and Redis going away leaves each routing on its own view."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
from helpers import Clock, eventually
from redis.asyncio import Redis

from loadtests.servers.redis import RedisServer
from router.request.types import RouteRequest
from router.scheduling.producers import FreshLoad
from router.server.config import EndpointConfig
from router.state.pool import Pool
from router.state.shared_load import SharedLoad

pytestmark = pytest.mark.integration


def replica_pool(*order: str) -> Pool:
    """A replica's pool: the same endpoints, in whatever slots this replica gave them."""
    pool = Pool()
    for name in order:
        address = f"127.0.0.1:{8000 + int(name[1:])}"
        pool.add(EndpointConfig(name=name, address=address, role="prefill-decode"))
    return pool


def load_on(pool: Pool, name: str) -> tuple[float, float, int]:
    cand = pool.candidates(np.array([pool.endpoints[name].slot]))
    return (
        float(cand.queued_prefill_tokens[0]),
        float(cand.reserved_kv_tokens[0]),
        int(cand.inflight_requests[0]),
    )


def request() -> RouteRequest:
    return RouteRequest("m", 4, 8, np.zeros(0, dtype=np.uint64), {})


async def poll(check: Callable[[], Awaitable[bool]], deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if await check():
            return True
    return False


async def test_a_replica_sees_what_the_others_have_in_flight_by_endpoint_not_by_slot(
    redis_client: Redis,
) -> None:
    clock = Clock()
    pool_a, pool_b = replica_pool("e0", "e1"), replica_pool("e1", "e0")  # slots differ
    a = SharedLoad(redis_client, "pool", pool_a, interval_s=0.05, clock=clock)
    b = SharedLoad(redis_client, "pool", pool_b, interval_s=0.05, clock=clock)
    e0 = pool_a.endpoints["e0"].slot
    pool_a.reserve(e0, None, prefill_tokens=3000.0, kv_tokens=3500.0)
    held = pool_b.reserve(pool_b.endpoints["e1"].slot, None, prefill_tokens=100.0, kv_tokens=200.0)
    await a.exchange()
    await b.exchange()
    assert load_on(pool_b, "e0") == (3000.0, 3500.0, 1)  # A's request, as B sees e0
    assert load_on(pool_b, "e1") == (100.0, 200.0, 1)  # B's own
    await a.exchange()
    assert load_on(pool_a, "e1") == (100.0, 200.0, 1)
    assert (a.replicas, b.replicas) == (2, 2)
    await redis_client.config_resetstat()
    await b.exchange()
    # Written, kept alive and read back in one command: a replica exchanges a few times a request.
    assert (await redis_client.info("commandstats"))["cmdstat_evalsha"]["calls"] == 1
    held.release()  # B's request ended: A stops counting it at its next exchange
    await b.exchange()
    await a.exchange()
    assert load_on(pool_a, "e1") == (0.0, 0.0, 0)
    assert load_on(pool_a, "e0") == (3000.0, 3500.0, 1)  # its own is never doubled
    assert await redis_client.pttl("pool:load") > 0  # the hash expires once nobody writes


async def test_a_replica_that_stops_writing_drops_out_and_its_entry_goes(redis_client: Redis) -> None:
    clock = Clock()
    pool_a, pool_b = replica_pool("e0"), replica_pool("e0")
    a = SharedLoad(redis_client, "pool", pool_a, interval_s=0.05, clock=clock)
    b = SharedLoad(redis_client, "pool", pool_b, interval_s=0.05, clock=clock)
    pool_a.reserve(pool_a.endpoints["e0"].slot, None, prefill_tokens=500.0, kv_tokens=600.0)
    await a.exchange()
    await b.exchange()
    assert load_on(pool_b, "e0") == (500.0, 600.0, 1)
    clock.now += b.board.stale_after_s + 0.1  # A was killed with its request in flight
    await b.exchange()
    assert load_on(pool_b, "e0") == (0.0, 0.0, 0)
    assert b.replicas == 1
    assert await redis_client.hkeys("pool:load") == [b.board.replica.encode()]


async def test_malformed_entries_and_unknown_endpoints_are_skipped(redis_client: Redis) -> None:
    clock = Clock()
    pool_b = replica_pool("e0")
    b = SharedLoad(redis_client, "pool", pool_b, interval_s=0.05, clock=clock)
    await redis_client.hset("pool:load", "garbage", b"not json")
    await redis_client.hset(
        "pool:load", "other", b'{"at": 1000.0, "load": {"e9": [1, 2, 3], "e0": [4, 5, 6]}}'
    )
    await b.exchange()
    assert load_on(pool_b, "e0") == (4.0, 5.0, 6)  # e9 is not in this replica's pool (yet)
    assert b"garbage" not in await redis_client.hkeys("pool:load")


async def test_without_redis_each_replica_routes_on_its_own_view(redis: RedisServer) -> None:
    pool_b = replica_pool("e0")
    client = Redis(host="127.0.0.1", port=redis.port, socket_timeout=0.5)
    b = SharedLoad(client, "pool", pool_b, interval_s=0.05, timeout_s=0.5)
    await client.hset("pool:load", "other", b'{"at": 9e18, "load": {"e0": [4, 5, 6]}}')  # never stale
    await b.exchange()
    assert load_on(pool_b, "e0") == (4.0, 5.0, 6)
    redis.kill()
    await b.exchange()
    assert load_on(pool_b, "e0") == (0.0, 0.0, 0)  # the others' share is dropped, not frozen
    assert (b.board.errors, b.replicas) == (1, 1)
    await client.aclose()


async def test_an_exchange_survives_a_redis_that_forgot_its_scripts(redis_client: Redis) -> None:
    pool_a, pool_b = replica_pool("e0"), replica_pool("e0")
    a = SharedLoad(redis_client, "pool", pool_a, interval_s=0.05)
    b = SharedLoad(redis_client, "pool", pool_b, interval_s=0.05)
    pool_a.reserve(pool_a.endpoints["e0"].slot, None, prefill_tokens=11.0, kv_tokens=22.0)
    await a.exchange()
    await redis_client.script_flush()  # as after a Redis restart: EVALSHA answers NOSCRIPT
    await b.exchange()
    assert load_on(pool_b, "e0") == (11.0, 22.0, 1)
    assert (a.board.errors, b.board.errors, b.board.down) == (0, 0, False)


async def test_a_change_is_told_at_once_not_at_the_next_interval(redis_client: Redis) -> None:
    pool_a, pool_b = replica_pool("e0"), replica_pool("e0")
    a = SharedLoad(redis_client, "pool", pool_a, interval_s=30.0)  # the heartbeat alone would take 30 s
    b = SharedLoad(redis_client, "pool", pool_b, interval_s=30.0)
    pool_a.on_reserve = a.reserved
    await a.exchange()  # A announces itself,
    await b.exchange()  # B finds A,
    await a.exchange()  # and A finds B (at their heartbeats): neither is alone
    task = asyncio.create_task(a.run())
    try:
        pool_a.reserve(pool_a.endpoints["e0"].slot, None, prefill_tokens=700.0, kv_tokens=800.0)

        async def b_sees_it() -> bool:
            await asyncio.sleep(0.01)  # past b's min_gap_s, as a next request would be
            await b.refresh()  # what the producer runs before b's next pick
            return load_on(pool_b, "e0") == (700.0, 800.0, 1)

        assert await poll(b_sees_it, 5.0), "B never saw A's reservation"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_what_a_replica_gives_back_goes_with_its_next_exchange(redis_client: Redis) -> None:
    pool_a, pool_b = replica_pool("e0"), replica_pool("e0")
    a = SharedLoad(redis_client, "pool", pool_a, interval_s=30.0, min_gap_s=0.0)  # no heartbeat here
    b = SharedLoad(redis_client, "pool", pool_b, interval_s=30.0, min_gap_s=0.0)
    pool_a.on_reserve = a.reserved
    await a.exchange()
    await b.exchange()
    await a.exchange()  # each knows of the other
    task = asyncio.create_task(a.run())
    try:
        held = pool_a.reserve(pool_a.endpoints["e0"].slot, None, prefill_tokens=700.0, kv_tokens=800.0)
        assert a._grew.is_set()  # a pick is told at once

        async def b_sees_the_pick() -> bool:
            await b.refresh()  # A's loop writes on its own: B sees it once that write lands
            return load_on(pool_b, "e0") == (700.0, 800.0, 1)

        assert await poll(b_sees_the_pick, 5.0), "B never saw A's pick"
        assert not a._grew.is_set()  # A's loop took it
        held.finish_prefill()
        held.release()
        assert not a._grew.is_set()  # giving back asks for no exchange of its own
        await b.refresh()
        assert load_on(pool_b, "e0") == (700.0, 800.0, 1)  # B overestimates A for a moment
        await a.refresh()  # A's next pick (or heartbeat) carries it
        await b.refresh()
        assert load_on(pool_b, "e0") == (0.0, 0.0, 0)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_lone_replica_tells_nobody_its_changes_until_another_appears(redis_client: Redis) -> None:
    pool_a, pool_b = replica_pool("e0"), replica_pool("e0")
    a = SharedLoad(redis_client, "pool", pool_a, interval_s=30.0, min_gap_s=0.0)  # no heartbeat here
    pool_a.on_reserve = a.reserved
    producer = FreshLoad(a, timeout_s=0.5)
    exchanges = 0
    real = a.board.exchange

    async def counted(own: object, *, read: bool = True) -> object:
        nonlocal exchanges
        exchanges += 1
        return await real(own, read=read)

    a.board.exchange = counted  # type: ignore[method-assign]
    assert producer.wanted(request())  # who else is there is not known yet
    await a.refresh()  # the first pick's: nobody else wrote
    assert (a.alone, exchanges, a.replicas) == (True, 1, 1)
    assert not producer.wanted(request())  # nothing to wait for before a pick
    task = asyncio.create_task(a.run())
    try:
        pool_a.reserve(pool_a.endpoints["e0"].slot, None, prefill_tokens=10.0, kv_tokens=20.0)
        await a.refresh()
        await eventually(lambda: not a._grew.is_set(), what="the loop taking the change")
        # A second change is taken only once the loop waits again: after any exchange the first
        # one made (with another replica there, it would have written at once).
        a.reserved()
        await eventually(lambda: not a._grew.is_set(), what="the loop waiting again")
        assert exchanges == 1
        b = SharedLoad(redis_client, "pool", pool_b, interval_s=30.0)
        await b.exchange()  # B starts
        await a.exchange()  # A's heartbeat finds it
        assert (a.alone, a.replicas, exchanges) == (False, 2, 2)
        assert producer.wanted(request())
        pool_a.reserve(pool_a.endpoints["e0"].slot, None, prefill_tokens=30.0, kv_tokens=40.0)

        async def b_sees_both() -> bool:
            await b.refresh()
            return load_on(pool_b, "e0") == (40.0, 60.0, 2)

        await eventually(b_sees_both, what="A's reservations in B, told as they change")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_concurrent_refreshes_share_one_exchange(redis_client: Redis) -> None:
    pool = replica_pool("e0")
    shared = SharedLoad(redis_client, "pool", pool, interval_s=30.0)
    calls = 0
    real = shared.exchange

    async def counted() -> None:
        nonlocal calls
        calls += 1
        await real()

    shared.exchange = counted  # type: ignore[method-assign]
    await asyncio.gather(*(shared.refresh() for _ in range(10)))
    assert calls == 1


async def test_a_caller_that_gives_up_does_not_stop_later_exchanges(redis_client: Redis) -> None:
    pool = replica_pool("e0")
    shared = SharedLoad(redis_client, "pool", pool, interval_s=30.0, min_gap_s=0.0)
    await redis_client.hset("pool:load", "other", b'{"at": 9e18, "load": {}}')  # not alone: it reads
    slow = asyncio.Event()
    real, calls = shared.exchange, 0

    async def gated() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            await slow.wait()  # the first exchange outlives the producer's timeout
        await real()

    shared.exchange = gated  # type: ignore[method-assign]
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await shared.refresh()
    slow.set()
    await shared.refresh()  # waits for the first, which ends on its own
    await shared.refresh()
    await shared.refresh()
    assert calls == 3  # each later refresh ran an exchange of its own


async def test_pushed_reservations_arrive_without_a_read_and_a_refresh_waits_for_none(
    redis_client: Redis, redis: RedisServer
) -> None:
    pool_a, pool_b = replica_pool("e0", "e1"), replica_pool("e1", "e0")
    a = SharedLoad(redis_client, "pool", pool_a, interval_s=30.0, push=True)
    b = SharedLoad(redis_client, "pool", pool_b, interval_s=30.0, push=True)
    follower = asyncio.create_task(b.follow())
    observer = Redis(host="127.0.0.1", port=redis.port)
    try:
        await eventually(lambda: b.board.subscribed, what="B subscribed")
        pool_a.reserve(pool_a.endpoints["e1"].slot, None, prefill_tokens=900.0, kv_tokens=1000.0)
        await a.exchange()  # A's write, as its loop makes it when its reservations change
        await eventually(lambda: load_on(pool_b, "e1") == (900.0, 1000.0, 1), what="A's share in B")
        assert b.replicas == 2
        reads = (await observer.info("commandstats")).get("cmdstat_hgetall", {}).get("calls", 0)
        await b.refresh()  # what runs before B's pick: nothing to wait for
        assert (await observer.info("commandstats")).get("cmdstat_hgetall", {}).get("calls", 0) == reads
        held = pool_a.reserve(pool_a.endpoints["e0"].slot, None, prefill_tokens=50.0, kv_tokens=60.0)
        await a.exchange()
        await eventually(lambda: load_on(pool_b, "e0") == (50.0, 60.0, 1), what="A's next share")
        held.release()
        await a.exchange()
        await eventually(lambda: load_on(pool_b, "e0") == (0.0, 0.0, 0), what="A's release")
        assert load_on(pool_b, "e1") == (900.0, 1000.0, 1)
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        await observer.aclose()


async def test_an_older_pushed_entry_never_replaces_a_newer_one(redis_client: Redis) -> None:
    clock = Clock()
    pool_b = replica_pool("e0")
    b = SharedLoad(redis_client, "pool", pool_b, interval_s=30.0, clock=clock, push=True)
    b._pushed("a", clock.now, {"e0": [10.0, 20.0, 1.0]})
    b._pushed("a", clock.now - 0.01, {"e0": [99.0, 99.0, 9.0]})  # overtaken on the way
    assert load_on(pool_b, "e0") == (10.0, 20.0, 1)
    clock.now += b.board.stale_after_s + 0.1  # A went silent: its share goes with B's next look
    b._pushed("c", clock.now, {})
    assert load_on(pool_b, "e0") == (0.0, 0.0, 0)
    assert b.replicas == 2


async def test_while_pushed_a_change_is_written_without_reading_the_others(
    redis_client: Redis, redis: RedisServer
) -> None:
    pool_a, pool_b = replica_pool("e0"), replica_pool("e0")
    a = SharedLoad(redis_client, "pool", pool_a, interval_s=30.0, push=True)  # no heartbeat in the test
    b = SharedLoad(redis_client, "pool", pool_b, interval_s=30.0, push=True)
    pool_a.on_reserve = a.reserved
    tasks = [asyncio.create_task(a.follow()), asyncio.create_task(b.follow())]
    observer = Redis(host="127.0.0.1", port=redis.port)
    try:
        await eventually(lambda: a.pushed and b.pushed, what="both subscribed")
        tasks.append(asyncio.create_task(a.run()))
        reads = (await observer.info("commandstats")).get("cmdstat_hgetall", {}).get("calls", 0)
        pool_a.reserve(pool_a.endpoints["e0"].slot, None, prefill_tokens=70.0, kv_tokens=80.0)
        await eventually(lambda: load_on(pool_b, "e0") == (70.0, 80.0, 1), what="A's change in B")
        assert (await observer.info("commandstats")).get("cmdstat_hgetall", {}).get("calls", 0) == reads
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await observer.aclose()


@pytest.mark.parametrize("push", [True, False], ids=["pushed", "read"])
async def test_a_replica_that_leaves_is_counted_by_no_other_at_once(redis_client: Redis, push: bool) -> None:
    # Long intervals: what B sees of A after A leaves is A's empty entry, not A's entry gone stale.
    pool_a, pool_b = replica_pool("e0"), replica_pool("e0")
    a = SharedLoad(redis_client, "pool", pool_a, interval_s=30.0, push=push)
    b = SharedLoad(redis_client, "pool", pool_b, interval_s=30.0, push=push)
    follower = asyncio.create_task(b.follow()) if push else None
    try:
        if push:
            await eventually(lambda: b.board.subscribed, what="B subscribed")
        pool_a.reserve(pool_a.endpoints["e0"].slot, None, prefill_tokens=70.0, kv_tokens=80.0)
        await a.exchange()  # A's last exchange: a request in flight, as when it is stopped
        if not push:
            await b.exchange()
        await eventually(lambda: load_on(pool_b, "e0") == (70.0, 80.0, 1), what="A's share in B")
        await a.leave()
        late = SharedLoad(redis_client, "pool", replica_pool("e0"), interval_s=30.0, push=push)
        await late.exchange()  # a replica started right after A stopped reads nothing of it either
        assert load_on(late.pool, "e0") == (0.0, 0.0, 0)
        if not push:
            await b.exchange()
        await eventually(lambda: load_on(pool_b, "e0") == (0.0, 0.0, 0), what="A's share gone from B")
    finally:
        if follower is not None:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower


async def test_leaving_while_redis_is_down_waits_for_nothing(redis_client: Redis) -> None:
    shared = SharedLoad(redis_client, "pool", replica_pool("e0"), interval_s=30.0)
    calls = []

    async def exchange(own: object, *, read: bool = True) -> None:
        calls.append(own)

    shared.board.exchange = exchange  # type: ignore[method-assign]
    shared.board.down = True  # the last exchange failed: the stop would wait out its timeout
    await shared.leave()
    assert calls == []
    shared.board.down = False
    await shared.leave()
    assert calls == [{}]
