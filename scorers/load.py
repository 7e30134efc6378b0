"""In-flight load on the decode pod: the predicted time per output token with this request added.

``tpot = step_base + per_seq * (batch + 1) + per_kv_token * (used_kv + need)`` where
``batch = max(scraped running, our in-flight requests)`` (scrapes lag behind our own picks; other
replicas only show in scrapes). Unknown ``running`` is the pool's worst known. Units: seconds.
"""

from __future__ import annotations

import numpy as np

from scorers.base import Candidates, EngineModel, RequestCtx, fill_unknown
from scorers.kv_headroom import need_tokens


def batch_size(cand: Candidates) -> np.ndarray:
    return np.maximum(fill_unknown(cand.running, worst=0.0), cand.inflight_requests)


def tpot_s(
    cand: Candidates, ctx: RequestCtx, model: EngineModel, used_kv: np.ndarray, batch: np.ndarray
) -> np.ndarray:
    """``used_kv`` from ``kv_headroom.used_tokens``, ``batch`` from ``batch_size`` (computed once)."""
    return (
        model.decode_step_base_s
        + model.decode_s_per_seq * (batch + 1.0)
        + model.decode_s_per_kv_token * (used_kv + need_tokens(ctx))
    )
