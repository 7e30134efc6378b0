"""MemoryPrefixIndex: consecutive-prefix matching, per-slot LRU, drop_slot, and a model check."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.base import PrefixIndex
from kvindex.hashing import text_block_keys
from kvindex.memory import MemoryPrefixIndex


def keys(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def slots(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def test_satisfies_the_prefix_index_protocol() -> None:
    index: PrefixIndex = MemoryPrefixIndex(8)
    assert index.match(keys(1), slots(0)).tolist() == [0]


def test_match_counts_the_recorded_prefix_of_real_text_keys() -> None:
    index = MemoryPrefixIndex(1024)
    system = "You are a helpful assistant. " * 40
    index.record(3, text_block_keys(system + "First question?", 64))
    prompt = text_block_keys(system + "Another question entirely, longer than the first one.", 64)
    shared = len(system) // 64
    result = index.match(prompt, slots(3, 4))
    assert result.dtype == np.int32
    assert result.tolist() == [shared, 0]


def test_a_gap_stops_the_match() -> None:
    index = MemoryPrefixIndex(16)
    index.record(0, keys(10, 11, 13, 14))  # block 12 missing
    assert index.match(keys(10, 11, 12, 13, 14), slots(0)).tolist() == [2]


def test_later_blocks_without_block_zero_match_nothing() -> None:
    index = MemoryPrefixIndex(16)
    index.record(0, keys(11, 12))
    assert index.match(keys(10, 11, 12), slots(0)).tolist() == [0]


def test_full_prompt_match_returns_the_prompt_length() -> None:
    index = MemoryPrefixIndex(16)
    index.record(1, keys(1, 2, 3, 4))
    assert index.match(keys(1, 2, 3), slots(1)).tolist() == [3]


def test_each_candidate_gets_its_own_depth_in_candidate_order() -> None:
    index = MemoryPrefixIndex(16)
    index.record(5, keys(1))
    index.record(2, keys(1, 2, 3))
    index.record(9, keys(1, 2))
    assert index.match(keys(1, 2, 3, 4), slots(9, 2, 5, 7, 2)).tolist() == [2, 3, 1, 0, 3]


def test_slots_absent_from_the_index_return_zero() -> None:
    index = MemoryPrefixIndex(16)
    assert index.match(keys(1, 2), slots(0, 1)).tolist() == [0, 0]
    index.record(0, keys(1, 2))
    assert index.match(keys(1, 2), slots(1, 4095)).tolist() == [0, 0]


def test_empty_prompt_or_candidates() -> None:
    index = MemoryPrefixIndex(16)
    index.record(0, keys(1))
    assert index.match(keys(), slots(0)).tolist() == [0]
    assert index.match(keys(1), slots()).shape == (0,)


def test_slots_outside_the_range_are_rejected() -> None:
    index = MemoryPrefixIndex(16, max_slots=8)
    with pytest.raises(ValueError, match="slot"):
        index.record(8, keys(1))
    index.record(7, keys(1))
    with pytest.raises(ValueError, match="slots"):
        index.match(keys(1), slots(8))
    with pytest.raises(ValueError, match="slots"):
        index.match(keys(1), slots(-1))


def test_lru_evicts_least_recent_blocks_of_that_slot_only() -> None:
    index = MemoryPrefixIndex(4)
    index.record(0, keys(1, 2))
    index.record(1, keys(1, 2))
    index.record(0, keys(10, 11))
    index.record(0, keys(1))  # touch: block 1 becomes most recent on slot 0
    index.record(0, keys(20, 21))  # slot 0 over capacity by 2: evicts 2 and 11, its least recent
    assert len(index) == 4 + 2  # slot 0 at its capacity, slot 1 untouched
    assert index.match(keys(1, 2), slots(0, 1)).tolist() == [1, 2]
    assert index.match(keys(20, 21), slots(0)).tolist() == [2]
    assert index.match(keys(10, 11), slots(0)).tolist() == [1]


def test_a_prompt_longer_than_capacity_keeps_its_head() -> None:
    index = MemoryPrefixIndex(3)
    index.record(0, keys(1, 2, 3, 4, 5))
    assert index.match(keys(1, 2, 3, 4, 5), slots(0)).tolist() == [3]
    assert len(index) == 3


def test_drop_slot_forgets_only_that_slot() -> None:
    index = MemoryPrefixIndex(8)
    index.record(0, keys(1, 2, 3))
    index.record(1, keys(1, 2))
    index.drop_slot(0)
    index.drop_slot(6)  # never recorded: a no-op
    assert index.match(keys(1, 2, 3), slots(0, 1)).tolist() == [0, 2]
    assert len(index) == 2
    index.drop_slot(1)
    assert len(index) == 0
    assert index.memory_bytes() > 0
    index.record(0, keys(1))
    assert index.match(keys(1, 2), slots(0)).tolist() == [1]


def test_many_candidates_dropping_at_one_depth() -> None:
    # Wider than the bit-loop threshold, so both the numpy mask build and decode paths run.
    index = MemoryPrefixIndex(8, max_slots=1024)
    many = list(range(0, 1000, 7))
    for s in many:
        index.record(s, keys(1, 2, 3) if s % 2 else keys(1, 2))
    result = index.match(keys(1, 2, 3, 4), slots(*many, 1001))
    assert result.tolist() == [3 if s % 2 else 2 for s in many] + [0]


def test_memory_bytes_grows_with_entries() -> None:
    index = MemoryPrefixIndex(1000)
    empty = index.memory_bytes()
    index.record(0, np.arange(500, dtype=np.uint64))
    assert index.memory_bytes() > empty + 500 * 100


class NaiveIndex:
    """Reference model: a list per slot, most recent last, scanned linearly."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: dict[int, list[int]] = {}

    def record(self, slot: int, block_keys: list[int]) -> None:
        lru = self.lru.setdefault(slot, [])
        for key in reversed(block_keys):
            if key in lru:
                lru.remove(key)
            lru.append(key)
        del lru[: max(0, len(lru) - self.capacity)]

    def drop_slot(self, slot: int) -> None:
        self.lru.pop(slot, None)

    def match(self, block_keys: list[int], slots: list[int]) -> list[int]:
        out = []
        for slot in slots:
            held = set(self.lru.get(slot, ()))
            depth = 0
            while depth < len(block_keys) and block_keys[depth] in held:
                depth += 1
            out.append(depth)
        return out


MAX_SLOTS = 80
slot_ids = st.integers(0, MAX_SLOTS - 1)
# Few distinct keys so that prefixes overlap, gaps appear and eviction matters.
key_lists = st.lists(st.integers(1, 12), max_size=10)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("record"), slot_ids, key_lists),
        st.tuples(st.just("drop"), slot_ids, st.just([])),
        st.tuples(st.just("match"), st.lists(slot_ids, max_size=40), key_lists),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 8), ops=operations)
def test_match_agrees_with_a_naive_model(capacity: int, ops: list[tuple[str, object, list[int]]]) -> None:
    index = MemoryPrefixIndex(capacity, max_slots=MAX_SLOTS)
    model = NaiveIndex(capacity)
    for op, target, block_keys in ops:
        if op == "record":
            assert isinstance(target, int)
            index.record(target, np.array(block_keys, dtype=np.uint64))
            model.record(target, block_keys)
        elif op == "drop":
            assert isinstance(target, int)
            index.drop_slot(target)
            model.drop_slot(target)
        else:
            assert isinstance(target, list)
            got = index.match(np.array(block_keys, dtype=np.uint64), np.array(target, dtype=np.int32))
            assert got.tolist() == model.match(block_keys, target)
    assert len(index) == sum(len(v) for v in model.lru.values())
    # The owners map holds exactly the keys some slot still has (no stale zero masks).
    assert set(index._owners) == {k for v in model.lru.values() for k in v}
    every = list(range(MAX_SLOTS))
    for probe in range(1, 13):
        assert index.match(np.array([probe], dtype=np.uint64), np.array(every)).tolist() == model.match(
            [probe], every
        )


def test_remove_forgets_only_those_blocks_of_that_slot() -> None:
    index = MemoryPrefixIndex(100)
    keys = np.arange(1, 9, dtype=np.uint64)
    index.record(0, keys)
    index.record(1, keys)
    index.remove(0, keys[4:6])
    index.remove(0, np.array([999], dtype=np.uint64))  # unknown: no-op
    assert index.match(keys, np.array([0, 1])).tolist() == [4, 8]
    assert len(index) == 14
    index.remove(1, keys)
    assert index.match(keys, np.array([1])).tolist() == [0]


def _two_prompts_on_slot_0_and_the_old_on_1() -> tuple[MemoryPrefixIndex, np.ndarray, np.ndarray]:
    """An index of up to 100 blocks a slot: slot 0 holds a 40-block prompt, then a 20-block one
    (60 blocks), slot 1 the 40-block one."""
    index = MemoryPrefixIndex(capacity_blocks_per_slot=100)
    old, new = np.arange(1, 41, dtype=np.uint64), np.arange(1001, 1021, dtype=np.uint64)
    index.record(0, old)
    index.record(0, new)
    index.record(1, old)
    return index, old, new


def test_shrink_drops_the_least_recently_used_and_caps_the_slot() -> None:
    index, old, new = _two_prompts_on_slot_0_and_the_old_on_1()
    index.shrink(0, 30)  # the engine holds 30 blocks fewer than the 60 recorded
    assert len(index) == 30 + 40  # slot 1 keeps its 40
    assert index.match(new, np.array([0]))[0] == 20  # the recent prompt stays
    # The old prompt loses its tail first (as vLLM frees blocks), on slot 0 only.
    assert index.match(old, np.array([0, 1])).tolist() == [10, 40]
    index.record(0, np.arange(2001, 2031, dtype=np.uint64))
    assert len(index) == 30 + 40  # capped from now on
    index.drop_slot(0)
    index.record(0, old)
    index.record(0, new)
    assert len(index) == 60 + 40  # a restarted engine starts with the full capacity again


def test_limit_holds_a_slot_to_its_engines_cache_and_outlives_a_drop() -> None:
    index, old, new = _two_prompts_on_slot_0_and_the_old_on_1()
    index.limit(0, 30)  # its engine's KV cache holds 30 blocks: the least recently used go now
    assert len(index) == 30 + 40
    assert index.match(old, np.array([0, 1])).tolist() == [10, 40]
    index.record(0, np.arange(2001, 2051, dtype=np.uint64))  # a prompt as big as the cache and more
    assert len(index) == 30 + 40
    assert index.match(new, np.array([0]))[0] == 0  # pushed out by what came after
    index.drop_slot(0)  # a cache reset: as big as before
    index.record(0, old)
    assert len(index) == 30 + 40
    index.shrink(0, 10)  # what an engine proved holds where it is below the limit
    index.limit(0, 100)
    index.record(0, new)
    assert len(index) == 20 + 40
    index.limit(0, None)  # not known any more (its endpoint left): the default again
    index.drop_slot(0)
    index.record(0, old)
    index.record(0, new)
    assert len(index) == 60 + 40
    with pytest.raises(ValueError, match="at least 1 block"):
        index.limit(0, 0)
