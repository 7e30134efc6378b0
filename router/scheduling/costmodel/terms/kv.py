"""Term ``kv`` (decode side): a hard filter for the impossible, a penalty that grows past full.

``need = prompt_tokens - cached + max_tokens``: blocks the pod already holds for this prompt are
shared, not allocated again (vLLM's prefix caching), so only the rest needs room.
``used = max(kv_usage * capacity, reserved_kv_tokens)`` (scraped usage, or our reservations when
they are newer). With ``frac = (used + need) / capacity`` the penalty is
``max(0, frac - soft) / (1 - soft)``: 0 below the soft threshold, 1 at exactly full, and growing
beyond, because a pod that is full *now* queues the request until blocks free (that is a wait,
not a refusal). Only a request that cannot fit in the pod's whole capacity is filtered out
(``+inf``). The term is ``penalty * kv_penalty_s`` seconds: at full, the prefill of
``picker.kv_penalty_tokens`` tokens (10,000 by default), what the pod will recompute when the cached
prefixes the pressure evicts are asked for again; in the engine's time, not the TTFT SLO's, so a
relaxed SLO does not make a full pod look worse. Unknown usage is
the pool's worst known usage; unknown capacity cannot be filtered and pays the worst known fraction.

Only decode-only pods pay the penalty (the filter holds everywhere). Sending a request away from a
nearly full decode pod costs a larger KV transfer; sending it away from a full pod that computes
prompts (``prefill-decode``, or a prefill pod that may decode) gives up the prefix it holds, which
is recomputed elsewhere and fills that pod's KV in turn: on the chat scenarios of the routing
benchmark, where every pod is nearly full in a burst, the penalty there kept turns off the pods
holding their prefixes and made the tails (docs/quality.md), while on split pools past capacity
it keeps pairs off full decode pods.
Consumes: ``kv_usage``, ``kv_capacity_tokens``, ``reserved_kv_tokens``, ``can_prefill``.
"""

from __future__ import annotations

import numpy as np

from router.scheduling.costmodel.view import Candidates, RequestCtx, Side, View, fill_unknown


def used_tokens(cand: Candidates) -> np.ndarray:
    usage = fill_unknown(cand.kv_usage, worst=1.0)
    # fmax ignores NaN: unknown capacity leaves our own reservations as the estimate.
    return np.fmax(usage * cand.kv_capacity_tokens, cand.reserved_kv_tokens)


def need_tokens(cached: np.ndarray, ctx: RequestCtx) -> np.ndarray:
    """New KV tokens this request would allocate on each candidate (``cached``: ``prefix.cached_tokens``)."""
    return ctx.prompt_tokens + ctx.max_tokens - cached


def fits(cand: Candidates, need: np.ndarray) -> np.ndarray:
    """Bool mask: the request could ever fit (unknown capacity counts as fitting)."""
    return ~(need > cand.kv_capacity_tokens)


def penalty(cand: Candidates, used: np.ndarray, need: np.ndarray, soft_threshold: float) -> np.ndarray:
    frac = fill_unknown((used + need) / cand.kv_capacity_tokens, worst=0.0)
    return np.maximum(0.0, frac - soft_threshold) / (1.0 - soft_threshold)


class KVPressure:
    name = "kv"
    side: Side = "decode"

    def seconds(self, view: View) -> np.ndarray:
        o = view.objectives
        pen = penalty(view.cand, view.used_kv, view.need_kv, o.kv_soft_threshold)
        pen *= o.kv_penalty_s
        pen[view.cand.can_prefill] = 0.0  # only decode-only pods pay it (the module docstring)
        pen[~fits(view.cand, view.need_kv)] = np.inf
        return pen


def term() -> KVPressure:
    return KVPressure()
