"""The engine legs' HTTP client: one small HTTP/1.1 client with keep-alive connections, or the
shared aiohttp session behind the same few calls.

A leg is one POST (or a GET/DELETE of a stored answer) to an engine on ``http://<address>``, its
answer read whole or streamed piece by piece. aiohttp's client does that with every feature a
general client needs (URL objects, cookie and redirect handling, tracing hooks, per-request timer
objects), and they cost: the proxy with its legs through this client spent 0.65× the CPU per
request of the same proxy through aiohttp's (``python -m loadtests.bench.routers --routers
pd-router,pd-router+aiohttp-legs``; docs/benchmarks.md). The proxy and the sidecar run every leg
through ``Http1Client`` (``proxy.http_client: builtin``, the default), or through the aiohttp
session (``aiohttp``; also the gate's canaries, and the virtual-time benchmarks, whose in-process
network stands in for that session).

Both raise the same three errors, so the exchange has one vocabulary: ``UpstreamConnectError``
(nothing reached the engine: refused, unreachable, the connect timeout), ``UpstreamIOError`` (the
exchange broke after that: a reset, a cut or malformed answer) and ``TimeoutError`` (the leg's
total time ran out).

What ``Http1Client`` speaks, per RFC 9112: a response framed by ``Content-Length``, by ``chunked``
transfer coding (trailers read and dropped) or by the connection's end; interim 1xx answers
skipped; no body for HEAD, 204 and 304. A connection goes back to its engine's idle list only
after a whole body of an HTTP/1.1 answer without ``Connection: close``, and an idle one is reused
for at most ``keepalive_s`` (uvicorn, vLLM's server, closes idle connections after 5 s). A reused
connection that the engine closed just as the request went out (no byte of an answer) is retried
once on a new one: the request never reached the engine's handler.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Mapping
from types import TracebackType
from typing import Protocol
from urllib.parse import quote

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

HEAD_LIMIT = 64 * 1024  # an answer's status line and headers; an engine's are a few hundred bytes
READ_SIZE = 64 * 1024
DEFAULT_KEEPALIVE_S = 4.0  # under uvicorn's default 5 s, so the engine is not the one to close
MAX_IDLE_PER_ENGINE = 256
# A whole (not streamed) answer read into memory: far above any completion's, logprobs included.
MAX_ANSWER_BYTES = 256 * 1024 * 1024


class UpstreamConnectError(Exception):
    """Nothing reached the engine: the connection was refused, unreachable or timed out."""


class UpstreamIOError(Exception):
    """The exchange broke after the connection: reset, cut, or an answer that is not HTTP/1.1."""


class Answer(Protocol):
    """An engine's answer: status and headers now, the body read whole or piece by piece.
    ``async with`` it: leaving gives its connection back (or closes it, if the body was not read
    to its end)."""

    status: int
    headers: CIMultiDictProxy[str]

    @property
    def content_type(self) -> str: ...

    async def read(self) -> bytes: ...

    async def readany(self) -> bytes:
        """The next piece of the body; ``b""`` at its end."""
        ...

    async def __aenter__(self) -> Answer: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class EngineClient(Protocol):
    """Sends one leg to an engine (``address`` is ``host:port``)."""

    async def send(
        self, method: str, address: str, path: str, headers: Mapping[str, str], body: bytes | None
    ) -> Answer: ...

    async def close(self) -> None: ...


async def read_whole(answer: Answer) -> bytes:
    """The rest of ``answer``'s body, at most ``MAX_ANSWER_BYTES`` (more raises ``UpstreamIOError``;
    leaving the answer then closes its connection)."""
    pieces, size = [], 0
    while piece := await answer.readany():
        size += len(piece)
        if size > MAX_ANSWER_BYTES:
            raise UpstreamIOError(f"the engine's answer is over {MAX_ANSWER_BYTES} bytes")
        pieces.append(piece)
    return b"".join(pieces)


# -- the built-in client ---------------------------------------------------------------------------


class _Connection:
    __slots__ = ("address", "idle_since", "reader", "writer")

    def __init__(self, address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.address = address
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def usable(self, now: float, keepalive_s: float) -> bool:
        return (
            now - self.idle_since < keepalive_s
            and not self.reader.at_eof()
            and not self.writer.transport.is_closing()
        )

    def close(self) -> None:
        self.writer.transport.abort()  # an engine sees the hang-up at once (and frees the request's KV)


class Http1Client:
    """HTTP/1.1 to engines over keep-alive connections, one idle list per engine."""

    def __init__(
        self,
        connect_timeout_s: float,
        request_timeout_s: float,
        *,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        max_idle_per_engine: int = MAX_IDLE_PER_ENGINE,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.keepalive_s = keepalive_s
        self.max_idle_per_engine = max_idle_per_engine
        # Per engine, oldest first: a leg takes the newest, a sweep closes the expired from the front.
        self._idle: dict[str, deque[_Connection]] = {}
        self._swept = time.monotonic()  # when every engine's expired ones were last closed
        self._closed = False

    async def send(
        self, method: str, address: str, path: str, headers: Mapping[str, str], body: bytes | None
    ) -> Answer:
        if self._closed:
            raise UpstreamConnectError("the client is closed")
        request = _request_bytes(method, address, path, headers, body)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        conn = self._idle_connection(address)
        retry = conn is not None  # a kept connection the engine may have closed as the request went out
        while True:
            if conn is None:
                conn = await self._connect(address)
            try:
                return await self._exchange(conn, method, request, deadline)
            except _StaleConnection:
                if not retry:
                    raise UpstreamIOError("the engine closed the connection without answering") from None
                retry, conn = False, None  # it never read the request: once more, on a new connection

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def _idle_connection(self, address: str) -> _Connection | None:
        conns = self._idle.get(address)
        now = time.monotonic()
        while conns:
            conn = conns.pop()
            if conn.usable(now, self.keepalive_s):
                return conn
            conn.close()
        return None

    def keep(self, conn: _Connection) -> None:
        """A connection whose answer was read whole: idle, for the next leg to the same engine."""
        if self._closed:
            conn.close()
            return
        now = time.monotonic()
        if now - self._swept >= self.keepalive_s:
            self._sweep(now)
        conns = self._idle.get(conn.address)
        if conns is None:
            conns = self._idle[conn.address] = deque()
        if len(conns) >= self.max_idle_per_engine:
            conn.close()
            return
        conn.idle_since = now
        conns.append(conn)

    def _sweep(self, now: float) -> None:
        """Every engine's expired idle connections closed (the engine closed them: half-open until
        then), and the engines left with none forgotten: one that left the pool (pods come back on
        new addresses) is never asked again. At most every ``keepalive_s``, when one is kept."""
        self._swept = now
        for address, conns in list(self._idle.items()):
            while conns and now - conns[0].idle_since >= self.keepalive_s:
                conns.popleft().close()
            if not conns:
                del self._idle[address]

    async def _connect(self, address: str) -> _Connection:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")  # an IPv6 literal's brackets
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(host, int(port), limit=HEAD_LIMIT)
        except TimeoutError:
            raise UpstreamConnectError(f"connect timed out after {self.connect_timeout_s:g} s") from None
        except (OSError, ValueError) as exc:
            raise UpstreamConnectError(f"connect failed: {exc}") from None
        return _Connection(address, reader, writer)

    async def _exchange(self, conn: _Connection, method: str, request: bytes, deadline: float) -> Http1Answer:
        answer = Http1Answer(self, conn, method == "HEAD", deadline)
        try:
            try:
                conn.writer.write(request)
                if len(request) > READ_SIZE:
                    await conn.writer.drain()
            except (ConnectionResetError, BrokenPipeError):  # the engine had closed it
                raise _StaleConnection from None
            except OSError as exc:
                raise UpstreamIOError(f"sending the leg failed: {exc}") from None
            await answer.read_head()  # maps its own read errors (a timeout is an OSError too)
        except BaseException:
            answer.abandon()
            raise
        return answer


class Dechunker:
    """The ``chunked`` transfer coding (RFC 9112, 7.1) decoded from bytes as they arrive: ``feed``
    returns the data they complete; ``done`` after the last chunk and its trailers (dropped);
    ``leftover`` when bytes followed the end. A malformed body raises ``ValueError``."""

    __slots__ = ("_buffer", "_left", "_state", "done", "leftover")

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._state = _SIZE
        self._left = 0
        self.done = False
        self.leftover = False

    def feed(self, raw: bytes) -> bytes:
        buffer = self._buffer
        buffer += raw
        out: list[bytes] = []
        pos, end = 0, len(buffer)
        while pos < end and not self.done:
            state = self._state
            if state == _DATA:
                take = min(self._left, end - pos)
                out.append(bytes(buffer[pos : pos + take]))
                pos += take
                self._left -= take
                if not self._left:
                    self._state = _CRLF
            elif state == _CRLF:
                if end - pos < 2:
                    break
                if buffer[pos : pos + 2] != b"\r\n":
                    raise ValueError("a chunk did not end with CRLF")
                pos += 2
                self._state = _SIZE
            else:  # a size line, or a trailer line
                eol = buffer.find(b"\r\n", pos)
                if eol < 0:
                    if end - pos > MAX_CHUNK_LINE:
                        raise ValueError(f"a chunk line over {MAX_CHUNK_LINE} bytes")
                    break
                line = bytes(buffer[pos:eol])
                pos = eol + 2
                if state == _TRAILER:
                    self.done = not line  # trailers are not ours to forward; an empty line ends them
                    continue
                size_text = line.split(b";", 1)[0].strip()
                if not size_text or size_text.lstrip(_HEX):
                    raise ValueError(f"bad chunk size {size_text[:20]!r}")
                self._left = int(size_text, 16)
                self._state = _DATA if self._left else _TRAILER
        del buffer[:pos]
        self.leftover = self.done and bool(buffer)
        return b"".join(out)


_SIZE, _DATA, _CRLF, _TRAILER = range(4)
_HEX = b"0123456789abcdefABCDEF"
MAX_CHUNK_LINE = 8192


class _StaleConnection(Exception):
    """The connection ended before a single byte of the answer."""


class Http1Answer:
    """One answer on one connection; the body is read through ``readany`` / ``read``."""

    __slots__ = (
        "_client",
        "_conn",
        "_dechunker",
        "_done",
        "_expired",
        "_keep",
        "_mode",
        "_remaining",
        "_timer",
        "head_only",
        "headers",
        "status",
    )

    def __init__(self, client: Http1Client, conn: _Connection, head_only: bool, deadline: float) -> None:
        self._client = client
        self._conn: _Connection | None = conn
        self.head_only = head_only
        self.status = 0
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
        self._mode = ""  # "length", "chunked" or "eof"
        self._remaining = 0
        self._dechunker = Dechunker()
        self._done = False
        self._keep = False
        self._expired = False
        # One timer for the whole leg (aiohttp's ``total``): it cuts the connection, and the read
        # that was waiting raises ``TimeoutError``.
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_at(deadline, self._expire)

    @property
    def content_type(self) -> str:
        value = self.headers.get("Content-Type", "application/octet-stream")
        return value.partition(";")[0].strip().lower()

    def _expire(self) -> None:
        self._expired = True
        self._timer = None
        if self._conn is not None:
            self._conn.close()

    def _failed(self, what: str, exc: BaseException | None = None) -> Exception:
        """The error to raise for a broken read: the timeout's, if it cut it."""
        self.abandon()
        if self._expired:
            return TimeoutError(f"the engine's answer took longer than {self._client.request_timeout_s:g} s")
        detail = f": {type(exc).__name__}" if exc is not None else ""
        return UpstreamIOError(f"{what}{detail}")

    async def read_head(self) -> None:
        conn = self._conn
        assert conn is not None
        reader = conn.reader
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if not exc.partial and not self._expired:
                    self.abandon()
                    raise _StaleConnection from None
                raise self._failed("the engine's answer ended inside its headers") from None
            except asyncio.LimitOverrunError:
                raise self._failed(f"the engine's answer headers are over {HEAD_LIMIT} bytes") from None
            except (ConnectionResetError, BrokenPipeError):
                if self._expired:
                    raise self._failed("") from None
                self.abandon()  # reset before a whole head: an engine closing an idle connection
                raise _StaleConnection from None
            except OSError as exc:
                raise self._failed("reading the engine's answer failed", exc) from None
            status, headers, http11 = _parse_head(head)
            if 100 <= status < 200:
                if status == 101:
                    raise self._failed("the engine switched protocols")
                continue  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            break
        self.status = status
        self.headers = CIMultiDictProxy(headers)
        self._keep = http11 and "close" not in _tokens(headers.getall("Connection", []))
        codings = _tokens(headers.getall("Transfer-Encoding", []))
        lengths = {v.strip() for v in headers.getall("Content-Length", [])}
        if self.head_only or status in (204, 304):
            self._mode, self._done = "length", True
        elif codings:
            if codings[-1] != "chunked":
                self._mode, self._keep = "eof", False
            else:
                self._mode = "chunked"
                if lengths:  # both framings: the coding wins, and the connection is not trusted again
                    self._keep = False
        elif lengths:
            if len(lengths) > 1 or not all(v.isdigit() for v in lengths):
                raise self._failed(f"the engine's answer has an invalid Content-Length {sorted(lengths)}")
            self._mode, self._remaining = "length", int(lengths.pop())
            self._done = self._remaining == 0
        else:
            self._mode, self._keep = "eof", False
        if self._done:
            self._finish()

    async def readany(self) -> bytes:
        if self._done:
            return b""
        conn = self._conn
        if conn is None:
            raise self._failed("the answer was abandoned")
        reader = conn.reader
        try:
            if self._mode == "length":
                data = await reader.read(min(self._remaining, READ_SIZE))
                if not data:
                    raise self._failed(f"the engine's answer was cut {self._remaining} bytes short")
                self._remaining -= len(data)
                if not self._remaining:
                    self._finish()
                return data
            if self._mode == "chunked":
                return await self._read_chunked(reader)
            data = await reader.read(READ_SIZE)
            if not data:
                if self._expired:
                    raise self._failed("")
                self._finish()
            return data
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise self._failed("reading the engine's answer failed", exc) from None

    async def _read_chunked(self, reader: asyncio.StreamReader) -> bytes:
        # Decoded from whatever arrived, one read per arrival: three awaits per chunk (its size line,
        # its data, its CRLF) cost a streamed answer more than aiohttp's C parser does.
        dechunker = self._dechunker
        while True:
            raw = await reader.read(READ_SIZE)
            if not raw:
                raise self._failed("the engine's answer was cut inside its chunked body")
            try:
                data = dechunker.feed(raw)
            except ValueError as exc:
                raise self._failed(str(exc)) from None
            if dechunker.done:
                self._keep = self._keep and not dechunker.leftover  # bytes after the end: not trusted
                self._finish()
                return data
            if data:
                return data

    async def read(self) -> bytes:
        return await read_whole(self)

    def _finish(self) -> None:
        """The body's last byte is read: the connection goes back to its idle list (or closes)."""
        self._done = True
        self._cancel_timer()
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._keep and not self._expired:
            self._client.keep(conn)
        else:
            conn.close()

    def abandon(self) -> None:
        """Close the connection (the body is not read to its end: it cannot carry another answer)."""
        self._cancel_timer()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def __aenter__(self) -> Http1Answer:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._done:
            self.abandon()


def _request_bytes(
    method: str, address: str, path: str, headers: Mapping[str, str], body: bytes | None
) -> bytes:
    lines = [f"{method} {_target(path)} HTTP/1.1\r\nHost: {address}\r\n"]
    for name, value in headers.items():
        lower = name.lower()
        if lower in _OWN_HEADERS:
            continue
        if any(c in name or c in value for c in "\r\n\0") or not name or ":" in name:
            raise UpstreamIOError(f"header {name[:40]!r} cannot be sent")
        lines.append(f"{name}: {value}\r\n")
    if body is not None:
        lines.append(f"Content-Length: {len(body)}\r\n")
    elif method not in ("GET", "HEAD", "DELETE"):
        lines.append("Content-Length: 0\r\n")
    lines.append("\r\n")
    # Header bytes as the listener decoded them (UTF-8, undecodable bytes kept as surrogates).
    head = "".join(lines).encode("utf-8", "surrogateescape")
    return head + body if body else head


def _target(path: str) -> str:
    """``path`` as a request target: what a request line cannot carry (spaces, control characters,
    non-ASCII) percent-encoded. The listeners hand over decoded paths, so a client's ``%0D%0A``
    arrives here as a line break, which must not end the request line."""
    if path.isascii() and path.isprintable() and " " not in path:
        return path
    return quote(path, safe=_VISIBLE_ASCII)


_VISIBLE_ASCII = "".join(chr(c) for c in range(0x21, 0x7F))


# Framing is this client's to write: a client's own Content-Length or Transfer-Encoding could
# disagree with the body sent.
_OWN_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "upgrade"}
)


def _parse_head(head: bytes) -> tuple[int, CIMultiDict[str], bool]:
    """Status, headers and whether it is HTTP/1.1, from ``head`` (up to and with the blank line)."""
    lines = head[:-4].split(b"\r\n")
    status_line = lines[0]
    version, _, rest = status_line.partition(b" ")
    code = rest[:3]
    if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise UpstreamIOError(f"not an HTTP/1.x answer: {status_line[:40]!r}")
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            raise UpstreamIOError(f"malformed header line {line[:40]!r}")
        headers.add(name.decode("latin-1"), value.strip().decode("latin-1"))
    return int(code), headers, version == b"HTTP/1.1"


def _tokens(values: list[str]) -> list[str]:
    return [token.strip().lower() for value in values for token in value.split(",") if token.strip()]


# -- the aiohttp session behind the same calls -----------------------------------------------------


def session_timeout(connect_timeout_s: float, request_timeout_s: float) -> aiohttp.ClientTimeout:
    """A leg's limits for the aiohttp session: the whole leg, and its connect."""
    return aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)


class SessionClient:
    """The legs through an ``aiohttp.ClientSession`` (or the in-process network's stand-in)."""

    def __init__(
        self, session: aiohttp.ClientSession, connect_timeout_s: float, request_timeout_s: float
    ) -> None:
        self.session = session
        self.timeout = session_timeout(connect_timeout_s, request_timeout_s)

    async def send(
        self, method: str, address: str, path: str, headers: Mapping[str, str], body: bytes | None
    ) -> Answer:
        try:
            response = await self.session.request(
                method, f"http://{address}{path}", data=body, headers=dict(headers), timeout=self.timeout
            )
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamConnectError(f"connect failed: {exc.os_error or exc}") from None
        except aiohttp.ClientError as exc:
            raise UpstreamIOError(type(exc).__name__) from None
        return SessionAnswer(response)

    async def close(self) -> None:
        pass  # the session is its owner's to close


class SessionAnswer:
    __slots__ = ("_response", "headers", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers = response.headers

    @property
    def content_type(self) -> str:
        return self._response.content_type

    async def read(self) -> bytes:
        return await read_whole(self)

    async def readany(self) -> bytes:
        try:
            return await self._response.content.readany()
        except aiohttp.ClientError as exc:
            raise UpstreamIOError(f"reading the engine's answer failed: {type(exc).__name__}") from None

    async def __aenter__(self) -> SessionAnswer:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Released, or closed on an error, as ``async with`` the response does.
        await self._response.__aexit__(exc_type, exc, tb)


def engine_client(
    kind: str, session: aiohttp.ClientSession, connect_timeout_s: float, request_timeout_s: float
) -> EngineClient:
    """``builtin``: ``Http1Client``; ``aiohttp``: the legs through ``session``."""
    if kind == "builtin":
        return Http1Client(connect_timeout_s, request_timeout_s)
    if kind == "aiohttp":
        return SessionClient(session, connect_timeout_s, request_timeout_s)
    raise ValueError(f"unknown engine HTTP client {kind!r}: builtin or aiohttp")
