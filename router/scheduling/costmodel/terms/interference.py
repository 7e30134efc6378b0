"""Term ``interference`` (prefill side): the stall a prefill inflicts on a pod's running decodes.

On a pod that also decodes (``prefill-decode``, or the decode pod itself when there is no prefill
leg) each of the ``batch`` running decodes waits once for as long as the prefill takes; over an
answer of the pool's typical length (its usual ``max_tokens`` times the share answers use) that is
``prefill_s / typical_answer_tokens`` on its time per output token, priced at ``tpot_weight`` (in
seconds of TTFT: the ``load`` term's price for a 100-token answer; priced at each stalled answer's
own length, as the ``load`` term prices its own request's, chat turns lost most of what that change
won: docs/quality.md)::

    stall = prefill_s * batch / typical_answer_tokens * tpot_weight

Prefill-only pods have no decodes to stall. (Priced as whole user-seconds of delay, one second of
stall per second of TTFT, it outweighed a prompt's own wait: pd-router then kept prompts off decode
pods that would have answered them soonest; docs/quality.md.) Units: seconds.
Consumes: ``can_decode``, ``running``/``inflight_requests`` (through ``batch``).
"""

from __future__ import annotations

import numpy as np

from router.scheduling.costmodel.view import Side, View


class DecodeStall:
    name = "interference"
    side: Side = "prefill"

    def seconds(self, view: View) -> np.ndarray:
        per_stalled = view.objectives.tpot_weight / max(view.ctx.typical_answer_tokens, 1.0)
        return np.where(view.cand.can_decode, view.prefill_s * view.batch * per_stalled, 0.0)


def term() -> DecodeStall:
    return DecodeStall()
