"""What the other router replicas have in flight on each endpoint, through the Redis they share.

Each replica reserves what it routes (``Pool.reserve``) and sees only its own reservations: two
replicas behind one gateway would both find a pod idle and send it their next prompts at once.
Every ``interval_s`` a replica writes its own reservations per endpoint into the hash
``{namespace}:load`` (field: its id; value: the wall time and, per endpoint id with anything in
flight, its queued prompt tokens, reserved KV tokens and decoding requests) and reads everyone's;
the sum of the others' fresh entries lands in the pool's ``others_*`` arrays, which
``Pool.candidates`` adds to its own. So another replica's picks are at most one interval (plus a
round trip) old, never unseen; a replica also exchanges as soon as a pick reserves more (at most
every ``min_gap_s``) and right before a pick (``refresh``, from a producer), so at a high request
rate the others' view of new reservations lags by a round trip, not an interval. What a replica
gives back (a prefill done, a request ended) goes with its next exchange, not one of its own: the
others overestimate its load for a moment, never miss a pick. Telling every change cost ~3.8
exchanges per request instead of ~2.3, each a round trip and a wake-up of every reader, for no
better routing (docs/benchmarks.md, "Picker replicas"). A replica that stops writing
(killed, partitioned) drops out after ``stale_after_s`` and the next reader deletes its field; the
hash expires once nobody writes. Redis trouble never stops routing: the others' share is then zero
(each replica sees its own, as without sharing), the outage is logged once and the failed exchanges
are counted.

With ``push`` each exchange is also published and every replica follows the others' as they come
(``ReplicaBoard.listen``): the others' view is then as fresh as their writes, and ``refresh``
before a pick has nothing to wait for.

A replica whose last read found no other (``alone``: one replica given a Redis, or the last one
left) writes only at the heartbeat and refreshes nothing before a pick: its changes have no reader,
and a replica that joins is seen at the next heartbeat, within the ``interval_s`` every view is
bounded by anyway. Exchanging at every change (and with a pipeline of three commands) a lone
replica given a Redis spent ~1.4x the CPU per request it does now behind Envoy
(docs/benchmarks.md, "Picker replicas").
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from router.state.features import SHARED
from router.state.pool import Pool
from router.state.replica_board import ReplicaBoard


class SharedLoad:
    def __init__(
        self,
        client: Any,  # redis.asyncio.Redis
        namespace: str,
        pool: Pool,
        *,
        interval_s: float,
        timeout_s: float = 0.5,
        # Closer together, exchanges only cost CPU (~0.5 ms each for 16 pods and 4 replicas, redis-py):
        # at 2 ms, four replicas on two cores routed worse than with no sharing at all.
        min_gap_s: float = 0.005,
        clock: Callable[[], float] = time.time,  # wall time: replicas compare each other's stamps
        push: bool = False,
    ) -> None:
        self.pool = pool
        self.interval_s = interval_s
        # Three missed exchanges: the replica is gone (or cut off), its share no longer counts.
        self.board = ReplicaBoard(
            client,
            f"{namespace}:load",
            "load",
            _load,
            stale_after_s=max(3 * interval_s, 0.5),
            timeout_s=timeout_s,
            clock=clock,
            push=push,
        )
        # The others' latest entries: replica id -> (stamp, reservations per endpoint id).
        self._others: dict[str, tuple[float, dict[str, list[float]]]] = {}
        self._read_once = False  # since Redis last failed: whether ``_others`` says who is there
        self.replicas = 1  # replicas whose reservations the pool's view includes (this one too)
        self.min_gap_s = min_gap_s
        self._grew = asyncio.Event()
        self._running: asyncio.Task[None] | None = None
        self._last = -math.inf  # monotonic time the last exchange started

    def reserved(self) -> None:
        """This replica reserved more (``Pool.on_reserve``): tell the others soon."""
        self._grew.set()

    async def run(self) -> None:
        """Exchange when this replica reserves more (at most every ``min_gap_s``; not while
        ``alone``), and at least every ``interval_s``."""
        while True:
            heartbeat = not await self._change_to_tell()
            self._grew.clear()
            wait = self._last + self.min_gap_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if self._running is not None:  # it read our reservations before this change
                await asyncio.shield(self._running)
            if heartbeat or not self.pushed:
                await self._start()
            else:  # the others' come pushed: tell them ours, read theirs at the heartbeat
                self._last = time.monotonic()
                await self.board.exchange(self.own(), read=False)

    async def _change_to_tell(self) -> bool:
        """True once this replica reserved more with another replica to tell, False
        when ``interval_s`` passed first (the heartbeat)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.interval_s):
                while True:
                    await self._grew.wait()
                    self._grew.clear()
                    if not self.alone:
                        return True
        return False

    @property
    def pushed(self) -> bool:
        """Whether the others' exchanges reach this replica as they are made."""
        return self.board.subscribed and not self.board.down

    @property
    def alone(self) -> bool:
        """The last read found no other replica (and Redis has not failed since)."""
        return self._read_once and not self._others

    @property
    def current(self) -> bool:
        """Whether a ``refresh`` could add nothing: the others' exchanges are pushed here, or there
        are no others."""
        return self.pushed or self.alone

    async def refresh(self) -> None:
        """An exchange now, unless one is under way (then that one) or one started within
        ``min_gap_s``: fresh enough for a pick, without one round trip per caller. Nothing while
        ``current``: the view is already as of now."""
        if self.current:
            return
        if self._running is not None:
            await asyncio.shield(self._running)
        elif not self.board.down and time.monotonic() - self._last >= self.min_gap_s:
            await self._start()
        # down: the heartbeat in ``run`` finds out when Redis is back

    async def _start(self) -> None:
        self._last = time.monotonic()
        running = self._running = asyncio.ensure_future(self.exchange())
        # Cleared when it ends, even if every caller waiting on it was cancelled meanwhile.
        running.add_done_callback(self._ended)
        await asyncio.shield(running)

    def _ended(self, task: asyncio.Future[None]) -> None:
        if self._running is task:
            self._running = None

    def own(self) -> dict[str, list[float]]:
        """This replica's reservations per endpoint id, those with anything in flight."""
        pool = self.pool
        arrays = [getattr(pool, name) for name in SHARED]
        busy = np.flatnonzero(np.any([a != 0 for a in arrays], axis=0))
        out = {}
        for slot in busy.tolist():
            endpoint = pool.by_slot[slot]
            if endpoint is not None:
                out[endpoint.id] = [float(a[slot]) for a in arrays]
        return out

    async def leave(self) -> None:
        """At shutdown: an empty entry in Redis (pushed to the others too), so no replica counts
        this one's last reservations for the ``stale_after_s`` a killed replica's would last. Not
        while Redis is known down: the stop would wait out the timeout for nothing."""
        if not self.board.down:
            await self.board.exchange({}, read=False)

    async def exchange(self) -> None:
        """Publish this replica's reservations, then add the others' up into the pool (none when
        Redis failed: the pick then sees this replica's own, as without sharing)."""
        others = await self.board.exchange(self.own())
        self._read_once = others is not None
        if others is None:
            self._others.clear()
        else:
            # What Redis holds is every replica's; a pushed entry newer than it stays.
            read = self.board.read
            self._others = {
                replica: max(entry, self._others.get(replica, entry), key=lambda e: e[0])
                for replica, entry in read.items()
            }
        self._add_up()

    async def follow(self) -> None:
        """Take the others' exchanges as they are published (with ``push``), for good."""
        await self.board.listen(self._pushed)

    def _pushed(self, replica: str, at: float, load: dict[str, list[float]]) -> None:
        if at >= self._others.get(replica, (at, load))[0]:
            self._others[replica] = (at, load)
            self._add_up()

    def _add_up(self) -> None:
        """The fresh others' reservations, summed per endpoint into the pool's ``others_*``."""
        pool = self.pool
        now = self.board.clock()
        stale = [r for r, (at, _) in self._others.items() if now - at > self.board.stale_after_s]
        for replica in stale:
            del self._others[replica]
        # Summed in Python and written in one assignment per feature: a message comes every few
        # ms from each replica, and numpy's per-element indexing cost ~5x as much.
        sums: dict[int, list[float]] = {}
        for _, load in self._others.values():
            for endpoint_id, values in load.items():
                endpoint = pool.endpoints.get(endpoint_id)
                if endpoint is None:  # an endpoint this replica does not know (yet)
                    continue
                total = sums.get(endpoint.slot)
                if total is None:
                    sums[endpoint.slot] = list(values)
                else:
                    for i, value in enumerate(values):
                        total[i] += value
        slots = np.fromiter(sums, dtype=np.intp, count=len(sums))
        pool.advance_decodes(pool.clock())  # so far they counted the others' old share
        columns = np.array(list(sums.values()), dtype=np.float64).reshape(len(sums), len(SHARED))
        for i, name in enumerate(SHARED):
            others = getattr(pool, f"others_{name}")
            others.fill(0)
            others[slots] = columns[:, i]
        pool.others_held = bool(sums)
        self.replicas = 1 + len(self._others)


def _load(value: Any) -> dict[str, list[float]]:
    """An entry's reservations per endpoint id, each one number per shared feature."""
    load = {str(name): [float(v) for v in values] for name, values in value.items()}
    if any(len(values) != len(SHARED) for values in load.values()):
        raise ValueError(f"{len(SHARED)} numbers per endpoint")
    return load
