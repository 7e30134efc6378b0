"""The admission state machine, transition by transition, with a gate the test scripts."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from helpers import Clock, eventually

from router.control.gate import CheckResult, GateFailed
from router.control.groups import ControlSettings, GroupController, GroupState
from router.control.topology import GroupSpec, Member
from router.state.pool import Pool


class ScriptedGate:
    """Each run waits for the test to decide it: ``passes(key)`` or ``fails(key, why)``."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, str]] = []  # (key, fingerprint) per run started
        self.verdicts: dict[str, asyncio.Queue[str | None]] = {}

    def _queue(self, key: str) -> asyncio.Queue[str | None]:
        return self.verdicts.setdefault(key, asyncio.Queue())

    async def run(self, group: GroupSpec, record) -> None:  # the Gate interface
        self.runs.append((group.key, group.fingerprint()))
        verdict = await self._queue(group.key).get()
        record(CheckResult("scripted", verdict is None, 0.001, verdict or "ok"))
        if verdict is not None:
            raise GateFailed(verdict)

    def passes(self, key: str) -> None:
        self._queue(key).put_nowait(None)

    def fails(self, key: str, why: str) -> None:
        self._queue(key).put_nowait(why)


def rank(
    name: str, r: int, *, ready: bool = True, uid: str | None = None, revision: str = "a1", **kw
) -> Member:
    addresses = (f"10.0.0.{r + 1}:8000",) if r == 0 else ()
    return Member(name, uid or f"uid-{name}", r, ready, addresses, revision, **kw)


def group(*members: Member, key: str = "g", size: int = 2) -> GroupSpec:
    return GroupSpec(key, size, members)


@pytest.fixture
def setup():
    pool = Pool(stale_after_s=1e9)
    gate = ScriptedGate()
    clock = Clock()
    control = GroupController(pool, gate, ControlSettings(retry_base_s=1.0, retry_max_s=4.0), clock=clock)  # type: ignore[arg-type]
    return pool, gate, clock, control


def admitted(pool: Pool) -> set[str]:
    return {e.id for e in pool.endpoints.values() if pool.admitted[e.slot]}


async def test_a_partial_group_waits_and_is_admitted_once_its_last_rank_is_ready(setup) -> None:
    pool, gate, _, control = setup
    control.apply([group(rank("g-0", 0))])
    assert control.groups["g"].state is GroupState.DISCOVERED and gate.runs == []
    assert "g-0" in pool.endpoints and admitted(pool) == set()  # scraped, never a candidate
    control.apply([group(rank("g-0", 0), rank("g-1", 1, ready=False))])
    assert gate.runs == []  # present but not Ready: still the barrier
    control.apply([group(rank("g-0", 0), rank("g-1", 1))])
    assert control.groups["g"].state is GroupState.GATING
    await eventually(lambda: len(gate.runs) == 1, 2, "one gate run")
    gate.passes("g")
    await eventually(lambda: control.groups["g"].state is GroupState.ADMITTED, 2, "admitted")
    assert admitted(pool) == {"g-0"}


async def test_a_new_epoch_revokes_before_apply_returns_and_a_stale_result_is_discarded(setup) -> None:
    pool, gate, _, control = setup
    control.apply([group(rank("g-0", 0), rank("g-1", 1))])
    gate.passes("g")
    await eventually(lambda: control.groups["g"].state is GroupState.ADMITTED, 2, "admitted")
    control.apply([group(rank("g-0", 0), rank("g-1", 1, uid="uid-restarted"))])  # rank 1 replaced
    assert admitted(pool) == set()  # revoked in the same call: the next pick cannot use it
    record = control.groups["g"]
    assert record.epoch == 2 and record.state is GroupState.GATING
    # The epoch changes again while epoch 2 is gating: epoch 2's pass must not admit epoch 3.
    control.apply([group(rank("g-0", 0), rank("g-1", 1, uid="uid-restarted", revision="b2"))])
    assert record.epoch == 3
    await eventually(lambda: gate.runs[-1][1] == record.fingerprint, 2, "epoch 3 gating")
    gate.passes("g")
    await eventually(lambda: record.state is GroupState.ADMITTED, 2, "epoch 3 admitted")
    assert [run[1] for run in gate.runs].count(record.fingerprint) == 1


async def test_a_restarted_engine_is_a_new_endpoint_that_starts_with_nothing_cached(setup) -> None:
    """Same name and address, another engine behind it (a container restart: a new identity): the
    old endpoint leaves the pool, so what the indexes held for its slot goes, and the new one is
    gated before it gets traffic."""
    pool, gate, _, control = setup
    forgotten: list[int] = []
    pool.on_removed = forgotten.append
    control.apply([group(rank("g-0", 0), rank("g-1", 1))])
    gate.passes("g")
    await eventually(lambda: admitted(pool) == {"g-0"}, 2, "admitted")
    old = pool.endpoints["g-0"]
    control.apply([group(rank("g-0", 0), rank("g-1", 1))])  # the same epoch again: nothing changes
    assert pool.endpoints["g-0"] is old and forgotten == []
    control.apply([group(rank("g-0", 0, uid="uid-g-0#1"), rank("g-1", 1))])
    assert forgotten == [old.slot]
    new = pool.endpoints["g-0"]
    assert new is not old and new.address == old.address and admitted(pool) == set()
    await eventually(lambda: len(gate.runs) == 2, 2, "gated again")
    gate.passes("g")
    await eventually(lambda: admitted(pool) == {"g-0"}, 2, "admitted again")


async def test_an_admitted_group_that_loses_a_rank_is_revoked_at_once(setup) -> None:
    pool, gate, _, control = setup
    control.apply([group(rank("g-0", 0), rank("g-1", 1))])
    gate.passes("g")
    await eventually(lambda: admitted(pool) == {"g-0"}, 2, "admitted")
    control.apply([group(rank("g-0", 0), rank("g-1", 1, ready=False))])
    assert admitted(pool) == set() and control.groups["g"].state is GroupState.DISCOVERED
    control.apply([group(rank("g-0", 0))])  # the rank is gone altogether: a new epoch, still partial
    assert admitted(pool) == set() and control.groups["g"].epoch == 2


async def test_a_failing_gate_is_retried_with_capped_exponential_backoff(setup) -> None:
    pool, gate, clock, control = setup
    control.apply([group(rank("g-0", 0), rank("g-1", 1))])
    record = control.groups["g"]
    delays = []
    for attempt in range(4):
        gate.fails("g", f"canary: boom {attempt}")
        await eventually(lambda: record.state is GroupState.FAILED, 2, "failed")
        delays.append(record.retry_at - clock.now)
        control.poll()
        assert record.state is GroupState.FAILED  # not before the backoff has passed
        clock.now = record.retry_at
        control.poll()
        assert record.state is GroupState.GATING
    assert delays == [1.0, 2.0, 4.0, 4.0]
    assert record.reason == "canary: boom 3" and admitted(pool) == set()
    gate.passes("g")
    await eventually(lambda: record.state is GroupState.ADMITTED, 2, "admitted after flapping")
    assert record.failures == 0 and record.reason is None


async def test_a_draining_group_gets_nothing_new_and_finishes_what_it_has(setup) -> None:
    pool, gate, _, control = setup
    control.apply([group(rank("g-0", 0), rank("g-1", 1))])
    gate.passes("g")
    await eventually(lambda: admitted(pool) == {"g-0"}, 2, "admitted")
    slot = pool.endpoints["g-0"].slot
    in_flight = pool.reserve(slot, None, 100.0, 200.0)
    control.apply([group(rank("g-0", 0, draining=True), rank("g-1", 1))])  # the pod is being deleted
    record = control.groups["g"]
    assert record.state is GroupState.DRAINING and admitted(pool) == set()
    control.poll()
    assert not record.drained  # a long decode is still running there
    in_flight.release()
    control.poll()
    assert record.drained and "g-0" in pool.endpoints  # still scraped until discovery drops it
    control.apply([])  # the pod is gone
    assert "g-0" not in pool.endpoints


async def test_an_endpoint_that_leaves_with_a_request_in_flight_is_not_charged_later(setup) -> None:
    pool, gate, _, control = setup
    solo = dataclasses.replace(rank("solo-0", 0), addresses=("10.0.9.9:8000",))
    control.apply([group(solo, key="solo", size=1)])
    gate.passes("solo")
    await eventually(lambda: admitted(pool) == {"solo-0"}, 2, "admitted")
    slot = pool.endpoints["solo-0"].slot
    reservation = pool.reserve(slot, None, 100.0, 200.0)
    control.apply([])
    assert "solo-0" in pool.endpoints and admitted(pool) == set()  # revoked, waits for its request
    control.groups.clear()
    control._leaving["solo-0"] = 0.0  # the drain deadline passed: it leaves with a request in flight
    control.poll()
    assert "solo-0" not in pool.endpoints
    newcomer = dataclasses.replace(rank("new-0", 0), addresses=("10.0.9.10:8000",))
    control.apply([group(newcomer, key="new", size=1)])
    assert pool.endpoints["new-0"].slot == slot  # the slot is reused
    reservation.release()  # the old request ends now
    assert pool.inflight_requests[slot] == 0 and pool.reserved_kv_tokens[slot] == 0


async def test_admin_drain_undrain_and_regate(setup) -> None:
    pool, gate, _, control = setup
    control.apply([group(rank("g-0", 0), rank("g-1", 1))])
    gate.passes("g")
    await eventually(lambda: admitted(pool) == {"g-0"}, 2, "admitted")
    control.drain("g")
    assert admitted(pool) == set() and control.groups["g"].state is GroupState.DRAINING
    control.undrain("g")
    assert control.groups["g"].state is GroupState.GATING  # gated again before traffic
    gate.passes("g")
    await eventually(lambda: admitted(pool) == {"g-0"}, 2, "admitted again")
    control.regate("g")
    assert admitted(pool) == set()
    await eventually(lambda: len(gate.runs) == 3, 2, "a third gate run")
    gate.passes("g")
    await eventually(lambda: admitted(pool) == {"g-0"}, 2, "admitted after re-gate")
    view = control.view()["groups"][0]
    assert view["state"] == "admitted" and view["epoch"] == 1 and view["checks"][0]["ok"]


class Recorder:
    """The control observer's timing reports, as lists of seconds."""

    def __init__(self) -> None:
        self.ready_times: list[float] = []
        self.registrations: list[float] = []

    def check(self, result: CheckResult) -> None: ...

    def barrier(self, seconds: float) -> None: ...

    def registered(self, seconds: float) -> None:
        self.registrations.append(seconds)

    def ready_time(self, seconds: float) -> None:
        self.ready_times.append(seconds)

    def failed(self, check: str) -> None: ...


async def test_only_an_epochs_first_admission_is_a_start_up_time() -> None:
    """A flap, a drain or a re-gate re-admits the same epoch later: that is not how long a replica
    takes to start, and it must not stretch the horizon the autoscaler plans over."""
    pool, gate, clock = Pool(stale_after_s=1e9), ScriptedGate(), Clock()
    recorder = Recorder()
    control = GroupController(pool, gate, clock=clock, observer=recorder)  # type: ignore[arg-type]
    control.apply([group(rank("g-0", 0), rank("g-1", 1, ready=False))])  # seen before it was Ready
    clock.now += 0.7
    control.apply([group(rank("g-0", 0), rank("g-1", 1))])
    gate.passes("g")
    await eventually(lambda: admitted(pool) == {"g-0"}, 2, "admitted")
    assert recorder.ready_times == [pytest.approx(0.7)] and recorder.registrations == [pytest.approx(0.7)]
    clock.now += 15.0
    control.apply([group(rank("g-0", 0), rank("g-1", 1, ready=False))])  # a flap
    control.apply([group(rank("g-0", 0), rank("g-1", 1))])
    gate.passes("g")
    await eventually(lambda: admitted(pool) == {"g-0"}, 2, "admitted after the flap")
    clock.now += 5.0
    control.drain("g")
    control.undrain("g")
    gate.passes("g")
    await eventually(lambda: admitted(pool) == {"g-0"}, 2, "admitted after the drain")
    control.regate("g")
    gate.passes("g")
    await eventually(lambda: admitted(pool) == {"g-0"}, 2, "admitted after the re-gate")
    assert recorder.ready_times == [pytest.approx(0.7)] and recorder.registrations == [pytest.approx(0.7)]
    # A new epoch (a rank replaced) is a start-up again.
    clock.now += 1.0
    control.apply([group(rank("g-0", 0), rank("g-1", 1, uid="uid-new", ready=False))])
    clock.now += 1.3
    control.apply([group(rank("g-0", 0), rank("g-1", 1, uid="uid-new"))])
    gate.passes("g")
    await eventually(lambda: admitted(pool) == {"g-0"}, 2, "the new epoch admitted")
    assert recorder.ready_times == [pytest.approx(0.7), pytest.approx(1.3)]


async def test_a_sidecar_coming_and_going_changes_the_endpoint_in_place(setup) -> None:
    pool, _, _, control = setup
    fronted = rank("g-0", 0, sidecars=("10.0.0.1:8000",))
    control.apply([group(fronted, size=1)])
    endpoint = pool.endpoints["g-0"]
    assert pool.sidecar[endpoint.slot]
    control.apply([group(dataclasses.replace(fronted, sidecars=()), size=1)])
    # An annotation changed on the same pod: the same endpoint (its reservations, its metrics).
    assert pool.endpoints["g-0"] is endpoint and not pool.sidecar[endpoint.slot]
