"""SharedPrefixIndex against a real redis-server: two replicas sharing blocks, clears, TTL, outages."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis
from helpers import eventually
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvindex.base import PrefixIndex
from kvindex.memory import MemoryPrefixIndex
from kvindex.redis_index import SharedPrefixIndex
from loadtests.servers.redis import RedisServer, available

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not available(), reason="redis-server binary not installed"),
]

LOGGER = "kvindex.redis_index"
NAMES = ["e0", "e1", "e2", "e3"]
# The same endpoints under different slot numbers on the two replicas (slots are per replica).
A_SLOTS = {name: i for i, name in enumerate(NAMES)}
B_SLOTS = {name: 20 - i for i, name in enumerate(NAMES)}


def keys(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def slots_of(table: dict[str, int], *names: str) -> np.ndarray:
    return np.array([table[n] for n in names], dtype=np.int32)


def client_for(server: RedisServer) -> aioredis.Redis:
    # No client-side retries: the index bounds every call and its probe is the retry.
    return aioredis.Redis(
        host=server.host,
        port=server.port,
        socket_connect_timeout=0.5,
        socket_timeout=0.5,
        retry=Retry(NoBackoff(), 0),
    )


def make_index(
    client: aioredis.Redis, table: dict[str, int], *, whole_prompts: bool = False, **kwargs: Any
) -> SharedPrefixIndex:
    """``whole_prompts``: a mirror fed whole prompts only, as the router's (Redis may bisect)."""
    by_slot = {slot: name for name, slot in table.items()}
    options: dict[str, Any] = {"flush_interval_s": 0.01, "probe_interval_s": 0.05, "lookup_timeout_s": 0.5}
    options.update(kwargs)
    return SharedPrefixIndex(
        client,
        MemoryPrefixIndex(4096, max_slots=64, whole_prompts=whole_prompts),
        slot_names=by_slot.__getitem__,
        slot_of=table.get,
        **options,
    )


@pytest.fixture
def server(redis: RedisServer) -> RedisServer:
    """A throwaway redis-server per test (``tests/conftest.py``)."""
    return redis


@pytest.fixture(scope="module")
def module_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    srv.start()
    yield srv
    srv.kill()


@pytest.fixture
async def clients(server: RedisServer) -> AsyncIterator[tuple[aioredis.Redis, aioredis.Redis]]:
    a, b = client_for(server), client_for(server)
    yield a, b
    await a.aclose()
    await b.aclose()


@pytest.fixture
async def pair(
    clients: tuple[aioredis.Redis, aioredis.Redis],
) -> AsyncIterator[tuple[SharedPrefixIndex, SharedPrefixIndex]]:
    a, b = make_index(clients[0], A_SLOTS), make_index(clients[1], B_SLOTS)
    await a.start()
    await b.start()
    yield a, b
    await a.close()
    await b.close()


def test_satisfies_the_prefix_index_protocol() -> None:
    index: PrefixIndex = make_index(aioredis.Redis(), A_SLOTS)
    assert index.match(keys(1), slots_of(A_SLOTS, "e0")).tolist() == [0]


async def test_block_recorded_by_one_replica_is_found_by_the_other(
    pair: tuple[SharedPrefixIndex, SharedPrefixIndex],
) -> None:
    a, b = pair
    prompt = keys(11, 12, 13, 14)
    a.record(A_SLOTS["e1"], prompt[:3])
    assert a.match(prompt, slots_of(A_SLOTS, "e0", "e1")).tolist() == [0, 3]  # mirror at once
    assert await a.flush()
    candidates = slots_of(B_SLOTS, "e0", "e1", "e2")
    assert b.match(prompt, candidates).tolist() == [0, 0, 0]  # B has not asked Redis yet
    assert (await b.lookup(prompt, candidates)).tolist() == [0, 3, 0]
    assert b.match(prompt, candidates).tolist() == [0, 3, 0]  # learned into B's mirror


async def test_the_background_task_flushes_without_being_asked(
    pair: tuple[SharedPrefixIndex, SharedPrefixIndex],
) -> None:
    a, b = pair
    a.record(A_SLOTS["e2"], keys(5, 6))

    async def visible() -> bool:
        return (await b.lookup(keys(5, 6), slots_of(B_SLOTS, "e2"))).tolist() == [2]

    await eventually(visible)
    assert a.pending == 0


async def test_a_gap_stops_the_match_inside_the_script(
    pair: tuple[SharedPrefixIndex, SharedPrefixIndex],
) -> None:
    a, b = pair
    prompt = keys(1, 2, 3, 4, 5)
    a.record(A_SLOTS["e0"], keys(1, 2, 4, 5))  # block 3 missing
    a.record(A_SLOTS["e1"], keys(2, 3, 4, 5))  # block 1 missing: nothing counts
    a.record(A_SLOTS["e2"], prompt)
    assert await a.flush()
    got = await b.lookup(prompt, slots_of(B_SLOTS, "e0", "e1", "e2", "e3"))
    assert got.tolist() == [2, 0, 5, 0]


async def test_cleared_on_one_replica_hides_the_old_blocks_from_both(
    pair: tuple[SharedPrefixIndex, SharedPrefixIndex],
) -> None:
    a, b = pair
    prompt = keys(7, 8, 9)
    a.record(A_SLOTS["e0"], prompt)
    a.record(A_SLOTS["e1"], prompt)
    assert await a.flush()
    b_cands = slots_of(B_SLOTS, "e0", "e1")
    assert (await b.lookup(prompt, b_cands)).tolist() == [3, 3]

    b.cleared(B_SLOTS["e0"])
    assert b.match(prompt, b_cands).tolist() == [0, 3]  # local at once
    assert await b.flush()
    assert (await a.lookup(prompt, slots_of(A_SLOTS, "e0", "e1"))).tolist() == [0, 3]
    assert a.match(prompt, slots_of(A_SLOTS, "e0", "e1")).tolist() == [0, 3]  # A's mirror too
    assert (await b.lookup(prompt, b_cands)).tolist() == [0, 3]

    # New blocks after the clear count again, for both.
    a.record(A_SLOTS["e0"], prompt[:1])
    assert await a.flush()
    assert (await b.lookup(prompt, b_cands)).tolist() == [1, 3]


async def test_removed_drops_single_blocks_everywhere(
    pair: tuple[SharedPrefixIndex, SharedPrefixIndex],
) -> None:
    a, b = pair
    prompt = keys(31, 32, 33, 34)
    a.stored(A_SLOTS["e3"], prompt)
    assert await a.flush()
    b_cand = slots_of(B_SLOTS, "e3")
    assert (await b.lookup(prompt, b_cand)).tolist() == [4]
    a.removed(A_SLOTS["e3"], keys(33))
    assert a.match(prompt, slots_of(A_SLOTS, "e3")).tolist() == [2]
    assert await a.flush()
    assert (await b.lookup(prompt, b_cand)).tolist() == [2]
    assert b.match(prompt, b_cand).tolist() == [2]  # B's mirror corrected by the lookup
    a.stored(A_SLOTS["e3"], keys(33))  # the engine cached it again: A writes it again, however lately
    assert await a.flush()
    assert (await b.lookup(prompt, b_cand)).tolist() == [4]


async def test_lookup_trusts_the_mirror_for_writes_not_flushed_yet(
    clients: tuple[aioredis.Redis, aioredis.Redis],
) -> None:
    a = make_index(clients[0], A_SLOTS)  # not started: nothing flushes behind our back
    prompt = keys(41, 42)
    a.record(A_SLOTS["e0"], prompt)
    assert (await a.lookup(prompt, slots_of(A_SLOTS, "e0"))).tolist() == [2]
    assert a.fallback_lookups == 0


async def test_ttl_expiry_removes_the_keys(clients: tuple[aioredis.Redis, aioredis.Redis]) -> None:
    raw = clients[0]
    a = make_index(raw, A_SLOTS, ttl_s=0.2)
    b = make_index(clients[1], B_SLOTS, ttl_s=0.2)
    a.record(A_SLOTS["e0"], keys(1, 2, 3))
    assert await a.flush()
    block_key = b"pdr:b:" + keys(1).astype(">u8").tobytes()
    assert await raw.exists(block_key) == 1
    assert await raw.pttl(block_key) > 0

    async def empty() -> bool:
        return await raw.dbsize() == 0

    await eventually(empty)  # every block key and the generation key are gone
    assert (await b.lookup(keys(1, 2, 3), slots_of(B_SLOTS, "e0"))).tolist() == [0]


async def test_write_queue_bound_drops_the_oldest_and_counts(
    clients: tuple[aioredis.Redis, aioredis.Redis],
) -> None:
    a = make_index(clients[0], A_SLOTS, max_pending=8)
    b = make_index(clients[1], B_SLOTS)
    e0 = A_SLOTS["e0"]
    a.record(e0, keys(1, 2, 3, 4))
    a.record(e0, keys(5, 6, 7, 8))
    a.record(e0, keys(9, 10, 11, 12))
    assert a.dropped_writes == 4
    assert a.pending == 8
    assert await a.flush()
    assert a.pending == 0
    cand = slots_of(B_SLOTS, "e0")
    assert (await b.lookup(keys(1, 2, 3, 4), cand)).tolist() == [0]  # the oldest write is lost
    assert (await b.lookup(keys(5, 6, 7, 8, 9, 10, 11, 12), cand)).tolist() == [8]


async def test_script_is_reloaded_after_script_flush(
    pair: tuple[SharedPrefixIndex, SharedPrefixIndex],
) -> None:
    a, b = pair
    a.record(A_SLOTS["e0"], keys(3, 4))
    assert await a.flush()
    assert (await b.lookup(keys(3, 4), slots_of(B_SLOTS, "e0"))).tolist() == [2]
    await b._client.script_flush()
    assert (await b.lookup(keys(3, 4), slots_of(B_SLOTS, "e0", "e1"))).tolist() == [2, 0]
    a.record(A_SLOTS["e1"], keys(3))
    assert await a.flush()  # the write script is reloaded as well
    assert (await b.lookup(keys(3, 4), slots_of(B_SLOTS, "e0", "e1"))).tolist() == [2, 1]
    assert b.redis_errors == 0 and b.healthy


async def server_count(client: aioredis.Redis, section: str, stat: str, field: str) -> int:
    """One counter of ``INFO <section>`` (0 while Redis has none): errors, or a command's calls."""
    stats = await client.info(section)
    return int(stats.get(stat, {}).get(field, 0))


async def noscript_errors(client: aioredis.Redis) -> int:
    return await server_count(client, "errorstats", "errorstat_NOSCRIPT", "count")


async def hsets(raw: aioredis.Redis) -> int:
    """HSETs Redis ran since the last CONFIG RESETSTAT: one per block an apply script wrote."""
    return await server_count(raw, "commandstats", "cmdstat_hset", "calls")


async def test_a_flush_of_one_script_call_is_one_round_trip(
    clients: tuple[aioredis.Redis, aioredis.Redis],
) -> None:
    raw = clients[1]
    a = make_index(clients[0], A_SLOTS)
    a.record(A_SLOTS["e1"], keys(9))
    assert await a.flush()  # the script is loaded now
    await raw.config_resetstat()
    a.record(A_SLOTS["e0"], keys(1, 2))
    a.drop_slot(A_SLOTS["e1"])  # a clear rides in the same call
    assert await a.flush()
    stats = await raw.info("commandstats")
    # EVALSHA alone: a pipeline would first ask SCRIPT EXISTS (one more round trip per flush).
    assert {k: v["calls"] for k, v in stats.items() if "script" in k or "eval" in k} == {"cmdstat_evalsha": 1}
    b = make_index(raw, B_SLOTS)
    assert (await b.lookup(keys(9), slots_of(B_SLOTS, "e0", "e1"))).tolist() == [0, 0]
    assert (await b.lookup(keys(1, 2), slots_of(B_SLOTS, "e0"))).tolist() == [2]


async def test_writes_after_script_flush_load_the_script_before_the_pipeline(
    clients: tuple[aioredis.Redis, aioredis.Redis],
) -> None:
    raw = clients[1]
    # One block per script call: 130 calls are three pipelines, each checked before it is sent.
    a = make_index(clients[0], A_SLOTS, batch_blocks=1)
    b = make_index(raw, B_SLOTS)
    a.record(A_SLOTS["e0"], keys(1))
    assert await a.flush()
    await raw.script_flush()
    await raw.config_resetstat()
    prompt = keys(*range(1, 131))
    a.record(A_SLOTS["e0"], prompt)
    assert await a.flush()
    # Loaded up front, not found missing by an EVALSHA that failed the whole pipeline and had to be resent.
    assert await noscript_errors(raw) == 0
    assert a.redis_errors == 0 and a.healthy
    # A lone lookup is not pipelined: it learns of the flush from one NOSCRIPT reply, loads, retries.
    assert (await b.lookup(prompt, slots_of(B_SLOTS, "e0"))).tolist() == [130]
    assert await noscript_errors(raw) == 1
    assert b.redis_errors == 0 and b.fallback_lookups == 0


# Holds the server for ~0.2 s: a script runs alone, so every other client waits for it.
BUSY_LUA = """
local t0 = redis.call('TIME')
while true do
  local t = redis.call('TIME')
  if (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > 200000 then return 1 end
end
"""


@pytest.mark.parametrize("batch_blocks", [1024, 1], ids=["one-call", "pipelined"])
async def test_flushes_that_time_out_leak_no_connection(server: RedisServer, batch_blocks: int) -> None:
    # Two connections at most: one leaked per timed-out flush would starve the client by the third.
    client = aioredis.Redis(
        host=server.host, port=server.port, max_connections=2, retry=Retry(NoBackoff(), 0)
    )
    blocker, reader = client_for(server), client_for(server)
    probes: list[aioredis.Redis] = []

    async def server_busy() -> bool:
        # A fresh connection's PING waits while the script runs: the server is blocked.
        probe = client_for(server)
        probes.append(probe)
        try:
            async with asyncio.timeout(0.01):
                await probe.ping()
        except TimeoutError:
            return True
        return False

    # A flush of one script call sends its EVALSHA alone; of several, a pipeline after SCRIPT EXISTS.
    a = make_index(client, A_SLOTS, write_timeout_s=0.05, batch_blocks=batch_blocks)
    b = make_index(reader, B_SLOTS)
    try:
        for i in range(3):
            a.record(A_SLOTS["e0"], keys(*range(50, 52 + i)))
            await client.ping()  # a connected connection in the pool, so the flush gets past connecting
            busy = asyncio.create_task(blocker.eval(BUSY_LUA, 0))
            await eventually(server_busy, 2, "the script holding the server")
            assert not await a.flush()  # the timeout fires while the server is held
            await busy
        assert await client.ping()
        assert await a.flush()
        assert (await b.lookup(keys(50, 51, 52, 53), slots_of(B_SLOTS, "e0"))).tolist() == [4]
    finally:
        for c in (client, blocker, reader, *probes):
            await c.aclose()


async def test_redis_outage_falls_back_to_the_mirror_then_resyncs(
    server: RedisServer,
    pair: tuple[SharedPrefixIndex, SharedPrefixIndex],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    a, b = pair
    prompt = keys(21, 22, 23, 24)
    a.record(A_SLOTS["e0"], prompt[:2])
    assert await a.flush()
    a_cands = slots_of(A_SLOTS, "e0", "e1")

    server.kill()
    a.record(A_SLOTS["e1"], prompt)  # written while Redis is gone: stays queued
    for _ in range(20):
        assert (await a.lookup(prompt, a_cands)).tolist() == [2, 4]
    assert not a.healthy
    assert a.fallback_lookups >= 19
    assert a.redis_errors >= 1
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "local-only" in warnings[0].getMessage()

    b_cands = slots_of(B_SLOTS, "e0", "e1")
    assert (await b.lookup(prompt, b_cands)).tolist() == [0, 0]  # B never learned: its mirror is empty
    assert not b.healthy

    server.restart()  # same port, empty: only the resync can bring the blocks back

    async def both_healthy() -> bool:
        return a.healthy and b.healthy

    await eventually(both_healthy)
    assert a.resyncs == 1
    assert (await b.lookup(prompt, b_cands)).tolist() == [2, 4]
    assert b.match(prompt, b_cands).tolist() == [2, 4]
    assert b.fallback_lookups == 1
    infos = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]
    assert any("shared again" in m for m in infos)


async def test_start_with_redis_down_is_local_only_until_it_comes_up(tmp_path: Path) -> None:
    srv = RedisServer(tmp_path)  # port chosen, not started
    client = client_for(srv)
    a = make_index(client, A_SLOTS)
    await a.start()
    try:
        assert not a.healthy
        a.record(A_SLOTS["e0"], keys(1, 2))
        assert (await a.lookup(keys(1, 2), slots_of(A_SLOTS, "e0"))).tolist() == [2]
        srv.start()

        async def healthy() -> bool:
            return a.healthy

        await eventually(healthy)
        assert await client.dbsize() >= 3  # two blocks and the generation key
    finally:
        await a.close()
        await client.aclose()
        srv.kill()


def test_memory_index_slot_keys_and_remove_as_used_here() -> None:
    index = MemoryPrefixIndex(8)
    index.record(0, keys(1, 2, 3))
    index.record(1, keys(2))
    assert index.slot_keys(0) == [3, 2, 1]  # least recent first
    assert index.slot_keys(5) == []
    index.remove(0, keys(2, 9))
    assert index.match(keys(1, 2, 3), np.array([0, 1])).tolist() == [1, 0]
    assert index.match(keys(2), np.array([0, 1])).tolist() == [0, 1]
    assert len(index) == 3
    index.remove(7, keys(1))  # unknown slot: no-op


# -- model check ---------------------------------------------------------------------------------

UNIVERSE = 6  # block keys 1..6; prompts are orderings of a few of them
_op = st.one_of(
    st.tuples(
        st.just("record"), st.integers(0, 1), st.sampled_from(NAMES), st.lists(st.integers(1, UNIVERSE))
    ),
    st.tuples(
        st.just("removed"), st.integers(0, 1), st.sampled_from(NAMES), st.lists(st.integers(1, UNIVERSE))
    ),
    st.tuples(st.just("cleared"), st.integers(0, 1), st.sampled_from(NAMES), st.just([])),
    st.tuples(
        st.just("lookup"),
        st.integers(0, 1),
        st.just(""),
        st.lists(st.integers(1, UNIVERSE), min_size=1, max_size=6),
    ),
)


def reference(held: dict[str, set[int]], prompt: list[int]) -> list[int]:
    out = []
    for name in NAMES:
        depth = 0
        while depth < len(prompt) and prompt[depth] in held[name]:
            depth += 1
        out.append(depth)
    return out


def check_against_reference(
    server: RedisServer, ops: list[tuple[str, int, str, list[int]]], *, whole_prompts: bool = False
) -> None:
    """Two replicas apply ``ops`` in order; every lookup must answer what ``reference`` does."""

    async def scenario() -> None:
        raw = client_for(server)
        await raw.flushdb()
        clients = [client_for(server), client_for(server)]
        tables = [A_SLOTS, B_SLOTS]
        replicas = [  # no task: explicit flush
            make_index(c, t, whole_prompts=whole_prompts) for c, t in zip(clients, tables, strict=True)
        ]
        held: dict[str, set[int]] = {name: set() for name in NAMES}
        try:
            for kind, r, name, blocks in ops:
                index, table = replicas[r], tables[r]
                if kind == "record":
                    index.record(table[name], keys(*blocks))
                    held[name].update(blocks)
                elif kind == "removed":
                    index.removed(table[name], keys(*blocks))
                    held[name].difference_update(blocks)
                elif kind == "cleared":
                    index.cleared(table[name])
                    held[name].clear()
                if kind != "lookup":
                    # Flushed at once so Redis sees the writes in the model's order: two replicas'
                    # unflushed writes race by up to one flush interval, by design.
                    assert await index.flush()
                else:
                    got = await index.lookup(keys(*blocks), slots_of(table, *NAMES))
                    assert got.tolist() == reference(held, blocks), (kind, r, blocks)
            assert all(index.redis_errors == 0 for index in replicas)
        finally:
            for c in [raw, *clients]:
                await c.aclose()

    asyncio.run(scenario())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, max_size=25))
def test_lookup_equals_a_naive_reference(
    module_server: RedisServer, ops: list[tuple[str, int, str, list[int]]]
) -> None:
    check_against_reference(module_server, ops)


# -- the bisecting lookup (an index fed whole prompts, as the router's) ----------------------------

# Block keys are chained (a key determines its prefix), so prompts are prefixes of a few documents:
# B shares A's first 6 blocks, C shares nothing.
DOCUMENTS = {
    "A": list(range(1, 41)),
    "B": list(range(1, 7)) + list(range(101, 135)),
    "C": list(range(201, 241)),
}
_whole = st.one_of(
    st.tuples(
        st.just("record"),
        st.integers(0, 1),
        st.sampled_from(NAMES),
        st.sampled_from(sorted(DOCUMENTS)),
        st.integers(1, 40),
    ),
    st.tuples(st.just("cleared"), st.integers(0, 1), st.sampled_from(NAMES), st.just("A"), st.just(0)),
    st.tuples(
        st.just("lookup"),
        st.integers(0, 1),
        st.just(""),
        st.sampled_from(sorted(DOCUMENTS)),
        st.integers(1, 40),
    ),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_whole, max_size=20))
def test_a_whole_prompt_index_bisects_to_the_walks_answer(
    module_server: RedisServer, ops: list[tuple[str, int, str, str, int]]
) -> None:
    prompts = [(kind, r, name, DOCUMENTS[doc][:length]) for kind, r, name, doc, length in ops]
    check_against_reference(module_server, prompts, whole_prompts=True)


async def hgetalls(client: aioredis.Redis) -> int:
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_hgetall", {}).get("calls", 0))


async def test_a_whole_prompt_lookup_probes_a_few_blocks_not_every_one(server: RedisServer) -> None:
    """256 blocks held whole by two endpoints and half by a third: the walk reads every block, the
    bisection the two ends and about log2(256) in between per depth."""
    client = client_for(server)
    prompt = keys(*range(1, 257))
    walking, bisecting = make_index(client, A_SLOTS), make_index(client, B_SLOTS, whole_prompts=True)
    try:
        walking.record(A_SLOTS["e0"], prompt)
        walking.record(A_SLOTS["e1"], prompt)
        walking.record(A_SLOTS["e2"], prompt[:128])
        assert await walking.flush()
        costs = []
        for index, table in ((walking, A_SLOTS), (bisecting, B_SLOTS)):
            before = await hgetalls(client)
            got = await index.lookup(prompt, slots_of(table, *NAMES))
            costs.append(await hgetalls(client) - before)
            assert got.tolist() == [256, 256, 128, 0]
        assert costs[0] == 256
        assert costs[1] <= 12, costs
    finally:
        await client.aclose()


async def test_many_distinct_depths_hand_over_to_the_walk(server: RedisServer) -> None:
    client = client_for(server)
    table = {f"d{i}": i for i in range(16)}
    prompt = keys(*range(1, 65))
    writer, reader = make_index(client, table), make_index(client, table, whole_prompts=True)
    try:
        for i, name in enumerate(table):
            writer.record(table[name], prompt[: 4 * i + 1])  # 16 different depths
        assert await writer.flush()
        got = await reader.lookup(prompt, np.arange(16, dtype=np.int32))
        assert got.tolist() == [4 * i + 1 for i in range(16)]
    finally:
        await client.aclose()


async def test_removed_blocks_make_the_index_walk_for_good(server: RedisServer) -> None:
    """A KV event removes a block from the middle: bisecting would see blocks 1 and 5 and say 5."""
    client = client_for(server)
    index = make_index(client, A_SLOTS, whole_prompts=True)
    try:
        index.record(A_SLOTS["e0"], keys(1, 2, 3, 4, 5))
        index.removed(A_SLOTS["e0"], keys(3))
        assert await index.flush()
        got = await index.lookup(keys(1, 2, 3, 4, 5), slots_of(A_SLOTS, "e0"))
        assert got.tolist() == [2]
    finally:
        await client.aclose()


# -- push: replicas publish their flushes and apply each other's ------------------------------------


async def lookup_scripts(client: aioredis.Redis) -> int:
    """Lookup and apply scripts Redis has run (EVALSHA): a lookup that asks Redis adds one."""
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


@pytest.fixture
async def pushed_pair(
    clients: tuple[aioredis.Redis, aioredis.Redis],
) -> AsyncIterator[tuple[SharedPrefixIndex, SharedPrefixIndex]]:
    a = make_index(clients[0], A_SLOTS, whole_prompts=True, push=True)
    b = make_index(clients[1], B_SLOTS, whole_prompts=True, push=True)
    await a.start()
    await b.start()
    await eventually(lambda: a.pushed and b.pushed, what="both subscribed to an empty Redis")
    yield a, b
    await a.close()
    await b.close()


async def test_a_pushed_write_reaches_the_other_mirror_and_its_lookup_asks_redis_nothing(
    pushed_pair: tuple[SharedPrefixIndex, SharedPrefixIndex], server: RedisServer
) -> None:
    a, b = pushed_pair
    prompt = keys(31, 32, 33, 34)
    candidates = slots_of(B_SLOTS, "e0", "e1", "e2")
    a.record(A_SLOTS["e1"], prompt[:3])
    await eventually(lambda: b.match(prompt, candidates).tolist() == [0, 3, 0], what="A's write in B")
    observer = client_for(server)
    before = await lookup_scripts(observer)
    assert (await b.lookup(prompt, candidates)).tolist() == [0, 3, 0]
    assert await lookup_scripts(observer) == before  # answered by the mirror: no round trip
    assert b.pushed_lookups == 1 and b.applied_pushes >= 1
    await observer.aclose()


async def test_a_pushed_clear_and_removal_reach_the_other_mirror(
    pushed_pair: tuple[SharedPrefixIndex, SharedPrefixIndex],
) -> None:
    a, b = pushed_pair
    prompt = keys(41, 42, 43, 44)
    candidates = slots_of(B_SLOTS, "e0", "e3")
    a.record(A_SLOTS["e0"], prompt)
    a.record(A_SLOTS["e3"], prompt)
    await eventually(lambda: b.match(prompt, candidates).tolist() == [4, 4], what="both prompts in B")
    a.cleared(A_SLOTS["e0"])
    a.removed(A_SLOTS["e3"], prompt[2:3])
    await eventually(
        lambda: b.match(prompt, candidates).tolist() == [0, 2], what="the clear and removal in B"
    )


async def test_a_replica_started_while_redis_holds_blocks_asks_redis_until_they_expired(
    clients: tuple[aioredis.Redis, aioredis.Redis],
) -> None:
    a = make_index(clients[0], A_SLOTS, whole_prompts=True, push=True, ttl_s=1.0)
    await a.start()
    prompt = keys(51, 52, 53)
    a.record(A_SLOTS["e2"], prompt)
    assert await a.flush()
    b = make_index(clients[1], B_SLOTS, whole_prompts=True, push=True, ttl_s=1.0)
    await b.start()
    try:
        candidates = slots_of(B_SLOTS, "e2")
        assert not b.pushed  # Redis holds a block written before B subscribed
        assert (await b.lookup(prompt, candidates)).tolist() == [3]  # so B still asks
        assert b.pushed_lookups == 0
        await eventually(lambda: b.pushed, timeout_s=5.0, what="one ttl after B subscribed")
        a.record(A_SLOTS["e1"], prompt[:1])  # from now on A's writes come to B
        await eventually(lambda: b.match(prompt, slots_of(B_SLOTS, "e1")).tolist() == [1])
    finally:
        await a.close()
        await b.close()


async def test_a_malformed_push_is_ignored_and_the_next_one_applies(
    pushed_pair: tuple[SharedPrefixIndex, SharedPrefixIndex],
    server: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    a, b = pushed_pair
    other = client_for(server)
    await other.publish("pdr:w", b"\x00\x00\x00\x01" + b"1" + b"a\x00\x09")  # a cut-off op
    await eventually(lambda: any("malformed push" in r.getMessage() for r in caplog.records))
    assert b.pushed
    a.record(A_SLOTS["e0"], keys(61, 62))
    await eventually(lambda: b.match(keys(61, 62), slots_of(B_SLOTS, "e0")).tolist() == [2])
    await other.aclose()


async def test_push_stops_while_redis_is_away_and_resumes_a_ttl_after_it_is_back(
    clients: tuple[aioredis.Redis, aioredis.Redis], server: RedisServer
) -> None:
    a = make_index(clients[0], A_SLOTS, whole_prompts=True, push=True, ttl_s=1.0)
    b = make_index(clients[1], B_SLOTS, whole_prompts=True, push=True, ttl_s=1.0)
    await a.start()
    await b.start()
    try:
        await eventually(lambda: a.pushed and b.pushed, what="both subscribed to an empty Redis")
        server.kill()
        a.record(A_SLOTS["e0"], keys(71, 72))
        await eventually(lambda: not a.pushed, what="A's flush to fail")
        await eventually(lambda: not b.pushed, what="B's subscription to drop")
        server.restart()
        # Pushes may have been lost meanwhile, and A's queued write lands: each asks Redis again
        # until what it holds has expired.
        await eventually(lambda: a.healthy and b._warm_at is not None, what="both back")
        assert not b.pushed
        assert (await b.lookup(keys(71, 72), slots_of(B_SLOTS, "e0"))).tolist() == [2]
        await eventually(lambda: a.pushed and b.pushed, timeout_s=5.0, what="pushed one ttl later")
        a.record(A_SLOTS["e1"], keys(81, 82))
        await eventually(lambda: b.match(keys(81, 82), slots_of(B_SLOTS, "e1")).tolist() == [2])
    finally:
        await a.close()
        await b.close()


def test_a_malformed_push_applies_nothing_of_itself() -> None:
    sender = make_index(aioredis.Redis(), A_SLOTS, whole_prompts=True, push=True)
    receiver = make_index(aioredis.Redis(), B_SLOTS, whole_prompts=True, push=True)
    good = sender._encode([], [("e0", b"a", keys(1, 2)), ("e1", b"a", keys(1, 2, 3))])
    candidates = slots_of(B_SLOTS, "e0", "e1")
    for bad in (good[:-3], good[:5] + b"x" + good[6:], good[:4]):  # cut off; unknown op; no header
        with pytest.raises(ValueError):
            receiver._receive(bad)
        assert receiver.match(keys(1, 2, 3), candidates).tolist() == [0, 0]  # not even e0's op
    receiver._receive(good)
    assert receiver.match(keys(1, 2, 3), candidates).tolist() == [2, 3]


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"rewrite_after_s": -1.0}, "rewrite_after_s: must be within 0..ttl_s/2"),
        ({"rewrite_after_s": 400.0, "ttl_s": 600.0}, "rewrite_after_s: must be within 0..ttl_s/2"),
        ({"recent_writes_cap": 0}, "recent_writes_cap: must be >= 1"),
    ],
)
def test_the_rewrite_window_and_its_cap_are_checked(option: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_index(aioredis.Redis(), A_SLOTS, whole_prompts=True, **option)


async def test_blocks_written_lately_are_not_written_again(
    clients: tuple[aioredis.Redis, aioredis.Redis],
) -> None:
    raw = clients[1]
    a = make_index(clients[0], A_SLOTS, whole_prompts=True)
    b = make_index(raw, B_SLOTS, whole_prompts=True)
    system = [101, 102, 103]  # a shared prefix every request carries
    await raw.config_resetstat()
    for question in (7, 8, 9):
        a.record(A_SLOTS["e0"], keys(*system, question))
        assert await a.flush()  # a flush per request: nothing coalesces them
    # 3 prefix blocks once, then one new block a request (12 with every prompt written whole).
    assert await hsets(raw) == 6
    for question in (7, 8, 9):
        assert (await b.lookup(keys(*system, question), slots_of(B_SLOTS, "e0"))).tolist() == [4]


async def test_blocks_are_written_again_once_rewrite_after_s_has_passed(
    clients: tuple[aioredis.Redis, aioredis.Redis],
) -> None:
    raw = clients[1]
    now = [0.0]
    a = make_index(clients[0], A_SLOTS, whole_prompts=True, rewrite_after_s=10.0, clock=lambda: now[0])
    a.record(A_SLOTS["e0"], keys(1, 2))
    assert await a.flush()
    await raw.config_resetstat()
    now[0] = 4.0
    a.record(A_SLOTS["e0"], keys(1, 2))  # within rewrite_after_s: not written, its TTL runs on
    assert await a.flush()
    assert await hsets(raw) == 0
    now[0] = 10.0
    a.record(A_SLOTS["e0"], keys(1, 2))  # past it: written again, the TTL full again
    assert await a.flush()
    assert await hsets(raw) == 2


async def test_a_clear_not_seen_yet_is_caught_by_redis(
    clients: tuple[aioredis.Redis, aioredis.Redis],
) -> None:
    a, b = make_index(clients[0], A_SLOTS, whole_prompts=True), make_index(clients[1], B_SLOTS)
    prompt = keys(61, 62)
    a.record(A_SLOTS["e1"], prompt)
    assert await a.flush()
    b.cleared(B_SLOTS["e1"])
    assert await b.flush()
    # A has not looked since: it sends the blocks with the generation it wrote them under, and
    # Redis, whose generation for e1 is newer, writes them again.
    a.record(A_SLOTS["e1"], prompt)
    assert await a.flush()
    assert (await b.lookup(prompt, slots_of(B_SLOTS, "e1"))).tolist() == [2]


async def test_a_clear_seen_in_a_lookup_makes_the_blocks_written_again(
    clients: tuple[aioredis.Redis, aioredis.Redis],
) -> None:
    a, b = make_index(clients[0], A_SLOTS, whole_prompts=True), make_index(clients[1], B_SLOTS)
    prompt = keys(21, 22, 23)
    a.record(A_SLOTS["e0"], prompt)
    assert await a.flush()
    b.cleared(B_SLOTS["e0"])  # e0 restarted: another replica bumps its generation
    assert await b.flush()
    # A's next request on e0 asks first: the new generation makes A forget what it wrote under the old.
    assert (await a.lookup(prompt, slots_of(A_SLOTS, "e0"))).tolist() == [0]
    a.record(A_SLOTS["e0"], prompt)
    assert await a.flush()
    assert (await b.lookup(prompt, slots_of(B_SLOTS, "e0"))).tolist() == [3]
