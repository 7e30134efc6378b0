"""The virtual clock's own guarantees: a run that cannot end fails instead of hanging, time and the
router's clock defaults are the real ones again afterwards, and each run's clock moves."""

from __future__ import annotations

import asyncio
import sys
import time
import types
from collections.abc import Callable

import pytest

from simulator.virtual_clock import VirtualDeadlock, VirtualTimeLimit, run_virtual


def test_waiting_for_what_never_comes_is_a_deadlock_not_a_hang() -> None:
    with pytest.raises(VirtualDeadlock):
        run_virtual(asyncio.Event().wait())


def test_a_run_kept_busy_forever_by_a_periodic_loop_runs_out_of_virtual_time() -> None:
    async def ticking_forever() -> None:
        while True:
            await asyncio.sleep(1.0)  # virtual: a scrape loop that never ends

    with pytest.raises(VirtualTimeLimit):
        run_virtual(ticking_forever(), max_virtual_s=60.0)


def test_clocks_and_defaults_captured_during_a_run_are_real_again_after_it() -> None:
    """A module imported during a run defines its defaults with the virtual clocks: afterwards
    they must be the real ones, or the next run reads a clock frozen at the last one's end."""
    name = "loadtests._virtual_clock_probe"
    probe: dict[str, Callable[..., float]] = {}

    async def import_during_the_run() -> float:
        module = types.ModuleType(name)
        exec(  # a module whose function captured the clock when it was defined
            "import time\ndef now(clock=time.monotonic):\n    return clock()\n", module.__dict__
        )
        sys.modules[name] = module
        probe["now"] = module.now
        await asyncio.sleep(5.0)
        return module.now()

    try:
        inside = run_virtual(import_during_the_run())
        assert probe["now"].__defaults__ == (time.monotonic,)
        assert abs(probe["now"]() - time.monotonic()) < 1.0  # the real clock, not the frozen one
        assert inside != probe["now"]()

        async def later() -> tuple[float, float]:
            before = probe["now"]()
            await asyncio.sleep(2.0)
            return before, probe["now"]()

        before, after = run_virtual(later())
        assert after - before == pytest.approx(2.0)  # a second run's clock moves
    finally:
        sys.modules.pop(name, None)
