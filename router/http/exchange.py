"""The prefill → decode exchange of vLLM's NIXL connector, as llm-d's decode sidecar drives it.

The prefill leg sends the client's request with ``max_tokens=1``, no stream and
``kv_transfer_params`` asking for a remote decode; the engine's answer carries the
``kv_transfer_params`` the decode leg then adds to the client's request, so the decode engine pulls
the prompt's KV instead of computing it. Used unchanged by the proxy adapter and the sidecar.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from router.http.upstream import Answer, EngineClient, UpstreamConnectError, UpstreamIOError
from router.request.parse import CHAT, COMPLETIONS, MESSAGES, RESPONSES, api_of
from router.request.rejections import UPSTREAM_DISCONNECTED

log = logging.getLogger(__name__)

PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class UpstreamError(Exception):
    """An engine failed before we sent the client anything; the next fallback may be tried."""

    def __init__(self, address: str, reason: str, *, connect: bool = False) -> None:
        super().__init__(f"{address}: {reason}")
        self.address = address
        self.reason = reason
        self.connect = connect


def prefill_body(body: dict[str, Any], path: str) -> bytes:
    """The prefill leg to ``path``: the client's request computing one token, no stream, remote
    decode."""
    leg = dict(body)
    leg.pop("stream_options", None)
    leg.update(max_tokens=1, stream=False, kv_transfer_params=PREFILL_KV_TRANSFER_PARAMS)
    if api_of(path) != MESSAGES:  # OpenAI sampling fields, not in the Messages API's schema
        leg["min_tokens"] = 1
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
    return orjson.dumps(leg)


def with_usage(body: dict[str, Any], api: str = COMPLETIONS) -> dict[str, Any] | None:
    """The body asking for the usage chunk a streamed OpenAI answer omits unless asked
    (``stream_options.include_usage``); None when it is not streamed or already asks, and for
    the other APIs: a streamed Messages or Responses answer always ends with its usage."""
    options = body.get("stream_options")
    if (
        api not in (COMPLETIONS, CHAT)
        or body.get("stream") is not True
        or (isinstance(options, dict) and options.get("include_usage"))
    ):
        return None
    return {
        **body,
        "stream_options": {**(options if isinstance(options, dict) else {}), "include_usage": True},
    }


def decode_body(body: dict[str, Any], kv_transfer_params: Any) -> bytes:
    """The decode leg: the client's request plus the prefill answer's ``kv_transfer_params``."""
    return orjson.dumps({**body, "kv_transfer_params": kv_transfer_params})


@dataclass(slots=True)
class Leg:
    """What one leg sends: path, headers and body bytes."""

    path: str
    headers: dict[str, str]
    method: str = "POST"  # GET/DELETE: a stored Responses API answer (no body)


class TwoLegExchange:
    """Forwards one request: optional prefill leg, then the decode leg streamed to the client."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def whole(self, what: str, address: str, leg: Leg, data: bytes) -> bytes:
        """POST ``data`` as the ``what`` leg (``prefill``, a canary's ``decode``) and read its JSON
        answer whole; anything but a 200 raises ``UpstreamError``."""
        headers = {**leg.headers, "content-type": "application/json"}
        try:
            async with await self.client.send("POST", address, leg.path, headers, data) as answer:
                payload = await answer.read()
        except UpstreamConnectError as exc:
            raise UpstreamError(address, str(exc), connect=True) from None
        except (UpstreamIOError, TimeoutError) as exc:
            raise UpstreamError(address, f"{what} leg failed: {_named(exc)}") from None
        if answer.status != 200:
            raise UpstreamError(address, f"{what} leg answered HTTP {answer.status}")
        return payload

    async def prefill(self, address: str, leg: Leg, body: dict[str, Any]) -> tuple[Any, Any]:
        """Run the prefill leg; returns its ``kv_transfer_params`` and ``usage`` (None when it sent
        none) or raises ``UpstreamError``."""
        payload = await self.whole("prefill", address, leg, prefill_body(body, leg.path))
        try:
            answer_body = orjson.loads(payload)
            params = answer_body["kv_transfer_params"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise UpstreamError(address, "prefill answer has no kv_transfer_params") from None
        if not isinstance(params, dict):
            raise UpstreamError(address, "prefill answer's kv_transfer_params is not an object")
        return params, answer_body.get("usage")

    async def decode(
        self,
        address: str,
        leg: Leg,
        data: bytes,
        start_response: Callable[[Answer, bytes | None], Awaitable[web.StreamResponse]],
        on_first_byte: Callable[[], None],
        on_body: Callable[[bytes], bytes] = lambda chunk: chunk,
        on_end: Callable[[], bytes] = lambda: b"",
        on_cut: Callable[[str], None] = lambda reason: None,
    ) -> web.StreamResponse:
        """Send the decode leg and stream its answer through ``start_response``; ``on_body`` sees
        every piece of it as it passes and returns what to write, ``on_end`` what is left at the end.
        A whole (non-streamed) answer is handed to ``start_response`` as its second argument, to
        go out in one piece (``respond``); a stream's is None and its pieces are written after.

        Raises ``UpstreamError`` only while nothing has been sent to the client (so the caller can
        fail over); after that an engine failure ends the stream with an SSE error event and is
        reported to ``on_cut`` (with its reason): the response began well, but did not end so.
        """
        headers = {"content-type": "application/json", **leg.headers}
        try:
            answer = await self.client.send(leg.method, address, leg.path, headers, data)
        except UpstreamConnectError as exc:
            raise UpstreamError(address, str(exc), connect=True) from None
        except (UpstreamIOError, TimeoutError) as exc:
            raise UpstreamError(address, f"decode leg failed: {_named(exc)}") from None
        async with answer:
            if answer.status >= 500:
                raise UpstreamError(address, f"decode leg answered HTTP {answer.status}")
            streaming = answer.content_type == "text/event-stream"
            if not streaming:
                # Small JSON answers are read whole, so a failure part-way can still fail over.
                try:
                    payload = await answer.read()
                except (UpstreamIOError, TimeoutError) as exc:
                    raise UpstreamError(address, f"decode answer cut: {_named(exc)}") from None
                on_first_byte()
                return await start_response(answer, on_body(payload) + on_end())
            out = None
            try:
                read = answer.readany
                while chunk := await read():
                    if out is None:
                        on_first_byte()
                        out = await start_response(answer, None)
                    if chunk := on_body(chunk):
                        await out.write(chunk)
            except (UpstreamIOError, TimeoutError) as exc:
                if out is None:
                    raise UpstreamError(
                        address, f"decode stream failed before any byte: {_named(exc)}"
                    ) from None
                log.warning("decode stream from %s cut mid-way: %s", address, _named(exc))
                on_cut(f"decode stream cut mid-way: {_named(exc)}")
                await out.write(
                    sse_error("upstream engine stopped mid-stream", UPSTREAM_DISCONNECTED, leg.path)
                )
            if out is None:
                on_first_byte()
                out = await start_response(answer, None)
            if rest := on_end():
                await out.write(rest)
            return out


ANSWER_HEADERS = ("Content-Type", "Cache-Control")  # what the client gets of the engine's headers


async def respond(
    request: web.Request, upstream: Answer, headers: Mapping[str, str], whole: bytes | None
) -> web.StreamResponse:
    """The client's response to ``upstream``'s answer, with the engine's ``ANSWER_HEADERS`` and
    ``headers``. A ``whole`` answer is a ``Response`` aiohttp sends once the handler returns,
    headers and body in one write with their length (a prepared stream costs a write for its
    headers and another for its last chunk); a stream's is prepared now, for its pieces."""
    out = (
        web.Response(status=upstream.status, body=whole)
        if whole is not None
        else web.StreamResponse(status=upstream.status)
    )
    for name in ANSWER_HEADERS:
        if name in upstream.headers:
            out.headers[name] = upstream.headers[name]
    out.headers.update(headers)
    if whole is None:
        await out.prepare(request)
    return out


def _named(exc: BaseException) -> str:
    """What failed, for logs and the failed leg's reason: the timeout by name, else the message."""
    return "TimeoutError" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__


def sse_error(message: str, code: str, path: str) -> bytes:
    """The event that ends a stream cut mid-way, in the stream's API's own error shape, so its
    client's SDK reports an error instead of a truncated answer."""
    api = api_of(path)
    if api == MESSAGES:
        error: dict[str, Any] = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + orjson.dumps(error) + b"\n\n"
    if api == RESPONSES:
        error = {"type": "error", "code": code, "message": message, "param": None}
        return b"event: error\ndata: " + orjson.dumps(error) + b"\n\n"
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + orjson.dumps(error) + b"\n\n"
