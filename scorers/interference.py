"""Term ``interference`` (prefill side): the stall a prefill inflicts on a pod's running decodes.

``stall = prefill_s * batch`` on a pod that also decodes (``prefill-decode``, or the decode pod
itself when there is no prefill leg); prefill-only pods have no decodes to stall. Each running
decode waits as long as the prefill takes, and those user-seconds count against the choice.
Units: seconds. Consumes: ``can_decode``, ``running``/``inflight_requests`` (through ``batch``).
"""

from __future__ import annotations

import numpy as np

from scorers.base import Side, View


class DecodeStall:
    name = "interference"
    side: Side = "prefill"

    def seconds(self, view: View) -> np.ndarray:
        return np.where(view.cand.can_decode, view.prefill_s * view.batch, 0.0)


def term() -> DecodeStall:
    return DecodeStall()
