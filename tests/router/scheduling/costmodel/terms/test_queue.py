import math

from scorer_cases import MODEL, cands, ctx

from router.scheduling.costmodel.terms import queue


def test_our_queued_tokens_count_even_before_the_engine_reports_them() -> None:
    c = cands(2, queued_prefill_tokens=[5000, 0])
    assert queue.wait_s(c, ctx(), MODEL).tolist() == [0.5, 0.0]


def test_scraped_waiting_requests_are_sized_by_the_typical_prompt_without_double_counting() -> None:
    c = cands(2, waiting=[4, 1], queued_prefill_tokens=[1000, 1000])
    # max(ours, waiting * 500): 4 waiting -> 2000 tokens; 1 waiting -> ours (1000) is larger.
    assert queue.queued_tokens(c, ctx()).tolist() == [2000, 1000]


def test_unknown_waiting_is_the_pool_worst_not_zero() -> None:
    c = cands(3, waiting=[math.nan, 6, 2])
    assert queue.queued_tokens(c, ctx()).tolist() == [3000, 3000, 1000]


def test_our_own_requests_among_the_scraped_waiting_are_not_sized_again_as_whole_prompts() -> None:
    # Both pods had 3 waiting at the last scrape; on the first all 3 were ours (counted exactly:
    # 600 uncached tokens, their prompts mostly cached), on the second 1 was: 2 came from elsewhere.
    c = cands(2, waiting=[3, 3], waiting_ours=[3, 1], queued_prefill_tokens=[600, 200])
    assert queue.queued_tokens(c, ctx()).tolist() == [600, 1000]
    # Ours that finished since the scrape leave no phantom behind, and never a negative count.
    c = cands(2, waiting=[1, 0], waiting_ours=[3, 2], queued_prefill_tokens=[0, 0])
    assert queue.queued_tokens(c, ctx()).tolist() == [0, 0]
