"""A small HTTP/2 gRPC server on the asyncio loop, for the ext_proc and health listeners.

Why not ``grpc.aio``: Envoy opens one gRPC stream per HTTP request, and a ``grpc.aio`` stream
costs ~0.5 ms of CPU in this process (task, context, completion-queue hops per message) against
~0.2 ms for the routing itself; at the InferencePool's request rates that is the router's ceiling.
This server handles a call's messages synchronously inside ``data_received`` and writes all the
frames a read produced in one ``transport.write``, which also saves Envoy a wake-up per frame.

Scope: cleartext HTTP/2 with prior knowledge (what Envoy's ``envoy_grpc`` client, grpc-go probes
and grpcio speak), unary and streaming calls, identity-encoded messages. Flow control is honoured
on the send side (peer windows, ``WINDOW_UPDATE``); on the receive side we advertise large windows
and top them up, and every message is capped at ``max_message_bytes``. Whatever is outside the
scope gets the error the specs name: ``GOAWAY`` (connection errors), ``RST_STREAM`` (refused or
broken streams), ``grpc-status`` trailers (unknown method, compressed or oversized messages).

A method is served by a factory ``(Call) -> CallHandler``; the handler's callbacks never await
(one that must, e.g. to tokenize, starts a task and answers through ``Call`` later).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Callable, Mapping
from typing import Protocol, cast
from urllib.parse import quote

import hpack
import hpack.exceptions

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 section 6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x5, 0x6, 0x7, 0x8, 0x9
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
FRAME_SIZE_ERROR, REFUSED_STREAM, COMPRESSION_ERROR = 0x6, 0x7, 0x9

SETTINGS_HEADER_TABLE_SIZE, SETTINGS_MAX_CONCURRENT_STREAMS = 0x1, 0x3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

# gRPC status codes we send.
OK, INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = 0, 3, 5, 8, 12, 13

DEFAULT_WINDOW = 65_535
MAX_WINDOW = 2**31 - 1
RECV_STREAM_WINDOW = 1 << 24  # what we advertise per stream; bodies are capped far below it anyway
RECV_CONN_WINDOW = 1 << 30
RECV_MAX_FRAME = 1 << 20  # fewer, larger frames from the peer: fewer parse rounds
MAX_HEADER_BLOCK = 64 * 1024
# grpc-message characters we send: percent-encoded (up to 12 bytes each) they still fit the 16 KiB
# frame every peer accepts, and we never split a header block over CONTINUATION frames.
MAX_STATUS_MESSAGE = 1000

_FRAME_HEAD = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")
_MESSAGE_HEAD = struct.Struct(">BI")  # gRPC length prefix: compressed flag, length


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: str, value: str) -> bytes:
    """An HPACK literal header field without indexing (new name, no Huffman): leaves no table state."""
    raw_name, raw_value = name.encode(), value.encode()
    return b"\x00" + _hpack_int(len(raw_name), 7) + raw_name + _hpack_int(len(raw_value), 7) + raw_value


_STATUS_200 = b"\x88"  # static table index 8 is ":status: 200"
# "Dynamic table size update to 0" (RFC 7541 6.3), at the start of our first header block: a peer
# whose SETTINGS_HEADER_TABLE_SIZE is under the default 4096 requires one (nghttp2 in Envoy fails
# the connection otherwise), and at 0 no later SETTINGS can require another. We never index.
_TABLE_SIZE_ZERO = b"\x20"
RESPONSE_HEADERS = _STATUS_200 + _literal("content-type", "application/grpc")
_OK_TRAILERS = _literal("grpc-status", "0")


def trailers_block(code: int, message: str = "") -> bytes:
    if code == OK and not message:
        return _OK_TRAILERS
    block = _literal("grpc-status", str(code))
    if message:
        block += _literal("grpc-message", quote(message[:MAX_STATUS_MESSAGE], safe=" !#$&'()*+,/:;=?@[]~"))
    return block


class CallHandler(Protocol):
    """One call's callbacks; none of them awaits."""

    def on_message(self, message: bytes) -> None: ...

    def on_end(self) -> None:
        """The client half-closed: no more messages will come."""

    def on_cancel(self) -> None:
        """The call is gone before we finished it (RST_STREAM, GOAWAY, connection lost)."""


HandlerFactory = Callable[["Call"], CallHandler]


class Call:
    """The server side of one gRPC call: ``send`` messages, then ``finish`` once."""

    __slots__ = (
        "conn",
        "finished",
        "handler",
        "headers",
        "headers_sent",
        "pending",
        "recv_buffer",
        "recv_unacked",
        "remote_closed",
        "send_window",
        "stream_id",
        "trailers",
    )

    def __init__(self, conn: Connection, stream_id: int, headers: dict[str, str], send_window: int) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.headers = headers
        self.send_window = send_window
        self.handler: CallHandler | None = None
        self.recv_buffer = bytearray()
        self.recv_unacked = 0
        self.headers_sent = False
        self.remote_closed = False
        self.finished = False
        self.pending = bytearray()  # DATA waiting for flow-control window
        self.trailers: bytes | None = None  # trailers waiting behind ``pending``

    def send(self, message: bytes) -> None:
        if self.finished:
            return
        if not self.headers_sent:
            self.headers_sent = True
            self.conn.write_headers(END_HEADERS, self.stream_id, RESPONSE_HEADERS)
        self.pending += _MESSAGE_HEAD.pack(0, len(message))
        self.pending += message
        self.conn.drain(self)

    def finish(self, code: int = OK, message: str = "") -> None:
        """End the call with a gRPC status; later sends and finishes are ignored."""
        if self.finished:
            return
        self.finished = True
        if self.headers_sent:
            self.trailers = trailers_block(code, message)
        else:  # a trailers-only response
            self.headers_sent = True
            self.trailers = RESPONSE_HEADERS + trailers_block(code, message)
        self.conn.drain(self)


class Connection(asyncio.Protocol):
    """One HTTP/2 connection: frames in, calls dispatched, frames out batched per read."""

    def __init__(self, server: H2GrpcServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.preface_seen = False
        self.out: list[bytes] = []
        self.flush_scheduled = False
        self.calls: dict[int, Call] = {}
        self.blocked: set[Call] = set()  # calls with DATA waiting for window
        self.last_stream_id = 0
        self.going_away = False  # we sent GOAWAY: no new calls
        self.decoder = HeaderDecoder()
        self.continuation: tuple[int, int, bytearray] | None = None  # (stream, flags, block so far)
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = 16_384
        self.send_window = DEFAULT_WINDOW
        self.recv_unacked = 0
        self.table_size_sent = False  # see _TABLE_SIZE_ZERO

    # -- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.server.connections.add(self)
        settings = b"".join(
            _SETTING.pack(k, v)
            for k, v in (
                (SETTINGS_MAX_CONCURRENT_STREAMS, self.server.max_concurrent_streams),
                (SETTINGS_INITIAL_WINDOW_SIZE, RECV_STREAM_WINDOW),
                (SETTINGS_MAX_FRAME_SIZE, RECV_MAX_FRAME),
                (SETTINGS_MAX_HEADER_LIST_SIZE, MAX_HEADER_BLOCK),
            )
        )
        self.write_frame(SETTINGS, 0, 0, settings)
        self.write_frame(WINDOW_UPDATE, 0, 0, _U32.pack(RECV_CONN_WINDOW - DEFAULT_WINDOW))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.server.connections.discard(self)
        self._drop_all()
        self.server.connection_closed()

    def pause_writing(self) -> None:
        # The peer is not reading what we write: stop taking new work from it until it does.
        assert self.transport is not None
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        assert self.transport is not None
        self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.flush_scheduled = True  # everything this read produces goes out in one write, below
        buffer = self.buffer
        buffer += data
        if not self.preface_seen:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(bytes(buffer)):
                    self._abort(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self.flush()
                return
            if buffer[: len(PREFACE)] != PREFACE:
                self._abort(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self.flush()
                return
            del buffer[: len(PREFACE)]
            self.preface_seen = True
        position, size = 0, len(buffer)
        try:
            while size - position >= 9 and self.transport is not None:
                head, flags, stream_id = _FRAME_HEAD.unpack_from(buffer, position)
                length, kind = head >> 8, head & 0xFF
                if length > RECV_MAX_FRAME:
                    raise _ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes")
                end = position + 9 + length
                if end > size:
                    break
                payload = bytes(buffer[position + 9 : end])
                position = end
                self._on_frame(kind, flags, stream_id & 0x7FFFFFFF, payload)
        except _ConnectionError as error:
            self._abort(error.code, error.reason)
            return
        finally:
            self.flush()
        del buffer[:position]

    # -- frames in ----------------------------------------------------------------------------------
    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self.continuation is not None and kind != CONTINUATION:
            raise _ConnectionError(PROTOCOL_ERROR, "expected CONTINUATION")
        if kind == DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._on_continuation(flags, stream_id, payload)
        elif kind == RST_STREAM:
            if len(payload) != 4 or not stream_id:
                raise _ConnectionError(FRAME_SIZE_ERROR if stream_id else PROTOCOL_ERROR, "bad RST_STREAM")
            call = self.calls.get(stream_id)
            if call is not None:
                self._drop(call)
        elif kind == SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == PING:
            if len(payload) != 8 or stream_id:
                raise _ConnectionError(FRAME_SIZE_ERROR, "bad PING")
            if not flags & ACK:
                self.write_frame(PING, ACK, 0, payload)
        elif kind == GOAWAY:
            self._on_goaway(payload)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # PRIORITY and unknown frame types are ignored, as the spec asks.

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise _ConnectionError(PROTOCOL_ERROR, "DATA on stream 0")
        self.recv_unacked += len(payload)  # flow control counts padding too
        if self.recv_unacked >= RECV_CONN_WINDOW // 2:
            self.write_frame(WINDOW_UPDATE, 0, 0, _U32.pack(self.recv_unacked))
            self.recv_unacked = 0
        call = self.calls.get(stream_id)
        if call is None or call.remote_closed:
            return  # a call we already finished or reset: late frames are dropped
        call.recv_unacked += len(payload)  # padding included here too, or the stream window leaks
        if call.recv_unacked >= RECV_STREAM_WINDOW // 2 and not flags & END_STREAM:
            self.write_frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(call.recv_unacked))
            call.recv_unacked = 0
        if flags & PADDED:
            payload = _unpad(payload)
        if flags & END_STREAM:
            # Set before the messages are handled: a call that its last message finishes is then
            # closed on both sides, and needs no RST_STREAM after the trailers.
            call.remote_closed = True
        buffer = call.recv_buffer
        buffer += payload
        while len(buffer) >= 5 and not call.finished:
            compressed, length = _MESSAGE_HEAD.unpack_from(buffer)
            if compressed:
                self._fail(call, UNIMPLEMENTED, "compressed messages are not supported")
                return
            if length > self.server.max_message_bytes:
                limit = self.server.max_message_bytes
                self._fail(call, RESOURCE_EXHAUSTED, f"message of {length} bytes is over {limit}")
                return
            if len(buffer) < 5 + length:
                break
            message = bytes(buffer[5 : 5 + length])
            del buffer[: 5 + length]
            self._dispatch(call, "on_message", message)
        if flags & END_STREAM:
            self._remote_end(call)

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise _ConnectionError(PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & PADDED:
            payload = _unpad(payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if flags & END_HEADERS:
            self._on_header_block(flags, stream_id, payload)
        else:
            self.continuation = (stream_id, flags, bytearray(payload))

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self.continuation is None or self.continuation[0] != stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "unexpected CONTINUATION")
        block = self.continuation[2]
        block += payload
        if len(block) > MAX_HEADER_BLOCK:
            raise _ConnectionError(PROTOCOL_ERROR, "header block too large")
        if flags & END_HEADERS:
            first_flags = self.continuation[1]
            self.continuation = None
            self._on_header_block(first_flags, stream_id, bytes(block))

    def _on_header_block(self, flags: int, stream_id: int, block: bytes) -> None:
        try:  # always decoded: the HPACK table must follow every block
            headers = self.decoder.decode(block)
        except (hpack.exceptions.HPACKError, UnicodeDecodeError) as exc:
            raise _ConnectionError(COMPRESSION_ERROR, f"bad header block: {exc}") from exc
        call = self.calls.get(stream_id)
        if call is not None:  # trailers from the client
            if flags & END_STREAM and not call.remote_closed:
                self._remote_end(call)
            return
        if stream_id % 2 == 0:
            raise _ConnectionError(PROTOCOL_ERROR, f"HEADERS opening stream {stream_id}")
        if stream_id <= self.last_stream_id:
            # A stream we finished or reset (refused, or done before the client half-closed): its
            # trailers may have been in flight, and frames after our RST_STREAM are to be ignored
            # (RFC 9113 5.1); like late DATA, they are dropped.
            return
        self.last_stream_id = stream_id
        if self.going_away or len(self.calls) >= self.server.max_concurrent_streams:
            self.write_frame(RST_STREAM, 0, stream_id, _U32.pack(REFUSED_STREAM))
            return
        call = Call(self, stream_id, headers, self.peer_initial_window)
        call.remote_closed = bool(flags & END_STREAM)
        self.calls[stream_id] = call
        factory = self.server.handlers.get(headers.get(":path", ""))
        if headers.get(":method") != "POST" or factory is None:
            call.finish(UNIMPLEMENTED, f"unknown method {headers.get(':path', '')}")
            return
        try:
            call.handler = factory(call)
        except Exception:
            log.exception("h2grpc: handler for %s failed to start", headers.get(":path"))
            call.finish(INTERNAL, "handler failed to start")
            return
        if call.remote_closed:
            self._dispatch(call, "on_end")

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS length")
        for offset in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, offset)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "initial window too large")
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for call in self.calls.values():
                    call.send_window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not 16_384 <= value <= 16_777_215:
                    raise _ConnectionError(PROTOCOL_ERROR, "bad max frame size")
                self.peer_max_frame = value
            # Header table size: our encoder never indexes, and zeroed the table (_TABLE_SIZE_ZERO).
        self.write_frame(SETTINGS, ACK, 0, b"")
        for call in list(self.calls.values()):
            self.drain(call)

    def _on_goaway(self, payload: bytes) -> None:
        if len(payload) < 8:
            raise _ConnectionError(FRAME_SIZE_ERROR, "bad GOAWAY")
        # Its last-stream-id counts streams *we* opened, and we open none: the calls in flight are
        # the client's own and may still finish (one going away on an error closes the socket).
        self.going_away = True
        self._close_if_idle()

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if stream_id == 0:
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "connection window overflow")
            for call in list(self.blocked):
                self.drain(call)
        elif (call := self.calls.get(stream_id)) is not None:
            call.send_window += increment
            self.drain(call)

    # -- calls ----------------------------------------------------------------------------------
    def _dispatch(self, call: Call, callback: str, *args: bytes) -> None:
        """Run a handler callback; a handler that raises fails its own call only."""
        if call.handler is None:
            return
        try:
            getattr(call.handler, callback)(*args)
        except Exception:
            log.exception("h2grpc: %s handler failed on stream %d", call.headers.get(":path"), call.stream_id)
            self._fail(call, INTERNAL, "internal error")

    def _remote_end(self, call: Call) -> None:
        call.remote_closed = True
        if call.finished:
            return
        if call.recv_buffer:  # not a clean end: the last message was cut short
            self._fail(call, INTERNAL, "stream ended inside a message")
        else:
            self._dispatch(call, "on_end")

    def _fail(self, call: Call, code: int, message: str) -> None:
        """Tell the handler its call is gone, then finish it with an error status."""
        self._cancel(call)
        call.finish(code, message)

    def _drop(self, call: Call) -> None:
        """Forget a call that will not finish (reset, connection gone): nothing more is sent for it."""
        self.calls.pop(call.stream_id, None)
        self.blocked.discard(call)
        call.finished = True
        self._cancel(call)

    def _drop_all(self) -> None:
        for call in list(self.calls.values()):
            self._drop(call)

    def _cancel(self, call: Call) -> None:
        if call.handler is not None:
            handler, call.handler = call.handler, None
            try:
                handler.on_cancel()
            except Exception:
                log.exception("h2grpc: on_cancel failed on stream %d", call.stream_id)

    def drain(self, call: Call) -> None:
        """Write what flow control allows of the call's pending DATA, then its trailers."""
        pending = call.pending
        while pending:
            allowed = min(len(pending), call.send_window, self.send_window, self.peer_max_frame)
            if allowed <= 0:
                self.blocked.add(call)
                return
            self.write_frame(DATA, 0, call.stream_id, bytes(pending[:allowed]))
            del pending[:allowed]
            call.send_window -= allowed
            self.send_window -= allowed
        self.blocked.discard(call)
        if call.trailers is not None:
            self.write_headers(END_HEADERS | END_STREAM, call.stream_id, call.trailers)
            call.trailers = None
            if not call.remote_closed:
                # Done before the client half-closed: ask it to stop sending, without error.
                self.write_frame(RST_STREAM, 0, call.stream_id, _U32.pack(NO_ERROR))
            self.closed(call)

    def closed(self, call: Call) -> None:
        """Both sides are done with the call (or we reset it): forget it."""
        self.calls.pop(call.stream_id, None)
        call.handler = None
        if self.going_away:
            self._close_if_idle()

    # -- frames out ---------------------------------------------------------------------------------
    def write_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        self.out.append(_FRAME_HEAD.pack(len(payload) << 8 | kind, flags, stream_id))
        self.out.append(payload)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def write_headers(self, flags: int, stream_id: int, block: bytes) -> None:
        if not self.table_size_sent:
            self.table_size_sent = True
            block = _TABLE_SIZE_ZERO + block
        self.write_frame(HEADERS, flags, stream_id, block)

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.out and self.transport is not None:
            self.transport.write(b"".join(self.out))
        self.out.clear()

    def go_away(self) -> None:
        """Take no new calls; close once the open ones end."""
        if not self.going_away and self.transport is not None:
            self.going_away = True
            self.write_frame(GOAWAY, 0, 0, _U32.pack(self.last_stream_id) + _U32.pack(NO_ERROR))
        self._close_if_idle()

    def _close_if_idle(self) -> None:
        if not self.calls and self.transport is not None:
            self.flush()
            self.transport.close()

    def abort_calls(self) -> None:
        """Shutdown after the grace period: cancel what is still open."""
        self._drop_all()
        self._close_if_idle()

    def _abort(self, code: int, reason: str) -> None:
        log.warning("h2grpc: closing connection: %s", reason)
        if self.transport is not None:
            self.write_frame(GOAWAY, 0, 0, _U32.pack(self.last_stream_id) + _U32.pack(code) + reason.encode())
            self.flush()
            self.transport.close()
            self.transport = None


class HeaderDecoder:
    """``hpack``'s decoder plus a cache of the blocks that leave its dynamic table as it was.

    Once its table is warm, Envoy sends the very same block for every ext_proc stream (indexed
    fields and a never-indexed ``:path``): decoding it in pure Python costs ~80 µs, a lookup does
    not. A cached block is only valid while the table is unchanged, so a block that changes it
    (an insertion, a size update) is never cached and empties the cache.
    """

    MAX_CACHED = 64

    def __init__(self) -> None:
        self.hpack = hpack.Decoder(max_header_list_size=MAX_HEADER_BLOCK)
        self.cache: dict[bytes, dict[str, str]] = {}

    def decode(self, block: bytes) -> dict[str, str]:
        cached = self.cache.get(block)
        if cached is not None:
            return dict(cached)
        before = self._table_state()
        headers = dict(self.hpack.decode(block))
        if self._table_state() == before:  # identity of the newest entry: compared by ``is``
            if len(self.cache) >= self.MAX_CACHED:
                self.cache.clear()
            self.cache[block] = headers
            return dict(headers)
        self.cache.clear()
        return headers

    def _table_state(self) -> tuple[object, int, int]:
        table = self.hpack.header_table
        entries = table.dynamic_entries
        return (_Same(entries[0]) if entries else None, len(entries), table.maxsize)


class _Same:
    """Equal only to a wrapper of the very same object (a tuple's ``==`` would compare values)."""

    __slots__ = ("item",)

    def __init__(self, item: object) -> None:
        self.item = item

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.item is self.item

    __hash__ = None  # type: ignore[assignment]


class _ConnectionError(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def _unpad(payload: bytes) -> bytes:
    if not payload or payload[0] >= len(payload):
        raise _ConnectionError(PROTOCOL_ERROR, "bad padding")
    return payload[1 : len(payload) - payload[0]]


class H2GrpcServer:
    """Listens on ``host:port`` and serves ``handlers`` (``/package.Service/Method`` -> factory)."""

    def __init__(
        self,
        handlers: Mapping[str, HandlerFactory],
        *,
        max_concurrent_streams: int = 10_000,
        max_message_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self.handlers = dict(handlers)
        self.max_concurrent_streams = max_concurrent_streams
        self.max_message_bytes = max_message_bytes
        self.connections: set[Connection] = set()
        self._server: asyncio.Server | None = None
        self._idle = asyncio.Event()

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Connection(self), host, port, reuse_address=True)
        return self._server.sockets[0].getsockname()[1]

    def connection_closed(self) -> None:
        if not self.connections:
            self._idle.set()

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop listening, let open calls finish for ``grace_s`` seconds, then cancel the rest."""
        if self._server is None:
            return
        self._server.close()
        self._idle.clear()
        for conn in list(self.connections):
            conn.go_away()
        if self.connections and grace_s:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace_s)
        for conn in list(self.connections):
            conn.abort_calls()
        await self._server.wait_closed()
        self._server = None
