"""SLO feasibility and the reserve fit over one pick's cost matrix (pure numpy, no pool state)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import SINGLE_PODS, Metrics, make_config, make_picker, make_pool, make_request

from router.scheduling.costmodel import slo
from router.scheduling.costmodel.matrix import PairCosts
from router.scheduling.costmodel.terms.load import MAX_PREFILL_SHARE

NOW = 100.0


def costs_of(metrics: dict[str, Metrics]) -> PairCosts:
    config = make_config(SINGLE_PODS)
    picker = make_picker(config, make_pool(config, metrics, NOW))
    return picker.costs(make_request(2000, max_tokens=64), now=NOW)


# e0 computes soonest but runs a big batch (its stall on others and its TPOT are high); e1 and e2
# have prompts queued.
BUSY_DECODER = {"e0": Metrics(running=60), "e1": Metrics(waiting=4), "e2": Metrics(waiting=12)}


def test_own_ttft_leaves_out_the_stall_a_prompt_inflicts_on_others() -> None:
    costs = costs_of(BUSY_DECODER)
    stall = costs.terms["interference"]
    own = slo.own_ttft_s(costs)
    assert stall[0] > 0.1  # the batch of 60 makes e0's stall large
    np.testing.assert_allclose(own[0], costs.ttft_s[0] - stall[costs.decode])
    assert own[0, 0] < costs.ttft_s[0, 0]


def test_feasible_routes_meet_the_ttft_budget_and_the_decode_pods_tpot() -> None:
    costs = costs_of(BUSY_DECODER)
    own = slo.own_ttft_s(costs)
    budget = float(np.sort(own.ravel())[1])  # two routes fit
    ok = slo.feasible(costs, budget, None)
    assert ok.sum() == 2
    assert (own[ok] <= budget).all() and (own[~ok] > budget).all()
    # A TPOT objective below e0's predicted TPOT takes e0's column out, whatever the TTFT.
    tpot = costs.view.tpot_s[costs.decode]
    ok = slo.feasible(costs, None, float(tpot[0]) * 0.9)
    assert not ok[:, 0].any() and ok[:, 1:].any()
    np.testing.assert_array_equal(slo.feasible(costs, None, None), np.isfinite(costs.cost))


def test_a_pod_computing_prompts_half_its_time_decodes_at_half_the_speed_its_step_says() -> None:
    config = make_config(SINGLE_PODS)
    pool = make_pool(
        config, {"e0": Metrics(running=8), "e1": Metrics(running=8), "e2": Metrics(running=8)}, NOW
    )
    e0 = pool.endpoints["e0"].slot
    pool.prefill_rate[e0] = config.engine.prefill_tokens_per_s / 2  # its prompts take half its time
    costs = make_picker(config, pool).costs(make_request(2000, max_tokens=64), now=NOW)
    step = costs.view.tpot_s[costs.decode]
    stalled = slo.decode_tpot_s(costs)
    assert stalled[0] == pytest.approx(2 * step[0])
    np.testing.assert_allclose(stalled[1:], step[1:])  # the others compute no prompts
    # The decision's prediction (debug headers, traces, the accuracy histogram) says the same.
    assert costs.prediction(-1, 0).tpot_s == pytest.approx(stalled[0])
    # An objective their steps meet: e0's answers, stalled by its prompts, would not.
    ok = slo.feasible(costs, None, float(step.max()) * 1.5)
    assert not ok[:, 0].any() and ok[:, 1:].any()
    pool.prefill_rate[e0] = 1e9  # a rate past any sense: the prediction is capped, not infinite
    capped = slo.decode_tpot_s(make_picker(config, pool).costs(make_request(2000, max_tokens=64), now=NOW))
    assert capped[0] == pytest.approx(step[0] / (1 - MAX_PREFILL_SHARE))


def test_infeasible_cells_stay_infeasible_whatever_the_slo() -> None:
    costs = costs_of(BUSY_DECODER)
    costs.cost[1, 2] = np.inf
    assert not slo.feasible(costs, 1e9, 1e9)[1, 2]


def test_a_relaxed_request_leaves_the_routes_fast_enough_for_the_tightest_objective() -> None:
    costs = costs_of({"e0": Metrics(), "e1": Metrics(waiting=4), "e2": Metrics(waiting=12)})
    own = slo.own_ttft_s(costs)
    ok = slo.feasible(costs, 2.0, None)
    tightest = 0.15
    assert (own[ok] <= tightest).any()  # some routes are fast enough for the tight requests
    kept = slo.reserved(costs, ok, 2.0, tightest)
    assert kept.any() and (own[kept] > tightest).all()
    chosen = np.unravel_index(np.argmin(slo.restricted(costs, kept)), costs.cost.shape)
    assert own[chosen] > tightest


def test_reserve_changes_nothing_for_tight_requests_or_when_only_fast_routes_meet_the_slo() -> None:
    costs = costs_of({"e0": Metrics(), "e1": Metrics(waiting=4), "e2": Metrics(waiting=12)})
    ok = slo.feasible(costs, 2.0, None)
    assert (slo.reserved(costs, ok, 0.2, 0.15) == ok).all()  # under twice the tightest: tight too
    assert (slo.reserved(costs, ok, 2.0, None) == ok).all()  # no tight objective seen
    only_fast = ok & (slo.own_ttft_s(costs) <= 0.15)
    assert (slo.reserved(costs, only_fast, 2.0, 0.15) == only_fast).all()


def test_restricted_keeps_the_cost_where_feasible_and_inf_elsewhere() -> None:
    costs = costs_of(BUSY_DECODER)
    ok = np.zeros_like(costs.cost, dtype=bool)
    ok[0, 1] = True
    out = slo.restricted(costs, ok)
    assert out[0, 1] == costs.cost[0, 1] and np.isinf(out[~ok]).all()
