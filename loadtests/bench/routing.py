"""Routing quality on the simulated cluster: pd-router vs baseline policies, same seeded workload.

For every scenario, every policy gets exactly the same requests at exactly the same arrival times
(``simulator.workloads.generate``, seeded) against a FRESH simulated cluster (empty caches, fresh counters),
one policy after another in this process. The router is given the simulator's speed model
(``engine_model_for``) and the same link table the simulator uses, so predictions are fair.

The scenarios (a–e) are ``loadtests.bench.scenarios``; (e) also runs pd-router-rigid, the
joint picker without ``picker.prefill_may_decode`` (the default lets prefill pods serve whole
requests).

Every scenario also runs ``reference``: a full-information pair picker that reads the simulator's
exact state (cache contents, queues, running batches, free KV, transfers in flight) and plays each
engine's batching loop forward with the simulator's own time model, choosing the route (one pod,
or a prefill → decode pair with its real transfer) with the smallest true TTFT. It is the
physical bound pd-router is measured against (``p90/ref``, ``p99/ref``); it runs in-process and
is registered here only, never in ``router.scheduling.costmodel.policies.POLICIES``.

Goodput is the share of requests answered within the scenario's SLOs (TTFT ≤ 1 s and TPOT ≤ 20 ms
unless the scenario says otherwise, divided by ``--speed`` like every simulated time). Under each
table: the observed / predicted TTFT percentiles of every pd-router run (its
``pd_router_prediction_ratio`` histogram), and the reference's own.

Also measures the "unloaded TTFT": a few requests of the same shape sent one at a time on an idle
cluster, cold (never-seen prompt) and warm (the same prompt again), so the reader can check how
loaded a run was (the issue's condition: round-robin's p50 TTFT ≥ 3 × the cold unloaded TTFT).

    python -m loadtests.bench.routing                      # all scenarios, default size (~7.5 min)
    python -m loadtests.bench.routing --scenarios de       # only the new ones
    python -m loadtests.bench.routing --scenarios a --rate 30 --requests 1200
    python -m loadtests.bench.routing --scenarios a --sweep 20,30,40   # round-robin load sweep
    python -m loadtests.bench.routing --scenarios e --sweep 12,16 --policies pd-router,pd-router-rigid
    python -m loadtests.bench.routing --misconfigure 3   # engines 3× slower than configured:
                                                         # pd-router-learning vs pd-router-static

Everything listens on 127.0.0.1. Every run is bounded by its request count and ``--run-timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import heapq
import logging
import math
import statistics
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from loadtests.bench.scenarios import (  # noqa: F401 (report, scaling and soak read the constants here)
    B_TURNS,
    GOODPUT_TPOT_S,
    GOODPUT_TTFT_S,
    HOP_S,
    KV_BYTES_PER_TOKEN,
    POLICIES,
    SCENARIOS,
    Scenario,
    config_data,
    goodput,
    router_links,
    scaled_links,
)
from router.request.types import RouteRequest
from router.scheduling.costmodel.matrix import PairCosts
from router.scheduling.costmodel.policies import PairChoice
from router.scheduling.costmodel.view import Candidates
from router.server.app import App
from router.server.compose import build
from router.server.config import LinksConfig, PoolConfig, parse_config
from router.state.pool import Pool
from simulator.cluster import link_cost_from
from simulator.engine import EngineSnapshot, SimCluster, SimEngine, SimJob, TimeModel
from simulator.workloads.client import Summary, percentile, run_workload, send
from simulator.workloads.generate import WorkItem, Workload

MS = 1000.0


# -- running ---------------------------------------------------------------------------------------


def make_config(
    cluster: SimCluster,
    tm: TimeModel,
    links: dict[str, Any],
    policy: str | dict[str, Any] = "joint",
    *,
    misconfigure: float = 1.0,
    learn: bool | None = None,
) -> PoolConfig:
    """The validated ``config_data`` of ``cluster``'s engines (see there for the arguments)."""
    endpoints = [
        (name, cluster.address(name), e.spec.role, e.spec.link) for name, e in cluster.engines.items()
    ]
    return parse_config(config_data(endpoints, tm, links, policy, misconfigure=misconfigure, learn=learn))


# The runs whose prediction errors are reported.
LEARNS = frozenset({"pd-router", "pd-router-rigid", "pd-router-learning"})


# -- the full-information reference ----------------------------------------------------------------

_MAX_STEPS = 100_000


def first_token_at(
    snap: EngineSnapshot,
    job: SimJob,
    arrive_at: float,
    ahead: Sequence[tuple[float, SimJob]] = (),
) -> float:
    """When ``job`` (a new request reaching the engine at loop time ``arrive_at``) emits its first
    token: the engine's batching loop (``SimEngine._batch_loop``) played forward from its exact
    state ``snap`` with the simulator's time model. ``ahead``: requests already sent there that
    the engine has not received yet, ``(arrival, job)`` (they join the queue before ``job`` when
    they arrive no later); no other new arrivals.

    Followed exactly: FIFO admission at each step's start (a free slot below ``max_running`` and
    the KV blocks the head needs), a remote prefill's transfer from its admission, the per-step
    prefill budget given in running order, every step's duration (base + prefill tokens + decoding
    sequences + resident KV), requests ending after their last token. Approximated: the blocks a
    request holds while it decodes grow continuously, prefix-cache hits are those of ``now``,
    preemption is not modelled. ``inf`` when the request would never be admitted.
    """
    tm = snap.time
    bt = snap.block_tokens
    speed = tm.speed
    budget_max = tm.max_prefill_tokens_per_step
    base, per_token = tm.step_base_s, tm.prefill_s_per_token
    per_seq, per_kv = tm.decode_s_per_seq, tm.kv_s_per_token
    # A job: [prefill tokens left, tokens left to emit, blocks freed when it ends, is the new one].
    prefilling: deque[list[Any]] = deque()
    ends: list[tuple[int, float]] = []  # (step index of its last token, blocks freed) per decoder
    decoding = 0
    for j in snap.running:
        if j.prefill > 0:
            prefilling.append([j.prefill, j.tokens, j.frees_blocks, False])
        else:
            ends.append((j.tokens - 1, j.frees_blocks))
            decoding += 1
    heapq.heapify(ends)
    waiting: deque[tuple[SimJob, bool]] = deque((j, False) for j in snap.waiting)
    order = 0  # tie-break for transfers done at the same time
    transfers: list[tuple[float, int, list[Any]]] = []
    for done, j in snap.transfers:
        transfers.append((done, order, [max(1, j.prefill), j.tokens, j.frees_blocks, False]))
        order += 1
    heapq.heapify(transfers)
    running = len(snap.running)
    in_transfer = len(transfers)
    held = float(snap.held_blocks)
    capacity = snap.num_gpu_blocks
    # Arrivals to come, in order: (loop time, order, job, is the new one).
    arrivals = [(at, i, j, False) for i, (at, j) in enumerate(ahead)]
    arrivals.append((arrive_at, len(arrivals), job, True))
    arrivals.sort(key=lambda a: (a[0], a[1]), reverse=True)  # popped from the end
    t = snap.start
    step = 0
    while step < _MAX_STEPS:
        while transfers and transfers[0][0] <= t:
            prefilling.append(heapq.heappop(transfers)[2])
            in_transfer -= 1
            running += 1
        while arrivals and arrivals[-1][0] <= t:
            _, _, j, mine = arrivals.pop()
            waiting.append((j, mine))
        while (
            waiting
            and running + in_transfer < tm.max_running
            and waiting[0][0].need_blocks <= capacity - held
        ):
            w, mine = waiting.popleft()
            held += w.need_blocks
            entry = [w.prefill, w.tokens, w.frees_blocks, mine]
            if w.transfer_s is not None:
                heapq.heappush(transfers, (t + w.transfer_s, order, entry))
                order += 1
                in_transfer += 1
            else:
                prefilling.append(entry)
                running += 1
        if running == 0:  # idle: the loop sleeps until a request or a transfer wakes it
            wake = min(_next(transfers), arrivals[-1][0] if arrivals else math.inf)
            if wake == math.inf:
                return math.inf
            t = max(t, wake)
            continue
        if not prefilling and ends and ends[0][0] - step > 1:
            # Decode-only steps until the next request ends or the next arrival: skip them at
            # once (the step time grows linearly with the resident KV, a closed-form sum).
            skip = ends[0][0] - step
            horizon = min(_next(transfers), arrivals[-1][0] if arrivals else math.inf)
            c0 = base + per_seq * decoding + per_kv * held * bt
            c1 = per_kv * decoding
            if horizon < math.inf:
                x = (horizon - t) * speed
                # Steps j = 0.. whose start t + S(j) is before the horizon, S(j) = j·c0 + c1·j(j-1)/2.
                a, b = c1 / 2.0, c0 - c1 / 2.0
                root = (-b + math.sqrt(b * b + 4.0 * a * x)) / (2.0 * a) if a > 0 else x / b
                skip = min(skip, max(1, math.ceil(root)))
            t += (skip * c0 + c1 * skip * (skip - 1) / 2.0) / speed
            held += skip * decoding / bt
            step += skip
            continue
        budget = budget_max
        for entry in prefilling:
            if budget <= 0:
                break
            n = min(budget, entry[0])
            entry[0] -= n
            budget -= n
        start_decoding = decoding
        t += (base + per_token * (budget_max - budget) + per_seq * decoding + per_kv * held * bt) / speed
        while ends and ends[0][0] <= step:
            held -= heapq.heappop(ends)[1]
            decoding -= 1
            running -= 1
        held += start_decoding / bt
        while prefilling and prefilling[0][0] <= 0:
            entry = prefilling.popleft()
            if entry[3]:
                return t
            entry[1] -= 1
            if entry[1] <= 0:
                held -= entry[2]
                running -= 1
            else:
                heapq.heappush(ends, (step + entry[1], entry[2]))
                decoding += 1
        step += 1
    return math.inf


def _next(transfers: list[tuple[float, int, list[Any]]]) -> float:
    return transfers[0][0] if transfers else math.inf


class RequestTap:
    """A candidate filter that keeps every candidate and hands the request to the reference.

    The ``PairPicker`` Protocol passes only ``PairCosts`` (token counts, no prompt); filters run
    in the same synchronous pick just before it, with the request. See the report: passing the
    request to ``PairPicker.choose`` would make this unnecessary."""

    name = "reference-request-tap"

    def __init__(self, reference: ReferencePicker) -> None:
        self.reference = reference

    def mask(self, cand: Candidates, request: RouteRequest) -> np.ndarray | None:
        self.reference.request = request
        return None


@dataclass(slots=True)
class _Sent:
    """A leg the reference routed that its engine has not received yet (in the proxy, or a decode
    leg waiting for its prefill): part of the true state, though not the simulator's yet."""

    request_id: str
    engine: str
    at: float  # loop time it is expected at the engine
    job: SimJob
    picked: float  # time.monotonic() of the pick (the engines log arrivals on that clock)


# A leg still not seen this long after it was expected is dropped (it failed, or was cancelled).
_SENT_GRACE_S = 1.0


@dataclass(slots=True)
class _Route:
    ttft_s: float
    prefill: int  # candidate position, -1: none
    col: int  # decode column


def _name(engine_at: list[SimEngine], position: int) -> str | None:
    return None if position < 0 else engine_at[position].spec.name


class ReferencePicker:
    """The full-information pair picker: the route with the smallest true TTFT.

    For every candidate it reads the simulated engine's exact state (``SimEngine.snapshot``: the
    prefix cache, queued and running work, the step in progress, free KV, transfers in flight) and
    plays its batching loop forward (``first_token_at``): one pod computing the prompt itself, and
    every (prefill, decode) pair the cost matrix allows — the prefill leg on P, the proxy's hop,
    then the decode leg on D with the real transfer of the blocks D lacks over the real link. Per
    decode pod and link class only the prefill pod whose leg ends first matters (the transfer
    depends on the link and D's cache only, and a later arrival on D is never served earlier).
    Feasibility is the router's: routes the matrix prices at +inf stay out (KV that can never fit,
    local prefill disabled, a prefill pod that may not decode)."""

    name = "reference"

    def __init__(self, cluster: SimCluster, pool: Pool, hop_s: float = HOP_S) -> None:
        self.cluster = cluster
        self.pool = pool
        self.hop_s = hop_s
        self.request: RouteRequest | None = None  # set by ``RequestTap`` in the same pick
        self.predicted: dict[str, float] = {}  # request id -> predicted TTFT of the chosen route
        self.pick_s: list[float] = []  # the reference's own time per pick (it blocks the loop)
        # The last pick's routes: (prefill engine or None, decode engine) -> predicted TTFT.
        self.last_routes: dict[tuple[str | None, str], float] = {}
        self.sent: list[_Sent] = []
        # The last pick priced: its routes' legs to record (``send_legs(prefill, col)``), and what
        # choosing among them needs.
        self.send_legs: Callable[[int, int], None] = lambda prefill, col: None
        self._request_id = ""
        self._alone: dict[int, float] = {}
        self._running: list[int] = []

    def _in_flight(self, now: float) -> dict[str, list[tuple[float, SimJob]]]:
        """Legs sent but not received yet, per engine name: ``(expected arrival, job)``."""
        if not self.sent:
            return {}
        engines = self.cluster.engines
        oldest = min(s.picked for s in self.sent) - 0.001
        seen: dict[str, set[str]] = {}
        for name in {s.engine for s in self.sent}:
            ids = seen[name] = set()
            for at, headers in reversed(engines[name].arrivals):
                if at < oldest:
                    break
                ids.add(headers.get("x-request-id", ""))
        self.sent = [
            s for s in self.sent if s.request_id not in seen[s.engine] and now < s.at + _SENT_GRACE_S
        ]
        out: dict[str, list[tuple[float, SimJob]]] = {}
        for s in self.sent:
            out.setdefault(s.engine, []).append((s.at, s.job))
        return out

    def choose(self, costs: PairCosts, fallbacks: int) -> PairChoice | None:
        started = time.perf_counter()
        try:
            return self._choose(costs, fallbacks)
        finally:
            self.pick_s.append(time.perf_counter() - started)

    def price(self, costs: PairCosts) -> list[_Route]:
        """Every route the matrix allows, with its true TTFT from the engines' state now (also
        ``last_routes``); ``send_legs`` then records the legs of whichever route is taken."""
        request, self.request = self.request, None
        if request is None:
            raise RuntimeError("reference picker used without its RequestTap filter")
        cand = costs.view.cand
        engines = self.cluster.engines
        by_slot = self.pool.by_slot
        engine_at: list[SimEngine] = []
        for slot in cand.slots.tolist():
            endpoint = by_slot[slot]
            assert endpoint is not None
            engine_at.append(engines[endpoint.id])
        prompt, keys = engine_at[0].prompt_blocks(request.body)
        max_tokens = request.max_tokens
        snaps: dict[int, EngineSnapshot] = {}

        def snap(pos: int) -> EngineSnapshot:
            if pos not in snaps:
                snaps[pos] = engine_at[pos].snapshot()
            return snaps[pos]

        now = snap(0).now
        in_flight = self._in_flight(now)

        def ahead(pos: int) -> list[tuple[float, SimJob]]:
            return in_flight.get(engine_at[pos].spec.name, [])

        alone: dict[int, float] = {}
        self._alone, self._request_id = alone, request.request_id

        def served_alone(pos: int) -> float:
            """First token of the prompt computed on ``pos`` (as a whole request or a prefill leg)."""
            if pos not in alone:
                job = engine_at[pos].job_for(keys, prompt, max_tokens)
                alone[pos] = first_token_at(snap(pos), job, now + self.hop_s, ahead(pos))
            return alone[pos]

        prefill_positions = costs.prefill.tolist()
        routes: list[_Route] = []
        for col, d in enumerate(costs.decode.tolist()):
            if not np.isfinite(costs.cost[:, col]).any():
                continue  # the request can never fit there
            if np.isfinite(costs.cost[0, col]):
                routes.append(_Route(served_alone(d) - now, -1, col))
            if not np.isfinite(costs.cost[1:, col]).any():
                continue  # no pair ends on this pod (a prefill pod serving whole requests)
            best: dict[str, tuple[float, int]] = {}
            for p in prefill_positions:
                if p == d:
                    continue
                link = engine_at[p].spec.link
                leg = served_alone(p)
                if link not in best or leg < best[link][0]:
                    best[link] = (leg, p)
            for leg, p in best.values():
                if leg == math.inf:
                    continue
                job = engine_at[d].job_for(keys, prompt, max_tokens, remote=engine_at[p])
                at = first_token_at(snap(d), job, leg + self.hop_s, ahead(d))
                routes.append(_Route(at - now, p, col))
        self.last_routes = {
            (_name(engine_at, r.prefill), engine_at[int(costs.decode[r.col])].spec.name): r.ttft_s
            for r in routes
        }
        self._running = [len(snap(d).running) + len(snap(d).waiting) for d in costs.decode.tolist()]
        # Until the engines receive them, a pick's legs are part of the state the next picks must
        # see (a burst picked in one go would otherwise herd onto one engine).
        self.send_legs = functools.partial(
            self._send, request.request_id, costs, engine_at, keys, prompt, max_tokens, now, served_alone
        )
        return routes

    def _send(
        self,
        request_id: str,
        costs: PairCosts,
        engine_at: list[SimEngine],
        keys: Sequence[int],
        prompt: int,
        max_tokens: int,
        now: float,
        served_alone: Callable[[int], float],
        prefill: int,
        col: int,
    ) -> None:
        """Record the legs of the route (``prefill`` position or -1, decode ``col``) as sent."""
        picked = time.monotonic()
        d = int(costs.decode[col])
        if prefill < 0:
            job = engine_at[d].job_for(keys, prompt, max_tokens)
            self.sent.append(_Sent(request_id, engine_at[d].spec.name, now + self.hop_s, job, picked))
            return
        remote = engine_at[prefill]
        job = remote.job_for(keys, prompt, 1)
        self.sent.append(_Sent(request_id, remote.spec.name, now + self.hop_s, job, picked))
        job = engine_at[d].job_for(keys, prompt, max_tokens, remote=remote)
        at = served_alone(prefill) + self.hop_s
        self.sent.append(_Sent(request_id, engine_at[d].spec.name, at, job, picked))

    def _choose(self, costs: PairCosts, fallbacks: int) -> PairChoice | None:
        routes = self.price(costs)
        finite = [r for r in routes if r.ttft_s < math.inf]
        if not finite:
            return None
        # Ties (an idle pool): the emptier decode pod, then the cheaper route (no pair).
        running = self._running
        chosen = min(finite, key=lambda r: (r.ttft_s, running[r.col], r.prefill >= 0))
        self.predicted[self._request_id] = chosen.ttft_s
        self.send_legs(chosen.prefill, chosen.col)
        alone = self._alone
        prefill_positions = costs.prefill.tolist()
        column_best: dict[int, float] = {}
        for r in finite:
            column_best[r.col] = min(r.ttft_s, column_best.get(r.col, math.inf))
        others = sorted((t, col) for col, t in column_best.items() if col != chosen.col)
        decode_fallbacks = np.array([col for _, col in others[:fallbacks]], dtype=np.int64)
        prefill_fallbacks = np.empty(0, dtype=np.int64)
        if chosen.prefill >= 0:
            d = int(costs.decode[chosen.col])
            ranked = sorted(
                (alone[p], p) for p in alone if p not in (chosen.prefill, d) and p in prefill_positions
            )
            prefill_fallbacks = np.array([p for _, p in ranked[:fallbacks]], dtype=np.int64)
        return PairChoice(chosen.prefill, chosen.col, prefill_fallbacks, decode_fallbacks)


class RegretTap:
    """Another pair picker, its every pick priced by the reference without choosing: the pick's
    *regret* is the true TTFT of the route it took minus the best route's, both from the engines'
    exact state at that moment. Its legs, not the reference's, join the reference's in-flight
    state. A pair through a prefill pod the reference did not price (not its link class's
    soonest) is not counted."""

    def __init__(self, inner: Any, reference: ReferencePicker) -> None:
        self.inner = inner
        self.reference = reference
        self.name = inner.name
        self.regrets: list[float] = []  # seconds, one per counted pick

    def choose(self, costs: PairCosts, fallbacks: int) -> PairChoice | None:
        choice = self.inner.choose(costs, fallbacks)
        routes = self.reference.price(costs)
        if choice is None:
            return None
        best = min((r.ttft_s for r in routes), default=math.inf)
        route = (choice.prefill, choice.decode)
        taken = next((r.ttft_s for r in routes if (r.prefill, r.col) == route), None)
        if taken is not None and math.isfinite(taken) and math.isfinite(best):
            self.regrets.append(taken - best)
        self.reference.send_legs(choice.prefill, choice.decode)
        return choice


def install_regret(app: App, cluster: SimCluster) -> RegretTap:
    """Price every pick of ``app``'s own pair picker with the full-information reference."""
    reference = ReferencePicker(cluster, app.parts.pool)
    picker = app.parts.picker
    tap = RegretTap(picker.pair_picker, reference)
    picker.pair_picker = tap
    picker.filters = (*picker.filters, RequestTap(reference))
    return tap


def install_reference(app: App, cluster: SimCluster) -> ReferencePicker:
    """Make ``app``'s picker the full-information reference over ``cluster`` (same process)."""
    reference = ReferencePicker(cluster, app.parts.pool)
    app.parts.picker.pair_picker = reference
    app.parts.picker.filters = (*app.parts.picker.filters, RequestTap(reference))
    return reference


# -- one run ----------------------------------------------------------------------------------------


@dataclass
class Run:
    """One policy's run: the client's view, and what the router and the simulator saw."""

    summary: Summary
    busy: dict[str, float] = field(default_factory=dict)  # role -> mean share of wall time stepping
    # pd-router's observed / predicted histograms: measure -> counts per bucket, and the bounds.
    ratios: dict[str, np.ndarray] = field(default_factory=dict)
    ratio_bounds: tuple[float, ...] = ()
    reference: ReferencePicker | None = None
    # Prompt tokens the engines computed, all pods: a P/D pair's decode leg reports the KV it was
    # sent as cached, so only this says how much of the prompts the prefix caches really spared.
    prefill_tokens_computed: int = 0

    @property
    def name(self) -> str:
        return self.summary.name


async def run_policy(
    scn: Scenario,
    policy: str,
    workload: Workload,
    tm: TimeModel,
    seed: int,
    timeout_s: float,
    misconfigure: float = 1.0,
) -> Run:
    physical, links = scaled_links(scn.links, tm.speed), router_links(scn, tm.speed)
    link_cost = link_cost_from(LinksConfig.model_validate(physical)) if physical else None
    async with SimCluster(scn.specs(tm), link_cost) as cluster:
        config = make_config(
            cluster,
            tm,
            links,
            POLICIES[policy],
            misconfigure=misconfigure,
            learn={"pd-router-learning": True, "pd-router-static": False}.get(policy),
        )
        async with App(build(config, seed=seed)) as app:
            reference = install_reference(app, cluster) if policy == "reference" else None
            base = f"http://127.0.0.1:{app.proxy_port}"
            run = run_workload(base, workload, name=policy, timeout_s=timeout_s)
            summary = await asyncio.wait_for(run, timeout=timeout_s + workload.items[-1].at_s + 10.0)
            perf = app.parts.scaling.perf
            ratios = {measure: counts.copy() for measure, counts in perf.ratios.items()}
            bounds = tuple(perf.ratio_buckets)
        busy: dict[str, list[float]] = {}
        for engine in cluster.engines.values():
            share = engine.stats.busy_s / summary.wall_s if summary.wall_s else 0.0
            busy.setdefault(engine.spec.role, []).append(share)
        computed = sum(engine.stats.prefill_tokens_computed for engine in cluster.engines.values())
    busy_share = {role: statistics.mean(v) for role, v in busy.items()}
    return Run(summary, busy_share, ratios, bounds, reference, prefill_tokens_computed=computed)


def _sample(scn: Scenario, k: int, seed: int) -> list[WorkItem]:
    """``k`` requests of the workload's shape whose prompts no other request shares (cold)."""
    items = []
    chat = scn.key in ("b", "d")
    for i in range(k):
        wl = scn.workload(B_TURNS if chat else 1, 1.0, seed + 7919 * (i + 1))
        if not wl.items:  # a time-based workload (phases) may hold no request in one second
            wl = scn.workload(16, 16.0, seed + 7919 * (i + 1))
        # Multi-turn: cycle through turn depths so the sample covers short and long conversations.
        items.append(wl.items[i % len(wl.items)])
    return items


async def unloaded_ttft(scn: Scenario, tm: TimeModel, seed: int, k: int = 6) -> tuple[float, float]:
    """(cold p50, warm p50) TTFT in seconds of ``k`` requests sent one at a time on an idle cluster."""
    physical, links = scaled_links(scn.links, tm.speed), router_links(scn, tm.speed)
    link_cost = link_cost_from(LinksConfig.model_validate(physical)) if physical else None
    cold: list[float] = []
    warm: list[float] = []
    async with SimCluster(scn.specs(tm), link_cost) as cluster:
        config = make_config(cluster, tm, links)
        async with (
            App(build(config, seed=seed)) as app,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60.0)) as session,
        ):
            base = f"http://127.0.0.1:{app.proxy_port}"
            for item in _sample(scn, k, seed):
                item = WorkItem(item.at_s, item.path, {**item.body, "max_tokens": 2}, item.session, item.turn)
                for out in (cold, warm):
                    result = await send(session, base, item)
                    if result.ok:
                        out.append(result.ttft_s)
                    await asyncio.sleep(0.05)  # let the engine and the router settle between requests
    return statistics.median(cold), statistics.median(warm)


# -- reporting -------------------------------------------------------------------------------------


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if value != value else f"{value:.{digits}f}"


def _cross_rack(summary: Summary, link_of: dict[str, str]) -> str:
    """Share of requests whose KV crossed racks (pairs only), and share served with no prefill leg."""
    ok = summary.ok
    if not ok:
        return "-"
    pairs = [r for r in ok if r.prefill]
    cross = sum(1 for r in pairs if link_of.get(r.prefill) != link_of.get(r.decode))
    local = len(ok) - len(pairs)
    return f"{100.0 * cross / len(ok):.0f}% / {100.0 * local / len(ok):.0f}%"


def histogram_quantile(counts: Sequence[int], bounds: Sequence[float], q: float) -> float:
    """The ``q`` quantile of a histogram (counts per bucket, upper bounds; the first bucket starts
    at 0), interpolated linearly inside the bucket as Prometheus' ``histogram_quantile`` does;
    ``inf`` when it falls in the open last bucket."""
    total = sum(counts)
    if total == 0:
        return float("nan")
    rank = q * total
    below = 0.0
    lower = 0.0
    for count, upper in zip(counts, bounds, strict=True):
        if count and below + count >= rank:
            if math.isinf(upper):
                return math.inf
            return lower + (upper - lower) * (rank - below) / count
        below += count
        lower = upper
    return bounds[-1]


def _ratio(value: float, bounds: Sequence[float]) -> str:
    if value != value:
        return "-"
    if math.isinf(value):
        finite = [b for b in bounds if not math.isinf(b)]
        return f">{finite[-1]:g}"
    return f"{value:.2f}"


def _busy(run: Run) -> str:
    b = run.busy
    if "prefill" in b or "decode" in b:
        return f"{b.get('prefill', 0.0):.0%}/{b.get('decode', 0.0):.0%}"
    return f"{statistics.mean(b.values()):.0%}" if b else "-"


def render(
    scn: Scenario,
    tm: TimeModel,
    rate: float,
    runs: list[Run],
    unloaded: tuple[float, float],
    link_of: dict[str, str],
) -> str:
    cold, warm = unloaded
    summaries = [r.summary for r in runs]
    n = len(summaries[0].results) if summaries else 0
    slo_ttft, slo_tpot = scn.goodput_ttft_s / tm.speed, scn.goodput_tpot_s / tm.speed
    lines = [
        "",
        f"{scn.title} — {n} requests at {rate:g} req/s{' base' if scn.key == 'd' else ''} (Poisson), "
        f"speed ×{tm.speed:g}",
        f"  {scn.params}",
        f"  unloaded TTFT (one request at a time, idle cluster): cold p50 {cold * MS:.1f} ms, "
        f"warm p50 {warm * MS:.1f} ms; goodput = TTFT ≤ {slo_ttft * MS:g} ms and TPOT ≤ "
        f"{slo_tpot * MS:g} ms",
        "",
    ]
    pd = any(s.role != "prefill-decode" for s in scn.specs(tm))
    cross = scn.key == "c"
    header = (
        f"  {'policy':<16} {'ok':>9} {'TTFT p50':>9} {'TTFT p90':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
        f"{'TPOT p99':>9} {'hit rate':>8} {'out tok/s':>9} {'goodput':>7} {'p50/RR':>7} {'p99/RR':>7} "
        f"{'p90/ref':>7} {'p99/ref':>7} {'busy P/D' if pd else 'busy':>9}"
    )
    if cross:
        header += f"  {'cross/no-P':>11}"
    lines += [header, "  " + "-" * (len(header) - 2)]
    rr = next((s for s in summaries if s.name == "round-robin"), None)
    ref = next((s for s in summaries if s.name == "reference"), None)
    rr50 = rr.pct("ttft_s", 0.5) if rr else float("nan")
    rr99 = rr.pct("ttft_s", 0.99) if rr else float("nan")
    ref90 = ref.pct("ttft_s", 0.9) if ref else float("nan")
    ref99 = ref.pct("ttft_s", 0.99) if ref else float("nan")
    for run in runs:
        s = run.summary
        p50, p90, p99 = s.pct("ttft_s", 0.5), s.pct("ttft_s", 0.9), s.pct("ttft_s", 0.99)
        row = (
            f"  {s.name:<16} {len(s.ok):>4}/{len(s.results):<4} {_fmt(p50 * MS):>9} {_fmt(p90 * MS):>9} "
            f"{_fmt(p99 * MS):>9} {_fmt(s.pct('tpot_s', 0.5) * MS, 2):>9} "
            f"{_fmt(s.pct('tpot_s', 0.99) * MS, 2):>9} {s.hit_rate:>8.1%} {s.throughput:>9.0f} "
            f"{goodput(s, slo_ttft, slo_tpot):>7.1%} {_fmt(p50 / rr50, 2):>7} {_fmt(p99 / rr99, 2):>7} "
            f"{_fmt(p90 / ref90, 2):>7} {_fmt(p99 / ref99, 2):>7} {_busy(run):>9}"
        )
        if cross:
            row += f"  {_cross_rack(s, link_of):>11}"
        lines.append(row)
    for s in summaries:
        failed = Counter(f"HTTP {r.status}: {r.error[:90]}" for r in s.results if not r.ok)
        for what, count in failed.most_common(3):
            lines.append(f"  {s.name} failed {count}× — {what}")
    lines += ["", *_prediction_errors(runs), "", *_verdict(scn, runs, cold, tm)]
    return "\n".join(lines) + "\n"


def _prediction_errors(runs: list[Run]) -> list[str]:
    """Observed / predicted TTFT per request: pd-router's histogram, and the reference's own."""
    out = []
    for run in runs:
        if run.name in LEARNS or run.name == "pd-router-static":
            parts = []
            for measure, label in (("ttft", "TTFT"), ("cached_tokens", "cached tokens")):
                counts, bounds = run.ratios[measure].tolist(), run.ratio_bounds
                p10, p50, p90 = (
                    _ratio(histogram_quantile(counts, bounds, q), bounds) for q in (0.1, 0.5, 0.9)
                )
                parts.append(f"{label} p10 {p10}, p50 {p50}, p90 {p90} ({sum(counts)})")
            out.append(
                f"  {run.name}: observed / predicted {parts[0]}; {parts[1]} "
                "(pd_router_prediction_ratio's buckets)"
            )
        if run.reference is not None:
            predicted = run.reference.predicted
            ratios = [
                r.ttft_s / predicted[r.request_id]
                for r in run.summary.ok
                if predicted.get(r.request_id, 0.0) > 0
            ]
            q10, q50, q90 = (percentile(ratios, q) for q in (0.1, 0.5, 0.9))
            p50, p99 = (percentile(run.reference.pick_s, q) for q in (0.5, 0.99))
            out.append(
                f"  reference: observed (client) / predicted TTFT p10 {q10:.2f}, p50 {q50:.2f}, "
                f"p90 {q90:.2f} ({len(ratios)}); its pick takes p50 {p50 * MS:.2f} ms, "
                f"p99 {p99 * MS:.2f} ms (blocking the loop)"
            )
    return out


def _verdict(scn: Scenario, runs: list[Run], cold: float, tm: TimeModel) -> list[str]:
    by = {r.name: r.summary for r in runs}
    out = []
    pd = by.get("pd-router")
    rr = by.get("round-robin")
    if pd is None:
        return out
    p50 = pd.pct("ttft_s", 0.5)
    slo = (scn.goodput_ttft_s / tm.speed, scn.goodput_tpot_s / tm.speed)
    if rr is not None and scn.key in ("a", "b"):
        rr50 = rr.pct("ttft_s", 0.5)
        load = rr50 / cold
        out.append(
            f"  load: round-robin p50 TTFT = {load:.1f} × cold unloaded TTFT "
            f"({'meets' if load >= 3.0 else 'BELOW'} the ≥ 3× load condition)"
        )
        ratio = p50 / rr50
        out.append(
            f"  target p50(pd-router) ≤ 0.5 × p50(round-robin): {ratio:.2f} × "
            f"-> {'PASS' if ratio <= 0.5 else 'FAIL'}"
        )
        ll = by.get("least-loaded")
        if ll is not None:
            a, b = pd.pct("ttft_s", 0.99), ll.pct("ttft_s", 0.99)
            out.append(
                f"  target p99(pd-router) ≤ p99(least-loaded): {a * MS:.1f} vs {b * MS:.1f} ms "
                f"-> {'PASS' if a <= b else 'FAIL'}"
            )
    ind = by.get("independent")
    if ind is not None:
        i50 = ind.pct("ttft_s", 0.5)
        gain = 1.0 - p50 / i50
        out.append(
            f"  target p50(pd-router) ≥ 30% lower than independent: {gain:.0%} lower "
            f"-> {'PASS' if gain >= 0.30 else 'FAIL'}"
        )
    ref = by.get("reference")
    if scn.key == "d" and ref is not None:
        r90 = pd.pct("ttft_s", 0.9) / ref.pct("ttft_s", 0.9)
        r99 = pd.pct("ttft_s", 0.99) / ref.pct("ttft_s", 0.99)
        good = goodput(pd, *slo)
        out.append(
            f"  target p90 and p99 TTFT ≤ 1.3 × the reference's: {r90:.2f} × and {r99:.2f} × "
            f"-> {'PASS' if max(r90, r99) <= 1.3 else 'FAIL'}"
        )
        out.append(f"  target goodput(pd-router) ≥ 99%: {good:.1%} -> {'PASS' if good >= 0.99 else 'FAIL'}")
    rigid_run = by.get("pd-router-rigid")
    if scn.key == "e" and rigid_run is not None:
        rigid, g = goodput(rigid_run, *slo), goodput(pd, *slo)
        out.append(
            f"  target goodput(pd-router, role-flexible) ≥ 90% where the role-rigid one is < 50%: "
            f"{g:.1%} vs {rigid:.1%} -> {'PASS' if g >= 0.90 and rigid < 0.50 else 'FAIL'}"
        )
    return out


def _maybe_png(path: str, results: dict[str, list[Summary]]) -> None:
    try:
        import matplotlib  # optional: the tables are the result

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return  # no matplotlib: the printed tables are the result
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (title, summaries) in zip(axes[0], results.items(), strict=True):
        names = [s.name for s in summaries]
        p50 = [s.pct("ttft_s", 0.5) * MS for s in summaries]
        p99 = [s.pct("ttft_s", 0.99) * MS for s in summaries]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], p50, width=0.4, label="TTFT p50")
        ax.bar([i + 0.2 for i in x], p99, width=0.4, label="TTFT p99")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=9)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


# -- main ------------------------------------------------------------------------------------------


async def main_async(args: argparse.Namespace) -> int:
    tm = TimeModel(speed=args.speed)
    results: dict[str, list[Summary]] = {}
    failed = 0
    for key in args.scenarios:
        scn = SCENARIOS[key]
        n = args.requests or scn.requests
        rates = [float(r) for r in args.sweep.split(",")] if args.sweep else [args.rate or scn.rate]
        if args.policies:
            policies = list(args.policies)  # as asked, on every scenario (each applies to any pool)
        else:
            policies = ["round-robin"] if args.sweep else list(scn.policies)
        if args.misconfigure != 1.0 and "pd-router" in policies and not args.sweep:
            policies.insert(policies.index("pd-router") + 1, "pd-router-learning")
            policies.insert(policies.index("pd-router-learning") + 1, "pd-router-static")
        started = time.perf_counter()
        unloaded = await unloaded_ttft(scn, tm, args.seed)
        for rate in rates:
            workload = scn.workload(n, rate, args.seed)
            if args.after_s and not any(item.at_s >= args.after_s for item in workload.items):
                sys.stderr.write(
                    f"routing.py: error: --after-s {args.after_s:g}: no request arrives that late\n"
                )
                return 2
            runs = []
            for policy in policies:
                t0 = time.perf_counter()
                run = await run_policy(
                    scn, policy, workload, tm, args.seed, args.run_timeout, args.misconfigure
                )
                summary = run.summary
                failed += len(summary.results) - len(summary.ok)  # a failure fails the run, warm-up or not
                if args.after_s:
                    summary.results = [r for r in summary.results if r.at_s >= args.after_s]
                sys.stderr.write(
                    f"  [{key}] {policy} @ {rate:g} req/s: {len(summary.ok)}/{len(summary.results)} ok, "
                    f"p50 TTFT {summary.pct('ttft_s', 0.5) * MS:.1f} ms, goodput "
                    f"{goodput(summary, scn.goodput_ttft_s / tm.speed, scn.goodput_tpot_s / tm.speed):.1%}, "
                    f"busy {_busy(run)} ({time.perf_counter() - t0:.0f} s)\n"
                )
                runs.append(run)
            link_of = {spec.name: spec.link for spec in scn.specs(tm)}
            sys.stdout.write(render(scn, tm, rate, runs, unloaded, link_of))
            sys.stdout.flush()
            results[f"{scn.title} @ {rate:g}/s"] = [r.summary for r in runs]
        sys.stderr.write(f"  [{key}] scenario took {time.perf_counter() - started:.0f} s\n")
    if args.png:
        _maybe_png(args.png, results)
    return 0 if failed == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.routing",
        description="Compare routing policies on the simulated cluster (same seeded workload, fresh "
        "cluster per policy). Prints one table per scenario.",
    )
    parser.add_argument(
        "--scenarios", default="abcde", help="which scenarios to run, e.g. 'ac' (default: abcde)"
    )
    parser.add_argument(
        "--policies",
        default="",
        help=f"comma-separated subset of {', '.join(POLICIES)} (default: each scenario's own; "
        "with --sweep: round-robin)",
    )
    parser.add_argument("--requests", type=int, default=0, help="requests per run (default: per scenario)")
    parser.add_argument("--rate", type=float, default=0.0, help="arrival rate req/s (default: per scenario)")
    parser.add_argument(
        "--sweep",
        default="",
        help="comma-separated rates: run round-robin (or --policies) at each (load search)",
    )
    parser.add_argument(
        "--speed", type=float, default=1.0, help="simulated-time speed-up (link costs scale alike)"
    )
    parser.add_argument(
        "--misconfigure",
        type=float,
        default=1.0,
        help="configure the engines as this × faster than they are (3: three times slower than "
        "written); adds pd-router-learning (signals.learn on) and pd-router-static (off)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--after-s",
        type=float,
        default=0.0,
        help="report only the requests that arrived this many seconds into the run or later (a "
        "warm-up left out of the percentiles and goodput; a failure anywhere still fails the run)",
    )
    parser.add_argument("--run-timeout", type=float, default=120.0, help="per-request client timeout, s")
    parser.add_argument("--png", default="", help="write a TTFT bar chart here (needs matplotlib)")
    args = parser.parse_args(argv)
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {sorted(unknown)}; choose from {sorted(SCENARIOS)}")
    if args.after_s < 0:
        parser.error(f"--after-s: at least 0, got {args.after_s:g}")
    args.policies = [p for p in args.policies.split(",") if p]
    bad = set(args.policies) - set(POLICIES)
    if bad:
        parser.error(f"unknown policy(ies) {sorted(bad)}; choose from {', '.join(POLICIES)}")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        import uvloop  # optional, as in the router CLI
    except ImportError:
        return asyncio.run(main_async(args))
    return uvloop.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
