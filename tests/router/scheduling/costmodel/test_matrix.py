import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scorer_cases import LINKS, MODEL, cands, cost_model, ctx

from router.scheduling.costmodel.matrix import (
    PairCosts,
    TermContractError,
    WeightedTerm,
    best_two_per_class,
    class_members,
    derive,
    pair_costs,
    smallest,
)
from router.scheduling.costmodel.view import RequestCtx, Side, View

TABLE = LINKS.table({"a": 0, "b": 1})


def costs_of(cand, is_prefill, is_decode, c=None, cm=None) -> PairCosts:
    cm = cm or cost_model()
    return pair_costs(derive(cand, c or ctx(), cm), is_prefill, is_decode, cm, TABLE)


def brute_force(costs: PairCosts, cand, c) -> np.ndarray:
    """Reference: the full P×D matrix by explicit per-pair arithmetic over candidate positions."""
    column = costs.column_s[costs.decode]
    full = np.full((len(cand), len(costs.decode)), np.inf)
    for i in costs.prefill:
        for j, d in enumerate(costs.decode):
            if i == d:
                continue
            link_i, link_d = cand.link_index[i], cand.link_index[d]
            missing = (
                c.prompt_tokens - min(cand.cached_blocks[d] * 16, c.prompt_tokens - 1)
            ) * MODEL.kv_bytes_per_token
            transfer = TABLE.latency_s[link_i, link_d] + missing / TABLE.bytes_per_s[link_i, link_d]
            view = costs.view
            ttft = (
                costs.route_s[i]
                + transfer
                + 2 * view.tpot_s[d]
                + MODEL.decode_step_base_s
                + MODEL.pd_leg_overhead_s
            )
            if costs.decode_queue:  # what is left of D's queue when the KV has arrived
                ttft += max(0.0, view.wait_s[d] - (view.wait_s[i] + view.prefill_s[i]) - transfer)
            full[i, j] = ttft + column[j]  # the SLO is 1 s
    return full


@pytest.mark.parametrize("decode_queue", [False, True])
def test_class_reduction_equals_the_full_pair_matrix(decode_queue: bool) -> None:
    """Every entry is its pair's cost; the class's best pair is the best of all (exactly without
    the decode-queue wait; with it, unless a pod that computes sooner pays a larger stall)."""
    rng = np.random.default_rng(3)
    cm = cost_model(pair_waits_for_decode_queue=decode_queue)
    for _ in range(60):
        k = int(rng.integers(1, 9))
        role = rng.integers(0, 3, k)  # 0 prefill, 1 decode, 2 prefill-decode
        is_prefill, is_decode = role != 1, role != 0
        cand = cands(
            k,
            queued_prefill_tokens=rng.integers(0, 20000, k).tolist(),
            running=rng.integers(0, 30, k).tolist(),
            link_index=rng.integers(0, 2, k).tolist(),
            cached_blocks=rng.integers(0, 60, k).tolist(),
            can_decode=is_decode.tolist(),
        )
        if not is_decode.any():
            continue
        costs = costs_of(cand, is_prefill, is_decode, ctx(1000), cm)
        expected = brute_force(costs, cand, ctx(1000))
        if len(costs.prefill) and not decode_queue:
            assert np.allclose(costs.cost[1:].min(axis=0), expected.min(axis=0))
        for row in range(1, costs.cost.shape[0]):
            for col in range(len(costs.decode)):
                p = costs.prefill_of[row, col]
                if p >= 0:
                    assert np.isclose(costs.cost[row, col], expected[p, col])
                    assert p != costs.decode[col]
                    assert np.isclose(costs.ttft(p, col), costs.ttft_s[row, col])


def test_local_prefill_pays_for_stalling_the_running_batch() -> None:
    c = ctx(2000)
    busy = costs_of(cands(1, running=[40], can_decode=[True]), np.array([False]), np.array([True]), c)
    idle = costs_of(cands(1, running=[0], can_decode=[True]), np.array([False]), np.array([True]), c)
    assert busy.terms["interference"][0] > 0 and idle.terms["interference"][0] == 0
    assert busy.cost[0, 0] > idle.cost[0, 0]
    # Each of the 40 waits the prefill once, spread over a typical answer and priced as TPOT is.
    o = busy.view.objectives
    stall = busy.view.prefill_s[0] * 40 / c.typical_answer_tokens * o.tpot_weight
    assert busy.terms["interference"][0] == pytest.approx(stall)
    # Short answers make the same stall a larger share of each one's time per token.
    short = RequestCtx(2000, 100, block_tokens=16, typical_prompt_tokens=500.0, typical_answer_tokens=16.0)
    shorter = costs_of(cands(1, running=[40], can_decode=[True]), np.array([False]), np.array([True]), short)
    assert shorter.terms["interference"][0] == pytest.approx(stall * c.typical_answer_tokens / 16.0)


def test_a_prefill_on_a_pod_that_also_decodes_pays_for_its_stall_too() -> None:
    cand = cands(3, running=[30, 30, 0], can_decode=[False, True, True])
    is_prefill, is_decode = np.array([True, True, False]), np.array([False, True, True])
    costs = costs_of(cand, is_prefill, is_decode, ctx(2000))
    assert costs.terms["interference"][0] == 0 and costs.terms["interference"][1] > 0
    # Decode on pod 2: prefill-only pod 0 is the cheaper prefill source (same queue, no stall).
    assert costs.prefill_of[1, 1] == 0


def test_a_prompt_on_a_prefill_pod_pays_for_stalling_the_whole_requests_it_answers() -> None:
    # Two prefill pods alike (scraped running 30 on both: prompts in progress count there too), the
    # first answering 30 whole requests of its own: each of those waits once for this prefill.
    cand = cands(3, running=[30, 30, 0], decoding_requests=[30, 0, 0], can_decode=[False, False, True])
    is_prefill, is_decode = np.array([True, True, False]), np.array([False, False, True])
    c = ctx(2000)
    costs = costs_of(cand, is_prefill, is_decode, c)
    stall = costs.view.prefill_s[0] * 30 / c.typical_answer_tokens * costs.view.objectives.tpot_weight
    assert costs.terms["interference"][0] == pytest.approx(stall) and stall > 0
    assert costs.terms["interference"][1] == 0.0


def test_a_pair_can_wait_for_what_is_left_of_its_decode_pods_queue() -> None:
    """Pod 1 decodes with 10k prompt tokens queued of its own; the pair's KV arrives after pod 0's
    prefill, and the decode leg then waits for the rest of pod 1's queue."""
    cand = cands(2, queued_prefill_tokens=[0, 10000], can_decode=[False, True])
    is_prefill, is_decode = np.array([True, False]), np.array([False, True])
    c = ctx(1000)
    plain = costs_of(cand, is_prefill, is_decode, c, cost_model(pair_waits_for_decode_queue=False))
    waits = costs_of(cand, is_prefill, is_decode, c)  # the default
    view = waits.view
    computed = view.wait_s[0] + view.prefill_s[0] + waits.transfer_s[0, 0]
    left = view.wait_s[1] - computed
    assert left > 0.1  # the queue outlasts the prefill leg by a lot
    assert waits.ttft_s[1, 0] == pytest.approx(plain.ttft_s[1, 0] + left)
    assert waits.ttft(0, 0) == pytest.approx(waits.ttft_s[1, 0])  # the breakdown agrees
    assert waits.ttft_s[0, 0] == plain.ttft_s[0, 0]  # computing locally was already in the queue
    # A decode pod whose queue drains before the KV arrives costs the pair nothing more.
    short = cands(2, queued_prefill_tokens=[0, 10], can_decode=[False, True])
    drained = costs_of(short, is_prefill, is_decode, c)
    off = cost_model(pair_waits_for_decode_queue=False)
    assert drained.ttft_s[1, 0] == costs_of(short, is_prefill, is_decode, c, off).ttft_s[1, 0]


def test_disallowing_local_prefill_leaves_only_pairs() -> None:
    is_decode = np.array([False, False, True, True])
    cand = cands(4, can_decode=is_decode.tolist())
    costs = costs_of(cand, ~is_decode, is_decode, cm=cost_model(allow_local_prefill=False))
    assert np.isinf(costs.cost[0]).all() and np.isfinite(costs.cost[1:]).any()


def test_breakdown_names_every_term_of_the_chosen_route() -> None:
    is_decode = np.array([False, True])
    costs = costs_of(
        cands(2, queued_prefill_tokens=[5000, 0], can_decode=[False, True]), ~is_decode, is_decode
    )
    pair = costs.breakdown(0, 0)
    assert pair["queue_s"] == pytest.approx(0.5)  # the prefill pod's queue: 5000 tokens at 10k/s
    assert pair["transfer_s"] > 0
    assert {"prefill_s", "interference_s", "load_s", "kv_s", "ttft_s", "tpot_s"} <= pair.keys()
    local = costs.breakdown(-1, 0)
    assert local["queue_s"] == 0 and local["transfer_s"] == 0


class _Term:
    side: Side = "decode"

    def __init__(self, name: str, values) -> None:
        self.name = name
        self.values = values

    def seconds(self, view: View) -> np.ndarray:
        return self.values(view)


@pytest.mark.parametrize(
    "values",
    [lambda v: np.full(len(v), np.nan), lambda v: np.zeros(len(v) + 1), lambda v: 0.0],
    ids=["nan", "wrong-shape", "scalar"],
)
def test_a_term_that_breaks_its_contract_is_named(values) -> None:
    cm = cost_model()
    cm = cost_model(terms=(*cm.terms, WeightedTerm(_Term("broken", values), 1.0)))
    with pytest.raises(TermContractError, match="'broken'"):
        costs_of(cands(2, can_decode=[True, True]), np.array([True, True]), np.array([True, True]), cm=cm)


def test_an_extra_term_moves_the_choice_and_a_zero_weight_keeps_its_filter() -> None:
    is_decode = np.array([True, True])
    cand = cands(2, can_decode=[True, True])
    avoid_first = _Term("avoid_first", lambda v: np.array([5.0, 0.0]))
    cm = cost_model()
    with_term = costs_of(
        cand, is_decode, is_decode, cm=cost_model(terms=(*cm.terms, WeightedTerm(avoid_first, 1.0)))
    )
    assert with_term.cost[0, 0] - with_term.cost[0, 1] == pytest.approx(5.0)
    # +inf (this pod can never decode it) survives a weight of 0; finite values vanish.
    forbid_first = _Term("forbid_first", lambda v: np.array([np.inf, 3.0]))
    muted = costs_of(
        cand, is_decode, is_decode, cm=cost_model(terms=(*cm.terms, WeightedTerm(forbid_first, 0.0)))
    )
    assert np.isinf(muted.cost[:, 0]).all() and np.isfinite(muted.cost[0, 1])
    assert muted.cost[0, 1] == pytest.approx(costs_of(cand, is_decode, is_decode).cost[0, 1])


def test_a_slow_engine_pays_its_slowness_on_wait_prefill_and_tpot() -> None:
    c = ctx(2000)
    cand = cands(
        2, running=[8, 8], queued_prefill_tokens=[4000, 4000], can_decode=[True, True], slowness=[1.0, 3.0]
    )
    view = derive(cand, c, cost_model())
    assert view.wait_s[1] == pytest.approx(3 * view.wait_s[0])
    assert view.prefill_s[1] == pytest.approx(3 * view.prefill_s[0])
    assert view.tpot_s[1] == pytest.approx(3 * view.tpot_s[0])
    costs = costs_of(cand, np.array([False, False]), np.array([True, True]), c)
    assert costs.cost[0, 0] < costs.cost[0, 1]  # everything else equal, the slow one loses


@given(
    st.lists(st.sampled_from([0.0, 1.0, 2.0, 3.5, np.inf, np.nan]), max_size=12),
    st.integers(0, 12),
)
def test_smallest_is_a_stable_sorts_first_finite_entries(values: list[float], limit: int) -> None:
    """The fallbacks' order: ties to the lower position, +inf and NaN never, at most ``limit``."""
    array = np.array(values, dtype=np.float64)
    order = np.argsort(array, kind="stable")
    expected = order[np.isfinite(array[order])][:limit]
    assert smallest(array.copy(), limit).tolist() == expected.tolist()


@given(
    st.lists(st.tuples(st.integers(0, 2), st.sampled_from([0.0, 1.0, 2.0, np.inf])), min_size=1, max_size=10)
)
def test_each_classes_best_two_are_a_lexsorts_first_two(items: list[tuple[int, float]]) -> None:
    """Cheapest and runner-up per link class, ties to the lower position, +inf members included."""
    labels = np.array([label for label, _ in items])
    cost = np.array([c for _, c in items])
    classes, item_class = np.unique(labels, return_inverse=True)
    # One class takes two argmins, not the rows; both break ties alike on every CPU (argpartition
    # did not: where AVX-512 is there its order among equal costs is a SIMD selection's).
    best, second = best_two_per_class(cost, class_members(item_class) if len(classes) > 1 else None)
    order = np.lexsort((cost, labels))
    for row, label in enumerate(classes):
        ranked = [int(i) for i in order if labels[i] == label]
        assert (best[row], second[row]) == (ranked[0], ranked[1] if len(ranked) > 1 else -1)
