"""The online performance model: how long prefill and decode really take on this pool, fitted from
what the router observes, so predictions (the picker's cost model, the signals, the replica
recommendation) follow the engines instead of the configuration.

Two linear models, one per role, in seconds:

* **prefill**: ``base + per_token × work`` where ``work`` is the prompt tokens the pod had to
  compute before answering — the uncached part of this prompt plus the prefill work queued ahead of
  it at the pick. Observed as the prefill leg's duration (a P/D pair) or the time to the first
  streamed token (a pod that computed the prompt itself).
* **decode**: ``base + per_seq × (batch + 1) + per_kv_token × kv`` per output token, with the
  decode pod's batch and resident KV tokens at the pick (scraped, or our own bookkeeping when
  larger). Observed as a streamed answer's time per output token.

Robustness, in that order:

* **Prior**: the configured engine model, as a ridge penalty: changing a term's contribution to
  a typical sample costs as much as ``prior_samples`` samples off by that much, so a handful of
  samples move the fit a little, many move it all the way, and a direction the samples do not
  span (all prompts the same size) stays at the prior.
* **Buckets**: samples are kept per power-of-two bucket of their size (ring buffers), so a burst
  of short prompts does not push out the rare long ones that pin the slope.
* **Slopes are never negative**: a term the samples cannot tell apart from another (decode's KV
  held grows with its batch when every context is alike) is held at zero and the others carry
  its part (least squares under the constraint), as long as one slope stays free.
* **Physically impossible fits are rejected** (a non-positive base, a prefill that costs nothing
  or less per token). The configured shape scaled by the median of observed over its predictions
  stands in (one factor, which noisy or collinear samples still determine); if even that is
  impossible the previous fit is kept. Each fit counts as accepted, rejected or
  scaled, and the fit's mean relative error on its samples is exported.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from prometheus_client.core import Metric

import router.observe.series as series
from router.scheduling.costmodel.view import EngineModel

PREFILL_TERMS = ("base_seconds", "seconds_per_token")
DECODE_TERMS = ("base_seconds", "seconds_per_seq", "seconds_per_kv_token")


@dataclass(frozen=True, slots=True)
class LearnSettings:
    # Each learned correction on its own (``signals.learn_*``); off, as the configuration's
    # default: observed and exported, never applied. ``perf_model``: route with the fitted speeds
    # instead of the configured ones.
    perf_model: bool = False
    token_ratio: bool = False  # scale character estimates of prompt tokens (``calibration.py``)
    cached_evidence: bool = False  # shrink the index where engines report fewer cached tokens
    engine_speed: bool = False  # a per-engine slowness factor against the pool's model (``engines.py``)
    min_samples: int = 16  # real samples before a role's fit replaces its prior
    per_bucket: int = 64  # samples kept per size bucket
    prior_samples: float = 0.1  # how many samples the configured model counts as
    observed_window_s: float = 30.0  # the observed TTFT/TPOT is the p90 over this window


class SampleBuckets:
    """Samples ``(features, seconds)`` in ring buffers per power-of-two bucket of a size."""

    def __init__(self, width: int, edges: np.ndarray, per_bucket: int) -> None:
        self.edges = edges.tolist()  # a list for bisect: np.searchsorted's wrapper costs more per sample
        self.per_bucket = per_bucket
        buckets = len(edges) + 1
        self.x = np.zeros((buckets, per_bucket, width))
        self.y = np.zeros((buckets, per_bucket))
        self.count = np.zeros(buckets, dtype=np.int64)  # samples ever added per bucket

    def add(self, size: float, features: Sequence[float], seconds: float) -> None:
        bucket = bisect.bisect_right(self.edges, size)
        row = int(self.count[bucket] % self.per_bucket)
        self.x[bucket, row] = features
        self.y[bucket, row] = seconds
        self.count[bucket] += 1

    def __len__(self) -> int:
        return int(np.minimum(self.count, self.per_bucket).sum())

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Every sample kept, as ``(n, width)`` features and ``(n,)`` seconds."""
        kept = np.arange(self.per_bucket)[None, :] < self.count[:, None]
        return self.x[kept], self.y[kept]


def fit_linear(x: np.ndarray, y: np.ndarray, prior: np.ndarray, prior_weight: float) -> np.ndarray:
    """Least-squares coefficients ``c`` of ``x @ c ≈ y``, pulled towards ``prior``: changing a
    term's contribution to a typical sample (its coefficient × the feature's RMS) costs as much as
    ``prior_weight`` samples off by that much. Units cancel; a direction the samples do not span
    stays at the prior."""
    strength = np.sqrt(prior_weight) * np.sqrt(np.mean(x**2, axis=0))
    rows = np.vstack([x, np.diag(strength)])
    target = np.concatenate([y, strength * prior])
    columns = np.abs(rows).max(axis=0)
    columns[columns == 0] = 1.0  # conditioning: every column on the same scale
    solution, *_ = np.linalg.lstsq(rows / columns, target, rcond=None)
    return np.asarray(solution / columns, dtype=np.float64)


def fit_nonnegative(x: np.ndarray, y: np.ndarray, prior: np.ndarray, prior_weight: float) -> np.ndarray:
    """``fit_linear`` with every slope (all but the base) at least zero, while one slope stays
    free: a term the samples cannot tell apart from another (the KV held grows with the batch when
    every context is alike) gets the least-squares answer's sign wrong, and the constrained
    optimum holds it at zero and gives its part to the others. A lone slope is never held (a
    prefill that costs nothing per token is not a fit)."""
    free = np.ones(x.shape[1], dtype=bool)
    while True:
        solution = np.zeros(x.shape[1])
        solution[free] = fit_linear(x[:, free], y, prior[free], prior_weight)
        slopes = np.flatnonzero(free[1:] & (solution[1:] < 0)) + 1
        if slopes.size == 0 or np.count_nonzero(free[1:]) <= 1:
            return solution
        free[slopes[np.argmin(solution[slopes])]] = False


def physical(coefficients: np.ndarray) -> str | None:
    """Why a fit is impossible (None when it is not): every step costs something, nothing is free."""
    if not np.isfinite(coefficients).all():
        return "not finite"
    if coefficients[0] <= 0:
        return "non-positive base"
    if (coefficients[1:] < 0).any():
        return "negative slope"
    return None


@dataclass(slots=True)
class RoleModel:
    """One role's linear model: its prior, its samples, its current coefficients."""

    role: str
    terms: tuple[str, ...]
    prior: np.ndarray
    samples: SampleBuckets
    coefficients: np.ndarray = field(init=False)
    fitted: bool = False  # True once a fit from real samples was accepted
    accepted: int = 0  # full fits taken
    scaled: int = 0  # full fit impossible: the prior's shape scaled to the samples instead
    rejected: int = 0  # full fits refused
    last_rejection: str | None = None
    error: float = math.nan  # mean |predicted / observed - 1| of the current fit on its samples
    added_since_fit: int = 0

    def __post_init__(self) -> None:
        self.coefficients = self.prior.copy()

    def add(self, size: float, features: Sequence[float], seconds: float) -> None:
        if seconds > 0 and math.isfinite(seconds):
            self.samples.add(size, features, seconds)
            self.added_since_fit += 1

    def refit(self, settings: LearnSettings) -> bool:
        """Fit again if new samples came; True when the coefficients changed.

        The full fit when it is physical; else the configured shape scaled by the median of
        observed over prior-predicted (one factor: "the engines are 3× slower than written"),
        which noisy or collinear samples still determine; else the previous coefficients."""
        if not self.added_since_fit or len(self.samples) < settings.min_samples:
            return False
        self.added_since_fit = 0
        x, y = self.samples.arrays()
        candidate = fit_nonnegative(x, y, self.prior, settings.prior_samples)
        reason = physical(candidate)
        if reason is not None:
            self.rejected += 1
            self.last_rejection = reason
            candidate = self.prior * float(np.median(y / (x @ self.prior)))
            if physical(candidate) is not None:
                return False
            self.scaled += 1
        else:
            self.accepted += 1
        self.coefficients = candidate
        self.fitted = True
        self.error = float(np.mean(np.abs((x @ candidate) / y - 1.0)))
        return True


class RecentLatency:
    """The p90 of the latencies observed over the last ``window_s`` (a bounded ring)."""

    def __init__(self, window_s: float, capacity: int = 512) -> None:
        self.window_s = window_s
        self.at = np.full(capacity, -math.inf)
        self.seconds = np.zeros(capacity)
        self.count = 0

    def add(self, now: float, seconds: float) -> None:
        row = self.count % len(self.at)
        self.at[row] = now
        self.seconds[row] = seconds
        self.count += 1

    def p90(self, now: float) -> float | None:
        recent = self.seconds[self.at >= now - self.window_s]
        return float(np.quantile(recent, 0.9)) if recent.size else None


_TOKEN_EDGES = 2.0 ** np.arange(7, 18)  # 128 .. 128k tokens


class PerformanceModel:
    """The two role models, the engine model they imply, and how far predictions were off."""

    def __init__(self, configured: EngineModel, settings: LearnSettings = LearnSettings()) -> None:
        self.configured = configured
        self.settings = settings
        prefill_prior = np.array([configured.decode_step_base_s, 1.0 / configured.prefill_tokens_per_s])
        decode_prior = np.array(
            [configured.decode_step_base_s, configured.decode_s_per_seq, configured.decode_s_per_kv_token]
        )
        self.prefill = RoleModel(
            "prefill",
            PREFILL_TERMS,
            prefill_prior,
            SampleBuckets(2, _TOKEN_EDGES, settings.per_bucket),
        )
        self.decode = RoleModel(
            "decode",
            DECODE_TERMS,
            decode_prior,
            SampleBuckets(3, _TOKEN_EDGES * 8, settings.per_bucket),
        )
        self.ttft = RecentLatency(settings.observed_window_s)
        # Each TTFT's prefill part, the prefill load's observed side: a P/D pair's prefill leg
        # (its queue and compute on the prefill pod), the whole TTFT where one pod computed the
        # prompt. A first token that waited for a decode slot says decode is short, not prefill.
        self.prefill_part = RecentLatency(settings.observed_window_s)
        self.tpot = RecentLatency(settings.observed_window_s)
        # observed / predicted, per measure: the router's own accuracy, as a histogram.
        self.ratio_buckets = series.PREDICTION_RATIO.buckets
        measures = ("ttft", "tpot", "cached_tokens")
        self.ratios = {m: np.zeros(len(self.ratio_buckets), dtype=np.int64) for m in measures}
        self.ratio_sums = {m: 0.0 for m in self.ratios}

    # Samples ------------------------------------------------------------------------------------

    def observe_prefill(self, work_tokens: float, seconds: float) -> None:
        """A prompt computed: ``work_tokens`` (queued ahead + its own uncached) took ``seconds``."""
        self.prefill.add(work_tokens, (1.0, work_tokens), seconds)

    def observe_ttft(
        self, now: float, seconds: float, predicted: float, prefill_seconds: float | None
    ) -> None:
        """A TTFT against its prediction; ``prefill_seconds``: its prefill part (a P/D pair's
        prefill leg, the whole TTFT where one pod computed the prompt; None when a pair's leg was
        not timed, as behind Envoy, where the sidecar runs it: not counted)."""
        self.ttft.add(now, seconds)
        if prefill_seconds is not None:
            self.prefill_part.add(now, prefill_seconds)
        self._ratio("ttft", seconds, predicted)

    def observe_tpot(
        self,
        now: float,
        seconds: float,
        predicted: float,
        batch: float,
        kv_tokens: float,
        *,
        fit: bool = True,
    ) -> None:
        """A streamed answer's time per output token, with the decode pod's batch (this request
        included) and resident KV tokens at the pick: the features the picker predicts TPOT from,
        so the fit is calibrated for exactly that use. ``fit=False``: observed and compared only
        (a pod that also computes prompts stalls its decodes for them, which the cost model
        prices separately as interference; fitting that into the step time would count it twice)."""
        if fit:
            self.decode.add(kv_tokens, (1.0, batch, kv_tokens), seconds)
        self.tpot.add(now, seconds)
        self._ratio("tpot", seconds, predicted)

    def observe_cached(self, predicted: float, reported: int) -> None:
        """The computing engine reported ``reported`` cached prompt tokens where the index said
        it held ``predicted``."""
        self._ratio("cached_tokens", float(reported), predicted)

    def _ratio(self, measure: str, observed: float, predicted: float) -> None:
        if predicted > 0 and math.isfinite(predicted):
            ratio = observed / predicted
            self.ratios[measure][bisect.bisect_left(self.ratio_buckets, ratio)] += 1
            self.ratio_sums[measure] += ratio

    # Fits ---------------------------------------------------------------------------------------

    def refit(self) -> bool:
        """Refit both roles (each only when it has new samples); True if either changed."""
        changed = self.prefill.refit(self.settings)
        return self.decode.refit(self.settings) or changed

    def engine_model(self) -> EngineModel:
        """The configured engine model with the fitted speeds in it (the configured ones while
        learning is off)."""
        if not self.settings.perf_model:
            return self.configured
        _, per_token = self.prefill.coefficients
        base, per_seq, per_kv = self.decode.coefficients
        return replace(
            self.configured,
            prefill_tokens_per_s=1.0 / per_token,
            decode_step_base_s=float(base),
            decode_s_per_seq=float(per_seq),
            decode_s_per_kv_token=float(per_kv),
        )

    # Export -------------------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        coefficient = series.PERF_MODEL_COEFFICIENT.family()
        samples = series.PERF_MODEL_SAMPLES.family()
        fits = series.PERF_MODEL_FITS.family()
        error = series.PERF_MODEL_ERROR.family()
        fitted = series.PERF_MODEL_FITTED.family()
        for model in (self.prefill, self.decode):
            for term, value in zip(model.terms, model.coefficients.tolist(), strict=True):
                coefficient.add_metric([model.role, term], value)
            samples.add_metric([model.role], float(len(model.samples)))
            fits.add_metric([model.role, "accepted"], float(model.accepted))
            fits.add_metric([model.role, "scaled"], float(model.scaled))
            fits.add_metric([model.role, "rejected"], float(model.rejected))
            fitted.add_metric([model.role], float(model.fitted))
            if not math.isnan(model.error):
                error.add_metric([model.role], model.error)
        yield from (coefficient, samples, fits, error, fitted)
        ratio = series.PREDICTION_RATIO.family()
        for measure, counts in self.ratios.items():
            cumulative = np.cumsum(counts).tolist()
            buckets = [
                (_le(bound), float(n)) for bound, n in zip(self.ratio_buckets, cumulative, strict=True)
            ]
            ratio.add_metric([measure], buckets, self.ratio_sums[measure])
        yield ratio


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)
