"""Autoscaling replay: the simulated P/D cluster with a simulated autoscaler in the loop.

For every scenario, every policy gets exactly the same requests at exactly the same (compressed)
arrival times against a fresh fleet and a fresh router, one run after another in this process. The
fleet (``simulator.fleet``) is the router's discovery source: a replica a policy asks for is paid
for at once, reports Ready only after ``--ready-s`` and then passes the router's real ready gate
before it gets traffic; a replica being removed is drained (no new requests, in-flight ones finish)
and stopped once idle. Prefill and decode scale independently, each between 1 and ``--max-replicas``.

Time is simulated: every duration below is in simulated seconds and the simulator runs ``--speed``
times faster than that (engine steps, arrivals, the ready time, the router's scrape and tick, the
autoscaler's period and window are all divided by it). The simulated engines are slow and small on
purpose (a simulated token stands for a chunk of real ones) so that a replay of minutes costs
seconds of CPU.

By default the replay runs in virtual time (``simulator.virtual_clock``): the fleet's engines, the
router (``App``: discovery, the ready gate, scrapes, the signals tick, the proxy's own handler) and
the client share one process and talk in-process (``simulator.local_net``; each proxy → engine leg
takes ``--hop-ms`` of wall time, 1 ms as on loopback, the router's own CPU time is not simulated),
and the clock jumps from event to event. The same seed gives the same numbers on any machine, and
all ten scenarios cost about a CPU minute. ``--wall-clock`` runs the same replay end to end instead:
real HTTP on 127.0.0.1 in wall-clock time (~15 minutes for all; the numbers move from run to run with
the machine's timing).

Scenarios (each ~4.5 simulated minutes; ``--quick`` shrinks every duration 5×):
  ramp        linear ramp 0.1 → 1.0 req/s over 4 min: both roles grow
  isl-burst   2 min of 6k-token prompts (from 2k), same rate and answers: prefill should scale, not decode
  osl-burst   2 min of 200-token answers (from 48), same rate and prompts: decode should scale, not prefill
  cache-drop  6k-token prompts whose 5.4k shared prefix stops repeating for 2 min: prefill demand ×10
  periodic    0.2 ↔ 0.8 req/s, period 80 s, shorter than the scale-down window: no flapping
  mix-shift   90 s of 6k-token prompts, a pause, then short prompts with long answers: one prompt mix
              per forecast, no jump to the maximum
  short-burst a 40-s burst, shorter than the ready time: a replica or two at most
  pd-drift    prompts growing while answers shrink at a constant rate: the two roles move apart
  rolling-upgrade  2-rank decode groups upgraded in place one at a time under steady load: the
              count holds while each group is away, nothing is cut
  drain       90 s of long answers (100-500 tokens) on replicas sized for them, then a trickle: replicas
              are removed while long decodes still run on them; nothing may be cut (failed requests)

Every prompt is prefilled on a prefill replica (``--local-prefill`` lets decode replicas compute
prompts themselves, the picker's "no prefill leg" choice).

Policies (same fleet, same stabilisation: scale up at once, down to the max desired of the last
``--window-s``, as an HPA's ``scaleDown.stabilizationWindowSeconds``; 10% tolerance):
  pd-router   the router's own recommended replicas per role (``App.scaling``: forecast over the
              ready time, hysteresis, refused scale-downs), applied as is (its window is the same)
  queue       waiting requests per replica (llm-d's HPA guide, per role): ceil(current × avg / target)
  kv          KV-cache utilisation per role (mean over replicas)
  running     running requests per replica (a common hand-written ScaledObject)

Reported per scenario × policy: SLO violation time (10-s buckets, by arrival, where more than 10% of
the requests missed TTFT or TPOT SLO or failed), violation area (Σ share missed × bucket), replica-
minutes (simulated, until the scenario's end), scale actions, failed requests; a PNG of replicas
and load over time (``--png``, needs matplotlib: ``pip install -e '.[bench]'``); and a CSV of the
router's recommendation per autoscaler tick and role (``--trace``: demand, forecast, capacity,
load, desired, recommended, refusal; in wall-clock units, as the compressed router sees them).

    python -m loadtests.bench.scaling                      # every scenario and policy (~1 CPU min)
    python -m loadtests.bench.scaling --seeds 0,1,2        # and the verdicts on the means over seeds
    python -m loadtests.bench.scaling --seeds 0,1,2 --jobs 4   # in 4 processes: the same numbers
    python -m loadtests.bench.scaling --wall-clock         # over HTTP in wall-clock time (~15 min)
    python -m loadtests.bench.scaling --quick --scenarios isl-burst --policies queue
    python -m loadtests.bench.scaling --png scaling.png --table scaling.md
    python -m loadtests.bench.scaling --scenarios ramp --trace ramp.csv  # the router's reasoning per tick
    python -m loadtests.bench.scaling --policies pd-router --signals min_rate_requests=16  # a what-if

With ``--wall-clock`` everything listens on 127.0.0.1; every run is bounded by its scenario's length
and ``--run-timeout`` (wall seconds, or virtual ones).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import csv
import dataclasses
import functools
import itertools
import logging
import math
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar
from unittest import mock

from loadtests.bench.quality import RouterUnderTest, _drive, local_exchange
from loadtests.bench.routing import KV_BYTES_PER_TOKEN, scaled_links
from loadtests.bench.scenarios import HOP_S
from router.adapters.openai import Proxy
from router.server import app as app_module
from router.server.app import App
from router.server.compose import build
from router.server.config import LinksConfig, PickerConfig, PoolConfig, parse_config
from simulator.cluster import engine_model_for, link_cost_from
from simulator.engine import EngineSpec, TimeModel
from simulator.fleet import Fleet
from simulator.local_net import LocalSession
from simulator.virtual_clock import run_virtual
from simulator.workloads.client import Result, Summary, run_workload
from simulator.workloads.generate import Phase, WorkItem, Workload, phased

ROLES = ("prefill", "decode")

# -- the simulated world (simulated seconds) -------------------------------------------------------

# A slow, small engine: 5k prompt tokens/s; a decode step of 0.1 s + 30 ms per sequence + 1 ms per 1k
# KV tokens held, so a decode replica meets the TPOT SLO up to ~9 sequences of 2k context.
WORLD = TimeModel(
    step_base_s=0.1,
    prefill_s_per_token=0.0002,
    decode_s_per_seq=0.03,
    kv_s_per_token=0.000001,
    max_prefill_tokens_per_step=2048,
    max_running=16,  # decode: max_num_seqs; beyond it requests queue
)
PREFILL_MAX_RUNNING = 2  # a prefill replica works on ~one 2k-token chunk per step: the rest queue
KV_BLOCKS = 8192  # × 16 tokens: 128k KV tokens per replica
TTFT_SLO_S = 3.0
TPOT_SLO_S = 0.4
LINKS = {"same": {"latency_ms": 0.05, "bandwidth_gbytes_per_s": 25.0}}
LINK = "rack-a"
TYPICAL_PROMPT = 2000
RANK_STAGGER_S = 5.0  # a multi-rank group's workers come up this far apart (simulated s)
WAIT_SKEW_S = PickerConfig.model_fields["max_wait_skew_ms"].default / 1000.0  # the picker's default
RATE_WINDOW_S = PickerConfig.model_fields["prefill_rate_window_ms"].default / 1000.0  # its default too
# How often the fleet looks for replicas whose ready time came and drained ones gone idle (simulated s;
# 10 ms of wall time at the default speed, as before the virtual mode)
FLEET_POLL_S = 0.2


@dataclass(frozen=True)
class Settings:
    """Everything in simulated seconds, except ``speed`` (simulated seconds per wall second)."""

    speed: float = 20.0
    ready_s: float = 60.0
    window_s: float = 90.0  # scale-down stabilisation, the same for every policy
    tick_s: float = 5.0  # the autoscaler's period (an HPA's sync, KEDA's pollingInterval)
    scrape_s: float = 2.0  # the router's engine scrape interval
    bucket_s: float = 10.0  # SLO accounting
    stretch: float = 1.0  # scenario durations × this (--quick: 0.2)
    max_replicas: int = 8
    min_replicas: int = 1
    # wall (or virtual) s: the tail after the scenario's end; over HTTP, each request's too
    run_timeout_s: float = 120.0
    # Let the picker skip the prefill leg (a decode replica computes the prompt itself). Off: every
    # prompt is prefilled on a prefill replica, so each role's load is its own; that choice also
    # weighs wall-clock overheads (the extra leg's HTTP exchange) that time compression inflates.
    local_prefill: bool = False
    # Virtual time (``simulator.virtual_clock``): the fleet, the router and the client in one process,
    # no socket, the clock moved from event to event, so a run is deterministic and costs only its
    # CPU. False: real HTTP on 127.0.0.1 in wall-clock time (``--wall-clock``), end to end.
    virtual: bool = True
    # Virtual: each proxy → engine leg takes this (wall s, as the loopback hop of the wall-clock mode
    # is: ×speed in simulated time)
    hop_s: float = HOP_S
    # ``signals`` settings overridden (``--signals KEY=VALUE``, durations in simulated s): what-ifs
    signals: tuple[tuple[str, str], ...] = ()

    def wall(self, sim_s: float) -> float:
        return sim_s / self.speed

    def shrunk(self, factor: float) -> Settings:
        """Scenarios ``factor`` as long, and the clocks that must keep pace with them (``--quick``)."""
        return dataclasses.replace(
            self,
            stretch=self.stretch * factor,
            ready_s=self.ready_s * factor,
            window_s=self.window_s * factor,
            tick_s=self.tick_s * factor,
            bucket_s=self.bucket_s * factor,
        )


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    phases: tuple[Phase, ...]
    expect: str
    initial: tuple[tuple[str, int], ...] = (("prefill", 1), ("decode", 1))
    ranks: int = 1  # ranks per group (a LeaderWorkerSet's size)
    rolls: tuple[tuple[float, str], ...] = ()  # (simulated s, role): a rolling upgrade starts

    def stretched(self, factor: float) -> tuple[Phase, ...]:
        return tuple(dataclasses.replace(p, duration_s=p.duration_s * factor) for p in self.phases)


def _phase(duration_s: float, rate: float, **kw: Any) -> Phase:
    shape: dict[str, Any] = {"prompt_tokens": TYPICAL_PROMPT, "max_tokens": 64}
    return Phase(duration_s, rate, **{**shape, **kw})


def _periodic(low: float, high: float, period_s: float, periods: int) -> tuple[Phase, ...]:
    half = period_s / 2
    return tuple(_phase(half, a, rate_end=b) for _ in range(periods) for a, b in ((low, high), (high, low)))


# Capacities at the SLO (measured with fixed replicas): a decode replica ~20 answer tokens/s (0.3 req/s
# of 64-token answers), a prefill replica ~2,000 prompt tokens/s of 2k-token prompts. Each scenario
# starts with the replicas its first phase needs.
SCENARIOS: dict[str, Scenario] = {
    s.key: s
    for s in (
        Scenario(
            "ramp",
            "linear ramp 0.1 → 1.0 req/s over 4 min (2k-token prompts, 64-token answers)",
            (_phase(240, 0.1, rate_end=1.0), _phase(30, 1.0)),
            "both roles grow with the load (decode 1 → 4, prefill 1 → 2), ahead of it by the ready time",
        ),
        Scenario(
            "isl-burst",
            "burst of long inputs: 0.5 req/s, prompts 2k → 6k tokens for 2 min → 2k",
            (_phase(60, 0.5), _phase(120, 0.5, prompt_tokens=6000), _phase(90, 0.5)),
            "prefill scales up (1 → 2-3), decode does not",
            initial=(("prefill", 1), ("decode", 2)),
        ),
        Scenario(
            "osl-burst",
            "burst of long outputs: 0.4 req/s, answers 48 → 200 tokens for 2 min → 48",
            (
                _phase(60, 0.4, max_tokens=48),
                _phase(120, 0.4, max_tokens=200),
                _phase(90, 0.4, max_tokens=48),
            ),
            "decode scales up (2 → 4-5), prefill does not",
            initial=(("prefill", 1), ("decode", 2)),
        ),
        Scenario(
            "cache-drop",
            "cache-hit drop: 0.5 req/s of 6k-token prompts, 5.4k shared (4 prefixes) → unique for 2 min",
            (
                _phase(90, 0.5, prompt_tokens=6000, shared_tokens=5400, max_tokens=48),
                _phase(120, 0.5, prompt_tokens=6000, max_tokens=48),
                _phase(60, 0.5, prompt_tokens=6000, shared_tokens=5400, max_tokens=48),
            ),
            "prefill scales up (1 → 2-3) when prefixes stop repeating (uncached prompt tokens ×10)",
            initial=(("prefill", 1), ("decode", 2)),
        ),
        Scenario(
            "periodic",
            "periodic load: 0.2 ↔ 0.8 req/s, period 80 s (shorter than the scale-down window)",
            (*_periodic(0.2, 0.8, 80, 3), _phase(30, 0.2)),
            "replicas settle at the peak's need: few scale actions, no flapping",
            initial=(("prefill", 1), ("decode", 2)),
        ),
        Scenario(
            "mix-shift",
            "prompt mix change: 0.5 req/s of 6k-token prompts for 90 s, a 20 s pause, then 1 req/s of "
            "200-token prompts asking for 300-token answers",
            (
                _phase(90, 0.5, prompt_tokens=6000, max_tokens=32),
                _phase(20, 0.0),
                _phase(120, 1.0, prompt_tokens=200, max_tokens=300),
            ),
            "prefill grows for the long prompts and never jumps when short ones follow; decode grows "
            "for the long answers",
            initial=(("prefill", 2), ("decode", 1)),
        ),
        Scenario(
            "short-burst",
            "a burst shorter than the ready time: 0.2 req/s, then 1.0 req/s for 40 s, then 0.2",
            (_phase(60, 0.2), _phase(40, 1.0), _phase(120, 0.2)),
            "at most a replica or two asked for: the burst is over before any would be ready",
        ),
        Scenario(
            "pd-drift",
            "P/D ratio drift: 0.3 req/s while prompts grow 1k → 3k → 6k tokens and answers shrink "
            "240 → 120 → 32, 80 s each",
            (
                _phase(80, 0.3, prompt_tokens=1000, max_tokens=240),
                _phase(80, 0.3, prompt_tokens=3000, max_tokens=120),
                _phase(80, 0.3, prompt_tokens=6000, max_tokens=32),
                _phase(30, 0.3, prompt_tokens=6000, max_tokens=32),
            ),
            "the roles move apart at a constant request rate: decode shrinks (4 → 1), prefill grows (1 → 2)",
            initial=(("prefill", 1), ("decode", 4)),
        ),
        Scenario(
            "rolling-upgrade",
            "rolling upgrade of 2-rank decode groups under steady load: 0.3 req/s of 100-300-token "
            "answers; at 60 s every decode group is replaced in place, one at a time",
            (_phase(270, 0.3, max_tokens=100, max_tokens_high=300),),
            "each group is away for its ready time (one fewer admitted) and back under the new "
            "revision: the replica count holds (a planned absence is not demand), none cut",
            initial=(("prefill", 1), ("decode", 4)),
            ranks=2,
            rolls=((60.0, "decode"),),
        ),
        Scenario(
            "drain",
            "scale-down during long decodes: 0.3 req/s of 100-500-token answers for 90 s, then 0.1 req/s",
            (_phase(90, 0.3, max_tokens=100, max_tokens_high=500), _phase(210, 0.1, max_tokens=32)),
            "decode (sized for the burst) scales down while long decodes still run on the replicas it "
            "removes: none cut",
            initial=(("prefill", 1), ("decode", 5)),
        ),
    )
}


# -- policies --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RoleReading:
    """The router's per-role pool signals (router/signals/saturation.py) at one tick."""

    fresh: float  # admitted endpoints with fresh metrics
    waiting: float  # requests queued at the engines, summed
    running: float  # requests running at the engines, summed
    kv_mean: float  # KV-cache usage, mean over fresh endpoints


SIGNALS = {
    "pd_router_pool_fresh_endpoints": "fresh",
    "pd_router_pool_waiting_requests": "waiting",
    "pd_router_pool_running_requests": "running",
    "pd_router_pool_kv_usage": "kv_mean",
}


def read_roles(app: App) -> dict[str, RoleReading]:
    """What Prometheus would scrape from the router now, per role (the ``stat="mean"`` KV series)."""
    values: dict[str, dict[str, float]] = {role: {} for role in ROLES}
    for family in app.parts.metrics.registry.collect():
        for sample in family.samples:
            attr = SIGNALS.get(sample.name)
            role = sample.labels.get("role")
            if attr is None or role not in values or sample.labels.get("stat", "mean") != "mean":
                continue
            values[role][attr] = sample.value
    missing = sorted(name for name, attr in SIGNALS.items() if any(attr not in v for v in values.values()))
    if missing:  # a renamed series would otherwise read as an idle pool
        raise RuntimeError(f"the router exports no per-role {missing}")
    return {role: RoleReading(**v) for role, v in values.items()}


class Policy(Protocol):
    name: str
    stabilized: bool  # goes through the HPA's scale-down window (pd-router has its own)

    def desired(self, app: App, reading: RoleReading, role: str, current: int) -> int | None:
        """Replicas ``role`` should have; None: no opinion this tick (keep ``current``)."""
        ...


TOLERANCE = 0.1  # the HPA's default: no change while the ratio is within 10% of 1


@dataclass(frozen=True)
class Threshold:
    """An HPA on one per-replica metric: desired = ceil(ready × average / target), per role."""

    name: str
    signal: str  # a RoleReading field
    per_replica: bool  # the signal is a sum over the role's replicas (divide by them)
    targets: dict[str, float]
    stabilized: bool = True

    def average(self, reading: RoleReading) -> float:
        value = getattr(reading, self.signal)
        return value / reading.fresh if self.per_replica else value

    def desired(self, app: App | None, reading: RoleReading, role: str, current: int) -> int | None:
        if reading.fresh < 1:
            return None  # no fresh metrics: an HPA keeps the replica count
        ratio = self.average(reading) / self.targets[role]
        if abs(ratio - 1.0) <= TOLERANCE:
            return current
        return math.ceil(reading.fresh * ratio - 1e-9)


def recommended(app: App, role: str) -> int | None:
    """pd-router's recommended replicas for ``role`` (``PoolSignals.latest``; router/signals/scaling.py)."""
    recommendation = app.parts.scaling.latest.get(role)
    return None if recommendation is None else int(recommendation.recommended)


class PdRouter:
    name = "pd-router"
    stabilized = False

    def desired(self, app: App, reading: RoleReading, role: str, current: int) -> int | None:
        return recommended(app, role)


# Targets per role, tuned to this fleet as an operator would from a steady run: a decode replica
# meets the TPOT SLO up to ~9 running (6 leaves headroom); a prefill replica runs at most 2 prompts
# (its chunk budget) and meets the TTFT SLO at ~1 on average with ~2 more queued; KV use at the decode
# knee is only ~15% with 2k contexts (0.3 is already generous: the common 0.8 would never scale).
THRESHOLDS: dict[str, Threshold] = {
    t.name: t
    for t in (
        Threshold("queue", "waiting", True, {"prefill": 2.0, "decode": 2.0}),
        Threshold("kv", "kv_mean", False, {"prefill": 0.3, "decode": 0.3}),
        Threshold("running", "running", True, {"prefill": 1.0, "decode": 6.0}),
    )
}
POLICIES: dict[str, Policy] = {"pd-router": PdRouter(), **THRESHOLDS}


def scaling_supported() -> bool:
    """Whether this router has the recommender (the ``signals`` section and ``App.scaling``)."""
    return "signals" in PoolConfig.model_fields


class Stabilizer:
    """An HPA's behaviour for one role: up at once, down to the max desired of the last window.

    Every policy starts as an autoscaler that has kept the ``initial`` count until ``now``: no scale
    below it within the first window. ``record=False`` (pd-router: its recommendation already went
    through its own window) keeps only that start, so the window is not applied twice.
    """

    def __init__(self, window_s: float, now: float, initial: int, *, record: bool = True) -> None:
        self.window_s = window_s
        self.record = record
        self.history: deque[tuple[float, int]] = deque([(now, initial)])

    def __call__(self, now: float, desired: int, current: int) -> int:
        if self.record:
            self.history.append((now, desired))
        while self.history and self.history[0][0] < now - self.window_s:
            self.history.popleft()
        if desired >= current or not self.history:
            return desired
        return min(current, max(desired, *(n for _, n in self.history)))


# -- one replay ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    t: float  # simulated seconds since the start
    replicas: dict[str, int]  # the workload's count per role (what the autoscaler set)
    admitted: dict[str, int]  # endpoints the router routes to, per role


@dataclass
class Outcome:
    scenario: str
    policy: str
    duration_s: float  # simulated
    results: list[Result]
    samples: list[Sample]
    replica_s: dict[str, float]  # simulated replica-seconds per role, within the scenario
    actions: dict[str, list[int]] = field(default_factory=dict)  # role -> [up, down]
    violation_s: float = 0.0
    violation_area_s: float = 0.0
    shares: list[float] = field(default_factory=list)  # per bucket: share of requests that missed
    # per autoscaler tick and role: the router's recommendation (whichever policy applies it)
    trace: list[dict[str, Any]] = field(default_factory=list)
    seed: int = 0

    @property
    def failed(self) -> int:
        return sum(1 for r in self.results if not r.ok)

    @property
    def replica_min(self) -> float:
        return sum(self.replica_s.values()) / 60.0

    @property
    def within(self) -> list[Sample]:
        """The samples up to the scenario's end (the autoscaler goes on while late answers finish)."""
        return [s for s in self.samples if s.t <= self.duration_s]

    def pct(self, attr: str, q: float, speed: float) -> float:
        return Summary(self.policy, self.results).pct(attr, q) * speed


def compressed(workload: Workload, speed: float) -> Workload:
    """The workload in wall time: every arrival ``speed`` times sooner."""
    items = [WorkItem(i.at_s / speed, i.path, i.body, i.session, i.turn) for i in workload.items]
    return Workload(workload.name, items)


def missed(result: Result, speed: float) -> bool:
    """Failed, or over the TTFT or TPOT SLO (simulated seconds)."""
    if not result.ok:
        return True
    return result.ttft_s * speed > TTFT_SLO_S or result.tpot_s * speed > TPOT_SLO_S  # NaN TPOT: not over


def account(outcome: Outcome, settings: Settings) -> None:
    """SLO violation time and area from the results, bucketed by arrival."""
    n = max(1, math.ceil(outcome.duration_s / settings.bucket_s))
    sent = [0] * n
    bad = [0] * n
    for r in outcome.results:
        i = min(n - 1, int(r.at_s * settings.speed // settings.bucket_s))
        sent[i] += 1
        bad[i] += missed(r, settings.speed)
    outcome.shares = [b / s if s else 0.0 for b, s in zip(bad, sent, strict=True)]
    outcome.violation_s = settings.bucket_s * sum(1 for share in outcome.shares if share > 0.1)
    outcome.violation_area_s = settings.bucket_s * sum(outcome.shares)


def make_config(fleet: Fleet, tm: TimeModel, settings: Settings) -> PoolConfig:
    endpoints = [
        {"address": fleet.cluster.address(r.name), "role": r.role, "name": r.name, "link": LINK}
        for r in fleet.replicas.values()
    ]
    wall_ms = 1000.0 / settings.speed
    data: dict[str, Any] = {
        "model": "sim-model",
        "endpoints": endpoints,  # informational: the fleet is the discovery source
        "engine": {**engine_model_for(tm, KV_BYTES_PER_TOKEN), "typical_prompt_tokens": TYPICAL_PROMPT},
        "links": scaled_links(LINKS, settings.speed),
        "slo": {"ttft_ms": TTFT_SLO_S * wall_ms, "tpot_ms": TPOT_SLO_S * wall_ms},
        "scrape": {
            "interval_ms": max(20.0, settings.scrape_s * wall_ms),
            "stale_after_ms": max(200.0, 4 * settings.scrape_s * wall_ms),
            "timeout_ms": 1000.0,
        },
        # virtual: no listener, the replay calls the proxy's handler in-process (``serving``)
        "proxy": {"enabled": not settings.virtual, "port": 0, "debug_headers": True},
        # Locality credit only within this of the least queue wait: its default in simulated seconds,
        # as every queue wait here is compressed (unscaled, 1 s of wall time is 20 s of simulated wait
        # skew at 20x, which piled cache-drop's repeated prompts onto the replicas holding them)
        "picker": {
            "allow_local_prefill": settings.local_prefill,
            "max_wait_skew_ms": WAIT_SKEW_S * wall_ms,
            "prefill_rate_window_ms": RATE_WINDOW_S * wall_ms,
        },
        "gate": {"initial_wait_s": 5.0, "retry_base_s": 0.05, "retry_max_s": 0.5},
    }
    if scaling_supported():  # every policy's router does the same work, only pd-router reads it
        data["signals"] = signals_section(settings)
    return parse_config(data)


def signals_section(settings: Settings) -> dict[str, Any]:
    """The recommender's settings in compressed time: the ready time and window of this replay, and
    every other duration (``*_s``) at its default in simulated seconds."""
    fields = PoolConfig.model_fields["signals"].annotation.model_fields  # type: ignore[union-attr]
    section: dict[str, Any] = {
        name: settings.wall(f.default) for name, f in fields.items() if name.endswith("_s")
    }
    section.update(
        tick_ms=max(50.0, 1000.0 / settings.speed),
        ready_time_s=settings.wall(settings.ready_s),
        scale_down_window_s=settings.wall(settings.window_s),
        min_replicas={role: settings.min_replicas for role in ROLES},
        max_replicas={role: settings.max_replicas for role in ROLES},
    )
    # Overrides: a duration is given in simulated seconds, like the scenario's
    section.update({k: settings.wall(float(v)) if k.endswith("_s") else v for k, v in settings.signals})
    return section


def templates(tm: TimeModel) -> dict[str, EngineSpec]:
    prefill_tm = dataclasses.replace(tm, max_running=PREFILL_MAX_RUNNING)
    spec = {"link": LINK, "num_gpu_blocks": KV_BLOCKS, "kv_bytes_per_token": KV_BYTES_PER_TOKEN}
    return {
        "prefill": EngineSpec("prefill", "prefill", time=prefill_tm, **spec),
        "decode": EngineSpec("decode", "decode", time=tm, **spec),
    }


def router_busy(app: App, name: str) -> bool:
    """Whether the router still has a request of its own in flight to endpoint ``name``."""
    endpoint = app.parts.pool.endpoints.get(name)
    return endpoint is not None and app.parts.pool.busy([endpoint.slot])


def admitted(app: App) -> dict[str, int]:
    counts = app.control.endpoint_counts() if app.control is not None else {}
    return {role: counts.get((role, "admitted"), 0) for role in ROLES}


async def autoscale(
    app: App, fleet: Fleet, policy: Policy, settings: Settings, outcome: Outcome, t0: float
) -> None:
    """The autoscaler's loop: every tick, per role, the policy's desired count (clamped) is applied."""
    loop = asyncio.get_running_loop()
    window = settings.wall(settings.window_s)
    start = loop.time()
    stabilizers = {
        role: Stabilizer(window, start, fleet.count(role), record=policy.stabilized) for role in ROLES
    }
    outcome.actions = {role: [0, 0] for role in ROLES}
    while True:
        now = loop.time()
        readings = read_roles(app)
        for role in ROLES:
            current = fleet.count(role)
            want = policy.desired(app, readings[role], role, current)
            want = current if want is None else want
            want = stabilizers[role](now, want, current)
            want = min(settings.max_replicas, max(settings.min_replicas, want))
            if want != current:
                outcome.actions[role][0 if want > current else 1] += 1
                await fleet.scale(role, want)
        replicas = {role: fleet.count(role) for role in ROLES}
        latest = app.parts.scaling.latest
        for role, rec in latest.items():
            outcome.trace.append(
                {"t": round((now - t0) * settings.speed, 1), "replicas": replicas[role], **rec_fields(rec)}
            )
        outcome.samples.append(Sample((now - t0) * settings.speed, replicas, admitted(app)))
        await asyncio.sleep(settings.wall(settings.tick_s))


def rec_fields(rec: Any) -> dict[str, Any]:
    """A recommendation's fields (a dataclass), rounded for a CSV."""
    out = {}
    for f in dataclasses.fields(rec):
        value = getattr(rec, f.name)
        out[f.name] = round(value, 3) if isinstance(value, float) else value
    return out


# Sends a workload (arrivals in wall seconds) to the router under test, every request at its time.
Drive = Callable[[Workload, str], Awaitable[Summary]]


@contextlib.asynccontextmanager
async def serving(
    initial: Mapping[str, int], settings: Settings, seed: int, ranks: int = 1
) -> AsyncIterator[tuple[Fleet, App, Drive]]:
    """A fresh fleet with ``initial`` replicas per role (Ready at once), a router discovering it, and
    how to send it a workload: over HTTP, or (``settings.virtual``) in-process, to the proxy's own
    handler, with the router's engine session answered by the fleet's engines in-process."""
    tm = dataclasses.replace(WORLD, speed=settings.speed)
    links = LinksConfig.model_validate(scaled_links(LINKS, settings.speed))
    async with (
        Fleet(
            templates(tm),
            ready_s=settings.wall(settings.ready_s),
            link_cost=link_cost_from(links),
            poll_s=settings.wall(FLEET_POLL_S),
            ranks=ranks,
            rank_stagger_s=settings.wall(RANK_STAGGER_S),
            in_process=settings.virtual,
        ) as fleet,
        contextlib.AsyncExitStack() as stack,
    ):
        await fleet.start(initial)
        config = make_config(fleet, tm, settings)
        session = LocalSession(fleet.cluster, hop_s=settings.hop_s) if settings.virtual else None
        if session is not None:  # App.start opens its engine session: this one instead
            stack.enter_context(mock.patch.object(app_module, "upstream_session", lambda: session))
        app = await stack.enter_async_context(App(build(config, discovery=fleet, seed=seed)))
        fleet.busy = functools.partial(router_busy, app)
        if session is None:
            url = f"http://127.0.0.1:{app.proxy_port}"

            def drive(workload: Workload, name: str) -> Awaitable[Summary]:
                return run_workload(url, workload, name=name, timeout_s=settings.run_timeout_s)

        else:
            cfg = config.proxy
            proxy = Proxy(
                app.parts.flow,
                local_exchange(session, cfg),
                lambda: app.ready,
                debug_headers=cfg.debug_headers,
            )
            router = RouterUnderTest(proxy.completions, proxy.max_body_bytes, "flow", app=app)

            def drive(workload: Workload, name: str) -> Awaitable[Summary]:
                return _drive(router, workload, name)

        yield fleet, app, drive


async def _roll_at(fleet: Fleet, at: float, role: str) -> None:
    await asyncio.sleep(max(0.0, at - asyncio.get_running_loop().time()))
    await fleet.roll(role, "r2")


async def replay(scn: Scenario, policy: Policy, workload: Workload, settings: Settings, seed: int) -> Outcome:
    """One scenario under one policy on a fresh fleet and router; returns what happened."""
    phases = scn.stretched(settings.stretch)
    duration = sum(p.duration_s for p in phases)
    outcome = Outcome(scn.key, policy.name, duration, [], [], {})
    loop = asyncio.get_running_loop()
    async with serving(dict(scn.initial), settings, seed, scn.ranks) as (fleet, app, drive):
        t0 = loop.time()
        scaler = asyncio.create_task(autoscale(app, fleet, policy, settings, outcome, t0))
        rolls = [
            asyncio.create_task(_roll_at(fleet, t0 + settings.wall(at * settings.stretch), role))
            for at, role in scn.rolls
        ]
        try:
            run = drive(compressed(workload, settings.speed), policy.name)
            summary = await asyncio.wait_for(run, settings.wall(duration) + settings.run_timeout_s + 10.0)
            await asyncio.sleep(max(0.0, t0 + settings.wall(duration) - loop.time()))
        finally:
            for task in (scaler, *rolls):
                task.cancel()
            await asyncio.gather(scaler, *rolls, return_exceptions=True)
        end = t0 + settings.wall(duration)
        outcome.replica_s = {role: fleet.replica_seconds(role, t0, end) * settings.speed for role in ROLES}
    outcome.results = summary.results
    account(outcome, settings)
    return outcome


# -- reporting -------------------------------------------------------------------------------------


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if value != value else f"{value:.{digits}f}"


def table(scn: Scenario, outcomes: Sequence[Outcome], settings: Settings, seed: int | None = None) -> str:
    """One scenario's markdown table (one row per policy) and its verdict; ``seed``: named in the
    title (a run of several seeds)."""
    lines = [
        f"### {scn.key}{'' if seed is None else f' (seed {seed})'}: {scn.title}",
        "",
        f"Expected: {scn.expect}. SLO: TTFT ≤ {TTFT_SLO_S:g} s, TPOT ≤ {TPOT_SLO_S:g} s (simulated); "
        f"ready time {settings.ready_s:g} s, scale-down window {settings.window_s:g} s.",
        "",
        "| policy | SLO viol. s | viol. area s | replica-min P | replica-min D | replica-min | "
        "actions P ↑/↓ | actions D ↑/↓ | peak P/D | failed | TTFT p90 s | TPOT p90 s |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for o in outcomes:
        peak = {role: max((s.replicas[role] for s in o.within), default=0) for role in ROLES}
        up_p, down_p = o.actions.get("prefill", [0, 0])
        up_d, down_d = o.actions.get("decode", [0, 0])
        lines.append(
            f"| {o.policy} | {o.violation_s:.0f} | {o.violation_area_s:.1f} | "
            f"{o.replica_s['prefill'] / 60:.1f} | {o.replica_s['decode'] / 60:.1f} | {o.replica_min:.1f} | "
            f"{up_p}/{down_p} | {up_d}/{down_d} | {peak['prefill']}/{peak['decode']} | "
            f"{o.failed}/{len(o.results)} | {_fmt(o.pct('ttft_s', 0.9, settings.speed), 2)} | "
            f"{_fmt(o.pct('tpot_s', 0.9, settings.speed), 2)} |"
        )
    lines += ["", verdict(outcomes), ""]
    return "\n".join(lines)


def _printed(o: Outcome) -> tuple[float, float]:
    """Violation area and replica-minutes as printed (0.1 s, 0.1 replica-minute): closer than that is
    a tie, not a loss."""
    return round(o.violation_area_s, 1), round(o.replica_min, 1)


def _contest(outcomes: Sequence[Outcome]) -> tuple[Outcome, Outcome, bool] | None:
    """pd-router, the best threshold policy (least violation area, then replica-minutes) and whether
    pd-router met the issue's target against it; None without both."""
    pd = next((o for o in outcomes if o.policy == "pd-router"), None)
    others = [o for o in outcomes if o.policy != "pd-router"]
    if pd is None or not others:
        return None
    best = min(others, key=lambda o: (o.violation_area_s, o.replica_min))
    (ours, our_min), (theirs, their_min) = _printed(pd), _printed(best)
    return pd, best, ours <= theirs and our_min <= their_min


def verdict(outcomes: Sequence[Outcome]) -> str:
    """The issue's target: pd-router has the least violation at ≤ the best threshold's replica-minutes."""
    contest = _contest(outcomes)
    if contest is None:
        return "Target (pd-router least SLO violation at ≤ the best threshold's replica-minutes): not run."
    pd, best, ok = contest
    return (
        f"Target: pd-router violation area {pd.violation_area_s:.1f} s vs best threshold ({best.policy}) "
        f"{best.violation_area_s:.1f} s, replica-min {pd.replica_min:.1f} vs {best.replica_min:.1f} "
        f"-> {'PASS' if ok else 'FAIL'}"
    )


def pooled(outcomes: Sequence[Outcome]) -> Outcome:
    """One policy's runs of a scenario over several seeds as one: violation and replica time are the
    means, every request's result is kept."""
    first, n = outcomes[0], len(outcomes)
    out = Outcome(
        first.scenario,
        first.policy,
        first.duration_s,
        [r for o in outcomes for r in o.results],
        [],
        {role: sum(o.replica_s[role] for o in outcomes) / n for role in first.replica_s},
    )
    out.violation_s = sum(o.violation_s for o in outcomes) / n
    out.violation_area_s = sum(o.violation_area_s for o in outcomes) / n
    return out


def _dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """No more of either count than ``b``, and less of one."""
    return a != b and a[0] <= b[0] and a[1] <= b[1]


def summary(runs: Mapping[str, Sequence[Outcome]]) -> list[str]:
    """The verdicts of every scenario in one table, with whether a threshold policy did better than
    pd-router on both counts (no more violation area and no more replica-minutes, less of one)."""
    lines = [
        "| scenario | pd-router: violation area s, replica-min | best threshold | the issue's target | "
        "a threshold better on both? |",
        "|---|---|---|---|---|",
    ]
    wins = total = 0
    for key, outcomes in runs.items():
        contest = _contest(outcomes)
        if contest is None:
            continue
        pd, best, ok = contest
        ours = _printed(pd)
        better = [o.policy for o in outcomes if o is not pd and _dominates(_printed(o), ours)]
        wins, total = wins + ok, total + 1
        lines.append(
            f"| {key} | {pd.violation_area_s:.1f}, {pd.replica_min:.1f} | {best.policy}: "
            f"{best.violation_area_s:.1f}, {best.replica_min:.1f} | {'PASS' if ok else 'FAIL'} | "
            f"{', '.join(better) or 'none'} |"
        )
    return [*lines, "", f"pd-router meets the target in {wins} of {total}."] if total else []


def verdicts(runs: Mapping[int, Mapping[str, Sequence[Outcome]]]) -> str:
    """The summary table of each seed and, for several, of their means (what to tune against)."""
    parts: list[str] = []
    for seed, by_key in runs.items():
        lines = summary(by_key)
        if lines:
            parts += [f"### Verdicts{f' (seed {seed})' if len(runs) > 1 else ''}", "", *lines, ""]
    if len(runs) > 1:
        keys = next(iter(runs.values())).keys()
        mean = {
            key: [pooled(same) for same in zip(*(by_key[key] for by_key in runs.values()), strict=True)]
            for key in keys
        }
        lines = summary(mean)
        if lines:
            seeds = ", ".join(str(seed) for seed in runs)
            parts += [f"### Verdicts (mean over seeds {seeds})", "", *lines, ""]
    return "\n".join(parts)


def write_trace(path: str, runs: Mapping[int, Mapping[str, Sequence[Outcome]]]) -> None:
    """The router's recommendation per autoscaler tick and role, for every run, as a CSV."""
    rows = [
        {"scenario": o.scenario, "seed": o.seed, "policy": o.policy, **row}
        for by_key in runs.values()
        for outcomes in by_key.values()
        for o in outcomes
        for row in o.trace
    ]
    if not rows:
        return
    with open(path, "w", encoding="utf-8", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def arrivals(workload: Workload, bucket_s: float, n: int) -> dict[str, list[float]]:
    """Offered load per bucket (simulated): requests/s, prompt and answer ktokens/s."""
    load = {"req/s": [0.0] * n, "prompt ktok/s": [0.0] * n, "answer ktok/s": [0.0] * n}
    for item in workload.items:
        i = min(n - 1, int(item.at_s // bucket_s))
        load["req/s"][i] += 1.0 / bucket_s
        load["prompt ktok/s"][i] += len(item.body["prompt"]) / 4 / 1000 / bucket_s
        load["answer ktok/s"][i] += item.body["max_tokens"] / 1000 / bucket_s
    return load


def write_png(
    path: str, runs: dict[str, list[Outcome]], workloads: dict[str, Workload], settings: Settings
) -> bool:
    """Per scenario: prefill and decode replicas per policy (asked for, and routable: ready and gated),
    offered load, and the share of requests missing the SLO over time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.stderr.write("no matplotlib: skipping the PNG (pip install -e '.[bench]')\n")
        return False
    fig, axes = plt.subplots(len(runs), 4, figsize=(20, 3.2 * len(runs)), squeeze=False)
    for row, (key, outcomes) in zip(axes, runs.items(), strict=True):
        for ax, role in zip(row[:2], ROLES, strict=True):
            for o in outcomes:
                times = [s.t for s in o.within]
                (line,) = ax.step(times, [s.replicas[role] for s in o.within], where="post", label=o.policy)
                routable = [s.admitted[role] for s in o.within]
                ax.step(times, routable, where="post", color=line.get_color(), linestyle=":", linewidth=1)
            ax.set_title(f"{key}: {role} replicas (dotted: routable)", fontsize=9)
            ax.set_ylim(bottom=0)
        n = len(outcomes[0].shares) if outcomes else 1
        t = [settings.bucket_s * i for i in range(n)]
        load = arrivals(workloads[key], settings.bucket_s, n)
        for name, values in load.items():
            row[2].plot(t, values, label=name)
        row[2].set_title(f"{key}: offered load", fontsize=9)
        for o in outcomes:
            row[3].step(t, o.shares, where="post", label=o.policy)
        row[3].set_title(f"{key}: share of requests missing the SLO", fontsize=9)
        row[3].set_ylim(0, 1.05)
        for ax in row:
            ax.set_xlabel("simulated s", fontsize=8)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return True


# -- main ------------------------------------------------------------------------------------------


def workload_for(scn: Scenario, settings: Settings, seed: int) -> Workload:
    return phased(scn.stretched(settings.stretch), seed=seed, name=scn.key)


def run_replay(scn: Scenario, policy: Policy, workload: Workload, settings: Settings, seed: int) -> Outcome:
    """One replay on an event loop of its own: virtual (``random`` seeded with ``seed``; bounded by
    the scenario's length and ``run_timeout_s`` of virtual time) or wall-clock."""
    run = replay(scn, policy, workload, settings, seed)
    if settings.virtual:
        duration = settings.wall(sum(p.duration_s for p in scn.stretched(settings.stretch)))
        return run_virtual(run, seed=seed, max_virtual_s=duration + settings.run_timeout_s + 60.0)
    return _run_wall_clock(run)


T = TypeVar("T")


def _run_wall_clock(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop  # optional, as in the router CLI
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _one_job(job: tuple[str, int, str], settings: Settings, several: bool) -> Outcome:
    """One (scenario, seed, policy) replay, said on stderr as it ends (from a worker process too)."""
    key, seed, name = job
    scn = SCENARIOS[key]
    wall, cpu = time.perf_counter(), time.process_time()
    outcome = run_replay(scn, POLICIES[name], workload_for(scn, settings, seed), settings, seed)
    outcome.seed = seed
    label = f"[{key}{f' seed {seed}' if several else ''}]"
    lines = [  # why, not just how many
        f"  {label} {name}: failed at {r.at_s * settings.speed:.1f} s (simulated): {r.status} {r.error}\n"
        for r in outcome.results
        if not r.ok
    ]
    lines.append(
        f"  {label} {name}: {len(outcome.results) - outcome.failed}/{len(outcome.results)} ok, "
        f"violation {outcome.violation_s:.0f} s, {outcome.replica_min:.1f} replica-min "
        f"({time.perf_counter() - wall:.1f} s, {time.process_time() - cpu:.1f} CPU s)\n"
    )
    sys.stderr.write("".join(lines))
    return outcome


def replay_all(args: argparse.Namespace, settings: Settings) -> dict[int, dict[str, list[Outcome]]]:
    """Every scenario × seed × policy, in ``args.jobs`` processes (each replay is alone on its own
    virtual loop: the same numbers in any process, in any order), each scenario's table printed as
    soon as its runs are in; returns the outcomes per seed and scenario."""
    policies = list(args.policies)
    if "pd-router" in policies and not scaling_supported():
        sys.stderr.write("pd-router: skipped (this router has no `signals` section / App.scaling yet)\n")
        policies.remove("pd-router")
    several = len(args.seeds) > 1
    jobs = [(key, seed, name) for key in args.scenarios for seed in args.seeds for name in policies]
    runs: dict[int, dict[str, list[Outcome]]] = {
        seed: {key: [] for key in args.scenarios} for seed in args.seeds
    }
    with contextlib.ExitStack() as stack:
        if args.jobs > 1:
            workers = stack.enter_context(concurrent.futures.ProcessPoolExecutor(args.jobs))
            outcomes = workers.map(_one_job, jobs, itertools.repeat(settings), itertools.repeat(several))
        else:
            outcomes = map(_one_job, jobs, itertools.repeat(settings), itertools.repeat(several))
        for (key, seed, _), outcome in zip(jobs, outcomes, strict=True):  # in order, as they end
            done = runs[seed][key]
            done.append(outcome)
            if len(done) == len(policies):
                sys.stdout.write(table(SCENARIOS[key], done, settings, seed if several else None) + "\n")
                sys.stdout.flush()
    return runs


def main_sync(args: argparse.Namespace, settings: Settings) -> int:
    runs = replay_all(args, settings)
    tables = [
        table(SCENARIOS[key], by_key[key], settings, seed if len(runs) > 1 else None)
        for key in args.scenarios
        for seed, by_key in runs.items()
    ]
    summaries = verdicts(runs)
    if summaries:
        sys.stdout.write(summaries + "\n")
    if args.table:
        with open(args.table, "w", encoding="utf-8") as out:
            out.write("\n".join([*tables, summaries]))
    if args.trace:
        write_trace(args.trace, runs)
    first = args.seeds[0]
    workloads = {key: workload_for(SCENARIOS[key], settings, first) for key in args.scenarios}
    if args.png and write_png(args.png, runs[first], workloads, settings):
        sys.stderr.write(f"wrote {args.png}{f' (seed {first})' if len(runs) > 1 else ''}\n")
    failed = sum(o.failed for by_key in runs.values() for outcomes in by_key.values() for o in outcomes)
    return 0 if failed == 0 else 1


def _names(value: str, known: Sequence[str], what: str) -> list[str]:
    names = [n for n in value.split(",") if n]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; choose from {list(known)}")
    return names


# Set by the replay's own options (``--ready-s``, ``--window-s``) or its clock: not overridable.
_REPLAY_OWNS = ("ready_time_s", "scale_down_window_s", "tick_ms", "min_replicas", "max_replicas")


def _override(value: str) -> tuple[str, str]:
    """``KEY=VALUE`` for the signals section: a setting it has, other than those the replay sets."""
    key, sep, setting = value.partition("=")
    fields = PoolConfig.model_fields["signals"].annotation.model_fields  # type: ignore[union-attr]
    if not sep or key not in fields or key in _REPLAY_OWNS:
        raise argparse.ArgumentTypeError(
            f"{value!r}: KEY=VALUE, KEY a signals setting other than {', '.join(_REPLAY_OWNS)}"
        )
    if key.endswith("_s"):
        try:
            float(setting)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r}: a duration in simulated seconds") from None
    return key, setting


def main(argv: list[str] | None = None) -> int:
    defaults = Settings()
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.scaling",
        description="Replay scaling scenarios on the simulated P/D fleet with each autoscaling policy in "
        "the loop (same seeded traffic); print a markdown table per scenario.",
    )
    parser.add_argument("--quick", action="store_true", help="every duration 5× shorter (a smoke run)")
    parser.add_argument(
        "--scenarios",
        type=lambda v: _names(v, list(SCENARIOS), "scenario"),
        default=list(SCENARIOS),
        help=f"comma-separated (default: all of {','.join(SCENARIOS)})",
    )
    parser.add_argument(
        "--policies",
        type=lambda v: _names(v, list(POLICIES), "policy"),
        default=list(POLICIES),
        help=f"comma-separated (default: all of {','.join(POLICIES)})",
    )
    parser.add_argument("--png", default="", help="write replicas and load over time here (matplotlib)")
    parser.add_argument("--table", default="", help="also write the markdown tables here")
    parser.add_argument(
        "--trace", default="", help="write the router's recommendation per tick and role here (CSV)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the traffic's and the router's seed")
    parser.add_argument(
        "--seeds",
        type=lambda v: [int(n) for n in v.split(",") if n],
        default=None,
        help="comma-separated, instead of --seed: every scenario with each, verdicts also on the means",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="virtual time: replays in parallel processes (default: 1)"
    )
    parser.add_argument(
        "--wall-clock",
        action="store_true",
        help="real HTTP on 127.0.0.1 in wall-clock time (--speed× compressed; ~15 min for all, noisy) "
        "instead of virtual time (in-process, deterministic)",
    )
    parser.add_argument("--speed", type=float, default=defaults.speed, help="simulated s per wall s")
    parser.add_argument("--ready-s", type=float, default=defaults.ready_s, help="replica ready time (sim s)")
    parser.add_argument("--window-s", type=float, default=defaults.window_s, help="scale-down window (sim s)")
    parser.add_argument("--max-replicas", type=int, default=defaults.max_replicas, help="per role")
    parser.add_argument("--run-timeout", type=float, default=defaults.run_timeout_s, help="wall s")
    parser.add_argument(
        "--hop-ms",
        type=float,
        default=defaults.hop_s * 1000,
        help="virtual time: each proxy → engine leg takes this (wall ms, ×speed simulated; default: 1)",
    )
    parser.add_argument(
        "--local-prefill",
        action="store_true",
        help="let the picker skip the prefill leg (decode replicas compute prompts themselves)",
    )
    parser.add_argument(
        "--signals",
        action="append",
        default=[],
        type=_override,
        metavar="KEY=VALUE",
        help="set one of pd-router's signals settings (repeatable; a duration in simulated s), e.g. "
        "min_rate_requests=16 or level_window_s=20",
    )
    args = parser.parse_args(argv)
    if args.wall_clock and args.jobs > 1:  # parallel wall-clock runs would share the CPU: slower, noisier
        parser.error("--jobs needs virtual time (not --wall-clock)")
    settings = dataclasses.replace(
        defaults,
        speed=args.speed,
        ready_s=args.ready_s,
        window_s=args.window_s,
        max_replicas=args.max_replicas,
        run_timeout_s=args.run_timeout,
        local_prefill=args.local_prefill,
        virtual=not args.wall_clock,
        hop_s=args.hop_ms / 1000,
        signals=tuple(args.signals),
    )
    if args.quick:
        settings = settings.shrunk(0.2)
    args.seeds = args.seeds or [args.seed]
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    return main_sync(args, settings)


if __name__ == "__main__":
    sys.exit(main())
