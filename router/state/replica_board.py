"""One Redis hash per shared fact, where each router replica keeps its own entry and reads the others'.

The field is the replica's id and the value ``{"at": <wall time>, <name>: <value>}``. Every exchange
writes this replica's entry, refreshes the hash's expiry (it disappears once nobody writes) and
reads everyone's in one round trip; an entry older than ``stale_after_s`` (a replica killed or cut
off) or unreadable is deleted by the reader that finds it. Redis trouble never raises: it is
counted, logged once per outage, and reads as no other replica at all.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import orjson

log = logging.getLogger(__name__)

T = TypeVar("T")


class ReplicaBoard(Generic[T]):
    def __init__(
        self,
        client: Any,  # redis.asyncio.Redis
        key: str,
        name: str,
        parse: Callable[[Any], T],  # an entry's value -> T; raises ValueError/TypeError when unreadable
        *,
        stale_after_s: float,
        timeout_s: float = 0.5,
        clock: Callable[[], float] = time.time,  # wall time: replicas compare each other's stamps
    ) -> None:
        self.client = client
        self.key = key
        self.name = name
        self.parse = parse
        self.stale_after_s = stale_after_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.replica = secrets.token_hex(4)
        self.errors = 0
        self.down = False

    async def exchange(self, own: Any) -> list[T] | None:
        """Publish ``own`` (JSON-able); the other replicas' fresh values, or None when Redis failed."""
        now = self.clock()
        entry = orjson.dumps({"at": now, self.name: own})
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.client.pipeline(transaction=False) as pipe:
                    pipe.hset(self.key, self.replica, entry)
                    pipe.pexpire(self.key, max(1, int(self.stale_after_s * 3000)))
                    pipe.hgetall(self.key)
                    *_, everyone = await pipe.execute()
                others, gone = self._read(everyone, now)
                if gone:
                    await self.client.hdel(self.key, *gone)
        except Exception as exc:  # Redis down, slow or answering garbage: this replica alone
            self.errors += 1
            if not self.down:
                log.warning("%s: Redis exchange failed (%s); this replica's own only", self.key, exc)
            self.down = True
            return None
        if self.down:
            log.info("%s: Redis is back; %d replicas", self.key, len(others) + 1)
        self.down = False
        return others

    def _read(self, everyone: dict[bytes, bytes], now: float) -> tuple[list[T], list[bytes]]:
        """The fresh others' values, and the fields of replicas gone stale or unreadable."""
        others, gone, me = [], [], self.replica.encode()
        for field, raw in everyone.items():
            if field == me:
                continue
            try:
                entry = orjson.loads(raw)
                at, value = float(entry["at"]), self.parse(entry[self.name])
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
                log.warning("%s: ignoring a malformed entry %r", self.key, field)
                gone.append(field)
                continue
            if now - at > self.stale_after_s:
                gone.append(field)
            else:
                others.append(value)
        return others, gone
