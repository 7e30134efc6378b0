"""PromptTokenizer: a real (tiny, trained offline) tokenizer → token ids → vLLM block keys."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from kvindex.tokenize import PromptTokenizer
from kvindex.vllm_hash import HashAlgo, VllmBlockHasher
from simulator.tiny_tokenizer import BOS, tiny_corpus, train_tiny_tokenizer

HASHER = VllmBlockHasher(HashAlgo.SHA256, block_size=4)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


class RecordingTokenizer(PromptTokenizer):
    """Counts encodes and records the thread each one ran on."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.encode_threads: list[int] = []

    def token_ids(self, text: str) -> list[int]:
        self.encode_threads.append(threading.get_ident())
        return super().token_ids(text)


@pytest.fixture
def tok(tokenizer_json: Path) -> Iterator[RecordingTokenizer]:
    with RecordingTokenizer(tokenizer_json, HASHER, offload_chars=200, cache_size=8) as t:
        yield t


def long_text(n_chars: int = 2000) -> str:
    text = " ".join(tiny_corpus())
    assert len(text) >= n_chars
    return text[:n_chars]


def test_token_ids_round_trip(tok: RecordingTokenizer, tokenizer_json: Path) -> None:
    text = "The router routes the prompt quickly."
    ids = tok.token_ids(text)
    raw = Tokenizer.from_file(str(tokenizer_json))
    assert ids == raw.encode(text).ids  # the fast batch path gives the same ids as encode()
    assert ids[0] == raw.token_to_id(BOS)  # add_special_tokens=True by default
    pieces = [raw.id_to_token(i) for i in ids[1:]]
    assert "[UNK]" not in pieces
    # The whitespace pre-tokenizer drops spaces, so the pieces spell the text without them.
    assert "".join(pieces) == text.replace(" ", "")
    assert {"router", "routes", "prompt", "quickly"} <= set(pieces)


def test_add_special_tokens_false(tokenizer_json: Path) -> None:
    text = "the router routes the prompt"
    with (
        PromptTokenizer(tokenizer_json, HASHER) as with_bos,
        PromptTokenizer(tokenizer_json, HASHER, add_special_tokens=False) as without,
    ):
        assert with_bos.token_ids(text)[1:] == without.token_ids(text)


def test_keys_equal_hasher_keys(tok: RecordingTokenizer) -> None:
    text = long_text(150)
    ids = tok.token_ids(text)
    assert len(ids) >= 2 * HASHER.block_size
    keys = tok.block_keys_sync(text)
    assert keys.dtype == np.uint64
    assert keys.tolist() == HASHER.keys(ids).tolist()
    assert len(keys) == len(ids) // HASHER.block_size


async def test_cache_hit_returns_identical_keys(tok: RecordingTokenizer) -> None:
    text = "the decode pod stores many blocks before decoding"
    first = await tok.block_keys(text)
    second = await tok.block_keys(text)
    assert second is first
    assert tok.block_keys_sync(text) is first
    assert len(tok.encode_threads) == 1
    assert (tok.hits, tok.misses, tok.cache_len) == (2, 1, 1)
    with pytest.raises(ValueError):
        first[0] = 0  # shared by every hit, so read-only


def test_lru_is_bounded_and_evicts_least_recent(tok: RecordingTokenizer) -> None:
    texts = [f"the router routes prompt number {i}" for i in range(tok.cache_size + 3)]
    keep = tok.block_keys_sync(texts[0])
    for text in texts[1:]:
        tok.block_keys_sync(texts[0])  # keep the first one recent
        tok.block_keys_sync(text)
    assert tok.cache_len == tok.cache_size
    calls = len(tok.encode_threads)
    assert tok.block_keys_sync(texts[0]) is keep
    tok.block_keys_sync(texts[1])  # evicted long ago: encoded again
    assert len(tok.encode_threads) == calls + 1


def test_cache_size_zero_disables_cache(tokenizer_json: Path) -> None:
    with PromptTokenizer(tokenizer_json, HASHER, cache_size=0) as t:
        a = t.block_keys_sync("the router routes the prompt again")
        assert t.block_keys_sync("the router routes the prompt again").tolist() == a.tolist()
        assert t.cache_len == 0


async def test_short_prompt_runs_inline(tok: RecordingTokenizer) -> None:
    await tok.block_keys("short prompt")
    assert tok.encode_threads == [threading.get_ident()]


async def test_long_prompt_runs_in_executor(tok: RecordingTokenizer) -> None:
    text = long_text(2000)
    assert len(text) > tok.offload_chars
    keys = await tok.block_keys(text)
    assert len(tok.encode_threads) == 1
    assert tok.encode_threads[0] != threading.get_ident()
    assert keys.tolist() == HASHER.keys(tok.token_ids(text)).tolist()
    assert await tok.block_keys(text) is keys  # and cached for the next request


async def test_concurrent_identical_long_prompts_encode_once(tok: RecordingTokenizer) -> None:
    text = long_text(3000)
    results = await asyncio.gather(*(tok.block_keys(text) for _ in range(5)))
    assert len(tok.encode_threads) == 1
    assert all(r is results[0] for r in results)


async def test_cancelled_waiter_does_not_lose_the_result(tok: RecordingTokenizer) -> None:
    text = long_text(2500)
    waiter = asyncio.ensure_future(tok.block_keys(text))
    await asyncio.sleep(0)
    waiter.cancel()
    keys = await tok.block_keys(text)  # joins the still-running computation or hits the cache
    assert len(tok.encode_threads) == 1
    assert keys.tolist() == HASHER.keys(tok.token_ids(text)).tolist()


def test_shared_prefix_gives_shared_leading_keys(tok: RecordingTokenizer) -> None:
    system = "You must route every request to the warm prefill pod within the slo. " * 3
    a = tok.block_keys_sync(system + "What is the queue latency of the decode pod?")
    b = tok.block_keys_sync(system + "Which replica should receive the next batch quickly?")
    system_ids = tok.token_ids(system)
    # The whitespace pre-tokenizer never merges across the space, so the system prompt's ids (and so
    # all its full blocks) are a prefix of both prompts' ids.
    assert tok.token_ids(system + "What")[: len(system_ids)] == system_ids
    n_shared = len(system_ids) // HASHER.block_size
    assert n_shared >= 3
    assert a[:n_shared].tolist() == b[:n_shared].tolist()
    assert a[n_shared + 1 :].tolist() != b[n_shared + 1 :].tolist()


def test_missing_file_error_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(ValueError, match=r"nope/tokenizer\.json"):
        PromptTokenizer(missing, HASHER)


def test_invalid_file_error_names_path(tmp_path: Path) -> None:
    bad = tmp_path / "broken.json"
    bad.write_text("{not a tokenizer")
    with pytest.raises(ValueError, match=r"broken\.json"):
        PromptTokenizer(str(bad), HASHER)


def test_bad_arguments(tokenizer_json: Path) -> None:
    for kwargs in ({"cache_size": -1}, {"offload_chars": -1}, {"workers": 0}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            PromptTokenizer(tokenizer_json, HASHER, **kwargs)  # type: ignore[arg-type]


async def test_close_stops_offloading(tokenizer_json: Path) -> None:
    t = PromptTokenizer(tokenizer_json, HASHER, offload_chars=10)
    assert len(await t.block_keys(long_text(100))) > 0
    t.close()
    with pytest.raises(RuntimeError):
        await t.block_keys(long_text(200))
    assert len(t.block_keys_sync(long_text(200))) > 0  # sync use still works after close


async def test_token_ids_are_hashed_as_they_are_cached_and_offloaded_when_long(
    tok: RecordingTokenizer,
) -> None:
    ids = tok.token_ids("The router routes the prompt quickly.")
    keys = (await tok.tokenize_ids(ids)).keys
    assert np.array_equal(keys, HASHER.keys(ids)) and not keys.flags.writeable
    assert tok.encode_threads == [threading.get_ident()]  # the one encode above: ids need none
    hits = tok.hits
    assert (await tok.tokenize_ids(list(ids))).keys is keys and tok.hits == hits + 1

    many = list(range(300))  # over offload_chars (200): hashed in the executor
    offloaded = await tok.tokenize_ids(many)
    assert np.array_equal(offloaded.keys, HASHER.keys(many)) and offloaded.tokens == 300
    assert await tok.tokenize_ids(many) is offloaded  # cached once settled
