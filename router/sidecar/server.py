"""``pd-router sidecar``: the decode-side proxy of an Envoy/InferencePool deployment.

The endpoint picker sends each request to a decode pod's sidecar and names the chosen prefill pod
in ``x-prefiller-host-port`` (llm-d's convention). The sidecar runs the same two-leg exchange as
the standalone proxy (``router.http.exchange``): a prefill leg to that pod, then the decode leg to
the local engine with the prefill's ``kv_transfer_params``. Everything that is not a completion
(``/metrics``, ``/health``, ``/v1/models``, ...) is reverse-proxied to the local engine, because
the router scrapes decode pods through their sidecar. Prefill targets are checked against the
allow list (``router.sidecar.allow``) before anything is sent.

With a sidecar in front of every pod, a pair's prefill pod is fronted too: the prefill leg a peer's
sidecar sends here (marked ``x-pd-prefill-leg``) goes to the local engine as it is. A client's
``kv_transfer_params`` is still refused with 400: a prefill leg is accepted only from a peer on the
allow list, only in a prefill leg's exact shape (the ``kv_transfer_params`` of a remote decode,
which name no host to pull KV from; one token; not streamed) and without a prefill pod of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from contextlib import AsyncExitStack
from types import TracebackType

import aiohttp
import orjson
from aiohttp import web
from yarl import URL

from router.http.client_io import answer_response, read_body
from router.http.exchange import (
    PREFILL_KV_TRANSFER_PARAMS,
    Leg,
    TwoLegExchange,
    UpstreamError,
    decode_body,
    respond,
)
from router.http.headers import (
    HOP_HEADERS,
    PASSTHROUGH_DROPPED,
    PREFILL_LEG,
    PREFILLER,
    SERVER_TIMING,
    PrefillTiming,
    forwardable,
    prefill_timing,
)
from router.http.server import http_runner
from router.http.session import upstream_session
from router.http.upstream import Answer, engine_client, session_timeout
from router.request.meter import Usage, usage_of
from router.request.parse import PD_PATHS, client_json
from router.request.rejections import BadRequest, PrefillForbidden, Rejection, UpstreamFailed, answer
from router.request.types import new_request_id
from router.sidecar.allow import PrefillAllowList, first_prefiller, format_host_port, parse_host_port
from router.transport.listen import binding
from router.transport.tls import HTTP1_ALPN, started

log = logging.getLogger(__name__)

PREFILL_OUTCOME_HEADER = "x-pd-sidecar-prefill"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_DRAIN_TIMEOUT_S = 5.0


class Sidecar:
    """aiohttp handlers: the P/D exchange for completions, a reverse proxy for everything else."""

    def __init__(
        self,
        decode_address: str,
        exchange: TwoLegExchange,
        session: aiohttp.ClientSession,
        timeout: aiohttp.ClientTimeout,
        allow: PrefillAllowList,
        max_body_bytes: int,
    ) -> None:
        """``session`` and ``timeout``: everything but the completions, passed through as it is."""
        self.decode_address = decode_address
        self.exchange = exchange
        self.session = session
        self.timeout = timeout
        self.allow = allow
        self.max_body_bytes = max_body_bytes

    def app(self) -> web.Application:
        # +1 so a body of exactly the limit is read, and one byte more is ours to reject as JSON.
        app = web.Application(client_max_size=self.max_body_bytes + 1)
        for path in sorted(PD_PATHS):
            app.router.add_post(path, self.completions)
        app.router.add_route("*", "/{tail:.*}", self.passthrough)
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._completions(request)
        except Rejection as rejection:
            return answer_response(answer(rejection))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        if PREFILL_LEG in request.headers:
            return await self._prefill_leg(request)
        request_id = request.headers.get("x-request-id") or new_request_id()
        target = first_prefiller(request.headers.getall(PREFILLER, []))
        address: str | None = None
        if target is not None:
            parsed = parse_host_port(target) if self.allow.permits(target) else None
            if parsed is None:
                shown = target[:80]  # client-controlled: bounded in logs and answers
                log.warning("request %s: prefill target %r is not allowed; refused", request_id, shown)
                raise PrefillForbidden(f"prefill target {shown!r} is not allowed by this sidecar")
            address = format_host_port(*parsed)  # canonical, so nothing odd reaches the URL
        raw = await read_body(request, self.max_body_bytes)
        # Checked on the local path too: a client-chosen remote_host would make the engine pull KV from it.
        body = client_json(raw)
        headers = forwardable(request.headers)
        headers["X-Request-Id"] = request_id
        leg = Leg(request.path, headers)
        outcome = "local"
        data = raw
        timing: PrefillTiming | None = None
        if address is not None:
            # Marked, so that a sidecar in front of the prefill pod passes it to its engine.
            prefill_leg = Leg(request.path, {**headers, PREFILL_LEG: "1"})
            leg_started = time.perf_counter()
            try:
                kv_params, usage = await self.exchange.prefill(address, prefill_leg, body)
            except UpstreamError as exc:
                # The decode engine computes the prompt itself: slower, not lost.
                log.warning(
                    "request %s: prefill leg to %s failed (%s); decoding with local prefill",
                    request_id,
                    address,
                    exc.reason,
                )
                outcome = "failed-local"
            else:
                outcome = "remote"
                counts = usage_of(usage) or Usage()
                timing = PrefillTiming(
                    time.perf_counter() - leg_started, counts.prompt_tokens, counts.cached_tokens
                )
                data = decode_body(body, kv_params)

        async def start_response(upstream: Answer, whole: bytes | None) -> web.StreamResponse:
            headers = {"X-Request-Id": request_id, PREFILL_OUTCOME_HEADER: outcome}
            if timing is not None:
                headers[SERVER_TIMING] = prefill_timing(timing)
            return await respond(request, upstream, headers, whole)

        try:
            return await self.exchange.decode(self.decode_address, leg, data, start_response, _noop)
        except UpstreamError as exc:
            log.warning(
                "request %s: decode engine %s failed: %s", request_id, self.decode_address, exc.reason
            )
            raise UpstreamFailed(f"the local decode engine failed: {exc.reason}") from None

    async def _prefill_leg(self, request: web.Request) -> web.StreamResponse:
        """A peer's sidecar runs a pair whose prefill pod is this one: the local engine computes the
        prompt and keeps its KV for the peer's engine to pull. Checked before it is sent: the peer
        is on the allow list, the leg names no prefill pod of its own, and its body is a prefill
        leg (so a client cannot make the engine pull KV from a host of its choosing)."""
        peer = request.remote or ""
        if not self.allow.permits_peer(peer):
            shown = peer[:64]
            log.warning("prefill leg from %r, which is not on the allow list; refused", shown)
            raise PrefillForbidden(f"prefill legs from {shown!r} are not allowed by this sidecar")
        if request.headers.getall(PREFILLER, []):
            raise BadRequest("a prefill leg cannot name a prefill pod of its own")
        raw = await read_body(request, self.max_body_bytes)
        _check_prefill_leg(raw)
        return await self._forward(request, raw, outcome="prefill-leg")

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """Reverse-proxy any other request to the local engine: status, headers and body unchanged."""
        try:
            data = await read_body(request, self.max_body_bytes) if request.body_exists else None
        except Rejection as rejection:
            return answer_response(answer(rejection))
        return await self._forward(request, data)

    async def _forward(
        self, request: web.Request, data: bytes | None, outcome: str | None = None
    ) -> web.StreamResponse:
        """``request`` with ``data`` to the local engine; its answer streamed back as it is (plus
        ``x-pd-sidecar-prefill: outcome`` when given)."""
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in PASSTHROUGH_DROPPED]
        try:
            upstream = await self.session.request(
                request.method,
                # rel_url, not raw_path: an absolute-form target must not pick the host. encoded=True
                # keeps the client's percent-encoding byte for byte.
                URL(f"http://{self.decode_address}{request.rel_url.raw_path_qs}", encoded=True),
                data=data,
                headers=headers,
                allow_redirects=False,
                timeout=self.timeout,
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("%s %s to %s failed: %s", request.method, request.path, self.decode_address, exc)
            return answer_response(answer(UpstreamFailed(f"the local engine failed: {type(exc).__name__}")))
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in HOP_HEADERS:
                    response.headers.add(name, value)
            if outcome is not None:
                response.headers[PREFILL_OUTCOME_HEADER] = outcome
            await response.prepare(request)
            try:
                read = upstream.content.readany
                while chunk := await read():
                    await response.write(chunk)
            except (aiohttp.ClientError, TimeoutError) as exc:
                # Headers are gone; cut the connection so the client cannot take a short body as whole.
                log.warning(
                    "%s %s from %s cut mid-way: %s", request.method, request.path, self.decode_address, exc
                )
                if request.transport is not None:
                    request.transport.abort()
                return response
            await response.write_eof()
            return response


def _noop() -> None:
    pass


def _check_prefill_leg(raw: bytes) -> None:
    """Refuse (400) a body that is not a prefill leg: exactly the ``kv_transfer_params`` of a
    remote decode (every remote_* null: no host to pull KV from), one token, not streamed."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"prefill leg body is not valid JSON: {exc}") from None
    if (
        not isinstance(body, dict)
        or body.get("kv_transfer_params") != PREFILL_KV_TRANSFER_PARAMS
        or body.get("stream") is True
        or body.get("max_tokens") != 1
        or body.get("max_completion_tokens", 1) != 1
    ):
        raise BadRequest(
            "not a prefill leg: expected the kv_transfer_params of a remote decode, max_tokens 1, no stream"
        )


class SidecarServer:
    """The sidecar listening on ``host:port`` (``.port`` is the bound one) while the context is open."""

    def __init__(
        self,
        decode_address: str,
        host: str,
        port: int,
        allow: Iterable[str],
        *,
        connect_timeout_s: float = 2.0,
        request_timeout_s: float = 600.0,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        tls: bool = False,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_min_version: str = "1.2",
        http_client: str = "builtin",
    ) -> None:
        """``tls``: serve HTTPS, from ``tls_cert``/``tls_key`` (reloaded when they change) or a
        self-signed pair without them; ``http_client``: the legs' (``router.http.upstream``)."""
        if tls and (tls_cert is None) != (tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together (neither: self-signed)")
        # Validated here, so a bad --allow fails before anything listens.
        self.allow = PrefillAllowList(allow)
        self.decode_address = decode_address
        self.host = host
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_body_bytes = max_body_bytes
        self.drain_timeout_s = drain_timeout_s
        self.http_client = http_client
        self.tls_files = (tls_cert, tls_key, tls_min_version) if tls else None
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> SidecarServer:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def _start(self) -> None:
        stack = self._stack
        session = await stack.enter_async_context(upstream_session())
        client = engine_client(self.http_client, session, self.connect_timeout_s, self.request_timeout_s)
        stack.push_async_callback(client.close)
        exchange = TwoLegExchange(client)
        timeout = session_timeout(self.connect_timeout_s, self.request_timeout_s)  # the pass-through's
        sidecar = Sidecar(self.decode_address, exchange, session, timeout, self.allow, self.max_body_bytes)
        # handler_cancellation: a client that hangs up cancels the engine calls, which frees their KV.
        runner = http_runner(sidecar.app(), drain_timeout_s=self.drain_timeout_s, cancel_on_disconnect=True)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)  # runs before the session closes: streams drain first
        context = None
        if self.tls_files is not None:
            tls = await started(*self.tls_files, alpn=HTTP1_ALPN)
            stack.push_async_callback(tls.__aexit__)
            context = tls.context
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True, ssl_context=context)
        with binding("sidecar listener", self.host, self.port):
            await site.start()
        self.port = runner.addresses[0][1]
        log.info(
            "sidecar listening on %s://%s:%s in front of decode engine %s",
            "https" if context is not None else "http",
            self.host,
            self.port,
            self.decode_address,
        )

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stack.aclose()
