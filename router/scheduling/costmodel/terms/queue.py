"""Term ``queue`` (prefill side): how long a new prompt waits behind prompts already queued on a pod.

``queued = max(ours, waiting * typical_prompt_tokens)``: *ours* is the uncached prompt tokens we
routed there that have not finished prefill (exact, up to date between scrapes); the scraped
``waiting`` count covers traffic from elsewhere (other router replicas), sized by the typical
prompt. Taking the max does not count our own requests twice. Unknown ``waiting`` is the pool's
worst. ``wait_s = queued / prefill_tokens_per_s``. Units: seconds.
Consumes: ``queued_prefill_tokens``, ``waiting``.
"""

from __future__ import annotations

import numpy as np

from router.scheduling.costmodel.view import Candidates, EngineModel, RequestCtx, Side, View, fill_unknown


def queued_tokens(cand: Candidates, ctx: RequestCtx) -> np.ndarray:
    waiting = fill_unknown(cand.waiting, worst=0.0)
    return np.maximum(cand.queued_prefill_tokens, waiting * ctx.typical_prompt_tokens)


def wait_s(cand: Candidates, ctx: RequestCtx, model: EngineModel) -> np.ndarray:
    return queued_tokens(cand, ctx) / model.prefill_tokens_per_s


class QueueWait:
    name = "queue"
    side: Side = "prefill"

    def seconds(self, view: View) -> np.ndarray:
        return view.wait_s


def term() -> QueueWait:
    return QueueWait()
