"""Where each Responses answer was given: a bounded memory, shared between replicas through Redis."""

from __future__ import annotations

from helpers import eventually
from redis.asyncio import Redis

from loadtests.servers.redis import RedisServer
from router.state.response_homes import ResponseHomes
from router.state.shared_homes import SharedHomes


def test_the_oldest_answers_are_forgotten_first() -> None:
    homes = ResponseHomes(max_entries=2)
    homes.remember("resp_1", "e0")
    homes.remember("resp_2", "e1")
    homes.remember("resp_1", "e0")  # used again: now the newest
    homes.remember("resp_3", "e2")
    assert (homes.home("resp_1"), homes.home("resp_2"), homes.home("resp_3")) == ("e0", None, "e2")
    assert len(homes) == 2


async def test_one_replica_learns_another_s_answers_and_redis_trouble_only_counts(
    redis: RedisServer, redis_client: Redis
) -> None:
    def replica() -> tuple[ResponseHomes, SharedHomes]:
        homes = ResponseHomes()
        homes.shared = SharedHomes(redis_client, "t", ttl_s=60.0, timeout_s=0.5)
        return homes, homes.shared

    (a, a_shared), (b, b_shared) = replica(), replica()
    a.remember("resp_1", "e2")
    await eventually(lambda: not a_shared.writes_pending, 5, "the write done")
    assert b.home("resp_1") is None
    await b.look_up("resp_1")
    assert b.home("resp_1") == "e2"
    await b.look_up("resp_unknown")
    assert b.home("resp_unknown") is None and b_shared.errors == 0

    redis.kill()
    await b.look_up("resp_2")  # never raises: no home, one failure counted
    a.remember("resp_3", "e0")  # kept locally, the write fails in the background
    await eventually(lambda: not a_shared.writes_pending, 5, "the failed write done")
    assert b.home("resp_2") is None and b_shared.errors == 1
    assert a.home("resp_3") == "e0" and a_shared.errors == 1
