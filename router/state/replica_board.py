"""One Redis hash per shared fact, where each router replica keeps its own entry and reads the others'.

The field is the replica's id and the value ``{"at": <wall time>, <name>: <value>}``. Every exchange
writes this replica's entry, refreshes the hash's expiry (it disappears once nobody writes) and
reads everyone's in one script call (one command: a pipeline of three cost ~1.4x its client CPU in
redis-py, and a replica exchanges a few times per request); an entry older than ``stale_after_s``
(a replica killed or cut off) or unreadable is deleted by the reader that finds it. Redis trouble
never raises: it is counted, logged once per outage, and reads as no other replica at all.

With ``push``, each exchange also publishes the entry on the channel named like the hash, and
``listen`` hands every other replica's to a callback as it comes: a reader is then as fresh as the
writers, without a round trip of its own (``subscribed``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import orjson

from kvindex.aio import follow_channel

log = logging.getLogger(__name__)

# KEYS[1]: the hash (and the channel); ARGV: this replica's field, its entry, the hash's expiry in
# ms, "1" to read everyone's back, and the message to publish ("" for none).
_EXCHANGE_LUA = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if ARGV[5] ~= '' then
  redis.call('PUBLISH', KEYS[1], ARGV[5])
end
if ARGV[4] == '1' then
  return redis.call('HGETALL', KEYS[1])
end
return {}
"""

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
        push: bool = False,
    ) -> None:
        self.client = client
        # EVALSHA, loading the source again after a Redis restart or SCRIPT FLUSH (NOSCRIPT).
        self._script = client.register_script(_EXCHANGE_LUA)
        self.push = push
        self.subscribed = False
        self.read: dict[str, tuple[float, T]] = {}  # the last exchange's others: id -> (stamp, value)
        self.key = key
        self.name = name
        self.parse = parse
        self.stale_after_s = stale_after_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.replica = secrets.token_hex(4)
        self.errors = 0
        self.down = False

    async def exchange(self, own: Any, *, read: bool = True) -> list[T] | None:
        """Publish ``own`` (JSON-able); the other replicas' fresh values, or None when Redis failed.
        ``read=False`` (their values come pushed): write only, and an empty list."""
        now = self.clock()
        entry = orjson.dumps({"at": now, self.name: own})
        published = self.replica.encode() + b" " + entry if self.push else b""
        expiry_ms = max(1, int(self.stale_after_s * 3000))
        try:
            async with asyncio.timeout(self.timeout_s):
                flat = await self._script(
                    keys=[self.key], args=[self.replica, entry, expiry_ms, b"1" if read else b"0", published]
                )
                others, gone = self._read(flat, now) if read else ([], [])
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

    async def listen(self, deliver: Callable[[str, float, T], None], retry_s: float = 0.5) -> None:
        """Hand every other replica's published entry (its id, stamp and value) to ``deliver`` as
        it comes, for good (resubscribing after Redis trouble; ``subscribed`` meanwhile False)."""
        me = self.replica.encode()

        def published(data: bytes) -> None:
            sender, _, raw = data.partition(b" ")
            if sender != me and (got := self._fresh(raw, self.clock())) is not None:
                deliver(sender.decode(), *got)

        async def subscribed() -> None:
            self.subscribed = True

        def lost(exc: Exception) -> None:
            self.errors += 1
            if self.subscribed:
                log.warning("%s: subscription lost (%s); reading on each exchange", self.key, exc)
            self.subscribed = False

        await follow_channel(
            self.client, self.key.encode(), published, subscribed=subscribed, lost=lost, retry_s=retry_s
        )

    def _fresh(self, raw: bytes, now: float) -> tuple[float, T] | None:
        """A published entry's stamp and value, None when stale or unreadable."""
        try:
            entry = orjson.loads(raw)
            at, value = float(entry["at"]), self.parse(entry[self.name])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            log.warning("%s: ignoring a malformed published entry", self.key)
            return None
        return None if now - at > self.stale_after_s else (at, value)

    def _read(self, everyone: list[bytes], now: float) -> tuple[list[T], list[bytes]]:
        """From the hash as HGETALL lists it (field, value, field, ...): the fresh others' values
        (also kept by replica id and stamp in ``read``), and the fields of replicas gone stale or
        unreadable."""
        others, gone, me = [], [], self.replica.encode()
        read: dict[str, tuple[float, T]] = {}
        for field, raw in zip(everyone[::2], everyone[1::2], strict=True):
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
                read[field.decode()] = (at, value)
        self.read = read
        return others, gone
