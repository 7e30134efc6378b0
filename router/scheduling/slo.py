"""Per-request SLOs in the pick: route to meet them, explore a little, refuse (or hold) what
cannot be met.

``SloGuide.constrain`` turns one pick's ``PairCosts`` into the matrix the pair picker chooses
from, for a request that carries an ``SloTarget`` (a request without one never reaches it, so
its route is exactly the cost model's):

* among routes predicted to meet the objectives (``costmodel.slo.feasible``, against the TTFT
  budget left after any time the request already waited) the normal cost decides; with ``fit:
  reserve`` and flow control on, a relaxed request first leaves the routes fast enough for the
  tightest TTFT objective of the last ``RECENT`` SLO requests to the tight ones
  (``costmodel.slo.reserved``);
* with probability ``exploration`` (a seeded generator owned by this instance) the request is
  routed by the plain cost instead, admission included: the predictions are then tested where
  the SLO logic would otherwise never send traffic, so they keep learning;
* when no route is predicted to meet them, ``admission`` decides: ``reject`` (429 ``SloShed``
  for a sheddable request, else 503 ``SloUnattainable`` with ``Retry-After``), ``hold`` (with flow
  control: ``SloWait``, held earliest deadline first until its TTFT budget is spent, then
  refused; without flow control as ``reject``), or ``off`` (routed by the plain cost, late).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from router.request.rejections import SloShed, SloUnattainable, SloWait
from router.request.types import RouteRequest
from router.scheduling.costmodel import slo
from router.scheduling.costmodel.matrix import PairCosts
from router.scheduling.costmodel.terms.load import prefill_share

Admission = Literal["reject", "hold", "off"]
Fit = Literal["reserve", "cost"]
# The tightest TTFT objective of this many recent SLO requests is what the fast routes are kept
# for: recent enough to follow the traffic, long enough that a lull of tight requests is not
# forgotten at once.
RECENT = 256


@dataclass(frozen=True, slots=True)
class SloSettings:
    admission: Admission = "hold"
    fit: Fit = "reserve"  # relaxed requests leave the routes tight ones need; "cost": plain argmin
    exploration: float = 0.02  # share of SLO requests routed by the plain cost


class SloGuide:
    """The SLO step of one picker (one per ``Picker``: it owns its random stream)."""

    def __init__(self, settings: SloSettings = SloSettings(), seed: int | None = None) -> None:
        self.settings = settings
        self._rng = np.random.default_rng(seed)
        self.explored = 0  # SLO requests routed by the plain cost on purpose
        self._recent_ttft = np.full(RECENT, np.inf)  # recent TTFT objectives, a ring
        self._at = 0

    def tightest_ttft_s(self) -> float | None:
        """The tightest TTFT objective among the recent SLO requests (None: none had one)."""
        tightest = float(np.minimum.reduce(self._recent_ttft))
        return None if tightest == np.inf else tightest

    def constrain(
        self, costs: PairCosts, request: RouteRequest, *, waited_s: float = 0.0, holds: bool = False
    ) -> PairCosts:
        """The costs to choose ``request``'s route from; raises when no route meets its SLO
        (``holds``: flow control is on, so ``hold`` may wait). ``waited_s``: time since arrival."""
        target = request.slo
        assert target is not None
        settings = self.settings
        if request.slo_explored is None:  # its first pick: a held request is picked again
            if target.ttft_s is not None:
                self._recent_ttft[self._at] = target.ttft_s
                self._at = (self._at + 1) % RECENT
            request.slo_explored = settings.exploration > 0.0 and self._rng.random() < settings.exploration
            self.explored += request.slo_explored
        if request.slo_explored:
            return costs
        budget = None if target.ttft_s is None else target.ttft_s - waited_s
        own = None if budget is None else slo.own_ttft_s(costs)  # the TTFT objective's measure
        ok = slo.feasible(costs, budget, target.tpot_s, own)
        if ok.any():
            # Only with flow control: its wait bound caps the queues relaxed traffic gathers in;
            # without it they grow to the relaxed budget and tight requests lose more than they gain
            # (docs/benchmarks.md, Per-request SLOs).
            if settings.fit == "reserve" and holds:
                ok = slo.reserved(costs, ok, budget, self.tightest_ttft_s(), own)
            return replace(costs, cost=slo.restricted(costs, ok))
        if settings.admission == "off":
            return costs
        message = _unmet(costs, own, budget, target.tpot_s)
        # Held only against a TTFT deadline: a TPOT-only objective has nothing to wait until.
        if settings.admission == "hold" and holds and budget is not None and budget > 0.0:
            raise SloWait(message, retry_after_s=1.0)
        rejection = SloShed if request.priority < 0 else SloUnattainable
        raise rejection(message, retry_after_s=1.0)


def _unmet(costs: PairCosts, own: np.ndarray | None, budget_s: float | None, tpot_s: float | None) -> str:
    """Why no route meets the SLO, with the best predictions (formatted only on refusal)."""
    parts = []
    finite = np.isfinite(costs.cost)
    if own is not None and budget_s is not None and finite.any():
        best = float(own[finite].min())
        left = max(budget_s, 0.0) * 1000
        parts.append(f"best predicted TTFT {best * 1000:.0f} ms against {left:.0f} ms left")
    if tpot_s is not None and len(costs.decode):
        tpot = slo.decode_tpot_s(costs)
        at = int(np.argmin(tpot))
        # How much of it is other prompts' stall on that pod: what no batch size would change.
        share = float(prefill_share(costs.view)[costs.decode[at]])
        stalled = f" (its prompts take {share:.0%} of that pod's time)" if share >= 0.005 else ""
        parts.append(f"best predicted TPOT {tpot[at] * 1000:.1f} ms against {tpot_s * 1000:.1f} ms{stalled}")
    detail = "; ".join(parts) or "no feasible route"
    return f"no route is predicted to meet this request's SLO ({detail})"
