"""A short soak (``loadtests.bench.soak``): ~10 s of open-loop load through the proxy with one engine
crash-stopped and restarted on its port in the middle.

Only requests whose lifetime overlaps the fault may fail, and only with an outcome the proxy
documents for it; nothing else fails; the router holds no reservation afterwards; and the process
does not grow without bound (a leak detector, not a speed test: no wall-clock assertion).
"""

from __future__ import annotations

import pytest

from loadtests.bench import soak

pytestmark = pytest.mark.integration

RSS_GROWTH_BOUND_MB = 200.0


async def test_a_short_soak_through_the_proxy_fails_only_inside_its_fault_and_leaks_nothing() -> None:
    # One fault: a restart of one pod from 4 s to 6 s (the next would not end 2 s before the phase does).
    result = await soak.run_soak(
        ["proxy"], 10.0, 20.0, seed=0, fault_every_s=4.0, fault_s=2.0, kinds=("restart",), grace_s=1.0
    )
    assert len(result.faults) == 1
    fault = result.faults[0]
    assert fault.kind == "restart" and fault.end_s > fault.start_s

    assert len(result.requests) >= 100  # ~200 scheduled; every one of them answered, one way or another
    failed = [d for d in result.requests if d.outcome != "ok"]
    for done in failed:
        assert result.in_fault(done), f"failed outside the fault: {done}"
        assert done.outcome in soak.ALLOWED["proxy"], f"undocumented outcome: {done}"
    assert result.unexpected() == []

    outside = [d for d in result.requests if not result.in_fault(d)]
    assert outside, "every request overlapped the fault: the test says nothing"
    assert all(d.outcome == "ok" for d in outside)  # error rate outside the fault window: 0

    assert result.outstanding_end == 0
    assert result.ticks and all(t.rss_mb == t.rss_mb for t in result.ticks)  # sampled each second
    assert result.rss_growth_mb < RSS_GROWTH_BOUND_MB

    lines = soak.report(result, window_s=5.0)
    assert any("unexpected failures" in line and line.rstrip().endswith(": 0") for line in lines)
