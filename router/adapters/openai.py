"""The standalone OpenAI-compatible proxy: HTTP in, ``RequestFlow`` calls, the two-leg exchange out.

It serves the APIs whose bodies the parser reads (``router.request.parse.API_PATHS``: completions,
chat, Anthropic's Messages, OpenAI's Responses) and passes a POST to any other path to one pod
chosen on load alone, body and content type as they came.

The adapter reads the body, runs the flow (parse → prepare → pick), forwards through
``router.http.exchange.TwoLegExchange`` with failover (prefill → next prefill pod, or local
prefill; decode before the first byte → next decode pod; after it → an SSE error event), and
closes the flight in one ``finally``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from router.flow.flight import CLIENT_GONE, Flight, RequestFlow
from router.http.client_io import answer_response, read_body
from router.http.exchange import Leg, TwoLegExchange, UpstreamError, decode_body, respond, with_usage
from router.http.headers import DEBUG_DECODE, DEBUG_PREFILL, DEBUG_REASON, forwardable
from router.http.server import bearer_ok, http_runner
from router.http.upstream import Answer, engine_client
from router.request.meter import usage_of
from router.request.parse import API_PATHS, OTHER
from router.request.rejections import UPSTREAM_DISCONNECTED, Rejection, UpstreamFailed
from router.server.config import ProxyConfig
from router.state.pool import Endpoint
from router.transport.listen import binding
from router.transport.tls import HTTP1_ALPN, ServerTls, started

if TYPE_CHECKING:  # only with tracing on, through the flow's tracer
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)


class Proxy:
    """aiohttp handlers for the OpenAI-compatible surface."""

    def __init__(
        self,
        flow: RequestFlow,
        exchange: TwoLegExchange,
        ready: Callable[[], bool],
        *,
        debug_headers: bool = False,
        metrics_token: str | None = None,
    ) -> None:
        self.flow = flow
        self.exchange = exchange
        self.ready = ready
        self.debug_headers = debug_headers
        if debug_headers:  # the reason header needs every decision's breakdown
            flow.explain = True
        self.metrics_token = metrics_token
        self.max_body_bytes = flow.limits.max_body_bytes

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes + 1)
        for path in sorted(API_PATHS):
            app.router.add_post(path, self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_post("/{tail:.*}", self.completions)  # an API we do not read: load-only
        # A stored Responses API answer lives on the engine that gave it: to that pod.
        app.router.add_get("/v1/responses/{response_id}", self.stored_response)
        app.router.add_delete("/v1/responses/{response_id}", self.stored_response)
        app.router.add_get("/v1/responses/{response_id}/input_items", self.stored_response)
        return app

    async def models(self, _: web.Request) -> web.Response:
        model = {
            "id": self.flow.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pd-router",
        }
        return web.Response(
            body=orjson.dumps({"object": "list", "data": [model]}), content_type="application/json"
        )

    async def health(self, _: web.Request) -> web.Response:
        if self.ready() and len(self.flow.picker.pool.candidate_slots()):
            return web.Response(text="ok")
        return web.Response(status=503, text="no admitted endpoint with fresh metrics")

    async def prometheus(self, request: web.Request) -> web.Response:
        if not bearer_ok(request, self.metrics_token):  # the same guard as the metrics listener's
            return web.Response(status=401, text="metrics: missing or wrong bearer token")
        body, content_type = self.flow.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, with_body=True)

    async def stored_response(self, request: web.Request) -> web.StreamResponse:
        """``GET``/``DELETE /v1/responses/{id}``: no body, to the pod that stored the answer."""
        return await self._serve(request, with_body=False)

    async def _serve(self, request: web.Request, *, with_body: bool) -> web.StreamResponse:
        flight = self.flow.start(request.headers, path=request.path)
        try:
            body = await read_body(request, self.max_body_bytes) if with_body else None
            await self.flow.route(flight, body, request.path)
            return await self._forward(request, flight)
        except Rejection as rejection:
            return answer_response(flight.reject(rejection))
        except (ConnectionResetError, asyncio.CancelledError):
            flight.close(CLIENT_GONE)
            raise
        finally:
            flight.close()

    async def _forward(self, request: web.Request, flight: Flight) -> web.StreamResponse:
        route, decision = flight.request, flight.decision
        assert route is not None and decision is not None
        headers = forwardable(request.headers)
        headers["X-Request-Id"] = route.request_id
        if route.api == OTHER and "Content-Type" in request.headers:  # not ours to re-encode: as sent
            headers["content-type"] = request.headers["Content-Type"]
        # A stored answer's GET: its query is the request (?stream=true).
        path = request.path if request.method == "POST" else request.path_qs
        leg = Leg(path, headers, request.method)
        kv_params = await self._prefill(flight, leg) if decision.prefill is not None else None
        # Ask a streamed answer for its usage (what the engine counted and had cached); the
        # client gets that chunk only if it asked for it itself.
        body = with_usage(route.body, route.api)
        flight.expect_answer(strip_usage=body is not None)
        body = route.body if body is None else body
        if kv_params is not None:
            data = decode_body(body, kv_params)
        else:
            unchanged = body is route.body and route.requested_model is None  # not re-encoded: as sent
            data = await request.read() if unchanged else orjson.dumps(body)
        last_error: UpstreamError | None = None
        for endpoint in [decision.decode, *decision.decode_fallbacks]:
            if endpoint is not decision.decode:
                flight.retarget(decode=endpoint)
            span: Span | None = None
            sent = leg
            if flight.span is not None:
                span, sent = self._leg(flight, "decode", endpoint, leg)
            try:
                response = await self.exchange.decode(
                    endpoint.address,
                    sent,
                    data,
                    lambda upstream, whole: self._start_response(request, upstream, flight, whole),
                    flight.prefill_done,
                    flight.body,
                    flight.body_rest,
                    lambda reason, endpoint=endpoint: flight.upstream_cut(endpoint, reason),
                )
            except UpstreamError as exc:
                last_error = exc
                flight.upstream_failed(endpoint, exc.reason, connect=exc.connect)
                self._leg_failed(span, exc)
            else:
                if span is not None:
                    self._decode_answered(span, response.status, flight)
                return response
            finally:
                if span is not None:
                    span.end()
        assert last_error is not None
        raise UpstreamFailed(f"every decode endpoint tried failed; last: {last_error}")

    async def _prefill(self, flight: Flight, leg: Leg) -> Any:
        route, decision = flight.request, flight.decision
        assert route is not None and decision is not None and decision.prefill is not None
        for endpoint in [decision.prefill, *decision.prefill_fallbacks]:
            if endpoint is not decision.prefill:
                flight.retarget(prefill=endpoint)
            span: Span | None = None
            sent = leg
            if flight.span is not None:
                span, sent = self._leg(flight, "prefill", endpoint, leg)
            try:
                params, usage = await self.exchange.prefill(endpoint.address, sent, route.body)
            except UpstreamError as exc:
                flight.upstream_failed(endpoint, exc.reason, connect=exc.connect)
                self._leg_failed(span, exc)
                continue
            else:
                if span is not None and self.flow.tracer is not None:
                    self.flow.tracer.prefill_answered(span, usage)
            finally:
                if span is not None:
                    span.end()
            flight.prefill_answered(usage_of(usage))
            return params
        # Every prefill pod failed: the decode pod computes the prompt itself (slower, not lost).
        log.warning("request %s: every prefill leg failed; decoding with local prefill", route.request_id)
        self.flow.metrics.prefill_fallback_local.inc()
        return None

    def _leg(self, flight: Flight, role: str, endpoint: Endpoint, leg: Leg) -> tuple[Span, Leg]:
        """A traced request's leg to ``endpoint``: its span, and the leg with the span's trace
        context (untraced, the caller sends ``leg`` as it is: no call, no allocation)."""
        tracer = self.flow.tracer
        assert flight.span is not None and tracer is not None
        span, headers = tracer.leg(flight.span, role, endpoint, leg.headers)
        return span, Leg(leg.path, headers, leg.method)

    def _decode_answered(self, span: Span, status: int, flight: Flight) -> None:
        span.set_attribute("http.response.status_code", status)
        if flight.outcome == UPSTREAM_DISCONNECTED and self.flow.tracer is not None:  # cut mid-way
            self.flow.tracer.failed(span, UPSTREAM_DISCONNECTED, "the engine stopped mid-answer")

    def _leg_failed(self, span: Span | None, error: UpstreamError) -> None:
        tracer = self.flow.tracer
        if span is not None and tracer is not None:
            tracer.failed(span, "connect_failed" if error.connect else "upstream_failed", error.reason)

    async def _start_response(
        self, request: web.Request, upstream: Answer, flight: Flight, whole: bytes | None
    ) -> web.StreamResponse:
        flight.responded(upstream.status)
        flight.first_byte()
        decision, route = flight.decision, flight.request
        assert decision is not None and route is not None
        headers = {"X-Request-Id": route.request_id}
        if self.debug_headers:
            headers[DEBUG_DECODE] = decision.decode.id
            if decision.prefill is not None:
                headers[DEBUG_PREFILL] = decision.prefill.id
            headers[DEBUG_REASON] = decision.reason
        return await respond(request, upstream, headers, whole)


class ProxyListener:
    """The proxy listening on ``config.host:port`` (``.port`` is the bound one) while the context is
    open; leaving it stops accepting and lets in-flight streams finish up to ``drain_timeout_s``."""

    def __init__(
        self,
        flow: RequestFlow,
        session: aiohttp.ClientSession,
        config: ProxyConfig,
        ready: Callable[[], bool],
        *,
        metrics_token: str | None = None,
    ) -> None:
        """``metrics_token``: the bearer token the proxy's own ``/metrics`` requires (``metrics.token``)."""
        self.client = engine_client(
            config.http_client, session, config.connect_timeout_s, config.request_timeout_s
        )
        exchange = TwoLegExchange(self.client)
        self.proxy = Proxy(
            flow, exchange, ready, debug_headers=config.debug_headers, metrics_token=metrics_token
        )
        self.config = config
        self.port: int | None = None
        self.tls: ServerTls | None = None
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> ProxyListener:
        cfg = self.config
        # handler_cancellation: a client that hangs up cancels the engine calls, freeing their KV.
        runner = http_runner(self.proxy.app(), drain_timeout_s=cfg.drain_timeout_s, cancel_on_disconnect=True)
        await runner.setup()
        self._runner = runner
        try:
            context = None
            if cfg.tls.enabled:
                tls = cfg.tls
                self.tls = await started(
                    tls.cert_file, tls.key_file, tls.min_version, tls.reload_interval_s, alpn=HTTP1_ALPN
                )
                context = self.tls.context
            with binding("proxy listener", cfg.host, cfg.port):
                await web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True, ssl_context=context).start()
        except BaseException:
            await self.__aexit__()
            raise
        self.port = runner.addresses[0][1]
        log.info(
            "proxy listening on %s://%s:%s (%d endpoints)",
            "https" if context is not None else "http",
            cfg.host,
            self.port,
            len(self.proxy.flow.picker.pool.endpoints),
        )
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.client.close()  # after the runner: its streams drained first
        if self.tls is not None:
            await self.tls.__aexit__()
            self.tls = None
