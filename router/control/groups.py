"""Groups, their epochs and the admission state machine.

::

    discovered ──(all ranks Ready)──► gating ──(every check passed, epoch still current)──► admitted
        ▲   ▲                           │                                                  │
        │   └──── backoff ◄── failed(reason) ◄──────────────────────────────────────────────┤ rank lost Ready
        │                                                                                  ▼
        └── new epoch (member set, identity or revision changed) ◄── any state      draining ──► gone

* The **epoch** is a per-group generation that goes up whenever the member set, a member's
  identity (pod UID) or its revision changes. ``apply`` revokes the old epoch **in the same call**
  (its endpoints leave the candidate set before the next pick), then gates the new one from scratch.
* A partial group is never admitted: it waits in ``discovered`` for its last rank (the *barrier*).
* A failure is retried after a capped exponential backoff; a result that arrives after its epoch
  changed is discarded.
* ``draining`` (a pod being deleted, the drain annotation, or the admin verb) takes no new requests
  while in-flight ones finish; the group's endpoints leave when idle or at the drain deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from kvindex.aio import stop_task
from router.control.gate import CheckResult, Gate, GateFailed
from router.control.shared import SharedGateResults, SharedVerdict
from router.control.topology import GroupSpec
from router.server.config import EndpointConfig
from router.state.pool import Pool

log = logging.getLogger(__name__)


class GroupState(StrEnum):
    DISCOVERED = "discovered"
    GATING = "gating"
    ADMITTED = "admitted"
    DRAINING = "draining"
    FAILED = "failed"
    GONE = "gone"


class ControlObserver(Protocol):
    """What the control plane reports (``router.observe.metrics.ControlMetrics`` implements it)."""

    def check(self, result: CheckResult) -> None: ...

    def barrier(self, seconds: float) -> None: ...

    def registered(self, seconds: float) -> None: ...

    def ready_time(self, seconds: float) -> None:
        """A group seen from before its ranks were Ready took ``seconds`` from first seen to
        admitted: how long a new replica takes to serve (the horizon scaling plans over)."""

    def failed(self, check: str) -> None: ...


@dataclass(eq=False)
class GroupRecord:
    key: str
    spec: GroupSpec
    epoch: int
    fingerprint: str
    state: GroupState
    discovered_at: float  # this epoch first seen
    reason: str | None = None  # the last failure
    checks: list[CheckResult] = field(default_factory=list)
    failures: int = 0  # consecutive, for the backoff
    retry_at: float = 0.0
    barrier_at: float | None = None  # all ranks Ready (this epoch)
    admitted_at: float | None = None  # the last admission of this epoch (None before the first)
    seen_unready: bool = False  # this epoch was first seen before every rank was Ready
    drain_deadline: float | None = None
    drained: bool = False
    admin_drain: bool = False
    regated_at: float | None = None  # wall clock of an admin re-gate: older shared verdicts are stale
    endpoint_ids: list[str] = field(default_factory=list)
    # Per endpoint, the identity of the rank serving it (pod UID and container restarts): a new one
    # is a new engine, whatever its name and address say (its KV cache is gone).
    identities: dict[str, str] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None

    @property
    def draining(self) -> bool:
        return self.admin_drain or self.spec.draining


@dataclass(frozen=True, slots=True)
class ControlSettings:
    retry_base_s: float = 1.0
    retry_max_s: float = 60.0
    drain_timeout_s: float = 600.0


class GroupController:
    """Owns group membership of the pool: endpoints are added unadmitted, admitted per epoch."""

    def __init__(
        self,
        pool: Pool,
        gate: Gate,
        settings: ControlSettings = ControlSettings(),
        observer: ControlObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedGateResults | None = None,
    ) -> None:
        """``shared``: gate results shared with other replicas (one gate run per epoch)."""
        self.pool = pool
        self.gate = gate
        self.shared = shared
        self.settings = settings
        self.observer = observer
        self.clock = clock
        self.groups: dict[str, GroupRecord] = {}
        self._leaving: dict[str, float] = {}  # endpoint id -> deadline: revoked, removed when idle
        self._changed = asyncio.Event()

    # -- discovery --------------------------------------------------------------------------------
    def apply(self, specs: list[GroupSpec]) -> None:
        """A full snapshot from discovery. Revocations take effect before this returns."""
        now = self.clock()
        seen = set()
        for spec in specs:
            seen.add(spec.key)
            record = self.groups.get(spec.key)
            fingerprint = spec.fingerprint()
            if record is None:
                record = self.groups[spec.key] = GroupRecord(
                    spec.key, spec, 1, fingerprint, GroupState.DISCOVERED, now, seen_unready=not spec.complete
                )
                self._log(record, "discovered")
            elif fingerprint != record.fingerprint:
                self._revoke(record, "new epoch")
                record.epoch += 1
                record.fingerprint = fingerprint
                record.spec = spec
                record.discovered_at = now
                record.seen_unready = not spec.complete
                record.barrier_at = record.admitted_at = None
                record.failures = 0
                record.checks = []
                record.state = GroupState.DISCOVERED
                self._log(record, "new epoch")
            else:
                record.spec = spec
            self._sync_endpoints(record)
            if record.state is GroupState.ADMITTED and not spec.complete:
                self._revoke(record, "a rank lost Ready")
                record.state = GroupState.DISCOVERED
                record.barrier_at = None
            if record.draining and record.state is not GroupState.DRAINING:
                self._start_drain(record, now)
            elif not record.draining and record.state is GroupState.DRAINING:
                record.state = GroupState.DISCOVERED  # undrained: gated again before traffic
        for key in [key for key in self.groups if key not in seen]:
            record = self.groups.pop(key)
            self._revoke(record, "left discovery")
            record.state = GroupState.GONE
            for endpoint_id in record.endpoint_ids:
                self._leave(endpoint_id, now + self.settings.drain_timeout_s)
            self._log(record, "gone")
        self.poll()

    def _sync_endpoints(self, record: GroupRecord) -> None:
        wanted: dict[str, EndpointConfig] = {}
        identities: dict[str, str] = {}
        for member in record.spec.members:
            streams = dict(zip(member.addresses, member.kv_events, strict=False))
            for address in member.addresses:
                name = member.name if len(member.addresses) == 1 else f"{member.name}@{address}"
                identities[name] = member.identity
                wanted[name] = EndpointConfig(
                    address=address,
                    role=member.role,
                    group=record.key,
                    link=member.link,
                    name=name,
                    sidecar=address in member.sidecars,
                    kv_events=streams.get(address),
                )
        pool = self.pool
        for endpoint_id in record.endpoint_ids:
            if endpoint_id not in wanted:
                self._leave(endpoint_id, self.clock() + self.settings.drain_timeout_s)
        for endpoint_id, config in wanted.items():
            current = pool.endpoints.get(endpoint_id)
            before = record.identities.get(endpoint_id)
            if current is not None and (
                current.address != config.address
                or current.role != config.role
                or current.kv_events != config.kv_events
                or (before is not None and before != identities[endpoint_id])
            ):
                # The same name on another address, or another engine behind it (a replaced or
                # restarted container), or another KV-event stream to follow: a different
                # endpoint, starting with nothing cached (and unsubscribed, then subscribed anew).
                pool.admitted[current.slot] = False
                pool.remove(endpoint_id)
                current = None
            if current is None:
                self._leaving.pop(endpoint_id, None)
                pool.add(config, admitted=False)
            else:
                pool.refresh(current, config)
        record.endpoint_ids = list(wanted)
        record.identities = identities

    def _leave(self, endpoint_id: str, deadline: float) -> None:
        endpoint = self.pool.endpoints.get(endpoint_id)
        if endpoint is not None:
            self.pool.admitted[endpoint.slot] = False
            self._leaving.setdefault(endpoint_id, deadline)

    # -- state changes ------------------------------------------------------------------------------
    def _slots(self, record: GroupRecord) -> list[int]:
        endpoints = self.pool.endpoints
        return [endpoints[i].slot for i in record.endpoint_ids if i in endpoints]

    def _revoke(self, record: GroupRecord, why: str) -> None:
        if record.task is not None:
            record.task.cancel()
            record.task = None
        slots = self._slots(record)
        if slots:
            self.pool.admitted[slots] = False
        if record.state is GroupState.ADMITTED:
            self._log(record, f"revoked: {why}")

    def _start_drain(self, record: GroupRecord, now: float) -> None:
        self._revoke(record, "draining")
        record.state = GroupState.DRAINING
        record.drained = False
        record.drain_deadline = now + self.settings.drain_timeout_s
        self._log(record, "draining")

    def drain(self, key: str) -> None:
        """The admin verb: no new requests for this group; in-flight ones finish."""
        record = self.groups[key]
        record.admin_drain = True
        if record.state is not GroupState.DRAINING:
            self._start_drain(record, self.clock())

    def undrain(self, key: str) -> None:
        record = self.groups[key]
        record.admin_drain = False
        if not record.spec.draining and record.state is GroupState.DRAINING:
            record.state = GroupState.DISCOVERED
        self.poll()

    def regate(self, key: str) -> None:
        """Run the gate again for the current epoch (the admin verb); revoked until it passes."""
        record = self.groups[key]
        record.regated_at = time.time()
        if record.state in (GroupState.ADMITTED, GroupState.FAILED, GroupState.GATING):
            self._revoke(record, "re-gate")
            record.state = GroupState.DISCOVERED
            record.failures = 0
        self.poll()

    # -- progress ---------------------------------------------------------------------------------------
    def poll(self) -> None:
        """Start gates that may start, finish drains that are done. Never awaits."""
        now = self.clock()
        for record in self.groups.values():
            if record.state is GroupState.DISCOVERED and record.spec.complete and not record.draining:
                if record.barrier_at is None:
                    record.barrier_at = now
                    if self.observer is not None:
                        self.observer.barrier(now - record.discovered_at)
                self._start_gate(record)
            elif record.state is GroupState.FAILED and now >= record.retry_at and record.spec.complete:
                self._start_gate(record)
        for endpoint_id, deadline in list(self._leaving.items()):
            endpoint = self.pool.endpoints.get(endpoint_id)
            if endpoint is None:
                del self._leaving[endpoint_id]
            elif not self.pool.busy([endpoint.slot]) or now >= deadline:
                self.pool.remove(endpoint_id)
                del self._leaving[endpoint_id]
        for record in self.groups.values():
            # Drained: nothing of ours in flight any more; the endpoints stay (unadmitted, still
            # scraped) until discovery drops the group, then leave the pool.
            if record.state is GroupState.DRAINING and not record.drained:
                slots = self._slots(record)
                if not self.pool.busy(slots) or now >= (record.drain_deadline or now):
                    record.drained = True
                    self._log(record, "drained")
        self._changed.set()

    def _start_gate(self, record: GroupRecord) -> None:
        record.state = GroupState.GATING
        record.checks = []
        record.task = asyncio.get_running_loop().create_task(
            self._gate(record, record.epoch), name=f"gate-{record.key}-{record.epoch}"
        )

    async def _gate(self, record: GroupRecord, epoch: int) -> None:
        def note(result: CheckResult) -> None:
            if record.epoch == epoch:
                record.checks.append(result)
                if self.observer is not None:
                    self.observer.check(result)

        spec = record.spec
        try:
            await self._run_gate(record, spec, note)
        except GateFailed as exc:
            if record.epoch != epoch or self.groups.get(record.key) is not record:
                return  # a newer epoch took over: this result means nothing
            record.failures += 1
            delay = min(self.settings.retry_max_s, self.settings.retry_base_s * 2 ** (record.failures - 1))
            record.retry_at = self.clock() + delay
            record.reason = str(exc)
            record.state = GroupState.FAILED
            if self.observer is not None and record.checks:
                self.observer.failed(record.checks[-1].name)
            self._log(record, f"gate failed ({exc}); retry in {delay:.1f}s", warning=True)
            return
        finally:
            if record.task is asyncio.current_task():
                record.task = None
            self._changed.set()
        # The epoch must still be current and the group still wanted when the checks end.
        if record.epoch != epoch or self.groups.get(record.key) is not record or record.draining:
            return
        if not record.spec.complete:
            record.state = GroupState.DISCOVERED
            return
        now = self.clock()
        # Only an epoch's first admission measures a start-up: a re-admission after a flap, a
        # drain or a re-gate would report the epoch's whole age, not how long a replica takes.
        first = record.admitted_at is None
        record.state = GroupState.ADMITTED
        record.failures = 0
        record.reason = None
        record.admitted_at = now
        slots = self._slots(record)
        if slots:
            self.pool.admitted[slots] = True
        if self.observer is not None and first:
            self.observer.registered(now - record.discovered_at)
            if record.seen_unready:
                self.observer.ready_time(now - record.discovered_at)
        self._log(record, f"admitted after {now - record.discovered_at:.2f}s")

    async def _run_gate(
        self, record: GroupRecord, spec: GroupSpec, note: Callable[[CheckResult], None]
    ) -> None:
        """The gate's checks, or another replica's verdict on this very epoch (``shared``)."""
        shared = self.shared
        if shared is None:
            await self.gate.run(spec, note)
            return
        key, fingerprint = record.key, record.fingerprint
        newer_than = record.regated_at or 0.0
        verdict = await shared.get(key, fingerprint)
        if verdict is not None and verdict.at < newer_than:
            verdict = None  # re-gated since: that verdict is stale
        if verdict is None and not await shared.claim(key, fingerprint):
            verdict = await shared.wait(key, fingerprint, newer_than)
        if verdict is not None:
            record.checks = [
                CheckResult(c["name"], c["ok"], c["seconds"], f"{c['detail']} (replica {verdict.by})")
                for c in verdict.checks
            ]
            if not verdict.ok:
                raise GateFailed(verdict.reason or "failed on another replica")
            return
        ran: list[CheckResult] = []

        def both(result: CheckResult) -> None:
            ran.append(result)
            note(result)

        def checks() -> list[dict[str, object]]:
            return [{"name": c.name, "ok": c.ok, "seconds": c.seconds, "detail": c.detail} for c in ran]

        try:
            await self.gate.run(spec, both)
        except GateFailed as exc:
            verdict = SharedVerdict(False, str(exc), checks(), shared.replica, time.time())
            await shared.put(key, fingerprint, verdict)
            raise
        await shared.put(key, fingerprint, SharedVerdict(True, None, checks(), shared.replica, time.time()))

    async def settle(self, timeout_s: float) -> None:
        """Wait until no group is gating (or the timeout): the first gate round at start."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while any(r.state is GroupState.GATING for r in self.groups.values()):
            self._changed.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return

    async def run(self, interval_s: float = 0.25) -> None:
        """Retries after backoff and drain completion need time to pass: poll on a timer."""
        while True:
            await asyncio.sleep(interval_s)
            self.poll()

    async def stop(self) -> None:
        tasks = [r.task for r in self.groups.values() if r.task is not None]
        await asyncio.gather(*(stop_task(task) for task in tasks))

    # -- views ------------------------------------------------------------------------------------------
    def counts(self) -> dict[tuple[str, str], int]:
        """(state, role) -> groups, for the gauges."""
        out: dict[tuple[str, str], int] = {}
        for record in self.groups.values():
            roles = {m.role for m in record.spec.members if m.addresses} or {"none"}
            for role in roles:
                out[(record.state.value, role)] = out.get((record.state.value, role), 0) + 1
        return out

    def endpoint_counts(self) -> dict[tuple[str, str], int]:
        """(role, stage) -> serving endpoints: ``discovered`` (in the pool), ``provisioned`` (its
        group has every rank Ready), ``admitted`` (its current epoch passed the gate)."""
        out: dict[tuple[str, str], int] = {}
        pool = self.pool
        for record in self.groups.values():
            for endpoint_id in record.endpoint_ids:
                endpoint = pool.endpoints.get(endpoint_id)
                if endpoint is None:
                    continue
                stages = ["discovered"]
                if record.spec.complete:
                    stages.append("provisioned")
                if pool.admitted[endpoint.slot]:
                    stages.append("admitted")
                for stage in stages:
                    out[(endpoint.role, stage)] = out.get((endpoint.role, stage), 0) + 1
        return out

    def view(self) -> dict[str, Any]:
        """The read-only debug view (``GET /debug/pool``)."""
        now = self.clock()
        groups = []
        for record in sorted(self.groups.values(), key=lambda r: r.key):
            groups.append(
                {
                    "key": record.key,
                    "state": record.state.value,
                    "epoch": record.epoch,
                    "fingerprint": record.fingerprint,
                    "expected_size": record.spec.expected_size,
                    "scale_decision": record.spec.scale_decision,
                    "members": [
                        {
                            "name": m.name,
                            "rank": m.rank,
                            "ready": m.ready,
                            "identity": m.identity,
                            "revision": m.revision,
                            "role": m.role,
                            "addresses": list(m.addresses),
                            "draining": m.draining,
                            "kv_events": [events.model_dump() for events in m.kv_events],
                        }
                        for m in sorted(record.spec.members, key=lambda m: m.rank)
                    ],
                    "checks": [
                        {"name": c.name, "ok": c.ok, "seconds": round(c.seconds, 4), "detail": c.detail}
                        for c in record.checks
                    ],
                    "admitted_for_s": None
                    if record.admitted_at is None
                    else round(now - record.admitted_at, 2),
                    "last_failure": record.reason,
                    "retry_in_s": round(max(0.0, record.retry_at - now), 2)
                    if record.state is GroupState.FAILED
                    else None,
                    "endpoints": record.endpoint_ids,
                }
            )
        return {"groups": groups, "leaving": sorted(self._leaving)}

    def _log(self, record: GroupRecord, what: str, *, warning: bool = False) -> None:
        decision = record.spec.scale_decision
        (log.warning if warning else log.info)(
            "group %s epoch %d: %s%s",
            record.key,
            record.epoch,
            what,
            f" (scale decision {decision})" if decision else "",
        )
