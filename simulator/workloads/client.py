"""Open-loop load client: sends a workload at its arrival times, measures TTFT/TPOT per request."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
import orjson

from simulator.workloads.generate import WorkItem, Workload


@dataclass(slots=True)
class Result:
    ok: bool
    status: int
    ttft_s: float = float("nan")
    tpot_s: float = float("nan")
    latency_s: float = float("nan")
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    decode: str = ""
    prefill: str = ""
    reason: str = ""
    error: str = ""
    at_s: float = float("nan")  # the item's arrival offset (set by run_workload)
    request_id: str = ""  # the X-Request-Id the router answered with (matches its pick)
    tag: str = ""  # the work item's class (``WorkItem.tag``), e.g. its SLO class


def percentile(values: Iterable[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0..1) of ``values``; NaN when there are none."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@dataclass(slots=True)
class Summary:
    name: str
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.ok]

    def pct(self, attr: str, q: float) -> float:
        return percentile([getattr(r, attr) for r in self.ok if getattr(r, attr) == getattr(r, attr)], q)

    def median(self, attr: str) -> float:
        values = [getattr(r, attr) for r in self.ok if getattr(r, attr) == getattr(r, attr)]
        return statistics.median(values) if values else float("nan")

    @property
    def hit_rate(self) -> float:
        prompt = sum(r.prompt_tokens for r in self.ok)
        return sum(r.cached_tokens for r in self.ok) / prompt if prompt else 0.0

    @property
    def throughput(self) -> float:
        """Output tokens per second over the whole run."""
        return sum(r.completion_tokens for r in self.ok) / self.wall_s if self.wall_s else 0.0

    def pairs(self) -> Counter[str]:
        return Counter(f"{r.prefill or '-'} -> {r.decode}" for r in self.ok)


def _has_text(choice: dict) -> bool:
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


class StreamTally:
    """What a client reads from a streamed answer, line by line: TTFT is the first content chunk,
    TPOT the mean gap after it, usage from the usage chunk; an error event ends the answer."""

    __slots__ = ("_partial", "chunks", "error", "first", "last", "started", "usage")

    def __init__(self, started: float) -> None:
        self.started = started
        self.first = self.last = 0.0
        self.chunks = 0
        self.usage: dict = {}
        self.error: str | None = None
        self._partial = b""  # a line cut between two pieces of ``feed``

    def line(self, line: bytes, now: float) -> bool:
        """One line of the stream, read at ``now``; True when it was an error event (stop reading)."""
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            return False
        event = orjson.loads(line[6:])
        if "error" in event:
            self.error = str(event["error"])
            return True
        if event.get("usage"):
            self.usage = event["usage"]
        if any(_has_text(choice) for choice in event.get("choices") or ()):
            # The first chat chunk is an empty role delta sent before any work: not a token.
            self.first = self.first or now
            self.last = now
            self.chunks += 1
        return False

    def feed(self, data: bytes, now: float) -> bool:
        """Raw bytes of the stream, read at ``now`` (lines may be cut between pieces); as ``line``."""
        lines = (self._partial + data if self._partial else data).split(b"\n")
        self._partial = lines.pop()
        # Events end with a blank line: skipped at once.
        return any(line and self.line(line, now) for line in lines)

    def result(self, status: int, headers: Mapping[str, str]) -> Result:
        """The request's ``Result`` once the answer ended (``headers``: the response's)."""
        if self.error is not None:
            return Result(False, status, error=self.error)
        if not self.chunks:
            return Result(False, 200, error="no tokens")
        usage = self.usage
        details = usage.get("prompt_tokens_details") or {}
        first, last, chunks = self.first, self.last, self.chunks
        return Result(
            True,
            200,
            ttft_s=first - self.started,
            tpot_s=(last - first) / (chunks - 1) if chunks > 1 else float("nan"),
            latency_s=last - self.started,
            prompt_tokens=usage.get("prompt_tokens", 0),
            cached_tokens=details.get("cached_tokens", 0) or 0,
            completion_tokens=usage.get("completion_tokens", chunks),
            decode=headers.get("x-pd-router-decode", ""),
            prefill=headers.get("x-pd-router-prefill", ""),
            reason=headers.get("x-pd-router-reason", ""),
            request_id=headers.get("x-request-id", ""),
        )


async def send(
    session: aiohttp.ClientSession, base_url: str, item: WorkItem, headers: Mapping[str, str] | None = None
) -> Result:
    """One streaming request; TTFT is the first content chunk, TPOT the mean gap after it."""
    tally = StreamTally(time.perf_counter())
    try:
        async with session.post(base_url + item.path, json=item.body, headers=headers) as resp:
            if resp.status != 200:
                return Result(False, resp.status, error=(await resp.text())[:200])
            async for line in resp.content:
                if tally.line(line, time.perf_counter()):
                    break
            return tally.result(resp.status, resp.headers)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Result(False, 0, error=type(exc).__name__)


async def run_workload(
    base_url: str,
    workload: Workload,
    *,
    name: str | None = None,
    timeout_s: float = 300.0,
    on_done: Callable[[Result], None] | None = None,
) -> Summary:
    """Send every item at its arrival time (open loop) and wait for all of them."""
    summary = Summary(name or workload.name)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as session:
        start = time.perf_counter()

        async def one(item: WorkItem) -> None:
            delay = item.at_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            result = await send(session, base_url, item)
            result.at_s = item.at_s
            summary.results.append(result)
            if on_done is not None:
                on_done(result)

        await asyncio.gather(*(one(item) for item in workload.items))
        summary.wall_s = time.perf_counter() - start
    return summary
