"""What every scorer reads: candidate feature arrays, the request, the engine speed model.

Contract for every scorer function: inputs are aligned arrays of shape ``(k,)`` (one entry per
candidate), outputs are float64 arrays of shape ``(k,)`` (or ``(kp, kd)`` for pair scorers) in
**seconds** unless the docstring says otherwise, never NaN. Features that were never scraped are
NaN here; each scorer decides explicitly what unknown means (usually: the pool's worst known
value), because treating unknown as idle herds traffic onto pods nobody has measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class Candidates:
    """Features of k candidate endpoints, gathered from the pool for one pick."""

    slots: np.ndarray
    running: np.ndarray  # scraped; NaN = unknown
    waiting: np.ndarray  # scraped; NaN = unknown
    kv_usage: np.ndarray  # scraped, 0..1; NaN = unknown
    kv_capacity_tokens: np.ndarray  # scraped block_size * num_gpu_blocks; NaN = unknown
    queued_prefill_tokens: np.ndarray  # our reservations: uncached prompt tokens not yet prefilled
    reserved_kv_tokens: np.ndarray  # our reservations: prompt + max_tokens of requests in flight
    inflight_requests: np.ndarray  # our reservations: requests decoding here
    link_index: np.ndarray  # index into the link table
    decodes: np.ndarray  # bool: the pod runs decodes (a prefill there stalls them)
    cached_blocks: np.ndarray  # longest cached prefix of this prompt, in blocks

    def __len__(self) -> int:
        return len(self.slots)

    def take(self, index: np.ndarray) -> Candidates:
        """The subset at ``index`` (a mask or integer positions)."""
        return Candidates(*(getattr(self, name)[index] for name in self.__slots__))


@dataclass(frozen=True, slots=True)
class RequestCtx:
    prompt_tokens: int
    max_tokens: int
    block_tokens: int
    typical_prompt_tokens: float  # stand-in size for queued requests that did not come through us


@dataclass(frozen=True, slots=True)
class EngineModel:
    """Engine speed, for turning tokens into seconds."""

    prefill_tokens_per_s: float
    decode_step_base_s: float  # fixed cost of any engine step
    pd_leg_overhead_s: float  # the extra HTTP exchange of a P/D pair's prefill leg
    decode_s_per_seq: float
    decode_s_per_kv_token: float
    kv_bytes_per_token: int


def fill_unknown(values: np.ndarray, worst: float) -> np.ndarray:
    """Replace NaN (never measured) by the pool's worst known value, or ``worst`` if none is known."""
    unknown = np.isnan(values)
    if not unknown.any():
        return values
    known = values[~unknown]
    return np.where(unknown, known.max() if known.size else worst, values)
