from __future__ import annotations

import numpy as np

from router.scheduling.costmodel.link import LinkCosts
from router.scheduling.costmodel.matrix import CostModel, WeightedTerm, derive
from router.scheduling.costmodel.registry import DEFAULT_WEIGHTS, load_term
from router.scheduling.costmodel.view import Candidates, EngineModel, Objectives, RequestCtx, View

MODEL = EngineModel(
    prefill_tokens_per_s=10000.0,
    decode_step_base_s=0.004,
    pd_leg_overhead_s=0.001,
    decode_s_per_seq=0.0002,
    decode_s_per_kv_token=1e-7,
    kv_bytes_per_token=100_000,
)


LINKS = LinkCosts(same=(0.0001, 50e9), default=(0.005, 1e9))


def cands(n: int = 3, **features: list[float]) -> Candidates:
    """Candidates with idle, known defaults; override any feature with a list of n values."""
    defaults: dict[str, np.ndarray] = {
        "slots": np.arange(n),
        "running": np.zeros(n),
        "waiting": np.zeros(n),
        "kv_usage": np.zeros(n),
        "kv_capacity_tokens": np.full(n, 10000.0),
        "queued_prefill_tokens": np.zeros(n),
        "slowness": np.ones(n),
        "reserved_kv_tokens": np.zeros(n),
        "inflight_requests": np.zeros(n, dtype=np.int64),
        "decoding_requests": np.zeros(n, dtype=np.int64),
        "decoding_kv_tokens": np.zeros(n),
        "waiting_ours": np.zeros(n),
        "prefill_rate": np.zeros(n),
        "link_index": np.zeros(n, dtype=np.int64),
        "can_decode": np.zeros(n, dtype=bool),
        "can_prefill": np.ones(n, dtype=bool),
        "cached_blocks": np.zeros(n, dtype=np.int32),
    }
    for name, values in features.items():
        defaults[name] = np.asarray(values, dtype=defaults[name].dtype)
    return Candidates(**defaults)


def objectives(**overrides: float) -> Objectives:
    return Objectives(**{"ttft_slo_s": 1.0, "tpot_slo_s": 0.05, "kv_soft_threshold": 0.9, **overrides})


def view(cand: Candidates, c: RequestCtx | None = None, **overrides: float) -> View:
    """The derived quantities of one pick over ``cand`` (default weights)."""
    return derive(cand, c or ctx(), cost_model(objectives(**overrides)))


def cost_model(o: Objectives | None = None, **fields: object) -> CostModel:
    """The default terms (weight 1) over ``MODEL``; ``fields`` override CostModel fields."""
    terms = tuple(WeightedTerm(load_term(name), 1.0) for name in DEFAULT_WEIGHTS)
    base = {"objectives": o or objectives(), "model": MODEL, "links": LINKS, "terms": terms}
    return CostModel(**{**base, **fields})  # type: ignore[arg-type]


def ctx(prompt_tokens: int = 1000, max_tokens: int = 100) -> RequestCtx:
    return RequestCtx(prompt_tokens, max_tokens, block_tokens=16, typical_prompt_tokens=500.0)
