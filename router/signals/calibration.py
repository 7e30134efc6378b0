"""Predictions corrected by what the engines report in each answer's ``usage``.

* **Tokens per character.** Without a tokenizer the router estimates a prompt's tokens from its
  characters (``limits.chars_per_token``). Every answer reports the true ``prompt_tokens``; their
  ratio to our estimate scales the estimate of every new prompt and the tokens an approximate
  (character) block stands for, so cached and uncached tokens stay consistent. Block boundaries
  never move: the index's keys stay valid. Only estimates are scaled: a count from a tokenizer or
  from token ids (``RouteRequest.exact_tokens``) is the engines' own, and precise keys are blocks
  of exactly the engines' block size. The ratio is robust to an engine that reports odd
  ``usage`` (``prompt_tokens: 1`` for every answer): a report outside ``[MIN_RATIO, MAX_RATIO]``
  of the estimate is not a tokenizer's and is ignored; each engine has its own ratio, the median
  of its last ``window`` reports, once it has ``min_samples`` of them; the pool's ratio is the
  median across engines of those not more than ``OUTLIER`` × off that median (every engine runs
  the same tokenizer, so one that disagrees is wrong, not different). Two engines that disagree
  leave no majority: the one nearer the configured estimate wins.
* **Cached tokens.** ``usage.prompt_tokens_details.cached_tokens`` says what the engine that
  computed the prompt really had. When it is far below what the index said that engine held, the
  engine evicted blocks the index still lists. The prompt itself is back in the engine's cache
  (it was just recomputed), so the index forgets as many of that engine's *least recently used*
  blocks as were missing and records no more than that for it from then on
  (``PrefixIndex.shrink``): its belief shrinks to what the engine really keeps. Only when nothing
  else was computing on that engine at the pick: a request sharing the prefix still in prefill
  makes the engine report it uncached without any eviction (taking that for an eviction halved
  the shared-prefix benchmark's hit rate).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from statistics import median

MIN_RATIO, MAX_RATIO = 0.25, 4.0  # reported / estimated beyond these is not a tokenizer's count
OUTLIER = 1.5  # an engine's ratio this many times off the pool's median is ignored
MAX_ENGINES = 1024  # engines remembered (the least recently heard from is forgotten first)


class TokenCalibration:
    """Engine-reported prompt tokens over our character estimate: a robust ratio per engine, the
    pool's the median across engines that agree."""

    def __init__(self, min_samples: int = 8, window: int = 32) -> None:
        """``min_samples``: an engine's reports before its ratio counts; ``window``: its ratio is
        the median of its last this many."""
        self.min_samples = min_samples
        self.window = window
        self.samples = 0  # reports taken, every engine
        self.rejected = 0  # reports ignored as implausible
        self._reports: OrderedDict[str, deque[float]] = OrderedDict()
        self._logs: dict[str, float] = {}  # log of each engine's ratio, once it has min_samples
        self._stale = 0  # engine ratios updated since the pool's was computed
        self._ratio = 1.0

    @property
    def ratio(self) -> float:
        """The factor applied to estimates: 1.0 until an engine has ``min_samples`` reports."""
        return self._ratio

    def engine_ratio(self, engine: str) -> float | None:
        """One engine's own ratio (None until it has ``min_samples`` reports)."""
        log = self._logs.get(engine)
        return None if log is None else math.exp(log)

    def observe(self, engine: str, estimated: int, reported: int) -> None:
        """``engine`` counted ``reported`` tokens in a prompt we estimated at ``estimated``."""
        if estimated <= 0 or reported <= 0:
            return
        ratio = reported / estimated
        if not MIN_RATIO <= ratio <= MAX_RATIO:
            self.rejected += 1
            return
        reports = self._reports.get(engine)
        if reports is None:
            reports = self._reports[engine] = deque(maxlen=self.window)
            if len(self._reports) > MAX_ENGINES:
                gone, _ = self._reports.popitem(last=False)
                self._logs.pop(gone, None)
        else:
            self._reports.move_to_end(engine)
        reports.append(ratio)
        self.samples += 1
        if len(reports) < self.min_samples:
            return
        joined = engine not in self._logs
        self._logs[engine] = math.log(median(reports))
        self._stale += 1
        # The median across n engines is recomputed every n updates (and when one joins), so
        # what it costs per answer stays small however large the pool.
        if joined or self._stale >= len(self._logs):
            self._stale = 0
            self._ratio = math.exp(_agreeing_median(list(self._logs.values())))

    def scale(self, estimated: int) -> int:
        return max(1, round(estimated * self.ratio)) if estimated else 0


def pool_ratio(engine_ratios: list[float]) -> float:
    """The median of the engines' ratios, leaving out those more than ``OUTLIER`` × off it; when
    that leaves none (two engines far apart), the one nearest the configured estimate (1.0)."""
    if not engine_ratios:
        return 1.0
    return math.exp(_agreeing_median([math.log(r) for r in engine_ratios]))


def _agreeing_median(logs: list[float]) -> float:
    """``pool_ratio`` in logs: ratios apart by a factor are equally far either way."""
    center = median(logs)
    bound = math.log(OUTLIER)
    agreeing = [x for x in logs if abs(x - center) <= bound]
    return median(agreeing) if agreeing else min(logs, key=abs)


def evicted_blocks(
    held_tokens: float, reported_cached: int, tokens_per_block: float
) -> tuple[int, int] | None:
    """Blocks ``[first, end)`` of the prompt the index said the engine held but the engine did
    not (None when the report is near what was held: within half of it, or one block)."""
    if tokens_per_block <= 0 or held_tokens - reported_cached <= max(tokens_per_block, held_tokens / 2):
        return None
    first = math.floor(reported_cached / tokens_per_block)
    end = math.ceil(held_tokens / tokens_per_block)
    return (first, end) if end > first else None
