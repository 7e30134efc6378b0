"""Typed rejections, and the one table that turns each into the client's answer.

A rejection says what the client should do next: fix the request (400/404/413), come back
later (429/503 with ``Retry-After``), or know that the engines failed (502). The proxy, the
ext_proc picker and the sidecar all answer through ``answer()``, so the same mistake gets the same
status, headers and OpenAI-style JSON body whichever way a request arrived.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

# Not a rejection: the engine cut its answer after the client had part of it. The code of the SSE
# error event the stream ends with (``router/http/exchange.py``) and the request's outcome label.
UPSTREAM_DISCONNECTED = "upstream_disconnected"


class Rejection(Exception):
    """A request we will not route (or could not serve); ``answer()`` gives its response."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def code(self) -> str:
        """Stable machine-readable code: the ``x-pd-router-reject`` header and the outcome label."""
        return _kind(self).code

    @property
    def status(self) -> int:
        return _kind(self).status


class BadRequest(Rejection):
    """Malformed body or a missing/invalid field: fix the request."""


class BodyTooLarge(BadRequest):
    """Body or prompt over the configured limit."""


class UnknownModel(Rejection):
    """The pool does not serve this model."""


class PrefillForbidden(Rejection):
    """A sidecar's allow list names neither the prefill target nor the peer sending a prefill leg;
    nothing was sent anywhere."""


class Shed(Rejection):
    """A sheddable request while the pool is saturated: retry later."""


class NoCapacity(Rejection):
    """No admitted, fresh endpoint can take this request now: retry after ``Retry-After``."""


class Saturated(NoCapacity):
    """Every eligible pod is saturated (the predicted queue wait is over the bound): with flow
    control the request waits for room instead (``router.flow.hold_queue``)."""


class QueueFull(NoCapacity):
    """Flow control holds as many requests as it may: retry later."""


class QueueTimeout(NoCapacity):
    """The request waited its deadline in flow control without a pod having room."""


class SloUnattainable(NoCapacity):
    """No route is predicted to meet the request's SLO (``x-slo-ttft-ms``/``x-slo-tpot-ms`` or its
    objective's): refused now rather than answered late; retry after ``Retry-After``."""


class SloShed(Shed):
    """``SloUnattainable`` for a sheddable request (priority < 0): 429."""


class SloWait(Saturated):
    """No route meets the request's SLO now, but its deadline has not passed: with flow control
    (``slo.admission: hold``) it waits, earliest deadline first, instead of being refused."""


class UpstreamFailed(Rejection):
    """Every engine tried for this request failed."""


@dataclass(frozen=True, slots=True)
class Kind:
    status: int
    error_type: str  # OpenAI's error.type
    code: str


# The one table. A subclass not listed answers as its nearest listed ancestor.
KINDS: dict[type[Rejection], Kind] = {
    Rejection: Kind(500, "server_error", "internal_error"),
    BadRequest: Kind(400, "invalid_request_error", "bad_request"),
    BodyTooLarge: Kind(413, "invalid_request_error", "too_large"),
    UnknownModel: Kind(404, "invalid_request_error", "model_not_found"),
    PrefillForbidden: Kind(403, "permission_error", "prefill_target_forbidden"),
    Shed: Kind(429, "rate_limit_error", "shed"),
    NoCapacity: Kind(503, "service_unavailable", "no_capacity"),
    Saturated: Kind(503, "service_unavailable", "saturated"),
    QueueFull: Kind(503, "service_unavailable", "queue_full"),
    QueueTimeout: Kind(503, "service_unavailable", "queue_timeout"),
    SloUnattainable: Kind(503, "service_unavailable", "slo_unattainable"),
    SloShed: Kind(429, "rate_limit_error", "slo_unattainable"),
    SloWait: Kind(503, "service_unavailable", "slo_unattainable"),
    UpstreamFailed: Kind(502, "server_error", "upstream_failed"),
}


@dataclass(frozen=True, slots=True)
class Answer:
    """A rejection as a response: status, headers (lower-case names) and JSON body."""

    status: int
    headers: dict[str, str]
    body: bytes


def answer(rejection: Rejection) -> Answer:
    kind = _kind(rejection)
    headers = {"content-type": "application/json", "x-pd-router-reject": kind.code}
    if rejection.retry_after_s is not None:
        headers["retry-after"] = str(max(1, round(rejection.retry_after_s)))
    error = {"message": rejection.message, "type": kind.error_type, "param": None, "code": kind.code}
    return Answer(kind.status, headers, orjson.dumps({"error": error}))


def _kind(rejection: Rejection) -> Kind:
    for cls in type(rejection).__mro__:
        kind = KINDS.get(cls)  # type: ignore[arg-type]
        if kind is not None:
            return kind
    raise AssertionError("unreachable: Rejection itself is in KINDS")
