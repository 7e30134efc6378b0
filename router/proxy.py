"""The standalone OpenAI-compatible proxy, and the two-leg P/D exchange it performs.

The adapter only turns HTTP into a ``RouteRequest``, asks the picker, forwards, and releases the
reservation in one ``finally``. ``TwoLegExchange`` is the prefill → decode protocol of vLLM's NIXL
connector as llm-d's decode sidecar drives it; the sidecar reuses it unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from router.config import PoolConfig
from router.picker import Picker, RouteDecision
from router.pool import Endpoint, Pool
from router.request import (
    COMPLETION_PATHS,
    BodyTooLarge,
    Rejection,
    RouteRequest,
    UpstreamFailed,
    parse_request,
)
from router.signals import RouterMetrics

log = logging.getLogger(__name__)

# Headers that only the router may set; a client's copy is dropped before forwarding.
INTERNAL_HEADERS = frozenset(
    {"x-gateway-destination-endpoint", "x-prefiller-host-port", "x-pd-router-decode", "x-pd-router-prefill"}
)
# Hop-by-hop and recomputed headers that are never copied between legs.
_HOP_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "upgrade",
        "accept-encoding",
    }
)
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class UpstreamError(Exception):
    """An engine failed before we sent the client anything; the next fallback may be tried."""

    def __init__(self, address: str, reason: str, *, connect: bool = False) -> None:
        super().__init__(f"{address}: {reason}")
        self.address = address
        self.reason = reason
        self.connect = connect


def prefill_body(body: dict[str, Any]) -> bytes:
    """The prefill leg: the client's request computing one token, no stream, remote decode."""
    leg = dict(body)
    leg.pop("stream_options", None)
    leg.update(max_tokens=1, min_tokens=1, stream=False, kv_transfer_params=PREFILL_KV_TRANSFER_PARAMS)
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    return orjson.dumps(leg)


def decode_body(body: dict[str, Any], kv_transfer_params: Any) -> bytes:
    """The decode leg: the client's request plus the prefill answer's ``kv_transfer_params``."""
    return orjson.dumps({**body, "kv_transfer_params": kv_transfer_params})


@dataclass(slots=True)
class Leg:
    """What one leg sends: path, headers and body bytes."""

    path: str
    headers: dict[str, str]


class TwoLegExchange:
    """Forwards one request: optional prefill leg, then the decode leg streamed to the client."""

    def __init__(
        self, session: aiohttp.ClientSession, connect_timeout_s: float, request_timeout_s: float
    ) -> None:
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)

    async def prefill(self, address: str, leg: Leg, body: dict[str, Any]) -> Any:
        """Run the prefill leg; returns its ``kv_transfer_params`` or raises ``UpstreamError``."""
        try:
            async with self.session.post(
                f"http://{address}{leg.path}",
                data=prefill_body(body),
                headers={**leg.headers, "content-type": "application/json"},
                timeout=self.timeout,
            ) as resp:
                payload = await resp.read()
                if resp.status != 200:
                    raise UpstreamError(address, f"prefill leg answered HTTP {resp.status}")
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError(address, f"connect failed: {exc.os_error or exc}", connect=True) from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(address, f"prefill leg failed: {type(exc).__name__}") from None
        try:
            params = orjson.loads(payload)["kv_transfer_params"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise UpstreamError(address, "prefill answer has no kv_transfer_params") from None
        if not isinstance(params, dict):
            raise UpstreamError(address, "prefill answer's kv_transfer_params is not an object")
        return params

    async def decode(
        self,
        address: str,
        leg: Leg,
        data: bytes,
        start_response: Callable[[aiohttp.ClientResponse], Awaitable[web.StreamResponse]],
        on_first_byte: Callable[[], None],
    ) -> web.StreamResponse:
        """Send the decode leg and stream its answer through ``start_response``.

        Raises ``UpstreamError`` only while nothing has been sent to the client (so the caller can
        fail over); after that an engine failure ends the stream with an SSE error event.
        """
        try:
            resp = await self.session.post(
                f"http://{address}{leg.path}",
                data=data,
                headers={**leg.headers, "content-type": "application/json"},
                timeout=self.timeout,
            )
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError(address, f"connect failed: {exc.os_error or exc}", connect=True) from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(address, f"decode leg failed: {type(exc).__name__}") from None
        async with resp:
            if resp.status >= 500:
                raise UpstreamError(address, f"decode leg answered HTTP {resp.status}")
            streaming = resp.content_type == "text/event-stream"
            if not streaming:
                # Small JSON answers are read whole, so a failure part-way can still fail over.
                try:
                    payload = await resp.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise UpstreamError(address, f"decode answer cut: {type(exc).__name__}") from None
                on_first_byte()
                out = await start_response(resp)
                await out.write(payload)
                return out
            out = None
            try:
                read = resp.content.readany  # a plain loop: cheaper per chunk than the async iterator
                while chunk := await read():
                    if out is None:
                        on_first_byte()
                        out = await start_response(resp)
                    await out.write(chunk)
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, TimeoutError) as exc:
                if out is None:
                    raise UpstreamError(
                        address, f"decode stream failed before any byte: {type(exc).__name__}"
                    ) from None
                log.warning("decode stream from %s cut mid-way: %s", address, type(exc).__name__)
                await out.write(_sse_error("upstream engine stopped mid-stream", "upstream_disconnected"))
            if out is None:
                on_first_byte()
                out = await start_response(resp)
            return out


def upstream_session() -> aiohttp.ClientSession:
    """The client session for talking to engines, shared by the proxy, scraper and sidecar.

    No cookie jar (one upstream's Set-Cookie must not ride along on other clients' requests), no
    decompression (pass-through bodies keep their Content-Encoding), no connection cap.
    """
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30.0)
    return aiohttp.ClientSession(
        connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
    )


def _sse_error(message: str, code: str) -> bytes:
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + orjson.dumps(error) + b"\n\n"


class Proxy:
    """aiohttp handlers for the OpenAI-compatible surface."""

    def __init__(
        self,
        config: PoolConfig,
        pool: Pool,
        picker: Picker,
        exchange: TwoLegExchange,
        metrics: RouterMetrics,
        ready: Callable[[], bool],
        prepare: Callable[[RouteRequest], Awaitable[None]] | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.picker = picker
        self.exchange = exchange
        self.metrics = metrics
        self.limits = config.request_limits()
        self.ready = ready
        self.prepare = prepare  # the I/O a pick may need first (tokenizing, a shared-index lookup)
        self.debug_headers = config.proxy.debug_headers

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes + 1)
        for path in sorted(COMPLETION_PATHS):
            app.router.add_post(path, self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        return app

    async def models(self, _: web.Request) -> web.Response:
        created = int(time.time())
        model = {"id": self.config.model, "object": "model", "created": created, "owned_by": "pd-router"}
        return web.json_response({"object": "list", "data": [model]}, dumps=_dumps)

    async def health(self, _: web.Request) -> web.Response:
        if self.ready() and len(self.pool.candidate_slots()):
            return web.Response(text="ok")
        return web.Response(status=503, text="no admitted endpoint with fresh metrics")

    async def prometheus(self, _: web.Request) -> web.Response:
        body, content_type = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        decision: RouteDecision | None = None
        outcome = "error"
        try:
            route = await self._route_request(request)
            decision = self.picker.pick(route)
            self.metrics.observe_pick(decision, time.perf_counter() - started)
            response = await self._forward(request, route, decision)
            outcome = "ok"
            return response
        except Rejection as rejection:
            outcome = rejection.code
            return web.Response(
                status=rejection.status,
                body=rejection.body(),
                headers={**rejection.headers(), "Content-Type": "application/json"},
            )
        except (ConnectionResetError, asyncio.CancelledError):
            outcome = "client_gone"
            raise
        finally:
            if decision is not None:
                decision.reservation.release()
            self.metrics.observe_request(outcome, time.perf_counter() - started)

    async def _route_request(self, request: web.Request) -> RouteRequest:
        limit = self.limits.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise BodyTooLarge(f"request body is {request.content_length} bytes; the limit is {limit}")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise BodyTooLarge(f"request body is over the limit of {limit} bytes") from None
        route = parse_request(raw, self.limits, request.headers)
        if self.prepare is not None:
            await self.prepare(route)
        return route

    async def _forward(
        self, request: web.Request, route: RouteRequest, decision: RouteDecision
    ) -> web.StreamResponse:
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in _HOP_HEADERS and k.lower() not in INTERNAL_HEADERS
        }
        headers["X-Request-Id"] = route.request_id
        leg = Leg(request.path, headers)
        kv_params = await self._prefill(decision, leg, route) if decision.prefill is not None else None
        data = decode_body(route.body, kv_params) if kv_params is not None else await request.read()
        decode_order = [decision.decode, *decision.decode_fallbacks]
        last_error: UpstreamError | None = None
        for endpoint in decode_order:
            if endpoint is not decision.decode:
                self.picker.retarget(decision, decode=endpoint)
            try:
                return await self.exchange.decode(
                    endpoint.address,
                    leg,
                    data,
                    lambda resp: self._start_response(request, resp, route, decision),
                    decision.reservation.finish_prefill,
                )
            except UpstreamError as exc:
                last_error = exc
                self._upstream_failed(endpoint, exc)
        assert last_error is not None
        raise UpstreamFailed(f"every decode endpoint tried failed; last: {last_error}")

    async def _prefill(self, decision: RouteDecision, leg: Leg, route: RouteRequest) -> Any:
        assert decision.prefill is not None
        for endpoint in [decision.prefill, *decision.prefill_fallbacks]:
            if endpoint is not decision.prefill:
                self.picker.retarget(decision, prefill=endpoint)
            try:
                params = await self.exchange.prefill(endpoint.address, leg, route.body)
            except UpstreamError as exc:
                self._upstream_failed(endpoint, exc)
                continue
            decision.reservation.finish_prefill()
            return params
        # Every prefill pod failed: the decode pod computes the prompt itself (slower, not lost).
        log.warning("request %s: every prefill leg failed; decoding with local prefill", route.request_id)
        self.metrics.prefill_fallback_local.inc()
        return None

    def _upstream_failed(self, endpoint: Endpoint, exc: UpstreamError) -> None:
        log.warning("upstream %s failed: %s", endpoint.id, exc.reason)
        self.metrics.upstream_errors.labels(endpoint=endpoint.id).inc()
        # Passive health: a refused connect means the pod is gone, so do not wait for the scraper;
        # other failures (a reset keep-alive connection, a 5xx) only count towards ejection.
        if exc.connect:
            self.pool.eject(endpoint, exc.reason)
        else:
            self.pool.record_failure(endpoint, exc.reason)

    async def _start_response(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        route: RouteRequest,
        decision: RouteDecision,
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status)
        for name in ("Content-Type", "Cache-Control"):
            if name in upstream.headers:
                response.headers[name] = upstream.headers[name]
        response.headers["X-Request-Id"] = route.request_id
        if self.debug_headers:
            response.headers["x-pd-router-decode"] = decision.decode.id
            if decision.prefill is not None:
                response.headers["x-pd-router-prefill"] = decision.prefill.id
            response.headers["x-pd-router-reason"] = decision.reason
        await response.prepare(request)
        return response


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()
