"""Flow control with late binding: hold requests while every eligible pod is saturated, and bind
each to the pod that is best when one has room.

Without it a request is committed at once to one engine's FIFO queue, however long; a burst then
waits behind whichever pods the picker chose at arrival, even when another frees up first. With
it the picker refuses a route whose predicted queue wait exceeds ``flow_control.max_wait_ms``
(``Saturated``), and the request waits here instead:

* **Ordered**: by priority (the objective's, higher first; sheddable < 0), then round-robin
  between tenants (the ``x-llm-d-inference-fairness-id`` header) within a priority, FIFO within a
  tenant. A new request never overtakes a waiting one of its priority or higher. Within a
  tenant, requests with a TTFT SLO leave earliest deadline (arrival + objective) first, ahead of
  those without one (FIFO among themselves); tenants stay round-robin, so one tenant's tight
  deadlines cannot starve another.
* **Bound late**: whenever capacity frees (a prefill finishes, a request ends, a scrape lands) and
  at least every ``poll_s``, the head is picked again *now*; it leaves with the best pod of that
  moment, or stays if the pool is still saturated.
* **Bounded**: at most ``max_queue`` requests (then 503 ``queue_full``; 429 ``shed`` for a
  sheddable one), each at most ``queue_timeout_s`` (then 503 ``queue_timeout``, or 429), with
  ``Retry-After``. Shutdown answers everyone still waiting. A request with a TTFT SLO is refused
  (``slo_unattainable``: 503, or 429 if sheddable) once its objective has run out while held,
  with ``refuse_late``: a late answer would miss it anyway.

``bind_now`` never awaits (the ext_proc stream only pauses when it returns False); ``wait`` is
the held path. Both go through ``Flight.pick``, so a held request is counted like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from router.request.rejections import (
    QueueFull,
    QueueTimeout,
    Rejection,
    Saturated,
    Shed,
    SloShed,
    SloUnattainable,
    SloWait,
)
from router.request.types import RouteRequest


class Flight(Protocol):
    """What flow control needs of a request's flight (``router.flow.flight.Flight``)."""

    request: RouteRequest | None
    decision: object

    def pick(self) -> object: ...

    def fairness_id(self) -> str: ...


@dataclass(frozen=True, slots=True)
class FlowSettings:
    max_queue: int = 1024
    queue_timeout_s: float = 30.0
    poll_s: float = 0.05
    deadlines: bool = True  # requests with a TTFT SLO leave earliest deadline first (``slo.per_request``)
    # A held request with a TTFT SLO is refused (slo_unattainable) when its objective runs out,
    # not answered late (``slo.admission`` other than off).
    refuse_late: bool = False


@dataclass(eq=False, slots=True)
class Waiter:
    flight: Flight
    priority: int
    tenant: str
    enqueued_at: float
    deadline: float = math.inf  # when its TTFT objective runs out (inf: none), on ``clock``
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class FlowObserver:
    """What flow control reports (``router.observe.metrics.FlowMetrics`` implements it)."""

    def queued(self, waiter: Waiter, delta: int) -> None: ...

    def left(self, waiter: Waiter, outcome: str, seconds: float) -> None: ...


class FlowControl:
    def __init__(
        self,
        settings: FlowSettings = FlowSettings(),
        observer: FlowObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.observer = observer or FlowObserver()
        self.clock = clock
        # priority -> tenant -> FIFO; priorities kept sorted high to low on insert.
        self.queues: dict[int, OrderedDict[str, deque[Waiter]]] = {}
        self.size = 0
        self._wake = asyncio.Event()
        self._closed = False

    # -- the request's side --------------------------------------------------------------------

    def bind_now(self, flight: Flight) -> bool:
        """Pick now unless the pool is saturated or requests of this priority or higher wait;
        False: ``wait`` for it. Any other rejection is raised as ``Flight.pick`` raises it."""
        request = flight.request
        assert request is not None
        if self.size and max(self.queues) >= request.priority:
            return False
        try:
            flight.pick()
        except Saturated:
            return False
        return True

    async def wait(self, flight: Flight) -> None:
        """Hold ``flight`` until it is bound (its decision set) or rejected."""
        request = flight.request
        assert request is not None
        sheddable = request.priority < 0
        if self._closed:
            raise QueueFull("shutting down", retry_after_s=1.0)
        if self.size >= self.settings.max_queue:
            cls = Shed if sheddable else QueueFull
            raise cls(f"flow control queue full ({self.size} requests wait)", retry_after_s=1.0)
        now = self.clock()
        ttft_s = None if request.slo is None or not self.settings.deadlines else request.slo.ttft_s
        # From arrival, as the picker spends it: parsing and I/O before the hold already took a share.
        spent = time.perf_counter() - flight.started
        deadline = math.inf if ttft_s is None else now + max(0.0, ttft_s - spent)
        waiter = Waiter(flight, request.priority, flight.fairness_id(), now, deadline)
        self._push(waiter)
        self._wake.set()
        outcome = "dispatched"
        limit = self.settings.queue_timeout_s
        late = self.settings.refuse_late and deadline - now < limit
        if late:
            limit = max(0.0, deadline - now)
        try:
            async with asyncio.timeout(limit):
                await waiter.future
        except TimeoutError:
            outcome = "timeout"
            self._remove(waiter)
            if flight.decision is None and late:
                refusal = SloShed if sheddable else SloUnattainable
                raise refusal(
                    f"held {limit * 1000:.0f} ms, its whole TTFT objective, without a route to meet it",
                    retry_after_s=1.0,
                ) from None
            if flight.decision is None:
                cls = Shed if sheddable else QueueTimeout
                raise cls(
                    f"waited {self.settings.queue_timeout_s:g}s for a pod with room", retry_after_s=1.0
                ) from None
            outcome = "dispatched"  # bound in the same instant: go on
        except asyncio.CancelledError:
            outcome = "cancelled"
            self._remove(waiter)
            raise
        except Rejection:
            outcome = "rejected"
            raise
        finally:
            self.observer.left(waiter, outcome, self.clock() - waiter.enqueued_at)

    # -- the pool's side -------------------------------------------------------------------------

    def capacity_freed(self) -> None:
        """A prefill finished or a request ended: try the head at once (called from the pool)."""
        if self.size:
            self._wake.set()

    def dispatch(self) -> int:
        """Bind waiting requests, best first, while the pool has room. Never awaits.

        A waiter held for its own SLO (``SloWait``: no route meets it yet) is passed over, not a
        reason to stop: the ones behind it may fit the pool as it is."""
        bound = 0
        passed: set[int] = set()  # ids of waiters whose SLO no route meets this round
        while self.size:
            waiter = self._next(passed)
            if waiter is None:
                break
            try:
                waiter.flight.pick()
            except SloWait:
                passed.add(id(waiter))
                continue
            except Saturated:
                break
            except Rejection as rejection:  # the pool changed under it (no pods): answer it
                self._take(waiter)
                waiter.future.set_exception(rejection)
                continue
            self._take(waiter)
            waiter.future.set_result(None)
            bound += 1
        return bound

    async def run(self) -> None:
        """Dispatch on every wake-up and at least every ``poll_s`` while requests wait."""
        while True:
            if self.size:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.settings.poll_s)
            else:
                await self._wake.wait()
            self._wake.clear()
            self.dispatch()

    def close(self) -> None:
        """Shutdown: everyone still waiting is answered 503, nobody new is held."""
        self._closed = True
        for tenants in self.queues.values():
            for fifo in tenants.values():
                for waiter in fifo:
                    if not waiter.future.done():
                        waiter.future.set_exception(QueueFull("shutting down", retry_after_s=1.0))
                    self.observer.queued(waiter, -1)
        self.queues.clear()
        self.size = 0

    # -- the queues ------------------------------------------------------------------------------

    def _push(self, waiter: Waiter) -> None:
        tenants = self.queues.get(waiter.priority)
        if tenants is None:
            self.queues[waiter.priority] = tenants = OrderedDict()
            self.queues = dict(sorted(self.queues.items(), reverse=True))
        fifo = tenants.setdefault(waiter.tenant, deque())
        at = len(fifo)
        while at and fifo[at - 1].deadline > waiter.deadline:  # earliest deadline first, else FIFO
            at -= 1
        fifo.insert(at, waiter)
        self.size += 1
        self.observer.queued(waiter, +1)

    def _next(self, passed: set[int]) -> Waiter | None:
        """The best waiter not in ``passed``: highest priority, tenants in turn, each FIFO in order."""
        for tenants in self.queues.values():
            for fifo in tenants.values():
                for waiter in fifo:
                    if id(waiter) not in passed:
                        return waiter
        return None

    def _take(self, waiter: Waiter) -> None:
        """Out of the queue, bound or answered; its tenant goes to the back (round robin)."""
        tenants = self.queues[waiter.priority]
        fifo = tenants.pop(waiter.tenant)
        fifo.remove(waiter)
        if fifo:
            tenants[waiter.tenant] = fifo
        self._forget(waiter, tenants)

    def _remove(self, waiter: Waiter) -> None:
        tenants = self.queues.get(waiter.priority)
        fifo = None if tenants is None else tenants.get(waiter.tenant)
        if fifo is None or waiter not in fifo:
            return  # already bound or answered
        fifo.remove(waiter)
        if not fifo:
            del tenants[waiter.tenant]  # type: ignore[union-attr]
        self._forget(waiter, tenants)  # type: ignore[arg-type]

    def _forget(self, waiter: Waiter, tenants: OrderedDict[str, deque[Waiter]]) -> None:
        if not tenants:
            del self.queues[waiter.priority]
        self.size -= 1
        self.observer.queued(waiter, -1)
