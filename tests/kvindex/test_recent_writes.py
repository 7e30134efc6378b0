"""``RecentWrites``: which blocks a flush sends as written lately (not written again unless their
endpoint's generation changed), on a clock the test moves."""

from __future__ import annotations

import numpy as np

from kvindex.redis_index import RecentWrites


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def keys(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def unwritten(recent: RecentWrites, name: str, *values: int) -> list[int]:
    new, lately = recent.split(name, keys(*values))
    assert sorted([*new.tolist(), *lately.tolist()]) == sorted(values)
    return sorted(new.tolist())


def test_a_block_is_left_out_for_at_most_rewrite_after_s() -> None:
    clock = Clock()
    recent = RecentWrites(10.0, cap=1000, clock=clock)
    recent.wrote("e0", keys(1, 2))
    assert unwritten(recent, "e0", 1, 2, 3) == [3]
    assert unwritten(recent, "e1", 1, 2) == [1, 2]  # per endpoint
    left_out_until = clock.now
    while unwritten(recent, "e0", 1) == []:
        clock.now += 0.5
        left_out_until = clock.now
    assert 5.0 <= left_out_until - 100.0 <= 10.0  # between half and all of rewrite_after_s


def test_a_long_pause_forgets_everything() -> None:
    clock = Clock()
    recent = RecentWrites(10.0, cap=1000, clock=clock)
    recent.wrote("e0", keys(1))
    clock.now += 60.0
    assert unwritten(recent, "e0", 1) == [1]
    assert len(recent) == 0


def test_forget_a_name_or_some_of_its_keys() -> None:
    recent = RecentWrites(10.0, cap=1000, clock=Clock())
    recent.wrote("e0", keys(1, 2, 3))
    recent.wrote("e1", keys(1))
    recent.forget("e0", keys(2))
    assert unwritten(recent, "e0", 1, 2, 3) == [2]
    recent.forget("e0")
    assert unwritten(recent, "e0", 1, 3) == [1, 3]
    assert unwritten(recent, "e1", 1) == []
    assert len(recent) == 1


def test_beyond_the_cap_everything_is_written_again() -> None:
    recent = RecentWrites(10.0, cap=4, clock=Clock())
    recent.wrote("e0", keys(1, 2, 3))
    assert unwritten(recent, "e0", 1) == []
    recent.wrote("e0", keys(4, 5))
    assert len(recent) == 0
    assert unwritten(recent, "e0", 1, 4) == [1, 4]
