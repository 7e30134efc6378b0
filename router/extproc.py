"""Envoy ext_proc endpoint picker: the Gateway API InferencePool protocol over ``Picker``.

One gRPC stream per HTTP request. ``ExtProcStream`` is the per-stream state machine, pure and
synchronous (``on_message`` returns the responses to send), so it is tested with hand-built
``ProcessingRequest`` sequences; ``ExtProcCall`` only pumps a call's messages through it and
releases the reservation in one place. The gRPC transport is ``router.h2grpc`` (why: its docstring).

What Envoy gets for a routed request (both, with the same single ``ip:port``):
``x-gateway-destination-endpoint`` in the header mutation and ``envoy.lb`` dynamic metadata, plus
``clear_route_cache``. A P/D decision adds ``x-prefiller-host-port`` (the decode pod's sidecar runs
the prefill leg). Client copies of every routing header we own are removed when we do not set
them. Client mistakes are ``ImmediateResponse``s with a JSON body, never gRPC errors.

Body modes, detected from the first message's ``protocol_config``:

* ``FULL_DUPLEX_STREAMED`` (the InferencePool protocol): the headers answer is deferred until the
  body is complete, then the body goes back as ``streamed_response`` chunks of ≤ 62,000 bytes.
* ``BUFFERED``: headers answered at once; routing rides on the body answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from router.config import PoolConfig
from router.h2grpc import INTERNAL, INVALID_ARGUMENT, NOT_FOUND, Call, CallHandler, H2GrpcServer
from router.picker import Picker, RouteDecision
from router.request import (
    BadRequest,
    BodyTooLarge,
    Rejection,
    RequestLimits,
    RouteRequest,
    parse_request,
)
from router.signals import RouterMetrics

log = logging.getLogger(__name__)

DESTINATION = "x-gateway-destination-endpoint"
PREFILLER = "x-prefiller-host-port"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
# Routing and control headers only the picker may set: a client's copy is always removed.
OWNED_HEADERS = (
    DESTINATION,
    PREFILLER,
    SERVED_KEY,
    "x-encoder-hosts-ports",
    "x-data-parallel-host-port",
    "x-kv-cache-source-host-port",
    "x-pd-router-decode",
    "x-pd-router-prefill",
)
MAX_CHUNK = 62_000  # per streamed_response message (the reference EPP's limit)

_Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = _Mode.FULL_DUPLEX_STREAMED
BUFFERED = _Mode.BUFFERED


@dataclass(frozen=True, slots=True)
class ExtProcSettings:
    model: str
    limits: RequestLimits
    response_processing: bool
    # Without response processing the stream closes once routed; the reservation then lapses
    # after the predicted duration of the request (capped), since no end-of-response will come.
    max_unobserved_s: float = 600.0


class ExtProcStream:
    """Protocol state of one ext_proc stream. ``on_message`` never awaits."""

    def __init__(
        self,
        settings: ExtProcSettings,
        picker: Picker,
        metrics: RouterMetrics,
        later: Callable[[float, Callable[[], None]], object] | None = None,
    ) -> None:
        self.settings = settings
        self.picker = picker
        self.metrics = metrics
        self.later = later
        self.mode: int | None = None
        self.response_mode: int = _Mode.NONE
        self.parsed: RouteRequest | Rejection | None = None  # set early when tokenizing off the loop
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        self.body = bytearray()
        self.decision: RouteDecision | None = None
        self.started = time.perf_counter()
        self.status: int | None = None
        self.engine_response = False
        self.outcome = "open"
        self.finished = False  # True once we want the stream closed (answered everything we will)

    # -- the state machine ----------------------------------------------------------------------
    def on_message(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = message.WhichOneof("request")
        if self.mode is None:
            self.mode = _body_mode(message)
            self.response_mode = message.protocol_config.response_body_mode
        if kind == "request_headers":
            return self._on_request_headers(message)
        if kind == "request_body":
            return self._on_request_body(message.request_body)
        if kind == "request_trailers":
            return self._route(trailers=True)
        if kind == "response_headers":
            return self._on_response_headers(message)
        if kind == "response_body":
            return self._on_response_body(message.response_body)
        if kind == "response_trailers":
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        log.warning("ext_proc: ignoring unexpected message %r", kind)
        return []

    def prompt_if_complete(self, message: pb.ProcessingRequest) -> str | None:
        """The prompt text if ``message`` completes a parseable request body (else None).

        Lets the servicer tokenize off the loop before the synchronous ``on_message`` routes;
        anything wrong with the body is left for ``on_message`` to reject.
        """
        kind = message.WhichOneof("request")
        if self.decision is not None or self.finished:
            return None
        if kind == "request_body" and message.request_body.end_of_stream:
            raw = bytes(self.body) + message.request_body.body
        elif kind == "request_trailers":
            raw = bytes(self.body)
        else:
            return None
        self.parsed = self._parse(raw)
        return self.parsed.prompt if isinstance(self.parsed, RouteRequest) else None

    def _parse(self, raw: bytes) -> RouteRequest | Rejection:
        try:
            return parse_request(raw, self.settings.limits, self.headers)
        except Rejection as rejection:
            return rejection

    def _on_request_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.headers = {
            h.key.lower(): h.raw_value.decode("utf-8", "replace") or h.value
            for h in message.request_headers.headers.headers
        }
        try:
            self.subset = _subset_hint(message.metadata_context)
        except BadRequest as rejection:
            return self._reject(rejection)
        if message.request_headers.end_of_stream:
            return self._route_headers_only()
        if self.mode == BUFFERED:
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
        return []  # FULL_DUPLEX: answer once the body is known

    def _on_request_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.decision is not None or self.finished:
            return []
        self.body += body.body
        if len(self.body) > self.settings.limits.max_body_bytes:
            limit = self.settings.limits.max_body_bytes
            return self._reject(BodyTooLarge(f"request body is over the limit of {limit} bytes"))
        if body.end_of_stream:
            return self._route(trailers=False)
        return []

    def _route(self, *, trailers: bool) -> list[pb.ProcessingResponse]:
        if self.decision is not None or self.finished:
            return []
        try:
            parsed = self.parsed if self.parsed is not None else self._parse(bytes(self.body))
            if isinstance(parsed, Rejection):
                raise parsed
            route = parsed
            route.subset = self.subset
            self.decision = self.picker.pick(route)
        except Rejection as rejection:
            return self._reject(rejection)
        self.metrics.observe_pick(self.decision, time.perf_counter() - self.started)
        mutation = _routing_mutation(self.decision)
        metadata = _destination_metadata(self.decision)
        if self.mode == BUFFERED:
            common = pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
            out = [
                pb.ProcessingResponse(
                    request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata
                )
            ]
        else:
            headers = pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
            out = [
                pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(response=headers), dynamic_metadata=metadata
                )
            ]
            out.extend(_streamed_body(bytes(self.body), end_of_stream=not trailers))
            if trailers:
                out.append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
        self.body = bytearray()
        self._after_routing(route)
        return out

    def _route_headers_only(self) -> list[pb.ProcessingResponse]:
        """A request without a body (GET): route to a pod at once, no prompt to score."""
        route = RouteRequest(
            model=self.settings.model,
            prompt_tokens=1,
            max_tokens=1,
            block_keys=_NO_BLOCKS,
            body={},
            request_id=self.headers.get("x-request-id") or "",
            subset=self.subset,
        )
        try:
            self.decision = self.picker.pick(route)
        except Rejection as rejection:
            return self._reject(rejection)
        self.metrics.observe_pick(self.decision, time.perf_counter() - self.started)
        common = pb.CommonResponse(header_mutation=_routing_mutation(self.decision), clear_route_cache=True)
        out = [
            pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(response=common),
                dynamic_metadata=_destination_metadata(self.decision),
            )
        ]
        self._after_routing(route)
        return out

    def _after_routing(self, route: RouteRequest) -> None:
        # Closing the stream early while Envoy streams the response to us in FULL_DUPLEX mode
        # loses response bodies (seen with Envoy 1.40 under load): then we follow the response.
        if self.settings.response_processing or self.response_mode == FULL_DUPLEX:
            return
        # Nothing more will tell us when this request ends: close now, let the charge lapse after
        # the predicted duration so the pool's view of load stays roughly right.
        self.finished = True
        self.outcome = "routed"
        assert self.decision is not None
        reservation = self.decision.reservation
        b = self.decision.breakdown
        expected = b.get("ttft_s", 0.0) + route.max_tokens * b.get("tpot_s", 0.0)
        if self.later is None:
            reservation.release()
        else:
            reservation.finish_prefill()
            self.later(min(expected, self.settings.max_unobserved_s), reservation.release)
            self.decision = None  # the timer owns the release now

    def _on_response_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.status = _status(message.response_headers.headers)
        served = _served_endpoint(message)
        # Envoy's own replies (413, 503 no healthy upstream, ...) also come down the response path.
        # They are told apart when Envoy reports who answered (served-endpoint metadata or the
        # upstream.address attribute, as in examples/envoy/); without either, a routed request's
        # response is taken to be the engine's.
        self.engine_response = self.decision is not None and served in (None, self.decision.decode.address)
        if self.decision is not None and not self.engine_response:
            self.outcome = f"envoy_{self.status}"
        return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]

    def _on_response_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.decision is not None:
            self.decision.reservation.finish_prefill()  # the first byte: prefill is over
        if self.mode != FULL_DUPLEX:
            return [pb.ProcessingResponse(response_body=pb.BodyResponse())]
        if body.end_of_stream and self.decision is not None:
            self.outcome = "ok" if self.engine_response and (self.status or 0) < 400 else self.outcome
            self.decision.reservation.release()
        mutation = pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(body=body.body, end_of_stream=body.end_of_stream)
        )
        return [
            pb.ProcessingResponse(
                response_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
            )
        ]

    def _reject(self, rejection: Rejection) -> list[pb.ProcessingResponse]:
        self.finished = True
        self.outcome = rejection.code
        headers = [
            _header("content-type", "application/json"),
            *(_header(k.lower(), v) for k, v in rejection.headers().items()),
        ]
        immediate = pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=rejection.status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=rejection.body(),
            details=f"pd_router_{rejection.code}",
        )
        return [pb.ProcessingResponse(immediate_response=immediate)]

    def close(self) -> None:
        """The stream ended (clean close, cancel, reset): give back whatever is still charged."""
        if self.decision is not None:
            self.decision.reservation.release()
        if self.outcome == "open":
            self.outcome = "ok" if self.engine_response else ("cancelled" if self.decision else "no_route")
        self.metrics.observe_request(self.outcome, time.perf_counter() - self.started)


class ExtProcCall:
    """One ``Process`` call on the gRPC server: pumps its messages through an ``ExtProcStream``.

    Messages are handled as they arrive, synchronously. When the body is complete and the app has
    I/O to do before the pick (tokenizing, the shared-index lookup), the call pauses in a task and
    queues what arrives meanwhile. The reservation is released in ``_close``, reached once.
    """

    def __init__(
        self,
        call: Call,
        stream: ExtProcStream,
        prepare: Callable[[RouteRequest], Awaitable[None]] | None,
    ) -> None:
        self.call = call
        self.stream = stream
        self.prepare = prepare
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
        if not prepared and self.prepare is not None and stream.prompt_if_complete(message) is not None:
            self.paused = deque()
            self.task = asyncio.get_running_loop().create_task(self._prepare_then(message))
            return
        for response in stream.on_message(message):
            self.call.send(response.SerializeToString())
        if stream.finished:
            self.call.finish()  # a clean close: Envoy goes on without us
            self._close()

    async def _prepare_then(self, message: pb.ProcessingRequest) -> None:
        assert self.prepare is not None and isinstance(self.stream.parsed, RouteRequest)
        try:
            await self.prepare(self.stream.parsed)
        except Exception:  # the pick still works without precise keys or the shared lookup
            log.exception("ext_proc: preparing request %s failed", self.stream.parsed.request_id)
        held, self.paused = self.paused or deque(), None
        try:
            if not self.closed:
                self._handle(message, prepared=True)
            while held and not self.closed:
                self._handle(held.popleft())
        except Exception:  # on the transport's own path its dispatcher does this; here we must
            log.exception("ext_proc: routing request %s failed", self.stream.parsed.request_id)
            self.call.finish(INTERNAL, "internal error")
            self._close()
            return
        if self.ended and not self.closed:  # the half-close arrived while we were preparing
            self.call.finish()
            self._close()

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            self.stream.close()


def settings_from(config: PoolConfig) -> ExtProcSettings:
    return ExtProcSettings(
        model=config.model,
        limits=config.request_limits(),
        response_processing=config.extproc.response_processing,
    )


# -- helpers ----------------------------------------------------------------------------------------
_NO_BLOCKS = np.empty(0, dtype=np.uint64)


def _body_mode(message: pb.ProcessingRequest) -> int:
    if message.HasField("protocol_config"):
        return message.protocol_config.request_body_mode
    return FULL_DUPLEX  # what the InferencePool protocol requires


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _routing_mutation(decision: RouteDecision) -> pb.HeaderMutation:
    routing = {DESTINATION: decision.decode.address}
    if decision.prefill is not None:
        routing[PREFILLER] = decision.prefill.address
    return pb.HeaderMutation(
        set_headers=[_header(k, v) for k, v in routing.items()],
        remove_headers=[name for name in OWNED_HEADERS if name not in routing],
    )


def _destination_metadata(decision: RouteDecision) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: decision.decode.address}})
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
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        entries = [v.string_value for v in value.list_value.values]
    elif kind == "string_value":
        entries = value.string_value.split(",")
    else:
        raise BadRequest(f"metadata {SUBSET_NAMESPACE}.{SUBSET_KEY} must be a list of ip:port strings")
    return frozenset(e.strip() for e in entries if e.strip())


def _served_endpoint(message: pb.ProcessingRequest) -> str | None:
    """Which ``ip:port`` answered: the served-endpoint metadata, else Envoy's upstream.address."""
    namespace = message.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if namespace is not None and SERVED_KEY in namespace.fields:
        return namespace.fields[SERVED_KEY].string_value
    attributes = message.attributes.get("envoy.filters.http.ext_proc")
    if attributes is not None and "upstream.address" in attributes.fields:
        return attributes.fields["upstream.address"].string_value
    return None


def _status(headers: Any) -> int | None:
    for header in headers.headers:
        if header.key == ":status":
            value = header.raw_value.decode() or header.value
            return int(value) if value.isdigit() else None
    return None


class HealthState:
    """gRPC health (``grpc.health.v1``) for the names gateways and probes ask about.

    ``Check`` answers from the table; ``Watch`` streams the current status, then every change.
    """

    READY_NAMES = ("", "readiness", "inference-extension", "envoy.service.ext_proc.v3.ExternalProcessor")

    def __init__(self) -> None:
        self.statuses: dict[str, int] = {}
        self.watchers: dict[str, set[Call]] = {}

    def set_ready(self, ready: bool) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        self._set("liveness", serving)
        for name in self.READY_NAMES:
            self._set(name, serving if ready else health_pb2.HealthCheckResponse.NOT_SERVING)

    def _set(self, name: str, status: int) -> None:
        if self.statuses.get(name) == status:
            return
        self.statuses[name] = status
        for call in self.watchers.get(name, ()):
            call.send(_health_response(status))

    def check(self, call: Call) -> CallHandler:
        return _HealthCall(self, call, watch=False)

    def watch(self, call: Call) -> CallHandler:
        return _HealthCall(self, call, watch=True)


def _health_response(status: int) -> bytes:
    return health_pb2.HealthCheckResponse(status=status).SerializeToString()  # type: ignore[arg-type]


class _HealthCall:
    def __init__(self, state: HealthState, call: Call, *, watch: bool) -> None:
        self.state = state
        self.call = call
        self.watch = watch
        self.service: str | None = None

    def on_message(self, data: bytes) -> None:
        try:
            self.service = health_pb2.HealthCheckRequest.FromString(data).service
        except DecodeError:
            self.call.finish(INVALID_ARGUMENT, "malformed HealthCheckRequest")
            return
        if self.watch:
            unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            self.call.send(_health_response(self.state.statuses.get(self.service, unknown)))
            self.state.watchers.setdefault(self.service, set()).add(self.call)

    def on_end(self) -> None:
        if self.watch:
            return  # a watch lasts until the client cancels it
        status = self.state.statuses.get(self.service) if self.service is not None else None
        if status is None:
            self.call.finish(NOT_FOUND, "unknown service")
        else:
            self.call.send(_health_response(status))
            self.call.finish()

    def on_cancel(self) -> None:
        if self.service is not None:
            self.state.watchers.get(self.service, set()).discard(self.call)


PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"
HEALTH_WATCH_METHOD = "/grpc.health.v1.Health/Watch"


async def start_grpc(
    config: PoolConfig,
    picker: Picker,
    metrics: RouterMetrics,
    health_state: HealthState,
    prepare: Callable[[RouteRequest], Awaitable[None]] | None = None,
) -> tuple[H2GrpcServer, H2GrpcServer, int, int]:
    """Start the ext_proc server and the health server; returns them and their bound ports."""
    cfg = config.extproc
    settings = settings_from(config)
    loop = asyncio.get_running_loop()

    def process(call: Call) -> CallHandler:
        return ExtProcCall(call, ExtProcStream(settings, picker, metrics, loop.call_later), prepare)

    health = {HEALTH_CHECK_METHOD: health_state.check, HEALTH_WATCH_METHOD: health_state.watch}
    # A whole buffered body arrives as one message: the cap sits above the body limit, so an
    # oversized body is our 413, not a gRPC error.
    max_message = max(4 * 1024 * 1024, settings.limits.max_body_bytes + 64 * 1024)
    # Health on the ext_proc port too: Envoy health-checks the cluster endpoint it connects to.
    server = H2GrpcServer(
        {PROCESS_METHOD: process, **health},
        max_concurrent_streams=cfg.max_concurrent_streams,
        max_message_bytes=max_message,
    )
    health_server = H2GrpcServer(health)
    health_state.set_ready(False)
    port = await server.start(cfg.host, cfg.port)
    health_port = await health_server.start(cfg.host, cfg.health_port)
    return server, health_server, port, health_port
