"""A small HTTP/2 gRPC server on the asyncio loop, for the ext_proc, health and KEDA listeners.

Why not ``grpc.aio``: Envoy opens one gRPC stream per HTTP request, and a ``grpc.aio`` stream
costs ~0.5 ms of CPU in this process (task, context, completion-queue hops per message) against
~0.2 ms for the routing itself; at the InferencePool's request rates that is the router's ceiling.
This server handles a call's messages synchronously inside ``data_received`` and writes all the
frames a read produced in one ``transport.write``, which also saves Envoy a wake-up per frame.

Scope: HTTP/2 with prior knowledge, cleartext or over TLS with ALPN ``h2`` (what Envoy's
``envoy_grpc`` client, grpc-go probes and grpcio speak), unary and streaming calls,
identity-encoded messages. Whatever is outside the scope gets the error the specs name:
``GOAWAY`` (connection errors), ``RST_STREAM`` (refused or broken streams), ``grpc-status``
trailers (unknown method, compressed or oversized messages).

The server accepts sockets, sniffs TLS from cleartext and owns the set of connections (their
cap, timeouts and shutdown); ``connection`` is the protocol of one connection and its calls,
``frames`` the wire format, ``limits`` every bound a peer can hit (``H2Limits``) and ``budgets``
the abuse budgets among them.

A method is served by a factory ``(Call) -> CallHandler``; the handler's callbacks never await
(one that must, e.g. to tokenize, starts a task and answers through ``Call`` later).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import time
from collections.abc import Callable, Mapping
from ssl import SSLContext
from typing import Any

from router.transport.h2.connection import Connection, HandlerFactory
from router.transport.h2.frames import (
    FRAME_HEAD,
    SETTING,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    U32,
    WINDOW_UPDATE,
)
from router.transport.h2.limits import DEFAULT_WINDOW, H2Limits
from router.transport.listen import binding

log = logging.getLogger(__name__)

_TLS_HANDSHAKE_RECORD = b"\x16"  # the first byte of a TLS ClientHello (a handshake record)


class H2GrpcServer:
    """Listens on ``host:port`` and serves ``handlers`` (``/package.Service/Method`` -> factory).

    ``limits`` bounds what each peer can make the server spend (``H2Limits``);
    ``max_concurrent_streams`` and ``max_message_bytes``, when given, override its fields of the
    same name.
    """

    def __init__(
        self,
        handlers: Mapping[str, HandlerFactory],
        *,
        limits: H2Limits | None = None,
        max_concurrent_streams: int | None = None,
        max_message_bytes: int | None = None,
    ) -> None:
        limits = limits or H2Limits()
        overrides = {
            name: value
            for name, value in (
                ("max_concurrent_streams", max_concurrent_streams),
                ("max_message_bytes", max_message_bytes),
            )
            if value is not None
        }
        self.limits = dataclasses.replace(limits, **overrides) if overrides else limits
        self.handlers = dict(handlers)
        limits = self.limits
        self.stream_window = limits.stream_window
        self.connection_window = limits.effective_connection_window
        self.max_call_send = limits.effective_call_send_bytes
        # Refills go out at half a window: one WINDOW_UPDATE per half window of traffic.
        self.stream_refill_at = self.stream_window // 2
        self.connection_refill_at = self.connection_window // 2
        settings = b"".join(
            SETTING.pack(k, v)
            for k, v in (
                (SETTINGS_MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams),
                (SETTINGS_INITIAL_WINDOW_SIZE, self.stream_window),
                (SETTINGS_MAX_FRAME_SIZE, limits.max_frame_size),
                (SETTINGS_MAX_HEADER_LIST_SIZE, limits.max_header_list_size),
            )
        )
        preamble = FRAME_HEAD.pack(len(settings) << 8 | SETTINGS, 0, 0) + settings
        if self.connection_window > DEFAULT_WINDOW:
            increment = U32.pack(self.connection_window - DEFAULT_WINDOW)
            preamble += FRAME_HEAD.pack(4 << 8 | WINDOW_UPDATE, 0, 0) + increment
        self.preamble = preamble  # what every connection sends first
        self.connections: dict[Connection, None] = {}  # serving, oldest first
        self.closing: dict[Connection, asyncio.BaseTransport] = {}  # GOAWAY sent, socket lingering
        self._listeners: list[socket.socket] = []
        self._accepters: list[asyncio.Task[None]] = []
        self._opening: set[asyncio.Task[None]] = set()  # accepted, first byte (or handshake) awaited
        self._sweeper: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._warned_at = float("-inf")
        self._unwarned = 0

    @property
    def max_concurrent_streams(self) -> int:
        return self.limits.max_concurrent_streams

    @property
    def max_message_bytes(self) -> int:
        return self.limits.max_message_bytes

    async def start(
        self,
        host: str,
        port: int,
        *,
        ssl: SSLContext | None = None,
        cleartext: bool = True,
        what: str = "gRPC listener",
    ) -> int:
        """Listen on ``host:port``; returns the bound port.

        With ``ssl`` (a server context offering ALPN ``h2``, see ``tls.py``) connections are served
        over TLS, and with ``cleartext`` as well, h2c on the same port: each connection's first
        byte tells which (a TLS record starts with 0x16, the HTTP/2 preface with ``P``), so a
        gateway configured either way is served. A connection speaking the other protocol than
        the port serves is closed with a log line that says so. An address that cannot be bound
        raises ``ListenError`` naming ``what``.
        """
        if ssl is None and not cleartext:
            raise ValueError("a listener needs TLS, cleartext or both")
        loop = asyncio.get_running_loop()
        try:
            with binding(what, host, port):
                # "" (as asyncio reads it): every interface, IPv4 and IPv6.
                infos = await loop.getaddrinfo(
                    host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
                )
                # Every address the host names ("localhost": ::1 and 127.0.0.1), as asyncio's
                # servers do; with port 0, the others take the port the first one got.
                addresses = list(dict.fromkeys(infos))
                for family, kind, proto, _, address in addresses:
                    if self._listeners:
                        address = (address[0], self._listeners[0].getsockname()[1], *address[2:])
                    self._listeners.append(self._listen(family, kind, proto, address, len(addresses) > 1))
        except BaseException:
            for listener in self._listeners:
                listener.close()
            self._listeners.clear()
            raise
        self._accepters = [
            loop.create_task(self._accept(listener, ssl, cleartext)) for listener in self._listeners
        ]
        self._sweeper = loop.create_task(self._sweep())
        return self._listeners[0].getsockname()[1]

    def _listen(
        self, family: int, kind: int, proto: int, address: tuple[Any, ...], v6_only: bool
    ) -> socket.socket:
        """A listening socket; ``v6_only`` when an IPv4 socket takes the same port beside it (a
        lone "::" stays dual-stack, so IPv4 peers reach it too)."""
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6_only))
            listener.bind(address)
            listener.listen(self.limits.listen_backlog)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        return listener

    async def _accept(self, listener: socket.socket, ssl: SSLContext | None, cleartext: bool) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # EMFILE and the like: the connection stays in the backlog
                self.warn(f"accept failed: {exc}")
                await asyncio.sleep(0.1)
                continue
            if len(self._opening) >= self.limits.max_connections:
                # Connections that have not sent a byte yet are not in ``connections``: bound them too.
                self.warn(f"{len(self._opening)} connections still opening: refusing a new one")
                sock.close()
                continue
            task = loop.create_task(self._open(sock, ssl, cleartext))
            self._opening.add(task)
            task.add_done_callback(self._opening.discard)
            # sock_accept returns at once while the backlog holds connections: without a turn
            # given back here, a burst of thousands would be taken in one long loop turn.
            await asyncio.sleep(0)

    async def _open(self, sock: socket.socket, ssl: SSLContext | None, cleartext: bool) -> None:
        """Wait for the connection's first byte, then serve it over TLS or cleartext."""
        loop = asyncio.get_running_loop()
        timeout = self.limits.handshake_timeout_s
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            first = await asyncio.wait_for(_peek(loop, sock), timeout)
            tls = first == _TLS_HANDSHAKE_RECORD
            refused = (
                "closed before sending a byte"  # a port probe: not worth a warning
                if not first
                else "a TLS client on a cleartext port (turn TLS on for this listener, or off at the client)"
                if tls and ssl is None
                else "a cleartext (h2c) client on a TLS-only port (accept_cleartext is off)"
                if not tls and not cleartext
                else None
            )
            if refused is not None:
                if first:
                    self.warn(refused)
                sock.close()
                return
            await loop.connect_accepted_socket(
                lambda: Connection(self),
                sock,
                ssl=ssl if tls else None,
                ssl_handshake_timeout=timeout if tls else None,
            )
        except TimeoutError:
            self.warn(f"no byte or no TLS handshake within {timeout:g} s of connecting")
            sock.close()
        except OSError as exc:  # ssl.SSLError is one
            self.warn(f"connection failed before HTTP/2: {exc}")
            sock.close()
        except asyncio.CancelledError:  # stop(): the socket is ours until a transport took it
            sock.close()
            raise

    async def _sweep(self) -> None:
        """Handshake and idle timeouts, looked at a few times per the shorter of the two."""
        limits = self.limits
        interval = max(0.01, min(limits.idle_timeout_s, limits.handshake_timeout_s) / 4)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            now = loop.time()
            for conn in list(self.connections):
                conn.sweep(now)

    def make_room(self) -> bool:
        """At the connection cap: close the idle connection least worth keeping, if there is one.

        One that never opened a stream goes first (oldest first: what a connection flood leaves),
        then the one idle longest. Connections with calls open, or that opened streams since the
        last sweep, are never closed for a newcomer.
        """
        victim: Connection | None = None
        for conn in self.connections:  # oldest first
            if conn.calls or conn.transport is None:
                continue
            if not conn.last_stream_id:
                victim = conn
                break
            if conn.last_stream_id != conn.swept_stream_id:
                continue  # it opened streams since the last sweep: in use, however briefly idle now
            if victim is None or conn.idle_since < victim.idle_since:
                victim = conn
        if victim is None:
            return False
        victim.go_away("connection limit")
        return True

    def forget(self, conn: Connection, transport: asyncio.BaseTransport) -> None:
        """``conn`` stopped serving; its socket lingers until the peer closes or the linger ends."""
        self.connections.pop(conn, None)
        self.closing[conn] = transport
        self._changed.set()

    def connection_closed(self, conn: Connection) -> None:
        self.connections.pop(conn, None)
        self.closing.pop(conn, None)
        self._changed.set()

    def warn(self, reason: str) -> None:
        """Log why a connection was closed, at most once a second (an attack is many connections)."""
        now = time.monotonic()
        if now - self._warned_at < 1.0:
            self._unwarned += 1
            return
        more = f" (and {self._unwarned} more since the last such warning)" if self._unwarned else ""
        self._warned_at, self._unwarned = now, 0
        log.warning("h2grpc: closing connection: %s%s", reason, more)

    async def _until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not done():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return True

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop listening, let open calls finish for ``grace_s`` seconds, then cancel the rest."""
        if not self._listeners:
            return
        for accepter in self._accepters:
            accepter.cancel()
        await asyncio.gather(*self._accepters, return_exceptions=True)
        self._accepters.clear()
        for listener in self._listeners:
            listener.close()
        opening = list(self._opening)
        for task in opening:
            task.cancel()
        await asyncio.gather(*opening, return_exceptions=True)
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for conn in list(self.connections):
            conn.go_away()
        if self.connections and grace_s:
            await self._until(lambda: not self.connections, grace_s)
        for conn in list(self.connections):
            conn.abort_calls()
        # Our first GOAWAY went out before the grace period: lingering sockets need not wait more.
        await asyncio.sleep(0)  # the last frames reach the kernel before the sockets go
        for transport in list(self.closing.values()):
            transport.abort()
        self._listeners.clear()


async def _peek(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    """The socket's first byte, left unread (b"" when the peer closed first)."""
    while True:
        try:
            return sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            pass
        readable = loop.create_future()
        fd = sock.fileno()
        loop.add_reader(fd, _resolve, readable)
        try:
            await readable
        finally:
            loop.remove_reader(fd)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
