"""An in-process network between a client, the router and simulated engines: no socket, same code.

* ``LocalSession`` stands in for the router's engine session (``aiohttp.ClientSession``): what the
  router sends to ``http://<engine address>/...`` (scrapes, the gate's checks, the prefill and
  decode legs) goes to ``SimEngine.local_call`` of the engine with that address, and the answer
  comes back as a response object with the parts of ``aiohttp.ClientResponse`` the router reads
  (``status``, ``headers``, ``content_type``, ``read``, ``content.readany``,
  ``content.iter_chunked``). An engine that is not running refuses the connection
  (``aiohttp.ClientConnectorError`` with ``ECONNREFUSED``); one stopped mid-answer cuts the body
  (``aiohttp.ClientPayloadError``), as over TCP. Each request takes ``hop_s`` to reach the engine
  (the loopback hop the proxy's legs take), answers travel back at once.
* ``LocalClient`` calls an aiohttp request handler (the proxy's ``completions``) with a request
  built in-process and hands every byte the handler writes to ``on_data`` as it is written.

Used with the virtual clock (``simulator.virtual_clock``), where nothing may touch a socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Mapping
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from aiohttp import web
from aiohttp.client_reqrep import ConnectionKey
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict, CIMultiDictProxy

from simulator.engine import EngineStopped, LocalAnswer, SimCluster, SimEngine


class LocalResponse:
    """One engine's answer as the router's ``aiohttp`` code reads it."""

    def __init__(self, url: str, answer: LocalAnswer, stack: contextlib.AsyncExitStack) -> None:
        self.url = url
        self.status = answer.status
        self.reason = _REASONS.get(answer.status, "")
        self.headers = CIMultiDictProxy(CIMultiDict(answer.headers))
        self.content_type = answer.content_type or "application/octet-stream"
        self.content_length: int | None = None  # pieces come as produced, like a chunked body
        self.content = _Content(answer.body)
        self._stack = stack
        self.closed = False

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.content.iter_any()])

    async def text(self, encoding: str = "utf-8") -> str:
        return (await self.read()).decode(encoding)

    async def json(self, **_: Any) -> Any:
        return orjson.loads(await self.read())

    async def release(self) -> None:
        """The connection closes: the engine lets go of the request (if it still holds it)."""
        if not self.closed:
            self.closed = True
            await self._stack.aclose()

    def close(self) -> None:
        if not self.closed:  # a synchronous close cannot wait: finish the release in a task
            asyncio.get_running_loop().create_task(self.release())

    async def __aenter__(self) -> LocalResponse:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.release()


class _Content:
    """``ClientResponse.content``: the body's pieces in order, as the engine writes them."""

    def __init__(self, body: AsyncIterator[bytes]) -> None:
        self._body = body
        self._eof = False

    async def readany(self) -> bytes:
        if self._eof:
            return b""
        try:
            return await anext(self._body)
        except StopAsyncIteration:
            self._eof = True
            return b""
        except EngineStopped as exc:
            self._eof = True
            raise aiohttp.ClientPayloadError(f"response payload is not completed: {exc}") from None

    async def iter_any(self) -> AsyncIterator[bytes]:
        while piece := await self.readany():
            yield piece

    def iter_chunked(self, n: int) -> AsyncIterator[bytes]:
        return self.iter_any()  # pieces are small; the router only bounds their total

    def at_eof(self) -> bool:
        return self._eof


class _Pending:
    """``session.post(...)``: awaited (the response, the caller releases it) or entered."""

    def __init__(self, opened: Callable[[], Awaitable[LocalResponse]]) -> None:
        self._opened = opened
        self._response: LocalResponse | None = None

    def __await__(self) -> Generator[Any, None, LocalResponse]:
        return self._opened().__await__()

    async def __aenter__(self) -> LocalResponse:
        self._response = await self._opened()
        return self._response

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._response is not None:
            await self._response.release()


class LocalSession:
    """The router's engine session, answered by ``cluster``'s engines in-process."""

    def __init__(self, cluster: SimCluster, *, hop_s: float = 0.0) -> None:
        self.cluster = cluster
        self.hop_s = hop_s
        self.closed = False
        self.calls: Counter[str] = Counter()  # "GET /metrics" -> requests sent

    def request(
        self,
        method: str,
        url: str,
        *,
        data: bytes | str | None = None,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
        **_: Any,
    ) -> _Pending:
        """``timeout.total`` bounds the wait for the answer to begin (in virtual time, raising
        ``TimeoutError`` as aiohttp does); the body's reading is bounded by the run's virtual-time
        limit (``run_virtual``). Other ``aiohttp`` options are accepted and ignored."""
        if json is not None:
            data = orjson.dumps(json)
        body = data.encode() if isinstance(data, str) else (data or b"")
        total = None if timeout is None else timeout.total
        return _Pending(lambda: self._open(method.upper(), url, dict(headers or {}), body, total))

    def get(self, url: str, **kwargs: Any) -> _Pending:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> _Pending:
        return self.request("POST", url, **kwargs)

    async def _open(
        self, method: str, url: str, headers: dict[str, str], body: bytes, total: float | None
    ) -> LocalResponse:
        async with asyncio.timeout(total):
            return await self._begin(method, url, headers, body)

    async def _begin(self, method: str, url: str, headers: dict[str, str], body: bytes) -> LocalResponse:
        parts = urlsplit(url)
        self.calls[f"{method} {parts.path}"] += 1
        engine = self._engine(parts.netloc)
        if self.hop_s > 0:
            await asyncio.sleep(self.hop_s)
        if engine is None or not engine.alive:
            raise _refused(parts.hostname or "", parts.port or 0)
        stack = contextlib.AsyncExitStack()
        answer = await stack.enter_async_context(engine.local_call(method, parts.path, headers, body))
        return LocalResponse(url, answer, stack)

    def _engine(self, address: str) -> SimEngine | None:
        cluster = self.cluster
        for name, engine in cluster.engines.items():
            if cluster.address(name) == address:
                return engine
        return None

    async def close(self) -> None:
        self.closed = True

    async def __aenter__(self) -> LocalSession:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()


def _refused(host: str, port: int) -> aiohttp.ClientConnectorError:
    key = ConnectionKey(host, port, False, True, None, None, None, None)
    return aiohttp.ClientConnectorError(key, OSError(errno.ECONNREFUSED, "Connection refused"))


class _Writer:
    """The payload writer behind the handler's response: every byte goes to ``on_data``."""

    def __init__(self, on_data: Callable[[bytes], None]) -> None:
        self.on_data = on_data
        self.buffer_size = 0
        self.output_size = 0
        self.length: int | None = None
        self.status_line = ""
        self.headers: CIMultiDict[str] = CIMultiDict()

    def enable_chunking(self) -> None:
        pass

    def enable_compression(self, encoding: str = "deflate", strategy: Any = None) -> None:
        pass

    async def write_headers(self, status_line: str, headers: CIMultiDict[str]) -> None:
        self.status_line = status_line
        self.headers = CIMultiDict(headers)

    def send_headers(self) -> None:
        pass

    async def write(self, chunk: bytes, **_: Any) -> None:
        self.output_size += len(chunk)
        self.on_data(bytes(chunk))

    async def write_eof(self, chunk: bytes = b"") -> None:
        if chunk:
            await self.write(chunk)

    async def drain(self) -> None:
        pass


class _Payload:
    """The request body as ``web.Request.read`` reads it."""

    def __init__(self, body: bytes) -> None:
        self._body: bytes | None = body

    async def readany(self) -> bytes:
        body, self._body = self._body, None
        return body or b""

    def at_eof(self) -> bool:
        return self._body is None

    def set_read_chunk_size(self, size: int) -> None:
        pass


class LocalClient:
    """Calls an aiohttp request handler (the proxy's ``completions``) as aiohttp's server would,
    in-process; the mocked server parts are built once and shared by every call."""

    def __init__(
        self,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
        *,
        client_max_size: int = 1024**2,
    ) -> None:
        self.handler = handler
        self.client_max_size = client_max_size
        probe = make_mocked_request("GET", "/")  # aiohttp's own stand-ins, made once
        self._app = probe.app
        self._protocol = probe.protocol
        self._transport = probe.transport

    async def call(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        on_data: Callable[[bytes], None],
    ) -> web.StreamResponse:
        """The handler's response to this request; ``on_data`` gets the body of a streamed
        (prepared) response as it is written, and the ``body`` of one the handler did not prepare
        (a JSON answer, a rejection) once it returns."""
        request = make_mocked_request(
            method,
            path,
            headers={**headers, "Content-Length": str(len(body))},
            writer=_Writer(on_data),
            payload=_Payload(body),  # type: ignore[arg-type]
            client_max_size=self.client_max_size,
            app=self._app,
            protocol=self._protocol,
            transport=self._transport,
        )
        response = await self.handler(request)
        if not response.prepared:
            payload = response.body if isinstance(response, web.Response) else None
            if isinstance(payload, bytes | bytearray):
                on_data(bytes(payload))
        return response


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 409: "Conflict", 500: "Internal Server Error"}
