"""The request path's instruments (router/observe/series.py) expose exactly what prometheus_client's
own Counter, Gauge and Histogram would for the same updates: same samples, same bucket bounds and
counts, same sums (less the optional ``_created`` series), and refuse what they refuse."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.observe import series


def _exposed(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_exposition_is_prometheus_clients_for_the_same_updates() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    counter = series.CounterSeries("c", "A counter.", ("a", "b"))
    gauge = series.GaugeSeries("g", "A gauge.", ("a",))
    plain = series.GaugeSeries("g0", "A gauge without labels.")
    histogram = series.HistogramSeries("h", "A histogram.", ("a",), (25e-6, 0.001, 0.5, 1, 2.5, 3600))
    lone = series.HistogramSeries("h0", "A histogram without labels.", buckets=(1, 8, 16))
    mine = {s.name: s.instrument(ours) for s in (counter, gauge, plain, histogram, lone)}
    reference = {
        "c": Counter("c", "A counter.", ("a", "b"), registry=theirs),
        "g": Gauge("g", "A gauge.", ("a",), registry=theirs),
        "g0": Gauge("g0", "A gauge without labels.", registry=theirs),
        "h": Histogram("h", "A histogram.", ("a",), buckets=histogram.buckets, registry=theirs),
        "h0": Histogram("h0", "A histogram without labels.", buckets=lone.buckets, registry=theirs),
    }
    for both in (mine, reference):
        both["c"].labels("x", "y").inc()
        both["c"].labels(a="x", b="y").inc(2.5)
        both["c"].labels("x", "z").inc(0)
        both["g"].labels("x").inc(3)
        both["g"].labels("x").dec(1.5)
        both["g"].labels("w").set(7)
        both["g0"].inc()
        for value in (0.0, 25e-6, 30e-6, 0.001, 0.7, 1.0, 2.5, 2.6, 3600.0, 1e9, -1.0):
            both["h"].labels("x").observe(value)
        for value in (1, 8, 9, 17, 16):
            both["h0"].observe(value)
    assert _exposed(ours) == _exposed(theirs)
    assert any('h_bucket{a="x",le="2.5e-05"} 3.0' in line for line in _exposed(ours))


def test_a_nan_lands_in_no_bucket_but_in_the_sum_as_prometheus_client_does() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    declared = series.HistogramSeries("h", "A histogram.", buckets=(1.0,))
    mine = declared.instrument(ours)
    reference = Histogram("h", "A histogram.", buckets=(1.0,), registry=theirs)
    for histogram in (mine, reference):
        histogram.observe(0.5)
        histogram.observe(math.nan)
    assert _exposed(ours) == _exposed(theirs)


def test_wrong_labels_and_a_falling_counter_are_refused() -> None:
    registry = CollectorRegistry()
    labelled = series.CounterSeries("c", "A counter.", ("a", "b")).instrument(registry)
    plain = series.CounterSeries("p", "A plain counter.").instrument(registry)
    with pytest.raises(ValueError, match="labels"):
        labelled.labels("only one")
    with pytest.raises(ValueError, match="labels"):
        labelled.labels(a="x", c="y")
    with pytest.raises(ValueError, match="use labels"):
        labelled.inc()
    with pytest.raises(ValueError, match="labels"):
        plain.labels("x")
    with pytest.raises(ValueError, match="only goes up"):
        plain.inc(-1)
    with pytest.raises(ValueError, match="Duplicated"):  # the registry still refuses a second "c"
        series.CounterSeries("c", "Again.").instrument(registry)
