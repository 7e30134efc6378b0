"""Homes kept per key and shared between router replicas through Redis: the Responses API answers'
engines (``router/state/response_homes.py``) and the sessions' pods (``router/state/sessions.py``).

Locally a bounded LRU (``keep_newest``); in Redis one key each, ``{namespace}:<kind>:<key>`` for the
index's TTL, written in the background (a bounded number pending) and read within a timeout.
Redis trouble never fails a request: it is counted (``errors``, exported per kind) and the replica
uses what it knows itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any, TypeVar

from redis.exceptions import RedisError

log = logging.getLogger(__name__)

MAX_PENDING_WRITES = 1024  # past this, a home is kept locally only
WRITE_TIMEOUT_S = 1.0  # a write is off the request path: it may wait longer than a lookup


V = TypeVar("V")


def keep_newest(entries: OrderedDict[str, V], key: str, value: V, max_entries: int) -> None:
    """Set ``key`` as the most recently used entry, forgetting the least recently used past the bound."""
    entries[key] = value
    entries.move_to_end(key)
    if len(entries) > max_entries:
        entries.popitem(last=False)


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
