"""Recommended replicas per role, planned ahead by the time a new replica needs to become ready.

Every tick (``signals.tick_ms``) ``PoolSignals`` refits the performance model (``perf.py``), hands
the picker the engine model it implies, and recomputes per role (prefill, decode):

* **demand**: prefill — uncached prompt tokens arriving per second: the request rate over
  ``level_window_s`` or the last ``min_rate_requests`` arrivals if that is longer (a few requests'
  Poisson noise is not a rate) times the mean uncached prompt of the last ``min_mix_requests``
  (fewer: a new mix shows within a few requests, the rate's noise stays out of it), plus the
  queued backlog spread over ``max(backlog_drain_s, H)`` (a replica asked for now helps only
  after the ready time); decode — the sequences past their prefill on the decode
  pods (scraped running + waiting, or ours past their prefill, ``decoding_requests``, when
  more), counted *at the TPOT SLO*: Little's law scales today's count by SLO / TPOT, so the
  demand is linear in the arrival rate whatever the pods' speed now; and at least what the
  arrivals will need (answer tokens asked for per second — the rate times the last
  ``min_mix_requests``' mean max_tokens — × the share answers use × the TPOT SLO), so a burst
  of long answers counts from its first requests.
* **forecast** over the horizon ``H`` = the ready time (``ready_time_s``, or the p90 of the gate's
  measured discovered → admitted times once there are some): each role's level (the mean of its
  last ``level_window_s`` of *replicas' worth*: each tick's demand over the capacity for that
  tick's own mix, so two mixes never meet in one division) × the growth of the *request rate*
  over ``H``. The request rate is the
  cause of both roles' demand: a longer prompt or answer mix is a new level, not a trend, and the
  in-flight count also rises while long answers accumulate after a step. The growth is
  ``1 + slope × H / rate`` (at most ``max_growth``) with the slope the smaller of the
  least-squares slopes over the two halves of ``trend_window_s``, each only when it is
  ``trend_significance`` standard errors above zero, and only once the window is full. The slope
  is fitted to the arrivals counted per tick (independent Poisson counts, whose noise is known),
  not to the smoothed rate: noise and single jumps are not extrapolated, sustained growth is.
  Demand that is falling is never forecast down: scaling down waits for it to happen.
* **capacity per replica at the SLO**, from the fitted model: prefill — tokens per second at the
  utilisation ``ρ`` where an M/D/1 queue's wait plus the prefill meets the TTFT SLO
  (``ρ = 2h / (s + 2h)``, ``s`` the prefill of the mean uncached prompt of the requests that make
  the rate, ``h = max(slo − s, s / 2)``: a prompt that nearly fills the SLO by itself waits at most
  half a service, so ``ρ`` never falls below 1/2 and never jumps; at most ``max_utilization``);
  decode — the batch at which the step time reaches the TPOT SLO with the pool's mean context; where
  ``kv_target`` of a replica's KV holds fewer, that batch's token rate counted at the SLO (its steps
  are faster than the SLO: ``batch × SLO / step``).
* **desired** = ``ceil(forecast / capacity)`` within ``[min_replicas, max_replicas]``; while the
  role's load (``max(predicted, observed) / SLO``) and its prediction alone (decode: the
  prediction and the observed TPOT, streams still running included) are above 1 it is at least
  one more than admitted — once what was asked for before is admitted (or the ready time
  passed) and the observed p90 has had its window to see it (no ratchet on one overload).
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
from prometheus_client.core import Metric

import router.observe.series as series
from router.scheduling.costmodel.matrix import CostModel
from router.signals.calibration import TokenCalibration
from router.signals.perf import PerformanceModel
from router.signals.saturation import SaturationSettings, predicted_latency, stage_signals
from router.signals.shared import Rates, SharedDemand
from router.signals.streams import LiveStreams
from router.state.pool import Pool

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
    # The trend is extrapolated only when its slope is this many standard errors above zero.
    trend_significance: float = 2.0
    # The arrival rate spans at least this many requests (Poisson noise ≈ 1/√n), up to
    # ``trend_window_s``, when ``level_window_s`` holds fewer.
    min_rate_requests: int = 32
    # What each request brings (uncached prompt, answer asked for) is averaged over at least this
    # many (up to ``trend_window_s``): a change of mix shows sooner than a change of rate can.
    min_mix_requests: int = 16
    backlog_drain_s: float = 30.0  # at the soonest: never faster than a new replica can help
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
    # What must also be over 1 before a broken SLO asks for a replica (``load`` is the larger of
    # the prediction and the observed p90); None while unknown. Prefill: the prediction for a
    # request arriving now (the observed TTFT lags the queue it comes from). Decode: the smaller
    # of the prediction and the observed TPOT, which counts the streams running now, so one
    # tick's prediction of a batch that never forms is not an overload.
    confirming_load: float | None = None


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
    demand: float = 0.0  # this tick's, in the capacity's unit
    load: float | None = None  # max(predicted, observed) / SLO


class Level:
    """A per-tick series' recent level: the mean of its last ``level_window_s``."""

    def __init__(self, settings: ScalingSettings) -> None:
        self.settings = settings
        self.points: deque[tuple[float, float]] = deque(maxlen=4096)

    def add(self, now: float, value: float) -> None:
        self.points.append((now, value))
        while self.points[0][0] < now - self.settings.level_window_s:
            self.points.popleft()

    def level(self) -> float:
        """The mean as of the last ``add`` (it keeps only the window's points)."""
        return sum(value for _, value in self.points) / len(self.points) if self.points else 0.0


def rate_growth(
    times: np.ndarray, requests: np.ndarray, rate: float, horizon_s: float, settings: ScalingSettings
) -> float:
    """How many times today's request ``rate`` the horizon will need: ``1 + slope × H / rate``,
    at least 1 (a fall is never forecast: scaling down waits for it) and at most ``max_growth``.

    ``requests`` counts the arrivals so far at each of ``times`` (the ticks of the last
    ``trend_window_s``). The slope is the smaller of the least-squares slopes of the arrival rate
    over the window's older and newer halves, each only when ``trend_significance`` standard
    errors above zero, and 0 until the window is (nearly) full: growth through the whole window is
    a trend, a single jump (a step, load arriving at a fresh router) a new level, already in it.
    The slope is fitted to the arrivals counted in each tick: independent Poisson counts, so its
    standard error under a constant rate is known. A smoothed rate's points are not independent (a
    32-request rate at 0.5 req/s spans 64 s, half the window), and a test that took them for
    samples found growth in noise."""
    young = len(times) < 7 or times[-1] - times[0] < settings.trend_window_s - settings.level_window_s
    if rate <= 0 or young:
        return 1.0
    spans, counts = np.diff(times), np.diff(requests)
    kept = spans > 0
    spans, counts, middles = spans[kept], counts[kept], ((times[1:] + times[:-1]) / 2)[kept]
    older = middles <= middles[0] + (middles[-1] - middles[0]) / 2
    slope = min(
        _significant_slope(middles[half], counts[half], spans[half], settings.trend_significance)
        for half in (older, ~older)
    )
    return min(1.0 + slope * horizon_s / rate, settings.max_growth)


def _significant_slope(at: np.ndarray, counts: np.ndarray, spans: np.ndarray, significance: float) -> float:
    """The least-squares slope of the rates ``counts / spans`` over ``at`` if it is ``significance``
    standard errors above zero, else 0. Under a constant rate λ each count is Poisson, so a rate's
    variance is λ / span; λ is the mean rate of these ticks."""
    if len(at) < 3:
        return 0.0
    x = at - at.mean()
    sxx = float(x @ x)
    if sxx <= 0:
        return 0.0
    slope = float(x @ (counts / spans)) / sxx  # Σx = 0: no need to centre the rates
    if slope <= 0:
        return 0.0
    mean_rate = float(counts.sum() / spans.sum())
    stderr = math.sqrt(mean_rate * float((x * x) @ (1.0 / spans))) / sxx
    return slope if slope > significance * stderr else 0.0


class Recommender:
    """Pure: per-role states in, recommendations out; keeps the desired history for hysteresis.

    ``settle_s``: how long an observed latency speaks for the past (the observed p90's window): a
    broken SLO asks for one more replica only once the replicas already asked for are admitted
    (or the ready time passed without them) and have been for ``settle_s``, so one overload is
    not answered again and again while its cure is starting or its latencies are still counted."""

    def __init__(self, settings: ScalingSettings, settle_s: float = 0.0) -> None:
        self.settings = settings
        self.settle_s = settle_s
        self.history: dict[str, deque[tuple[float, int]]] = {role: deque() for role in ROLES}
        self.asked: dict[str, int] = {}  # the last recommendation per role
        self.asked_since: dict[str, float] = {}  # since when it has been above the admitted count
        self.admitted: dict[str, tuple[int, float]] = {}  # admitted count and since when

    def recommend(
        self, now: float, role: str, state: RoleState, forecast: float, horizon_s: float
    ) -> Recommendation:
        s = self.settings
        index = ROLES.index(role)
        low, high = s.min_replicas[index], s.max_replicas[index]
        desired = math.ceil(forecast / state.capacity - 1e-9) if state.capacity > 0 else state.current
        starting, settled = self._settled(now, role, state, horizon_s)
        broken = state.load is not None and state.load > 1.0
        if broken and (state.confirming_load is None or state.confirming_load > 1.0):
            # The SLO is broken, whatever the model says: one more than admitted, or keep the
            # ones asked for while they start (answered once per overload, not every tick).
            if starting:
                desired = max(desired, self.asked[role])
            elif settled:
                desired = max(desired, state.current + 1)
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
        if recommended > state.current:
            self.asked_since.setdefault(role, now)
        else:
            self.asked_since.pop(role, None)
        self.asked[role] = recommended
        return Recommendation(
            role,
            state.current,
            desired,
            recommended,
            refused,
            forecast,
            state.capacity,
            horizon_s,
            state.demand,
            state.load,
        )

    def _settled(self, now: float, role: str, state: RoleState, horizon_s: float) -> tuple[bool, bool]:
        """``(starting, settled)``: replicas asked for are not admitted yet (within the ready
        time); the admitted count has not changed for ``settle_s`` (the observed latency has had
        its window to see them)."""
        count, since = self.admitted.get(role, (state.current, -math.inf))
        if state.current != count:
            since = now
        self.admitted[role] = (state.current, since)
        starting = (
            self.asked.get(role, 0) > state.current and now - self.asked_since.get(role, now) < horizon_s
        )
        return starting, not starting and now - since >= self.settle_s

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
    # M/D/1: the wait is ρ/(2(1−ρ))·s, so wait + s meets the SLO at ρ = 2h / (s + 2h), h = slo − s.
    # A prompt whose own compute nears or passes the SLO can never meet it, and more replicas only
    # shorten its wait: there the wait is held to half a service (ρ = 1/2) instead of to a headroom
    # that a refit moves from a little to nothing (capacity fell 25× between identical bursts).
    headroom = max(ttft_slo_s - service, service / 2.0)
    rho = 2.0 * headroom / (service + 2.0 * headroom)
    return min(rho, cap) * typical_tokens / service


def decode_capacity(
    perf: PerformanceModel, context_tokens: float, tpot_slo_s: float, kv_tokens: float, kv_target: float
) -> float:
    """What one decode replica serves with this mean context, in the demand's unit: sequences in
    flight *at the TPOT SLO* (Little's law: its token rate × the SLO).

    Unbounded, the batch whose step time is the SLO. Where the KV (``kv_target`` of it) holds fewer
    sequences, the replica runs that smaller batch, whose steps are *faster* than the SLO: it turns
    over ``batch / step`` tokens a second, ``batch × SLO / step`` sequences at the SLO. Counted as if
    it ran at the SLO's pace, 82 sequences at 31-ms steps against a 50-ms SLO read as 82 instead of
    133, and 6,000 answer tokens a second asked for four replicas instead of three."""
    base, per_seq, per_kv = perf.decode.coefficients
    per_sequence = per_seq + per_kv * context_tokens
    batch = (tpot_slo_s - base) / per_sequence if per_sequence > 0 else math.inf
    if kv_tokens > 0 and context_tokens > 0:
        kv_batch = kv_tokens * kv_target / context_tokens
        if kv_batch < batch:
            step = base + per_sequence * kv_batch
            batch = kv_batch * tpot_slo_s / step if step > 0 else kv_batch
    return max(batch, 1.0)


class DemandMeter:
    """What the flow tells the signals: fed on the request path with plain additions."""

    __slots__ = ("max_tokens", "prefill_tokens", "requests", "typical_uncached")

    def __init__(self) -> None:
        self.prefill_tokens = 0.0  # uncached prompt tokens routed, ever
        self.max_tokens = 0.0  # answer tokens asked for (max_tokens), ever
        self.requests = 0
        self.typical_uncached: float | None = None  # a moving average per request

    def arrived(self, uncached_tokens: float, max_tokens: int = 0) -> None:
        self.prefill_tokens += uncached_tokens
        self.max_tokens += max_tokens
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
        shared: SharedDemand | None = None,
    ) -> None:
        """``cost_model`` reads the picker's current cost model, ``reprice`` hands it the one each
        accepted fit implies; ``ready_times``: the gate's recent discovered → admitted durations;
        ``shared``: the other router replicas' arrival rates (each replica routes a share)."""
        self.pool = pool
        self.perf = perf
        self.current_cost_model = cost_model
        self.reprice = reprice
        self.settings = settings
        self.ready_times = ready_times
        self.typical_max_tokens = typical_max_tokens
        self.block_tokens = block_tokens
        self.clock = clock
        self.shared = shared
        self.own_rates = Rates()  # this replica's arrivals per second at the last tick
        self.demand = DemandMeter()
        self.streams = LiveStreams()  # answers streaming now: decode load while they run
        self.tokens = TokenCalibration()
        self.recommender = Recommender(settings, settle_s=perf.settings.observed_window_s)
        self.levels = {role: Level(settings) for role in ROLES}  # per role, in replicas' worth
        # The uncached prompt tokens a typical request brings now (the recent mix, else the slow
        # average; None before any), set each tick: the prefill capacity and load are for it.
        self.prompt_mix: float | None = None
        self.latest: dict[str, Recommendation] = {}
        # (time, prefill tokens routed so far, requests so far, max_tokens asked for so far) per
        # tick, over the trend window: the arrival rate, its growth, and what the requests bring.
        self._arrived: deque[tuple[float, float, int, float]] = deque()

    @property
    def cost_model(self) -> CostModel:
        return self.current_cost_model()

    def horizon_s(self) -> float:
        measured = list(self.ready_times())
        return float(np.quantile(measured, 0.9)) if measured else self.settings.ready_time_s

    def tick(self) -> dict[str, Recommendation]:
        now = self.clock()
        if self.perf.refit() and self.perf.settings.perf_model:
            self.reprice(replace(self.cost_model, model=self.perf.engine_model()))
        horizon = self.horizon_s()
        tokens_per_s, requests_per_s, per_request, answer_tokens_per_s = self._arrival_rate(
            now, self.demand.prefill_tokens, self.demand.requests, self.demand.max_tokens
        )
        self.own_rates = Rates(tokens_per_s, requests_per_s, answer_tokens_per_s)
        if self.shared is not None:  # the pool's arrivals: every replica routes a share of them
            pooled = self.own_rates + self.shared.others
            tokens_per_s, requests_per_s, answer_tokens_per_s = (
                pooled.prompt_tokens,
                pooled.requests,
                pooled.answer_tokens,
            )
            if pooled.requests > 0:
                per_request = pooled.prompt_tokens / pooled.requests
        self.prompt_mix = per_request if per_request is not None else self.demand.typical_uncached
        growth = self.growth(horizon)  # the cause of both roles' demand
        decode = self._decode_state(now, answer_tokens_per_s * self.pool.answered_share)
        prefill = self._prefill_state(now, horizon, tokens_per_s)
        out = {}
        for role, (state, value) in {"prefill": prefill, "decode": decode}.items():
            # One mix per division: the trend holds each tick's demand over the capacity for that
            # tick's own prompt and answer mix (replicas' worth), so a change of mix is a new
            # level in replicas, never one mix's tokens over another's capacity.
            needed = value / state.capacity if state.capacity > 0 else 0.0
            level = self.levels[role]
            level.add(now, needed)
            forecast = max(level.level() * growth, needed) * state.capacity
            out[role] = self.recommender.recommend(now, role, state, forecast, horizon)
        self.latest = out
        return out

    def growth(self, horizon_s: float) -> float:
        """The growth of the request rate over the horizon (``rate_growth``), from this
        replica's own arrivals: with several replicas each sees a share of the pool's, growing
        alike."""
        arrived = self._arrived
        times = np.fromiter((point[0] for point in arrived), np.float64, len(arrived))
        requests = np.fromiter((point[2] for point in arrived), np.float64, len(arrived))
        return rate_growth(times, requests, self.own_rates.requests, horizon_s, self.settings)

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
        return self._loads(role, self.clock() if now is None else now)[0]

    def _loads(self, role: str, now: float) -> tuple[float | None, float | None]:
        """``RoleState``'s ``load`` and ``confirming_load``: ``max(predicted, observed p90) / SLO``,
        and the prediction (prefill) or the smaller of the two (decode); None while unknown."""
        o = self.cost_model.objectives
        stage = "prefill" if role == "prefill" else "decode"
        predicted = predicted_latency(
            self.pool,
            self.cost_model,
            stage,
            self.typical_max_tokens,
            self.block_tokens,
            now,
            # A request of the recent mix, as the capacity is for: the slow average of whole
            # prompts ignores the cache hits and lags a change of mix by ~50 requests.
            self.prompt_mix if role == "prefill" else None,
        )
        observed = self.observed_latency(role, now)
        slo = o.ttft_slo_s if role == "prefill" else o.tpot_slo_s
        known = [v / slo for v in (predicted, observed) if v is not None]
        if not known:
            return None, None
        if role == "prefill":
            return max(known), None if predicted is None else predicted / slo
        return max(known), min(known)

    def observed_latency(self, role: str, now: float) -> float | None:
        """The p90 over the observation window of what answers saw: prefill — each TTFT's
        prefill part (a P/D pair's prefill leg: a first token that waited for a decode slot is
        decode's to answer; counted at the first token), as the prediction is; decode — the TPOT,
        also of the streams still running (the larger), so long generations count while they run,
        not once they end."""
        if role == "prefill":
            return self.perf.prefill_part.p90(now)
        ended, running = self.perf.tpot.p90(now), self.streams.tpot_p90()
        return max((v for v in (ended, running) if v is not None), default=None)

    def _prefill_state(self, now: float, horizon_s: float, tokens_per_s: float) -> tuple[RoleState, float]:
        """Demand: uncached prompt tokens per second, plus the queued backlog spread over the time
        a new replica needs to help (``backlog_drain_s`` at the soonest); capacity: at the SLO for
        the uncached size of the very prompts that make the rate (``prompt_mix``), the size the
        load is predicted for."""
        pool = self.pool
        slots = self._role_slots("prefill")
        queued = stage_signals(pool, "prefill", SaturationSettings(), now).queued_prompt_tokens
        demand = tokens_per_s + queued / max(self.settings.backlog_drain_s, horizon_s)
        typical = self.prompt_mix
        capacity = prefill_capacity(
            self.perf,
            pool.typical_prompt_tokens if typical is None else max(typical, 1.0),
            self.cost_model.objectives.ttft_slo_s,
            self.settings.max_utilization,
        )
        load, confirming = self._loads("prefill", now)
        state = RoleState(self._replicas(slots), demand, capacity, load, confirming_load=confirming)
        return state, demand

    def _arrival_rate(
        self, now: float, tokens: float, requests: int, max_tokens: float
    ) -> tuple[float, float, float | None, float]:
        """Uncached prompt tokens, requests and answer tokens asked for per second, and the mean
        uncached tokens per request (None without any). The request rate spans the last
        ``level_window_s`` or further back (up to ``trend_window_s``) until it holds
        ``min_rate_requests`` arrivals: a few requests' Poisson noise is not a rate. What each
        request brings (its uncached prompt, its max_tokens) is averaged over the shorter span of
        ``min_mix_requests``: a new prompt or answer mix counts within a few requests, without the
        rate's noise. The token rates are the product of the two."""
        s = self.settings
        arrived = self._arrived
        arrived.append((now, tokens, requests, max_tokens))
        while len(arrived) > 1 and arrived[1][0] <= now - s.trend_window_s:
            arrived.popleft()
        rate_start = mix_start = arrived[0]
        mix_found = False
        for point in reversed(arrived):  # the newest points far enough back
            if point[0] > now - s.level_window_s:
                continue
            count = requests - point[2]
            if not mix_found:
                mix_start, mix_found = point, count >= s.min_mix_requests
            rate_start = point
            if mix_found and count >= s.min_rate_requests:
                break
        span = max(s.level_window_s, now - rate_start[0])
        requests_per_s = (requests - rate_start[2]) / span
        count = requests - mix_start[2]
        if count <= 0:
            return 0.0, requests_per_s, None, 0.0
        per_request = (tokens - mix_start[1]) / count
        return (
            requests_per_s * per_request,
            requests_per_s,
            per_request,
            requests_per_s * ((max_tokens - mix_start[3]) / count),
        )

    def _decode_state(self, now: float, answer_tokens_per_s: float = 0.0) -> tuple[RoleState, float]:
        """Demand: the sequences decoding (scraped running + waiting on the decode pods, or ours
        past their prefill when more: a request still queued for its prefill holds no decode slot
        yet and arrives only as fast as prefill lets it), counted as they would be *at the TPOT
        SLO*: by Little's law a sequence is in flight for as long as its tokens take, so the count
        at today's time per token is scaled by SLO / TPOT (fewer in flight while the pods are
        fast, more while they are slow). That count is linear in the arrival rate, so its level
        and its trend mean the same at any load; capacity is in the same unit. At least what the
        arrivals will need (Little's law on arrivals: answer tokens asked for per second × the
        share produced × the TPOT SLO): a burst of long answers counts from its first request,
        not once the answers have piled up."""
        pool = self.pool
        slots = self._role_slots("decode")
        running = np.nan_to_num(pool.running[slots])
        scraped = float((running + np.nan_to_num(pool.waiting[slots])).sum())
        ours = float(pool.inflight_requests[slots].sum())
        decoding = float(pool.decoding_requests[slots].sum())  # ours past their prefill
        capacity_tokens = pool.kv_capacity_tokens[slots]
        used = np.fmax(np.nan_to_num(pool.kv_usage[slots]) * capacity_tokens, pool.reserved_kv_tokens[slots])
        used_tokens = float(np.nansum(used))
        tpot_slo = self.cost_model.objectives.tpot_slo_s
        sequences = max(
            max(scraped, decoding) * self._slo_over_tpot(running, used, tpot_slo),
            answer_tokens_per_s * tpot_slo,
        )
        known = capacity_tokens[np.isfinite(capacity_tokens)]
        per_replica_kv = float(known.mean()) if known.size else 0.0
        holding = max(scraped, ours)  # every sequence with KV on (or reserved for) the pods
        context = (
            used_tokens / holding
            if holding >= 1
            else pool.typical_prompt_tokens + self.typical_max_tokens / 2
        )
        capacity = decode_capacity(self.perf, context, tpot_slo, per_replica_kv, self.settings.kv_target)
        load, confirming = self._loads("decode", now)
        state = RoleState(
            self._replicas(slots),
            sequences,
            capacity,
            load,
            used_tokens,
            per_replica_kv,
            confirming_load=confirming,
        )
        return state, sequences

    def _slo_over_tpot(self, running: np.ndarray, kv_tokens: np.ndarray, tpot_slo_s: float) -> float:
        """SLO / time per token of the running sequences (the fitted step time at each pod's
        batch and KV, weighted by its sequences); 1 with nothing running."""
        total = float(running.sum())
        if total <= 0:
            return 1.0
        base, per_seq, per_kv = self.perf.decode.coefficients
        step = base + per_seq * running + per_kv * np.nan_to_num(kv_tokens)
        return float((running * tpot_slo_s / np.maximum(step, 1e-9)).sum()) / total

    async def run(self) -> None:
        """Tick until cancelled."""
        while True:
            try:
                self.tick()
            except Exception:  # a bug here must not stop the signals for good
                log.exception("signals tick failed")
            if self.shared is not None:  # under its own timeout; never raises
                await self.shared.exchange(self.own_rates)
            await asyncio.sleep(self.settings.tick_s)

    # Export -------------------------------------------------------------------------------------

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self.perf.collect()
        now = self.clock()
        observed = series.POOL_OBSERVED_SECONDS.family()
        for role, measure, value in (
            ("prefill", "ttft", self.perf.ttft.p90(now)),
            ("prefill", "prefill", self.observed_latency("prefill", now)),  # what the load reads
            ("decode", "tpot", self.observed_latency("decode", now)),
        ):
            if value is not None:
                observed.add_metric([role, measure], value)
        yield observed
        load = series.POOL_LOAD.family()
        for role in ROLES:
            value = self.load(role, now)
            if value is not None:
                load.add_metric([role], value)
        yield load
        for field, declared in series.RECOMMENDATION.items():
            family = declared.family()
            for role, rec in self.latest.items():
                family.add_metric([role], float(getattr(rec, field)))
            yield family
        refused = series.SCALE_DOWN_REFUSED.family()
        for role, rec in self.latest.items():
            for reason in ("slo", "kv"):
                refused.add_metric([role, reason], float(rec.refused == reason))
        yield refused
        yield series.SIGNALS_REPLICAS.one_sample(1 if self.shared is None else self.shared.replicas)
        if self.shared is not None:
            yield series.SHARED_DEMAND_ERRORS.one_sample(self.shared.board.errors)
        yield series.SCALING_HORIZON.one_sample(self.horizon_s())
