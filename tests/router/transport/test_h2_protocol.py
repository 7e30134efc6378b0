"""The HTTP/2 gRPC server's protocol edges: grpcio interop, raw frames, flow control, shutdown, fuzz."""

from __future__ import annotations

import asyncio
import functools
import itertools
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import hpack
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from h2client import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    SETTINGS_HEADER_TABLE_SIZE,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    WINDOW_UPDATE,
    Frame,
    H2Client,
    frame,
    goaway,
    grpc_message,
    rst_stream,
    settings,
    window_update,
)
from helpers import eventually
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from router.adapters.health import CHECK_METHOD as HEALTH_CHECK_METHOD
from router.adapters.health import WATCH_METHOD as HEALTH_WATCH_METHOD
from router.adapters.health import HealthState
from router.transport.h2.connection import Call, Connection
from router.transport.h2.frames import FRAME_SIZE_ERROR, HeaderDecoder
from router.transport.h2.server import H2GrpcServer

ECHO = "/test.Echo/Bidi"  # echoes every message, finishes OK when the client half-closes
HOLD = "/test.Echo/Hold"  # records messages; the test finishes the call itself
MAX_STREAMS = 3
MAX_MESSAGE = 4096
CALL_TIMEOUT_S = 5.0


class Handler:
    """Records every callback. ``b"raise"`` makes on_message raise, ``b"finish"`` finishes the call."""

    def __init__(self, call: Call, *, echo: bool) -> None:
        self.call = call
        self.echo = echo
        self.messages: list[bytes] = []
        self.ends = 0
        self.cancels = 0

    def on_message(self, message: bytes) -> None:
        self.messages.append(message)
        if message == b"raise":
            raise RuntimeError("handler failure the test asked for")
        if self.echo:
            self.call.send(message)
        if message == b"finish":
            self.call.finish()

    def on_end(self) -> None:
        self.ends += 1
        if self.echo:
            self.call.finish()

    def on_cancel(self) -> None:
        self.cancels += 1


class Served:
    """Handler factories for the test server, and every handler they made, in order."""

    def __init__(self) -> None:
        self.handlers: list[Handler] = []

    def factory(self, *, echo: bool) -> Callable[[Call], Handler]:
        def make(call: Call) -> Handler:
            handler = Handler(call, echo=echo)
            self.handlers.append(handler)
            return handler

        return make

    async def handler(self, index: int) -> Handler:
        await eventually(lambda: len(self.handlers) > index, timeout_s=2, what=f"handler #{index}")
        return self.handlers[index]


class Env:
    """A running test server, its port and handlers; raw clients made here are closed at teardown."""

    def __init__(self, server: H2GrpcServer, port: int, served: Served) -> None:
        self.server = server
        self.port = port
        self.served = served
        self.clients: list[H2Client] = []

    async def connect(self, client_settings: dict[int, int] | None = None, **kw: Any) -> H2Client:
        client = await H2Client.connect(self.port, client_settings, **kw)
        self.clients.append(client)
        return client


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    served = Served()
    handlers = {ECHO: served.factory(echo=True), HOLD: served.factory(echo=False)}
    server = H2GrpcServer(handlers, max_concurrent_streams=MAX_STREAMS, max_message_bytes=MAX_MESSAGE)
    port = await server.start("127.0.0.1", 0)
    test_env = Env(server, port, served)
    try:
        yield test_env
    finally:
        for client in test_env.clients:
            await client.close()
        await server.stop(0)


def raw_stub(channel: grpc.aio.Channel, path: str) -> Callable[..., Any]:
    """A bytes-in, bytes-out stream-stream method; a deadline turns a hang into a failure."""
    method = channel.stream_stream(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    return functools.partial(method, timeout=CALL_TIMEOUT_S)


def of_stream(frames: list[Frame], stream_id: int) -> list[Frame]:
    return [f for f in frames if f.stream_id == stream_id]


def kinds(frames: list[Frame]) -> list[int]:
    return [f.kind for f in frames]


# -- interop with grpcio ----------------------------------------------------------------------------
async def test_grpcio_bidi_echo_streams_each_message_before_the_half_close(env: Env) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{env.port}") as channel:
        call = raw_stub(channel, ECHO)()
        for message in (b"one", b"", b"three" * 100):
            await call.write(message)
            assert await call.read() == message  # answered while the request stream is still open
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
    [handler] = env.served.handlers
    assert handler.messages == [b"one", b"", b"three" * 100]
    assert (handler.ends, handler.cancels) == (1, 0)


async def test_grpcio_unknown_method_is_unimplemented(env: Env) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{env.port}") as channel:
        call = raw_stub(channel, "/test.Echo/Nope")()  # headers only: the answer needs no message
        assert await call.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "/test.Echo/Nope" in await call.details()
    assert env.served.handlers == []


# The error tests write their message and then only wait for the status: a write or half-close
# racing the server's early trailers + RST_STREAM(NO_ERROR) makes grpcio report its own INTERNAL.
async def test_grpcio_handler_raising_is_internal_and_the_next_call_is_served(env: Env) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{env.port}") as channel:
        call = raw_stub(channel, ECHO)()
        await call.write(b"raise")
        assert await call.code() == grpc.StatusCode.INTERNAL
        # The failed handler was told its call is gone; the same connection serves the next call.
        assert env.served.handlers[0].cancels == 1
        assert [r async for r in raw_stub(channel, ECHO)(iter([b"a", b"b"]))] == [b"a", b"b"]
    assert env.served.handlers[1].call.conn is env.served.handlers[0].call.conn


async def test_grpcio_message_over_the_cap_is_resource_exhausted(env: Env) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{env.port}") as channel:
        call = raw_stub(channel, ECHO)()
        await call.write(b"x" * (MAX_MESSAGE + 1))
        assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert env.served.handlers[0].messages == []
        # Exactly at the cap is fine.
        assert [r async for r in raw_stub(channel, ECHO)(iter([b"y" * MAX_MESSAGE]))] == [b"y" * MAX_MESSAGE]


# -- raw frames -------------------------------------------------------------------------------------
@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"PRX"])
async def test_bad_preface_is_goaway_protocol_error_and_close(env: Env, garbage: bytes) -> None:
    client = await env.connect(handshake=False)
    await client.send(garbage)  # the short one is already not a prefix of the preface
    frames = await client.read_until_closed()
    assert kinds(frames) == [SETTINGS, WINDOW_UPDATE, GOAWAY]
    assert frames[-1].error_code == PROTOCOL_ERROR
    await eventually(lambda: not env.server.connections, what="connection forgotten")


async def test_preface_in_pieces_is_accepted(env: Env) -> None:
    client = await env.connect(handshake=False)
    for piece in (PREFACE[:5], PREFACE[5:20], PREFACE[20:] + settings()[:4], settings()[4:]):
        await client.send(piece)
    await client.send(client.request(1, ECHO), frame(DATA, END_STREAM, 1, grpc_message(b"hi")))
    result = await client.read_stream(1)
    assert result.messages == [b"hi"]
    assert result.trailers["grpc-status"] == "0"


async def test_ping_is_answered_with_ack_and_the_same_payload(env: Env) -> None:
    client = await env.connect()
    await client.send(frame(PING, 0, 0, b"\x01\x02\x03\x04\x05\x06\x07\x08"))
    answer = await client.read_frame()
    assert (answer.kind, answer.flags, answer.stream_id) == (PING, ACK, 0)
    assert answer.payload == b"\x01\x02\x03\x04\x05\x06\x07\x08"
    await client.send(frame(PING, ACK, 0, b"ackackac"))  # an ACK is not answered
    assert await client.barrier() == []


async def test_header_block_split_over_continuation_frames_is_served(env: Env) -> None:
    client = await env.connect()
    for stream_id in (1, 3):  # the second block leans on the HPACK table the first one filled
        block = client.header_block(ECHO)
        third = len(block) // 3
        await client.send(
            frame(HEADERS, 0, stream_id, block[:third]),
            frame(CONTINUATION, 0, stream_id, block[third : 2 * third]),
            frame(CONTINUATION, END_HEADERS, stream_id, block[2 * third :]),
            frame(DATA, END_STREAM, stream_id, grpc_message(b"split %d" % stream_id)),
        )
        result = await client.read_stream(stream_id)
        assert result.messages == [b"split %d" % stream_id]
        assert result.trailers["grpc-status"] == "0"


async def test_a_frame_between_headers_and_continuation_is_a_connection_error(env: Env) -> None:
    client = await env.connect()
    block = client.header_block(HOLD)
    await client.send(frame(HEADERS, 0, 1, block[:4]), frame(PING, 0, 0, b"8 bytes!"))
    frames = await client.read_until_closed()
    assert kinds(frames) == [GOAWAY]
    assert frames[0].error_code == PROTOCOL_ERROR


async def test_padded_and_priority_headers_and_padded_data_are_served(env: Env) -> None:
    client = await env.connect()
    block = client.header_block(ECHO)
    priority = struct.pack(">IB", 0, 15)  # depends on stream 0, weight 16
    headers = bytes([7]) + priority + block + b"\0" * 7
    body = grpc_message(b"padded body")
    data = bytes([200]) + body + b"\0" * 200
    await client.send(
        frame(HEADERS, END_HEADERS | PADDED | PRIORITY_FLAG, 1, headers),
        frame(DATA, PADDED, 1, data),
        frame(DATA, PADDED | END_STREAM, 1, b"\0"),  # padding length 0, nothing else
    )
    result = await client.read_stream(1)
    assert result.messages == [b"padded body"]
    assert result.trailers["grpc-status"] == "0"
    assert env.served.handlers[0].messages == [b"padded body"]


async def test_messages_split_across_frames_and_packed_in_one_frame_are_all_delivered(env: Env) -> None:
    client = await env.connect()
    first, second, third = b"a" * 300, b"", b"c" * 17
    wire = grpc_message(first)
    await client.send(
        client.request(1, ECHO),
        frame(DATA, 0, 1, wire[:3]),  # cut inside the length prefix
        frame(DATA, 0, 1, wire[3:100]),
        frame(DATA, 0, 1, b""),
        frame(DATA, 0, 1, wire[100:]),
        frame(DATA, END_STREAM, 1, grpc_message(second) + grpc_message(third)),
    )
    result = await client.read_stream(1)
    assert result.messages == [first, second, third]
    assert env.served.handlers[0].messages == [first, second, third]
    assert env.served.handlers[0].ends == 1


async def test_client_trailers_half_close_the_call(env: Env) -> None:
    client = await env.connect()
    opening = client.request(1, ECHO)  # encoded in wire order: the HPACK table follows it
    trailers = client.encoder.encode([("x-client-trailer", "1")])
    await client.send(
        opening,
        frame(DATA, 0, 1, grpc_message(b"m")),
        frame(HEADERS, END_HEADERS | END_STREAM, 1, trailers),
    )
    result = await client.read_stream(1)
    assert result.messages == [b"m"]
    assert env.served.handlers[0].ends == 1


async def test_a_stream_ending_inside_a_message_is_internal(env: Env) -> None:
    client = await env.connect()
    truncated = grpc_message(b"abcdef")[:7]
    await client.send(client.request(1, ECHO), frame(DATA, END_STREAM, 1, truncated))
    result = await client.read_stream(1)
    assert result.trailers["grpc-status"] == "13"
    handler = env.served.handlers[0]
    assert (handler.messages, handler.ends, handler.cancels) == ([], 0, 1)  # no clean end


async def test_compressed_message_is_unimplemented_in_trailers(env: Env) -> None:
    client = await env.connect()
    await client.send(client.request(1, ECHO), frame(DATA, 0, 1, grpc_message(b"zz", compressed=True)))
    result = await client.read_stream(1)
    [trailers] = result.frames  # trailers-only: nothing was sent before the error
    assert trailers.flags & END_STREAM
    assert trailers.headers[":status"] == "200"
    assert trailers.headers["grpc-status"] == "12"
    assert "compressed" in trailers.headers["grpc-message"]
    handler = env.served.handlers[0]
    assert (handler.messages, handler.cancels) == ([], 1)


async def test_unknown_method_with_a_huge_path_still_fits_one_frame(env: Env) -> None:
    client = await env.connect()
    # 8 KB of path (within the header list cap, sent without Huffman), 24 KB once percent-encoded.
    path = "/" + "\N{GRINNING FACE}" * 2000
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        ("content-type", "application/grpc"),
    ]
    block = client.encoder.encode(headers, huffman=False)
    await client.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, block))
    result = await client.read_stream(1)
    assert result.trailers["grpc-status"] == "12"
    assert all(len(f.payload) <= 16_384 for f in result.frames)  # the peer's max frame size
    assert await client.barrier() == []  # and the connection is fine


async def test_rst_stream_from_the_client_cancels_exactly_once(env: Env) -> None:
    client = await env.connect()
    await client.send(client.request(1, HOLD), frame(DATA, 0, 1, grpc_message(b"before")))
    handler = await env.served.handler(0)
    await client.send(rst_stream(1), rst_stream(1), frame(DATA, 0, 1, grpc_message(b"after")))
    assert await client.barrier() == []
    assert handler.cancels == 1
    assert handler.messages == [b"before"]  # late DATA on a reset stream is dropped
    handler.call.send(b"too late")  # and the handler's late answers go nowhere
    handler.call.finish()
    assert await client.barrier() == []
    await client.close()
    await eventually(lambda: not env.server.connections, what="connection gone")
    assert handler.cancels == 1


async def test_connection_dropped_mid_call_cancels_the_call(env: Env) -> None:
    client = await env.connect()
    await client.send(client.request(1, HOLD), client.request(3, ECHO, end_stream=True))
    handler = await env.served.handler(0)
    await client.read_stream(3)  # a finished call is not cancelled below
    await client.close()
    await eventually(lambda: handler.cancels == 1, what="on_cancel after the connection dropped")
    assert env.served.handlers[1].cancels == 0


async def test_streams_over_the_concurrency_limit_are_refused(env: Env) -> None:
    client = await env.connect()
    assert client.server_settings[SETTINGS_MAX_CONCURRENT_STREAMS] == MAX_STREAMS
    await client.send(*(client.request(s, HOLD) for s in (1, 3, 5)), client.request(7, HOLD))
    refused = await client.read_stream(7)
    assert kinds(refused.frames) == [RST_STREAM]
    assert refused.frames[0].error_code == REFUSED_STREAM
    assert len(env.served.handlers) == MAX_STREAMS
    # Finishing one frees a slot for the next stream.
    env.served.handlers[0].call.finish()
    await client.read_stream(1)
    await client.send(client.request(9, HOLD))
    handler = await env.served.handler(MAX_STREAMS)
    assert handler.call.stream_id == 9
    assert [h.cancels for h in env.served.handlers] == [0] * (MAX_STREAMS + 1)


async def test_late_frames_on_a_refused_stream_are_ignored(env: Env) -> None:
    client = await env.connect()
    await client.send(*(client.request(s, HOLD) for s in (1, 3, 5)))
    # Stream 7 is over the limit, and its message and trailers were sent before the refusal came.
    opening = client.request(7, HOLD)  # encoded in wire order: the HPACK table follows it
    trailers = client.encoder.encode([("x-client-trailer", "1")])
    await client.send(
        opening,
        frame(DATA, 0, 7, grpc_message(b"x")),
        frame(HEADERS, END_HEADERS | END_STREAM, 7, trailers),
    )
    frames = await client.barrier()
    assert [(f.kind, f.stream_id, f.error_code) for f in frames] == [(RST_STREAM, 7, REFUSED_STREAM)]
    assert [h.cancels for h in env.served.handlers] == [0] * MAX_STREAMS  # the others go on


async def test_send_side_flow_control_waits_for_the_peer_window(env: Env) -> None:
    client = await env.connect({SETTINGS_INITIAL_WINDOW_SIZE: 10})
    await client.send(client.request(1, HOLD), frame(DATA, END_STREAM, 1, grpc_message(b"go")))
    handler = await env.served.handler(0)
    message = bytes(range(30))
    handler.call.send(message)  # 35 bytes on the wire with its prefix
    handler.call.finish()

    sent = of_stream(await client.barrier(), 1)
    assert kinds(sent) == [HEADERS, DATA]
    assert len(sent[1].payload) == 10
    wire = sent[1].payload

    await client.send(window_update(1, 10))
    sent = of_stream(await client.barrier(), 1)
    assert kinds(sent) == [DATA]
    assert len(sent[0].payload) == 10
    wire += sent[0].payload

    # A larger initial window applies to open streams too (and the trailers still wait).
    await client.send(settings({SETTINGS_INITIAL_WINDOW_SIZE: 20}))
    sent = of_stream(await client.barrier(), 1)
    assert kinds(sent) == [DATA]
    assert len(sent[0].payload) == 10
    wire += sent[0].payload

    await client.send(window_update(1, 100))
    sent = of_stream(await client.barrier(), 1)
    assert kinds(sent) == [DATA, HEADERS]  # the last 5 bytes, then trailers; no RST: client half-closed
    wire += sent[0].payload
    assert sent[1].flags & END_STREAM and sent[1].headers["grpc-status"] == "0"
    assert wire == grpc_message(message)


async def test_send_side_respects_the_connection_window_and_max_frame_size(env: Env) -> None:
    client = await env.connect({SETTINGS_INITIAL_WINDOW_SIZE: 1 << 20})
    await client.send(client.request(1, HOLD, end_stream=True))
    handler = await env.served.handler(0)
    message = b"m" * 70_000
    handler.call.send(message)
    handler.call.finish()
    sent = of_stream(await client.barrier(), 1)
    data = [f for f in sent if f.kind == DATA]
    assert kinds(sent) == [HEADERS] + [DATA] * len(data)  # no trailers yet
    assert sum(len(f.payload) for f in data) == 65_535  # the default connection window
    assert max(len(f.payload) for f in data) <= 16_384  # the default max frame size
    await client.send(window_update(0, 10_000))
    sent = of_stream(await client.barrier(), 1)
    assert kinds(sent) == [DATA, HEADERS]
    wire = b"".join(f.payload for f in data) + sent[0].payload
    assert wire == grpc_message(message)


async def test_finishing_before_the_client_half_closes_sends_trailers_then_rst_no_error(env: Env) -> None:
    client = await env.connect()
    await client.send(client.request(1, ECHO), frame(DATA, 0, 1, grpc_message(b"finish")))
    result = await client.read_stream(1)
    assert kinds(result.frames) == [HEADERS, DATA, HEADERS]
    assert result.messages == [b"finish"]
    reset = await client.read_frame()
    assert (reset.kind, reset.stream_id, reset.error_code) == (RST_STREAM, 1, NO_ERROR)
    assert env.served.handlers[0].cancels == 0


async def test_finishing_after_the_half_close_sends_no_rst(env: Env) -> None:
    client = await env.connect()
    # on_end finishes (stream 1); on_message finishes with END_STREAM on the same frame (stream 3)
    await client.send(client.request(1, ECHO), frame(DATA, END_STREAM, 1, grpc_message(b"x")))
    await client.send(client.request(3, ECHO), frame(DATA, END_STREAM, 3, grpc_message(b"finish")))
    frames = await client.barrier()
    for stream_id in (1, 3):
        assert kinds(of_stream(frames, stream_id)) == [HEADERS, DATA, HEADERS]
    assert env.served.handlers[1].ends == 0  # finished before the half-close was seen


async def test_goaway_from_the_client_lets_open_calls_finish(env: Env) -> None:
    client = await env.connect()
    await client.send(client.request(1, ECHO), frame(DATA, 0, 1, grpc_message(b"one")))
    assert kinds(await client.barrier()) == [HEADERS, DATA]
    # A client's GOAWAY names the last *server*-initiated stream (none here): stream 1 goes on.
    await client.send(goaway(0))
    await client.send(frame(DATA, END_STREAM, 1, grpc_message(b"two")))
    frames = await client.read_until_closed()  # the server closes once the call is done
    assert kinds(frames) == [DATA, HEADERS]
    assert frames[-1].headers["grpc-status"] == "0"
    assert env.served.handlers[0].messages == [b"one", b"two"]
    assert env.served.handlers[0].cancels == 0


async def test_a_client_shrinking_the_hpack_table_gets_a_size_update(env: Env) -> None:
    client = await env.connect({SETTINGS_HEADER_TABLE_SIZE: 0})
    client.decoder.max_allowed_table_size = 0  # the check nghttp2 (Envoy) and python-h2 make
    for stream_id in (1, 3):
        await client.send(
            client.request(stream_id, ECHO), frame(DATA, END_STREAM, stream_id, grpc_message(b"t"))
        )
        result = await client.read_stream(stream_id)  # decoding raises without the size update
        assert result.messages == [b"t"]
        assert result.trailers["grpc-status"] == "0"
    assert client.decoder.header_table_size == 0


async def test_headers_on_an_even_stream_is_a_connection_error(env: Env) -> None:
    client = await env.connect()
    await client.send(client.request(2, ECHO))
    frames = await client.read_until_closed()
    assert kinds(frames) == [GOAWAY]
    assert frames[0].error_code == PROTOCOL_ERROR


async def test_padding_is_credited_back_to_the_stream_window(env: Env) -> None:
    env.server.stream_refill_at = 500  # top-ups after 500 consumed bytes, not half a stream window
    client = await env.connect()
    await client.send(client.request(1, HOLD))
    body = grpc_message(b"p" * 100)
    await client.send(frame(DATA, PADDED, 1, bytes([255]) + body + b"\0" * 255))  # 361 bytes
    await client.send(frame(DATA, PADDED, 1, bytes([255]) + body + b"\0" * 255))
    updates = [f for f in await client.barrier() if f.kind == WINDOW_UPDATE and f.stream_id == 1]
    assert [struct.unpack(">I", f.payload)[0] for f in updates] == [722]  # padding included
    assert env.served.handlers[0].messages == [b"p" * 100] * 2


# -- graceful stop ----------------------------------------------------------------------------------
async def test_stop_sends_goaway_and_an_open_call_can_finish_within_grace(env: Env) -> None:
    client = await env.connect()
    await client.send(client.request(1, HOLD), frame(DATA, 0, 1, grpc_message(b"working")))
    handler = await env.served.handler(0)
    stopping = asyncio.create_task(env.server.stop(5.0))
    notice = await client.read_frame()
    assert notice.kind == GOAWAY and notice.error_code == NO_ERROR
    assert struct.unpack_from(">I", notice.payload)[0] == 1  # the last stream we will serve
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", env.port)  # no longer listening
    await client.send(client.request(3, ECHO))  # a new stream on the old connection is refused
    refused = await client.read_stream(3)
    assert refused.frames[0].error_code == REFUSED_STREAM
    await client.send(frame(DATA, 0, 1, grpc_message(b"more")))
    await eventually(lambda: handler.messages == [b"working", b"more"], what="the call still served")
    handler.call.send(b"result")
    handler.call.finish()
    frames = await client.read_until_closed()  # then the server closes the idle connection
    assert kinds(frames) == [HEADERS, DATA, HEADERS, RST_STREAM]
    assert frames[2].headers["grpc-status"] == "0"
    await asyncio.wait_for(stopping, 1.0)  # long before the 5 s grace
    assert handler.cancels == 0


async def test_stop_cancels_calls_still_open_after_grace(env: Env) -> None:
    client = await env.connect()
    await client.send(client.request(1, HOLD), client.request(3, HOLD))
    await env.served.handler(1)
    await env.server.stop(0.05)
    assert [h.cancels for h in env.served.handlers] == [1, 1]
    frames = await client.read_until_closed()
    assert kinds(frames) == [GOAWAY]
    await eventually(lambda: not env.server.connections, what="connection closed")


async def test_shutting_down_a_connection_the_peer_already_reset_is_quiet(env: Env) -> None:
    """A peer that sent GOAWAY, then reset its socket before we noticed: our half-close meets
    ENOTCONN, which must not escape into stop()."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", env.port))
        wire = PREFACE + settings() + frame(HEADERS, END_HEADERS, 1, _request_block(HOLD)) + goaway(0)
        await loop.sock_sendall(sock, wire + frame(PING, 0, 0, b"barrier!"))
        seen = b""
        while frame(PING, ACK, 0, b"barrier!") not in seen:  # the server has handled all of it
            seen += await loop.sock_recv(sock, 65_536)
        [conn] = env.server.connections
        assert conn.going_away and conn.calls
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        sock.close()  # with SO_LINGER 0: a reset, delivered at once on loopback
    time.sleep(0.05)  # blocking on purpose: the loop must not run, it would notice the reset first
    conn.abort_calls()  # what stop() does after its grace period
    await eventually(lambda: not env.server.connections and not env.server.closing, what="forgotten")


# -- health through the real extproc pieces ---------------------------------------------------------
async def test_health_watch_streams_the_status_then_changes_and_cancel_unwatches() -> None:
    state = HealthState()
    server = H2GrpcServer({HEALTH_CHECK_METHOD: state.check, HEALTH_WATCH_METHOD: state.watch})
    state.set_ready(False)
    port = await server.start("127.0.0.1", 0)
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"), timeout=CALL_TIMEOUT_S)
            assert (await watch.read()).status == not_serving
            assert len(state.watchers["readiness"]) == 1
            state.set_ready(True)
            assert (await watch.read()).status == serving
            check = await stub.Check(
                health_pb2.HealthCheckRequest(service="liveness"), timeout=CALL_TIMEOUT_S
            )
            assert check.status == serving
            watch.cancel()
            await eventually(lambda: not state.watchers["readiness"], timeout_s=2, what="watcher removed")
            state.set_ready(False)  # nothing left to send to
    finally:
        await server.stop(0)


# -- fuzz -------------------------------------------------------------------------------------------
class FakeTransport:
    def __init__(self) -> None:
        self.written = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        if not self.closed:  # what asyncio does: writes after close are dropped
            self.written += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def parse_frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """Everything the server wrote must be whole frames."""
    frames, position = [], 0
    while position < len(data):
        assert len(data) - position >= 9, "a truncated frame head"
        length_kind, flags, stream_id = struct.unpack_from(">IBI", data, position)
        end = position + 9 + (length_kind >> 8)
        assert end <= len(data), "a truncated frame"
        frames.append((length_kind & 0xFF, flags, stream_id, data[position + 9 : end]))
        position = end
    return frames


async def test_control_frames_of_the_wrong_length_are_frame_size_errors(env: Env) -> None:
    valid: dict[int, Callable[[int], bool]] = {
        PING: lambda n: n == 8,
        SETTINGS: lambda n: n % 6 == 0,
        WINDOW_UPDATE: lambda n: n == 4,
        RST_STREAM: lambda n: n == 4,
        GOAWAY: lambda n: n >= 8,  # then optional debug data
    }
    cases = [(PING, 0), (SETTINGS, 0), (WINDOW_UPDATE, 0), (WINDOW_UPDATE, 1), (RST_STREAM, 1), (GOAWAY, 0)]
    for kind, stream_id in cases:
        for length in range(14):
            transport = FakeTransport()
            conn = Connection(env.server)
            conn.connection_made(transport)  # type: ignore[arg-type]
            # A stream's frames go to an open stream (RST_STREAM on an idle one is an error too).
            opening = frame(HEADERS, END_HEADERS, stream_id, _request_block(HOLD)) if stream_id else b""
            conn.data_received(PREFACE + opening + frame(kind, 0, stream_id, bytes(length)))
            conn.connection_lost(None)
            goaways = [f for f in parse_frames(bytes(transport.written)) if f[0] == GOAWAY]
            codes = [struct.unpack_from(">I", f[3], 4)[0] for f in goaways]
            assert codes == ([] if valid[kind](length) else [FRAME_SIZE_ERROR]), (kind, length)


def _request_block(path: str) -> bytes:
    return hpack.Encoder().encode(
        [(":method", "POST"), (":path", path), ("content-type", "application/grpc")]
    )


_stream_ids = st.sampled_from([0, 1, 3, 5, 7, 2, 0x80000001])
_flags = st.sampled_from([0, END_STREAM, END_HEADERS, END_HEADERS | END_STREAM, PADDED]) | st.integers(0, 255)
# Mostly frames that parse, so that a sequence gets past its first error into later states.
_frames = st.one_of(
    st.builds(frame, st.integers(0, 10), _flags, _stream_ids, st.binary(max_size=24)),
    st.builds(  # connection-level frames with payloads of any short length
        lambda kind, payload: frame(kind, 0, 0, payload),
        st.sampled_from([PRIORITY, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE]),
        st.binary(max_size=13),
    ),
    st.builds(
        lambda flags, stream_id, path: frame(HEADERS, flags, stream_id, _request_block(path)),
        st.sampled_from([END_HEADERS, END_HEADERS | END_STREAM, 0, END_STREAM]),
        st.sampled_from([1, 3, 5, 7]),
        st.sampled_from([ECHO, HOLD, "/nope"]),
    ),
    st.builds(
        lambda flags, stream_id, body: frame(DATA, flags, stream_id, grpc_message(body)),
        st.sampled_from([0, END_STREAM]),
        st.sampled_from([1, 3, 5, 7]),
        st.sampled_from([b"", b"x", b"finish", b"raise", b"y" * 5000]),
    ),
    st.sampled_from(
        [
            frame(CONTINUATION, END_HEADERS, 1, _request_block(ECHO)),
            settings({SETTINGS_INITIAL_WINDOW_SIZE: 3}),
            settings({SETTINGS_INITIAL_WINDOW_SIZE: 2**31}),
            window_update(0, 2**31 - 1),
            window_update(1, 2**31 - 1),
            window_update(3, 0),
            rst_stream(1),
            goaway(0),
            frame(PING, 0, 0, bytes(8)),
        ]
    ),
)


async def test_fuzzed_frames_never_raise_and_the_server_keeps_serving(env: Env) -> None:
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))

    @hypothesis_settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        frames=st.lists(_frames, max_size=16),
        garbage=st.binary(max_size=16),
        cuts=st.lists(st.integers(0, 10_000), max_size=4),
    )
    def feed(frames: list[bytes], garbage: bytes, cuts: list[int]) -> None:
        transport = FakeTransport()
        conn = Connection(env.server)
        conn.connection_made(transport)  # type: ignore[arg-type]
        handlers_before = len(env.served.handlers)
        conn.data_received(PREFACE + settings())
        wire = b"".join(frames) + garbage  # delivered in reads cut at arbitrary points
        points = [0, *sorted(cut % (len(wire) + 1) for cut in cuts), len(wire)]
        for start, end in itertools.pairwise(points):
            conn.data_received(wire[start:end])
        conn.flush()
        written = parse_frames(bytes(transport.written))
        if conn.transport is None and not conn.going_away:  # a connection error: GOAWAY says why
            assert written[-1][0] == GOAWAY
        conn.connection_lost(None)
        for handler in env.served.handlers[handlers_before:]:
            assert handler.cancels <= 1
            assert handler.cancels == 1 or handler.call.finished  # nothing is left dangling
        assert conn not in env.server.connections

    try:
        feed()
    finally:
        loop.set_exception_handler(None)
    assert unhandled == []
    client = await env.connect()
    await client.send(client.request(1, ECHO), frame(DATA, END_STREAM, 1, grpc_message(b"still here")))
    assert (await client.read_stream(1)).messages == [b"still here"]


# -- the header-block cache --------------------------------------------------------------------------


def test_a_repeated_block_is_decoded_once_and_a_table_change_invalidates_it() -> None:
    encoder, decoder = hpack.Encoder(), HeaderDecoder()
    first = encoder.encode([(":path", "/a"), ("x-a", "1")])  # inserts x-a: 1 into the table
    assert decoder.decode(first) == {":path": "/a", "x-a": "1"} and not decoder.cache
    index = encoder.encode([("x-a", "1")])  # now one byte: the dynamic-table index of x-a
    assert decoder.decode(index) == {"x-a": "1"} and index in decoder.cache
    assert decoder.decode(index) == {"x-a": "1"}  # served from the cache
    decoder.decode(encoder.encode([("x-b", "2")]))  # an insertion: x-b takes x-a's index
    assert index not in decoder.cache
    assert decoder.decode(index) == {"x-b": "2"}


def test_an_insertion_at_a_full_table_is_seen_even_when_it_keeps_the_size() -> None:
    encoder, decoder = hpack.Encoder(), HeaderDecoder()
    encoder.header_table_size = decoder.hpack.max_allowed_table_size = 64  # room for one entry
    decoder.decode(encoder.encode([("x-a", "11")]))
    index = encoder.encode([("x-a", "11")])
    assert decoder.decode(index) == {"x-a": "11"} and index in decoder.cache
    decoder.decode(encoder.encode([("x-a", "12")]))  # evicts x-a: 11, same length and entry size
    assert decoder.decode(index) == {"x-a": "12"}
