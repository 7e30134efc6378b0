"""Which engine gave each Responses API answer.

vLLM keeps the conversation it stored with an answer (``store``) in that engine's memory; a request
naming the answer as ``previous_response_id`` can only be served there (another engine answers
404). The flow remembers each answer's engine; a filter sends the follow-up back to it. Bounded:
the oldest answers are forgotten first, as their engines forget them too.

With several picker replicas the follow-up may reach another replica than the one that routed the
answer: with ``index.redis`` each answer's engine is also written to Redis (``{ns}:resp:<id>``, for
the index's TTL) and a replica that does not know an id reads it there before the pick
(``ResponseHomeLookup``), within the lookup timeout. Redis trouble never fails a request: the
follow-up is then routed on load, and the engine answers whether it knows the conversation.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any, TypeVar

from redis.exceptions import RedisError

from router.request.types import RouteRequest

log = logging.getLogger(__name__)

MAX_PENDING_WRITES = 1024  # past this, an answer's home is kept locally only
WRITE_TIMEOUT_S = 1.0  # a write is off the request path: it may wait longer than a lookup


V = TypeVar("V")


def keep_newest(entries: OrderedDict[str, V], key: str, value: V, max_entries: int) -> None:
    """Set ``key`` as the most recently used entry, forgetting the least recently used past the bound."""
    entries[key] = value
    entries.move_to_end(key)
    if len(entries) > max_entries:
        entries.popitem(last=False)


class ResponseHomes:
    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self.shared: SharedHomes | None = None  # with index.redis
        self._homes: OrderedDict[str, str] = OrderedDict()  # response id -> endpoint id

    def remember(self, response_id: str, endpoint_id: str) -> None:
        self._keep(response_id, endpoint_id)
        if self.shared is not None:
            self.shared.publish(response_id, endpoint_id)

    def home(self, response_id: str) -> str | None:
        """The endpoint that gave answer ``response_id``, if it is known here."""
        return self._homes.get(response_id)

    async def look_up(self, response_id: str) -> None:
        """Learn from the other replicas where ``response_id`` was answered, if it is not known here."""
        if self.shared is not None and response_id not in self._homes:
            endpoint_id = await self.shared.fetch(response_id)
            if endpoint_id is not None:
                self._keep(response_id, endpoint_id)

    def _keep(self, response_id: str, endpoint_id: str) -> None:
        keep_newest(self._homes, response_id, endpoint_id, self.max_entries)

    def __len__(self) -> int:
        return len(self._homes)


class SharedHomes:
    """Homes in Redis, one key each (written in the background, read within a timeout): the
    Responses API answers' (``resp``) and the sessions' (``session``, ``router/state/sessions.py``).

    ``kind`` names the keys (``{namespace}:<kind>:<id>``) and the warning."""

    def __init__(
        self, client: Any, namespace: str, *, ttl_s: float, timeout_s: float, kind: str = "resp"
    ) -> None:
        self.client = client
        self.kind = kind
        self.prefix = f"{namespace}:{kind}:"
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.timeout_s = timeout_s
        self.errors = 0
        self._pending: set[asyncio.Task[None]] = set()

    @property
    def writes_pending(self) -> int:
        return len(self._pending)

    def publish(self, key: str, value: str) -> None:
        if len(self._pending) >= MAX_PENDING_WRITES:
            self.errors += 1
            return
        task = asyncio.get_running_loop().create_task(self._write(key, value))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _write(self, key: str, value: str) -> None:
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                await self.client.set(self.prefix + key, value, px=self.ttl_ms)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("write", exc)

    async def fetch(self, key: str) -> str | None:
        try:
            async with asyncio.timeout(self.timeout_s):
                value = await self.client.get(self.prefix + key)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("read", exc)
            return None
        if value is None:
            return None
        # Not ours to trust: bytes that are not text read as no entry (the decoders refuse them).
        return value.decode(errors="replace") if isinstance(value, bytes) else str(value)

    def _failed(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        if self.errors == 1 or self.errors % 1000 == 0:
            log.warning(
                "shared %s homes: Redis %s failed (%s); %d failures", self.kind, what, exc, self.errors
            )


class ResponseHomeLookup:
    """Producer: a follow-up's stored answer, looked up among the other replicas' before the pick."""

    name = "response_home"

    def __init__(self, homes: ResponseHomes) -> None:
        self.homes = homes

    async def produce(self, request: RouteRequest) -> None:
        if request.previous_response_id is not None:
            await self.homes.look_up(request.previous_response_id)
