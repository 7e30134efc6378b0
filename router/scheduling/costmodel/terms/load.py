"""Term ``load`` (decode side): the predicted time per output token with this request added,
priced by how many answer tokens it will be paid for.

``tpot = step_base + per_seq * (batch + 1) + per_kv_token * (used_kv + need)`` where
``batch = max(scraped running, our in-flight requests)`` (scrapes lag behind our own picks; other
replicas only show in scrapes). Unknown ``running`` is the pool's worst known. The term is TPOT in
seconds of TTFT: ``tpot * awaited_tokens``, ``picker.tpot_weight`` (10 by default) for a 100-token
answer, in proportion to this request's expected answer (its ``max_tokens`` times the share of it
answers really use, ``Pool.answered_share``), counted within [64, 1024] tokens.

Why in proportion: a second of TPOT is paid once per answer token, so a 300-token answer pays it
ten times as often as a 30-token one. One weight for every request was too much for short chat
answers (the picker kept turns off pods with a queue of a few milliseconds for a TPOT a few
percent lower) and too little for long ones: the same-run comparison is in docs/quality.md ("TPOT
priced by the answer it will be paid for"). The bounds keep it sane where max_tokens says little: below
64 tokens a pod's TPOT still orders equal choices as before (shared-prefix traffic of 16-token
answers lost at p99 with less), and a client asking for 32k tokens it never uses does not make TPOT
outweigh everything else until the share has learned it.

What the term prices is the decode step alone. On a pod that also computes prompts each step that
computes prompt tokens is longer by them, so an answer there runs at ``stalled_tpot_s``: the
step's time over the share of the pod's time its decode steps get. That is the TPOT a request's
own objective is held to (``costmodel/slo.py``); priced here instead, it lost as many cells of the
routing matrix as it won (docs/quality.md, "Told the SLO").

Consumes: ``running``, ``inflight_requests``, KV use (``router/scheduling/costmodel/terms/kv.py``);
``stalled_tpot_s`` also ``prefill_rate``.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np

from router.scheduling.costmodel.view import Candidates, EngineModel, Side, View, fill_unknown

Num = TypeVar("Num", float, np.ndarray)

# The answer length ``tpot_weight`` is stated for, and the bounds of the length priced.
REFERENCE_ANSWER_TOKENS = 100.0
MIN_PRICED_ANSWER_TOKENS = 64.0
MAX_PRICED_ANSWER_TOKENS = 1024.0


def awaited_tokens(tpot_weight: float, answer_tokens: float) -> float:
    """Seconds of TTFT one second of TPOT costs an answer of ``answer_tokens``."""
    priced = min(max(answer_tokens, MIN_PRICED_ANSWER_TOKENS), MAX_PRICED_ANSWER_TOKENS)
    return tpot_weight * priced / REFERENCE_ANSWER_TOKENS


def batch_size(cand: Candidates) -> np.ndarray:
    return np.maximum(fill_unknown(cand.running, worst=0.0), cand.inflight_requests)


def tpot_s(model: EngineModel, kv_tokens: np.ndarray, batch: np.ndarray) -> np.ndarray:
    """``kv_tokens``: resident KV including this request (used + need); ``batch``: ``batch_size``."""
    return (
        model.decode_step_base_s
        + model.decode_s_per_seq * (batch + 1.0)
        + model.decode_s_per_kv_token * kv_tokens
    )


# A pod computing prompts this share of its time or more is predicted at it: beyond, the prediction
# is nearly all stall and would run to infinity on a rate measured over about a second.
MAX_PREFILL_SHARE = 0.9


def share_of_time(prefill_rate: Num, slowness: Num, prefill_tokens_per_s: float) -> Num:
    """The share of a pod's time its prompts take: the prompt tokens we sent it lately per second
    (``Pool.note_prefill``) times the time one takes there (arrays, or one pod's floats)."""
    return np.minimum(prefill_rate * slowness / prefill_tokens_per_s, MAX_PREFILL_SHARE)


def stretched(tpot: Num, share: Num) -> Num:
    """The time per output token an answer sees where the decode step takes ``tpot`` and the pod's
    prompts ``share`` of its time (a chunked-prefill step computes decodes and prompt tokens
    together; the prompts' share of the time is the decode steps' loss)."""
    return tpot / (1.0 - share)


def prefill_share(view: View) -> np.ndarray:
    """``share_of_time`` for each candidate."""
    return share_of_time(view.cand.prefill_rate, view.cand.slowness, view.model.prefill_tokens_per_s)


def stalled_tpot_s(view: View) -> np.ndarray:
    """The TPOT an answer sees on each candidate with this request added and the prompts the pod
    computes meanwhile: ``tpot_s / (1 - prefill_share)``."""
    return stretched(view.tpot_s, prefill_share(view))


class DecodeLoad:
    name = "load"
    side: Side = "decode"

    def seconds(self, view: View) -> np.ndarray:
        return view.tpot_s * awaited_tokens(view.objectives.tpot_weight, view.ctx.answer_tokens)


def term() -> DecodeLoad:
    return DecodeLoad()
