"""KV headroom on the decode pod: a hard filter plus a soft penalty near the edge.

``used = max(kv_usage * capacity, reserved_kv_tokens)`` (scraped usage, or our reservations when
they are newer), ``need = prompt_tokens + max_tokens``. A candidate whose known capacity cannot
hold ``used + need`` is filtered out. The penalty is ``max(0, frac - soft) / (1 - soft)`` with
``frac = (used + need) / capacity``: 0 below the soft threshold, 1 at full. Units: a fraction of
one TTFT SLO (the weighting multiplies). Unknown usage is the pool's worst known usage; unknown
capacity cannot be filtered and pays the penalty of the worst known fraction.
"""

from __future__ import annotations

import numpy as np

from scorers.base import Candidates, RequestCtx, fill_unknown


def used_tokens(cand: Candidates) -> np.ndarray:
    usage = fill_unknown(cand.kv_usage, worst=1.0)
    # fmax ignores NaN: unknown capacity leaves our own reservations as the estimate.
    return np.fmax(usage * cand.kv_capacity_tokens, cand.reserved_kv_tokens)


def need_tokens(ctx: RequestCtx) -> int:
    return ctx.prompt_tokens + ctx.max_tokens


def fits(cand: Candidates, ctx: RequestCtx, used: np.ndarray) -> np.ndarray:
    """Bool mask: the request's KV would fit (unknown capacity counts as fitting)."""
    return ~((used + need_tokens(ctx)) > cand.kv_capacity_tokens)


def penalty(cand: Candidates, ctx: RequestCtx, used: np.ndarray, soft_threshold: float) -> np.ndarray:
    frac = fill_unknown((used + need_tokens(ctx)) / cand.kv_capacity_tokens, worst=0.0)
    return np.maximum(0.0, frac - soft_threshold) / (1.0 - soft_threshold)
