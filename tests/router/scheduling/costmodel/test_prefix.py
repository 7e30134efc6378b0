import numpy as np
from scorer_cases import cands, ctx

from router.scheduling.costmodel import prefix


def test_cached_prefix_lowers_uncached_tokens_by_whole_blocks() -> None:
    c = cands(cached_blocks=[0, 10, 40])
    assert prefix.uncached_tokens(prefix.cached_tokens(c, ctx(1000)), ctx(1000), 1.0).tolist() == [
        1000,
        840,
        360,
    ]


def test_a_fully_cached_prompt_still_computes_one_token() -> None:
    c = cands(1, cached_blocks=[100])
    assert prefix.uncached_tokens(prefix.cached_tokens(c, ctx(1000)), ctx(1000), 1.0).tolist() == [1]


def test_trust_scales_the_credit_and_zero_ignores_locality() -> None:
    c = cands(1, cached_blocks=[50])
    assert prefix.uncached_tokens(prefix.cached_tokens(c, ctx(1000)), ctx(1000), 0.5).tolist() == [600]
    assert prefix.uncached_tokens(prefix.cached_tokens(c, ctx(1000)), ctx(1000), 0.0).tolist() == [1000]


def test_fairness_trust_drops_credit_beyond_the_wait_skew() -> None:
    waits = np.array([0.1, 0.5, 2.0])
    assert prefix.fairness_trust(waits, 1.0, max_skew_s=1.0).tolist() == [1.0, 1.0, 0.0]
