"""Approximate block keys: pinned values (replicas of different versions share them through Redis
during a rolling upgrade, so a key must never change), and the chain as the module describes it."""

from __future__ import annotations

import hashlib

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvindex.hashing import text_block_keys, token_block_keys


def chain(root: bytes, blocks: list[bytes]) -> list[int]:
    """The module docstring's definition, block by block."""
    keys, parent = [], root
    for block in blocks:
        parent = hashlib.blake2b(parent + block, digest_size=8).digest()
        keys.append(int.from_bytes(parent, "little"))
    return keys


def test_keys_are_pinned() -> None:
    assert text_block_keys("You are a helpful assistant. " * 8, 64).tolist() == [
        7426558803824486687,
        13200650262987965545,
        11134576845209606076,
    ]
    unicode = text_block_keys("Grüße, 東京! " * 20, 16)
    assert len(unicode) == 13
    assert unicode[:4].tolist() == [
        9742798991249142291,
        1091710877018148336,
        16198288008100373696,
        17905802764769357990,
    ]
    assert token_block_keys(list(range(40)), 16).tolist() == [4526895903267235764, 12660923831399632162]


@given(st.text(max_size=400), st.integers(1, 40))
def test_text_keys_chain_each_full_character_block(text: str, block_chars: int) -> None:
    n = len(text) // block_chars
    blocks = [
        text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass") for i in range(n)
    ]
    keys = text_block_keys(text, block_chars)
    assert keys.dtype == np.uint64 and keys.tolist() == chain(b"pd-router/v1", blocks)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(1, 20))
def test_token_keys_chain_each_full_block_of_ids(ids: list[int], block_tokens: int) -> None:
    n = len(ids) // block_tokens
    blocks = [
        b"".join(i.to_bytes(4, "little") for i in ids[b * block_tokens : (b + 1) * block_tokens])
        for b in range(n)
    ]
    keys = token_block_keys(ids, block_tokens)
    assert keys.dtype == np.uint64 and keys.tolist() == chain(b"pd-router/ids/v1", blocks)
