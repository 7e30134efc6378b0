import math

from scorer_cases import cands, ctx

from scorers import kv_headroom


def test_a_request_that_would_not_fit_is_filtered() -> None:
    c = cands(3, kv_usage=[0.5, 0.95, 0.0], kv_capacity_tokens=[10000, 10000, 1000])
    used = kv_headroom.used_tokens(c)
    assert kv_headroom.fits(c, ctx(1000, 100), used).tolist() == [True, False, False]


def test_penalty_is_zero_below_the_soft_threshold_and_one_when_full() -> None:
    c = cands(3, kv_usage=[0.0, 0.85, 0.89], kv_capacity_tokens=[10000, 10000, 10000])
    used = kv_headroom.used_tokens(c)
    penalty = kv_headroom.penalty(c, ctx(900, 100), used, soft_threshold=0.9)
    assert penalty[0] == 0.0 and 0.0 < penalty[1] < penalty[2]
    assert math.isclose(penalty[2], (0.99 - 0.9) / 0.1)


def test_our_reservations_count_when_they_exceed_the_scrape() -> None:
    c = cands(1, kv_usage=[0.1], reserved_kv_tokens=[9500])
    assert kv_headroom.used_tokens(c).tolist() == [9500]
    assert not kv_headroom.fits(c, ctx(400, 200), kv_headroom.used_tokens(c))[0]


def test_unknown_usage_is_the_pool_worst_and_unknown_capacity_is_not_filtered() -> None:
    c = cands(3, kv_usage=[math.nan, 0.7, 0.2], kv_capacity_tokens=[10000, 10000, math.nan])
    used = kv_headroom.used_tokens(c)
    assert used[0] == 7000
    assert kv_headroom.fits(c, ctx(100, 10), used)[2]
