import math

import numpy as np
from scorer_cases import cands, ctx, view

from router.scheduling.costmodel import prefix
from router.scheduling.costmodel.terms import kv
from router.scheduling.costmodel.view import Candidates, RequestCtx


def need_of(c: Candidates, cx: RequestCtx) -> np.ndarray:
    return kv.need_tokens(prefix.cached_tokens(c, cx), cx)


def test_only_a_request_larger_than_the_whole_pod_is_filtered() -> None:
    c = cands(3, kv_usage=[0.5, 0.95, 0.0], kv_capacity_tokens=[10000, 10000, 1000])
    need = need_of(c, ctx(1000, 100))
    # A full pod queues the request (a penalty, below); only 1100 > 1000 can never fit.
    assert kv.fits(c, need).tolist() == [True, True, False]


def test_blocks_the_pod_already_holds_are_not_needed_again() -> None:
    c = cands(2, cached_blocks=[0, 50])
    assert need_of(c, ctx(1000, 100)).tolist() == [1100, 300]


def test_penalty_is_zero_below_soft_one_when_full_and_grows_past_full() -> None:
    c = cands(4, kv_usage=[0.0, 0.85, 0.89, 1.0], kv_capacity_tokens=[10000] * 4)
    used = kv.used_tokens(c)
    penalty = kv.penalty(c, used, need_of(c, ctx(900, 100)), soft_threshold=0.9)
    assert penalty[0] == 0.0 and 0.0 < penalty[1] < penalty[2] < penalty[3]
    assert math.isclose(penalty[2], (0.99 - 0.9) / 0.1)
    assert penalty[3] > 1.0


def test_our_reservations_count_when_they_exceed_the_scrape() -> None:
    c = cands(1, kv_usage=[0.1], reserved_kv_tokens=[9500])
    assert kv.used_tokens(c).tolist() == [9500]


def test_unknown_usage_is_the_pool_worst_and_unknown_capacity_is_not_filtered() -> None:
    c = cands(3, kv_usage=[math.nan, 0.7, 0.2], kv_capacity_tokens=[10000, 10000, math.nan])
    assert kv.used_tokens(c)[0] == 7000
    assert kv.fits(c, need_of(c, ctx(100, 10)))[2]


def test_only_decode_only_pods_pay_the_penalty_and_every_pod_filters() -> None:
    # Four nearly full pods (the last too small for the request): two compute prompts, two only decode.
    c = cands(
        4,
        kv_usage=[0.95, 0.95, 0.95, 0.0],
        kv_capacity_tokens=[10000, 10000, 10000, 1000],
        can_prefill=[True, False, True, False],
        can_decode=[True, True, False, True],
    )
    seconds = kv.term().seconds(view(c, ctx(1000, 100)))
    # Leaving the pod that holds its prefix recomputes it elsewhere; leaving a decode pod costs a transfer.
    assert seconds[0] == seconds[2] == 0.0 < seconds[1]
    assert seconds[3] == math.inf
