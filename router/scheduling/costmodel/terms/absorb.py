"""Term ``absorb`` (decode side): what a prefill pod pays for serving a whole request.

With ``picker.prefill_may_decode`` (vLLM's NIXL connector in ``kv_both`` mode: every instance
can serve a whole request) a prefill pod is also a decode column, for requests it computes and
decodes itself (no pair). Its own job is prompts, so the decode counts against it: for each of the
request's ``max_tokens`` steps the pod's step grows by what one more sequence costs
(``per_seq + per_kv_token × context``), and every prompt waiting there (at least the next one)
waits that much longer. ``0`` on pods whose role decodes. Units: seconds of others' TTFT. Weighted
0.5 by default (``registry.DEFAULT_WEIGHTS``): the prompts a decode delays are those computed while it
runs, which ``max(waiting, 1)`` over-counts, and at 1 prefill pods served too few whole requests
where the decode pods were the bottleneck (docs/quality.md, "The absorb term at half weight").
Consumes: ``can_decode``, ``waiting``.
"""

from __future__ import annotations

import numpy as np

from router.scheduling.costmodel.view import Side, View, fill_unknown


class PrefillPodDecodes:
    name = "absorb"
    side: Side = "decode"

    def seconds(self, view: View) -> np.ndarray:
        cand, ctx, model = view.cand, view.ctx, view.model
        if np.logical_and.reduce(cand.can_decode):  # .all() without its Python wrapper
            return np.zeros(len(cand))
        step = model.decode_s_per_seq + model.decode_s_per_kv_token * (ctx.prompt_tokens + ctx.max_tokens)
        waiting = np.maximum(fill_unknown(cand.waiting, worst=0.0), 1.0)
        return np.where(cand.can_decode, 0.0, ctx.max_tokens * step * waiting)


def term() -> PrefillPodDecodes:
    return PrefillPodDecodes()
