"""A request's latency objectives: the ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` headers, else its
InferenceObjective's defaults (``slo.objectives`` in the configuration).

The headers are a documented client input, not a routing header the router owns: they are read
here and forwarded to the engines unchanged (vLLM ignores them; a sidecar or an engine-side proxy
may log them). A value that is not a positive number of milliseconds of at most an hour is a 400
naming the header, so a typo never silently turns a tight objective into none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from router.request.parse import objective_of
from router.request.rejections import BadRequest
from router.request.types import SloTarget

# The defaults of requests that name no InferenceObjective (``slo.default_objective``), in the
# same mapping as the named ones: no objective is named "" (the configuration refuses it).
UNNAMED = ""
TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"
# Beyond an hour an objective is a mistake (seconds sent as milliseconds' multiple, a timestamp),
# not a latency target: refused rather than read as "no objective".
MAX_SLO_MS = 3_600_000.0


def slo_of(headers: Mapping[str, str], defaults: Mapping[str, SloTarget] | None = None) -> SloTarget | None:
    """The request's objectives: each header wins over its objective's default for that measure (a
    request naming none: ``defaults[UNNAMED]``, when configured); None when neither says anything
    (the request is routed exactly as without SLOs)."""
    objective = objective_of(headers)
    default = defaults.get(objective or UNNAMED) if defaults else None
    ttft = _ms(headers, TTFT_HEADER)
    tpot = _ms(headers, TPOT_HEADER)
    if ttft is None and default is not None:
        ttft = default.ttft_s
    if tpot is None and default is not None:
        tpot = default.tpot_s
    if ttft is None and tpot is None:
        return None
    # A request naming none is counted under the default objective whose SLOs it was given.
    return SloTarget(ttft, tpot, default.objective if default is not None else objective)


def _ms(headers: Mapping[str, str], name: str) -> float | None:
    """Header ``name`` as seconds; raises ``BadRequest`` for anything but 0 < ms ≤ an hour."""
    raw = headers.get(name)
    if raw is None:
        return None
    shown = raw if len(raw) <= 32 else raw[:32] + "..."
    try:
        ms = float(raw.strip())
    except ValueError:
        raise BadRequest(f"header {name} must be a number of milliseconds, got {shown!r}") from None
    if not math.isfinite(ms) or ms <= 0:
        raise BadRequest(f"header {name} must be a positive number of milliseconds, got {shown!r}")
    if ms > MAX_SLO_MS:
        raise BadRequest(f"header {name} is {ms:g} ms; an objective is at most {MAX_SLO_MS:g} ms (an hour)")
    return ms / 1000.0
