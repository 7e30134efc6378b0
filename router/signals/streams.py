"""Answers still streaming: their time per output token so far.

An answer's TPOT is recorded when it ends (``PerformanceModel.observe_tpot``), so with
generations of tens of seconds the observed decode latency, and the decode ``load`` built on it,
would react one generation late: after a burst, not during it. Every scaling tick therefore also
reads the streams still running: ``(now - first token) / tokens so far`` each (the token being
waited for is counted, so a stream that has stalled shows it), the p90 over those with at least
two tokens. The set holds the answers in flight, never more than ``limit``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import numpy as np


class Streaming(Protocol):
    """What an answer being streamed shows (``router.request.meter.ResponseMeter``)."""

    first_at: float | None  # the first token's time (``clock``'s)
    events: int  # tokens so far


class LiveStreams:
    def __init__(self, limit: int = 65536, clock: Callable[[], float] = time.perf_counter) -> None:
        self.limit = limit
        self.clock = clock
        self._streams: set[Streaming] = set()

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, stream: Streaming) -> None:
        if len(self._streams) < self.limit:
            self._streams.add(stream)

    def discard(self, stream: Streaming) -> None:
        self._streams.discard(stream)

    def tpot_p90(self) -> float | None:
        """The p90 of the running streams' seconds per token so far; None without any."""
        now = self.clock()
        values = [
            (now - s.first_at) / s.events for s in self._streams if s.first_at is not None and s.events >= 2
        ]
        return float(np.quantile(values, 0.9)) if values else None
