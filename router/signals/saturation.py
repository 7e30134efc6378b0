"""Pool-level saturation signals per role, computed from the pool's arrays when Prometheus scrapes.

The *stages* are the roles as autoscalers see them: ``prefill`` (pods that compute prompts:
``prefill`` and ``prefill-decode``) and ``decode`` (``decode`` and ``prefill-decode``); a
``prefill-decode`` pod counts in both. Only admitted endpoints count; a stage is computed over its
*fresh* endpoints (metrics younger than the staleness threshold).

* **Saturation** per endpoint is ``max(waiting / queue_threshold, kv_usage / kv_threshold)``
  (defaults 5 and 0.8, as the reference picker's utilization detector); an endpoint whose metrics
  are stale or unknown scores 1.0 (fail closed). A stage's saturation is the mean over its
  admitted endpoints, an empty stage reads 1.0, nothing is clamped, and ``effective`` is the max of
  the stages. Exported under llm-d's and the Inference Extension's names so existing alerts and
  ScaledObjects keep working.
* **Per-role load**: queued uncached prompt tokens (the ``queue`` term's count: ours, or the
  scraped waiting less ours × typical prompt, whichever is larger), running and waiting
  requests, KV usage (mean, max, sample std-dev).
* **Predicted latency**: the TTFT a typical new request would get from the best prefill
  candidate (queue wait + prefill of a typical prompt, from the cost model's own terms) and the
  TPOT it would get from the best decode candidate (stretched by the prompts that pod computes:
  ``terms/load.py`` ``stalled_tpot_s``). Absent while a stage has no fresh endpoint
  (unknown, not zero). The load per role (``max(predicted, observed) / SLO``) and the replica
  recommendation are in ``scaling.py``.
* **Pool averages** under both families (``llm_d_epp_*`` and ``inference_pool_*``): means over
  fresh endpoints of KV usage, waiting (queue) and running requests, their std-devs, the number of
  fresh endpoints, and the per-endpoint queue size.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from prometheus_client.core import Metric

import router.observe.series as series
from router.scheduling.costmodel.matrix import CostModel, derive
from router.scheduling.costmodel.terms.load import stalled_tpot_s
from router.scheduling.costmodel.terms.queue import queued_prompt_tokens
from router.scheduling.costmodel.view import RequestCtx
from router.state.pool import Pool

STAGES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class SaturationSettings:
    queue_threshold: float = 5.0  # waiting requests at which an endpoint counts as saturated
    kv_threshold: float = 0.8  # KV usage at which an endpoint counts as saturated


@dataclass(frozen=True, slots=True)
class StageSignals:
    """One stage (role) at one instant."""

    endpoints: int  # admitted
    fresh: int  # admitted with fresh metrics
    saturation: float  # mean of the per-endpoint scores; 1.0 when empty
    queued_prompt_tokens: float
    running: float
    waiting: float
    kv_mean: float
    kv_max: float
    kv_stddev: float


def endpoint_saturation(
    pool: Pool, slots: np.ndarray, fresh: np.ndarray, s: SaturationSettings
) -> np.ndarray:
    """Per endpoint of ``slots``: the utilization score, 1.0 where stale or unknown (fail closed)."""
    waiting = pool.waiting[slots]
    kv = pool.kv_usage[slots]
    score = np.maximum(waiting / s.queue_threshold, kv / s.kv_threshold)
    return np.where(fresh & np.isfinite(score), score, 1.0)


def stage_signals(pool: Pool, stage: str, s: SaturationSettings, now: float) -> StageSignals:
    role_mask = pool.can_prefill if stage == "prefill" else pool.can_decode
    slots = np.flatnonzero(pool.in_use & pool.admitted & ~pool.ejected & role_mask)
    fresh = pool.scraped[slots] & ((now - pool.last_scrape_ok[slots]) <= pool.stale_after_s)
    scores = endpoint_saturation(pool, slots, fresh, s)
    live = slots[fresh]
    waiting = np.nan_to_num(pool.waiting[live])
    kv = pool.kv_usage[live]
    kv = kv[np.isfinite(kv)]
    # The queue term's own count (ours, or others' scraped waiting), unknown waiting read as none
    queued = queued_prompt_tokens(
        pool.queued_prefill_tokens[slots],
        np.nan_to_num(pool.waiting[slots]),
        pool.waiting_ours[slots],
        pool.typical_prompt_tokens,
    )
    return StageSignals(
        endpoints=len(slots),
        fresh=len(live),
        saturation=float(scores.mean()) if len(slots) else 1.0,
        queued_prompt_tokens=float(queued.sum()),
        running=float(np.nan_to_num(pool.running[live]).sum()),
        waiting=float(waiting.sum()),
        kv_mean=float(kv.mean()) if kv.size else 0.0,
        kv_max=float(kv.max()) if kv.size else 0.0,
        kv_stddev=_sample_stddev(kv),
    )


def predicted_latency(
    pool: Pool,
    cost_model: CostModel,
    stage: str,
    max_tokens: int,
    block_tokens: int,
    now: float,
    prompt_tokens: float | None = None,
) -> float | None:
    """Seconds a typical new request would see on the best candidate of ``stage``: its TTFT for
    ``prefill`` (queue wait + computing ``prompt_tokens``, by default the pool's slow average of
    whole prompts), its TPOT for ``decode``; None if empty."""
    role_mask = pool.can_prefill if stage == "prefill" else pool.can_decode
    ok = pool.in_use & pool.admitted & pool.scraped & ~pool.ejected & role_mask
    ok &= (now - pool.last_scrape_ok) <= pool.stale_after_s
    slots = np.flatnonzero(ok)
    if not len(slots):
        return None
    tokens = pool.typical_prompt_tokens if prompt_tokens is None else prompt_tokens
    ctx = RequestCtx(max(1, round(tokens)), max_tokens, block_tokens, tokens)
    view = derive(pool.candidates(slots), ctx, cost_model)
    seconds = view.wait_s + view.prefill_s if stage == "prefill" else stalled_tpot_s(view)
    return float(seconds.min())


def _sample_stddev(values: np.ndarray) -> float:
    # The reference picker's rule: divide by n - 1, with a floor of 1.
    if values.size == 0:
        return 0.0
    return float(math.sqrt(((values - values.mean()) ** 2).sum() / max(values.size - 1, 1)))


class SignalsCollector:
    """Exports the signals when Prometheus scrapes (nothing on the request path)."""

    def __init__(
        self,
        pool: Pool,
        pool_name: str,
        cost_model: Callable[[], CostModel] | None = None,
        settings: SaturationSettings = SaturationSettings(),
        *,
        typical_max_tokens: int = 256,
        block_tokens: int = 16,
        prompt_tokens: Callable[[], float | None] = lambda: None,
    ) -> None:
        """``cost_model``: the picker's current one (refits re-price it), for predicted latency
        (omitted: not exported); ``prompt_tokens``: the uncached prompt of a typical request now
        (``PoolSignals.prompt_mix``, which the prefill load is predicted for; None: the pool's
        slow average of whole prompts)."""
        self.pool = pool
        self.pool_name = pool_name
        self.cost_model = cost_model
        self.settings = settings
        self.typical_max_tokens = typical_max_tokens
        self.block_tokens = block_tokens
        self.prompt_tokens = prompt_tokens

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        now = time.monotonic()
        pool = self.pool
        stages = {stage: stage_signals(pool, stage, self.settings, now) for stage in STAGES}
        effective = max(signals.saturation for signals in stages.values())
        for declared in series.POOL_SATURATION:
            family = declared.family()
            for stage, signals in stages.items():
                family.add_metric([self.pool_name, stage], signals.saturation)
            family.add_metric([self.pool_name, "effective"], effective)
            yield family
        for field, declared in series.POOL_PER_ROLE.items():
            family = declared.family()
            for stage, signals in stages.items():
                family.add_metric([stage], float(getattr(signals, field)))
            yield family
        kv = series.POOL_KV_USAGE.family()
        for stage, signals in stages.items():
            kv.add_metric([stage, "mean"], signals.kv_mean)
            kv.add_metric([stage, "max"], signals.kv_max)
            kv.add_metric([stage, "stddev"], signals.kv_stddev)
        yield kv
        if self.cost_model is not None:
            yield from self._predicted(now)
        yield from self._pool_averages(now)

    def _predicted(self, now: float) -> Iterator[Metric]:
        assert self.cost_model is not None
        cost_model = self.cost_model()
        ttft = predicted_latency(
            self.pool,
            cost_model,
            "prefill",
            self.typical_max_tokens,
            self.block_tokens,
            now,
            self.prompt_tokens(),
        )
        tpot = predicted_latency(
            self.pool, cost_model, "decode", self.typical_max_tokens, self.block_tokens, now
        )
        latency = series.POOL_PREDICTED_SECONDS.family()
        if ttft is not None:
            latency.add_metric(["prefill", "ttft"], ttft)
        if tpot is not None:
            latency.add_metric(["decode", "tpot"], tpot)
        yield latency

    def _pool_averages(self, now: float) -> Iterator[Metric]:
        """The pool gauges dashboards query, under llm-d's names and the Inference Extension's."""
        pool = self.pool
        ok = pool.in_use & pool.admitted & pool.scraped & ~pool.ejected
        ok &= (now - pool.last_scrape_ok) <= pool.stale_after_s
        slots = np.flatnonzero(ok)
        for declared in series.READY_ENDPOINTS:
            yield declared.one_sample(float(len(slots)), self.pool_name)
        if not len(slots):
            return  # as the reference picker: the averages keep no value without a fresh endpoint
        for feature, (llm_d_mean, gie_mean, std_dev) in series.POOL_AVERAGES.items():
            values = getattr(pool, feature)[slots]
            known = values[np.isfinite(values)]
            mean = round(float(known.mean()), 2) if known.size else 0.0
            yield llm_d_mean.one_sample(mean, self.pool_name)
            yield gie_mean.one_sample(mean, self.pool_name)
            yield std_dev.one_sample(round(_sample_stddev(known), 2), self.pool_name)
        for declared in series.PER_ENDPOINT_QUEUE_SIZE:
            family = declared.family()
            for slot in slots.tolist():
                endpoint = pool.by_slot[slot]
                if endpoint is not None:
                    family.add_metric([self.pool_name, endpoint.id], float(np.nan_to_num(pool.waiting[slot])))
            yield family
