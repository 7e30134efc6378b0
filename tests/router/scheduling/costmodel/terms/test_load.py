import math

from scorer_cases import MODEL, cands, ctx

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
