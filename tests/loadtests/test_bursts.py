"""The same burst, replayed on fresh fleets and routers, gets the same replica recommendation: the
capacity per replica must not swing with each refit of the performance model (one that moves a
prompt's service time near the TTFT SLO can cut it 5-25×). In virtual time, each replay with a
different time per proxy → engine leg (¼× to 8× the usual), so every observation the router learns
from moves; deterministic, where the wall-clock replays (``python -m loadtests.bench.bursts``)
took the machine's hiccups for the router's (a CI run's first replay, on a machine busy a moment
with something else, learned a prefill 1.7× slower than the next two)."""

from __future__ import annotations

import dataclasses

import pytest

from loadtests.bench.bursts import HOPS, SETTINGS, burst, repeat_virtual, table

pytestmark = pytest.mark.integration


def test_identical_bursts_give_recommendations_within_one_replica() -> None:
    # 9k-token prompts: their service is near the TTFT SLO, where the capacity once fell off a cliff.
    phase = burst(requests=32, prompt_tokens=9000, seconds=20.0)
    runs = repeat_virtual(len(HOPS), phase, dataclasses.replace(SETTINGS, speed=10.0), seed=0)
    report = table(runs, phase)
    assert all(r.ok == r.requests for r in runs), report
    peaks = [r.peak_prefill for r in runs]
    # The burst needs more than the two prefill replicas running: the runs must agree on how many.
    assert min(peaks) > 2, report
    assert max(peaks) - min(peaks) <= 2, report  # each within one replica of the middle
    for run in runs:  # the capacity per replica moves with the refits, never by a factor of two
        assert run.capacity_low >= run.capacity_high / 2, report
