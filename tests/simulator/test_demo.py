"""The README's first command keeps working: the demo runs end to end and reports its table."""

from __future__ import annotations

import pytest

from simulator.demo import run_demo

pytestmark = pytest.mark.integration


async def test_demo_routes_every_request_and_prints_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert await run_demo(requests=16, seed=3) == 0
    out = capsys.readouterr().out
    assert "16 ok / 16 sent" in out
    assert "TTFT p50 / p99" in out and "prefix-cache hit rate" in out
    assert "-> decode-" in out  # which pairs were chosen, and why
