"""Term ``interference`` (prefill side): the stall a prefill inflicts on a pod's running decodes.

Each decode running on the pod that computes the prompt waits once for as long as the prefill
takes; over an answer of the pool's typical length (its usual ``max_tokens`` times the share
answers use) that is ``prefill_s / typical_answer_tokens`` on its time per output token, priced at
``tpot_weight`` (in seconds of TTFT: the ``load`` term's price for a 100-token answer; priced at
each stalled answer's own length, as the ``load`` term prices its own request's, chat turns lost
most of what that change won: docs/quality.md)::

    stall = prefill_s * decoding / typical_answer_tokens * tpot_weight

``decoding`` is the running batch on a pod that decodes by role (``prefill-decode``, or the decode
pod itself when there is no prefill leg), and on a prefill pod the whole requests it is answering
(``picker.prefill_may_decode``; ``decoding_requests``, as the ``step`` term reads them). Without the
latter, prompts kept landing on the prefill pods that answered requests, free of charge, and those
answers ran at several times the decode pods' TPOT (docs/quality.md, "The stall on a prefill pod's
own answers"). (Priced as whole user-seconds of delay, one second of stall per second of TTFT, it
outweighed a prompt's own wait: pd-router then kept prompts off decode pods that would have
answered them soonest; docs/quality.md.) Units: seconds.
Consumes: ``can_decode``, ``running``/``inflight_requests`` (through ``batch``),
``decoding_requests``.
"""

from __future__ import annotations

import numpy as np

from router.scheduling.costmodel.view import Side, View


def stalled_decodes(view: View) -> np.ndarray:
    """The answers running on each pod that a stall there holds up: the running batch where the
    role decodes, the whole requests it is answering on a prefill pod."""
    return np.where(view.cand.can_decode, view.batch, view.cand.decoding_requests)


class DecodeStall:
    name = "interference"
    side: Side = "prefill"

    def seconds(self, view: View) -> np.ndarray:
        per_stalled = view.objectives.tpot_weight / max(view.ctx.typical_answer_tokens, 1.0)
        return view.prefill_s * stalled_decodes(view) * per_stalled


def term() -> DecodeStall:
    return DecodeStall()
