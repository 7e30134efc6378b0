"""Term ``queue`` (prefill side): how long a new prompt waits behind prompts already queued on a pod.

``queued = max(ours, (waiting - waiting_ours)⁺ * typical_prompt_tokens)``: *ours* is the uncached
prompt tokens we routed there that have not finished prefill (exact, up to date between scrapes);
the scraped ``waiting`` count, less those of ours that were queued there when it was scraped
(``waiting_ours``), covers traffic from elsewhere (other router replicas, clients that bypass the
router), sized by the typical prompt. Taking the max does not count other replicas' shared
reservations twice. Without the subtraction our own queued requests, most of whose prompt is
cached, came back from each scrape sized as whole prompts, and a pod holding a conversation's
prefix looked several times busier than it was (docs/quality.md, "The scraped queue less our own").
Unknown ``waiting`` is the pool's worst. ``wait_s = queued / prefill_tokens_per_s``. Units: seconds.
Consumes: ``queued_prefill_tokens``, ``waiting``, ``waiting_ours``.
"""

from __future__ import annotations

import numpy as np

from router.scheduling.costmodel.view import Candidates, EngineModel, RequestCtx, Side, View, fill_unknown


def queued_prompt_tokens(
    ours: np.ndarray, waiting: np.ndarray, waiting_ours: np.ndarray, typical_prompt_tokens: float
) -> np.ndarray:
    """The formula above over known ``waiting``; the pool's signals sum it over a role's pods."""
    return np.maximum(ours, np.maximum(waiting - waiting_ours, 0.0) * typical_prompt_tokens)


def queued_tokens(cand: Candidates, ctx: RequestCtx) -> np.ndarray:
    waiting = fill_unknown(cand.waiting, worst=0.0)
    ours = cand.queued_prefill_tokens
    return queued_prompt_tokens(ours, waiting, cand.waiting_ours, ctx.typical_prompt_tokens)


def wait_s(cand: Candidates, ctx: RequestCtx, model: EngineModel) -> np.ndarray:
    return queued_tokens(cand, ctx) / model.prefill_tokens_per_s


class QueueWait:
    name = "queue"
    side: Side = "prefill"

    def seconds(self, view: View) -> np.ndarray:
        return view.wait_s


def term() -> QueueWait:
    return QueueWait()
