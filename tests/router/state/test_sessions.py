"""Session homes: bounded and aged, keyed by x-session-id (or an opted-in user), shared through Redis."""

from __future__ import annotations

from helpers import Clock, eventually, make_request
from redis.asyncio import Redis

from loadtests.servers.redis import RedisServer
from router.state.sessions import SessionHome, SessionHomes
from router.state.shared_homes import SharedHomes


def test_the_least_recently_used_session_is_forgotten_first_and_old_ones_expire() -> None:
    clock = Clock()
    homes = SessionHomes(max_entries=2, ttl_s=60.0, clock=clock)
    homes.remember("h:a", ("e0",), 100)
    homes.remember("h:b", ("e1",), 200)
    homes.remember("h:a", ("e0",), 300)  # a's next turn: a is the newest
    homes.remember("h:c", ("e2", "e3"), 400)
    assert homes.home("h:b") is None and len(homes) == 2
    assert homes.home("h:c") == SessionHome(("e2", "e3"), 400, 1000.0)
    clock.now += 61.0
    assert homes.home("h:a") is None and homes.home("h:c") is None


def test_x_session_id_is_a_session_user_only_when_opted_in_and_never_the_same_key() -> None:
    with_both = make_request(100, session_id="abc", user="abc")
    only_user = make_request(100, user="abc")
    assert SessionHomes(enabled=True).key_of(with_both) == ("h:abc", 1.0)
    assert SessionHomes(enabled=True).key_of(only_user) is None  # user_weight 0: user is ignored
    assert SessionHomes(enabled=True, user_weight=0.5).key_of(only_user) == ("u:abc", 0.5)
    assert SessionHomes(enabled=False).key_of(with_both) is None
    assert SessionHomes(enabled=True).key_of(make_request(100)) is None


def test_an_entry_reads_back_as_written_and_anything_else_is_no_entry() -> None:
    home = SessionHome(("10.0.0.1:8000", "d1"), 1234, 1767225600.25)
    assert SessionHome.decode(home.encode()) == home
    assert SessionHome.decode("garbage") is None
    assert SessionHome.decode("1.0|x|e0") is None
    assert SessionHome.decode("inf|10|e0") is None  # would win every comparison, never age out
    assert SessionHome.decode("nan|10|e0") is None
    assert SessionHome.decode("1.0|-5|e0") is None


async def test_another_replica_keeps_the_session_home_and_redis_trouble_only_counts(
    redis: RedisServer, redis_client: Redis
) -> None:
    clock = Clock()

    def replica() -> tuple[SessionHomes, SharedHomes]:
        homes = SessionHomes(enabled=True, clock=clock)
        homes.shared = SharedHomes(redis_client, "t", ttl_s=60.0, timeout_s=0.5, kind="session")
        return homes, homes.shared

    (a, a_shared), (b, b_shared) = replica(), replica()
    b.remember("h:s1", ("e0",), 100)  # b's own entry, older than a's next one
    await eventually(lambda: not b_shared.writes_pending, 5, "b's write done")
    clock.now += 1.0
    a.remember("h:s1", ("e2",), 900)
    await eventually(lambda: not a_shared.writes_pending, 5, "a's write done")
    await b.look_up("h:s1")
    assert b.home("h:s1") == SessionHome(("e2",), 900, 1001.0)  # the newer entry wins
    clock.now += 1.0
    b.remember("h:s1", ("e1",), 1000)
    await eventually(lambda: not b_shared.writes_pending, 5, "b's write done")
    await a.look_up("h:s1")
    assert a.home("h:s1") == SessionHome(("e1",), 1000, 1002.0)
    await a.look_up("h:unknown")
    assert a.home("h:unknown") is None and a_shared.errors == 0
    # An entry dated far ahead of this replica's clock would beat every newer turn: ignored.
    await redis_client.set("t:session:h:future", SessionHome(("e0",), 10, clock.now + 3600).encode())
    await a.look_up("h:future")
    assert a.home("h:future") is None

    redis.kill()
    await b.look_up("h:s1")  # never raises: the local entry stays, one failure counted
    assert b.home("h:s1") is not None and b_shared.errors == 1
