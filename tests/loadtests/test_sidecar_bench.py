"""The sidecar benchmark's harness: each client's cells go through a real sidecar, both legs."""

from __future__ import annotations

import argparse

from loadtests.bench import sidecar


def test_every_cell_runs_both_legs_through_the_sidecar_with_each_client() -> None:
    seen = sidecar.run(argparse.Namespace(rounds=1, scale=0.1))  # 200 requests a cell
    assert set(seen) == {(client, kind) for client in sidecar.CLIENTS for kind in ("whole", "stream")}
    for [(rps, cpu_ms)] in seen.values():
        # /proc counts CPU in 10-ms ticks: 200 requests through two legs take more than one.
        assert rps > 0 and cpu_ms > 0
    lines = sidecar.render(seen, 1)
    assert sum(line.startswith("| builtin |") for line in lines) == 2
    assert any(line.startswith("whole: builtin over aiohttp, CPU per request ") for line in lines)
