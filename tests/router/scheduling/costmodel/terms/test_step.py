import numpy as np
from scorer_cases import LINKS, MODEL, cands, cost_model, ctx, view

from router.scheduling.costmodel.matrix import CostModel, derive, pair_costs
from router.scheduling.costmodel.terms import step


def test_a_prefill_pod_pays_a_step_and_a_half_of_the_decodes_it_serves() -> None:
    c = cands(
        3,
        decoding_requests=[0, 20, 20],
        decoding_kv_tokens=[0.0, 5000.0, 5000.0],
        slowness=[1.0, 1.0, 2.0],
        running=[8, 28, 28],  # scraped: its prompts in progress too, which the queue term prices
    )
    seconds = step.term().seconds(view(c))
    idle = 1.5 * MODEL.decode_step_base_s
    busy = 1.5 * (MODEL.decode_step_base_s + 20 * MODEL.decode_s_per_seq + 5000 * MODEL.decode_s_per_kv_token)
    np.testing.assert_allclose(seconds, [idle, busy, 2 * busy])


def test_pods_that_decode_by_role_pay_nothing_here() -> None:
    # Their running batch is priced against a local prefill by the interference term.
    c = cands(2, decoding_requests=[20, 20], can_decode=[True, False])
    seconds = step.term().seconds(view(c))
    assert seconds[0] == 0.0 and seconds[1] > 0.0


def test_a_pair_leaves_the_prefill_pod_busy_decoding_whole_requests() -> None:
    # Two prefill pods alike but for the whole requests the first is decoding (no queue on either),
    # and a decode pod: the pair's prefill leg goes to the idle one. The prompt would wait for those
    # decodes' steps (this term) and stall them (``interference``): each alone steers it; without
    # both the two tie and the first wins.
    c = cands(
        3,
        decoding_requests=[30, 0, 0],
        decoding_kv_tokens=[30000.0, 0.0, 0.0],
        can_prefill=[True, True, False],
        can_decode=[False, False, True],
    )
    is_prefill, is_decode = c.can_prefill, c.can_decode
    table = LINKS.table({"default": 0})

    def prefill_pod(cm: CostModel) -> int:
        return int(pair_costs(derive(c, ctx(), cm), is_prefill, is_decode, cm, table).prefill_of[1, 0])

    cm = cost_model()

    def without(*names: str) -> CostModel:
        return cost_model(terms=tuple(w for w in cm.terms if w.term.name not in names))

    assert prefill_pod(cm) == 1
    assert prefill_pod(without("step")) == 1 and prefill_pod(without("interference")) == 1
    assert prefill_pod(without("step", "interference")) == 0
