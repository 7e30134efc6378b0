"""Every ``H2Limits`` bound crossed on raw frames, while a well-behaved client is served meanwhile.

Each test runs a grpcio health checker on its own connection (``Checker``: checks back to back)
and an attacker on raw frames (``tests/h2client.py``). It asserts what happened to the attacking
connection (GOAWAY with the code RFC 9113 or ``H2Limits`` names, then closed; or its memory
bounded) and that the checker's connection was never touched and kept being answered: no check
failed, and checks were answered after the attack began (during it, where the attack lasts long
enough to have a "during"). Speeds are not asserted: ``loadtests/bench/h2_attacks.py`` measures them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import select
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from h2client import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    NO_ERROR,
    PING,
    PREFACE,
    PRIORITY,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    WINDOW_UPDATE,
    Frame,
    H2Client,
    frame,
    grpc_message,
    rst_stream,
    settings,
    window_update,
)
from helpers import eventually

from router.adapters.health import HealthState
from router.transport.h2.connection import Call, Connection
from router.transport.h2.limits import H2Limits
from router.transport.h2.server import H2GrpcServer

ECHO = "/test.Echo/Bidi"  # echoes each message, finishes when the client half-closes
HOLD = "/test.Echo/Hold"  # never answers: the call stays open until the client goes
PUSH = "/test.Echo/Push"  # answers each message with PUSH_COUNT messages of PUSH_SIZE bytes
PUSH_COUNT, PUSH_SIZE = 4, 60_000
SERVING = health_pb2.HealthCheckResponse.SERVING


class Handler:
    def __init__(self, call: Call, mode: str) -> None:
        self.call = call
        self.mode = mode
        self.cancels = 0

    def on_message(self, message: bytes) -> None:
        if self.mode == "echo":
            self.call.send(message)
        elif self.mode == "push":
            for _ in range(PUSH_COUNT):
                self.call.send(b"p" * PUSH_SIZE)

    def on_end(self) -> None:
        if self.mode != "hold":
            self.call.finish()

    def on_cancel(self) -> None:
        self.cancels += 1


class Env:
    """A server with health, echo, hold and push methods; the attacker's raw clients and handlers."""

    def __init__(self, server: H2GrpcServer, port: int) -> None:
        self.server = server
        self.port = port
        self.handlers: list[Handler] = []
        self.clients: list[H2Client] = []

    def factory(self, mode: str) -> Callable[[Call], Handler]:
        def make(call: Call) -> Handler:
            handler = Handler(call, mode)
            self.handlers.append(handler)
            return handler

        return make

    async def connect(self, client_settings: dict[int, int] | None = None, **kw: Any) -> H2Client:
        client = await H2Client.connect(self.port, client_settings, **kw)
        self.clients.append(client)
        return client

    def attacker(self, known: set[Connection]) -> Connection:
        """The server side of the one connection that is not in ``known``."""
        [conn] = [c for c in self.server.connections if c not in known]
        return conn


Serve = Callable[..., Awaitable[Env]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """``await serve(**limits)``: a running server with those ``H2Limits`` fields changed."""
    envs: list[Env] = []

    async def start(**changes: Any) -> Env:
        health = HealthState()
        health.set_ready(True)
        server = H2GrpcServer({}, limits=dataclasses.replace(H2Limits(), **changes))
        env = Env(server, 0)
        server.handlers.update(
            {
                **health.methods(),
                ECHO: env.factory("echo"),
                HOLD: env.factory("hold"),
                PUSH: env.factory("push"),
            }
        )
        env.port = await server.start("127.0.0.1", 0)
        envs.append(env)
        return env

    try:
        yield start
    finally:
        for env in envs:
            for client in env.clients:
                await client.close()
            await env.server.stop(0)


class Checker:
    """A well-behaved client on its own connection: grpcio health checks, back to back."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{env.port}")
        self.stub = health_pb2_grpc.HealthStub(self.channel)
        self.answered: list[float] = []  # loop times at which checks were answered SERVING
        self.failures: list[str] = []
        self.task: asyncio.Task[None] | None = None
        self.connections: set[Connection] = set()

    async def check(self) -> None:
        request = health_pb2.HealthCheckRequest(service="liveness")
        try:
            reply = await self.stub.Check(request, timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            self.failures.append(f"{exc.code()}: {exc.details()}")
            return
        if reply.status != SERVING:
            self.failures.append(f"status {reply.status}")
        else:
            self.answered.append(asyncio.get_running_loop().time())

    async def _run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(0.001)

    async def __aenter__(self) -> Checker:
        await self.check()
        self.connections = set(self.env.server.connections)  # the checker's own, and only it
        assert len(self.connections) == 1
        self.task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.channel.close()

    def answered_between(self, start: float, end: float) -> int:
        return sum(start <= t <= end for t in self.answered)

    async def still_served(self, since: float) -> None:
        """More checks are answered after ``since``, on the very connection it started with."""
        await eventually(lambda: self.answered_between(since, float("inf")) >= 3, 5.0, "checks answered")
        assert self.failures == []
        assert self.connections <= set(self.env.server.connections), "the checker's connection was closed"


def now() -> float:
    return asyncio.get_running_loop().time()


async def flood(client: H2Client, data: bytes, chunk: int = 64 * 1024) -> int:
    """Write ``data`` in pieces until done or the server closed on us; returns the bytes written."""
    written = 0
    with contextlib.suppress(ConnectionError):
        for start in range(0, len(data), chunk):
            await client.send(data[start : start + chunk])
            written += min(chunk, len(data) - start)
    return written


async def goaway_then_closed(client: H2Client) -> tuple[Frame, list[Frame]]:
    """Read until the server closes; exactly one GOAWAY, the last frame. Returns it and all frames."""
    frames = await client.read_until_closed(timeout_s=5.0)
    goaways = [f for f in frames if f.kind == GOAWAY]
    assert len(goaways) == 1 and frames[-1] is goaways[0], [f.kind for f in frames]
    return goaways[0], frames


def reason(goaway: Frame) -> str:
    return goaway.payload[8:].decode()


class Slices:
    """Counts the times ``conn`` cuts a read short and gives the loop to the others (``_defer``)."""

    def __init__(self, conn: Connection) -> None:
        self.count = 0
        original = conn._defer

        def counting() -> None:
            self.count += 1
            original()

        conn._defer = counting  # type: ignore[method-assign]


# -- rapid reset ------------------------------------------------------------------------------------
async def test_rapid_reset_spends_the_reset_budget_then_goaway(serve: Serve) -> None:
    env = await serve()  # the default budget: 1000 resets, refilled at 100/s
    limits = env.server.limits
    async with Checker(env) as checker:
        client = await env.connect()
        pairs = [client.request(2 * i + 1, HOLD) + rst_stream(2 * i + 1) for i in range(20_000)]
        started = now()
        await flood(client, b"".join(pairs))
        goaway, _ = await goaway_then_closed(client)
        ended = now()
        assert goaway.error_code == ENHANCE_YOUR_CALM
        assert reason(goaway) == "too many streams reset before an answer"
        # Streams the server started before it stopped: the burst and what refilled meanwhile.
        assert (
            limits.reset_burst
            <= len(env.handlers)
            <= limits.reset_burst + limits.reset_refill_per_s * (ended - started) + 1
        )
        assert all(h.cancels == 1 for h in env.handlers)
        await checker.still_served(started)  # the attack is over in milliseconds: served after it


async def test_calls_that_complete_earn_back_the_reset_budget(serve: Serve) -> None:
    """What Envoy does (many streams, a share reset as clients go away) never runs out."""
    env = await serve(reset_burst=20, reset_refill_per_s=0.001)
    client = await env.connect()
    for batch in range(30):  # 600 streams: every other one reset, 300 resets against a budget of 20
        out = []
        for i in range(20):
            stream_id = 2 * (batch * 20 + i) + 1
            out.append(client.request(stream_id, ECHO))
            if i % 2:
                out.append(rst_stream(stream_id))
            else:
                out.append(frame(DATA, END_STREAM, stream_id, grpc_message(b"done")))
        await client.send(*out)
        assert all(f.kind != GOAWAY for f in await client.barrier())
    assert sum(h.cancels for h in env.handlers) == 300


async def test_streams_reset_after_an_answer_never_spend_the_budget(serve: Serve) -> None:
    """What Envoy does with every ext_proc stream it is done with: half-close and reset, often
    before our trailers. Answered streams were no free work: the budget is not spent."""
    env = await serve(reset_burst=5, reset_refill_per_s=0.001)
    client = await env.connect()
    for batch in range(10):
        out = []
        for i in range(100):  # 1,000 streams, each answered (echoed) and then reset while still open
            stream_id = 2 * (batch * 100 + i) + 1
            out += [client.request(stream_id, ECHO), frame(DATA, 0, stream_id, grpc_message(b"m"))]
            out.append(rst_stream(stream_id))
        await client.send(*out)
        frames = await client.barrier()
        assert all(f.kind != GOAWAY for f in frames)
    assert len(env.handlers) == 1000 and all(h.cancels == 1 for h in env.handlers)


async def test_refused_streams_spend_the_reset_budget(serve: Serve) -> None:
    env = await serve(max_concurrent_streams=2, reset_burst=10, reset_refill_per_s=0.001)
    async with Checker(env) as checker:
        client = await env.connect()
        started = now()
        await client.send(*(client.request(2 * i + 1, HOLD) for i in range(100)))
        goaway, frames = await goaway_then_closed(client)
        refused = [f for f in frames if f.kind == RST_STREAM and f.error_code == REFUSED_STREAM]
        assert goaway.error_code == ENHANCE_YOUR_CALM and "refused" in reason(goaway)
        assert len(refused) == 11  # the budget, then the one that crossed it
        await checker.still_served(started)


# -- header blocks ----------------------------------------------------------------------------------
async def test_continuation_flood_is_cut_at_the_frame_cap(serve: Serve) -> None:
    env = await serve()
    cap = env.server.limits.max_continuation_frames
    async with Checker(env) as checker:
        client = await env.connect()
        block = client.header_block(HOLD)
        flood_frames = frame(HEADERS, 0, 1, block) + frame(CONTINUATION, 0, 1) * 200_000
        started = now()
        written = await flood(client, flood_frames)
        goaway, _ = await goaway_then_closed(client)
        assert goaway.error_code == ENHANCE_YOUR_CALM
        assert f"over {cap} CONTINUATION" in reason(goaway)
        assert env.handlers == [] and written > 0
        await checker.still_served(started)


async def test_a_split_block_within_the_caps_is_served(serve: Serve) -> None:
    env = await serve()
    cap = env.server.limits.max_continuation_frames
    client = await env.connect()
    block = client.header_block(ECHO, **{"x-pad": "p" * 2000})
    size = -(-len(block) // (cap + 1))  # exactly the cap of CONTINUATION frames after the HEADERS
    pieces = [block[i : i + size] for i in range(0, len(block), size)]
    assert len(pieces) == cap + 1
    out = [frame(HEADERS, 0, 1, pieces[0])]
    out += [frame(CONTINUATION, 0, 1, p) for p in pieces[1:-1]]
    out += [frame(CONTINUATION, END_HEADERS, 1, pieces[-1]), frame(DATA, END_STREAM, 1, grpc_message(b"ok"))]
    await client.send(*out)
    assert (await client.read_stream(1)).messages == [b"ok"]


async def test_a_frame_over_max_frame_size_is_refused_from_its_head(serve: Serve) -> None:
    """The table's 800 KB HEADERS frame: refused when its 9-byte head arrives, nothing buffered."""
    env = await serve()
    async with Checker(env) as checker:
        client = await env.connect()
        assert client.server_settings[SETTINGS_MAX_FRAME_SIZE] == env.server.limits.max_frame_size
        started = now()
        head = struct.pack(">IBI", 800_000 << 8 | HEADERS, END_HEADERS, 1)
        await client.send(head + b"\x00" * 100)  # the head and a sliver of the block, no more
        goaway, _ = await goaway_then_closed(client)
        assert goaway.error_code == FRAME_SIZE_ERROR
        await checker.still_served(started)


async def test_a_header_block_over_the_list_size_is_refused_before_hpack(serve: Serve) -> None:
    """Checked on a HEADERS frame with END_HEADERS too, not only on CONTINUATION."""
    env = await serve(max_frame_size=1 << 20)  # frames may be large: the header cap must hold alone
    decoded: list[tuple[Connection, int]] = []
    original = Connection._on_header_block

    def recording(conn: Connection, flags: int, stream_id: int, block: bytes) -> None:
        decoded.append((conn, len(block)))
        original(conn, flags, stream_id, block)

    async with Checker(env) as checker:
        client = await env.connect()
        attacker = env.attacker(checker.connections)
        limit = client.server_settings[SETTINGS_MAX_HEADER_LIST_SIZE]
        started = now()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Connection, "_on_header_block", recording)
            await flood(client, frame(HEADERS, END_HEADERS, 1, b"\xff" * 800_000))  # garbage for HPACK
            goaway, _ = await goaway_then_closed(client)
        assert goaway.error_code == ENHANCE_YOUR_CALM  # not COMPRESSION_ERROR: HPACK never ran
        assert f"over {limit}" in reason(goaway)
        assert [size for conn, size in decoded if conn is attacker] == []
        await checker.still_served(started)


async def test_a_header_block_over_the_list_size_across_continuations_is_refused(serve: Serve) -> None:
    env = await serve(max_header_list_size=4096)
    async with Checker(env) as checker:
        client = await env.connect()
        block = client.header_block(HOLD, **{"x-pad": "p" * 8000})  # ~6 KB once Huffman-coded
        started = now()
        await client.send(
            frame(HEADERS, 0, 1, block[:3000]), frame(CONTINUATION, END_HEADERS, 1, block[3000:])
        )
        goaway, _ = await goaway_then_closed(client)
        assert goaway.error_code == ENHANCE_YOUR_CALM and "over 4096" in reason(goaway)
        await checker.still_served(started)


def _hpack_bomb(client: H2Client) -> bytes:
    """One field inserted into the table, then indexed 4,000 times: ~300 KB decoded from ~4 KB."""
    encoder = client.encoder
    first = encoder.encode([("x-bomb", "v" * 40)])
    again = encoder.encode([("x-bomb", "v" * 40)])  # the one-byte index of the field just inserted
    return frame(HEADERS, END_HEADERS, 1, first + again * 4000)


def _huge_frame(client: H2Client) -> bytes:
    return struct.pack(">IBI", (16 << 20) - 1 << 8 | DATA, 0, 1)


@pytest.mark.parametrize(
    ("attack", "code"),
    [(_hpack_bomb, COMPRESSION_ERROR), (_huge_frame, FRAME_SIZE_ERROR)],
    ids=["bomb", "16MiB"],
)
async def test_what_already_held_still_holds(
    serve: Serve, attack: Callable[[H2Client], bytes], code: int
) -> None:
    env = await serve()
    async with Checker(env) as checker:
        client = await env.connect()
        started = now()
        await client.send(attack(client))
        goaway, _ = await goaway_then_closed(client)
        assert goaway.error_code == code
        await checker.still_served(started)


# -- SETTINGS and PING floods -----------------------------------------------------------------------
async def test_settings_flood_is_goaway_after_the_burst(serve: Serve) -> None:
    env = await serve()
    burst = env.server.limits.settings_burst
    async with Checker(env) as checker:
        client = await env.connect()  # its handshake SETTINGS spent one
        started = now()
        await flood(client, settings() * 100_000)  # ACKs never read while sending
        goaway, frames = await goaway_then_closed(client)
        assert goaway.error_code == ENHANCE_YOUR_CALM and "SETTINGS" in reason(goaway)
        acks = [f for f in frames if f.kind == SETTINGS and f.flags & ACK]
        assert len(acks) <= burst  # bounded by the budget (a little refills while it runs)
        await checker.still_served(started)


async def test_ping_flood_is_goaway_after_the_strikes(serve: Serve) -> None:
    env = await serve()
    strikes = env.server.limits.max_ping_strikes
    async with Checker(env) as checker:
        client = await env.connect()
        started = now()
        await flood(client, frame(PING, 0, 0, b"12345678") * 100_000)  # ACKs never read
        goaway, frames = await goaway_then_closed(client)
        assert goaway.error_code == ENHANCE_YOUR_CALM and reason(goaway) == "too_many_pings"
        assert len([f for f in frames if f.kind == PING]) == strikes + 1  # the first is no strike
        await checker.still_served(started)


async def test_pings_between_answered_calls_are_no_strikes(serve: Serve) -> None:
    """Keepalive and BDP pings of a client that gets answers never count (grpc-core's rule)."""
    env = await serve(max_ping_strikes=1)
    client = await env.connect()
    for i in range(20):
        stream_id = 2 * i + 1
        await client.send(
            client.request(stream_id, ECHO),
            frame(DATA, END_STREAM, stream_id, grpc_message(b"x")),
            frame(PING, 0, 0, struct.pack(">Q", i)),
        )
        assert (await client.read_stream(stream_id)).messages == [b"x"]
    assert all(f.kind != GOAWAY for f in await client.barrier())


# -- flow control and buffers ------------------------------------------------------------------------
SMALL_BUFFERS = {
    "max_message_bytes": 64 * 1024,  # stream window 128 KiB + 10
    "connection_window": 256 * 1024,
    "max_connection_send_bytes": 256 * 1024,
    "max_write_per_turn": 64 * 1024,
}


async def test_data_beyond_the_connection_window_is_flow_control_error(serve: Serve) -> None:
    """Unfinished messages are not consumed: four of them overrun the 256 KiB connection window."""
    env = await serve(**SMALL_BUFFERS)
    async with Checker(env) as checker:
        client = await env.connect()
        assert client.conn_window == env.server.connection_window == 256 * 1024
        partial = grpc_message(b"m" * 65_536)[:-1]  # one byte short: the handler never gets it
        out = []
        for stream_id in (1, 3, 5, 7):  # each within its own stream window
            out.append(client.request(stream_id, HOLD))
            out += [
                frame(DATA, 0, stream_id, partial[i : i + 16_384]) for i in range(0, len(partial), 16_384)
            ]
        started = now()
        await client.send(*out)
        goaway, _ = await goaway_then_closed(client)
        assert goaway.error_code == FLOW_CONTROL_ERROR and "connection window" in reason(goaway)
        await checker.still_served(started)


async def test_data_beyond_a_stream_window_is_flow_control_error(serve: Serve) -> None:
    env = await serve(**SMALL_BUFFERS)
    async with Checker(env) as checker:
        env.server.stream_refill_at = 1 << 30  # no stream refills for connections made from now
        client = await env.connect()
        window = client.window(1)
        message = grpc_message(b"s" * 1000)
        count = window // len(message) + 1
        started = now()
        await client.send(client.request(1, ECHO), *(frame(DATA, 0, 1, message) for _ in range(count)))
        goaway, _ = await goaway_then_closed(client)
        assert goaway.error_code == FLOW_CONTROL_ERROR and "stream 1" in reason(goaway)
        await checker.still_served(started)


async def test_zero_window_responses_are_bounded_then_leave_in_slices(serve: Serve) -> None:
    """The table's zero-window attack: bodies echoed to a client that grants no window."""
    env = await serve(**SMALL_BUFFERS)
    limits = env.server.limits
    async with Checker(env) as checker:
        client = await env.connect({SETTINGS_INITIAL_WINDOW_SIZE: 0})
        attacker = env.attacker(checker.connections)
        body = grpc_message(b"b" * (60 * 1024))
        started = now()
        sent_bodies = 0
        for stream_id in range(1, 401, 2):  # 200 streams x 60 KB, each within the windows granted
            if client.window(stream_id) < len(body):
                with contextlib.suppress(TimeoutError):  # a refill, if the server grants one
                    while client.window(stream_id) < len(body):
                        await client.read_frame(timeout_s=0.2)
            if client.window(stream_id) < len(body):
                break  # the server stopped refilling: it has all it will buffer for us
            client.spend(stream_id, len(body))
            await client.send(client.request(stream_id, ECHO), frame(DATA, END_STREAM, stream_id, body))
            sent_bodies += 1
        await client.barrier()
        # Bounded: answers waiting <= the send cap plus what one window of requests can add.
        bound = limits.max_connection_send_bytes + env.server.connection_window + len(body)
        assert 0 < attacker.send_pending <= bound
        assert sent_bodies < 200  # the attacker was held back, not buffered without end
        assert checker.answered_between(started, now()) >= 1
        # Open every window: what was waiting leaves in slices of max_write_per_turn.
        writes: list[int] = []
        transport = attacker.transport
        assert transport is not None
        real_write = transport.write
        attacker.transport = _WriteSpy(lambda data: (writes.append(len(data)), real_write(data)), transport)
        await client.send(
            settings({SETTINGS_INITIAL_WINDOW_SIZE: 2**31 - 1}), window_update(0, 2**31 - 1 - 65_535)
        )
        echoed: set[int] = set()
        while len(echoed) < sent_bodies:
            got = await client.read_frame()
            if got.kind == HEADERS and got.flags & END_STREAM:
                echoed.add(got.stream_id)
        assert attacker.send_pending == 0
        assert max(writes) <= limits.max_write_per_turn + 2 * 16_384 + 64  # a slice, plus a frame
        await checker.still_served(started)


class _WriteSpy:
    """A transport whose writes go through ``write`` first (the rest is the real transport)."""

    def __init__(self, write: Callable[[bytes], object], transport: Any) -> None:
        self._write = write
        self._transport = transport

    def write(self, data: bytes) -> None:
        self._write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


async def test_a_call_over_its_send_cap_is_reset_and_cancelled(serve: Serve) -> None:
    # The cap is raised to twice the largest message: 2 x (8192 + 5) bytes here, under one push.
    env = await serve(max_message_bytes=8192, max_call_send_bytes=1)
    async with Checker(env) as checker:
        client = await env.connect({SETTINGS_INITIAL_WINDOW_SIZE: 0})
        started = now()
        await client.send(client.request(1, PUSH), frame(DATA, 0, 1, grpc_message(b"go")))
        frames = await client.barrier()
        resets = [f for f in frames if f.kind == RST_STREAM and f.stream_id == 1]
        assert [f.error_code for f in resets] == [ENHANCE_YOUR_CALM]
        assert env.handlers[0].cancels == 1
        assert all(f.kind != GOAWAY for f in frames)  # the connection itself goes on
        await client.send(client.request(3, ECHO), frame(DATA, END_STREAM, 3, grpc_message(b"next")))
        await client.send(settings({SETTINGS_INITIAL_WINDOW_SIZE: 65_535}))
        assert (await client.read_stream(3)).messages == [b"next"]
        await checker.still_served(started)


# -- time on the loop --------------------------------------------------------------------------------
async def test_a_large_read_is_processed_in_slices_while_others_are_served(serve: Serve) -> None:
    env = await serve()
    async with Checker(env) as checker:
        client = await env.connect()
        attacker = env.attacker(checker.connections)
        slices = Slices(attacker)
        cheap = frame(PRIORITY, 0, 1, struct.pack(">IB", 0, 15)) * 100_000  # 1.4 MB, ignored frames
        started = now()
        await flood(client, cheap)
        assert await client.barrier() == []  # every frame processed, the connection fine
        ended = now()
        # About one slice per max_frames_per_read frames (the budget is looked at every 32 frames).
        assert slices.count >= 100_000 // env.server.limits.max_frames_per_read // 2
        assert checker.answered_between(started, ended) >= 1
        await checker.still_served(started)


async def test_the_time_budget_cuts_a_read_after_a_heavy_frame(serve: Serve) -> None:
    """Frames of a kilobyte or more are timed one by one: a read of header blocks that each take
    HPACK a while is cut after the frame that used the turn up, not 32 frames later."""
    env = await serve(max_time_per_read_s=1e-9, max_frames_per_read=1_000_000)  # the time budget only
    async with Checker(env) as checker:
        client = await env.connect()
        attacker = env.attacker(checker.connections)
        slices = Slices(attacker)
        blocks = [
            client.request(2 * i + 1, ECHO, end_stream=True, **{"x-pad": f"{i:04d}" * 800}) for i in range(50)
        ]
        assert all(len(block) >= 1024 for block in blocks)
        started = now()
        await client.send(*blocks)
        frames = await client.barrier()
        assert len([f for f in frames if f.kind == HEADERS and f.flags & END_STREAM]) == 50  # all served
        assert slices.count >= 45  # about one turn per block: the reads were cut after every heavy frame
        await checker.still_served(started)


# -- connections -------------------------------------------------------------------------------------
async def test_an_idle_connection_gets_goaway_no_error_and_is_closed(serve: Serve) -> None:
    env = await serve(idle_timeout_s=0.3)
    async with Checker(env) as checker:
        client = await env.connect()
        started = now()
        await client.send(client.request(1, ECHO), frame(DATA, END_STREAM, 1, grpc_message(b"once")))
        assert (await client.read_stream(1)).messages == [b"once"]
        goaway, _ = await goaway_then_closed(client)  # nothing more sent: idle from here
        assert goaway.error_code == NO_ERROR and reason(goaway) == "idle"
        assert struct.unpack_from(">I", goaway.payload)[0] == 1  # stream 1 was served
        assert now() - started >= 0.3
        await checker.still_served(started)  # busy: never idle


async def test_no_preface_within_the_handshake_timeout_is_closed(serve: Serve) -> None:
    env = await serve(handshake_timeout_s=0.3)
    async with Checker(env) as checker:
        started = now()
        silent = await env.connect(handshake=False)
        await silent.send(PREFACE[:10])  # a slow start, never finished
        goaway, frames = await goaway_then_closed(silent)
        assert [f.kind for f in frames] == [SETTINGS, WINDOW_UPDATE, GOAWAY]
        assert goaway.error_code == PROTOCOL_ERROR and "preface" in reason(goaway)
        await checker.still_served(started)


async def test_connection_cap_closes_unused_connections_first_then_refuses(serve: Serve) -> None:
    env = await serve(max_connections=10)
    async with Checker(env) as checker:
        started = now()
        unused = [await env.connect() for _ in range(20)]  # 9 fit; each later one closes the oldest
        assert len(env.server.connections) == 10
        for client in unused[:11]:
            goaway, _ = await goaway_then_closed(client)
            assert goaway.error_code == NO_ERROR and reason(goaway) == "connection limit"
        for client in unused[11:]:  # the newest 9 are still up
            assert await client.barrier() == []
        # Connections with a call open are never closed for a newcomer: at the cap, it is refused.
        for stream_id, client in enumerate(unused[11:]):
            await client.send(client.request(2 * stream_id + 1, HOLD))
            await client.barrier()
        refused = await env.connect(handshake=False)
        await refused.send(PREFACE)  # a connection is served (or refused) from its first byte on
        goaway, _ = await goaway_then_closed(refused)
        assert goaway.error_code == ENHANCE_YOUR_CALM and "connection limit" in reason(goaway)
        await checker.still_served(started)


async def test_the_listen_backlog_takes_a_burst_of_connects(serve: Serve) -> None:
    """With asyncio's backlog of 100, connects past ~101 wait for a SYN retransmit (1 s)."""
    burst = 600
    with open("/proc/sys/net/core/somaxconn") as f:
        if int(f.read()) < burst:
            pytest.skip("net.core.somaxconn caps the backlog below the burst")
    env = await serve(max_connections=2 * burst)
    assert env.server.limits.listen_backlog >= burst
    socks: list[socket.socket] = []
    try:
        # The loop is busy in this synchronous block and accepts nothing: every connect that
        # completes at once sits in the kernel's accept queue, which the backlog sizes.
        for _ in range(burst):
            sock = socket.socket()
            sock.setblocking(False)
            assert sock.connect_ex(("127.0.0.1", env.port)) in (0, errno.EINPROGRESS)
            socks.append(sock)
        deadline = time.monotonic() + 0.5
        pending = set(socks)
        while pending and time.monotonic() < deadline:
            _, writable, _ = select.select([], list(pending), [], 0.05)
            pending -= set(writable)
        assert not pending, f"{len(pending)} of {burst} connects did not complete within 0.5 s"
    finally:
        for sock in socks:
            sock.close()
