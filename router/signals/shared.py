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

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.state.replica_board import ReplicaBoard


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


def _rates(value: Any) -> Rates:
    prompt_tokens, requests, answer_tokens = (float(v) for v in value)
    return Rates(prompt_tokens, requests, answer_tokens)


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
        self.board = ReplicaBoard(
            client,
            f"{namespace}:demand",
            "rates",
            _rates,
            stale_after_s=stale_after_s,
            timeout_s=timeout_s,
            clock=clock,
        )
        self.others = Rates()  # the fresh others' sum, as last read
        self.replicas = 1  # replicas whose rates the pool's include (this one too)

    async def exchange(self, own: Rates) -> None:
        """Publish ``own``, then read the others' (``others``, ``replicas``)."""
        others = await self.board.exchange([own.prompt_tokens, own.requests, own.answer_tokens])
        others = others or []  # Redis failed: count our own
        self.others = sum(others, Rates())
        self.replicas = 1 + len(others)
