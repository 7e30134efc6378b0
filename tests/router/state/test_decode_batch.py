"""The decode batch and resident KV a stream ran with (``Pool.advance_decode``,
``Reservation.decoded``): what its time per token depends on, averaged over its decoding, not their
values at its pick."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import Clock

from router.server.config import EndpointConfig
from router.state.pool import Pool


def decode_pool(clock: Clock) -> tuple[Pool, int]:
    pool = Pool(clock=clock)
    pool.add(EndpointConfig(name="d0", address="127.0.0.1:8000", role="decode"))
    return pool, pool.endpoints["d0"].slot


def test_the_mean_batch_weighs_each_batch_by_how_long_it_ran() -> None:
    clock = Clock()
    pool, d0 = decode_pool(clock)
    mine = pool.reserve(d0, None, prefill_tokens=100.0, kv_tokens=200.0)
    clock.now += 1.0  # the prompt computes: not decoding yet
    mine.finish_prefill()
    clock.now += 2.0  # alone: batch 1 for 2 s
    others = [pool.reserve(d0, None, 100.0, 300.0) for _ in range(3)]
    for other in others:
        other.finish_prefill()
    prefilling = pool.reserve(d0, None, 100.0, 0.0)  # its prompt still computing elsewhere
    clock.now += 1.0  # batch 4 for 1 s
    for other in others:
        other.release()
    prefilling.release()
    clock.now += 1.0  # batch 1 for 1 s
    mine.release()
    assert mine.decoded == pytest.approx(((1 * 2 + 4 + 1) / 4, (200 * 2 + 1100 + 200) / 4))
    assert prefilling.decoded is None  # released before decoding: nothing to learn
    assert pool.decoding_requests[d0] == 0 and pool.inflight_requests[d0] == 0


def test_the_scrape_counts_from_when_it_came_and_a_queue_is_not_a_batch() -> None:
    clock = Clock()
    pool, d0 = decode_pool(clock)
    mine = pool.reserve(d0, None, 100.0, 200.0)
    mine.finish_prefill()
    clock.now += 1.0  # ours alone: batch 1
    pool.advance_decode(d0, clock.now)  # what a scrape does before it writes what it read
    pool.running[d0], pool.waiting[d0] = 9.0, 0.0  # other clients' streams on the same engine
    pool.kv_usage[d0], pool.kv_capacity_tokens[d0] = 0.5, 10_000.0
    clock.now += 1.0
    mine.release()
    assert mine.decoded == pytest.approx(((1 + 9) / 2, (200 + 5000) / 2))

    # Ours alone again, 6 of them queued behind a full batch of 10: the batch is 10, not 16.
    pool.running[d0], pool.waiting[d0] = 10.0, 6.0
    queued = [pool.reserve(d0, None, 100.0, 200.0) for _ in range(16)]
    for reservation in queued:
        reservation.finish_prefill()
    clock.now += 1.0
    queued[0].release()
    assert queued[0].decoded is not None and queued[0].decoded[0] == pytest.approx(10.0)


def test_the_other_replicas_share_counts_and_a_reused_slot_learns_nothing() -> None:
    clock = Clock()
    pool, d0 = decode_pool(clock)
    mine = pool.reserve(d0, None, 100.0, 200.0)
    mine.finish_prefill()
    clock.now += 1.0
    pool.advance_decodes(clock.now)  # what the shared load does before it writes the others'
    pool.others_inflight_requests[d0], pool.others_reserved_kv_tokens[d0] = 3, 900.0
    clock.now += 1.0
    mine.release()
    assert mine.decoded == pytest.approx(((1 + 4) / 2, (200 + 1100) / 2))

    gone = pool.reserve(d0, None, 100.0, 200.0)
    gone.finish_prefill()
    pool.remove("d0")
    pool.add(EndpointConfig(name="d1", address="127.0.0.1:8001", role="decode"))  # takes the slot
    clock.now += 1.0
    gone.release()
    assert gone.decoded is None
    assert pool.batch_seconds[d0] == 0.0  # d1's integral starts afresh, untouched by d0's request


def test_every_slot_at_once_integrates_what_one_slot_at_a_time_does() -> None:
    # advance_decodes (arrays) and advance_decode (one slot's scalars) state the integrand twice:
    # they must agree, unknown (NaN) scrapes included.
    rng = np.random.default_rng(7)
    pools = []
    for _ in range(2):
        clock = Clock()
        pool = Pool(clock=clock)
        for i in range(6):
            pool.add(EndpointConfig(name=f"d{i}", address=f"127.0.0.1:{8000 + i}", role="decode"))
        pools.append(pool)
    for step in range(20):
        now = 1000.0 + step
        values = {
            "running": np.where(rng.random(6) < 0.3, np.nan, rng.integers(0, 12, 6).astype(float)),
            "waiting": np.where(rng.random(6) < 0.3, np.nan, rng.integers(0, 4, 6).astype(float)),
            "kv_usage": np.where(rng.random(6) < 0.3, np.nan, rng.random(6)),
            "kv_capacity_tokens": np.full(6, 50_000.0),
            "decoding_requests": rng.integers(0, 10, 6),
            "decoding_kv_tokens": rng.random(6) * 20_000,
            "others_inflight_requests": rng.integers(0, 3, 6),
            "others_reserved_kv_tokens": rng.random(6) * 5_000,
        }
        one, every = pools
        for slot in range(6):
            one.advance_decode(slot, now)
        every.advance_decodes(now)
        for pool in pools:
            for name, column in values.items():
                getattr(pool, name)[:6] = column
    for name in ("batch_seconds", "kv_token_seconds"):
        np.testing.assert_allclose(getattr(pools[0], name)[:6], getattr(pools[1], name)[:6])
    assert pools[0].batch_seconds[:6].sum() > 0
