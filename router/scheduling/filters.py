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


class ResponseHome:
    """A request continuing a stored answer (``previous_response_id``) only on the engine that
    gave it, while that engine is a candidate (``router/state/response_homes.py``); otherwise no
    restriction: whichever engine gets it answers whether it knows the answer."""

    name = "response_home"

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def mask(self, cand: Candidates, request: RouteRequest) -> np.ndarray | None:
        if request.previous_response_id is None:
            return None
        endpoint_id = self.pool.response_homes.home(request.previous_response_id)
        endpoint = None if endpoint_id is None else self.pool.endpoints.get(endpoint_id)
        if endpoint is None:
            return None
        home = cand.slots == endpoint.slot
        return home if home.any() else None
