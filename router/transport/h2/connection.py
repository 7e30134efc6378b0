"""A small HTTP/2 gRPC server on the asyncio loop, for the ext_proc and health listeners.

Why not ``grpc.aio``: Envoy opens one gRPC stream per HTTP request, and a ``grpc.aio`` stream
costs ~0.5 ms of CPU in this process (task, context, completion-queue hops per message) against
~0.2 ms for the routing itself; at the InferencePool's request rates that is the router's ceiling.
This server handles a call's messages synchronously inside ``data_received`` and writes all the
frames a read produced in one ``transport.write``, which also saves Envoy a wake-up per frame.
It is built on ``hpack`` alone (no ``h2`` state machine): frames are parsed here.

Scope: HTTP/2 with prior knowledge, cleartext or over TLS with ALPN ``h2`` (what Envoy's
``envoy_grpc`` client, grpc-go probes and grpcio speak), unary and streaming calls,
identity-encoded messages. Whatever is outside the scope gets the error the specs name:
``GOAWAY`` (connection errors), ``RST_STREAM`` (refused or broken streams), ``grpc-status``
trailers (unknown method, compressed or oversized messages).

Every resource a peer can make us spend is bounded by a named limit in ``H2Limits`` (one place;
each field says why its default is what it is). Crossing one ends the attacking connection with
``GOAWAY ENHANCE_YOUR_CALM`` (or the error RFC 9113 names: ``FRAME_SIZE_ERROR`` for a frame over
our ``SETTINGS_MAX_FRAME_SIZE``, ``FLOW_CONTROL_ERROR`` for data beyond our window,
``COMPRESSION_ERROR`` for a block HPACK refuses), or bounds its memory by backpressure:

* streams reset before we answered anything (RST_STREAM from the peer, or refused by us) spend
  a per-connection budget that refills over time and with every call that completes (rapid
  reset, CVE-2023-44487; Envoy resets every ext_proc stream it is done with, answered ones);
* CONTINUATION frames per header block are counted and the header block's size is checked on
  HEADERS and CONTINUATION alike, before HPACK sees it (CVE-2024-27316);
* frames are at most ``max_frame_size``; SETTINGS are rate-limited; PINGs closer together than
  ``min_ping_interval_s`` with nothing sent in between are strikes (grpc-core's ping policy);
* receive windows are refilled only for bytes handed to a handler (or discarded), so a peer
  can have at most one connection window of request bytes buffered here; responses waiting for
  the peer's window are capped per call (reset past it) and per connection (past it the peer's
  receive window is no longer refilled: it gets no new request bytes until it reads its answers);
  frames leave in slices of ``max_write_per_turn`` per loop turn;
* one read is processed for at most ``max_frames_per_read`` frames or ``max_time_per_read_s``,
  then the connection yields the loop to the others (grpc-core's ``max_requests_per_read``);
* connections: a cap (the longest-unused idle connection makes room for a new one), an idle
  timeout, a handshake timeout, and a listen backlog sized for reconnect bursts.

A method is served by a factory ``(Call) -> CallHandler``; the handler's callbacks never await
(one that must, e.g. to tokenize, starts a task and answers through ``Call`` later).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from ssl import SSLContext
from typing import Any, Protocol, cast
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

NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x3
FRAME_SIZE_ERROR, REFUSED_STREAM, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x6, 0x7, 0x9, 0xB

SETTINGS_HEADER_TABLE_SIZE, SETTINGS_MAX_CONCURRENT_STREAMS = 0x1, 0x3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

# gRPC status codes we send.
OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = 0, 3, 8, 12, 13

DEFAULT_WINDOW = 65_535
MAX_WINDOW = 2**31 - 1
MIN_MAX_FRAME, MAX_MAX_FRAME = 16_384, 2**24 - 1
# grpc-message characters we send: percent-encoded (up to 12 bytes each) they still fit the 16 KiB
# frame every peer accepts, and we never split a header block over CONTINUATION frames.
MAX_STATUS_MESSAGE = 1000
# The read loop looks at the clock (and the frame budget) once per this many frames, and after any
# frame of at least _HEAVY_FRAME bytes: a clock read per small frame would cost more than the frame,
# while one large frame (a header block to decode, a body to handle) can take milliseconds.
_BUDGET_CHECK_MASK = 31
_HEAVY_FRAME = 1024
_NEVER = float("-inf")
_TLS_HANDSHAKE_RECORD = b"\x16"  # the first byte of a TLS ClientHello (a handshake record)

KiB, MiB = 1024, 1024 * 1024


@dataclass(frozen=True, slots=True)
class H2Limits:
    """Every bound the server puts on what one peer can make it spend, with the reason for each.

    Defaults are sized so that legitimate Envoy traffic (thousands of streams per connection,
    keepalive PINGs, streams reset when downstream clients go away) never reaches one, while each
    attack in ``loadtests/bench/h2_attacks.py`` ends with the attacking connection closed or its
    memory bounded. ``H2GrpcServer(limits=...)`` takes one; ``dataclasses.replace`` tunes a field.
    """

    # -- streams and messages -------------------------------------------------------------------
    max_concurrent_streams: int = 10_000
    """SETTINGS_MAX_CONCURRENT_STREAMS: Envoy multiplexes every in-flight request of a worker on
    one connection (one ext_proc stream each); streams over it are refused (and spend the reset
    budget). Each open stream holds its handler and its headers (up to max_header_list_size)."""

    max_message_bytes: int = 4 * MiB
    """The largest gRPC message a call accepts (RESOURCE_EXHAUSTED beyond). The stream window and
    the floors of ``connection_window`` and ``max_call_send_bytes`` are derived from it so that a
    message in flight always fits."""

    max_header_list_size: int = 16 * KiB
    """SETTINGS_MAX_HEADER_LIST_SIZE, enforced on the encoded block (HEADERS + CONTINUATIONs, before
    HPACK runs: ENHANCE_YOUR_CALM) and on the decoded list (HPACK's own cap: COMPRESSION_ERROR).
    Envoy's ext_proc metadata is a few hundred bytes and grpc-core's default hard limit for
    metadata is 16 KiB; a block this size costs HPACK (pure Python) ~5 ms and an open call keeps
    it (it was 64 KiB)."""

    max_continuation_frames: int = 16
    """CONTINUATION frames per header block (h2's CONTINUATION_BACKLOG is 64): a maximal block
    fits one frame, and peers that split at 16 KiB need none; empty or 1-byte CONTINUATIONs would
    otherwise cost a frame parse each for free (CVE-2024-27316)."""

    max_frame_size: int = 64 * KiB
    """SETTINGS_MAX_FRAME_SIZE we advertise (larger frames: FRAME_SIZE_ERROR as soon as the frame
    head arrives). A 4 MiB body is 64 frames, while a connection holding a frame in progress holds
    at most this much (it was 1 MiB)."""

    # -- flow control and buffers -----------------------------------------------------------------
    connection_window: int = 8 * MiB
    """Receive window per connection, refilled only for bytes handed to a handler or discarded:
    the most request bytes one connection can have buffered here. Raised to the stream window
    (twice the largest message) so that one message in progress always completes."""

    max_call_send_bytes: int = 8 * MiB
    """Response bytes one call may have waiting (for the peer's window or the socket); past it the
    call is reset with ENHANCE_YOUR_CALM and its handler cancelled. Raised to twice the largest
    message: ext_proc sends a whole request body back."""

    max_connection_send_bytes: int = 4 * MiB
    """Response bytes one connection may have waiting before its receive window stops being
    refilled: a peer that does not read its answers gets no more request bytes (backpressure, not
    an error). Memory per connection is then about this + ``connection_window``."""

    max_write_per_turn: int = 1 * MiB
    """Bytes moved from calls' queues to the socket per loop turn: a window opening on many
    blocked calls leaves in slices instead of one copy of everything (and one long turn)."""

    # -- time on the loop -----------------------------------------------------------------------
    max_frames_per_read: int = 1000
    """Frames processed per turn before the connection yields the loop to others (grpc-core's
    max_requests_per_read); the rest of the read is processed on the next turn, reading paused."""

    max_time_per_read_s: float = 0.005
    """Loop time one connection may take per turn (checked every 32 frames and after every frame
    of 1 KiB or more): handlers and HPACK run inside frame processing, so the frame count alone
    does not bound it."""

    # -- abuse budgets ----------------------------------------------------------------------------
    reset_burst: int = 1000
    """Streams a connection may have reset before we answered anything on them (peer RST_STREAM,
    or refused by us) in a burst; one more is GOAWAY ENHANCE_YOUR_CALM (rapid reset,
    CVE-2023-44487). Envoy resets every ext_proc stream it is done with (answered: not counted)
    and one that a downstream client left before its answer (counted), so the budget is large and
    refills (below)."""

    reset_refill_per_s: float = 100.0
    """The reset budget refills at this rate, and by one for every call that completes: a busy
    peer cancelling a share of its calls never runs out, a peer that only resets is held to this."""

    settings_burst: int = 100
    """Non-ACK SETTINGS frames a connection may send in a burst (each costs an ACK and, with a new
    initial window, a pass over its calls); one more is GOAWAY ENHANCE_YOUR_CALM. Peers send one
    at the start, grpc-core a few more as it sizes its windows."""

    settings_refill_per_s: float = 10.0
    """The SETTINGS budget refills at this rate."""

    min_ping_interval_s: float = 1.0
    """A PING arriving sooner than this after the previous one, with no new stream and no DATA
    sent to the peer in between, is a strike (grpc-core's policy: keepalive and BDP pings of a
    peer that gets answers never count)."""

    max_ping_strikes: int = 10
    """Strikes tolerated; one more is GOAWAY ENHANCE_YOUR_CALM "too_many_pings"."""

    # -- connections ------------------------------------------------------------------------------
    max_connections: int = 1024
    """Open connections per server. At the cap a new connection closes the longest-unused idle one
    (GOAWAY NO_ERROR: a client reconnects), or is refused (GOAWAY ENHANCE_YOUR_CALM) when every
    connection has calls open. Keep it under the process's open-file limit, which the router
    shares with its upstream connections."""

    idle_timeout_s: float = 300.0
    """A connection with no call open and no new stream for this long gets GOAWAY NO_ERROR and is
    closed. Envoy reconnects on demand; its health checks every few seconds keep theirs open."""

    handshake_timeout_s: float = 10.0
    """Time to complete the TLS handshake and send the client preface; slower is closed."""

    close_linger_s: float = 1.0
    """After our GOAWAY (and FIN), how long a connection is kept reading and discarding so the
    peer gets the GOAWAY instead of a reset, before the socket is dropped."""

    listen_backlog: int = 4096
    """listen(2) backlog: a fleet of Envoys reconnecting at once must not find the accept queue
    full (the kernel caps it at net.core.somaxconn); it was asyncio's 100."""

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"H2Limits.{item.name} must be a positive number, got {value!r}")
        if not MIN_MAX_FRAME <= self.max_frame_size <= MAX_MAX_FRAME:
            raise ValueError(f"H2Limits.max_frame_size must be in [16384, 2**24 - 1]: {self.max_frame_size}")
        if self.connection_window > MAX_WINDOW:
            raise ValueError(f"H2Limits.connection_window must be under 2**31: {self.connection_window}")

    @property
    def stream_window(self) -> int:
        """SETTINGS_INITIAL_WINDOW_SIZE we advertise: twice the largest message (with its 5-byte
        prefix), so a message in progress always fits between two refills (refills come at half)."""
        return min(MAX_WINDOW, max(DEFAULT_WINDOW, 2 * (self.max_message_bytes + 5)))

    @property
    def effective_connection_window(self) -> int:
        return min(MAX_WINDOW, max(self.connection_window, self.stream_window))

    @property
    def effective_call_send_bytes(self) -> int:
        return max(self.max_call_send_bytes, 2 * (self.max_message_bytes + 5))


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
        "recv_credit",
        "recv_window",
        "remote_closed",
        "send_window",
        "stream_id",
        "trailers",
    )

    def __init__(
        self, conn: Connection, stream_id: int, headers: dict[str, str], send_window: int, recv_window: int
    ) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.headers = headers
        self.send_window = send_window
        self.recv_window = recv_window  # what the peer may still send on this stream
        self.recv_credit = 0  # bytes consumed since the stream's last WINDOW_UPDATE
        self.handler: CallHandler | None = None
        self.recv_buffer = bytearray()
        self.headers_sent = False
        self.remote_closed = False
        self.finished = False
        self.pending = bytearray()  # DATA waiting for flow-control window (or the turn's write budget)
        self.trailers: bytes | None = None  # trailers waiting behind ``pending``

    def send(self, message: bytes) -> None:
        if self.finished:
            return
        conn = self.conn
        if not self.headers_sent:
            self.headers_sent = True
            conn.write_headers(END_HEADERS, self.stream_id, RESPONSE_HEADERS)
        self.pending += _MESSAGE_HEAD.pack(0, len(message))
        self.pending += message
        conn.send_pending += 5 + len(message)
        conn.drain(self)
        if self.pending and len(self.pending) > conn.max_call_send:
            conn.reset_call(self, f"over {conn.max_call_send} response bytes waiting for the peer")

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


class _Budget:
    """A token bucket: ``burst`` tokens, refilled at ``rate`` per second (and one by one by the owner)."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, burst: int, rate: float) -> None:
        self.burst = burst
        self.rate = rate
        self.tokens = float(burst)
        self.stamp = time.monotonic()

    def take(self) -> bool:
        """Spend a token; False when there is none left."""
        now = time.monotonic()
        tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if tokens < 1.0:
            self.tokens = tokens
            return False
        self.tokens = tokens - 1.0
        return True

    def give(self) -> None:
        self.tokens = min(float(self.burst), self.tokens + 1.0)


class Connection(asyncio.Protocol):
    """One HTTP/2 connection: frames in, calls dispatched, frames out batched per read."""

    def __init__(self, server: H2GrpcServer) -> None:
        limits = server.limits
        self.server = server
        self.limits = limits
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None  # None once we stopped serving (or before)
        self.buffer = bytearray()
        self.preface_seen = False
        self.out: list[bytes] = []
        self.drained = 0  # DATA bytes moved to ``out`` this turn (against max_write_per_turn)
        self.flush_scheduled = False
        self.calls: dict[int, Call] = {}
        # Calls with DATA waiting for the connection window or the turn's write budget, oldest first
        # (a call waiting for its own stream window is not here: only its WINDOW_UPDATE moves it).
        self.blocked: dict[Call, None] = {}
        self.drain_scheduled = False
        self.last_stream_id = 0
        self.going_away = False  # we sent GOAWAY: no new calls
        self.decoder = HeaderDecoder(limits.max_header_list_size)
        self.max_header_block = limits.max_header_list_size
        self.max_frame, self.max_frames = limits.max_frame_size, limits.max_frames_per_read
        self.max_message = limits.max_message_bytes
        self.continuation: tuple[int, int, bytearray] | None = None  # (stream, flags, block so far)
        self.continuation_frames = 0
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = 16_384
        self.send_window = DEFAULT_WINDOW
        self.send_pending = 0  # bytes in the calls' ``pending``
        self.max_call_send = server.max_call_send
        self.recv_window = server.connection_window  # what the peer may still send
        self.recv_credit = 0  # bytes consumed since our last connection WINDOW_UPDATE
        self.refill_at = server.connection_refill_at
        self.stream_refill_at = server.stream_refill_at
        self.write_budget = limits.max_write_per_turn
        self.table_size_sent = False  # see _TABLE_SIZE_ZERO
        # Reading is paused while the peer does not read us (write_paused) or while a read is only
        # partly processed (read_deferred: the rest waits for the next loop turn).
        self.write_paused = False
        self.read_deferred = False
        self.reading_paused = False
        self.continue_scheduled = False
        self.resets = _Budget(limits.reset_burst, limits.reset_refill_per_s)
        self.resets_spent = 0  # resets not yet earned back by completed calls
        self.settings_budget = _Budget(limits.settings_burst, limits.settings_refill_per_s)
        self.ping_strikes = 0
        self.last_ping = _NEVER
        self.sent_at_ping = (0, DEFAULT_WINDOW)
        self.created = self.idle_since = self.loop.time()
        self.swept_stream_id = 0
        self.linger: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        server = self.server
        self.out.append(server.preamble)  # our SETTINGS (first, as the preface requires) + window
        if len(server.connections) >= self.limits.max_connections and not server.make_room():
            self._abort(ENHANCE_YOUR_CALM, f"connection limit ({self.limits.max_connections}) reached")
            return
        server.connections[self] = None
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.linger is not None:
            self.linger.cancel()
        self.transport = None
        self._drop_all()
        self.server.connection_closed(self)

    def pause_writing(self) -> None:
        # The peer is not reading what we write: stop taking new work from it until it does.
        self.write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._update_reading()
        if self.read_deferred:
            self._schedule_continue()
        if self.blocked:
            self._schedule_drain()

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return  # closing: what the peer still sends is discarded
        self.buffer += data
        if self.read_deferred or self.write_paused:
            # Frames of an earlier read wait for their turn (or for the peer to read us): in order.
            if not self.read_deferred:
                self.read_deferred = True
                self._update_reading()
            return
        self._process()

    # -- reading, a bounded slice per turn -----------------------------------------------------------
    def _process(self) -> None:
        """Handle the buffered frames, for at most one turn's budget; reply in one write."""
        self.flush_scheduled = True  # everything this read produces goes out in one write, below
        buffer = self.buffer
        position = 0
        try:
            if not self.preface_seen and not self._preface():
                return
            max_frame, max_frames = self.max_frame, self.max_frames
            size, frames = len(buffer), 0
            deadline = time.monotonic() + self.limits.max_time_per_read_s
            while size - position >= 9 and self.transport is not None:
                head, flags, stream_id = _FRAME_HEAD.unpack_from(buffer, position)
                length = head >> 8
                if length > max_frame:
                    raise _ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes over {max_frame}")
                end = position + 9 + length
                if end > size:
                    break
                payload = bytes(buffer[position + 9 : end])
                position = end
                self._on_frame(head & 0xFF, flags, stream_id & 0x7FFFFFFF, payload)
                frames += 1
                if (length >= _HEAVY_FRAME or not frames & _BUDGET_CHECK_MASK) and (
                    frames >= max_frames or time.monotonic() > deadline
                ):
                    if size - position >= 9 and self.transport is not None:
                        self._defer()  # the others get the loop; the rest is processed next turn
                    break
        except _ConnectionError as error:
            self._abort(error.code, error.reason)
        finally:
            del buffer[:position]
            self.flush()

    def _preface(self) -> bool:
        """Consume the client preface once it is all there; False while it is not."""
        buffer = self.buffer
        if len(buffer) < len(PREFACE):
            if not PREFACE.startswith(bytes(buffer)):
                raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            return False
        if buffer[: len(PREFACE)] != PREFACE:
            raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
        del buffer[: len(PREFACE)]
        self.preface_seen = True
        return True

    def _defer(self) -> None:
        self.read_deferred = True
        self._update_reading()
        self._schedule_continue()

    def _schedule_continue(self) -> None:
        if not self.continue_scheduled:
            self.continue_scheduled = True
            self.loop.call_soon(self._continue)

    def _continue(self) -> None:
        self.continue_scheduled = False
        if self.transport is None or self.write_paused:
            return  # resume_writing schedules us again
        self.read_deferred = False
        self._process()
        self._update_reading()

    def _update_reading(self) -> None:
        paused = self.write_paused or self.read_deferred
        if paused != self.reading_paused and self.transport is not None:
            self.reading_paused = paused
            if paused:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

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
            self._on_rst_stream(stream_id, payload)
        elif kind == SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == PING:
            self._on_ping(flags, stream_id, payload)
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
        size = len(payload)  # flow control counts padding too
        self.recv_window = window = self.recv_window - size
        if window < 0:
            raise _ConnectionError(FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        call = self.calls.get(stream_id)
        if call is None or call.remote_closed:
            if stream_id > self.last_stream_id:
                raise _ConnectionError(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            self._consumed(None, size)  # a call we already finished or reset: late frames are dropped
            return
        call.recv_window = window = call.recv_window - size
        if window < 0:
            raise _ConnectionError(FLOW_CONTROL_ERROR, f"DATA beyond the window of stream {stream_id}")
        if flags & PADDED:
            payload = _unpad(payload)
        if flags & END_STREAM:
            # Set before the messages are handled: a call that its last message finishes is then
            # closed on both sides, and needs no RST_STREAM after the trailers.
            call.remote_closed = True
        buffer = call.recv_buffer
        kept = len(buffer)
        if not call.finished:  # a call answered already: what still comes is dropped
            buffer += payload
        max_message = self.max_message
        while len(buffer) >= 5 and not call.finished:
            compressed, length = _MESSAGE_HEAD.unpack_from(buffer)
            if compressed:
                self._fail(call, UNIMPLEMENTED, "compressed messages are not supported")
                break
            if length > max_message:
                self._fail(call, RESOURCE_EXHAUSTED, f"message of {length} bytes is over {max_message}")
                break
            if len(buffer) < 5 + length:
                break
            message = bytes(buffer[5 : 5 + length])
            del buffer[: 5 + length]
            self._dispatch(call, "on_message", message)
        if call.finished and buffer:  # failed or answered mid-message: the rest is dropped
            buffer.clear()
        # Consumed: the frame's bytes (padding included) but for what is left buffered, a partial
        # message; what _consumed does, inlined (once per DATA frame).
        consumed = size + kept - len(buffer)
        if consumed:
            self.recv_credit += consumed
            if self.recv_credit >= self.refill_at:
                self._refill()
            if not call.remote_closed and not call.finished:
                call.recv_credit += consumed
                if call.recv_credit >= self.stream_refill_at:
                    self._refill_stream(call)
        if flags & END_STREAM:
            self._remote_end(call)

    def _consumed(self, call: Call | None, size: int) -> None:
        """``size`` request bytes were handed to a handler or dropped: the peer may send as many again.

        Refills are batched (at half a window) and the connection's is withheld while the peer
        leaves more than ``max_connection_send_bytes`` of answers unread.
        """
        self.recv_credit += size
        if self.recv_credit >= self.refill_at:
            self._refill()
        if call is not None and not call.remote_closed and not call.finished:
            call.recv_credit += size
            if call.recv_credit >= self.stream_refill_at:
                self._refill_stream(call)

    def _refill_stream(self, call: Call) -> None:
        call.recv_window += call.recv_credit
        self.write_frame(WINDOW_UPDATE, 0, call.stream_id, _U32.pack(call.recv_credit))
        call.recv_credit = 0

    def _refill(self) -> None:
        if self.send_pending > self.limits.max_connection_send_bytes or self.transport is None:
            return  # the peer gets more window once it has read its answers (see drain)
        credit, self.recv_credit = self.recv_credit, 0
        self.recv_window += credit
        self.write_frame(WINDOW_UPDATE, 0, 0, _U32.pack(credit))

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise _ConnectionError(PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & PADDED:
            payload = _unpad(payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if len(payload) > self.max_header_block:  # checked before HPACK spends any time on it
            limit = self.max_header_block
            raise _ConnectionError(ENHANCE_YOUR_CALM, f"header block of {len(payload)} bytes over {limit}")
        if flags & END_HEADERS:
            self._on_header_block(flags, stream_id, payload)
        else:
            self.continuation = (stream_id, flags, bytearray(payload))
            self.continuation_frames = 0

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self.continuation is None or self.continuation[0] != stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "unexpected CONTINUATION")
        limits = self.limits
        self.continuation_frames += 1
        if self.continuation_frames > limits.max_continuation_frames:
            count = limits.max_continuation_frames
            raise _ConnectionError(ENHANCE_YOUR_CALM, f"over {count} CONTINUATION frames in a header block")
        block = self.continuation[2]
        block += payload
        if len(block) > limits.max_header_list_size:
            limit = limits.max_header_list_size
            raise _ConnectionError(ENHANCE_YOUR_CALM, f"header block of {len(block)} bytes over {limit}")
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
        if self.going_away or len(self.calls) >= self.limits.max_concurrent_streams:
            self.write_frame(RST_STREAM, 0, stream_id, _U32.pack(REFUSED_STREAM))
            if not self.going_away and not self._spend_reset():  # a refusal costs us a frame too
                raise _ConnectionError(ENHANCE_YOUR_CALM, "too many streams refused")
            return
        server = self.server
        call = Call(self, stream_id, headers, self.peer_initial_window, server.stream_window)
        call.remote_closed = bool(flags & END_STREAM)
        self.calls[stream_id] = call
        factory = server.handlers.get(headers.get(":path", ""))
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

    def _on_rst_stream(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4 or not stream_id:
            raise _ConnectionError(FRAME_SIZE_ERROR if stream_id else PROTOCOL_ERROR, "bad RST_STREAM")
        if stream_id > self.last_stream_id or not stream_id & 1:
            raise _ConnectionError(PROTOCOL_ERROR, f"RST_STREAM on idle stream {stream_id}")
        call = self.calls.get(stream_id)
        if call is None:
            return  # already done on our side: nothing was cut short
        self._drop(call)
        # Only a stream reset before we answered anything spends the budget: that is the rapid
        # reset (work started for a stream that never waited for it). Envoy closes *and resets*
        # every ext_proc stream it is done with, often before our trailers: answered, not counted.
        if not call.headers_sent and not self._spend_reset():
            raise _ConnectionError(ENHANCE_YOUR_CALM, "too many streams reset before an answer")

    def _spend_reset(self) -> bool:
        self.resets_spent += 1
        return self.resets.take()

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS length")
        if not self.settings_budget.take():
            raise _ConnectionError(ENHANCE_YOUR_CALM, "too many SETTINGS frames")
        window = self.peer_initial_window
        for offset in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, offset)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "initial window too large")
                window = value
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not MIN_MAX_FRAME <= value <= MAX_MAX_FRAME:
                    raise _ConnectionError(PROTOCOL_ERROR, "bad max frame size")
                self.peer_max_frame = value
            # Header table size: our encoder never indexes, and zeroed the table (_TABLE_SIZE_ZERO).
        self.write_frame(SETTINGS, ACK, 0, b"")
        # One pass over the calls per frame, however many window entries it carries: the net change
        # is what each entry's change adds up to.
        delta, self.peer_initial_window = window - self.peer_initial_window, window
        if delta:
            for call in self.calls.values():
                call.send_window += delta
        if delta > 0:
            for call in list(self.calls.values()):
                if call.pending or call.trailers is not None:
                    self.drain(call)

    def _on_ping(self, flags: int, stream_id: int, payload: bytes) -> None:
        if len(payload) != 8 or stream_id:
            raise _ConnectionError(FRAME_SIZE_ERROR, "bad PING")
        if flags & ACK:
            return
        # What we sent since the previous PING, read off state we keep anyway (the send path pays
        # nothing): a new stream means answers went out, a smaller send window means DATA did.
        now, sent = time.monotonic(), (self.last_stream_id, self.send_window)
        if sent != self.sent_at_ping:
            self.ping_strikes = 0  # the peer gets answers: its pings are keepalives, not a flood
        elif now - self.last_ping < self.limits.min_ping_interval_s:
            self.ping_strikes += 1
            if self.ping_strikes > self.limits.max_ping_strikes:
                raise _ConnectionError(ENHANCE_YOUR_CALM, "too_many_pings")
        self.last_ping, self.sent_at_ping = now, sent
        self.write_frame(PING, ACK, 0, payload)

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
            if self.blocked:
                self._drain_blocked()
        elif (call := self.calls.get(stream_id)) is not None:
            call.send_window += increment
            if call.pending or call.trailers is not None:
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
        self.blocked.pop(call, None)
        call.finished = True
        call.trailers = None
        if call.pending:
            self.send_pending -= len(call.pending)
            call.pending.clear()
        if call.recv_buffer:
            self._consumed(None, len(call.recv_buffer))
            call.recv_buffer.clear()
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

    def reset_call(self, call: Call, reason: str) -> None:
        """Reset a call that crossed a per-call limit (RST_STREAM ENHANCE_YOUR_CALM, handler cancelled)."""
        if call.stream_id not in self.calls or self.transport is None:
            return
        log.warning("h2grpc: resetting stream %d: %s", call.stream_id, reason)
        self.write_frame(RST_STREAM, 0, call.stream_id, _U32.pack(ENHANCE_YOUR_CALM))
        self._drop(call)
        if not self._spend_reset():
            self._abort(ENHANCE_YOUR_CALM, "too many streams reset")

    def drain(self, call: Call) -> None:
        """Write what flow control and the turn's budget allow of the call's DATA, then its trailers."""
        pending = call.pending
        if pending:
            while pending:
                if self.write_paused or self.drained >= self.write_budget:
                    self.blocked[call] = None  # the rest goes in a later turn
                    self._schedule_drain()
                    return
                allowed = min(len(pending), call.send_window, self.send_window, self.peer_max_frame)
                if allowed <= 0:
                    if self.send_window <= 0:
                        self.blocked[call] = None
                    else:  # waits for its own stream's WINDOW_UPDATE
                        self.blocked.pop(call, None)
                    return
                self.write_frame(DATA, 0, call.stream_id, bytes(pending[:allowed]))
                del pending[:allowed]
                call.send_window -= allowed
                self.send_window -= allowed
                self.send_pending -= allowed
                self.drained += allowed
            if self.recv_credit >= self.refill_at:
                self._refill()  # one withheld while the answers waited
        self.blocked.pop(call, None)
        if call.trailers is not None:
            self.write_headers(END_HEADERS | END_STREAM, call.stream_id, call.trailers)
            call.trailers = None
            if not call.remote_closed:
                # Done before the client half-closed: ask it to stop sending, without error.
                self.write_frame(RST_STREAM, 0, call.stream_id, _U32.pack(NO_ERROR))
            self.closed(call)

    def _drain_blocked(self) -> None:
        """Drain blocked calls oldest first, while the connection window and the turn's budget last."""
        blocked = self.blocked
        budget = self.limits.max_write_per_turn
        # Each pass either finishes a call's DATA, parks it on its own stream window, or stops the
        # loop (the window or the budget ran out): no call is looked at twice per opening.
        while (
            blocked
            and self.send_window > 0
            and not self.write_paused
            and self.drained < budget
            and self.transport is not None
        ):
            call = next(iter(blocked))
            del blocked[call]
            self.drain(call)

    def _schedule_drain(self) -> None:
        if not self.drain_scheduled and not self.write_paused:
            self.drain_scheduled = True
            self.loop.call_soon(self._drain_later)

    def _drain_later(self) -> None:
        self.drain_scheduled = False
        if self.transport is None or self.write_paused:
            return  # resume_writing schedules us again
        self.flush_scheduled = True
        try:
            self._drain_blocked()
        finally:
            self.flush()

    def closed(self, call: Call) -> None:
        """Both sides are done with the call (or we reset it): forget it."""
        self.calls.pop(call.stream_id, None)
        call.handler = None
        if call.recv_buffer:
            self._consumed(None, len(call.recv_buffer))
            call.recv_buffer.clear()
        if self.resets_spent:  # a completed call earns back a reset (see H2Limits)
            self.resets_spent -= 1
            self.resets.give()
        if self.going_away:
            self._close_if_idle()

    # -- frames out ---------------------------------------------------------------------------------
    def write_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        self.out.append(_FRAME_HEAD.pack(len(payload) << 8 | kind, flags, stream_id))
        self.out.append(payload)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self.flush)

    def write_headers(self, flags: int, stream_id: int, block: bytes) -> None:
        if not self.table_size_sent:
            self.table_size_sent = True
            block = _TABLE_SIZE_ZERO + block
        self.write_frame(HEADERS, flags, stream_id, block)

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.out:
            if self.transport is not None:
                self.transport.write(b"".join(self.out))
            self.out.clear()
            self.drained = 0

    # -- closing --------------------------------------------------------------------------------------
    def go_away(self, reason: str = "") -> None:
        """Take no new calls; close once the open ones end."""
        if not self.going_away and self.transport is not None:
            self.going_away = True
            debug = reason.encode()
            self.write_frame(GOAWAY, 0, 0, _U32.pack(self.last_stream_id) + _U32.pack(NO_ERROR) + debug)
        self._close_if_idle()

    def _close_if_idle(self) -> None:
        if not self.calls and self.transport is not None:
            self._shutdown()

    def abort_calls(self) -> None:
        """Shutdown after the grace period: cancel what is still open."""
        self._drop_all()
        self._close_if_idle()

    def _abort(self, code: int, reason: str) -> None:
        if self.transport is not None:
            self.server.warn(reason)
            goaway = _U32.pack(self.last_stream_id) + _U32.pack(code) + reason.encode()
            self.write_frame(GOAWAY, 0, 0, goaway)
            self._shutdown()

    def _shutdown(self) -> None:
        """Stop serving: our frames so far (a GOAWAY last) go out, then FIN; the socket lingers.

        Closing a socket with unread input makes the kernel send a reset, which can destroy the
        GOAWAY before the peer reads it; so we half-close, keep reading (discarding) for up to
        ``close_linger_s``, and close when the peer does, or abort then.
        """
        transport = self.transport
        if transport is None:
            return
        self.flush()
        self.transport = None
        self.server.forget(self, transport)
        self._drop_all()
        if not transport.can_write_eof():  # TLS: close_notify after what is buffered
            transport.close()
        else:
            try:
                transport.write_eof()
            except OSError:  # the peer is gone already (reset): there is nobody left to tell
                transport.abort()
                return
            if self.reading_paused:
                transport.resume_reading()
        self.linger = self.loop.call_later(self.limits.close_linger_s, transport.abort)

    def sweep(self, now: float) -> None:
        """The server's periodic look: handshake and idle timeouts."""
        if self.transport is None:
            return
        limits = self.limits
        if not self.preface_seen:
            if now - self.created >= limits.handshake_timeout_s:
                self._abort(PROTOCOL_ERROR, f"no HTTP/2 preface within {limits.handshake_timeout_s:g} s")
            return
        if self.calls or self.last_stream_id != self.swept_stream_id:
            self.swept_stream_id = self.last_stream_id
            self.idle_since = now
        elif now - self.idle_since >= limits.idle_timeout_s:
            self.go_away("idle")


class HeaderDecoder:
    """``hpack``'s decoder plus a cache of the blocks that leave its dynamic table as it was.

    Once its table is warm, Envoy sends the very same block for every ext_proc stream (indexed
    fields and a never-indexed ``:path``): decoding it in pure Python costs ~80 µs, a lookup does
    not. A cached block is only valid while the table is unchanged, so a block that changes it
    (an insertion, a size update) is never cached and empties the cache.
    """

    MAX_CACHED = 64

    def __init__(self, max_header_list_size: int = 64 * KiB) -> None:
        self.hpack = hpack.Decoder(max_header_list_size=max_header_list_size)
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
            _SETTING.pack(k, v)
            for k, v in (
                (SETTINGS_MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams),
                (SETTINGS_INITIAL_WINDOW_SIZE, self.stream_window),
                (SETTINGS_MAX_FRAME_SIZE, limits.max_frame_size),
                (SETTINGS_MAX_HEADER_LIST_SIZE, limits.max_header_list_size),
            )
        )
        preamble = _FRAME_HEAD.pack(len(settings) << 8 | SETTINGS, 0, 0) + settings
        if self.connection_window > DEFAULT_WINDOW:
            increment = _U32.pack(self.connection_window - DEFAULT_WINDOW)
            preamble += _FRAME_HEAD.pack(4 << 8 | WINDOW_UPDATE, 0, 0) + increment
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
        self, host: str, port: int, *, ssl: SSLContext | None = None, cleartext: bool = True
    ) -> int:
        """Listen on ``host:port``; returns the bound port.

        With ``ssl`` (a server context offering ALPN ``h2``, see ``tls.py``) connections are served
        over TLS, and with ``cleartext`` as well, h2c on the same port: each connection's first
        byte tells which (a TLS record starts with 0x16, the HTTP/2 preface with ``P``), so a
        gateway configured either way is served. A connection speaking the other protocol than
        the port serves is closed with a log line that says so.
        """
        if ssl is None and not cleartext:
            raise ValueError("a listener needs TLS, cleartext or both")
        loop = asyncio.get_running_loop()
        # "" (as asyncio reads it): every interface, IPv4 and IPv6.
        infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        # Every address the host names ("localhost": ::1 and 127.0.0.1), as asyncio's servers do;
        # with port 0, the others take the port the first one got.
        try:
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
