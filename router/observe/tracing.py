"""OpenTelemetry spans per request (``tracing.enabled``, off by default; the ``tracing`` extra).

One ``pd_router.request`` span per request (SERVER), its parent the W3C ``traceparent`` the
request came with (a client's through the proxy, Envoy's through ext_proc), carrying the routing
decision: the candidates, the chosen prefill and decode pods, predicted against observed TTFT and
TPOT, each cost term's share of the chosen route's cost. Children: ``pd_router.queue``
while flow control holds the request, and the proxy's ``pd_router.prefill`` and ``pd_router.decode``
legs (CLIENT), each leg sending the engine a ``traceparent`` naming itself as the parent.

Off, ``RequestFlow.tracer`` is None and every hook is behind that one check: the off path neither
imports ``opentelemetry`` (this module imports it only in what runs with tracing on) nor
allocates. Spans are started and ended explicitly (never made current through contextvars): one
ext_proc request is many callbacks on one stream, not one task.

Attribute names follow the OpenTelemetry GenAI and HTTP semantic conventions where one fits
(``gen_ai.request.model``, ``gen_ai.usage.input_tokens``, ``server.address``,
``http.response.status_code``, ``error.type``); the router's own are under ``pd_router.``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from router.request.meter import usage_of
from router.request.parse import CHAT, COMPLETIONS, MESSAGES, RESPONSES
from router.request.rejections import Rejection
from router.server.config import ConfigError

if TYPE_CHECKING:  # never at run time: the off path must not import opentelemetry
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

    from router.request.meter import ResponseMeter, Usage
    from router.request.types import RouteRequest
    from router.scheduling.picker import RouteDecision
    from router.state.pool import Endpoint

log = logging.getLogger(__name__)

REQUEST_SPAN = "pd_router.request"
QUEUE_SPAN = "pd_router.queue"
PREFILL_SPAN = "pd_router.prefill"
DECODE_SPAN = "pd_router.decode"
_LEG_SPANS = {"prefill": PREFILL_SPAN, "decode": DECODE_SPAN}
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context

# gen_ai.operation.name per API the parser reads (the GenAI conventions' well-known values).
_OPERATIONS = {COMPLETIONS: "text_completion", CHAT: "chat", MESSAGES: "chat", RESPONSES: "chat"}
# Breakdown entries ending in "_s" that are not cost terms (``PairCosts.breakdown``).
_NOT_TERMS = frozenset({"ttft_s", "tpot_s", "transfer_s", "after_transfer_s"})


class RequestTracer:
    """Starts, annotates and ends one request's spans; made by ``build`` when tracing is on."""

    def __init__(
        self,
        provider: TracerProvider,
        *,
        ttft_slo_s: float,
        link_weight: float = 1.0,
        candidates: Callable[[], int] = lambda: -1,
        owns_provider: bool = True,
    ) -> None:
        """``ttft_slo_s`` and ``link_weight``: what a decision's ``cost`` is measured in (the
        configured TTFT SLO; a transfer's weight), to turn each term's seconds into its share;
        ``candidates``: how many endpoints may take traffic now; ``owns_provider``: ``shutdown``
        flushes and stops the provider (False: the caller's, e.g. a test's)."""
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("pd_router")
        self.propagator = TraceContextTextMapPropagator()
        self.ttft_slo_s = ttft_slo_s
        self.link_weight = link_weight
        self.candidates = candidates
        self.owns_provider = owns_provider
        self._in = trace.set_span_in_context
        self._server, self._client, self._internal = (
            trace.SpanKind.SERVER,
            trace.SpanKind.CLIENT,
            trace.SpanKind.INTERNAL,
        )
        self._error = trace.StatusCode.ERROR
        self._status = trace.Status

    # -- the request span ------------------------------------------------------------------------
    def start(self, headers: Mapping[str, str], via: str, path: str | None) -> Span:
        """The request's span, a child of the trace context in ``headers`` (if any); ``via``: the
        adapter; ``path``: the request's (default: ext_proc's ``:path`` header)."""
        parent = self.propagator.extract(headers)
        attributes: dict[str, Any] = {
            "pd_router.adapter": via,
            "http.request.method": headers.get(":method", "POST"),
        }
        path = headers.get(":path") if path is None else path
        if path is not None:
            attributes["url.path"] = path.split("?", 1)[0]
        return self.tracer.start_span(REQUEST_SPAN, context=parent, kind=self._server, attributes=attributes)

    def picked(self, span: Span, request: RouteRequest, decision: RouteDecision) -> None:
        """The decision, as attributes of the request span."""
        if not span.is_recording():  # sampled out: nothing is kept, so nothing is computed
            return
        b = decision.breakdown
        attributes: dict[str, Any] = {
            "gen_ai.request.id": request.request_id,
            "gen_ai.request.model": request.requested_model or request.model,
            "gen_ai.request.max_tokens": request.max_tokens,
            "pd_router.model": request.model,
            "pd_router.api": request.api,
            "pd_router.priority": request.priority,
            "pd_router.prompt_tokens": request.prompt_tokens,
            "pd_router.candidates": self.candidates(),
            "pd_router.route.kind": decision.kind,
            "pd_router.route.policy": decision.policy,
            "pd_router.decode.endpoint": decision.decode.id,
            "pd_router.decode.address": decision.decode.address,
            "pd_router.decode.fallbacks": len(decision.decode_fallback_slots),
            "pd_router.predicted.ttft_s": b["ttft_s"],
            "pd_router.predicted.tpot_s": b["tpot_s"],
            "pd_router.cached_tokens": b["cached_tokens"],
            "pd_router.cost": b["cost"],
        }
        operation = _OPERATIONS.get(request.api)
        if operation is not None:
            attributes["gen_ai.operation.name"] = operation
        slo = request.slo
        if slo is not None:  # only requests that carry one: the others' spans are as before
            if slo.ttft_s is not None:
                attributes["pd_router.slo.ttft_s"] = slo.ttft_s
            if slo.tpot_s is not None:
                attributes["pd_router.slo.tpot_s"] = slo.tpot_s
            if slo.objective:
                attributes["pd_router.slo.objective"] = slo.objective
        if decision.prefill is not None:
            attributes["pd_router.prefill.endpoint"] = decision.prefill.id
            attributes["pd_router.prefill.address"] = decision.prefill.address
            attributes["pd_router.prefill.fallbacks"] = len(decision.prefill_fallback_slots)
            attributes["pd_router.transfer_s"] = b["transfer_s"]
        attributes.update(self.shares(b))
        span.set_attributes(attributes)

    def shares(self, breakdown: Mapping[str, float]) -> dict[str, float]:
        """Each cost term's share of the chosen route's cost (``cost`` × the TTFT SLO: the route's
        seconds, also given, so a share times it is the term's weighted seconds); ``link`` is the
        weighted KV transfer's. Shares only: every attribute is paid for per request."""
        total = breakdown["cost"] * self.ttft_slo_s
        out = {"pd_router.cost_s": total}
        if total <= 0:
            return out
        for key, seconds in breakdown.items():
            if key.endswith("_s") and key not in _NOT_TERMS:
                out[f"pd_router.cost.{key[:-2]}.share"] = seconds / total
        if breakdown.get("transfer_s"):
            out["pd_router.cost.link.share"] = self.link_weight * breakdown["transfer_s"] / total
        return out

    def refused(self, span: Span, rejection: Rejection) -> None:
        """A refused request: status ERROR, with the status and code the client got."""
        span.set_attributes({"http.response.status_code": rejection.status, "error.type": rejection.code})
        span.set_status(self._status(self._error, rejection.message))

    def end(
        self,
        span: Span,
        outcome: str,
        *,
        ttft_s: float | None,
        meter: ResponseMeter | None,
    ) -> None:
        """The request ended: its outcome, observed TTFT (from the pick, as predicted) and TPOT, and
        what the engine reported it used."""
        if span.is_recording():
            attributes: dict[str, Any] = {"pd_router.outcome": outcome}
            if ttft_s is not None:
                attributes["pd_router.observed.ttft_s"] = ttft_s
            if meter is not None:
                tpot = meter.tpot()
                if tpot is not None:
                    attributes["pd_router.observed.tpot_s"] = tpot
                usage = meter.usage
                if usage is not None:
                    attributes.update(_usage(usage))
            span.set_attributes(attributes)
            # A refusal set its own error (``refused``); these are the engine's or the gateway's.
            if outcome == "upstream_disconnected" or outcome.startswith(("http_5", "envoy_5")):
                span.set_attributes({"error.type": outcome})
                span.set_status(self._status(self._error, outcome))
        span.end()

    # -- children --------------------------------------------------------------------------------
    def queue(self, parent: Span, depth: int) -> Span:
        """Held by flow control: ``depth`` requests were already waiting."""
        return self.tracer.start_span(
            QUEUE_SPAN,
            context=self._in(parent),
            kind=self._internal,
            attributes={"pd_router.queue.depth": depth},
        )

    def leg(
        self, parent: Span, role: str, endpoint: Endpoint, headers: dict[str, str]
    ) -> tuple[Span, dict[str, str]]:
        """One leg to an engine (``role``: ``prefill`` or ``decode``): its span and the headers to
        send, ``traceparent`` naming the leg (a client's own trace headers, in whatever case, are
        replaced)."""
        host, _, port = endpoint.address.rpartition(":")
        span = self.tracer.start_span(
            _LEG_SPANS[role],
            context=self._in(parent),
            kind=self._client,
            attributes={
                "pd_router.endpoint": endpoint.id,
                "server.address": host,
                "server.port": int(port) if port.isdigit() else 0,
            },
        )
        return span, self.inject(span, headers)

    def inject(self, span: Span, headers: dict[str, str]) -> dict[str, str]:
        """``headers`` (a copy) carrying ``span``'s trace context instead of any it had."""
        out = {k: v for k, v in headers.items() if k.lower() not in TRACE_HEADERS}
        self.propagator.inject(out, context=self._in(span))
        return out

    def context_headers(self, span: Span) -> dict[str, str]:
        """``span``'s trace context as headers (for Envoy to send upstream)."""
        out: dict[str, str] = {}
        self.propagator.inject(out, context=self._in(span))
        return out

    def prefill_answered(self, span: Span, usage: object) -> None:
        """What a prefill leg's engine reported (``usage`` as it answered; None: nothing)."""
        counted = usage_of(usage)
        if counted is not None and span.is_recording():
            span.set_attributes(_usage(counted))

    def failed(self, span: Span, error_type: str, message: str) -> None:
        """A leg failed (the request may still be answered by a fallback)."""
        span.set_attributes({"error.type": error_type})
        span.set_status(self._status(self._error, message))

    def shutdown(self) -> None:
        """Export what is still buffered and stop (at the service's stop)."""
        if self.owns_provider:
            self.provider.shutdown()


def _usage(usage: Usage) -> dict[str, int]:
    counts = {
        "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": usage.completion_tokens,
        "gen_ai.usage.cache_read.input_tokens": usage.cached_tokens,
    }
    return {name: value for name, value in counts.items() if value is not None}


def otlp_provider() -> TracerProvider:
    """A provider exporting in batches as the standard environment says: ``OTEL_TRACES_EXPORTER``
    (``otlp``, the default; ``console``; ``none``), ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``
    (``http/protobuf``, the default; ``grpc`` needs ``opentelemetry-exporter-otlp-proto-grpc``),
    the exporter's own ``OTEL_EXPORTER_OTLP_*`` (endpoint, headers, timeout, ...), the sampler's
    ``OTEL_TRACES_SAMPLER[_ARG]``, the batch's ``OTEL_BSP_*``, and the resource's
    ``OTEL_SERVICE_NAME``/``OTEL_RESOURCE_ATTRIBUTES`` (``service.name`` is ``pd-router`` unless
    they name it)."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "pd-router"}))
    provider = TracerProvider(resource=resource)  # the sampler from OTEL_TRACES_SAMPLER
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if kind == "none":
        return provider
    if kind == "console":
        exporter: Any = ConsoleSpanExporter()
    elif kind == "otlp":
        exporter = _otlp_exporter()
    else:
        raise ValueError(f"OTEL_TRACES_EXPORTER={kind!r}: pd-router exports otlp, console or none")
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _otlp_exporter() -> Any:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: grpc or http/protobuf")
    return OTLPSpanExporter()


def _missing_opentelemetry(exc: ImportError) -> str:
    if "opentelemetry.proto" in str(exc):
        # xds-protos (Envoy's messages, a dependency) ships an old copy of opentelemetry-proto's
        # modules under the same paths: whichever of the two pip installs last wins.
        return (
            "tracing.enabled: opentelemetry-proto's modules were overwritten by an older copy (xds-protos, "
            "the Envoy messages pd-router needs, ships one); reinstall them: pip install "
            f"--force-reinstall --no-deps opentelemetry-proto ({exc})"
        )
    return f"tracing.enabled needs OpenTelemetry: pip install 'pd-router[tracing]' ({exc})"


def tracer_for(
    ttft_slo_s: float,
    link_weight: float,
    candidates: Callable[[], int],
    provider: TracerProvider | None = None,
) -> RequestTracer:
    """The request tracer over ``provider`` (a test's), else one made from the environment."""
    try:
        owned = provider is None
        made = otlp_provider() if provider is None else provider
    except ImportError as exc:
        raise ConfigError(_missing_opentelemetry(exc)) from None
    except ValueError as exc:  # an OTEL_* variable we cannot follow
        raise ConfigError(f"tracing: {exc}") from None
    log.info("tracing on: a span per request, exported as OTEL_* says")
    return RequestTracer(
        made, ttft_slo_s=ttft_slo_s, link_weight=link_weight, candidates=candidates, owns_provider=owned
    )
