"""The README's first command keeps working: the demo runs end to end, routes the same requests
by least-loaded and by pd-router, and reports both side by side."""

from __future__ import annotations

import re

import pytest

from simulator.demo import demo_workload, run_demo

pytestmark = pytest.mark.integration


async def test_the_demo_routes_every_request_both_ways_and_keeps_pd_routers_kv_in_its_rack(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert await run_demo(requests=24, seed=3) == 0
    out = capsys.readouterr().out
    assert out.count("24 ok / 24 sent") == 2  # pd-router's column and least-loaded's
    assert "Same requests: pd-router's TTFT is" in out
    assert "-> decode-" in out  # which routes pd-router chose, and why
    pairs = re.search(r"P/D pairs\s+(\d+) \((\d+) cross-rack\)\s+(\d+) \((\d+) cross-rack\)", out)
    assert pairs is not None, out
    _, ours_across, baseline, baseline_across = map(int, pairs.groups())
    # Least-loaded pairs every request and picks each leg alone, so some KV crosses the slow link;
    # pd-router prices the transfer and keeps its pairs inside a rack.
    assert baseline == 24 and baseline_across > 0
    assert ours_across == 0


def test_the_demo_workload_mixes_warm_questions_and_cold_documents() -> None:
    items = demo_workload(120, seed=0).items
    documents = [i for i in items if i.body["prompt"].startswith("Summarise this document:")]
    assert 20 <= len(documents) <= 60  # about one in three
    assert len({i.body["prompt"] for i in documents}) == len(documents)  # each one cold
    assert [i.at_s for i in items] == sorted(i.at_s for i in items)


async def test_without_the_baseline_only_pd_router_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert await run_demo(requests=8, seed=1, baseline=False) == 0
    out = capsys.readouterr().out
    assert out.count("8 ok / 8 sent") == 1 and "least-loaded" not in out
