"""A simulated autoscaled fleet: replicas an autoscaler asks for, published to the router as discovery.

``Fleet`` plays both the cluster and the router's discovery source (``router.control.topology.
DiscoverySource``): each replica is one simulated engine and one group of ``ranks`` ranks (rank 0
serves; the others are worker ranks with no address, Ready ``rank_stagger_s`` apart, as a
LeaderWorkerSet's workers).

* **Scale up**: a new replica's engine starts at once (it is paid for from then on) and is published
  *not Ready*; after ``ready_s`` (scheduling, image pull, weights, warm-up) it is published Ready and
  then goes through the router's real ready gate before it gets traffic.
* **Scale down**: replicas not yet Ready go first (newest first, as a ReplicaSet picks), and simply
  vanish; a Ready one, or a group rolling to a new revision that still finishes its streams, is
  published *draining* (the router takes no new requests to it, in-flight ones finish) and its
  engine is stopped only once it is idle: nothing running or waiting on the engine and, per
  ``busy``, nothing of the router's in flight to it. So a scale-down never cuts a stream.
* **Rolling upgrade** (``roll``): one group of a role at a time, in place (a LeaderWorkerSet's
  default: maxUnavailable 1, no surge): its ranks are replaced by pods of the new revision (new
  identities, not Ready), which become Ready after ``ready_s`` as a new replica's do; the next
  group follows once this one is Ready again. The engine keeps running (and finishes what it was
  given): the router stops routing to the group the moment its epoch changes.

Every replica's life (requested, Ready, draining, stopped) is kept for the replica-time accounting.
Everything listens on 127.0.0.1 (or nowhere, ``in_process``); time is the event loop's clock (wall
seconds, or virtual ones on ``simulator.virtual_clock``'s loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import cast

from router.control.topology import GroupSpec, Member, Publish, Role
from simulator.engine import EngineSpec, LinkCost, SimCluster, SimEngine

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Replica:
    name: str
    role: str
    engine: SimEngine
    created_at: float  # requested (and paid for) from here
    ready_at: float  # reports Ready from here
    ready: bool = False
    draining_at: float | None = None
    stopped_at: float | None = None
    ranks: int = 1
    revision: str = "r1"
    epoch: int = 0  # pod generation: a rolling upgrade replaces every rank's identity

    @property
    def active(self) -> bool:
        """Counted in the workload's replicas: neither draining nor stopped."""
        return self.draining_at is None and self.stopped_at is None

    @property
    def idle(self) -> bool:
        return self.engine.num_running == 0 and self.engine.num_waiting == 0

    def seconds(self, since: float, until: float) -> float:
        """How long this replica existed within [since, until]."""
        end = until if self.stopped_at is None else min(self.stopped_at, until)
        return max(0.0, end - max(self.created_at, since))


def never_busy(name: str) -> bool:
    return False


class Fleet:
    """Replicas per role from ``templates`` (role -> engine spec; name and port are replaced)."""

    name = "fleet"

    def __init__(
        self,
        templates: Mapping[str, EngineSpec],
        *,
        ready_s: float,
        link_cost: LinkCost | None = None,
        revision: str = "r1",
        poll_s: float = 0.01,
        ranks: int = 1,
        rank_stagger_s: float = 0.0,
        in_process: bool = False,
    ) -> None:
        """``in_process``: the engines listen nowhere and are called in-process
        (``simulator.local_net``), for a run on the virtual clock."""
        self.templates = dict(templates)
        self.ready_s = ready_s
        self.revision = revision
        self.poll_s = poll_s
        self.ranks = ranks
        self.rank_stagger_s = rank_stagger_s
        self.synced = False
        # Whether the router still has requests in flight to this endpoint (set once the router exists).
        self.busy: Callable[[str], bool] = never_busy
        self.cluster = SimCluster([], link_cost, in_process=in_process)
        self.replicas: dict[str, Replica] = {}  # every replica ever, stopped ones included
        self._counters: dict[str, int] = {}
        self._changed = asyncio.Event()

    # -- the autoscaler's side ----------------------------------------------------------------------

    def active(self, role: str) -> list[Replica]:
        return [r for r in self.replicas.values() if r.role == role and r.active]

    def count(self, role: str) -> int:
        """The workload's replica count (what an HPA reads as current and sets)."""
        return len(self.active(role))

    async def scale(self, role: str, n: int) -> None:
        """Set ``role`` to ``n`` replicas: start new ones (Ready after ``ready_s``) or remove some."""
        if role not in self.templates:
            raise ValueError(f"no template for role {role!r}; have {sorted(self.templates)}")
        active = self.active(role)
        for _ in range(n - len(active)):
            await self._add(role, ready=False)
        # Not Ready first, then the most recent: newest first within each.
        victims = sorted(active, key=lambda r: (r.ready, -r.created_at))[: max(0, len(active) - n)]
        now = self._now()
        for replica in victims:
            replica.draining_at = now
            # Not Ready and idle (a replica still starting): nothing to finish, it goes at once. A
            # group rolling to a new revision is not Ready either, yet its old pods still finish
            # the streams they had: it drains like a Ready one (``step`` stops it once idle).
            if not replica.ready and replica.idle and not self.busy(replica.name):
                await self._stop(replica)
        self._changed.set()

    async def roll(self, role: str, revision: str) -> None:
        """Upgrade every group of ``role`` to ``revision``, one at a time (see the module docstring);
        returns when the last one is Ready again."""
        for replica in [r for r in self.active(role) if r.revision != revision]:
            if not replica.active:  # scaled down meanwhile
                continue
            replica.revision, replica.epoch = revision, replica.epoch + 1
            replica.ready, replica.ready_at = False, self._now() + self.ready_s
            log.info("fleet: %s rolling to %s", replica.name, revision)
            self._changed.set()
            while replica.active and not (replica.ready and self._all_ranks_ready(replica)):
                await asyncio.sleep(self.poll_s)

    def _all_ranks_ready(self, replica: Replica) -> bool:
        return self._now() >= replica.ready_at + (replica.ranks - 1) * self.rank_stagger_s

    async def start(self, initial: Mapping[str, int]) -> None:
        """The replicas running before the replay: Ready at once."""
        for role, n in initial.items():
            for _ in range(n):
                await self._add(role, ready=True)

    async def stop(self) -> None:
        now = self._now()
        for replica in self.replicas.values():
            if replica.stopped_at is None:
                replica.stopped_at = now
        await self.cluster.stop()

    async def __aenter__(self) -> Fleet:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def replica_seconds(self, role: str, since: float, until: float) -> float:
        return sum(r.seconds(since, until) for r in self.replicas.values() if r.role == role)

    # -- the discovery side -------------------------------------------------------------------------

    def snapshot(self) -> list[GroupSpec]:
        """Every replica not yet stopped, as a group of its ranks."""
        groups = []
        now = self._now()
        for r in self.replicas.values():
            if r.stopped_at is not None:
                continue
            members = tuple(
                Member(
                    name=r.name if rank == 0 else f"{r.name}-rank{rank}",
                    identity=f"{r.name}-rank{rank}-gen{r.epoch}",
                    rank=rank,
                    ready=r.ready and now >= r.ready_at + rank * self.rank_stagger_s,
                    addresses=(self.cluster.address(r.name),) if rank == 0 else (),
                    revision=r.revision,
                    role=cast(Role, r.role),  # a template's role, checked by EngineSpec
                    link=r.engine.spec.link,
                    draining=r.draining_at is not None,
                )
                for rank in range(r.ranks)
            )
            groups.append(GroupSpec(r.name, r.ranks, members))
        return groups

    async def run(self, publish: Publish) -> None:
        """Publish a snapshot now and on every change; replicas become Ready, drained ones stop."""
        published = self.snapshot()
        publish(published)
        self.synced = True
        while True:
            self._changed.clear()
            await self.step()
            snapshot = self.snapshot()
            if snapshot != published:
                publish(snapshot)
                published = snapshot
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.poll_s)

    async def step(self) -> None:
        """Ready the replicas whose time came; stop the draining ones that are idle."""
        now = self._now()
        for replica in list(self.replicas.values()):
            if replica.stopped_at is not None:
                continue
            if replica.draining_at is None and not replica.ready and now >= replica.ready_at:
                replica.ready = True
                log.info("fleet: %s Ready after %.2fs", replica.name, now - replica.created_at)
            elif replica.draining_at is not None and replica.idle and not self.busy(replica.name):
                await self._stop(replica)

    # -- internals ------------------------------------------------------------------------------------

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    async def _add(self, role: str, *, ready: bool) -> Replica:
        seq = self._counters[role] = self._counters.get(role, 0) + 1
        name = f"{role}-{seq}"
        spec = dataclasses.replace(self.templates[role], name=name, port=0)
        engine = await self.cluster.add(spec)
        now = self._now()
        replica = Replica(
            name,
            role,
            engine,
            now,
            # The replicas running before the replay have every rank Ready already.
            now - (self.ranks - 1) * self.rank_stagger_s if ready else now + self.ready_s,
            ready=ready,
            ranks=self.ranks,
            revision=self.revision,
        )
        self.replicas[name] = replica
        log.info("fleet: %s requested (%s)", name, "Ready" if ready else f"Ready in {self.ready_s:.2f}s")
        return replica

    async def _stop(self, replica: Replica) -> None:
        replica.stopped_at = self._now()
        await self.cluster.remove(replica.name)
        log.info("fleet: %s stopped", replica.name)
