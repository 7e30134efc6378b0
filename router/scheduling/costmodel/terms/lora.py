"""Term ``lora`` (both sides): the adapter load a request for a LoRA adapter waits for.

Per candidate, by what the pool knows of the requested adapter there (``Candidates.adapter_state``,
from ``router/state/lora.py``): 0 where it is resident; a load where a slot is free; a load and
``lora_evict_s`` where every slot is taken (the eviction is the reload the evicted adapter's next
request pays) or where how many slots there are is unknown (unknown is never idle);
``+inf`` where the engine's ``/v1/models`` does not list the adapter, unless no candidate lists it
(then nobody is refused for it and each pays a load and an eviction). A request that names no
adapter costs 0 everywhere.

vLLM loads an adapter inside an engine step, so the pod's running decodes wait for it too: a load
is ``lora_load_s`` for this request plus the stall of the answers running there (``decoding``: the
batch where the role decodes, a prefill pod's whole requests), priced as ``interference`` prices a
prefill's::

    load = lora_load_s * (1 + decoding / typical_answer_tokens * tpot_weight)

Side ``both``: every pod the request runs on needs the adapter, the one that computes the prompt
and, for a pair, the decode pod after the KV arrives. The prompts a load delays on a prefill pod
are the ``queue`` term's to price. Units: seconds.
Consumes: ``adapter_state`` (set per request by the picker).
"""

from __future__ import annotations

import numpy as np

from router.scheduling.costmodel.terms.interference import stalled_decodes
from router.scheduling.costmodel.view import ADAPTER_EVICTS, ADAPTER_NOT_SERVED, ADAPTER_RESIDENT, Side, View


class LoraLoad:
    name = "lora"
    side: Side = "both"

    def seconds(self, view: View) -> np.ndarray:
        state = view.cand.adapter_state
        if state is None:
            return np.zeros(len(view))
        model, o = view.model, view.objectives
        per_stalled = o.tpot_weight / max(view.ctx.typical_answer_tokens, 1.0)
        stalled = stalled_decodes(view)
        load = model.lora_load_s * (1.0 + stalled * per_stalled)
        seconds = np.where(state == ADAPTER_RESIDENT, 0.0, load)
        seconds[state >= ADAPTER_EVICTS] += model.lora_evict_s
        not_served = state == ADAPTER_NOT_SERVED
        if not_served.any() and not not_served.all():
            seconds[not_served] = np.inf
        return seconds


def term() -> LoraLoad:
    return LoraLoad()
