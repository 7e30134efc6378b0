"""The engine legs' built-in HTTP/1.1 client against a scripted engine: each test decides the bytes
the engine answers, so framing, keep-alive, a stale connection, cuts and timeouts are each one case."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from helpers import eventually

from router.http import upstream
from router.http.upstream import Dechunker, Http1Client, UpstreamConnectError, UpstreamIOError

Reply = Callable[[asyncio.StreamWriter, "Seen"], Awaitable[bool]]  # True: keep the connection open


@dataclass
class Seen:
    """What the engine received: one entry per request, with the connection it came on."""

    requests: list[tuple[int, bytes, bytes]] = field(default_factory=list)  # (connection, head, body)
    connections: int = 0
    closed_by_client: asyncio.Event = field(default_factory=asyncio.Event)
    closes: int = 0  # connections the client closed


@asynccontextmanager
async def engine(reply: Reply) -> AsyncIterator[tuple[str, Seen]]:
    seen = Seen()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.connections += 1
        number = seen.connections
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    seen.closes += 1
                    seen.closed_by_client.set()
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                seen.requests.append((number, head, body))
                if not await reply(writer, seen):
                    writer.close()
                    return
        except ConnectionError:
            seen.closed_by_client.set()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}", seen
    finally:
        server.close()


def writes(*pieces: bytes, keep: bool = True) -> Reply:
    async def reply(writer: asyncio.StreamWriter, _: Seen) -> bool:
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
        return keep

    return reply


JSON = b'{"ok": true}'
WHOLE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n" + JSON


def client(**kwargs: float) -> Http1Client:
    return Http1Client(
        connect_timeout_s=2.0, request_timeout_s=kwargs.pop("request_timeout_s", 10.0), **kwargs
    )


async def legs_through(reply: Reply, legs: Http1Client, n: int = 2) -> Seen:
    """``n`` legs one after the other, each answer read whole (and checked); what the engine saw."""
    async with engine(reply) as (address, seen):
        for _ in range(n):
            async with await legs.send("POST", address, "/", {}, b"{}") as answer:
                assert await answer.read() == JSON
        await legs.close()
    return seen


async def test_a_whole_answer_is_read_and_the_connection_carries_the_next_leg() -> None:
    async with engine(writes(WHOLE)) as (address, seen):
        legs = client()
        for _ in range(3):
            async with await legs.send(
                "POST", address, "/v1/completions", {"x-request-id": "r1"}, b"{}"
            ) as answer:
                assert (answer.status, answer.content_type) == (200, "application/json")
                assert await answer.read() == JSON
        await legs.close()
    assert seen.connections == 1 and len(seen.requests) == 3
    head, body = seen.requests[0][1], seen.requests[0][2]
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: " + address.encode())
    assert b"x-request-id: r1\r\n" in head and b"Content-Length: 2\r\n" in head and body == b"{}"


async def test_a_chunked_stream_comes_piece_by_piece_and_its_trailers_are_dropped() -> None:
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    first, second = b"data: 1\n\n", b"data: [DONE]\n\n"
    gate = asyncio.Event()

    async def reply(writer: asyncio.StreamWriter, _: Seen) -> bool:
        writer.write(head + b"%x;ext=1\r\n%s\r\n" % (len(first), first))
        await gate.wait()  # the second piece only once the first was read
        writer.write(b"%x\r\n%s\r\n0\r\nX-Trailer: t\r\n\r\n" % (len(second), second))
        return True

    async with engine(reply) as (address, seen):
        legs = client()
        async with await legs.send("POST", address, "/v1/completions", {}, b"{}") as answer:
            assert answer.content_type == "text/event-stream"
            assert await answer.readany() == first
            gate.set()
            assert await answer.read() == second
            assert await answer.readany() == b""
        async with await legs.send("POST", address, "/v1/completions", {}, b"{}") as answer:
            gate.set()
            assert await answer.read() == first + second
        await legs.close()
    assert seen.connections == 1  # the chunked body ended cleanly: the connection was kept


async def test_an_answer_framed_by_the_connections_end_is_read_to_it_and_not_kept() -> None:
    unframed = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + JSON
    seen = await legs_through(writes(unframed, keep=False), client())
    assert seen.connections == 2


@pytest.mark.parametrize(
    "close", [b"HTTP/1.1 200 OK\r\nConnection: close\r\n", b"HTTP/1.0 200 OK\r\n"], ids=["close", "http/1.0"]
)
async def test_an_answer_that_closes_or_is_http_1_0_does_not_keep_its_connection(close: bytes) -> None:
    seen = await legs_through(writes(close + b"Content-Length: 12\r\n\r\n" + JSON), client())
    assert seen.connections == 2


async def test_a_kept_connection_the_engine_closed_is_retried_once_on_a_new_one() -> None:
    async def reply(writer: asyncio.StreamWriter, seen: Seen) -> bool:
        if len(seen.requests) == 2:  # the second request, on the kept connection: closed unanswered
            return False
        writer.write(WHOLE)
        return True

    seen = await legs_through(reply, client())
    assert [number for number, _, _ in seen.requests] == [1, 1, 2]


async def test_a_new_connection_closed_unanswered_is_an_io_error_not_retried() -> None:
    async with engine(writes(keep=False)) as (address, seen):
        with pytest.raises(UpstreamIOError, match="without answering"):
            await client().send("POST", address, "/", {}, b"{}")
    assert seen.connections == 1 and len(seen.requests) == 1


async def test_an_idle_connection_past_keepalive_is_not_reused() -> None:
    seen = await legs_through(writes(WHOLE), client(keepalive_s=0.0))
    assert seen.connections == 2


async def test_interim_answers_are_skipped_and_head_and_204_have_no_body() -> None:
    async with engine(writes(b"HTTP/1.1 100 Continue\r\n\r\n" + WHOLE)) as (address, _):
        legs = client()
        async with await legs.send("POST", address, "/", {}, b"{}") as answer:
            assert answer.status == 200 and await answer.read() == JSON
    async with engine(writes(b"HTTP/1.1 204 No Content\r\n\r\n", WHOLE)) as (address, seen):
        async with await legs.send("DELETE", address, "/v1/responses/r", {}, None) as answer:
            assert answer.status == 204 and await answer.read() == b""
        async with await legs.send("HEAD", address, "/", {}, None) as answer:
            assert answer.status == 200 and await answer.read() == b""  # its Content-Length is not a body
        head = seen.requests[0][1]
        assert head.startswith(b"DELETE /v1/responses/r HTTP/1.1") and b"Content-Length" not in head
    await legs.close()


async def test_a_refused_connection_is_a_connect_error() -> None:
    async with engine(writes(WHOLE)) as (address, _):
        pass  # closed: nothing listens there now
    with pytest.raises(UpstreamConnectError, match="connect failed"):
        await client().send("POST", address, "/", {}, b"{}")


async def test_an_engine_that_never_answers_times_the_leg_out_and_its_connection_closes() -> None:
    async with engine(writes()) as (address, seen):  # reads the request, answers nothing
        with pytest.raises(TimeoutError):
            await client(request_timeout_s=0.2).send("POST", address, "/", {}, b"{}")
        await asyncio.wait_for(seen.closed_by_client.wait(), 10.0)


async def test_a_stream_that_stalls_mid_way_times_out_on_the_read() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

    legs = client(request_timeout_s=0.3)
    async with engine(writes(head + b"3\r\nabc\r\n")) as (address, _):  # and nothing more
        answer = await legs.send("POST", address, "/", {}, b"{}")
        async with answer:
            assert await answer.readany() == b"abc"
            with pytest.raises(TimeoutError):
                await answer.readany()


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b'HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n{"ok"', "12|short"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", "chunk|failed"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
        (b"SPDY/3 200 OK\r\n\r\n", "not an HTTP/1.x answer"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nab", "invalid Content-Length"),
        (b"HTTP/1.1 200 OK\r\nbad header\r\n\r\n", "malformed header"),
        (b"HTTP/1.1 200 OK\r\nContent-Le", "ended inside its headers"),
    ],
    ids=["cut-length", "cut-chunk", "chunk-size", "status-line", "two-lengths", "header", "cut-head"],
)
async def test_a_broken_answer_is_an_io_error_and_its_connection_is_not_kept(
    answer: bytes, error: str
) -> None:
    async with engine(writes(answer, keep=False)) as (address, seen):
        legs = client()
        with pytest.raises(UpstreamIOError, match=error):
            async with await legs.send("POST", address, "/", {}, b"{}") as got:
                await got.read()
        assert not legs._idle.get(address)
        await legs.close()
    assert len(seen.requests) == 1  # a fresh connection's failure is never retried


async def test_an_answer_left_unread_closes_its_connection() -> None:
    async with engine(writes(WHOLE)) as (address, seen):
        legs = client()
        async with await legs.send("POST", address, "/", {}, b"{}") as answer:
            assert answer.status == 200  # the body is not read: the connection cannot be reused
        await asyncio.wait_for(seen.closed_by_client.wait(), 10.0)
        async with await legs.send("POST", address, "/", {}, b"{}") as answer:
            assert await answer.read() == JSON
        await legs.close()
    assert seen.connections == 2


async def test_a_header_that_would_split_the_request_is_refused_before_anything_is_sent() -> None:
    async with engine(writes(WHOLE)) as (address, seen):
        legs = client()
        with pytest.raises(UpstreamIOError, match="cannot be sent"):
            await legs.send("POST", address, "/", {"x-a": "1\r\nx-injected: 2"}, b"{}")
        # Framing is the client's own: a forwarded Content-Length cannot disagree with the body.
        async with await legs.send("POST", address, "/", {"Content-Length": "999"}, b"{}") as answer:
            assert await answer.read() == JSON
        await legs.close()
    assert seen.requests[0][2] == b"{}" and b"999" not in seen.requests[0][1]


async def test_a_body_larger_than_the_socket_buffer_is_sent_whole() -> None:
    body = b'{"prompt": "' + b"x" * (4 << 20) + b'"}'
    async with engine(writes(WHOLE)) as (address, seen):
        legs = client()
        async with await legs.send("POST", address, "/", {}, body) as answer:
            assert await answer.read() == JSON
        await legs.close()
    assert seen.requests[0][2] == body


CHUNKED = b"4;name=v\r\nWiki\r\n5\r\npedia\r\nE\r\n in\r\n\r\nchunks.\r\n0\r\nExpires: never\r\n\r\n"


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(CHUNKED)], ids=lambda n: f"{n}-byte pieces")
def test_a_chunked_body_decodes_the_same_however_it_arrives(size: int) -> None:
    dechunker = Dechunker()
    out = b"".join(dechunker.feed(CHUNKED[i : i + size]) for i in range(0, len(CHUNKED), size))
    assert out == b"Wikipedia in\r\n\r\nchunks." and dechunker.done and not dechunker.leftover


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"4\r\nWikiXX", "did not end with CRLF"),
        (b"-4\r\nWiki\r\n", "bad chunk size"),
        (b"0x4\r\nWiki\r\n", "bad chunk size"),
        (b"4" * 9000, "chunk line over"),
    ],
    ids=["no-crlf", "negative", "0x", "endless-size-line"],
)
def test_a_malformed_chunked_body_is_refused(body: bytes, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        Dechunker().feed(body)


def test_bytes_after_the_last_chunk_are_noticed() -> None:
    dechunker = Dechunker()
    assert dechunker.feed(b"2\r\nok\r\n0\r\n\r\nHTTP/1.1 200 OK") == b"ok"
    assert dechunker.done and dechunker.leftover


async def test_a_decoded_path_cannot_split_the_request_line() -> None:
    async with engine(writes(WHOLE)) as (address, seen):
        legs = client()
        # A client's POST /v1/x%0D%0AX-Injected:%201%20é reaches the client decoded.
        async with await legs.send("POST", address, "/v1/x\r\nX-Injected: 1 é", {}, b"{}") as answer:
            assert await answer.read() == JSON
        await legs.close()
    head = seen.requests[0][1]
    assert head.startswith(b"POST /v1/x%0D%0AX-Injected:%201%20%C3%A9 HTTP/1.1\r\n")
    assert b"\r\nX-Injected" not in head


async def test_connections_idle_past_keepalive_are_closed_not_kept_open() -> None:
    async with engine(writes(WHOLE)) as (address, seen):
        legs = client(keepalive_s=0.0)

        async def leg() -> None:
            async with await legs.send("POST", address, "/", {}, b"{}") as answer:
                assert await answer.read() == JSON

        await asyncio.gather(*(leg() for _ in range(3)))  # three connections at once
        assert seen.connections == 3
        # Each kept connection closed the expired ones before it: one left open.
        assert len(legs._idle[address]) == 1
        await eventually(lambda: seen.closes == 2, 10.0, "the two expired connections closed")
        await legs.close()


async def test_an_engine_no_longer_asked_is_forgotten_with_its_idle_connection() -> None:
    async with engine(writes(WHOLE)) as (gone, seen_gone), engine(writes(WHOLE)) as (staying, _):
        legs = client(keepalive_s=0.0)
        for address in (gone, staying):  # the first engine leaves the pool after one leg
            async with await legs.send("POST", address, "/", {}, b"{}") as answer:
                assert await answer.read() == JSON
        assert list(legs._idle) == [staying]
        await eventually(lambda: seen_gone.closes == 1, 10.0, "the departed engine's connection closed")
        await legs.close()


async def test_a_whole_answer_over_the_limit_is_refused_and_its_connection_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(upstream, "MAX_ANSWER_BYTES", 8)
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcde\r\n5\r\nfghij\r\n"
    async with engine(writes(chunked)) as (address, seen):  # 10 bytes so far, and more to come
        legs = client()
        with pytest.raises(UpstreamIOError, match="over 8 bytes"):
            async with await legs.send("POST", address, "/", {}, b"{}") as answer:
                await answer.read()
        await eventually(lambda: seen.closes == 1, 10.0, "the connection closed")
        await legs.close()
