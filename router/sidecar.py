"""``pd-router sidecar``: the decode-side proxy of an Envoy/InferencePool deployment.

The endpoint picker sends each request to a decode pod's sidecar and names the chosen prefill pod
in ``x-prefiller-host-port`` (llm-d's convention). The sidecar runs the same two-leg exchange as
the standalone proxy (``TwoLegExchange``): a prefill leg to that pod, then the decode leg to the
local engine with the prefill's ``kv_transfer_params``. Everything that is not a completion
(``/metrics``, ``/health``, ``/v1/models``, ...) is reverse-proxied to the local engine, because
the router scrapes decode pods through their sidecar.

The prefill address comes from a request header, so it is an SSRF vector: only literal IP
addresses matched by the ``--allow`` list are contacted, names are never resolved, and an empty
list permits nothing.
"""

from __future__ import annotations

import ipaddress
import logging
import uuid
from collections.abc import Iterable
from contextlib import AsyncExitStack
from types import TracebackType

import aiohttp
from aiohttp import web
from yarl import URL

from router.proxy import (
    _HOP_HEADERS,
    INTERNAL_HEADERS,
    Leg,
    TwoLegExchange,
    UpstreamError,
    decode_body,
    upstream_session,
)
from router.request import COMPLETION_PATHS, BodyTooLarge, Rejection, UpstreamFailed, client_json

log = logging.getLogger(__name__)

PREFILLER_HEADER = "x-prefiller-host-port"
PREFILL_OUTCOME_HEADER = "x-pd-sidecar-prefill"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_DRAIN_TIMEOUT_S = 5.0
# Never sent to an engine: the router-only headers and the legacy name of the prefill header.
# The request id and content type are dropped from the copied headers because each leg sets its own.
_DROPPED_REQUEST_HEADERS = INTERNAL_HEADERS | {"x-prefiller-url"}
_LEG_OWN_HEADERS = frozenset({"x-request-id", "content-type"})
# The exchange legs re-encode JSON and want it uncompressed; a pass-through may keep the client's
# Accept-Encoding, since the session does not decompress and the encoded bytes go back as they are.
_PASSTHROUGH_HOP_HEADERS = _HOP_HEADERS - {"accept-encoding"}
# Response headers that describe one connection, not the message (RFC 9110 §7.6.1).
_HOP_RESPONSE_HEADERS = frozenset(
    {"content-length", "transfer-encoding", "connection", "keep-alive", "te", "trailer", "upgrade"}
)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class PrefillForbidden(Rejection):
    """The named prefill target is not on the allow list (403); nothing was sent anywhere."""

    status = 403
    error_type = "permission_error"
    code = "prefill_target_forbidden"


def parse_host_port(value: str) -> tuple[IPAddress, int] | None:
    """``ip:port`` or ``[ipv6]:port`` with a literal address, else ``None`` (names are never resolved)."""
    host, sep, port = value.rpartition(":")
    if not sep:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        return None  # an IPv6 address with a port must be bracketed, or the port is ambiguous
    if "%" in host:
        return None  # zone ids name an interface, not a pod
    # isdigit() alone accepts non-ASCII digits that int() would happily convert.
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return _unmapped(address), int(port)


def format_host_port(address: IPAddress, port: int) -> str:
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


def _unmapped(address: IPAddress) -> IPAddress:
    # ::ffff:10.0.0.1 is 10.0.0.1 on the wire; compare it as such.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class PrefillAllowList:
    """Which prefill targets a sidecar may contact: CIDRs, bare IPs (any port) and exact ``ip:port``."""

    def __init__(self, entries: Iterable[str]) -> None:
        self.networks: list[IPNetwork] = []
        self.endpoints: set[tuple[IPAddress, int]] = set()
        for entry in entries:
            self._add(entry.strip(), entry)

    def _add(self, text: str, entry: str) -> None:
        if "/" in text:
            try:
                network = ipaddress.ip_network(text)
            except ValueError as exc:
                raise ValueError(f"invalid prefill allow entry {entry!r}: {exc}") from None
            self.networks.append(network)
            return
        bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
        try:
            address = ipaddress.ip_address(bare)
        except ValueError:
            pass
        else:
            if "%" in bare:
                raise ValueError(f"invalid prefill allow entry {entry!r}: zone ids are not supported")
            address = _unmapped(address)
            self.networks.append(ipaddress.ip_network(address))
            return
        host_port = parse_host_port(text)
        if host_port is None:
            raise ValueError(
                f"invalid prefill allow entry {entry!r}: expected a CIDR, an IP address or ip:port "
                "([v6]:port); host names are not accepted"
            )
        self.endpoints.add(host_port)

    def permits(self, host_port: str) -> bool:
        parsed = parse_host_port(host_port.strip())
        if parsed is None:
            return False
        address, port = parsed
        return (address, port) in self.endpoints or any(address in net for net in self.networks)

    def __bool__(self) -> bool:
        return bool(self.networks or self.endpoints)


def first_prefiller(values: list[str]) -> str | None:
    """The first entry of a (possibly repeated, possibly comma-separated) prefill header."""
    for value in values:
        for item in value.split(","):
            item = item.strip()
            if item.lower().startswith("http://"):
                item = item[len("http://") :].rstrip("/")
            if item:
                return item
    return None


class Sidecar:
    """aiohttp handlers: the P/D exchange for completions, a reverse proxy for everything else."""

    def __init__(
        self,
        decode_address: str,
        exchange: TwoLegExchange,
        session: aiohttp.ClientSession,
        allow: PrefillAllowList,
        max_body_bytes: int,
    ) -> None:
        self.decode_address = decode_address
        self.exchange = exchange
        self.session = session
        self.allow = allow
        self.max_body_bytes = max_body_bytes

    def app(self) -> web.Application:
        # +1 so a body of exactly the limit is read, and one byte more is ours to reject as JSON.
        app = web.Application(client_max_size=self.max_body_bytes + 1)
        for path in sorted(COMPLETION_PATHS):
            app.router.add_post(path, self.completions)
        app.router.add_route("*", "/{tail:.*}", self.passthrough)
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._completions(request)
        except Rejection as rejection:
            return _rejection_response(rejection)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        target = first_prefiller(request.headers.getall(PREFILLER_HEADER, []))
        address: str | None = None
        if target is not None:
            parsed = parse_host_port(target) if self.allow.permits(target) else None
            if parsed is None:
                shown = target[:80]  # client-controlled: bounded in logs and answers
                log.warning("request %s: prefill target %r is not allowed; refused", request_id, shown)
                raise PrefillForbidden(f"prefill target {shown!r} is not allowed by this sidecar")
            address = format_host_port(*parsed)  # canonical, so nothing odd reaches the URL
        raw = await self._read_body(request)
        # Checked on the local path too: a client-chosen remote_host would make the engine pull KV from it.
        body = client_json(raw)
        headers = {
            k: v
            for k, v in request.headers.items()
            if (name := k.lower()) not in _HOP_HEADERS
            and name not in _DROPPED_REQUEST_HEADERS
            and name not in _LEG_OWN_HEADERS
        }
        headers["X-Request-Id"] = request_id
        leg = Leg(request.path, headers)
        outcome = "local"
        data = raw
        if address is not None:
            try:
                kv_params = await self.exchange.prefill(address, leg, body)
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
                data = decode_body(body, kv_params)

        async def start_response(upstream: aiohttp.ClientResponse) -> web.StreamResponse:
            response = web.StreamResponse(status=upstream.status)
            for name in ("Content-Type", "Cache-Control"):
                if name in upstream.headers:
                    response.headers[name] = upstream.headers[name]
            response.headers["X-Request-Id"] = request_id
            response.headers[PREFILL_OUTCOME_HEADER] = outcome
            await response.prepare(request)
            return response

        try:
            return await self.exchange.decode(self.decode_address, leg, data, start_response, _noop)
        except UpstreamError as exc:
            log.warning(
                "request %s: decode engine %s failed: %s", request_id, self.decode_address, exc.reason
            )
            raise UpstreamFailed(f"the local decode engine failed: {exc.reason}") from None

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise BodyTooLarge(f"request body is {request.content_length} bytes; the limit is {limit}")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise BodyTooLarge(f"request body is over the limit of {limit} bytes") from None
        if len(raw) > limit:
            raise BodyTooLarge(f"request body is {len(raw)} bytes; the limit is {limit}")
        return raw

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """Reverse-proxy any other request to the local engine: status, headers and body unchanged."""
        try:
            data = await self._read_body(request) if request.body_exists else None
        except Rejection as rejection:
            return _rejection_response(rejection)
        headers = [
            (k, v)
            for k, v in request.headers.items()
            if (name := k.lower()) not in _PASSTHROUGH_HOP_HEADERS and name not in _DROPPED_REQUEST_HEADERS
        ]
        try:
            upstream = await self.session.request(
                request.method,
                # rel_url, not raw_path: an absolute-form target must not pick the host. encoded=True
                # keeps the client's percent-encoding byte for byte.
                URL(f"http://{self.decode_address}{request.rel_url.raw_path_qs}", encoded=True),
                data=data,
                headers=headers,
                allow_redirects=False,
                timeout=self.exchange.timeout,
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("%s %s to %s failed: %s", request.method, request.path, self.decode_address, exc)
            return _rejection_response(UpstreamFailed(f"the local engine failed: {type(exc).__name__}"))
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in _HOP_RESPONSE_HEADERS:
                    response.headers.add(name, value)
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


def _rejection_response(rejection: Rejection) -> web.Response:
    return web.Response(
        status=rejection.status,
        body=rejection.body(),
        headers={**rejection.headers(), "Content-Type": "application/json"},
    )


def _noop() -> None:
    pass


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
    ) -> None:
        # Validated here, so a bad --allow fails before anything listens.
        self.allow = PrefillAllowList(allow)
        self.decode_address = decode_address
        self.host = host
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_body_bytes = max_body_bytes
        self.drain_timeout_s = drain_timeout_s
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
        exchange = TwoLegExchange(session, self.connect_timeout_s, self.request_timeout_s)
        sidecar = Sidecar(self.decode_address, exchange, session, self.allow, self.max_body_bytes)
        # handler_cancellation: a client that hangs up cancels the engine calls, which frees their KV.
        runner = web.AppRunner(
            sidecar.app(),
            handler_cancellation=True,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=self.drain_timeout_s,
        )
        await runner.setup()
        stack.push_async_callback(runner.cleanup)  # runs before the session closes: streams drain first
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        await site.start()
        self.port = runner.addresses[0][1]
        log.info(
            "sidecar listening on http://%s:%s in front of decode engine %s",
            self.host,
            self.port,
            self.decode_address,
        )

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stack.aclose()
