"""Predictions corrected by what the engines report in each answer's ``usage``.

* **Tokens per character.** Without a tokenizer the router estimates a prompt's tokens from its
  characters (``limits.chars_per_token``). Every answer reports the true ``prompt_tokens``; their
  ratio to our estimate, a moving average taken once ``min_samples`` answers agree, scales the
  estimate of every new prompt and the tokens an approximate (character) block stands for, so
  cached and uncached tokens stay consistent. Block boundaries never move: the index's keys stay
  valid.
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

MIN_RATIO, MAX_RATIO = 0.25, 4.0


class TokenCalibration:
    """Engine-reported prompt tokens over our character estimate, as a moving ratio."""

    def __init__(self, min_samples: int = 8, alpha: float = 0.05) -> None:
        self.min_samples = min_samples
        self.alpha = alpha
        self.samples = 0
        self._ratio = 1.0

    @property
    def ratio(self) -> float:
        """The factor applied to estimates: 1.0 until ``min_samples`` answers were seen."""
        return self._ratio if self.samples >= self.min_samples else 1.0

    def observe(self, estimated: int, reported: int) -> None:
        if estimated <= 0 or reported <= 0:
            return
        ratio = min(max(reported / estimated, MIN_RATIO), MAX_RATIO)
        self.samples += 1
        # The first answers set the level quickly (a running mean), then a moving average.
        weight = max(self.alpha, 1.0 / self.samples)
        self._ratio += weight * (ratio - self._ratio)

    def scale(self, estimated: int) -> int:
        return max(1, round(estimated * self.ratio)) if estimated else 0


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
