import math

from scorer_cases import MODEL, cands, ctx, view

from router.scheduling.costmodel import prefix
from router.scheduling.costmodel.terms import kv, load


def test_tpot_grows_with_the_batch_and_uses_our_inflight_when_larger() -> None:
    c = cands(3, running=[0, 10, 2], inflight_requests=[0, 0, 20])
    batch = load.batch_size(c)
    assert batch.tolist() == [0, 10, 20]
    tpot = load.tpot_s(
        MODEL,
        kv.used_tokens(c) + kv.need_tokens(prefix.cached_tokens(c, ctx()), ctx()),
        batch,
    )
    assert tpot[0] < tpot[1] < tpot[2]
    assert math.isclose(tpot[1] - tpot[0], 10 * MODEL.decode_s_per_seq)


def test_unknown_running_is_the_pool_worst() -> None:
    c = cands(3, running=[math.nan, 12, 3])
    assert load.batch_size(c).tolist() == [12, 12, 3]


def test_tpot_costs_in_proportion_to_the_expected_answer_within_bounds() -> None:
    assert load.awaited_tokens(10.0, 100.0) == 10.0  # tpot_weight is stated for 100 tokens
    assert load.awaited_tokens(10.0, 300.0) == 30.0
    assert load.awaited_tokens(10.0, 16.0) == load.awaited_tokens(10.0, 64.0) == 6.4
    assert load.awaited_tokens(10.0, 32_000.0) == load.awaited_tokens(10.0, 1024.0)
    c = cands(2, running=[0, 10])
    asked = ctx(max_tokens=300)  # its expected answer is its max_tokens until the pool learns one
    learned = asked._replace(expected_answer_tokens=100.0)
    tpot_s = view(c, asked).tpot_s
    assert (load.term().seconds(view(c, asked)) == tpot_s * 30.0).all()
    assert (load.term().seconds(view(c, learned)) == tpot_s * 10.0).all()
