"""Session affinity as a prefix-locality prior: the cached prefix a session's home pods likely hold.

``cached_blocks = max(index, known * expected_tokens // block_tokens)``, where ``known`` marks the
candidates that are the session's home (the pods its last turn ran on, ``router/state/sessions.py``)
and ``expected_tokens`` is that turn's prompt length times the session's weight (1 for
``x-session-id``, ``sessions.user_weight`` for ``user``). The max, not a sum: where the index holds
the same prefix the session adds nothing; where the index lost it (evicted, a restart, a miss) the
session's evidence stands in. Within one block of the session's count the index's stands: the two
count a prompt differently (characters against estimated tokens), so a block's difference is
rounding, and the index's is the evidence of the very blocks this prompt shares.

Everything downstream is unchanged: ``prefix.cached_tokens`` caps the credit at the prompt, the
fairness cap drops it on a pod whose queue is far above the least, and the ``queue``, ``kv`` and
transfer costs decide whether staying is worth it, so a saturated home loses the session like any
warm pod. Units: blocks of ``block_tokens`` prompt tokens. Consumes: ``cached_blocks`` and
``slots``; other candidates are unknown to the session and keep the index's value.
"""

from __future__ import annotations

import numpy as np


def cached_blocks_with_session(
    cached_blocks: np.ndarray, known: np.ndarray, expected_tokens: float, block_tokens: float
) -> np.ndarray:
    """``cached_blocks`` raised to the session's expected prefix on the ``known`` (home) candidates."""
    expected_blocks = int(expected_tokens // block_tokens) if block_tokens > 0 else 0
    if expected_blocks <= 0 or not known.any():
        return cached_blocks
    lost = known & (cached_blocks < expected_blocks - 1)
    return np.where(lost, np.asarray(expected_blocks, dtype=cached_blocks.dtype), cached_blocks)
