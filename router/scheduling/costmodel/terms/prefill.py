"""Term ``prefill`` (prefill side): the time to compute the part of the prompt a pod has not cached.

``prefill_s = uncached / prefill_tokens_per_s`` with ``uncached`` from ``costmodel/prefix.py``
(prefix locality after the fairness cap). Units: seconds. Consumes: ``cached_blocks`` and, through
the fairness cap, the queue wait.
"""

from __future__ import annotations

import numpy as np

from router.scheduling.costmodel.view import Side, View


class PrefillCompute:
    name = "prefill"
    side: Side = "prefill"

    def seconds(self, view: View) -> np.ndarray:
        return view.prefill_s


def term() -> PrefillCompute:
    return PrefillCompute()
