"""Prefix locality: how many of the prompt's tokens a candidate must still compute.

``uncached = prompt_tokens - trust * cached``, where ``cached`` is the candidate's longest cached
prefix (in blocks × block size), capped at ``prompt_tokens - 1`` because an engine always computes
at least the last token. ``trust`` in [0, 1] is ``weights.prefix``, zeroed by the fairness cap on
candidates whose predicted queue wait is far above the least-loaded one, so a warm cache cannot
pin traffic on a hot pod. Units: tokens. Consumes: ``cached_blocks``. The seconds this saves are
the ``prefill`` term's (``router/scheduling/costmodel/terms/prefill.py``).
"""

from __future__ import annotations

import numpy as np

from router.scheduling.costmodel.view import Candidates, RequestCtx


def cached_tokens(cand: Candidates, ctx: RequestCtx) -> np.ndarray:
    # Block counts are never negative, so only the upper cap needs applying.
    return np.minimum(cand.cached_blocks * float(ctx.block_tokens), max(ctx.prompt_tokens - 1, 0))


def fairness_trust(wait_s: np.ndarray, weight: float, max_skew_s: float) -> np.ndarray:
    """Locality credit per candidate: ``weight`` where the wait is within ``max_skew_s`` of the least."""
    if wait_s.size == 0:
        return wait_s
    return np.where(wait_s <= np.minimum.reduce(wait_s) + max_skew_s, weight, 0.0)


def uncached_tokens(cached: np.ndarray, ctx: RequestCtx, trust: np.ndarray | float) -> np.ndarray:
    """``cached`` from ``cached_tokens`` (computed once per pick)."""
    return ctx.prompt_tokens - trust * cached
