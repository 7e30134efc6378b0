"""One HTTP/2 connection of the gRPC server: frames in, calls dispatched, frames out.

``Connection`` is the asyncio protocol: it parses the frames of a read (``frames`` has their
layouts), runs each call's handler callbacks synchronously as messages complete, keeps both
directions' flow-control windows, and writes every frame the read produced in one
``transport.write``. ``Call`` is what a handler holds to answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import hpack.exceptions

from router.transport.h2.budgets import PingStrikes, ResetBudget, TokenBucket
from router.transport.h2.frames import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_HEAD,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    INTERNAL,
    MESSAGE_HEAD,
    NO_ERROR,
    OK,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RESOURCE_EXHAUSTED,
    RESPONSE_HEADERS,
    RST_STREAM,
    SETTING,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_FRAME_SIZE,
    TABLE_SIZE_ZERO,
    U32,
    UNIMPLEMENTED,
    WINDOW_UPDATE,
    H2ConnectionError,
    HeaderDecoder,
    trailers_block,
    unpad,
)
from router.transport.h2.limits import DEFAULT_WINDOW, MAX_MAX_FRAME, MAX_WINDOW, MIN_MAX_FRAME

if TYPE_CHECKING:
    from router.transport.h2.server import H2GrpcServer

log = logging.getLogger(__name__)

# The read loop looks at the clock (and the frame budget) once per this many frames, and after any
# frame of at least _HEAVY_FRAME bytes: a clock read per small frame would cost more than the frame,
# while one large frame (a header block to decode, a body to handle) can take milliseconds.
_BUDGET_CHECK_MASK = 31
_HEAVY_FRAME = 1024


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
        self.pending += MESSAGE_HEAD.pack(0, len(message))
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

    def flush(self) -> None:
        """Write what is queued now. Frames written outside a read (by a handler that awaited)
        otherwise leave at the end of the loop's turn, behind the callbacks queued before them,
        such as the pick's index record."""
        self.conn.flush()


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
        self.table_size_sent = False  # see TABLE_SIZE_ZERO
        # Reading is paused while the peer does not read us (write_paused) or while a read is only
        # partly processed (read_deferred: the rest waits for the next loop turn).
        self.write_paused = False
        self.read_deferred = False
        self.reading_paused = False
        self.continue_scheduled = False
        self.resets = ResetBudget(limits.reset_burst, limits.reset_refill_per_s)
        self.settings_budget = TokenBucket(limits.settings_burst, limits.settings_refill_per_s)
        self.pings = PingStrikes(limits.min_ping_interval_s, limits.max_ping_strikes, self._sent())
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
                head, flags, stream_id = FRAME_HEAD.unpack_from(buffer, position)
                length = head >> 8
                if length > max_frame:
                    raise H2ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes over {max_frame}")
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
        except H2ConnectionError as error:
            self._abort(error.code, error.reason)
        finally:
            del buffer[:position]
            self.flush()

    def _preface(self) -> bool:
        """Consume the client preface once it is all there; False while it is not."""
        buffer = self.buffer
        if len(buffer) < len(PREFACE):
            if not PREFACE.startswith(bytes(buffer)):
                raise H2ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            return False
        if buffer[: len(PREFACE)] != PREFACE:
            raise H2ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
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
            raise H2ConnectionError(PROTOCOL_ERROR, "expected CONTINUATION")
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
            raise H2ConnectionError(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # PRIORITY and unknown frame types are ignored, as the spec asks.

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise H2ConnectionError(PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)  # flow control counts padding too
        self.recv_window = window = self.recv_window - size
        if window < 0:
            raise H2ConnectionError(FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        call = self.calls.get(stream_id)
        if call is None or call.remote_closed:
            if stream_id > self.last_stream_id:
                raise H2ConnectionError(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            self._consumed(None, size)  # a call we already finished or reset: late frames are dropped
            return
        call.recv_window = window = call.recv_window - size
        if window < 0:
            raise H2ConnectionError(FLOW_CONTROL_ERROR, f"DATA beyond the window of stream {stream_id}")
        if flags & PADDED:
            payload = unpad(payload)
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
            compressed, length = MESSAGE_HEAD.unpack_from(buffer)
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
        self.write_frame(WINDOW_UPDATE, 0, call.stream_id, U32.pack(call.recv_credit))
        call.recv_credit = 0

    def _refill(self) -> None:
        if self.send_pending > self.limits.max_connection_send_bytes or self.transport is None:
            return  # the peer gets more window once it has read its answers (see drain)
        credit, self.recv_credit = self.recv_credit, 0
        self.recv_window += credit
        self.write_frame(WINDOW_UPDATE, 0, 0, U32.pack(credit))

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise H2ConnectionError(PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & PADDED:
            payload = unpad(payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if len(payload) > self.max_header_block:  # checked before HPACK spends any time on it
            limit = self.max_header_block
            raise H2ConnectionError(ENHANCE_YOUR_CALM, f"header block of {len(payload)} bytes over {limit}")
        if flags & END_HEADERS:
            self._on_header_block(flags, stream_id, payload)
        else:
            self.continuation = (stream_id, flags, bytearray(payload))
            self.continuation_frames = 0

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self.continuation is None or self.continuation[0] != stream_id:
            raise H2ConnectionError(PROTOCOL_ERROR, "unexpected CONTINUATION")
        limits = self.limits
        self.continuation_frames += 1
        if self.continuation_frames > limits.max_continuation_frames:
            count = limits.max_continuation_frames
            raise H2ConnectionError(ENHANCE_YOUR_CALM, f"over {count} CONTINUATION frames in a header block")
        block = self.continuation[2]
        block += payload
        if len(block) > limits.max_header_list_size:
            limit = limits.max_header_list_size
            raise H2ConnectionError(ENHANCE_YOUR_CALM, f"header block of {len(block)} bytes over {limit}")
        if flags & END_HEADERS:
            first_flags = self.continuation[1]
            self.continuation = None
            self._on_header_block(first_flags, stream_id, bytes(block))

    def _on_header_block(self, flags: int, stream_id: int, block: bytes) -> None:
        try:  # always decoded: the HPACK table must follow every block
            headers = self.decoder.decode(block)
        except (hpack.exceptions.HPACKError, UnicodeDecodeError) as exc:
            raise H2ConnectionError(COMPRESSION_ERROR, f"bad header block: {exc}") from exc
        call = self.calls.get(stream_id)
        if call is not None:  # trailers from the client
            if flags & END_STREAM and not call.remote_closed:
                self._remote_end(call)
            return
        if stream_id % 2 == 0:
            raise H2ConnectionError(PROTOCOL_ERROR, f"HEADERS opening stream {stream_id}")
        if stream_id <= self.last_stream_id:
            # A stream we finished or reset (refused, or done before the client half-closed): its
            # trailers may have been in flight, and frames after our RST_STREAM are to be ignored
            # (RFC 9113 5.1); like late DATA, they are dropped.
            return
        self.last_stream_id = stream_id
        if self.going_away or len(self.calls) >= self.limits.max_concurrent_streams:
            self.write_frame(RST_STREAM, 0, stream_id, U32.pack(REFUSED_STREAM))
            if not self.going_away and not self.resets.spend():  # a refusal costs us a frame too
                raise H2ConnectionError(ENHANCE_YOUR_CALM, "too many streams refused")
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
            raise H2ConnectionError(FRAME_SIZE_ERROR if stream_id else PROTOCOL_ERROR, "bad RST_STREAM")
        if stream_id > self.last_stream_id or not stream_id & 1:
            raise H2ConnectionError(PROTOCOL_ERROR, f"RST_STREAM on idle stream {stream_id}")
        call = self.calls.get(stream_id)
        if call is None:
            return  # already done on our side: nothing was cut short
        self._drop(call)
        # Only a stream reset before we answered anything spends the budget: that is the rapid
        # reset (work started for a stream that never waited for it). Envoy closes *and resets*
        # every ext_proc stream it is done with, often before our trailers: answered, not counted.
        if not call.headers_sent and not self.resets.spend():
            raise H2ConnectionError(ENHANCE_YOUR_CALM, "too many streams reset before an answer")

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise H2ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise H2ConnectionError(FRAME_SIZE_ERROR, "SETTINGS length")
        if not self.settings_budget.take():
            raise H2ConnectionError(ENHANCE_YOUR_CALM, "too many SETTINGS frames")
        window = self.peer_initial_window
        for offset in range(0, len(payload), 6):
            key, value = SETTING.unpack_from(payload, offset)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise H2ConnectionError(FLOW_CONTROL_ERROR, "initial window too large")
                window = value
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not MIN_MAX_FRAME <= value <= MAX_MAX_FRAME:
                    raise H2ConnectionError(PROTOCOL_ERROR, "bad max frame size")
                self.peer_max_frame = value
            # Header table size: our encoder never indexes, and zeroed the table (TABLE_SIZE_ZERO).
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
            raise H2ConnectionError(FRAME_SIZE_ERROR, "bad PING")
        if flags & ACK:
            return
        if self.pings.flood(self._sent()):
            raise H2ConnectionError(ENHANCE_YOUR_CALM, "too_many_pings")
        self.write_frame(PING, ACK, 0, payload)

    def _sent(self) -> tuple[int, int]:
        """What we sent, read off state we keep anyway (the send path pays nothing): a new stream
        means answers went out, a smaller send window means DATA did."""
        return self.last_stream_id, self.send_window

    def _on_goaway(self, payload: bytes) -> None:
        if len(payload) < 8:
            raise H2ConnectionError(FRAME_SIZE_ERROR, "bad GOAWAY")
        # Its last-stream-id counts streams *we* opened, and we open none: the calls in flight are
        # the client's own and may still finish (one going away on an error closes the socket).
        self.going_away = True
        self._close_if_idle()

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise H2ConnectionError(FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
        increment = U32.unpack(payload)[0] & 0x7FFFFFFF
        if stream_id == 0:
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise H2ConnectionError(FLOW_CONTROL_ERROR, "connection window overflow")
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
        self.write_frame(RST_STREAM, 0, call.stream_id, U32.pack(ENHANCE_YOUR_CALM))
        self._drop(call)
        if not self.resets.spend():
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
                self.write_frame(RST_STREAM, 0, call.stream_id, U32.pack(NO_ERROR))
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
        self.resets.earn_back()
        if self.going_away:
            self._close_if_idle()

    # -- frames out ---------------------------------------------------------------------------------
    def write_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        self.out.append(FRAME_HEAD.pack(len(payload) << 8 | kind, flags, stream_id))
        self.out.append(payload)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self.flush)

    def write_headers(self, flags: int, stream_id: int, block: bytes) -> None:
        if not self.table_size_sent:
            self.table_size_sent = True
            block = TABLE_SIZE_ZERO + block
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
            self.write_frame(GOAWAY, 0, 0, U32.pack(self.last_stream_id) + U32.pack(NO_ERROR) + debug)
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
            goaway = U32.pack(self.last_stream_id) + U32.pack(code) + reason.encode()
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
