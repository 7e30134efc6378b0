"""vLLM-exact block hashes: the reference vectors of kv-routing.md §9.5 and the chain's properties."""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.vllm_hash import HashAlgo, VllmBlockHasher, block_digests, event_ints, none_hash

# Reference vectors from vLLM 0.33's own hashing code (kv-routing.md §9.5), block size 16.
NONE_HASH_HEX = {
    HashAlgo.SHA256: "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
    HashAlgo.SHA256_CBOR: "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
}
BLOCK0_HEX = {
    HashAlgo.SHA256: "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798",
    HashAlgo.SHA256_CBOR: "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749",
}
BLOCK0_INT = {HashAlgo.SHA256: 3262291359910021016, HashAlgo.SHA256_CBOR: 2233398808101521225}
BLOCK1_INT = {HashAlgo.SHA256: 7142137847444424233, HashAlgo.SHA256_CBOR: 17911472383915781900}
LORA_BLOCK0_INT = {HashAlgo.SHA256: 11258382377252743191, HashAlgo.SHA256_CBOR: 5174291320956968451}
SEED42_BLOCK0_INT = {HashAlgo.SHA256: 12181739546299357825, HashAlgo.SHA256_CBOR: 2863503375995570957}

ALGOS = list(HashAlgo)


@pytest.mark.parametrize("algo", ALGOS)
def test_none_hash_reference(algo: HashAlgo) -> None:
    assert none_hash(algo, None).hex() == NONE_HASH_HEX[algo]


@pytest.mark.parametrize("algo", ALGOS)
def test_block0_and_block1_reference(algo: HashAlgo) -> None:
    digests = block_digests(list(range(32)), 16, algo, none_hash(algo, None))
    assert len(digests) == 2
    assert digests[0].hex() == BLOCK0_HEX[algo]
    assert int(event_ints([digests[0]])[0]) == BLOCK0_INT[algo]
    assert int(event_ints([digests[1]])[0]) == BLOCK1_INT[algo]
    keys = VllmBlockHasher(algo, 16).keys(list(range(32)))
    assert keys.dtype == np.uint64
    assert keys.tolist() == [BLOCK0_INT[algo], BLOCK1_INT[algo]]


@pytest.mark.parametrize("algo", ALGOS)
def test_lora_extra_key_reference(algo: HashAlgo) -> None:
    # vLLM's extra for a block is a tuple of tagged extras; a LoRA request contributes one entry.
    extra = (("lora", "my-lora", "/path/a"),)
    keys = VllmBlockHasher(algo, 16).keys(list(range(16)), extra_keys=[extra])
    assert keys.tolist() == [LORA_BLOCK0_INT[algo]]


@pytest.mark.parametrize("algo", ALGOS)
def test_pythonhashseed_reference(algo: HashAlgo) -> None:
    hasher = VllmBlockHasher(algo, 16, python_hash_seed="42")
    assert hasher.seed == none_hash(algo, "42") != none_hash(algo, None)
    assert hasher.keys(list(range(16))).tolist() == [SEED42_BLOCK0_INT[algo]]


def test_hand_written_cbor_recipe() -> None:
    # The cross-language recipe of §9.5: a plain CBOR array [seed, [ints], null], canonical.
    seed = none_hash(HashAlgo.SHA256_CBOR, None)
    digest = hashlib.sha256(cbor2.dumps([seed, list(range(16)), None], canonical=True)).digest()
    assert digest.hex() == BLOCK0_HEX[HashAlgo.SHA256_CBOR]


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**40), max_size=70),
    block_size=st.integers(1, 20),
    algo=st.sampled_from(ALGOS),
    with_extra=st.booleans(),
)
def test_matches_naive_vllm_recipe(
    tokens: list[int], block_size: int, algo: HashAlgo, with_extra: bool
) -> None:
    """The fast paths hash exactly the bytes of vLLM's `hash_fn((parent, tuple(tokens), extra))`."""
    n_blocks = len(tokens) // block_size
    extras: list[tuple | None] | None = None
    if with_extra:
        extras = [(("lora", "a", "/p"),) if i % 2 else None for i in range(n_blocks)]
    if algo is HashAlgo.SHA256:

        def h(obj: object) -> bytes:
            return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    else:

        def h(obj: object) -> bytes:
            return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()

    parent = h("vllm-none-hash")
    expected = []
    for i in range(n_blocks):
        extra = None if extras is None else extras[i]
        parent = h((parent, tuple(tokens[i * block_size : (i + 1) * block_size]), extra))
        expected.append(parent)
    assert block_digests(tokens, block_size, algo, h("vllm-none-hash"), extras) == expected


@pytest.mark.parametrize("algo", ALGOS)
def test_partial_last_block_not_hashed(algo: HashAlgo) -> None:
    hasher = VllmBlockHasher(algo, 16)
    full = hasher.keys(list(range(32)))
    assert hasher.keys(list(range(47))).tolist() == full.tolist()
    assert hasher.keys(list(range(15))).shape == (0,)
    assert hasher.keys([]).shape == (0,)
    assert len(hasher.keys(list(range(48)))) == 3


@pytest.mark.parametrize("algo", ALGOS)
def test_chaining(algo: HashAlgo) -> None:
    hasher = VllmBlockHasher(algo, 16)
    tokens = list(range(100, 100 + 16 * 8))
    base = hasher.keys(tokens)

    first_changed = hasher.keys([999_999, *tokens[1:]])
    assert np.all(first_changed != base), "token 0 feeds every later key through the chain"

    block3_changed = list(tokens)
    block3_changed[3 * 16 + 5] += 1
    keys = hasher.keys(block3_changed)
    assert keys[:3].tolist() == base[:3].tolist()
    assert np.all(keys[3:] != base[3:])


@pytest.mark.parametrize("algo", ALGOS)
def test_numpy_token_ids_hash_like_python_ints(algo: HashAlgo) -> None:
    hasher = VllmBlockHasher(algo, 16)
    tokens = list(range(40))
    for arr in (np.arange(40, dtype=np.int64), np.arange(40, dtype=np.uint32)):
        assert hasher.keys(arr).tolist() == hasher.keys(tokens).tolist()
    assert hasher.keys(tuple(tokens)).tolist() == hasher.keys(tokens).tolist()


def test_event_ints_are_the_low_64_bits_big_endian() -> None:
    digests = [bytes(range(32)), *(bytes([i]) * 32 for i in (0, 1, 255))]
    assert event_ints(digests).tolist() == [int.from_bytes(d[24:], "big") for d in digests]
    assert event_ints([]).dtype == np.uint64


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor", "md5"])
def test_unsupported_algo_is_rejected_by_name(algo: str) -> None:
    with pytest.raises(ValueError, match=algo):
        VllmBlockHasher(algo, 16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=algo):
        none_hash(algo, None)  # type: ignore[arg-type]


def test_hasher_accepts_algo_string_and_validates() -> None:
    assert VllmBlockHasher("sha256_cbor", 16).algo is HashAlgo.SHA256_CBOR  # type: ignore[arg-type]
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="block_size"):
            VllmBlockHasher(HashAlgo.SHA256, bad)
    hasher = VllmBlockHasher(HashAlgo.SHA256, 16)
    with pytest.raises(ValueError, match="extra_keys"):
        hasher.keys(list(range(32)), extra_keys=[None])
    with pytest.raises(TypeError, match="tuple"):
        hasher.keys(list(range(16)), extra_keys=[["lora", "x", "/p"]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="seed"):
        block_digests(list(range(16)), 16, HashAlgo.SHA256, b"short")


def test_hasher_is_frozen_value() -> None:
    a = VllmBlockHasher(HashAlgo.SHA256, 16, "42")
    assert a == VllmBlockHasher(HashAlgo.SHA256, 16, "42")
    assert a != VllmBlockHasher(HashAlgo.SHA256, 16)
    with pytest.raises(AttributeError):
        a.block_size = 32  # type: ignore[misc]
