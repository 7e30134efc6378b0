"""What each link class really moves: KV-transfer bandwidth learned from answered P/D pairs.

A pair's decode leg starts when the prefill leg answers; its first token comes after the KV
transfer and what follows it on the decode pod (``after_transfer_s``: the cost model's two decode
steps, its step base and the leg's overhead). So each answered pair shows about
``decode leg - after_transfer_s`` seconds of transfer for the bytes the picker priced, on the
(prefill label, decode label) class. Per class (unordered: links are symmetric, as configured),
the median over the last ``window`` answers of ``(transfer - configured latency) / bytes``,
weighted by their bytes, is its seconds per byte: weighted because a small transfer's seconds are
mostly the decode pod's own noise (a step more or less) and a large one's mostly the link; a
median because a decode pod's queue only ever adds time and a few waits must not halve a link's
bandwidth. With ``min_samples`` answers the learned bandwidth replaces
the configured one for that class; the configured latency stays (one prompt size cannot tell
latency from bandwidth, and bandwidth is what a real prompt's KV pays for). So labelling racks is
enough: the ``links`` section's numbers are priors.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
from prometheus_client.core import Metric

import router.observe.series as series
from router.scheduling.costmodel.link import LinkCosts

# Below this a transfer is latency, whatever the link: nothing to learn a bandwidth from.
MIN_BYTES = 1 << 20
# A learned bandwidth moves the table only when it changed this much (relative) since the last.
_RELEARN = 0.05


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The value below which half of the total weight lies."""
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, cumulative[-1] / 2.0)])


class LinkLearner:
    """Per link class, a ring of observed seconds per byte; ``costs`` lays the learned
    bandwidths over the configured ``LinkCosts``. ``apply``: route with them
    (``signals.learn_links``); off, they are only observed and exported."""

    def __init__(self, prior: LinkCosts, *, apply: bool, window: int = 32, min_samples: int = 8) -> None:
        if window < min_samples or min_samples < 1:
            raise ValueError(f"need 1 <= min_samples <= window, got {min_samples}, {window}")
        self.prior = prior
        self.apply = apply
        self.window = window
        self.min_samples = min_samples
        self.version = 0  # changes whenever ``costs`` would answer differently
        self._samples: dict[tuple[str, str], np.ndarray] = {}
        self._count: dict[tuple[str, str], int] = {}
        self._learned: dict[tuple[str, str], float] = {}  # class -> bytes per second

    def observe(self, prefill_link: str, decode_link: str, transfer_bytes: float, seconds: float) -> None:
        """One answered pair: ``transfer_bytes`` took about ``seconds`` (decode leg − what follows)."""
        if not (transfer_bytes >= MIN_BYTES and math.isfinite(seconds)):
            return
        key = (prefill_link, decode_link) if prefill_link <= decode_link else (decode_link, prefill_link)
        per_byte = max(seconds - self.prior.between(*key)[0], 0.0) / transfer_bytes
        ring = self._samples.get(key)
        if ring is None:
            ring = self._samples[key] = np.empty((2, self.window))
        n = self._count.get(key, 0)
        ring[:, n % self.window] = per_byte, transfer_bytes
        n = self._count[key] = n + 1
        if n < self.min_samples:
            return
        median = weighted_median(ring[0, : min(n, self.window)], ring[1, : min(n, self.window)])
        # Answers faster than the configured latency must not make a link free: at most 1 TB/s.
        bandwidth = 1.0 / max(median, 1e-12)
        before = self._learned.get(key)
        if before is None or abs(bandwidth - before) > _RELEARN * before:
            self._learned[key] = bandwidth
            self.version += 1

    def learned(self) -> dict[tuple[str, str], float]:
        """Bytes per second per link class with enough answers (a copy)."""
        return dict(self._learned)

    def costs(self, prior: LinkCosts) -> LinkCosts:
        """``prior`` with the learned bandwidths of its classes when applied, else ``prior``."""
        if not self.apply or not self._learned:
            return prior
        pairs = dict(prior.pairs)
        for (a, b), bandwidth in self._learned.items():
            pairs[(a, b)] = (prior.between(a, b)[0], bandwidth)
        return LinkCosts(prior.same, prior.default, tuple(pairs.items()))

    # -- Prometheus (registered as a collector) --------------------------------------------------

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        family = series.LINK_LEARNED_BANDWIDTH.family()
        for (a, b), bandwidth in sorted(self._learned.items()):
            family.add_metric([a, b], bandwidth)
        yield family
