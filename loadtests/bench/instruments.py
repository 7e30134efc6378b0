"""Benchmark the request path's metric updates (a script, not a test): the router's instruments
(``router/observe/series.py``) against prometheus_client's Counter, Gauge and Histogram, side by
side in one process, alternating rounds.

One "request" is what the router records for a streamed, answered request: the pick's duration and
kind, the running gauges up and down, TTFT, the request total and duration, the input, output and
cached tokens, TPOT and the normalized TPOT, each under llm-d's and the Inference Extension's names
(``router/observe/metrics.py``: 16 histogram observations and 8 counter or gauge updates).

    python -m loadtests.bench.instruments [--requests 20000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.observe import series

# (declaration, how many label values, what one request does to it)
_UPDATES: Sequence[tuple[series.Series, str, float]] = (
    (series.PICK_DURATION, "observe", 0.0002),
    (series.DECISIONS, "inc", 1.0),
    *((s, "inc", 1.0) for s in series.MODEL_REQUESTS_RUNNING),
    *((s, "observe", 0.05) for s in series.MODEL_TTFT),
    *((s, "dec", 1.0) for s in series.MODEL_REQUESTS_RUNNING),
    *((s, "inc", 1.0) for s in series.MODEL_REQUESTS),
    *((s, "observe", 0.3) for s in series.MODEL_REQUEST_DURATION),
    *((s, "observe", 300.0) for pair in series.MODEL_TOKENS.values() for s in pair),
    *((s, "observe", 0.01) for s in (*series.MODEL_NTPOT, *series.MODEL_TPOT)),
    (series.REQUESTS, "inc", 1.0),
    (series.REQUEST_DURATION, "observe", 0.3),
)


def _prometheus_client(declared: series.Series, registry: CollectorRegistry) -> Any:
    if isinstance(declared, series.HistogramSeries):
        return Histogram(
            declared.name, declared.help, declared.labels, buckets=declared.buckets, registry=registry
        )
    kind = Counter if isinstance(declared, series.CounterSeries) else Gauge
    return kind(declared.name, declared.help, declared.labels, registry=registry)


def one_request(make: Callable[[series.Series, CollectorRegistry], Any]) -> Callable[[], None]:
    """A function doing one request's updates on instruments made by ``make`` (label children
    bound once, as ``RequestMetrics.bind`` does)."""
    registry = CollectorRegistry()
    made: dict[str, Any] = {}
    steps = []
    for declared, method, value in _UPDATES:
        instrument = made.get(declared.name)
        if instrument is None:
            instrument = made[declared.name] = make(declared, registry)
        target = instrument.labels(*("x" for _ in declared.labels)) if declared.labels else instrument
        steps.append((getattr(target, method), value))

    def run() -> None:
        for update, value in steps:
            update(value)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.instruments", description=__doc__)
    parser.add_argument("--requests", type=int, default=20000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per implementation, alternating")
    args = parser.parse_args(argv)
    contenders = {
        "prometheus_client": one_request(_prometheus_client),
        "router": one_request(lambda declared, registry: declared.instrument(registry)),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, run in contenders.items():
            start = time.perf_counter_ns()
            for _ in range(args.requests):
                run()
            times[name].append((time.perf_counter_ns() - start) / args.requests / 1000)
    print(f"one request's metric updates ({len(_UPDATES)}), median of {args.rounds} alternating rounds")
    print(f"{'instruments':<20} {'µs per request':>15}")
    for name, values in times.items():
        print(f"{name:<20} {statistics.median(values):>15.2f}")
    ratio = statistics.median(times["router"]) / statistics.median(times["prometheus_client"])
    print(f"router / prometheus_client: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
