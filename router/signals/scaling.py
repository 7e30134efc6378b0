"""Recommended replicas per role, planned ahead by the time a new replica needs to become ready.

Every tick (``signals.tick_ms``) ``PoolSignals`` refits the performance model (``perf.py``), hands
the picker the engine model it implies, and recomputes per role (prefill, decode):

* **demand**: prefill — uncached prompt tokens arriving per second (what the picker routed this
  tick) plus the queued backlog drained over ``backlog_drain_s``; decode — sequences in flight on
  the decode pods (scraped running + waiting, or ours when larger) and KV tokens resident.
* **forecast** over the horizon ``H`` = the ready time (``ready_time_s``, or the p90 of the gate's
  measured discovered → admitted times once there are some): ``level + max(0, trend) × H``, the
  level the mean of the last ``level_window_s`` and the trend a least-squares slope over the last
  ``trend_window_s``, at most ``max_growth`` × the level. Demand that is falling is never
  forecast down: scaling down waits for it to happen.
* **capacity per replica at the SLO**, from the fitted model: prefill — tokens per second at the
  utilisation ``ρ`` where an M/D/1 queue's wait plus the typical prefill meets the TTFT SLO
  (``ρ = 2h / (s + 2h)``, ``s`` the typical prefill, ``h = slo − s``; at most ``max_utilization``);
  decode — the batch at which the step time reaches the TPOT SLO with the pool's mean context,
  at most what fits in ``kv_target`` of a replica's KV.
* **desired** = ``ceil(forecast / capacity)`` within ``[min_replicas, max_replicas]``; while the
  role's load (``max(predicted, observed) / SLO``) is above 1 it is at least one more than now.
* **recommended** = the max of desired over the last ``scale_down_window_s`` (scale up at once,
  down only after the window: no flapping on periodic load). A scale-down from ``N`` to ``M`` is
  **refused** (the smallest safe count kept, the reason exported) when the consolidated load
  ``load × N / M`` would break the SLO (``slo``) or the KV in use would not fit in ``M``
  replicas at ``kv_target`` (``kv``).

Prefill and decode are computed independently: long prompts raise prefill demand only, long
outputs raise decode concurrency only. A ``prefill-decode`` pod counts in both roles; scale its
one workload on the larger of the two.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
from prometheus_client.core import GaugeMetricFamily, Metric

from router.pool import Pool
from router.signals.calibration import TokenCalibration
from router.signals.perf import PerformanceModel
from router.signals.pool import SaturationSettings, predicted_latency, stage_signals
from scorers.cost import CostModel

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class ScalingSettings:
    tick_s: float = 1.0
    ready_time_s: float = 480.0  # until measured: scheduling, image, weights, graph capture, gate
    scale_down_window_s: float = 300.0
    level_window_s: float = 10.0
    trend_window_s: float = 120.0
    max_growth: float = 3.0  # the forecast is at most this × the current level
    backlog_drain_s: float = 30.0
    max_utilization: float = 0.85
    kv_target: float = 0.8
    min_replicas: tuple[int, int] = (1, 1)  # prefill, decode
    max_replicas: tuple[int, int] = (64, 64)


@dataclass(frozen=True, slots=True)
class RoleState:
    """One role at one tick, as the recommender needs it."""

    current: int  # admitted replicas
    demand: float  # prefill: tokens/s; decode: sequences in flight
    capacity: float  # per replica at the SLO, in the same unit
    load: float | None  # max(predicted, observed) / SLO; None while unknown
    kv_used_tokens: float = 0.0
    kv_capacity_tokens: float = 0.0  # per replica


@dataclass(frozen=True, slots=True)
class Recommendation:
    role: str
    current: int
    desired: int
    recommended: int
    refused: str | None  # why a scale-down below ``recommended`` was refused: "slo" | "kv"
    forecast: float
    capacity: float
    horizon_s: float


class Trend:
    """A per-tick series: its recent level and its least-squares slope."""

    def __init__(self, settings: ScalingSettings) -> None:
        self.settings = settings
        self.points: deque[tuple[float, float]] = deque(maxlen=4096)

    def add(self, now: float, value: float) -> None:
        self.points.append((now, value))
        while self.points and self.points[0][0] < now - self.settings.trend_window_s:
            self.points.popleft()

    def forecast(self, now: float, horizon_s: float) -> float:
        if not self.points:
            return 0.0
        t, v = np.array(self.points).T
        recent = v[t >= now - self.settings.level_window_s]
        level = float(recent.mean()) if recent.size else float(v[-1])
        slope = 0.0
        if len(t) >= 3 and np.ptp(t) > 0:
            slope = max(0.0, float(np.polyfit(t - t[-1], v, 1)[0]))
        if level <= 0:
            return 0.0
        return min(level + slope * horizon_s, self.settings.max_growth * level)


class Recommender:
    """Pure: per-role states in, recommendations out; keeps the desired history for hysteresis."""

    def __init__(self, settings: ScalingSettings) -> None:
        self.settings = settings
        self.history: dict[str, deque[tuple[float, int]]] = {role: deque() for role in ROLES}

    def recommend(
        self, now: float, role: str, state: RoleState, forecast: float, horizon_s: float
    ) -> Recommendation:
        s = self.settings
        index = ROLES.index(role)
        low, high = s.min_replicas[index], s.max_replicas[index]
        desired = math.ceil(forecast / state.capacity - 1e-9) if state.capacity > 0 else state.current
        if state.load is not None and state.load > 1.0:
            desired = max(desired, state.current + 1)  # the SLO is broken now, whatever the model says
        desired = min(max(desired, low), high)
        history = self.history[role]
        if not history and s.scale_down_window_s > 0:
            # A fresh router holds what runs for one window before it scales anything down.
            history.append((now, state.current))
        history.append((now, desired))
        while history and history[0][0] < now - s.scale_down_window_s:
            history.popleft()
        stabilised = max(d for _, d in history)
        recommended, refused = stabilised, None
        if stabilised < state.current:
            recommended, refused = self._safe_scale_down(state, stabilised)
        return Recommendation(
            role, state.current, desired, recommended, refused, forecast, state.capacity, horizon_s
        )

    def _safe_scale_down(self, state: RoleState, target: int) -> tuple[int, str | None]:
        """The smallest count from ``target`` up that keeps the SLO and the KV (and why a smaller
        one was refused)."""
        n = state.current
        for m in range(target, n):
            if self._breaks(state, n, m) is None:
                return m, None if m == target else self._breaks(state, n, target)
        return n, self._breaks(state, n, target)

    def _breaks(self, state: RoleState, n: int, m: int) -> str | None:
        if m == 0:  # scale to zero: only with nothing to serve
            return "slo" if state.demand > 0 else None
        if state.load is not None and state.load * n / m >= 1.0:
            return "slo"
        if (
            state.kv_capacity_tokens > 0
            and state.kv_used_tokens > m * state.kv_capacity_tokens * self.settings.kv_target
        ):
            return "kv"
        return None


def prefill_capacity(perf: PerformanceModel, typical_tokens: float, ttft_slo_s: float, cap: float) -> float:
    """Tokens per second one prefill replica serves while a typical prompt meets the TTFT SLO."""
    base, per_token = perf.prefill.coefficients
    service = base + per_token * typical_tokens
    headroom = ttft_slo_s - service
    rho = 2.0 * headroom / (service + 2.0 * headroom) if headroom > 0 else 0.1
    return min(rho, cap) * typical_tokens / service


def decode_capacity(
    perf: PerformanceModel, context_tokens: float, tpot_slo_s: float, kv_tokens: float, kv_target: float
) -> float:
    """Sequences one decode replica runs at the TPOT SLO with this mean context, KV permitting."""
    base, per_seq, per_kv = perf.decode.coefficients
    per_sequence = per_seq + per_kv * context_tokens
    batch = (tpot_slo_s - base) / per_sequence if per_sequence > 0 else math.inf
    if kv_tokens > 0 and context_tokens > 0:
        batch = min(batch, kv_tokens * kv_target / context_tokens)
    return max(batch, 1.0)


class DemandMeter:
    """What the flow tells the signals: fed on the request path with plain additions."""

    __slots__ = ("prefill_tokens", "requests", "typical_uncached")

    def __init__(self) -> None:
        self.prefill_tokens = 0.0  # uncached prompt tokens routed, ever
        self.requests = 0
        self.typical_uncached: float | None = None  # a moving average per request

    def arrived(self, uncached_tokens: float) -> None:
        self.prefill_tokens += uncached_tokens
        self.requests += 1
        typical = self.typical_uncached
        self.typical_uncached = (
            uncached_tokens if typical is None else typical + 0.02 * (uncached_tokens - typical)
        )


class PoolSignals:
    """The tick: refit the model, re-price the picker, recommend replicas per role."""

    def __init__(
        self,
        pool: Pool,
        perf: PerformanceModel,
        cost_model: Callable[[], CostModel],
        reprice: Callable[[CostModel], None],
        settings: ScalingSettings = ScalingSettings(),
        *,
        ready_times: Callable[[], Sequence[float]] = tuple,
        typical_max_tokens: int = 256,
        block_tokens: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``cost_model`` reads the picker's current cost model, ``reprice`` hands it the one each
        accepted fit implies; ``ready_times``: the gate's recent discovered → admitted durations."""
        self.pool = pool
        self.perf = perf
        self.current_cost_model = cost_model
        self.reprice = reprice
        self.settings = settings
        self.ready_times = ready_times
        self.typical_max_tokens = typical_max_tokens
        self.block_tokens = block_tokens
        self.clock = clock
        self.demand = DemandMeter()
        self.tokens = TokenCalibration()
        self.recommender = Recommender(settings)
        self.trends = {role: Trend(settings) for role in ROLES}
        self.latest: dict[str, Recommendation] = {}
        # (time, prefill tokens routed so far) per tick, over the level window: the arrival rate.
        self._arrived: deque[tuple[float, float]] = deque()

    @property
    def cost_model(self) -> CostModel:
        return self.current_cost_model()

    def horizon_s(self) -> float:
        measured = list(self.ready_times())
        return float(np.quantile(measured, 0.9)) if measured else self.settings.ready_time_s

    def tick(self) -> dict[str, Recommendation]:
        now = self.clock()
        if self.perf.refit() and self.perf.settings.learn:
            self.reprice(replace(self.cost_model, model=self.perf.engine_model()))
        horizon = self.horizon_s()
        states = {"prefill": self._prefill_state(now), "decode": self._decode_state(now)}
        out = {}
        for role, (state, value) in states.items():
            self.trends[role].add(now, value)
            forecast = max(self.trends[role].forecast(now, horizon), value)
            out[role] = self.recommender.recommend(now, role, state, forecast, horizon)
        self.latest = out
        return out

    def _role_slots(self, role: str) -> np.ndarray:
        pool = self.pool
        mask = pool.can_prefill if role == "prefill" else pool.can_decode
        return np.flatnonzero(pool.in_use & pool.admitted & ~pool.ejected & mask)

    def _replicas(self, slots: np.ndarray) -> int:
        groups = {
            endpoint.group for slot in slots.tolist() if (endpoint := self.pool.by_slot[slot]) is not None
        }
        return len(groups)

    def load(self, role: str, now: float | None = None) -> float | None:
        """``max(predicted, observed) / SLO``: TTFT for prefill, TPOT for decode; None while
        neither is known."""
        now = self.clock() if now is None else now
        o = self.cost_model.objectives
        stage = "prefill" if role == "prefill" else "decode"
        predicted = predicted_latency(
            self.pool, self.cost_model, stage, self.typical_max_tokens, self.block_tokens, now
        )
        observed = (self.perf.ttft if role == "prefill" else self.perf.tpot).p90(now)
        known = [v for v in (predicted, observed) if v is not None]
        if not known:
            return None
        return max(known) / (o.ttft_slo_s if role == "prefill" else o.tpot_slo_s)

    def _prefill_state(self, now: float) -> tuple[RoleState, float]:
        pool = self.pool
        slots = self._role_slots("prefill")
        rate = self._arrival_rate(now, self.demand.prefill_tokens)
        queued = stage_signals(pool, "prefill", SaturationSettings(), now).queued_prompt_tokens
        demand = rate + queued / self.settings.backlog_drain_s
        typical = self.demand.typical_uncached
        capacity = prefill_capacity(
            self.perf,
            pool.typical_prompt_tokens if typical is None else max(typical, 1.0),
            self.cost_model.objectives.ttft_slo_s,
            self.settings.max_utilization,
        )
        state = RoleState(self._replicas(slots), demand, capacity, self.load("prefill", now))
        return state, demand

    def _arrival_rate(self, now: float, tokens: float) -> float:
        """Tokens per second over the last ``level_window_s`` (a burst inside one tick is spread
        over the window, not read as its instantaneous rate)."""
        arrived = self._arrived
        arrived.append((now, tokens))
        window = self.settings.level_window_s
        while len(arrived) > 1 and arrived[1][0] <= now - window:
            arrived.popleft()
        return (tokens - arrived[0][1]) / window

    def _decode_state(self, now: float) -> tuple[RoleState, float]:
        pool = self.pool
        slots = self._role_slots("decode")
        scraped = np.nan_to_num(pool.running[slots]) + np.nan_to_num(pool.waiting[slots])
        sequences = float(np.maximum(scraped, pool.inflight_requests[slots]).sum())
        capacity_tokens = pool.kv_capacity_tokens[slots]
        used = np.fmax(np.nan_to_num(pool.kv_usage[slots]) * capacity_tokens, pool.reserved_kv_tokens[slots])
        used_tokens = float(np.nansum(used))
        known = capacity_tokens[np.isfinite(capacity_tokens)]
        per_replica_kv = float(known.mean()) if known.size else 0.0
        context = (
            used_tokens / sequences
            if sequences >= 1
            else pool.typical_prompt_tokens + self.typical_max_tokens / 2
        )
        capacity = decode_capacity(
            self.perf, context, self.cost_model.objectives.tpot_slo_s, per_replica_kv, self.settings.kv_target
        )
        state = RoleState(
            self._replicas(slots), sequences, capacity, self.load("decode", now), used_tokens, per_replica_kv
        )
        return state, sequences

    async def run(self) -> None:
        """Tick until cancelled."""
        while True:
            try:
                self.tick()
            except Exception:  # a bug here must not stop the signals for good
                log.exception("signals tick failed")
            await asyncio.sleep(self.settings.tick_s)

    # Export -------------------------------------------------------------------------------------

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self.perf.collect()
        now = self.clock()
        observed = GaugeMetricFamily(
            "pd_router_pool_observed_seconds",
            "p90 over the observation window of the TTFT (prefill) and TPOT (decode) streamed answers saw.",
            labels=["role", "measure"],
        )
        for role, measure, recent in (
            ("prefill", "ttft", self.perf.ttft),
            ("decode", "tpot", self.perf.tpot),
        ):
            value = recent.p90(now)
            if value is not None:
                observed.add_metric([role, measure], value)
        yield observed
        load = GaugeMetricFamily(
            "pd_router_pool_load",
            "max(predicted, observed) latency over its SLO per role: TTFT for prefill, TPOT for decode.",
            labels=["role"],
        )
        for role in ROLES:
            value = self.load(role, now)
            if value is not None:
                load.add_metric([role], value)
        yield load
        families = {
            "pd_router_recommended_replicas": (
                "Replicas per role the pool needs over the ready-time horizon, after hysteresis and "
                "refused scale-downs (scale on this).",
                "recommended",
            ),
            "pd_router_desired_replicas": ("This tick's need per role, before hysteresis.", "desired"),
            "pd_router_current_replicas": ("Admitted replicas (groups) per role.", "current"),
            "pd_router_demand_forecast": (
                "Demand forecast over the horizon: prefill tokens/s, decode sequences in flight.",
                "forecast",
            ),
            "pd_router_replica_capacity": (
                "What one replica serves at the SLO, in the demand's unit.",
                "capacity",
            ),
        }
        for name, (doc, attr) in families.items():
            family = GaugeMetricFamily(name, doc, labels=["role"])
            for role, rec in self.latest.items():
                family.add_metric([role], float(getattr(rec, attr)))
            yield family
        refused = GaugeMetricFamily(
            "pd_router_scale_down_refused",
            "1 while a scale-down is refused, by reason: slo (consolidated load would break it) or kv.",
            labels=["role", "reason"],
        )
        for role, rec in self.latest.items():
            for reason in ("slo", "kv"):
                refused.add_metric([role, reason], float(rec.refused == reason))
        yield refused
        yield GaugeMetricFamily(
            "pd_router_scaling_horizon_seconds",
            "The ready time the recommendation plans over (configured, or measured by the gate).",
            value=self.horizon_s(),
        )
