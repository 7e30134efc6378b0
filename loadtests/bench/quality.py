"""Routing quality in virtual time: the same numbers on every machine and every run.

The routing benchmark (``loadtests.bench.routing``) runs real HTTP against engines that sleep in
wall-clock time, so its numbers move with the machine. This one runs the same scenarios
(``loadtests.bench.scenarios``) with the same simulated engines (``SimEngine``'s batching,
prefix cache, KV limit and transfers) and the same router code — ``App`` (the ready gate, the
scrape loop parsing each engine's own ``/metrics`` text at the configured interval, the signals
tick that refits the performance model), and the proxy's own ``completions`` handler driving
``RequestFlow``/``Flight`` (parse, pick with its reservation, the prefill leg, the decode leg
streamed through the ``ResponseMeter``, close and learning) — but everything in one process on a
virtual clock (``simulator.virtual_clock``): no socket (``simulator.local_net``), no
thread, time advanced from event to event. Each proxy → engine leg takes ``--hop-ms`` (1 ms, what
the wall-clock benchmark measured on loopback); the router's own CPU time is not simulated (a
pick is instantaneous), nor is the engines' (HTTP framing, JSON).

Per scenario and policy: TTFT p50/p90/p99, TPOT p50/p99, goodput (TTFT ≤ 1 s and TPOT ≤ 20 ms)
and the ratios to least-loaded and to the full-information reference (``routing.ReferencePicker``,
run in-process as in the wall-clock benchmark). Every policy gets the same seeded workload on a
fresh cluster with a fresh clock.

    python -m loadtests.bench.quality                          # b, d, e: RR, LL, pd-router, reference
    python -m loadtests.bench.quality --scenarios abcde --no-reference
    python -m loadtests.bench.quality --variant learn-on=signals.learn=true \\
        --variant flex=picker.prefill_may_decode=true
    python -m loadtests.bench.quality --json out.json           # the numbers, for a baseline
    python -m loadtests.bench.quality --router-tree /tmp/old    # pd-router of another checkout
    python -m loadtests.bench.quality --matrix                  # pool sizes × loads × request mixes

``--router-tree PATH`` runs the router (``router``, ``scorers``, ``kvindex``) of another checkout
with this checkout's simulator and scenarios, in a subprocess whose import path puts PATH's
packages first (an editable install's finder is removed, so nothing of this checkout fills the
gaps; only ``kvindex.hashing``, which the simulator keys its cache with, is this checkout's, after
checking it keys text as the tree's does). Trees with ``router.flow.flight`` (the ``RequestFlow`` proxy)
and older trees with ``router.proxy.Proxy(config, pool, picker, exchange, metrics, ready,
prepare)`` both run; settings the older configuration does not know are dropped (and listed), and
only pd-router and its variants run there (the baselines are this checkout's: compare with its
numbers, or the digests in ``--json``: equal digests, request-for-request identical runs).

``--matrix`` generates scenarios (``scenarios.matrix_scenario``): pools of 4–64 prefill-decode pods
(or split half prefill, half decode), Poisson load at 0.5–1.5× a nominal capacity (every shared
prefix cached where it is computed, decode batches full), request mixes ``chat`` (long shared
system prompt, short answers), ``rag`` (long shared documents, very short answers) and ``long``
(short prompts, long answers); one line per cell with each policy's ratios to least-loaded.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from loadtests.bench.scenarios import (
    HOP_S,
    MIXES,
    POLICIES,
    SCENARIOS,
    Scenario,
    config_data,
    goodput,
    matrix_scenario,
    router_links,
    scaled_links,
    with_goodput_slo,
    with_slow_pods,
)
from simulator.cluster import link_cost_from
from simulator.engine import SimCluster, TimeModel
from simulator.local_net import LocalClient, LocalSession
from simulator.virtual_clock import run_virtual
from simulator.workloads.client import Result, StreamTally, Summary, percentile
from simulator.workloads.generate import Workload

MS = 1000.0
DEFAULT_SCENARIOS = "bde"
BASELINES = ("round-robin", "least-loaded")
JOINT = "pd-router"
REFERENCE = "reference"
# A diagnostic, not a policy to deploy: pd-router's defaults with each engine's true prefix cache
# at pick time in place of the router's index (how much a perfect index would be worth).
TRUE_CACHE = "pd-router-true-cache"
# The virtual run serves no listener: the handler is called in-process.
VIRTUAL_OVERRIDES = ("proxy.enabled=false",)


@dataclass(frozen=True)
class Policy:
    """A row of the table: a ``picker`` section plus ``--set``-style overrides."""

    name: str
    picker: dict[str, Any]
    overrides: tuple[str, ...] = ()
    reference: bool = False
    true_cache: bool = False
    regret: bool = False  # price each of its picks with the reference (``routing.RegretTap``)
    # Send each request's conversation as ``x-session-id`` (``--session-ids``: the multi-turn
    # workloads know their sessions; a client that sends none is the default row).
    session_ids: bool = False


def blind_to_slos(pol: Policy) -> Policy:
    """``pol`` routing every request on its cost alone, whatever SLO it carries."""
    return dataclasses.replace(pol, overrides=(*pol.overrides, "slo.per_request=false"))


def policy(name: str, overrides: Sequence[str] = ()) -> Policy:
    """A named policy of ``scenarios.POLICIES`` (``reference``: the full-information picker), or a
    variant of pd-router's defaults when ``overrides`` are given."""
    if overrides:
        return Policy(name, dict(POLICIES[JOINT]), tuple(overrides))
    if name == TRUE_CACHE:
        return Policy(name, dict(POLICIES[JOINT]), true_cache=True)
    if name not in POLICIES:
        raise ValueError(
            f"unknown policy {name!r}; choose from {', '.join([*POLICIES, TRUE_CACHE])} or give a --variant"
        )
    return Policy(name, dict(POLICIES[name]), reference=name == REFERENCE)


@dataclass
class PolicyRun:
    """One policy on one scenario: every request's result and what the run cost."""

    scenario: str
    policy: str
    summary: Summary
    cpu_s: float  # CPU seconds of the whole run (process time, not virtual)
    sim_s: float  # virtual seconds from the first arrival to the last answer
    prefill_tokens_computed: int = 0
    lora_loads: int = 0  # adapters the engines loaded into a GPU slot
    pruned: tuple[str, ...] = ()  # settings the router under test does not know (older trees)
    calls: dict[str, int] = field(default_factory=dict)  # what the router sent the engines, by route
    observed: dict[str, int] = field(default_factory=dict)  # answers the performance model compared
    cross_link: int = 0  # pairs whose prefill and decode pods have different link labels
    predictions: list[PredictionError] = field(default_factory=list)  # the router's, where it has them
    regrets: list[float] = field(default_factory=list)  # seconds per pick, with ``--regret``

    def stats(self, scn: Scenario, tm: TimeModel) -> dict[str, Any]:
        s = self.summary
        return {
            "requests": len(s.results),
            "ok": len(s.ok),
            "ttft_p50_ms": s.pct("ttft_s", 0.5) * MS,
            "ttft_p90_ms": s.pct("ttft_s", 0.9) * MS,
            "ttft_p99_ms": s.pct("ttft_s", 0.99) * MS,
            "tpot_p50_ms": s.pct("tpot_s", 0.5) * MS,
            "tpot_p99_ms": s.pct("tpot_s", 0.99) * MS,
            "goodput": goodput(s, scn.goodput_ttft_s / tm.speed, scn.goodput_tpot_s / tm.speed),
            "hit_rate": s.hit_rate,
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "lora_loads": self.lora_loads,
            "cross_link_pairs": self.cross_link,
            "digest": self.digest(),
        }

    def per_request(self) -> list[tuple[str, bool, float, float, str, str]]:
        """``(request id, ok, TTFT, TPOT, decode pod, prefill pod)`` per request, by request id."""
        return sorted(
            (r.request_id, r.ok, r.ttft_s, r.tpot_s, r.decode, r.prefill) for r in self.summary.results
        )

    def digest(self) -> str:
        """A fingerprint of ``per_request`` (exact floats): equal digests, identical runs."""
        return hashlib.sha256(repr(self.per_request()).encode()).hexdigest()[:16]


# -- the router under test ---------------------------------------------------------------------


@dataclass(frozen=True)
class PredictionError:
    """One answered request: its decision's kind, the predicted and observed TTFT, and for a pair
    its two legs (predicted: the prefill pod's queue + compute; the transfer + what follows)."""

    kind: str  # pd-pair, local-prefill, single, whole-on-prefill
    predicted_s: float  # the router's predicted TTFT (its cost's prefill side: stall included)
    stall_s: float  # the interference term inside it: a cost to others, not a wait
    observed_s: float
    prefill_leg_predicted_s: float = math.nan
    prefill_leg_s: float = math.nan
    decode_leg_predicted_s: float = math.nan

    @classmethod
    def of(cls, decision: Any, observed_s: float, prefill_leg_s: float | None) -> PredictionError:
        b = decision.breakdown
        kind = decision.kind
        if decision.decode.role == "prefill":
            kind = "whole-on-prefill"
        leg = b.get("queue_s", 0.0) + b.get("prefill_s", 0.0)
        pair = decision.prefill is not None
        return cls(
            kind,
            b["ttft_s"],
            b.get("interference_s", 0.0),
            observed_s,
            leg if pair else math.nan,
            prefill_leg_s if pair and prefill_leg_s is not None else math.nan,
            # Everything after the prefill leg: transfer, what follows, any wait for D's queue.
            b["ttft_s"] - leg - b.get("interference_s", 0.0) if pair else math.nan,
        )


@dataclass
class RouterUnderTest:
    handler: Callable[[Any], Awaitable[Any]]  # the proxy's completions handler
    max_body_bytes: int
    api: str  # "flow" (RequestFlow proxy) or "legacy" (router.proxy.Proxy)
    pruned: tuple[str, ...] = ()
    app: Any = None
    predictions: list[PredictionError] = field(default_factory=list)
    regrets: list[float] = field(default_factory=list)  # seconds, with ``Policy.regret``

    def observed(self) -> dict[str, int]:
        """Answers the performance model compared with its predictions, per measure (TTFT, TPOT,
        ...), where the router has one."""
        ratios = getattr(getattr(getattr(parts_of(self.app), "scaling", None), "perf", None), "ratios", {})
        return {measure: int(counts.sum()) for measure, counts in ratios.items()}


def _flow_api() -> bool:
    """Whether the router under test has ``RequestFlow`` (trees before it drive ``router.proxy``)."""
    try:
        tree_module("router.flow.flight")
    except ModuleNotFoundError:
        return False
    return True


@contextlib.asynccontextmanager
async def open_router(
    data: dict[str, Any],
    overrides: Sequence[str],
    seed: int,
    session: LocalSession,
    cluster: SimCluster,
    *,
    reference: bool = False,
    true_cache: bool = False,
    regret: bool = False,
) -> AsyncIterator[RouterUnderTest]:
    """The router of whichever tree is importable, started as the service starts (``App``), its
    engine session answered in-process by ``session``."""
    app_module = tree_module("router.server.app")

    with mock.patch.object(app_module, "upstream_session", lambda: session):
        if _flow_api():
            async with _flow_router(
                app_module, data, overrides, seed, session, cluster, reference, regret
            ) as r:
                if true_cache:
                    _install_true_cache(parts_of(r.app).picker, cluster)
                yield r
        else:
            if true_cache or regret:
                raise UnsupportedTree("the true cache and --regret need the current picker")
            async with _legacy_router(app_module, data, overrides, seed, session, reference) as r:
                yield r


def _install_true_cache(picker: Any, cluster: SimCluster) -> None:
    """``picker`` reads each candidate engine's real cached prefix of the prompt (at pick time,
    in the picker's block size) instead of its own index."""

    def true_cached_blocks(request: Any, slots: np.ndarray) -> np.ndarray:
        block = request.block_tokens if request.block_tokens and request.precise_keys is None else None
        block = block or picker.settings.block_tokens
        out = np.zeros(len(slots), dtype=np.int32)
        for i, slot in enumerate(slots.tolist()):
            engine = cluster.engines[picker.pool.by_slot[slot].id]
            tokens, keys = engine.prompt_blocks(request.body)
            out[i] = int(engine.cached_prefix_tokens(keys, tokens) / block)
        return out

    picker._cached_blocks = true_cached_blocks


@contextlib.asynccontextmanager
async def _flow_router(
    app_module: Any,
    data: dict[str, Any],
    overrides: Sequence[str],
    seed: int,
    session: LocalSession,
    cluster: SimCluster,
    reference: bool,
    regret: bool = False,
) -> AsyncIterator[RouterUnderTest]:
    from router.adapters.openai import Proxy

    config_module = tree_module("router.server.config")
    PoolConfig, parse_config = config_module.PoolConfig, config_module.parse_config

    data = json.loads(json.dumps(data))
    pruned = tuple(prune_unknown(data, PoolConfig))  # an older tree may not know every section
    config = parse_config(data, [*VIRTUAL_OVERRIDES, *overrides])
    async with started_app(app_module, config, seed) as app:
        if reference:
            from loadtests.bench.routing import install_reference

            install_reference(app, cluster)
        proxy = Proxy(
            parts_of(app).flow, local_exchange(session, config.proxy), lambda: app.ready, debug_headers=True
        )
        router = RouterUnderTest(proxy.completions, proxy.max_body_bytes, "flow", pruned, app)
        if regret and not reference:
            from loadtests.bench.routing import install_regret

            router.regrets = install_regret(app, cluster).regrets
        with _tap_predictions(router.predictions):
            yield router


def local_exchange(session: LocalSession, cfg: Any) -> Any:
    """The tree's ``TwoLegExchange`` over the in-process network (which stands in for an aiohttp
    session): through ``SessionClient``, or given the session itself in a tree from before it."""
    from router.http.exchange import TwoLegExchange

    try:
        from router.http.upstream import SessionClient
    except ImportError:
        return TwoLegExchange(session, cfg.connect_timeout_s, cfg.request_timeout_s)  # type: ignore[arg-type]
    return TwoLegExchange(SessionClient(session, cfg.connect_timeout_s, cfg.request_timeout_s))  # type: ignore[arg-type]


@contextlib.contextmanager
def _tap_predictions(out: list[PredictionError]) -> Iterator[None]:
    """Each answered request's prediction against what happened, as learning sees it."""
    flow = tree_module("router.flow.flight")

    learn = getattr(getattr(flow, "Flight", None), "_learn", None)
    if learn is None:  # an older tree learns elsewhere: no predictions from it
        yield
        return

    def tapped(flight: Any, decision: Any) -> None:
        meter = flight.meter
        first = None if meter is None or not meter.streaming else meter.first_at
        if first is not None:
            out.append(PredictionError.of(decision, first - flight.picked_at, flight.prefill_leg_s))
        learn(flight, decision)

    with mock.patch.object(flow.Flight, "_learn", tapped):
        yield


@contextlib.asynccontextmanager
async def _legacy_router(
    app_module: Any,
    data: dict[str, Any],
    overrides: Sequence[str],
    seed: int,
    session: LocalSession,
    reference: bool,
) -> AsyncIterator[RouterUnderTest]:
    """A tree from before ``RequestFlow`` (e304d75 and its time): ``router.proxy.Proxy`` over the
    ``App``'s pool and picker."""
    config_module = tree_module("router.server.config")
    PoolConfig, parse_config = config_module.PoolConfig, config_module.parse_config
    try:
        from router.proxy import Proxy, TwoLegExchange
    except ImportError as exc:
        raise UnsupportedTree(f"neither router.flow.flight nor router.proxy.Proxy: {exc}") from None
    if reference:
        raise UnsupportedTree("the reference picker needs the current picker's extension points")
    if data.get("picker", {}).get("policy", "joint") != "joint":
        raise UnsupportedTree("baseline policies need picker.policy; run them from this checkout")
    data = json.loads(json.dumps(data))
    pruned = tuple(prune_unknown(data, PoolConfig))
    params = list(inspect.signature(Proxy).parameters)
    if params[:4] != ["config", "pool", "picker", "exchange"]:
        raise UnsupportedTree(f"router.proxy.Proxy{tuple(params)}: an interface this harness does not know")
    config = parse_config(data, [*VIRTUAL_OVERRIDES, *overrides])
    async with started_app(app_module, config, seed) as app:
        cfg = config.proxy
        exchange = TwoLegExchange(session, cfg.connect_timeout_s, cfg.request_timeout_s)
        prepare = app._prepare_hook() if hasattr(app, "_prepare_hook") else None
        proxy = Proxy(config, app.pool, app.picker, exchange, app.metrics, lambda: app.ready, prepare)
        proxy.debug_headers = True
        yield RouterUnderTest(proxy.completions, config.limits.max_body_bytes, "legacy", pruned, app)


# Where older trees kept the modules the harness drives (before router/ was packaged by stage).
_OLDER_LAYOUT = {
    "router.server.app": "router.app",
    "router.server.config": "router.config",
    "router.flow.flight": "router.flow",
    "router.server.compose": "router.compose",
}


def tree_module(name: str) -> Any:
    """The module ``name`` of the router under test, or where an older tree kept it."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        older = _OLDER_LAYOUT.get(name)
        if older is None or not name.startswith(str(exc.name)):
            raise
        return importlib.import_module(older)


def started_app(app_module: Any, config: Any, seed: int) -> Any:
    """The tree's ``App`` (an async context manager) as the tree builds it: from
    ``compose.build``'s parts, or from the configuration itself in older trees."""
    try:
        build = getattr(tree_module("router.server.compose"), "build", None)
    except ModuleNotFoundError:  # a tree from before compose.py (e304d75 and its time)
        build = None
    return app_module.App(config, seed=seed) if build is None else app_module.App(build(config, seed=seed))


def parts_of(app: Any) -> Any:
    """What the tree's ``App`` was built from (older trees' ``App`` held the parts itself)."""
    return getattr(app, "parts", app)


class UnsupportedTree(RuntimeError):
    """The router under test has an interface this harness cannot drive."""


def prune_unknown(data: dict[str, Any], model: Any, prefix: str = "") -> list[str]:
    """Drop the keys of ``data`` that the pydantic ``model`` has no field for (recursively, into
    nested models and lists of them); returns the dotted paths dropped."""
    dropped: list[str] = []
    fields = model.model_fields
    for key in list(data):
        if key not in fields:
            dropped.append(prefix + key)
            del data[key]
            continue
        annotation = fields[key].annotation
        args = getattr(annotation, "__args__", ())
        value = data[key]
        if isinstance(value, dict) and hasattr(annotation, "model_fields"):
            dropped += prune_unknown(value, annotation, f"{prefix}{key}.")
        elif isinstance(value, list) and args and hasattr(args[0], "model_fields"):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    dropped += prune_unknown(item, args[0], f"{prefix}{key}[{i}].")
    return sorted(set(dropped))


# -- one run -----------------------------------------------------------------------------------


async def _drive(
    router: RouterUnderTest, workload: Workload, name: str, session_ids: bool = False
) -> Summary:
    """The open-loop client: every item at its arrival time, through the proxy's handler."""
    import asyncio

    loop = asyncio.get_running_loop()
    summary = Summary(name)
    client = LocalClient(router.handler, client_max_size=router.max_body_bytes + 1)
    start = loop.time()

    async def one(index: int, item: Any) -> None:
        delay = item.at_s - (loop.time() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        tally = StreamTally(time.perf_counter())
        head: list[bytes] = []

        def on_data(data: bytes) -> None:
            if len(head) < 4:
                head.append(data)
            tally.feed(data, time.perf_counter())

        # As aiohttp's ``json=`` sends it (simulator.workloads.client.send), with a request id
        # of its own so the run does not depend on uuid4.
        raw = json.dumps(item.body).encode()
        headers = {"Content-Type": "application/json", "X-Request-Id": f"r{index:06d}", **item.headers}
        if session_ids:
            headers["X-Session-Id"] = f"s{item.session}"
        response = await client.call("POST", item.path, headers, raw, on_data)
        if response.status != 200:
            result = Result(False, response.status, error=b"".join(head)[:200].decode(errors="replace"))
            result.request_id = headers["X-Request-Id"]
        else:
            result = tally.result(response.status, response.headers)
            result.request_id = result.request_id or headers["X-Request-Id"]
        result.at_s = item.at_s
        result.tag = item.tag
        summary.results.append(result)

    await asyncio.gather(*(one(i, item) for i, item in enumerate(workload.items)))
    summary.wall_s = loop.time() - start
    return summary


async def _run(
    scn: Scenario, pol: Policy, workload: Workload, tm: TimeModel, seed: int, hop_s: float
) -> PolicyRun:
    LinksConfig = tree_module("router.server.config").LinksConfig

    physical, links = scaled_links(scn.links, tm.speed), router_links(scn, tm.speed)
    link_cost = link_cost_from(LinksConfig.model_validate(physical)) if physical else None
    async with SimCluster(scn.specs(tm), link_cost, in_process=True) as cluster:
        session = LocalSession(cluster, hop_s=hop_s)
        endpoints = [
            (name, cluster.address(name), e.spec.role, e.spec.link) for name, e in cluster.engines.items()
        ]
        data = config_data(endpoints, tm, links, pol.picker)
        if scn.configure is not None:
            scn.configure(data, tm)
        async with open_router(
            data,
            pol.overrides,
            seed,
            session,
            cluster,
            reference=pol.reference,
            true_cache=pol.true_cache,
            regret=pol.regret,
        ) as router:
            summary = await _drive(router, workload, pol.name, pol.session_ids)
            observed = router.observed()
            predictions = list(router.predictions)
            regrets = list(router.regrets)
        computed = sum(engine.stats.prefill_tokens_computed for engine in cluster.engines.values())
        loads = sum(engine.stats.lora_loads for engine in cluster.engines.values())
        link = {name: engine.spec.link for name, engine in cluster.engines.items()}
    run = PolicyRun(scn.key, pol.name, summary, 0.0, summary.wall_s, pruned=router.pruned)
    run.cross_link = sum(1 for r in summary.ok if r.prefill and link.get(r.prefill) != link.get(r.decode))
    run.predictions = predictions
    run.regrets = regrets
    run.calls = dict(session.calls)
    run.observed = observed
    run.prefill_tokens_computed = computed
    run.lora_loads = loads
    return run


def run_policy(
    scn: Scenario,
    pol: Policy,
    *,
    requests: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    hop_s: float = HOP_S,
    tm: TimeModel | None = None,
    workload: Workload | None = None,
) -> PolicyRun:
    """One policy on one scenario, on a fresh cluster in a fresh virtual loop (synchronous: it runs
    its own event loop). ``workload``: the scenario's own for these ``requests``, ``rate`` and
    ``seed`` when not given (pass it to share one between policies)."""
    tm = tm or TimeModel()
    if workload is None:
        workload = scn.workload(requests or scn.requests, rate or scn.rate, seed)
    cpu = time.process_time()
    run = run_virtual(_run(scn, pol, workload, tm, seed, hop_s), seed=seed)
    run.cpu_s = time.process_time() - cpu
    return run


# -- the table ---------------------------------------------------------------------------------


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if value != value or math.isinf(value) else f"{value:.{digits}f}"


def _ratio(a: float, b: float) -> str:
    return "-" if not (a == a and b == b) or b == 0 else f"{a / b:.2f}"


def render(scn: Scenario, runs: Sequence[PolicyRun], tm: TimeModel, requests: int, rate: float) -> str:
    stats = {run.policy: run.stats(scn, tm) for run in runs}
    ll = stats.get("least-loaded", {})
    ref = stats.get(REFERENCE, {})
    slo_ttft, slo_tpot = scn.goodput_ttft_s / tm.speed * MS, scn.goodput_tpot_s / tm.speed * MS
    lines = [
        "",
        f"{scn.title} — {requests} requests at {rate:g} req/s{' base' if scn.key == 'd' else ''}, "
        f"virtual time; goodput = TTFT ≤ {slo_ttft:g} ms and TPOT ≤ {slo_tpot:g} ms",
        f"  {scn.params}",
        "",
    ]
    width = max(18, *(len(run.policy) for run in runs))  # a variant's name may be longer
    header = (
        f"  {'policy':<{width}} {'ok':>9} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'TPOT p50':>9} {'p99':>7} "
        f"{'goodput':>7} {'p50/LL':>6} {'p90/LL':>6} {'p99/LL':>6} {'p90/ref':>7} {'p99/ref':>7} "
        f"{'hit':>5} {'x-link':>6} {'sim s':>6} {'CPU s':>6}"
    )
    lines += [header, "  " + "-" * (len(header) - 2)]
    for run in runs:
        s = stats[run.policy]
        lines.append(
            f"  {run.policy:<{width}} {int(s['ok']):>4}/{int(s['requests']):<4} {_fmt(s['ttft_p50_ms']):>9} "
            f"{_fmt(s['ttft_p90_ms']):>8} {_fmt(s['ttft_p99_ms']):>8} {_fmt(s['tpot_p50_ms'], 2):>9} "
            f"{_fmt(s['tpot_p99_ms'], 2):>7} {s['goodput']:>7.1%} "
            f"{_ratio(s['ttft_p50_ms'], ll.get('ttft_p50_ms', math.nan)):>6} "
            f"{_ratio(s['ttft_p90_ms'], ll.get('ttft_p90_ms', math.nan)):>6} "
            f"{_ratio(s['ttft_p99_ms'], ll.get('ttft_p99_ms', math.nan)):>6} "
            f"{_ratio(s['ttft_p90_ms'], ref.get('ttft_p90_ms', math.nan)):>7} "
            f"{_ratio(s['ttft_p99_ms'], ref.get('ttft_p99_ms', math.nan)):>7} "
            f"{s['hit_rate']:>5.0%} {s['cross_link_pairs']:>6} {run.sim_s:>6.1f} {run.cpu_s:>6.1f}"
        )
    if any(run.lora_loads for run in runs):
        lines.append("  LoRA adapter loads: " + ", ".join(f"{run.policy} {run.lora_loads}" for run in runs))
    lines += render_slo_attainment(scn, runs, tm)
    lines += render_prediction_errors(runs)
    lines += render_regrets(runs)
    for run in runs:
        failed = [r for r in run.summary.results if not r.ok]
        if failed:
            lines.append(
                f"  {run.policy} failed {len(failed)}×, first: HTTP {failed[0].status} {failed[0].error}"
            )
        if run.pruned:
            lines.append(f"  {run.policy}: this router does not know {', '.join(run.pruned)} (dropped)")
    return "\n".join(lines) + "\n"


def slo_attainment(scn: Scenario, run: PolicyRun, tm: TimeModel) -> dict[str, tuple[float, int, int]]:
    """Per SLO class (and ``all``): (share of its requests answered within both objectives,
    requests, refused by the router). A refused or failed request missed its SLO."""
    out: dict[str, tuple[float, int, int]] = {}
    met_all = n_all = refused_all = 0
    for tag, (ttft_s, tpot_s) in scn.slo_classes.items():
        results = [r for r in run.summary.results if r.tag == tag]
        met = sum(
            1
            for r in results
            if r.ok and r.ttft_s <= ttft_s / tm.speed and not r.tpot_s > tpot_s / tm.speed  # NaN: one token
        )
        refused = sum(1 for r in results if r.status in (429, 503))
        out[tag] = (met / len(results) if results else math.nan, len(results), refused)
        met_all, n_all, refused_all = met_all + met, n_all + len(results), refused_all + refused
    out["all"] = (met_all / n_all if n_all else math.nan, n_all, refused_all)
    return out


def render_slo_attainment(scn: Scenario, runs: Sequence[PolicyRun], tm: TimeModel) -> list[str]:
    """With SLO classes: each policy's attainment per class (refused requests count as missed)."""
    if not scn.slo_classes:
        return []
    classes = [*scn.slo_classes, "all"]
    width = max(18, *(len(run.policy) for run in runs))
    header = f"  {'SLO attainment':<{width}} " + " ".join(f"{c:>22}" for c in classes)
    lines = ["", header, "  " + "-" * (len(header) - 2)]
    for run in runs:
        cells = slo_attainment(scn, run, tm)
        lines.append(
            f"  {run.policy:<{width}} "
            + " ".join(f"{cells[c][0]:>7.1%} of {cells[c][1]:>4} ({cells[c][2]:>3} refused)" for c in classes)
        )
    return lines


def render_regrets(runs: Sequence[PolicyRun]) -> list[str]:
    """With ``--regret``: each policy's picks against the reference's in the same state."""
    rows = [(run.policy, run.regrets) for run in runs if run.regrets]
    if not rows:
        return []
    width = max(18, *(len(name) for name, _ in rows))
    header = (
        f"  {'regret at the pick':<{width}} {'picks':>6} {'p50 ms':>7} {'p90':>7} {'p99':>7} "
        f"{'> 20 ms':>7} {'sum s':>7}"
    )
    lines = ["", header, "  " + "-" * (len(header) - 2)]
    for name, regrets in rows:
        p50, p90, p99 = (percentile(regrets, q) * MS for q in (0.5, 0.9, 0.99))
        late = sum(1 for r in regrets if r > 0.020) / len(regrets)
        lines.append(
            f"  {name:<{width}} {len(regrets):>6} {p50:>7.1f} {p90:>7.1f} {p99:>7.1f} {late:>7.1%} "
            f"{sum(regrets):>7.2f}"
        )
    return lines


def render_prediction_errors(runs: Sequence[PolicyRun]) -> list[str]:
    """Observed ÷ predicted per decision kind (median and p90): TTFT as predicted, TTFT without the
    stall term (which prices others' delay, not this request's), and a pair's two legs."""
    rows = [(run.policy, run.predictions) for run in runs if run.predictions]
    if not rows:
        return []
    width = max(18, *(len(name) for name, _ in rows))
    head = (
        f"  {'prediction error':<{width}} {'kind':<17} {'n':>5} {'TTFT obs/pred p50':>17} {'p90':>5} "
        f"{'w/o stall p50':>13} {'p90':>5} {'P leg p50':>9} {'D leg p50':>9}"
    )
    lines = ["", head, "  " + "-" * (len(head) - 2)]

    def ratios(pairs: Iterable[tuple[float, float]]) -> list[float]:
        return sorted(o / p for o, p in pairs if p > 0 and o == o and p == p)

    def q(values: list[float], at: float) -> str:
        return _fmt(percentile(values, at), 2) if values else "-"

    for policy_name, predictions in rows:
        for kind in ("pd-pair", "local-prefill", "single", "whole-on-prefill"):
            mine = [p for p in predictions if p.kind == kind]
            if not mine:
                continue
            ttft = ratios((p.observed_s, p.predicted_s) for p in mine)
            bare = ratios((p.observed_s, p.predicted_s - p.stall_s) for p in mine)
            p_leg = ratios((p.prefill_leg_s, p.prefill_leg_predicted_s) for p in mine)
            d_leg = ratios((p.observed_s - p.prefill_leg_s, p.decode_leg_predicted_s) for p in mine)
            lines.append(
                f"  {policy_name:<{width}} {kind:<17} {len(mine):>5} {q(ttft, 0.5):>17} {q(ttft, 0.9):>5} "
                f"{q(bare, 0.5):>13} {q(bare, 0.9):>5} {q(p_leg, 0.5):>9} {q(d_leg, 0.5):>9}"
            )
    return lines


# -- command line ------------------------------------------------------------------------------


def _variants(raw: Sequence[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in raw:
        name, sep, sets = item.partition("=")
        if not sep or not name or "=" not in sets:
            raise ValueError(f"--variant {item!r}: expected NAME=dotted.key=value[,dotted.key=value...]")
        out.setdefault(name, []).extend(s for s in sets.split(",") if s)
    return out


_TREE_PACKAGES = ("router", "kvindex", "scorers")


def _router_tree_env(tree: Path, work: Path) -> Path:
    """A directory whose ``router`` and ``kvindex`` (and ``scorers``, in trees from before the cost
    model moved into ``router/scheduling/``) are ``tree``'s and whose ``loadtests`` is this
    checkout's, with its ``simulator``: the import path of the subprocess."""
    here = Path(__file__).resolve().parents[2]
    for name in _TREE_PACKAGES:
        if not (tree / name / "__init__.py").exists():
            if name == "scorers":
                continue
            raise SystemExit(f"--router-tree {tree}: no {name}/ package there")
        (work / name).symlink_to(tree / name)
    for name in ("simulator", "loadtests"):
        (work / name).symlink_to(here / name)
    return work


# The subprocess of --router-tree: its imports pinned before anything imports the simulator.
_TREE_BOOT = """
import importlib, importlib.util, sys
from pathlib import Path

import numpy as np

tree, here = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
# An editable install's finder would supply the modules the tree lacks from this checkout.
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
for name in ("router", "kvindex", *(["scorers"] if (tree / "scorers").is_dir() else [])):
    where = Path(importlib.import_module(name).__file__).resolve()
    if tree not in where.parents:
        sys.exit(f"--router-tree: {name} was imported from {where}, not from {tree}")
# The simulator keys its prefix cache with this checkout's kvindex.hashing; the tree's router gets
# the same module, which must hash text exactly as the tree's own (it has only grown since e304d75).
theirs = importlib.import_module("kvindex.hashing")
spec = importlib.util.spec_from_file_location("kvindex.hashing", here / "kvindex" / "hashing.py")
ours = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ours)
sample = "the router and the simulator hash this prompt alike; " * 40
if not np.array_equal(theirs.text_block_keys(sample, 64), ours.text_block_keys(sample, 64)):
    sys.exit("--router-tree: the tree's kvindex.hashing keys text differently from this checkout's")
sys.modules["kvindex.hashing"] = ours
importlib.import_module("kvindex").hashing = ours
# Pure modules the simulator reads prompts with that an older tree's kvindex lacks: this checkout's.
for name in ("chat_messages",):
    if not (tree / "kvindex" / f"{name}.py").exists():
        spec = importlib.util.spec_from_file_location(f"kvindex.{name}", here / "kvindex" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"kvindex.{name}"] = module
        spec.loader.exec_module(module)
from loadtests.bench.quality import main

sys.exit(main(sys.argv[3:]))
"""


def _run_in_tree(args: argparse.Namespace, argv: Sequence[str]) -> int:
    tree = Path(args.router_tree).resolve()
    forwarded = [a for a in argv if not a.startswith("--router-tree")]
    if "--router-tree" in argv:  # "--router-tree PATH" as two words
        i = list(argv).index("--router-tree")
        forwarded = [*argv[:i], *argv[i + 2 :]]
    here = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="quality-tree-") as work:
        cwd = _router_tree_env(tree, Path(work))
        env = {**os.environ, "PYTHONPATH": str(cwd)}
        cmd = [sys.executable, "-c", _TREE_BOOT, str(tree), str(here), "--in-tree", str(tree), *forwarded]
        return subprocess.call(cmd, cwd=cwd, env=env)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.quality",
        description="Routing quality on the simulated cluster in virtual time: deterministic, seconds "
        "of CPU per scenario. Prints one table per scenario.",
    )
    parser.add_argument("--scenarios", default=DEFAULT_SCENARIOS, help=f"default: {DEFAULT_SCENARIOS}")
    parser.add_argument(
        "--policies",
        default="",
        help=f"comma-separated, of {', '.join([*POLICIES, TRUE_CACHE])} "
        f"(default: {','.join([*BASELINES, JOINT])} and the reference unless --no-reference; "
        "with --matrix: least-loaded,cache-aware,pd-router)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=KEY=VALUE[,KEY=VALUE]",
        help="a row of pd-router's defaults with these --set overrides (repeatable)",
    )
    parser.add_argument(
        "--session-ids",
        action="store_true",
        help="add a twin of every pd-router row (and variant), named '<row> +sid', whose client sends "
        "each conversation's x-session-id and whose router has sessions.enabled",
    )
    parser.add_argument("--no-reference", action="store_true", help="skip the full-information reference")
    parser.add_argument(
        "--regret",
        action="store_true",
        help="price every pick of every policy with the reference, in the state it was made in, and "
        "print each policy's regret (its route's true TTFT minus the best route's); slower",
    )
    parser.add_argument("--requests", type=int, default=0, help="requests per run (default: per scenario)")
    parser.add_argument("--rate", type=float, default=0.0, help="arrival rate, req/s (default: per scenario)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--seeds",
        default="",
        help="comma-separated seeds (instead of --seed): a table per seed, then one over every "
        "seed's requests pooled (one seed is one draw of a busy pool's arrivals)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel processes (default: 1)")
    parser.add_argument("--hop-ms", type=float, default=HOP_S * MS, help="proxy → engine hop (default: 1)")
    parser.add_argument(
        "--slow-pods",
        type=float,
        default=1.0,
        metavar="FACTOR",
        help="a mixed fleet: the second half of each role's pods FACTOR× slower, the router not told",
    )
    parser.add_argument("--json", default="", help="also write the numbers here (a baseline file)")
    parser.add_argument(
        "--router-tree",
        default="",
        help="run the router of this checkout (router/, scorers/, kvindex/) with this harness",
    )
    parser.add_argument("--in-tree", default="", help=argparse.SUPPRESS)  # set by --router-tree
    matrix = parser.add_argument_group("the matrix (instead of --scenarios; the reference is not run)")
    matrix.add_argument("--matrix", action="store_true", help="run generated scenarios over the grid below")
    matrix.add_argument(
        "--matrix-pools",
        default="4,16",
        help="pool sizes (default: %(default)s; 64 pods: ~1 CPU minute a run)",
    )
    matrix.add_argument(
        "--matrix-loads", default="0.5,0.8,1.0,1.2,1.5", help="× the nominal capacity (default: %(default)s)"
    )
    matrix.add_argument(
        "--matrix-mixes", default=",".join(MIXES), help="request mixes, of %(default)s (default: all)"
    )
    matrix.add_argument(
        "--matrix-shapes", default="pd", help="pd (prefill-decode pods) and/or split (half P, half D)"
    )
    matrix.add_argument("--matrix-seconds", type=float, default=8.0, help="seconds of arrivals per cell")
    matrix.add_argument(
        "--matrix-slo",
        action="store_true",
        help="every request carries the goodput's objectives (x-slo-* headers): pd-router's rows route "
        "and admit by them; the other policies, like the routers they stand for, read no SLO",
    )
    args = parser.parse_args(argv)
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {sorted(unknown)}; choose from {sorted(SCENARIOS)}")
    if args.slow_pods <= 0:
        parser.error(f"--slow-pods {args.slow_pods:g}: a factor > 0")
    try:
        variants = _variants(args.variant)
    except ValueError as exc:
        parser.error(str(exc))
    if args.router_tree:
        return _run_in_tree(args, argv)
    default = ["least-loaded", "cache-aware", JOINT] if args.matrix else [*BASELINES, JOINT]
    names = [p for p in args.policies.split(",") if p] or default
    legacy = not _flow_api()
    if legacy:
        skipped = [n for n in names if n != JOINT]
        names = [n for n in names if n == JOINT]
        sys.stderr.write(
            f"router of {args.in_tree or 'this path'}: before RequestFlow; runs pd-router and variants "
            f"only (skipped: {', '.join(skipped) or 'none'})\n"
        )
    elif not args.no_reference and not args.matrix and REFERENCE not in names:
        names.append(REFERENCE)
    try:
        policies = [policy(n) for n in names] + [policy(n, sets) for n, sets in variants.items()]
    except ValueError as exc:
        parser.error(str(exc))
    if args.regret:
        policies = [dataclasses.replace(p, regret=not p.reference) for p in policies]
    if args.session_ids:
        twins = [p for p in policies if p.picker == POLICIES[JOINT] and not p.reference and not p.true_cache]
        policies += [
            dataclasses.replace(
                p, name=f"{p.name} +sid", overrides=(*p.overrides, "sessions.enabled=true"), session_ids=True
            )
            for p in twins
        ]
    tm = TimeModel()
    command = shlex.join(["python", "-m", "loadtests.bench.quality", *argv])
    out: dict[str, Any] = {"command": command, "seed": args.seed, "hop_ms": args.hop_ms, "scenarios": {}}
    if args.matrix:
        try:
            cells = _matrix(args)
        except (KeyError, ValueError) as exc:
            parser.error(f"--matrix: {exc}")
        if args.matrix_slo:
            cells = [with_goodput_slo(cell) for cell in cells]
            policies = [p if p.picker == POLICIES[JOINT] else blind_to_slos(p) for p in policies]
        return _run_matrix(cells, policies, args, tm, out)
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x] or [args.seed]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: expected comma-separated integers")
    if len(seeds) > 1:
        out["seeds"] = seeds
    jobs = [(key, seed, pol) for key in args.scenarios for seed in seeds for pol in policies]
    done = _run_jobs(jobs, args, tm)
    for key in args.scenarios:
        scn = _scenario(key, args)
        n, rate = args.requests or scn.requests, args.rate or scn.rate
        for seed in seeds:
            runs = [done[key, seed, pol.name] for pol in policies]
            if len(seeds) > 1:
                sys.stdout.write(f"\nseed {seed}")
            sys.stdout.write(render(scn, runs, tm, n, rate))
        pooled = [pool_runs([done[key, seed, pol.name] for seed in seeds]) for pol in policies]
        if len(seeds) > 1:
            sys.stdout.write(f"\nseeds {','.join(map(str, seeds))} pooled ({len(seeds)} × {n} requests)")
            sys.stdout.write(render(scn, pooled, tm, n, rate))
        sys.stdout.flush()
        out["scenarios"][key] = {
            "requests": n,
            "rate": rate,
            "policies": {run.policy: _round(run.stats(scn, tm)) for run in pooled},
        }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    return 0


def pool_runs(runs: Sequence[PolicyRun]) -> PolicyRun:
    """One policy's runs over several seeds as one run: every request, percentiles over them all."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    results = [r for run in runs for r in run.summary.results]
    pooled = PolicyRun(
        first.scenario,
        first.policy,
        Summary(first.summary.name, results, sum(run.summary.wall_s for run in runs)),
        cpu_s=sum(run.cpu_s for run in runs),
        sim_s=sum(run.sim_s for run in runs),
        prefill_tokens_computed=sum(run.prefill_tokens_computed for run in runs),
        lora_loads=sum(run.lora_loads for run in runs),
        pruned=first.pruned,
        cross_link=sum(run.cross_link for run in runs),
        predictions=[p for run in runs for p in run.predictions],
        regrets=[r for run in runs for r in run.regrets],
    )
    return pooled


def _fleet(args: argparse.Namespace) -> str:
    """What the header says of the fleet (nothing for a uniform one)."""
    return "" if args.slow_pods == 1.0 else f"; half the pods {args.slow_pods:g}× slower, the router not told"


def _scenario(key: str, args: argparse.Namespace) -> Scenario:
    """Scenario ``key`` on the fleet the command line asks for."""
    scn = SCENARIOS[key]
    return scn if args.slow_pods == 1.0 else with_slow_pods(scn, args.slow_pods)


def _one_job(job: tuple[str, int, Policy], args: argparse.Namespace, tm: TimeModel) -> PolicyRun:
    key, seed, pol = job
    scn = _scenario(key, args)
    workload = scn.workload(args.requests or scn.requests, args.rate or scn.rate, seed)
    run = run_policy(scn, pol, seed=seed, hop_s=args.hop_ms / MS, tm=tm, workload=workload)
    sys.stderr.write(
        f"  [{key} seed {seed}] {pol.name}: p50 TTFT {run.summary.pct('ttft_s', 0.5) * MS:.1f} ms, "
        f"{run.cpu_s:.1f} CPU s for {run.sim_s:.1f} virtual s\n"
    )
    return run


def _run_jobs(
    jobs: Sequence[tuple[str, int, Policy]], args: argparse.Namespace, tm: TimeModel
) -> dict[tuple[str, int, str], PolicyRun]:
    """Every (scenario, seed, policy) run, in ``args.jobs`` processes (each run is deterministic
    and alone in its process's virtual loop, so parallel runs give the same numbers)."""
    if args.jobs <= 1 or len(jobs) == 1:
        runs = [_one_job(job, args, tm) for job in jobs]
    else:
        with concurrent.futures.ProcessPoolExecutor(args.jobs) as workers:
            runs = list(workers.map(_one_job, jobs, [args] * len(jobs), [tm] * len(jobs)))
    return {(key, seed, pol.name): run for (key, seed, pol), run in zip(jobs, runs, strict=True)}


def _matrix(args: argparse.Namespace) -> list[Scenario]:
    def floats(raw: str) -> list[float]:
        return [float(x) for x in raw.split(",") if x]

    cells = [
        matrix_scenario(shape, int(pods), MIXES[mix], load, args.matrix_seconds)
        for shape in args.matrix_shapes.split(",")
        for pods in floats(args.matrix_pools)
        for mix in args.matrix_mixes.split(",")
        for load in floats(args.matrix_loads)
    ]
    return cells if args.slow_pods == 1.0 else [with_slow_pods(cell, args.slow_pods) for cell in cells]


def _told(args: argparse.Namespace) -> str:
    if not args.matrix_slo:
        return ""
    return (
        "; every request carries the goodput's SLO (pd-router refuses what no route is predicted to "
        "meet; a refusal counts as a miss), the other policies route blind to it"
    )


def _run_matrix(
    cells: Sequence[Scenario], policies: Sequence[Policy], args: argparse.Namespace, tm: TimeModel, out: dict
) -> int:
    """One line per cell: each policy's TTFT p50/p90 and goodput, and its ratios to least-loaded."""
    names = [p.name for p in policies]
    head = f"  {'cell':<22} {'req':>6} {'req/s':>7}"
    for name in names:
        head += f" | {name[:18]:>18} p50 {'p90':>7} {'good':>5} {'p50/LL':>6} {'p90/LL':>6}"
    sys.stdout.write(
        f"\nMatrix: TTFT ms and goodput per policy; load × nominal capacity (every shared prefix cached "
        f"where it is computed, every decode batch full); {args.matrix_seconds:g} s of arrivals per "
        f"cell{_fleet(args)}{_told(args)}\n\n{head}\n  {'-' * (len(head) - 2)}\n"
    )
    for scn in cells:
        workload = scn.workload(scn.requests, scn.rate, args.seed)
        runs = {
            pol.name: run_policy(scn, pol, seed=args.seed, hop_s=args.hop_ms / MS, tm=tm, workload=workload)
            for pol in policies
        }
        stats = {name: run.stats(scn, tm) for name, run in runs.items()}
        ll = stats.get("least-loaded", {})
        line = f"  {scn.key:<22} {scn.requests:>6} {scn.rate:>7.1f}"
        for name in names:
            s = stats[name]
            line += (
                f" | {_fmt(s['ttft_p50_ms']):>22} {_fmt(s['ttft_p90_ms']):>7} {s['goodput']:>5.0%} "
                f"{_ratio(s['ttft_p50_ms'], ll.get('ttft_p50_ms', math.nan)):>6} "
                f"{_ratio(s['ttft_p90_ms'], ll.get('ttft_p90_ms', math.nan)):>6}"
            )
        cpu = sum(run.cpu_s for run in runs.values())
        failed = ", ".join(
            f"{n} {stats[n]['requests'] - stats[n]['ok']}"
            for n in names
            if stats[n]["ok"] < stats[n]["requests"]
        )
        sys.stdout.write(f"{line}   ({cpu:.0f} CPU s{'; failed or refused: ' + failed if failed else ''})\n")
        sys.stdout.flush()
        out["scenarios"][scn.key] = {
            "requests": scn.requests,
            "rate": scn.rate,
            "policies": {name: _round(s) for name, s in stats.items()},
        }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    return 0


def _round(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 3) if isinstance(v, float) and math.isfinite(v) else v) for k, v in stats.items()}


if __name__ == "__main__":
    sys.exit(main())
