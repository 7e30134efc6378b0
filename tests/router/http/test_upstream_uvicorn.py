"""The engine legs' built-in client against uvicorn, the server vLLM's OpenAI API runs on: its
framing of whole and streamed answers, and its keep-alive timeout closing idle connections."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
import uvicorn
from helpers import eventually

from router.http.upstream import Http1Client

pytestmark = pytest.mark.integration

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
PIECES = [b"data: %d\n\n" % i for i in range(5)] + [b"data: [DONE]\n\n"]


class Engine:
    """An ASGI app answering as vLLM's server does: JSON with a length, SSE streamed in pieces."""

    def __init__(self) -> None:
        self.clients: list[tuple[str, int]] = []  # each request's peer: its connection

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        self.clients.append(tuple(scope["client"]))
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if orjson.loads(body).get("stream"):
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            for piece in PIECES:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        answer = orjson.dumps({"echo": orjson.loads(body)})
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})


@asynccontextmanager
async def uvicorn_engine(keep_alive_s: float) -> AsyncIterator[tuple[str, Engine]]:
    engine = Engine()
    config = uvicorn.Config(
        engine, host="127.0.0.1", port=0, lifespan="off", log_level="warning", timeout_keep_alive=keep_alive_s
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started, 10.0, "uvicorn started")
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        await task


async def test_whole_and_streamed_answers_from_uvicorn_over_one_kept_connection() -> None:
    async with uvicorn_engine(keep_alive_s=5.0) as (address, engine):
        legs = Http1Client(2.0, 10.0)
        for i in range(3):
            async with await legs.send(
                "POST", address, "/v1/completions", {}, orjson.dumps({"n": i})
            ) as answer:
                assert answer.status == 200 and answer.content_type == "application/json"
                assert orjson.loads(await answer.read()) == {"echo": {"n": i}}
        body = orjson.dumps({"stream": True})
        async with await legs.send("POST", address, "/v1/completions", {}, body) as answer:
            assert answer.content_type == "text/event-stream"
            assert await answer.read() == b"".join(PIECES)
        await legs.close()
    assert len(engine.clients) == 4 and len(set(engine.clients)) == 1


async def test_after_uvicorn_closed_an_idle_connection_the_next_leg_goes_out_on_a_new_one() -> None:
    async with uvicorn_engine(keep_alive_s=0.2) as (address, engine):
        legs = Http1Client(2.0, 10.0, keepalive_s=60.0)  # trusting idle connections far longer than uvicorn
        for _ in range(2):
            async with await legs.send("POST", address, "/", {}, b"{}") as answer:
                assert await answer.read() == b'{"echo":{}}'
            [idle] = legs._idle[address]
            await eventually(idle.reader.at_eof, 10.0, "uvicorn closing the idle connection")
        await legs.close()
    assert len(set(engine.clients)) == 2  # the second leg went out on a new connection
