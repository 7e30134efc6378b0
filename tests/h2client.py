"""A tiny raw HTTP/2 client for protocol tests: frames built by hand, headers through ``hpack``.

It speaks just enough to drive ``router.transport.h2`` frame by frame: the test decides every frame
that goes out (including broken ones) and reads what comes back with a deadline, never a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import ssl
import struct
from dataclasses import dataclass, field

import hpack

# The protocol's numbers written out again from RFC 9113 on purpose, not imported from the server:
# a wrong constant there must not be mirrored here.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x5, 0x6, 0x7, 0x8, 0x9
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR = 0x0, 0x1, 0x3, 0x6
REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x7, 0x8, 0x9, 0xB

SETTINGS_HEADER_TABLE_SIZE, SETTINGS_MAX_CONCURRENT_STREAMS = 0x1, 0x3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

_HEAD = struct.Struct(">IBI")
_U32 = struct.Struct(">I")
_pings = itertools.count(1)


@dataclass
class Frame:
    kind: int
    flags: int
    stream_id: int
    payload: bytes
    headers: dict[str, str] = field(default_factory=dict)  # decoded, for HEADERS frames

    @property
    def error_code(self) -> int:
        """The error code of a RST_STREAM or GOAWAY frame."""
        return _U32.unpack_from(self.payload, 4 if self.kind == GOAWAY else 0)[0]


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _HEAD.pack(len(payload) << 8 | kind, flags, stream_id) + payload


def settings(values: dict[int, int] | None = None) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in (values or {}).items()))


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(increment))


def rst_stream(stream_id: int, code: int = CANCEL) -> bytes:
    return frame(RST_STREAM, 0, stream_id, _U32.pack(code))


def goaway(last_stream_id: int, code: int = NO_ERROR) -> bytes:
    return frame(GOAWAY, 0, 0, _U32.pack(last_stream_id) + _U32.pack(code))


def grpc_message(body: bytes, *, compressed: bool = False) -> bytes:
    """One length-prefixed gRPC message."""
    return struct.pack(">BI", int(compressed), len(body)) + body


def grpc_messages(data: bytes) -> list[bytes]:
    """Split a stream's DATA bytes back into gRPC messages (asserting there is no leftover)."""
    out, position = [], 0
    while position < len(data):
        compressed, length = struct.unpack_from(">BI", data, position)
        assert compressed == 0
        out.append(data[position + 5 : position + 5 + length])
        position += 5 + length
    assert position == len(data), "a truncated gRPC message"
    return out


@dataclass
class StreamResult:
    """What came back on one stream, in order."""

    frames: list[Frame]

    @property
    def headers(self) -> dict[str, str]:
        return next(f.headers for f in self.frames if f.kind == HEADERS)

    @property
    def trailers(self) -> dict[str, str]:
        return next(f.headers for f in self.frames if f.kind == HEADERS and f.flags & END_STREAM)

    @property
    def data(self) -> bytes:
        return b"".join(f.payload for f in self.frames if f.kind == DATA)

    @property
    def messages(self) -> list[bytes]:
        return grpc_messages(self.data)


class H2Client:
    """One cleartext HTTP/2 connection with prior knowledge."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.server_settings: dict[int, int] = {}
        # The server's receive windows as the frames read so far grant them (``window``, ``spend``):
        # a client that sends only what they allow is a well-behaved one, whatever else it does.
        self.conn_window = 65_535
        self.stream_windows: dict[int, int] = {}

    @classmethod
    async def connect(
        cls,
        port: int,
        client_settings: dict[int, int] | None = None,
        *,
        handshake: bool = True,
        tls: ssl.SSLContext | None = None,
    ) -> H2Client:
        """Connect (over TLS with ``tls``, to the name ``localhost``); with ``handshake``, exchange
        SETTINGS and wait for the server's ACK of ours."""
        server_hostname = "localhost" if tls is not None else None
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=tls, server_hostname=server_hostname
        )
        client = cls(reader, writer)
        if handshake:
            await client.send(PREFACE + settings(client_settings))
            acked = seen = False
            while not (acked and seen):
                got = await client.read_frame()
                if got.kind == SETTINGS and got.flags & ACK:
                    acked = True
                elif got.kind == SETTINGS:
                    seen = True
                    await client.send(frame(SETTINGS, ACK, 0))
        return client

    def _stream_window(self, stream_id: int) -> int:
        initial = self.server_settings.get(SETTINGS_INITIAL_WINDOW_SIZE, 65_535)
        return self.stream_windows.get(stream_id, initial)

    def window(self, stream_id: int) -> int:
        """What the server lets us send on ``stream_id`` now (its stream and connection windows)."""
        return min(self.conn_window, self._stream_window(stream_id))

    def spend(self, stream_id: int, size: int) -> None:
        """Account for ``size`` bytes of DATA sent on ``stream_id``."""
        self.conn_window -= size
        self.stream_windows[stream_id] = self._stream_window(stream_id) - size

    def _track(self, got: Frame) -> None:
        if got.kind == SETTINGS and not got.flags & ACK:
            for offset in range(0, len(got.payload), 6):
                key, value = struct.unpack_from(">HI", got.payload, offset)
                self.server_settings[key] = value
        elif got.kind == WINDOW_UPDATE:
            increment = _U32.unpack(got.payload)[0] & 0x7FFFFFFF
            if got.stream_id == 0:
                self.conn_window += increment
            else:
                self.stream_windows[got.stream_id] = self._stream_window(got.stream_id) + increment

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()

    async def send(self, *data: bytes) -> None:
        self.writer.write(b"".join(data))
        await self.writer.drain()

    def header_block(self, path: str, **extra: str) -> bytes:
        headers = [
            (":method", extra.pop("method", "POST")),
            (":scheme", "http"),
            (":path", path),
            (":authority", "test"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *extra.items(),
        ]
        return self.encoder.encode(headers)

    def request(self, stream_id: int, path: str, *, end_stream: bool = False, **extra: str) -> bytes:
        """A HEADERS frame opening ``stream_id`` for ``path``."""
        flags = END_HEADERS | (END_STREAM if end_stream else 0)
        return frame(HEADERS, flags, stream_id, self.header_block(path, **extra))

    async def read_frame(self, timeout_s: float = 2.0) -> Frame:
        """The next frame; fails the test if none arrives within ``timeout_s``."""
        head = await asyncio.wait_for(self.reader.readexactly(9), timeout_s)
        length_kind, flags, stream_id = _HEAD.unpack(head)
        payload = await asyncio.wait_for(self.reader.readexactly(length_kind >> 8), timeout_s)
        got = Frame(length_kind & 0xFF, flags, stream_id & 0x7FFFFFFF, payload)
        self._track(got)
        if got.kind == HEADERS:  # decode every block in order: the HPACK table must follow
            assert flags & END_HEADERS, "the server never sends CONTINUATION"
            got.headers = dict(self.decoder.decode(payload))
        return got

    async def read_stream(self, stream_id: int, timeout_s: float = 2.0) -> StreamResult:
        """Frames for ``stream_id`` until it ends (END_STREAM or RST_STREAM); others are dropped."""
        frames: list[Frame] = []
        while True:
            got = await self.read_frame(timeout_s)
            if got.stream_id != stream_id:
                continue
            frames.append(got)
            if (got.flags & END_STREAM and got.kind in (DATA, HEADERS)) or got.kind == RST_STREAM:
                return StreamResult(frames)

    async def barrier(self) -> list[Frame]:
        """Send a PING and return every frame that arrives before its ACK.

        The server answers frames in order and writes what one read produced in one go, so
        anything it was going to send in reply to earlier frames is in the returned list.
        """
        payload = struct.pack(">Q", next(_pings))
        await self.send(frame(PING, 0, 0, payload))
        before: list[Frame] = []
        while True:
            got = await self.read_frame()
            if got.kind == PING and got.flags & ACK and got.payload == payload:
                return before
            before.append(got)

    async def read_until_closed(self, timeout_s: float = 2.0) -> list[Frame]:
        """Every frame until the server closes the connection."""
        frames: list[Frame] = []
        while True:
            try:
                frames.append(await self.read_frame(timeout_s))
            except asyncio.IncompleteReadError as exc:
                assert not exc.partial, "connection closed mid-frame"
                return frames
            except ConnectionResetError:  # closed with our last bytes unread: what came is all
                return frames


# -- plain HTTP/2 requests (not gRPC), e.g. through Envoy ------------------------------------------


@dataclass
class HttpReply:
    """One HTTP/2 response; ``status`` is None when the stream was reset instead (``reset_code``)."""

    status: int | None
    headers: dict[str, str]
    body: bytes
    trailers: dict[str, str]
    reset_code: int | None = None


async def request_with_trailers(
    port: int,
    path: str,
    body: bytes,
    *,
    headers: dict[str, str] | None = None,
    trailers: dict[str, str] | None = None,
    method: str = "POST",
    timeout_s: float = 10.0,
) -> HttpReply:
    """One request on a new cleartext HTTP/2 connection (prior knowledge), with request trailers.

    Frames sent: HEADERS (no END_STREAM), DATA frames (never END_STREAM), then a trailing HEADERS
    frame with END_STREAM carrying ``trailers``. With ``trailers=None`` the last DATA frame ends
    the stream instead (a request without trailers, for comparison). Reads the response until the
    stream ends; ``timeout_s`` bounds the wait for each frame.
    """
    client = await H2Client.connect(port)
    try:
        stream_id = 1
        request_headers = [
            (":method", method),
            (":scheme", "http"),
            (":path", path),
            (":authority", f"127.0.0.1:{port}"),
            ("content-type", "application/json"),
            *(headers or {}).items(),
        ]
        out = [frame(HEADERS, END_HEADERS, stream_id, client.encoder.encode(request_headers))]
        max_frame = client.server_settings.get(SETTINGS_MAX_FRAME_SIZE, 16384)
        chunks = [body[i : i + max_frame] for i in range(0, len(body), max_frame)] or [b""]
        for i, chunk in enumerate(chunks):
            last = trailers is None and i == len(chunks) - 1
            out.append(frame(DATA, END_STREAM if last else 0, stream_id, chunk))
        if trailers is not None:
            block = client.encoder.encode(list(trailers.items()))
            out.append(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, block))
        await client.send(*out)
        result = await client.read_stream(stream_id, timeout_s)
        reset = next((f.error_code for f in result.frames if f.kind == RST_STREAM), None)
        blocks = [f.headers for f in result.frames if f.kind == HEADERS]
        response_headers = blocks[0] if blocks and ":status" in blocks[0] else {}
        status = int(response_headers[":status"]) if response_headers else None
        response_trailers = blocks[-1] if len(blocks) > 1 else {}
        return HttpReply(status, response_headers, result.data, response_trailers, reset)
    finally:
        await client.close()
