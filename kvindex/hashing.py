"""Approximate block keys: chained 64-bit hashes over fixed-size character blocks.

Without a tokenizer, ``chars_per_token`` characters stand in for one token, so a block of
``block_tokens`` tokens is ``block_tokens * chars_per_token`` characters. Only *full* blocks get a
key (as in vLLM: a partial last block is never shared). Key i hashes key i-1 with block i's text,
so equal keys mean equal prefixes. A prompt given as token ids needs no stand-in: its blocks are
``block_tokens`` ids each (``token_block_keys``), keyed apart from text so the two never meet.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

_ROOT = b"pd-router/v1"
_IDS_ROOT = b"pd-router/ids/v1"
# Token ids are hashed as 4-byte words: every vocabulary is far smaller.
MAX_TOKEN_ID = (1 << 32) - 1


def estimate_tokens(text: str, chars_per_token: float) -> int:
    """Token count estimate for ``text`` (at least 1 for a non-empty prompt)."""
    return max(1, math.ceil(len(text) / chars_per_token)) if text else 0


def text_block_keys(text: str, block_chars: int) -> np.ndarray:
    """uint64 chained keys of every full ``block_chars``-character block of ``text``."""
    data = text.encode("utf-8", "surrogatepass")
    n_blocks = len(text) // block_chars
    keys = np.empty(n_blocks, dtype=np.uint64)
    parent = _ROOT
    # Slice the UTF-8 bytes per character block: encode once, then cut where the text cuts.
    if len(data) == len(text):
        cuts = range(0, n_blocks * block_chars + 1, block_chars)
    else:
        cuts = _utf8_cuts(text, block_chars, n_blocks)
    starts = iter(cuts)
    start = next(starts)
    for i, end in enumerate(starts):
        parent = hashlib.blake2b(parent + data[start:end], digest_size=8).digest()
        keys[i] = int.from_bytes(parent, "little")
        start = end
    return keys


def _utf8_cuts(text: str, block_chars: int, n_blocks: int) -> list[int]:
    cuts = [0]
    offset = 0
    for i in range(n_blocks):
        offset += len(text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass"))
        cuts.append(offset)
    return cuts


def token_block_keys(ids: Sequence[int], block_tokens: int) -> np.ndarray:
    """uint64 chained keys of every full ``block_tokens``-id block of ``ids`` (each <= MAX_TOKEN_ID)."""
    n_blocks = len(ids) // block_tokens
    data = np.asarray(ids[: n_blocks * block_tokens], dtype="<u4").tobytes()
    width = 4 * block_tokens
    keys = np.empty(n_blocks, dtype=np.uint64)
    parent = _IDS_ROOT
    for i in range(n_blocks):
        parent = hashlib.blake2b(parent + data[i * width : (i + 1) * width], digest_size=8).digest()
        keys[i] = int.from_bytes(parent, "little")
    return keys
