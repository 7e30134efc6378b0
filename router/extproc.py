"""Envoy ext_proc endpoint picker: the Gateway API InferencePool protocol over ``Picker``.

One gRPC stream per HTTP request. ``ExtProcStream`` is the per-stream state machine, pure and
synchronous (``on_message`` returns the responses to send), so it is tested with hand-built
``ProcessingRequest`` sequences; ``ExternalProcessor.Process`` only pumps messages through it and
releases the reservation in one ``finally``.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.config import PoolConfig
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


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """The gRPC servicer: pumps a stream's messages through an ``ExtProcStream``."""

    def __init__(
        self,
        settings: ExtProcSettings,
        picker: Picker,
        metrics: RouterMetrics,
        prepare: Callable[[RouteRequest], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self.picker = picker
        self.metrics = metrics
        self.prepare = prepare

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> None:
        # context.read()/write() rather than iterating and yielding: no async-generator round trip
        # per message, which is most of grpc.aio's per-stream cost here.
        loop = asyncio.get_running_loop()
        stream = ExtProcStream(self.settings, self.picker, self.metrics, loop.call_later)
        try:
            while (message := await context.read()) is not grpc.aio.EOF:
                if self.prepare is not None and stream.prompt_if_complete(message) is not None:  # type: ignore[arg-type]
                    # Tokenizing and shared-index lookups happen here; the pick stays synchronous.
                    assert isinstance(stream.parsed, RouteRequest)
                    await self.prepare(stream.parsed)
                for response in stream.on_message(message):  # type: ignore[arg-type]
                    await context.write(response)
                if stream.finished:
                    return  # a clean close: Envoy goes on without us
        finally:
            stream.close()


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
    """gRPC health (``grpc.health.v1``) for the names gateways and probes ask about."""

    READY_NAMES = ("", "readiness", "inference-extension", "envoy.service.ext_proc.v3.ExternalProcessor")

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()

    async def set_ready(self, ready: bool) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        status = serving if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.servicer.set("liveness", serving)
        for name in self.READY_NAMES:
            await self.servicer.set(name, status)


async def start_grpc(
    config: PoolConfig,
    picker: Picker,
    metrics: RouterMetrics,
    health_state: HealthState,
    prepare: Callable[[RouteRequest], Awaitable[None]] | None = None,
) -> tuple[grpc.aio.Server, grpc.aio.Server, int, int]:
    """Start the ext_proc server and the health server; returns them and their bound ports."""
    cfg = config.extproc
    server = grpc.aio.server(maximum_concurrent_rpcs=cfg.max_concurrent_streams)
    pb_grpc.add_ExternalProcessorServicer_to_server(
        ExternalProcessor(settings_from(config), picker, metrics, prepare), server
    )
    # Health on the ext_proc port too: Envoy health-checks the cluster endpoint it connects to.
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    health_server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, health_server)
    health_port = health_server.add_insecure_port(f"{cfg.host}:{cfg.health_port}")
    await health_state.set_ready(False)
    await server.start()
    await health_server.start()
    return server, health_server, port, health_port
