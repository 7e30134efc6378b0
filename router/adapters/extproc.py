"""Envoy ext_proc endpoint picker: the Gateway API InferencePool protocol over ``RequestFlow``.

One gRPC stream per HTTP request. ``ExtProcStream`` is the per-stream state machine, pure and
synchronous (``on_message`` returns the responses to send), so it is tested with hand-built
``ProcessingRequest`` sequences; ``ExtProcCall`` pumps a call's messages through it, pauses while
the flow prepares (tokenizing, a shared-index lookup) and closes the flight in one place. The
gRPC transport is ``router.transport.h2``.

What Envoy gets for a routed request (both, with the same single ``ip:port``):
``x-gateway-destination-endpoint`` in the header mutation and ``envoy.lb`` dynamic metadata, plus
``clear_route_cache``. A P/D decision adds ``x-prefiller-host-port`` (the decode pod's sidecar runs
the prefill leg), so pairs end only on decode pods a sidecar fronts (``extproc.pd_pairs``). Client
copies of every routing header we own are removed when we do not set them. Client mistakes are
``ImmediateResponse``s with a JSON body, never gRPC errors.

Body modes, detected from the first message's ``protocol_config``:

* ``FULL_DUPLEX_STREAMED`` (the InferencePool protocol): the headers answer is deferred until the
  body is complete, then the body goes back as ``streamed_response`` chunks of ≤ 62,000 bytes.
* ``BUFFERED`` (and ``BUFFERED_PARTIAL``): headers answered at once; Envoy sends the buffered body
  as one message (``end_of_stream`` is false when trailers follow) and routing rides on its answer.
* ``NONE`` and ``STREAMED``: Envoy picks the upstream before the picker could see the body, so the
  request is routed on its headers (one pod, load only, no prefix locality), every body chunk
  passes through unanswered-for, and a warning says which mode to use instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError

from router.adapters.health import HealthState
from router.flow.flight import ROUTED, Flight, RequestFlow
from router.http.headers import (
    DESTINATION,
    DESTINATION_SERVED,
    DESTINATION_SUBSET,
    PREFILLER,
    ROUTER_HEADERS,
    SERVER_TIMING,
    read_prefill_timing,
)
from router.request.meter import Usage
from router.request.parse import headers_only_request, stored_response_of
from router.request.rejections import BadRequest, BodyTooLarge, Rejection
from router.request.types import RouteRequest
from router.scheduling.extension import Producer
from router.scheduling.picker import RouteDecision
from router.server.config import ExtProcConfig
from router.transport.h2.connection import Call, CallHandler
from router.transport.h2.frames import INTERNAL, INVALID_ARGUMENT
from router.transport.h2.limits import H2Limits
from router.transport.h2.server import H2GrpcServer
from router.transport.tls import ServerTls, started

log = logging.getLogger(__name__)

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
LB_NAMESPACE = "envoy.lb"
MAX_CHUNK = 62_000  # per streamed_response message (the reference EPP's limit)
PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
# The Gateway API Inference Extension conformance suite (extproc.conformance): its test header
# names the endpoints a request may go to, and it expects the served one back in a response header.
CONFORMANCE_SELECTION = "test-epp-endpoint-selection"
SERVED_ECHO = "x-conformance-test-served-endpoint"
ECHO_SET_HEADER = "x-echo-set-header"

_Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = _Mode.FULL_DUPLEX_STREAMED
BUFFERED = _Mode.BUFFERED
_WHOLE_BODY_MODES = (_Mode.BUFFERED, _Mode.BUFFERED_PARTIAL)
_HEADER_ROUTED_MODES = (_Mode.NONE, _Mode.STREAMED)


@dataclass(frozen=True, slots=True)
class ExtProcSettings:
    response_processing: bool
    conformance: bool = False  # the Inference Extension conformance suite's hooks (test-only)
    # Which decode pods a pair may end on (``ExtProcConfig.pd_pairs``): Envoy sends the request to
    # the decode pod alone, so only a sidecar there runs the prefill leg.
    pd_pairs: Literal["auto", "always", "never"] = "auto"
    # Without response processing the stream closes once routed; the reservation then lapses
    # after the predicted duration of the request (capped), since no end-of-response will come.
    max_unobserved_s: float = 600.0


class ExtProcStream:
    """Protocol state of one ext_proc stream. ``on_message`` never awaits."""

    def __init__(
        self,
        flow: RequestFlow,
        settings: ExtProcSettings,
        later: Callable[[float, Callable[[], None]], object] | None = None,
        warned_modes: set[int] | None = None,
    ) -> None:
        """``warned_modes``: the listener's body modes already warned about, shared by its streams."""
        self.flow = flow
        self.settings = settings
        self.later = later
        self.warned_modes = set() if warned_modes is None else warned_modes
        self.flight: Flight | None = None
        self.mode: int | None = None
        self.response_mode: int = _Mode.NONE
        self.subset: frozenset[str] | None = None
        self.body = bytearray()
        self.body_done = False  # the request body is complete (end_of_stream, trailers, or buffered)
        self.trailers = False
        self.engine_response = False
        self.routed_on_headers = False  # NONE/STREAMED body modes: the body never decides anything
        self.finished = False  # True once we want the stream closed (answered everything we will)

    @property
    def decision(self) -> RouteDecision | None:
        return None if self.flight is None else self.flight.decision

    # -- the state machine ----------------------------------------------------------------------
    def on_message(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = message.WhichOneof("request")
        if self.mode is None:
            self.mode = _body_mode(message)
            # Without protocol_config (older Envoy) both directions are the InferencePool's mode.
            has_config = message.HasField("protocol_config")
            self.response_mode = message.protocol_config.response_body_mode if has_config else FULL_DUPLEX
        if self.flight is None and kind != "request_headers":
            # Out of order, but a body still parses on its own.
            self.flight = self.flow.start({}, via="ext_proc")
        if kind == "request_headers":
            return self._on_request_headers(message)
        if kind == "request_body":
            return self._on_request_body(message.request_body)
        if kind == "request_trailers":
            return self._on_request_trailers()
        if kind == "response_headers":
            return self._on_response_headers(message)
        if kind == "response_body":
            return self._on_response_body(message.response_body)
        if kind == "response_trailers":
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        log.warning("ext_proc: ignoring unexpected message %r", kind)
        return []

    def parse_if_complete(self, message: pb.ProcessingRequest) -> bool:
        """Parse the request if ``message`` completes its body: True when it then needs preparing.

        Lets ``ExtProcCall`` run the flow's producers before the synchronous ``on_message`` picks;
        a body that does not parse is left for ``on_message`` to reject.
        """
        if self.flight is None or self.flight.request is not None or self.finished or self.flight.closed:
            return False
        kind = message.WhichOneof("request")
        if kind == "request_body" and (message.request_body.end_of_stream or self.mode in _WHOLE_BODY_MODES):
            raw = bytes(self.body) + message.request_body.body
        elif kind == "request_trailers":
            raw = bytes(self.body)
        else:
            return False
        try:
            self._parse(raw)
        except Rejection:
            return False
        return True

    def _parse(self, raw: bytes) -> None:
        assert self.flight is not None
        request = self.flight.parse(raw, self.subset)
        pairs = self.settings.pd_pairs
        if pairs == "auto":
            request.pairs_need_sidecar = True
        elif pairs == "never":
            request.prefill_leg = False

    def _on_request_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if self.flight is not None:
            # Envoy sends the request headers once, first. A second start would orphan the flight
            # (and any reservation it holds), so a stream out of this order is refused instead.
            if self.finished:
                return []
            return self.reject(BadRequest("ext_proc: request_headers after the request had started"))
        headers = header_map(message.request_headers)
        self.flight = self.flow.start(headers, via="ext_proc")
        try:
            self.subset = _subset_hint(message.metadata_context)
        except BadRequest as rejection:
            return self.reject(rejection)
        if self.settings.conformance and (steer := headers.get(CONFORMANCE_SELECTION)) is not None:
            # ip or ip:port tokens; those outside this pool are skipped, none inside: 503.
            self.subset = frozenset(token.strip() for token in steer.split(",") if token.strip())
        if message.request_headers.end_of_stream:
            self.flight.headers_only(self.subset)
            return self._route()
        if self.mode in _HEADER_ROUTED_MODES:
            _warn_header_routing(self.mode, self.warned_modes)
            self.routed_on_headers = True
            self.flight.headers_only(self.subset)
            return self._route()
        if self.mode in _WHOLE_BODY_MODES:
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
        return []  # FULL_DUPLEX: answer once the body is known

    def _on_request_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.routed_on_headers:  # STREAMED: each chunk is answered, unchanged
            return [] if self.finished else [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        if self.body_done or self.finished:
            return []
        self.body += body.body
        if len(self.body) > self.flow.limits.max_body_bytes:
            limit = self.flow.limits.max_body_bytes
            return self.reject(BodyTooLarge(f"request body is over the limit of {limit} bytes"))
        # A buffered body is whole in one message, even when trailers follow (end_of_stream false).
        if body.end_of_stream or self.mode in _WHOLE_BODY_MODES:
            return self._on_body_complete()
        return []

    def _on_request_trailers(self) -> list[pb.ProcessingResponse]:
        self.trailers = True
        if self.finished:
            return []
        if (
            self.body_done or self.routed_on_headers
        ):  # routed on the buffered body already: just let the trailers through
            return [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        return self._on_body_complete()

    def _on_body_complete(self) -> list[pb.ProcessingResponse]:
        self.body_done = True
        assert self.flight is not None
        if self.flight.request is None:
            try:
                self._parse(bytes(self.body))
            except Rejection as rejection:
                return self.reject(rejection)
        return self._route()

    def _route(self) -> list[pb.ProcessingResponse]:
        assert self.flight is not None and self.flight.request is not None
        if self.flight.closed:  # its response already ended: a pick now would never be released
            return self.reject(BadRequest("ext_proc: the request ended after its response"))
        try:
            decision = self.flight.pick()
        except Rejection as rejection:
            return self.reject(rejection)
        # A model rewrite changed the body that goes upstream (and so its length).
        rewritten = orjson.dumps(self.flight.request.body) if self.flight.request.requested_model else None
        span, tracer = self.flight.span, self.flow.tracer
        mutation = _routing_mutation(
            decision,
            content_length=None if rewritten is None else len(rewritten),
            conformance=self.settings.conformance,
            # The engine (or the decode pod's sidecar) continues this request's trace; with
            # Envoy's own tracing on, Envoy sets its upstream span's context over it.
            trace=None if span is None or tracer is None else tracer.context_headers(span),
        )
        common = pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        metadata = _destination_metadata(decision)
        if not self.body_done:  # a request without a body: route on its headers
            out = [
                pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
                )
            ]
        elif self.mode in _WHOLE_BODY_MODES:
            if rewritten is not None:
                common.body_mutation.body = rewritten
            out = [
                pb.ProcessingResponse(
                    request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata
                )
            ]
            if self.trailers:
                out.append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
        else:
            out = [
                pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
                )
            ]
            body = bytes(self.body) if rewritten is None else rewritten
            out.extend(_streamed_body(body, end_of_stream=not self.trailers))
            if self.trailers:
                out.append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
        self.body = bytearray()
        self._after_routing()
        return out

    def _after_routing(self) -> None:
        # Closing the stream early while Envoy streams the response to us in FULL_DUPLEX mode
        # loses response bodies (seen with Envoy 1.40 under load): then we follow the response.
        if self.settings.response_processing or self.response_mode == FULL_DUPLEX:
            return
        # Nothing more will tell us when this request ends: close now, let the charge lapse after
        # the predicted duration so the pool's view of load stays roughly right.
        assert self.flight is not None and self.flight.request is not None
        self.finished = True
        self.flight.outcome = ROUTED
        decision = self.flight.hand_over()
        assert decision is not None
        prediction = decision.prediction
        expected = prediction.ttft_s + self.flight.request.max_tokens * prediction.tpot_s
        reservation = decision.reservation
        if self.later is None:
            reservation.release()
        else:
            reservation.finish_prefill()
            self.later(min(expected, self.settings.max_unobserved_s), reservation.release)

    def _on_response_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        status = _status(message.response_headers.headers) or 0
        decision = self.decision
        # Envoy's own replies (413, 503 no healthy upstream, a connect failure, ...) also come down
        # the response path. They are told apart when Envoy reports who answered (served-endpoint
        # metadata or the upstream.address attribute, as in examples/envoy/); without either, the
        # status alone decides the outcome (an Envoy 503 is then counted as http_5xx, never ok).
        served = _served_endpoint(message)
        self.engine_response = decision is not None and served in (None, decision.decode.address)
        if self.flight is not None:
            self.flight.responded(status, gateway_reply=decision is not None and not self.engine_response)
            if self.engine_response and decision is not None and decision.prefill is not None:
                self._prefill_timed(message.response_headers.headers)
        if self.settings.conformance and decision is not None:
            echo = pb.HeaderMutation(set_headers=[_header(SERVED_ECHO, served or decision.decode.address)])
            return [
                pb.ProcessingResponse(
                    response_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=echo))
                )
            ]
        return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]

    def _prefill_timed(self, headers: Any) -> None:
        """The decode pod's sidecar ran the pair's prefill leg and timed it (``Server-Timing``, with
        the prefill engine's token counts): the prompt is computed, and its time teaches the
        prefill model as the proxy's own legs do."""
        assert self.flight is not None
        value = _header_value(headers, SERVER_TIMING)
        timing = None if value is None else read_prefill_timing(value)
        if timing is not None:
            # The prefill engine's counts, as its answer's usage says them: the fit learns from the
            # tokens it really computed, not from the index's guess.
            usage = Usage(prompt_tokens=timing.prompt_tokens, cached_tokens=timing.cached_tokens)
            self.flight.prefill_answered(usage, seconds=timing.seconds)

    def _on_response_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.flight is not None:
            self.flight.prefill_done()  # the first byte: prefill is over
            self.flight.first_byte()
            if self.engine_response:
                self.flight.body(body.body)
        if self.response_mode != FULL_DUPLEX:  # the response's own mode, not the request's
            return [pb.ProcessingResponse(response_body=pb.BodyResponse())]
        if body.end_of_stream and self.flight is not None:
            self.flight.close()
        mutation = pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(body=body.body, end_of_stream=body.end_of_stream)
        )
        return [
            pb.ProcessingResponse(
                response_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
            )
        ]

    def reject(self, rejection: Rejection) -> list[pb.ProcessingResponse]:
        self.finished = True
        assert self.flight is not None
        answer = self.flight.reject(rejection)
        immediate = pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=answer.status),
            headers=pb.HeaderMutation(set_headers=[_header(k, v) for k, v in answer.headers.items()]),
            body=answer.body,
            details=f"pd_router_{rejection.code}",
        )
        return [pb.ProcessingResponse(immediate_response=immediate)]

    def close(self) -> None:
        """The stream ended (clean close, cancel, reset): give back whatever is still charged."""
        if self.flight is not None:
            self.flight.close()


class ExtProcCall:
    """One ``Process`` call on the gRPC server: pumps its messages through an ``ExtProcStream``.

    Messages are handled as they arrive, synchronously. When the body is complete and the flow has
    I/O to do before the pick, the call pauses in a task and queues what arrives meanwhile. The
    flight is closed in ``_close``, reached once.
    """

    def __init__(self, call: Call, stream: ExtProcStream) -> None:
        self.call = call
        self.stream = stream
        self.paused: deque[pb.ProcessingRequest] | None = None  # messages held while preparing
        self.task: asyncio.Task[None] | None = None
        self.ended = False
        self.closed = False

    def on_message(self, data: bytes) -> None:
        try:
            message = pb.ProcessingRequest.FromString(data)
        except DecodeError:
            log.warning("ext_proc: malformed ProcessingRequest (%d bytes); failing the stream", len(data))
            self.call.finish(INVALID_ARGUMENT, "malformed ProcessingRequest")
            self._close()
            return
        if self.paused is not None:
            self.paused.append(message)
        else:
            self._handle(message)

    def on_end(self) -> None:
        self.ended = True
        if self.paused is None:
            self.call.finish()
            self._close()

    def on_cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self._close()

    def _handle(self, message: pb.ProcessingRequest, *, prepared: bool = False) -> None:
        stream = self.stream
        flow = stream.flow
        if (
            not prepared
            and flow.prepares
            and (stored := self._on_stored_response(message)) is not None
            and (wanted := flow.wanted(stored))
        ):
            # A body-less request on a stored answer (GET /v1/responses/{id}): the pod that gave it
            # may be in another replica's share of the homes, read before its headers are routed.
            self._pause(self._look_up_then(message, stored, wanted))
            return
        # Pause (a task per request) only for I/O a producer wants before the pick, or when flow
        # control holds the request.
        if not prepared and (flow.prepares or flow.control is not None) and stream.parse_if_complete(message):
            wanted = flow.wanted(self._parsed()) if flow.prepares else ()
            if wanted or not self._bind_now():
                self._pause(self._prepare_then(message, wanted))
                return
        for response in stream.on_message(message):
            self.call.send(response.SerializeToString())
        if stream.finished:
            self.call.finish()  # a clean close: Envoy goes on without us
            self._close()

    def _pause(self, work: Coroutine[Any, Any, None]) -> None:
        """Hold what arrives while ``work`` runs (it ends in ``_resume``, or closes the call)."""
        self.paused = deque()
        self.task = asyncio.get_running_loop().create_task(work)

    def _parsed(self) -> RouteRequest:
        assert self.stream.flight is not None and self.stream.flight.request is not None
        return self.stream.flight.request

    def _bind_now(self) -> bool:
        """True unless flow control holds the request (a rejection is left for ``on_message``)."""
        assert self.stream.flight is not None
        try:
            return self.stream.flow.bind_now(self.stream.flight)
        except Rejection:
            return True

    def _on_stored_response(self, message: pb.ProcessingRequest) -> RouteRequest | None:
        """The request of a body-less headers message on a stored Responses answer, else None."""
        if message.WhichOneof("request") != "request_headers" or not message.request_headers.end_of_stream:
            return None
        headers = header_map(message.request_headers)
        if stored_response_of(headers.get(":path")) is None:
            return None
        return headers_only_request(self.stream.flow.model, headers, None, headers.get(":path"))

    async def _look_up_then(
        self, message: pb.ProcessingRequest, request: RouteRequest, wanted: tuple[Producer, ...]
    ) -> None:
        await self.stream.flow.prepare(request, wanted)  # the shared response home lands in this replica's
        self._resume(message, request.request_id)

    async def _prepare_then(self, message: pb.ProcessingRequest, wanted: tuple[Producer, ...]) -> None:
        flight = self.stream.flight
        flow = self.stream.flow
        assert flight is not None and flight.request is not None
        if wanted:
            await flow.prepare(flight.request, wanted)
        if flow.control is not None and flight.decision is None:
            try:
                await flow.admit(flight)
            except Rejection as rejection:
                for response in self.stream.reject(rejection):
                    self.call.send(response.SerializeToString())
                self.call.finish()
                self.call.flush()
                self._close()
                return
        self._resume(message, flight.request.request_id)

    def _resume(self, message: pb.ProcessingRequest, request_id: str) -> None:
        """Handle the message that paused the call, then what arrived meanwhile; the answers
        leave at once, before the index record the pick queued (hundreds of µs for a long new
        prompt), not after it."""
        held, self.paused = self.paused or deque(), None
        try:
            if not self.closed:
                self._handle(message, prepared=True)
            while held and not self.closed:
                self._handle(held.popleft())
        except Exception:  # on the transport's own path its dispatcher does this; here we must
            log.exception("ext_proc: routing request %s failed", request_id)
            self.call.finish(INTERNAL, "internal error")
            self._close()
        else:
            if self.ended and not self.closed:  # the half-close arrived while we were preparing
                self.call.finish()
                self._close()
        finally:
            self.call.flush()

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            self.stream.close()


# -- helpers ----------------------------------------------------------------------------------------


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """Envoy's request headers, lower-case names (``raw_value`` as Envoy sends it, else ``value``)."""
    return {h.key.lower(): h.raw_value.decode("utf-8", "replace") or h.value for h in headers.headers.headers}


def _warn_header_routing(mode: int, warned: set[int]) -> None:
    # Once per mode and listener: a configuration choice, not a per-request event.
    if mode not in warned:
        warned.add(mode)
        log.warning(
            "ext_proc request_body_mode %s: Envoy picks the upstream before the body is seen, so "
            "requests are routed on their headers only (no prefix locality, no P/D pair); use "
            "FULL_DUPLEX_STREAMED (the InferencePool protocol) or BUFFERED",
            _Mode.BodySendMode.Name(mode),
        )


def _body_mode(message: pb.ProcessingRequest) -> int:
    if message.HasField("protocol_config"):
        return message.protocol_config.request_body_mode
    return FULL_DUPLEX  # what the InferencePool protocol requires


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _routing_mutation(
    decision: RouteDecision,
    *,
    content_length: int | None = None,
    conformance: bool = False,
    trace: dict[str, str] | None = None,
) -> pb.HeaderMutation:
    """The routing headers, the rest of ours removed; ``content_length`` when we changed the body;
    ``trace``: the request span's trace context headers."""
    routing = {DESTINATION: decision.decode.address}
    if decision.prefill is not None:
        routing[PREFILLER] = decision.prefill.address
    extra = {}
    if content_length is not None:
        extra["content-length"] = str(content_length)
    if conformance:  # the suite's echo servers copy this header into their answer
        extra[ECHO_SET_HEADER] = f"{SERVED_ECHO}:{decision.decode.address}"
    if trace:
        extra.update(trace)
    return pb.HeaderMutation(
        set_headers=[_header(k, v) for k, v in (routing | extra).items()],
        remove_headers=[name for name in ROUTER_HEADERS if name not in routing],
    )


def _destination_metadata(decision: RouteDecision) -> struct_pb2.Struct:
    # Set field by field: ``Struct.update`` converts the dict in Python, at over twice the cost.
    metadata = struct_pb2.Struct()
    metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = decision.decode.address
    return metadata


def _streamed_body(body: bytes, *, end_of_stream: bool) -> Iterable[pb.ProcessingResponse]:
    chunks = [body[i : i + MAX_CHUNK] for i in range(0, len(body), MAX_CHUNK)] or [b""]
    for i, chunk in enumerate(chunks):
        last = end_of_stream and i == len(chunks) - 1
        streamed = pb.StreamedBodyResponse(body=chunk, end_of_stream=last)
        common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
        yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))


def _subset_hint(metadata: Any) -> frozenset[str] | None:
    """The ``envoy.lb.subset_hint`` list (or comma string); ``None`` when absent."""
    namespace = metadata.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or DESTINATION_SUBSET not in namespace.fields:
        return None
    value = namespace.fields[DESTINATION_SUBSET]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        entries = [v.string_value for v in value.list_value.values]
    elif kind == "string_value":
        entries = value.string_value.split(",")
    else:
        raise BadRequest(
            f"metadata {SUBSET_NAMESPACE}.{DESTINATION_SUBSET} must be a list of ip:port strings"
        )
    return frozenset(e.strip() for e in entries if e.strip())


def _served_endpoint(message: pb.ProcessingRequest) -> str | None:
    """Which ``ip:port`` answered: the served-endpoint metadata, else Envoy's upstream.address."""
    namespace = message.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if namespace is not None and DESTINATION_SERVED in namespace.fields:
        return namespace.fields[DESTINATION_SERVED].string_value
    attributes = message.attributes.get("envoy.filters.http.ext_proc")
    if attributes is not None and "upstream.address" in attributes.fields:
        return attributes.fields["upstream.address"].string_value
    return None


def _status(headers: Any) -> int | None:
    """The ``:status`` header's three ASCII digits; ``None`` when absent or anything else."""
    value = _header_value(headers, ":status") or ""
    return int(value) if len(value) == 3 and value.isascii() and value.isdigit() else None


def _header_value(headers: Any, key: str) -> str | None:
    """The first value of the header ``key``; None without it. ``key`` lower-case: Envoy sends every
    name so (HTTP/2's rule, which it applies to HTTP/1 peers' headers too)."""
    for header in headers.headers:
        if header.key == key:
            value: str = header.raw_value.decode("latin-1") or header.value
            return value
    return None


class ExtProcListener:
    """The ext_proc server and its separate gRPC health server, listening while the context is open.

    Leaving it drains: the ext_proc server lets open streams finish up to ``grace_s``, then the
    health server stops.
    """

    def __init__(self, flow: RequestFlow, config: ExtProcConfig, health: HealthState) -> None:
        self.flow = flow
        self.config = config
        self.health = health
        self.settings = ExtProcSettings(
            response_processing=config.response_processing,
            conformance=config.conformance,
            pd_pairs=config.pd_pairs,
        )
        self.warned_modes: set[int] = set()  # a configuration choice: warned once per listener
        self.port: int | None = None
        self.health_port: int | None = None
        self._servers: list[tuple[H2GrpcServer, float | None]] = []
        self.tls: ServerTls | None = None

    @property
    def server(self) -> H2GrpcServer | None:
        """The ext_proc listener's server (None until started)."""
        return self._servers[0][0] if self._servers else None

    async def __aenter__(self) -> ExtProcListener:
        cfg, flow, health = self.config, self.flow, self.health
        loop = asyncio.get_running_loop()

        def process(call: Call) -> CallHandler:
            return ExtProcCall(call, ExtProcStream(flow, self.settings, loop.call_later, self.warned_modes))

        # A whole buffered body arrives as one message: the cap sits above the body limit, so an
        # oversized body is our 413, not a gRPC error.
        max_message = max(4 * 1024 * 1024, flow.limits.max_body_bytes + 64 * 1024)
        # Health on the ext_proc port too: Envoy health-checks the cluster endpoint it connects to.
        limits = H2Limits(
            max_concurrent_streams=cfg.max_concurrent_streams,
            max_message_bytes=max_message,
            max_connections=cfg.max_connections,
            idle_timeout_s=cfg.idle_timeout_s,
        )
        server = H2GrpcServer({PROCESS_METHOD: process, **health.methods()}, limits=limits)
        health_server = H2GrpcServer(health.methods())
        health.set_ready(False)  # alive (liveness SERVING), not ready until the App says so
        try:
            context = None
            if cfg.tls.enabled:
                tls = cfg.tls
                self.tls = await started(tls.cert_file, tls.key_file, tls.min_version, tls.reload_interval_s)
                context = self.tls.context
            self.port = await server.start(
                cfg.host,
                cfg.port,
                ssl=context,
                cleartext=context is None or cfg.tls.accept_cleartext,
                what="ext_proc listener",
            )
            self._servers.append((server, cfg.grace_s))
            self.health_port = await health_server.start(
                cfg.host, cfg.health_port, what="gRPC health listener"
            )
            self._servers.append((health_server, None))
        except BaseException:
            await self.__aexit__()
            raise
        log.info(
            "ext_proc listening on %s:%s (%s), gRPC health on %s",
            cfg.host,
            self.port,
            "h2c" if context is None else "TLS and h2c" if cfg.tls.accept_cleartext else "TLS only",
            self.health_port,
        )
        return self

    async def __aexit__(self, *_: object) -> None:
        # The ext_proc server drains open streams first, then health goes, then TLS's watcher.
        for server, grace in self._servers:
            await server.stop(grace)
        self._servers.clear()
        if self.tls is not None:
            await self.tls.__aexit__()
            self.tls = None
