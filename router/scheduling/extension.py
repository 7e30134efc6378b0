"""The extension points: one small Protocol each, its contract in the docstring.

The contracts are enforced once, by the runner that calls them (``Picker`` for filters, cost terms
and pair pickers; ``RequestFlow`` for producers), not by every implementation. How to add one:
``docs/architecture.md`` "Extending pd-router".
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from router.request.types import RouteRequest
from router.scheduling.costmodel.policies import PairPicker
from router.scheduling.costmodel.view import Candidates, CostTerm

__all__ = ["CandidateFilter", "CostTerm", "PairPicker", "Producer"]


class CandidateFilter(Protocol):
    """Which candidates may take this request at all.

    Contract, checked by ``Picker``: ``mask`` returns a bool array of shape ``(k,)`` aligned
    with ``cand`` (True = keep), or ``None`` when it keeps every candidate (the cheap common
    case). Pure and synchronous: reads the candidates' features and the request, may read (never
    write) the pool it was built with. Runs before the prefix-index lookup, so
    ``cand.cached_blocks`` is not known yet. A filter that removes every decode pod makes the
    request a 503 (``NoCapacity``), never an unfiltered pick.
    """

    name: str

    def mask(self, cand: Candidates, request: RouteRequest) -> np.ndarray | None: ...


class Producer(Protocol):
    """I/O a pick needs, done before it: fills fields of the request or refreshes local state.

    Contract: may await; bounds its own time (a producer that waits on a remote service has a
    timeout); never raises for a remote failure it can route without (the flow logs and goes on
    if it does); never touches the pool's reservations. ``fills``: True when it writes fields of
    the request that other producers read (those run first, one after another, in order); False
    when it only reads the request and refreshes local state (those then run all at once, so a
    request waits for the slowest lookup, not for their sum). ``wanted``: whether it has anything
    to do for this request (synchronous, cheap): a request no producer wants is picked without
    awaiting, and ext_proc answers it without pausing its stream. Examples: tokenizing the prompt
    into vLLM's block hashes (precise mode, fills, always wanted), one Redis lookup refreshing the
    shared-index mirror (not wanted while the replicas push their writes into it).
    """

    name: str
    fills: bool

    def wanted(self, request: RouteRequest) -> bool: ...

    async def produce(self, request: RouteRequest) -> None: ...
