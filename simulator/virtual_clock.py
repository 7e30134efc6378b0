"""Virtual time for the simulator: an asyncio event loop whose clock only moves when nothing is
left to run, so a simulated minute costs the CPU it takes to compute, not a minute.

``VirtualEventLoop`` is asyncio's own selector loop with two changes: ``time()`` reads a
``VirtualClock``, and its selector never waits: asked to wait ``timeout`` seconds for I/O it
advances the clock by ``timeout`` and reports no event, so the loop's next iteration runs the
timers due then. There is no real I/O in this mode (the engines and the router talk in-process,
``simulator.local_net``); a wait with nothing scheduled can never end, and raises
``VirtualDeadlock`` instead of hanging. Executors (threads) are refused: their results would land
at a real-time moment, which is not reproducible.

``virtual_time(clock)`` makes every clock the code reads the same virtual one while a run lasts:
``time.monotonic``, ``time.perf_counter`` and ``time.time`` (wall time = a fixed epoch + the
virtual clock), and the defaults of functions that captured the real clocks when they were
defined (``clock: Callable[[], float] = time.monotonic`` in the router's signals, control plane
and flow control), swapped in the modules under test and restored afterwards. The global
``random`` generator is seeded for the run and restored too (the scrape loop's jitter draws from
it).

Same code, same seed, same numbers, on any machine: ``run_virtual(main(), seed=0)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import selectors
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import Executor
from typing import Any, TypeVar

T = TypeVar("T")

# Where virtual time starts: far from 0, so "never" (0.0) in any timestamp field stays in the past.
START_S = 10_000.0
# The wall-clock epoch virtual time maps to (time.time()): 2026-01-01 00:00:00 UTC.
EPOCH_S = 1_767_225_600.0
# Packages whose functions may hold the real clocks as default arguments.
CLOCK_MODULES = ("router", "scorers", "kvindex", "loadtests")


# How much virtual time a run may take at most: a task that waits forever while periodic loops
# (scrapes, ticks) keep the clock moving never deadlocks, so it must run out of time instead.
MAX_VIRTUAL_S = 3600.0


class VirtualDeadlock(RuntimeError):
    """Nothing is ready and nothing is scheduled: every task waits for something that cannot come."""


class VirtualTimeLimit(RuntimeError):
    """The run took more virtual time than it was given (``run_virtual``'s ``max_virtual_s``)."""


class VirtualClock:
    """Seconds since an arbitrary start; moves only when the loop sleeps, up to ``limit``."""

    __slots__ = ("limit", "now")

    def __init__(self, start: float = START_S, max_virtual_s: float = MAX_VIRTUAL_S) -> None:
        self.now = start
        self.limit = start + max_virtual_s

    def __call__(self) -> float:
        return self.now

    def wall(self) -> float:
        """``time.time()`` in virtual time."""
        return EPOCH_S + self.now

    def ns(self) -> int:
        return int(self.now * 1e9)


class _Selector(selectors.SelectSelector):
    """Registrations are kept (asyncio's self-pipe registers itself) but never polled."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise VirtualDeadlock(
                "virtual clock: nothing is ready and nothing is scheduled (every task is waiting for "
                "something that will never happen)"
            )
        if timeout > 0:
            self.clock.now += timeout
            if self.clock.now > self.clock.limit:
                raise VirtualTimeLimit(
                    f"virtual clock: the run is past its {self.clock.limit - START_S:g} s of virtual time"
                )
        return []


class VirtualEventLoop(asyncio.SelectorEventLoop):  # type: ignore[misc,valid-type]
    """asyncio's selector loop on a ``VirtualClock``: sleeping is free, time jumps to the next timer."""

    def __init__(self, clock: VirtualClock | None = None) -> None:
        self.clock = clock or VirtualClock()
        super().__init__(_Selector(self.clock))
        # Timers due within this of "now" run in the same iteration: the clock jumps exactly to
        # the earliest one, so only float rounding needs covering.
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self.clock.now

    def run_in_executor(
        self, executor: Executor | None, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        raise RuntimeError(
            f"virtual clock: {getattr(func, '__qualname__', func)!r} wants a thread; threads finish at "
            "real-time moments, which virtual time cannot reproduce (use the in-process, "
            "approximate-mode path)"
        )

    def set_default_executor(self, executor: Any) -> None:
        raise RuntimeError("virtual clock: no executors")


def _swap_defaults(replacements: dict[int, Callable[[], Any]]) -> None:
    """Replace default arguments that are one of ``replacements``' keys (a clock, by identity) in
    every function of the modules under ``CLOCK_MODULES``."""

    def fix(fn: Any) -> None:
        code_fn = getattr(fn, "__func__", fn)  # classmethod / staticmethod
        if not hasattr(code_fn, "__code__"):
            return
        # getattr: a compiled function (numba's dispatcher) has a __code__ and no __kwdefaults__.
        defaults = getattr(code_fn, "__defaults__", None)
        if defaults and any(id(d) in replacements for d in defaults):
            code_fn.__defaults__ = tuple(replacements.get(id(d), d) for d in defaults)
        kw = getattr(code_fn, "__kwdefaults__", None)
        if kw and any(id(d) in replacements for d in kw.values()):
            code_fn.__kwdefaults__ = {k: replacements.get(id(v), v) for k, v in kw.items()}

    for name, module in list(sys.modules.items()):
        if module is None or name.split(".", 1)[0] not in CLOCK_MODULES:
            continue
        for value in list(vars(module).values()):
            if getattr(value, "__module__", None) != name:
                continue  # imported from elsewhere: fixed where it is defined
            if isinstance(value, type):
                for attr in list(vars(value).values()):
                    fix(attr)
            else:
                fix(value)


@contextlib.contextmanager
def virtual_time(clock: VirtualClock, *, seed: int = 0) -> Iterator[VirtualClock]:
    """Every clock reads ``clock`` (and ``random`` is seeded with ``seed``) until the block ends.

    Not thread-safe by design: nothing else should run while a virtual run does (the process's
    other threads would read virtual time too)."""
    real = {
        "monotonic": time.monotonic,
        "perf_counter": time.perf_counter,
        "time": time.time,
        "monotonic_ns": time.monotonic_ns,
        "perf_counter_ns": time.perf_counter_ns,
        "time_ns": time.time_ns,
    }
    # One object per clock, so a default captured during the run can be mapped back to its own.
    fake: dict[str, Callable[[], Any]] = {
        "monotonic": clock,
        "perf_counter": clock.__call__,
        "time": clock.wall,
        "monotonic_ns": clock.ns,
        "perf_counter_ns": clock.ns,
        "time_ns": lambda: int(clock.wall() * 1e9),
    }
    state = random.getstate()
    _swap_defaults({id(real[name]): fake[name] for name in real})
    for name, fn in fake.items():
        setattr(time, name, fn)
    random.seed(seed)
    try:
        yield clock
    finally:
        for name, fn in real.items():
            setattr(time, name, fn)
        # Back to the real clocks, also in modules imported during the run (they captured the
        # virtual ones): else every later run would read this run's frozen clock.
        _swap_defaults({id(fake[name]): real[name] for name in real})
        random.setstate(state)


def run_virtual(
    main: Coroutine[Any, Any, T] | Callable[[], Awaitable[T]],
    *,
    seed: int = 0,
    max_virtual_s: float = MAX_VIRTUAL_S,
) -> T:
    """Run ``main`` to completion on a fresh ``VirtualEventLoop`` in virtual time, at most
    ``max_virtual_s`` of it (else ``VirtualTimeLimit``); the loop is closed after (its async
    generators finalised, as ``asyncio.run`` does)."""
    clock = VirtualClock(max_virtual_s=max_virtual_s)
    loop = VirtualEventLoop(clock)
    asyncio.set_event_loop(loop)
    try:
        with virtual_time(clock, seed=seed):
            coro = main if asyncio.iscoroutine(main) else main()  # type: ignore[operator]
            try:
                return loop.run_until_complete(coro)
            finally:
                _cancel_all(loop)
                loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what the run left behind and let it unwind (``asyncio.run``'s own clean-up)."""
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
