"""How much slower or faster each engine is than the pool's model says: a per-engine factor.

A fleet is rarely uniform (two GPU generations, a noisy neighbour, a throttled card). The
performance model (``perf.py``) is fitted for the pool; each answer also says how its engine
did against that model: the prompt's compute time (the prefill leg, or the first streamed token)
against ``work / prefill rate``, and the streamed TPOT against the model's TPOT. Their ratio is a
moving average per engine; every ``apply`` the factor of an engine with enough answers is its
average over the pool's median (clamped to ``[1/8, 8]``), and 1 for the others. The cost model
multiplies an engine's queue wait, prefill time and TPOT by it (the ``slowness`` feature), so a
slow engine gets less work without anyone configuring it.
"""

from __future__ import annotations

import math

import numpy as np

from router.state.pool import Pool

MIN_FACTOR, MAX_FACTOR = 0.125, 8.0


class EngineSpeeds:
    def __init__(self, alpha: float = 0.1, min_samples: int = 5) -> None:
        self.alpha = alpha
        self.min_samples = min_samples
        self.ratios: dict[str, float] = {}  # endpoint id -> moving average of observed / model
        self.samples: dict[str, int] = {}

    def observe(self, endpoint_id: str, observed_s: float, model_s: float) -> None:
        """One answer: this engine took ``observed_s`` where the pool's model says ``model_s``."""
        if not (observed_s > 0 and model_s > 0 and math.isfinite(observed_s / model_s)):
            return
        ratio = observed_s / model_s
        n = self.samples.get(endpoint_id, 0) + 1
        self.samples[endpoint_id] = n
        weight = max(self.alpha, 1.0 / n)
        before = self.ratios.get(endpoint_id, ratio)
        self.ratios[endpoint_id] = before + weight * (ratio - before)

    def apply(self, pool: Pool) -> None:
        """Write each engine's factor into ``pool.slowness`` (endpoints gone are forgotten)."""
        known = {
            e: r
            for e, r in self.ratios.items()
            if self.samples[e] >= self.min_samples and e in pool.endpoints
        }
        for gone in [e for e in self.ratios if e not in pool.endpoints]:
            del self.ratios[gone], self.samples[gone]
        pool.slowness[:] = 1.0
        if len(known) < 2:
            return  # one engine is its own pool: nothing to compare it with
        median = float(np.median(list(known.values())))
        for endpoint_id, ratio in known.items():
            factor = min(max(ratio / median, MIN_FACTOR), MAX_FACTOR)
            pool.slowness[pool.endpoints[endpoint_id].slot] = factor
