"""The candidate filters the router ships (``router.scheduling.extension.CandidateFilter``)."""

from __future__ import annotations

import numpy as np

from router.request.types import RouteRequest
from router.scheduling.costmodel.view import Candidates
from router.state.pool import Pool


class SubsetHint:
    """Only the endpoints a gateway named in ``envoy.lb.subset_hint`` (when it named any)."""

    name = "subset_hint"

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def mask(self, cand: Candidates, request: RouteRequest) -> np.ndarray | None:
        if request.subset is None:
            return None
        return np.isin(cand.slots, self.pool.slots_of(request.subset))
