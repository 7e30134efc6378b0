"""Header names the router owns, and the ones never copied from one HTTP hop to the next."""

from __future__ import annotations

import math
from typing import NamedTuple

DESTINATION = "x-gateway-destination-endpoint"
DESTINATION_SUBSET = "x-gateway-destination-endpoint-subset"
DESTINATION_SERVED = "x-gateway-destination-endpoint-served"
PREFILLER = "x-prefiller-host-port"
DEBUG_DECODE = "x-pd-router-decode"
DEBUG_PREFILL = "x-pd-router-prefill"
DEBUG_REASON = "x-pd-router-reason"
# Set by a sidecar on the prefill leg it sends to a peer's sidecar; a client's copy is removed at
# the gateway and by the proxy like every header here, so only a peer can mark a prefill leg.
PREFILL_LEG = "x-pd-prefill-leg"

# A sidecar times the prefill leg it ran in its answer's ``Server-Timing`` (W3C: a metric, ``dur``
# in milliseconds), so behind Envoy the picker's prefill model learns from pairs as the proxy's does.
SERVER_TIMING = "server-timing"
PREFILL_TIMING_METRIC = "pd-prefill"
MAX_PREFILL_TIMING_S = 3600.0  # longer is no prompt's compute time: a broken clock or value
MAX_COUNT_DIGITS = 12  # a token count of more digits is no prompt's

# Routing and control headers only the router may set (the Inference Extension's, llm-d's and
# ours): a client's copy is removed before anything is forwarded, so clients cannot steer routing.
ROUTER_HEADERS = (
    DESTINATION,
    PREFILLER,
    DESTINATION_SERVED,
    "x-encoder-hosts-ports",
    "x-data-parallel-host-port",
    "x-kv-cache-source-host-port",
    "x-prefiller-url",  # llm-d's legacy name of the prefill header
    DEBUG_DECODE,
    DEBUG_PREFILL,
    PREFILL_LEG,
)

# Connection-specific (RFC 9110 §7.6.1) or recomputed for each leg: never copied between hops.
HOP_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "upgrade", "trailer"}
)
# Never copied into an exchange leg: hop headers, the router's own, and what each leg sets itself
# (its request id and content type). The legs re-encode JSON, so they ask for identity bodies.
LEG_DROPPED = HOP_HEADERS | frozenset(ROUTER_HEADERS) | {"accept-encoding", "x-request-id", "content-type"}
# Never copied by a pass-through (which keeps Accept-Encoding: encoded bytes go back as they are).
PASSTHROUGH_DROPPED = HOP_HEADERS | frozenset(ROUTER_HEADERS)


def forwardable(headers: object, dropped: frozenset[str] = LEG_DROPPED) -> dict[str, str]:
    """A client's headers minus ``dropped`` (lower-case names); ``headers`` is any items() mapping."""
    return {k: v for k, v in headers.items() if k.lower() not in dropped}  # type: ignore[attr-defined]


class PrefillTiming(NamedTuple):
    """What a sidecar reports of the prefill leg it ran: its seconds, and the prompt tokens and
    cached tokens of the prefill engine's ``usage`` (None where it did not say)."""

    seconds: float
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


def prefill_timing(timing: PrefillTiming) -> str:
    """The ``Server-Timing`` value that reports ``timing`` (the counts as extra parameters, which
    other readers of the header ignore)."""
    value = f"{PREFILL_TIMING_METRIC};dur={timing.seconds * 1000.0:.3f}"
    if timing.prompt_tokens is not None:
        value += f";prompt={timing.prompt_tokens}"
    if timing.cached_tokens is not None:
        value += f";cached={timing.cached_tokens}"
    return value


def read_prefill_timing(server_timing: str) -> PrefillTiming | None:
    """The prefill leg's report in a ``Server-Timing`` value (``prefill_timing``'s metric among any
    others); None without it, or when its ``dur`` is not a plausible duration (a count that is not
    one is left out)."""
    for metric in server_timing.split(","):
        name, *parts = (part.strip() for part in metric.split(";"))
        if name != PREFILL_TIMING_METRIC:
            continue
        params = {}
        for part in parts:
            key, _, value = part.partition("=")
            params[key.strip().lower()] = value.strip().strip('"')
        try:
            seconds = float(params["dur"]) / 1000.0
        except (KeyError, ValueError):
            return None
        if not (math.isfinite(seconds) and 0.0 <= seconds <= MAX_PREFILL_TIMING_S):
            return None
        return PrefillTiming(seconds, _count(params.get("prompt")), _count(params.get("cached")))
    return None


def _count(text: str | None) -> int | None:
    """A token count's digits (at most ``MAX_COUNT_DIGITS``: a longer one is no prompt's, and
    ``int`` refuses very long ones with an error); None for anything else."""
    if text is None or not (0 < len(text) <= MAX_COUNT_DIGITS and text.isascii() and text.isdigit()):
        return None
    return int(text)
