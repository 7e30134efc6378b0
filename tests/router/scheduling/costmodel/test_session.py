"""Session affinity's prior: the home pods' expected prefix where the index knows less, never added."""

from __future__ import annotations

import numpy as np

from router.scheduling.costmodel.session import cached_blocks_with_session


def test_the_home_pod_is_credited_the_last_prompt_where_the_index_knows_nothing() -> None:
    cached = np.zeros(3, dtype=np.int32)
    home = np.array([False, True, False])
    out = cached_blocks_with_session(cached, home, expected_tokens=1000, block_tokens=16)
    assert out.tolist() == [0, 62, 0] and out.dtype == np.int32


def test_index_and_session_evidence_are_not_added_the_larger_wins() -> None:
    cached = np.array([80, 10, 5, 39], dtype=np.int32)
    home = np.array([True, True, False, True])
    out = cached_blocks_with_session(cached, home, expected_tokens=640, block_tokens=16)
    # The index knew more on pod 0; pod 2 is not a home; pod 3's index is within a block (rounding).
    assert out.tolist() == [80, 40, 5, 39]


def test_unknown_pods_keep_the_index_value_and_a_short_prompt_credits_nothing() -> None:
    cached = np.array([3, 0], dtype=np.int32)
    assert cached_blocks_with_session(cached, np.array([False, False]), 5000, 16) is cached
    assert cached_blocks_with_session(cached, np.array([True, True]), 15, 16) is cached
    assert cached_blocks_with_session(cached, np.array([True, True]), 5000, 0) is cached
