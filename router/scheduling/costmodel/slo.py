"""Per-request SLOs over one pick's cost matrix: which routes meet them, and which of those fits.

Pure numpy over ``PairCosts`` (masks over the ``(1 + L, kd)`` matrix, no per-endpoint loop):

* **feasible**: the TTFT the request itself would see (``own_ttft_s``: the route's predicted
  TTFT, ``PairCosts.ttft_s``, less the ``interference`` term, which prices the stall this prompt
  inflicts on the computing pod's running decodes: a cost to others, not a wait of its own) is
  within the request's remaining TTFT budget, and its decode pod's predicted TPOT
  (``decode_tpot_s``: the decode step stretched by the prompts the pod computes meanwhile) within
  its TPOT objective. A measure without an objective constrains nothing;
  an infeasible cell (+inf cost) stays infeasible.
* **reserved** (the headroom-efficient fit): a *relaxed* request (TTFT budget at least
  ``RELAXED_FACTOR`` × the tightest objective the pool has seen recently) does not take a route
  fast enough for that tightest objective while a slower route also meets its own: those are the
  only routes tight requests can use. Among what is left the normal cost decides (so prefix
  locality, transfer, decode load and KV still count); when every feasible route is fast, the
  relaxed request takes the cheapest of them as before. On an idle pool nothing changes; once
  queues grow, relaxed traffic gathers on the pods already too slow for tight requests and the
  others stay short.
"""

from __future__ import annotations

import numpy as np

from router.scheduling.costmodel.matrix import PairCosts
from router.scheduling.costmodel.terms.load import stalled_tpot_s

# The prefill-side term that is a cost to others (the running decodes a prompt stalls), not time
# the request waits for its first token (``terms/interference.py``).
STALL_TERM = "interference"
# A request is relaxed, and leaves the fast routes to tight ones, when its TTFT budget is at least
# this many times the tightest objective seen: a request near the tightest is itself tight.
RELAXED_FACTOR = 2.0


def feasible(
    costs: PairCosts, ttft_budget_s: float | None, tpot_s: float | None, own: np.ndarray | None = None
) -> np.ndarray:
    """``(1 + L, kd)`` bool: routes predicted to meet both objectives (None: unconstrained);
    ``own``: ``own_ttft_s(costs)`` when the caller has it already."""
    ok = np.isfinite(costs.cost)
    if ttft_budget_s is not None:
        ok &= (own_ttft_s(costs) if own is None else own) <= ttft_budget_s
    if tpot_s is not None:
        ok &= (decode_tpot_s(costs) <= tpot_s)[None, :]
    return ok


def decode_tpot_s(costs: PairCosts) -> np.ndarray:
    """``(kd,)``: the TPOT an answer is predicted at on each decode column's pod, the stall of the
    prompts that pod computes included (``terms/load.py``)."""
    return stalled_tpot_s(costs.view)[costs.decode]


def computing(costs: PairCosts) -> np.ndarray:
    """``(1 + L, kd)``: the candidate position of the pod that computes each route's prompt (the
    decode pod itself in row 0, the pair's prefill pod in the others)."""
    decode = np.broadcast_to(costs.decode[None, :], costs.prefill_of.shape)
    return np.where(costs.prefill_of >= 0, costs.prefill_of, decode)


def own_ttft_s(costs: PairCosts) -> np.ndarray:
    """``(1 + L, kd)``: each route's predicted TTFT less the stall it prices for others."""
    stall = costs.terms.get(STALL_TERM)
    if stall is None:
        return costs.ttft_s
    return costs.ttft_s - stall[computing(costs)]


def reserved(
    costs: PairCosts,
    ok: np.ndarray,
    ttft_budget_s: float | None,
    tightest_ttft_s: float | None,
    own: np.ndarray | None = None,
) -> np.ndarray:
    """``ok`` less the routes a relaxed request should leave to tight ones (see the module
    docstring); ``ok`` itself when the request is not relaxed or no slower route meets its SLO."""
    if ttft_budget_s is None or tightest_ttft_s is None or ttft_budget_s < RELAXED_FACTOR * tightest_ttft_s:
        return ok
    slower = ok & ((own_ttft_s(costs) if own is None else own) > tightest_ttft_s)
    return slower if slower.any() else ok


def restricted(costs: PairCosts, ok: np.ndarray) -> np.ndarray:
    """The cost matrix to choose from: the normal cost where ``ok``, +inf elsewhere."""
    return np.where(ok, costs.cost, np.inf)
