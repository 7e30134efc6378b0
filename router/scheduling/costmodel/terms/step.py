"""Term ``step`` (prefill side): the engine step a prompt is computed in on a prefill pod.

A prompt joins a pod's batch at a step boundary, half a step's wait on average, and is computed in
the step that follows, whose length is the engine's fixed cost plus what every sequence it decodes
adds. A prefill pod decodes the whole requests it serves (``picker.prefill_may_decode``), so its
steps grow with them, and every prompt it computes waits for that::

    step = 1.5 * (step_base + per_seq * decoding + per_kv_token * decoding_kv) * slowness

``decoding`` and ``decoding_kv`` are the requests this router sent there that are past their
prefill, and the KV they hold: a prefill pod's scraped ``running`` also counts the prompts it is
computing, which the ``queue`` and ``prefill`` terms already price. With several picker replicas
each counts only its own (they are not among the reservations shared through Redis), so a pod
looks less busy to each than it is. On the routing benchmark's
decode-bound scenario (e), the prefill pods' whole requests came in at 1.48× their predicted TTFT
without this term and 1.03× with it (docs/quality.md, "A prefill pod's own step").

0 on pods that decode by role: there a local prefill's ``interference`` term prices the running
batch (as a cost to the streams it stalls), and adding the step there too made decisions worse
(docs/quality.md, "Prediction error by decision kind"). Units: seconds. Consumes: ``can_decode``,
``decoding_requests``, ``decoding_kv_tokens``, ``slowness``.
"""

from __future__ import annotations

import numpy as np

from router.scheduling.costmodel.view import Side, View

# Half a step's wait to join the batch, then the step itself.
STEPS_TO_COMPUTE = 1.5


class PrefillPodStep:
    name = "step"
    side: Side = "prefill"

    def seconds(self, view: View) -> np.ndarray:
        m, cand = view.model, view.cand
        step = (
            m.decode_step_base_s
            + m.decode_s_per_seq * cand.decoding_requests
            + m.decode_s_per_kv_token * cand.decoding_kv_tokens
        )
        return np.where(cand.can_decode, 0.0, STEPS_TO_COMPUTE * step * cand.slowness)


def term() -> PrefillPodStep:
    return PrefillPodStep()
