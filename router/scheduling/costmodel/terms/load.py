"""Term ``load`` (decode side): the predicted time per output token with this request added.

``tpot = step_base + per_seq * (batch + 1) + per_kv_token * (used_kv + need)`` where
``batch = max(scraped running, our in-flight requests)`` (scrapes lag behind our own picks; other
replicas only show in scrapes). Unknown ``running`` is the pool's worst known. The term is TPOT
in seconds of TTFT: ``tpot * tpot_weight`` (``picker.tpot_weight``, 10 by default: as if the first
ten answer tokens were awaited; not the SLOs' ratio, which would make the trade depend on how
tight the targets are set).
Consumes: ``running``, ``inflight_requests``, KV use (``router/scheduling/costmodel/terms/kv.py``).
"""

from __future__ import annotations

import numpy as np

from router.scheduling.costmodel.view import Candidates, EngineModel, Side, View, fill_unknown


def batch_size(cand: Candidates) -> np.ndarray:
    return np.maximum(fill_unknown(cand.running, worst=0.0), cand.inflight_requests)


def tpot_s(model: EngineModel, kv_tokens: np.ndarray, batch: np.ndarray) -> np.ndarray:
    """``kv_tokens``: resident KV including this request (used + need); ``batch``: ``batch_size``."""
    return (
        model.decode_step_base_s
        + model.decode_s_per_seq * (batch + 1.0)
        + model.decode_s_per_kv_token * kv_tokens
    )


class DecodeLoad:
    name = "load"
    side: Side = "decode"

    def seconds(self, view: View) -> np.ndarray:
        return view.tpot_s * view.objectives.tpot_weight


def term() -> DecodeLoad:
    return DecodeLoad()
