"""MemoryPrefixIndex.match on a whole-prompt index (bisection) against the walk, on the same ops."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import pytest

from kvindex.memory import MemoryPrefixIndex

MAX_SLOTS = 128
RECORDED_SLOTS = 100  # slots from here to MAX_SLOTS are never recorded, only asked about


def chain(content: Sequence[int]) -> np.ndarray:
    """Chained keys as ``kvindex.hashing`` makes them: key i hashes key i-1 and block i."""
    keys = np.empty(len(content), dtype=np.uint64)
    parent = b"test"
    for i, block in enumerate(content):
        parent = hashlib.blake2b(parent + block.to_bytes(4, "little"), digest_size=8).digest()
        keys[i] = int.from_bytes(parent, "little")
    return keys


def slots(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


class CountingDict(dict[int, int]):
    """An ``owners`` map that counts ``match``'s probes."""

    probes = 0

    def get(self, key: int, default: int = 0) -> int:  # type: ignore[override]
        self.probes += 1
        return super().get(key, default)


def probes(index: MemoryPrefixIndex, keys: np.ndarray, candidates: np.ndarray) -> tuple[list[int], int]:
    """``match``'s answer and how many blocks it looked up."""
    counting = CountingDict(index._owners)
    index._owners = counting
    try:
        return index.match(keys, candidates).tolist(), counting.probes
    finally:
        index._owners = dict(counting)


class Twins:
    """A whole-prompt index and a walking one, given the same calls."""

    def __init__(self, capacity: int) -> None:
        self.bisecting = MemoryPrefixIndex(capacity, max_slots=MAX_SLOTS, whole_prompts=True)
        self.walking = MemoryPrefixIndex(capacity, max_slots=MAX_SLOTS)
        self.recorded = 0

    def record(self, slot: int, keys: np.ndarray) -> None:
        self.bisecting.record(slot, keys)
        self.walking.record(slot, keys)
        self.recorded += keys.shape[0]

    def shrink(self, slot: int, blocks: int) -> None:
        self.bisecting.shrink(slot, blocks)
        self.walking.shrink(slot, blocks)

    def drop_slot(self, slot: int) -> None:
        self.bisecting.drop_slot(slot)
        self.walking.drop_slot(slot)

    def remove(self, slot: int, keys: np.ndarray) -> None:
        self.bisecting.remove(slot, keys)
        self.walking.remove(slot, keys)

    def check(self, keys: np.ndarray, candidates: np.ndarray) -> None:
        expected = self.walking.match(keys, candidates)
        assert self.bisecting.match(keys, candidates).tolist() == expected.tolist(), (keys, candidates)


def random_prompt(rng: np.random.Generator, corpus: list[list[int]]) -> list[int]:
    """Mostly a prefix of an earlier prompt plus new blocks; blocks come from 3 values, so
    unrelated prompts share short prefixes too."""
    tail = rng.integers(0, 3, size=int(rng.integers(0, 24))).tolist()
    if corpus and rng.random() < 0.8:
        base = corpus[int(rng.integers(len(corpus)))]
        return base[: int(rng.integers(0, len(base) + 1))] + tail
    return tail


def random_query(rng: np.random.Generator, corpus: list[list[int]]) -> np.ndarray:
    """A recorded prompt as is, cut, extended or both, or a new one; never empty."""
    prompt = corpus[int(rng.integers(len(corpus)))]
    if prompt and rng.random() < 0.5:
        prompt = prompt[: int(rng.integers(1, len(prompt) + 1))]
    if rng.random() < 0.5 or not prompt:
        prompt = prompt + rng.integers(0, 3, size=int(rng.integers(1, 16))).tolist()
    return chain(prompt)


def random_slots(rng: np.random.Generator) -> np.ndarray:
    size = int(rng.integers(1, 101))
    chosen = rng.choice(MAX_SLOTS, size=size, replace=bool(rng.random() < 0.2))
    return chosen.astype(np.int64 if rng.random() < 0.7 else np.int32)


def run(rng: np.random.Generator, twins: Twins, queries: int, remove_rate: float) -> None:
    corpus: list[list[int]] = [random_prompt(rng, [])]
    corpus[0].append(0)  # the first query needs a non-empty prompt to start from
    asked = 0
    while asked < queries:
        roll = rng.random()
        if roll < 0.45:
            prompt = random_prompt(rng, corpus)
            corpus.append(prompt)
            twins.record(int(rng.integers(RECORDED_SLOTS)), chain(prompt))
        elif roll < 0.48:
            twins.shrink(int(rng.integers(RECORDED_SLOTS)), int(rng.integers(1, 10)))
        elif roll < 0.50:
            twins.drop_slot(int(rng.integers(RECORDED_SLOTS)))
        elif roll < 0.50 + remove_rate:
            keys = chain(corpus[int(rng.integers(len(corpus)))])
            start = int(rng.integers(0, keys.shape[0] + 1))
            twins.remove(int(rng.integers(RECORDED_SLOTS)), keys[start : start + int(rng.integers(1, 4))])
        else:
            twins.check(random_query(rng, corpus), random_slots(rng))
            asked += 1
    assert len(twins.walking) < twins.recorded  # eviction did happen


@pytest.mark.parametrize("seed", range(5))
def test_bisection_answers_as_the_walk_on_whole_prompts(seed: int) -> None:
    rng = np.random.default_rng(seed)
    twins = Twins(capacity=int(rng.integers(8, 60)))
    run(rng, twins, queries=1000, remove_rate=0.0)
    assert not twins.bisecting._holes  # the bisection answered every query here


@pytest.mark.parametrize("seed", range(3))
def test_removes_leave_the_answers_those_of_the_walk(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    twins = Twins(capacity=int(rng.integers(8, 60)))
    run(rng, twins, queries=1000, remove_rate=0.1)


def test_the_shared_system_prompt_case_takes_a_few_probes_not_the_match_length() -> None:
    system = list(range(192))
    bisecting = MemoryPrefixIndex(1000, max_slots=64, whole_prompts=True)
    walking = MemoryPrefixIndex(1000, max_slots=64)
    for index in (bisecting, walking):
        for slot in range(0, 64, 8):
            index.record(slot, chain(system + [slot] * 64))
    prompt = chain(system + [1000] * 64)
    everyone = np.arange(64)
    expected = [192 if slot % 8 == 0 else 0 for slot in range(64)]
    assert probes(walking, prompt, everyone) == (expected, 193)
    answer, looked_up = probes(bisecting, prompt, everyone)
    assert answer == expected
    assert looked_up <= 12  # block 0, the last block, and a bisection of 256 blocks
    # The next prompt on that system prompt ends its match where this one did: probed first.
    answer, looked_up = probes(bisecting, chain(system + [2000] * 64), everyone)
    assert (answer, looked_up) == (expected, 4)  # block 0, the last block, blocks 191 and 192


def test_a_match_that_ends_elsewhere_than_the_last_one_is_exact_in_a_few_more_probes() -> None:
    system = list(range(192))
    index = MemoryPrefixIndex(1000, max_slots=64, whole_prompts=True)
    for slot in range(0, 64, 8):
        index.record(slot, chain(system + [slot] * 64))
    index.record(1, chain(system[:40]))
    everyone = np.arange(64)
    probes(index, chain(system + [1000] * 64), everyone)  # ends at block 192
    answer, looked_up = probes(index, chain(system[:100] + [1000] * 156), everyone)
    assert answer == [100 if slot % 8 == 0 else 40 if slot == 1 else 0 for slot in range(64)]
    assert looked_up <= 12 + 4  # the bisection's, and the last match's two blocks besides


def test_many_distinct_depths_hand_over_to_the_walk_and_stay_exact() -> None:
    prompt = chain(range(64))
    index = MemoryPrefixIndex(1000, max_slots=64, whole_prompts=True)
    for slot in range(64):
        index.record(slot, prompt[:slot])
    answer, looked_up = probes(index, prompt, np.arange(64))
    assert answer == list(range(64))
    assert looked_up <= 64 + 16  # the walk's 64, plus the bisection's few before it gave up


def test_a_hole_from_remove_is_walked_until_the_slot_is_dropped() -> None:
    prompt = chain(range(8))
    index = MemoryPrefixIndex(100, max_slots=8, whole_prompts=True)
    index.record(0, prompt)
    index.record(1, prompt)
    index.remove(0, prompt[3:4])
    # Slot 0 still holds the first and the last block: a bisection would answer 8 for it.
    assert index.match(prompt, slots(0, 1)).tolist() == [3, 8]
    assert index.match(prompt, slots(0)).tolist() == [3]
    # Other slots have no holes and still bisect: 2 probes for a full match.
    assert probes(index, prompt, slots(1)) == ([8], 2)
    index.drop_slot(0)
    index.record(0, prompt[:5])
    assert probes(index, prompt, slots(0, 1)) == ([5, 8], 5)  # 2 ends, then blocks 3, 5, 4


def test_a_remove_that_removes_nothing_keeps_the_bisection() -> None:
    prompt = chain(range(8))
    index = MemoryPrefixIndex(100, max_slots=8, whole_prompts=True)
    index.record(0, prompt)
    index.remove(0, chain([7, 7]))
    index.remove(3, prompt)  # a slot never recorded
    assert probes(index, prompt, slots(0)) == ([8], 2)


def test_an_index_not_fed_whole_prompts_walks() -> None:
    # KV events store a prompt chunk by chunk: the later chunk is more recent, so eviction takes
    # block 1 before blocks 2 and 3, and a bisection (blocks 0 and 3 held) would answer 4.
    prompt = chain(range(4))
    index = MemoryPrefixIndex(4)
    index.record(0, prompt[:2])
    index.record(0, prompt[2:])
    index.record(0, chain([9]))
    assert index.match(prompt, slots(0)).tolist() == [1]
