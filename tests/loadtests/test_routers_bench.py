"""The side-by-side router benchmark's harness, with pd-router alone (the Rust routers are installed
by the benchmark itself, never by the suite)."""

from __future__ import annotations

import math

from loadtests.bench import routers


def test_every_figure_is_measured_through_the_router() -> None:
    # /proc counts CPU in clock ticks (10 ms): at scale 0.25 the c=1 cell is 100 requests, ~100 ms of
    # router CPU, so a zero reading means the CPU was not read (at 0.05 it could round to no tick).
    # And aiohttp forwarding alone, and around pd-router's request flow.
    names = ["pd-router", routers.FLOOR, routers.FLOOR_FLOW]
    args = routers.parser().parse_args(["--routers", ",".join(names), "--rounds", "1", "--scale", "0.25"])
    rows = routers.run(args)
    for name in names:
        [figures] = rows.rounds[name]
        assert figures.rps_c16 > 0 and figures.cpu_ms_c1 > 0 and figures.cpu_ms_c16 > 0
        assert math.isfinite(figures.added_p50_ms)
    lines = routers.render(rows)
    assert [line.split(" | ")[0] for line in lines[4:7]] == [f"| {name}" for name in names]
    assert any(line.startswith(f"  vs {routers.FLOOR}: CPU ") for line in lines)
