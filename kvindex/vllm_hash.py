"""vLLM-exact chained block hashes (vLLM 0.33 ``hash_block_tokens`` / ``init_none_hash``).

The router's prefix index is fed by vLLM KV events, which name cached blocks by the low 64 bits of
vLLM's own block hash. To match a prompt against those events, the router must recompute the *same*
chain from the prompt's token ids:

    h_-1 = NONE_HASH                       (the seed, see ``none_hash``)
    h_i  = H((h_{i-1}, tuple(tokens_i), extra_i))   for every FULL block i
    key_i = int.from_bytes(h_i, "big") & (2**64 - 1)

where ``H`` is ``--prefix-caching-hash-algo``: ``sha256`` (pickle protocol 5, the default) or
``sha256_cbor`` (canonical CBOR). The chain runs over the full 32-byte parent digest, never over the
64-bit event form. ``extra_i`` is None or a tuple of *tagged* extras, e.g. a LoRA request hashes
``(("lora", lora_name, lora_path),)`` into every block, so a prompt hashed without its request's
extras differs from the engine's chain from block 0 on.

xxhash variants are rejected: with PYTHONHASHSEED unset their seed is random per engine, and the
router could not reproduce it anyway.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import cbor2
import numpy as np

# vLLM 0.33 hashes this string when PYTHONHASHSEED is unset (sha256 and sha256_cbor only).
_DEFAULT_NONE_SEED = "vllm-none-hash"
_DIGEST_BYTES = 32


class HashAlgo(StrEnum):
    """The ``--prefix-caching-hash-algo`` values the router can reproduce."""

    SHA256 = "sha256"
    SHA256_CBOR = "sha256_cbor"

    @classmethod
    def parse(cls, value: str | HashAlgo) -> HashAlgo:
        """``value`` as a ``HashAlgo``; a ValueError names the value and the supported ones."""
        try:
            return cls(value)
        except ValueError:
            why = (
                " (its seed is random per engine, so the router cannot reproduce it)"
                if "xxhash" in str(value)
                else ""
            )
            supported = ", ".join(a.value for a in cls)
            raise ValueError(
                f"unsupported prefix-caching hash algo {str(value)!r}{why}; supported: {supported}"
            ) from None


def _hash_obj(algo: HashAlgo, obj: object) -> bytes:
    if algo is HashAlgo.SHA256:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def none_hash(algo: HashAlgo, python_hash_seed: str | None) -> bytes:
    """vLLM 0.33's ``NONE_HASH``: the parent digest of block 0.

    ``H(python_hash_seed)`` (the env string itself, e.g. ``"42"``) when the engine runs with
    PYTHONHASHSEED set, else ``H("vllm-none-hash")``. An empty PYTHONHASHSEED still counts as set,
    as in vLLM (it tests ``is None``).
    """
    algo = HashAlgo.parse(algo)
    return _hash_obj(algo, _DEFAULT_NONE_SEED if python_hash_seed is None else python_hash_seed)


def _as_int_list(token_ids: Sequence[int] | np.ndarray) -> list[int]:
    # pickle must see Python ints: a numpy int64 pickles as a numpy scalar and would silently give
    # a different digest, so arrays are converted with one C-level tolist().
    if isinstance(token_ids, np.ndarray):
        return token_ids.tolist()
    return token_ids if isinstance(token_ids, list) else list(token_ids)


def block_digests(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    algo: HashAlgo,
    seed: bytes,
    extra_keys: Sequence[tuple | None] | None = None,
) -> list[bytes]:
    """Chained 32-byte digests of every FULL ``block_size`` block of ``token_ids``.

    ``seed`` is the parent of block 0 (``none_hash(...)``, or a known digest to continue a chain).
    ``extra_keys``, if given, holds one entry (tuple or None) per full block, exactly as vLLM hashes
    it; entries past the last full block are ignored. A partial last block is never hashed.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    algo = HashAlgo.parse(algo)
    if len(seed) != _DIGEST_BYTES:
        raise ValueError(
            f"seed must be a {_DIGEST_BYTES}-byte digest (NONE_HASH or a parent), got {len(seed)}"
        )
    tokens = _as_int_list(token_ids)
    n_blocks = len(tokens) // block_size
    if extra_keys is not None:
        if len(extra_keys) < n_blocks:
            raise ValueError(f"extra_keys has {len(extra_keys)} entries for {n_blocks} full blocks")
        for i in range(n_blocks):
            if extra_keys[i] is not None and type(extra_keys[i]) is not tuple:
                # A list pickles differently from a tuple: vLLM always builds tuples.
                raise TypeError(
                    f"extra_keys[{i}] must be a tuple or None, got {type(extra_keys[i]).__name__}"
                )
    if algo is HashAlgo.SHA256_CBOR:
        return _cbor_chain(tokens, n_blocks, block_size, seed, extra_keys)
    # Locals: this loop runs once per block (256 times for a 4k-token prompt at block size 16).
    sha256 = hashlib.sha256
    dumps = pickle.dumps
    proto = pickle.HIGHEST_PROTOCOL
    digests: list[bytes] = []
    append = digests.append
    parent = seed
    for i in range(n_blocks):
        start = i * block_size
        extra = None if extra_keys is None else extra_keys[i]
        parent = sha256(dumps((parent, tuple(tokens[start : start + block_size]), extra), proto)).digest()
        append(parent)
    return digests


# Canonical CBOR of the 3-tuple (parent, tokens, extra) is the array(3) head, the bytes(32) head, the
# parent, then the encoded tokens and extra. Only the parent depends on the previous block, so the
# rest is encoded for every block first and the chain is one concatenation + one sha256 per block
# (~20% faster than cbor2.dumps of the whole tuple per block; a test checks the bytes are equal).
_CBOR_PREFIX = b"\x83\x58\x20"  # array(3), bytes(32)
_CBOR_NULL = b"\xf6"


def _cbor_chain(
    tokens: list[int], n_blocks: int, block_size: int, seed: bytes, extra_keys: Sequence[tuple | None] | None
) -> list[bytes]:
    dumps = cbor2.dumps
    # Ints have one encoding in CBOR, so canonical=False is byte-identical for the token tuple and
    # skips the canonical encoder's per-call cost; extras may hold anything, so they stay canonical.
    tails = [
        dumps(tuple(tokens[i * block_size : (i + 1) * block_size]))
        + (
            _CBOR_NULL
            if extra_keys is None or extra_keys[i] is None
            else dumps(extra_keys[i], canonical=True)
        )
        for i in range(n_blocks)
    ]
    sha256 = hashlib.sha256
    digests: list[bytes] = []
    append = digests.append
    parent = seed
    for tail in tails:
        parent = sha256(_CBOR_PREFIX + parent + tail).digest()
        append(parent)
    return digests


def event_ints(digests: Sequence[bytes]) -> np.ndarray:
    """The 64-bit form vLLM publishes in KV events of every digest: its last 8 bytes, big-endian,
    unsigned; as a uint64 array (one join + one frombuffer, no int loop)."""
    if not digests:
        return np.empty(0, dtype=np.uint64)
    tails = b"".join(d[_DIGEST_BYTES - 8 :] for d in digests)
    return np.frombuffer(tails, dtype=">u8").astype(np.uint64)


@dataclass(frozen=True)
class VllmBlockHasher:
    """Block keys exactly as one vLLM engine configuration publishes them in its KV events.

    ``algo``, ``block_size`` and ``python_hash_seed`` must equal the engine's
    ``--prefix-caching-hash-algo``, hash block size and ``PYTHONHASHSEED`` (None when unset).
    """

    algo: HashAlgo
    block_size: int
    python_hash_seed: str | None = None
    # Derived once: NONE_HASH costs a hash and would otherwise be recomputed per prompt.
    seed: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "algo", HashAlgo.parse(self.algo))
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        object.__setattr__(self, "seed", none_hash(self.algo, self.python_hash_seed))

    def digests(
        self, token_ids: Sequence[int] | np.ndarray, extra_keys: Sequence[tuple | None] | None = None
    ) -> list[bytes]:
        """32-byte chained digests of every full block (see ``block_digests``)."""
        return block_digests(token_ids, self.block_size, self.algo, self.seed, extra_keys)

    def keys(
        self, token_ids: Sequence[int] | np.ndarray, extra_keys: Sequence[tuple | None] | None = None
    ) -> np.ndarray:
        """uint64 event keys of every full block: what ``BlockStored.block_hashes`` carries."""
        return event_ints(self.digests(token_ids, extra_keys))
