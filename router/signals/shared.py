"""The pool's arrival rates across router replicas, through the Redis they already share.

Each replica counts only the requests it routed, and KEDA reads one replica (one connection per
``scalerAddress``): with several replicas, the rates behind a recommendation must be the pool's.
Every tick a replica writes its own rates into the hash ``{namespace}:demand`` (field: its id;
value: its rates and the wall time it measured them) and reads everyone's; the rates of the
others measured within ``stale_after_s`` are added to its own at the next tick. A replica that
stops writing (killed, partitioned) drops out after ``stale_after_s``, and the next reader deletes
its field; the hash itself expires once no replica writes. Redis trouble never stops a tick: the
replica then counts its own rates alone, logs once per outage and counts the failed exchanges.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Rates:
    """Arrivals per second as one replica (or the pool) measured them."""

    prompt_tokens: float = 0.0  # uncached prompt tokens routed
    requests: float = 0.0
    answer_tokens: float = 0.0  # answer tokens asked for (max_tokens)

    def __add__(self, other: Rates) -> Rates:
        return Rates(
            self.prompt_tokens + other.prompt_tokens,
            self.requests + other.requests,
            self.answer_tokens + other.answer_tokens,
        )


class SharedDemand:
    def __init__(
        self,
        client: Any,  # redis.asyncio.Redis
        namespace: str,
        *,
        stale_after_s: float,
        timeout_s: float = 0.5,
        clock: Callable[[], float] = time.time,  # wall time: replicas compare each other's stamps
    ) -> None:
        self.client = client
        self.key = f"{namespace}:demand"
        self.stale_after_s = stale_after_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.replica = secrets.token_hex(4)
        self.others = Rates()  # the fresh others' sum, as last read
        self.replicas = 1  # replicas whose rates the pool's include (this one too)
        self.errors = 0
        self._down = False

    async def exchange(self, own: Rates) -> None:
        """Publish ``own``, then read the others' (``others``, ``replicas``)."""
        now = self.clock()
        entry = orjson.dumps({"at": now, "rates": [own.prompt_tokens, own.requests, own.answer_tokens]})
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.client.pipeline(transaction=False) as pipe:
                    pipe.hset(self.key, self.replica, entry)
                    pipe.pexpire(self.key, max(1, int(self.stale_after_s * 3000)))
                    pipe.hgetall(self.key)
                    *_, everyone = await pipe.execute()
                gone = self._read(everyone, now)
                if gone:
                    await self.client.hdel(self.key, *gone)
        except Exception as exc:  # Redis down, slow or answering garbage: count our own
            self.errors += 1
            self.others, self.replicas = Rates(), 1
            if not self._down:
                log.warning("shared demand: Redis exchange failed (%s); counting this replica's only", exc)
            self._down = True
            return
        if self._down:
            log.info("shared demand: Redis is back; counting %d replicas", self.replicas)
        self._down = False

    def _read(self, everyone: dict[bytes, bytes], now: float) -> list[bytes]:
        """Sum the fresh others into ``others``; returns the fields of replicas gone stale."""
        others, replicas, gone = Rates(), 1, []
        me = self.replica.encode()
        for field, raw in everyone.items():
            if field == me:
                continue
            try:
                entry = orjson.loads(raw)
                at = float(entry["at"])
                prompt_tokens, requests, answer_tokens = (float(v) for v in entry["rates"])
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                log.warning("shared demand: ignoring a malformed entry %r", field)
                gone.append(field)
                continue
            if now - at > self.stale_after_s:
                gone.append(field)
                continue
            others += Rates(prompt_tokens, requests, answer_tokens)
            replicas += 1
        self.others, self.replicas = others, replicas
        return gone
