"""Prompt text → token ids → vLLM block keys, with long prompts tokenized off the event loop.

The text must be what the engine tokenizes (for chat requests: after the chat template), and
``add_special_tokens`` must match how the engine's API tokenizes it (vLLM's completions API adds
them, e.g. a BOS), or every key differs from the engine's from block 0 on. A prompt the client
gave as token ids is hashed as it is (``tokenize_ids``): vLLM neither tokenizes it nor adds
special tokens.

Caching: an LRU maps a *digest of the text* (16-byte BLAKE2b of its UTF-8) to its read-only key
array. A digest rather than the text itself because prompts can be hundreds of kilobytes: keying by
text would keep up to ``cache_size`` whole prompts alive (memory, and prompt text lingering in the
heap), while the digest costs ~1 µs per kB, small next to tokenizing, and a 128-bit collision is
not a practical concern. Token ids share the LRU under a digest of their own kind.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple, TypeVar

import numpy as np
from tokenizers import Tokenizer

from kvindex.vllm_hash import VllmBlockHasher

_P = TypeVar("_P", str, Sequence[int])


class Tokenized(NamedTuple):
    """A prompt as the engine sees it: its block keys (read-only) and its exact token count."""

    keys: np.ndarray
    tokens: int


class PromptTokenizer:
    """Tokenize prompts with a local Hugging Face ``tokenizer.json`` and compute their vLLM block keys.

    Not thread-safe by itself: call it from the one event loop that owns the router's state (the
    executor threads only run the pure encode + hash of one text).
    """

    def __init__(
        self,
        tokenizer_json: str | Path,
        hasher: VllmBlockHasher,
        *,
        add_special_tokens: bool = True,
        cache_size: int = 4096,
        offload_chars: int = 8192,
        workers: int = 1,
    ) -> None:
        path = Path(tokenizer_json)
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        if offload_chars < 0:
            raise ValueError(f"offload_chars must be >= 0, got {offload_chars}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not path.is_file():
            raise ValueError(f"tokenizer file not found: {path}")
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for malformed JSON
            raise ValueError(f"cannot load tokenizer {path}: {exc}") from exc
        self.path = path
        self.hasher = hasher
        self.add_special_tokens = add_special_tokens
        self.cache_size = cache_size
        self.offload_chars = offload_chars
        self._cache: OrderedDict[bytes, Tokenized] = OrderedDict()
        # In-flight offloaded texts, so a burst of the same long prompt tokenizes it once.
        self._pending: dict[bytes, asyncio.Future[Tokenized]] = {}
        # Threads start lazily on the first submit, so an instance that never offloads costs nothing.
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pd-tokenize")
        self.hits = 0
        self.misses = 0

    def token_ids(self, text: str) -> list[int]:
        """Token ids of ``text``, exactly as the engine's tokenizer produces them."""
        # encode_batch_fast skips char offsets (several times faster than encode) and releases the
        # GIL while encoding, which is what lets executor threads run beside the event loop.
        return self._tokenizer.encode_batch_fast([text], add_special_tokens=self.add_special_tokens)[0].ids

    def _compute(self, text: str) -> Tokenized:
        return self._hash_ids(self.token_ids(text))

    def _hash_ids(self, ids: Sequence[int]) -> Tokenized:
        keys = self.hasher.keys(ids)
        keys.flags.writeable = False  # shared by every cache hit: callers must not mutate it
        return Tokenized(keys, len(ids))

    @staticmethod
    def _digest(text: str) -> bytes:
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    @staticmethod
    def _ids_digest(ids: Sequence[int]) -> bytes:
        # Another personalisation: ids and a text with the same bytes are different prompts.
        data = np.asarray(ids, dtype="<u4").tobytes()
        return hashlib.blake2b(data, digest_size=16, person=b"token ids").digest()

    def _lookup(self, digest: bytes) -> Tokenized | None:
        found = self._cache.get(digest)
        if found is None:
            self.misses += 1
            return None
        self._cache.move_to_end(digest)
        self.hits += 1
        return found

    def _store(self, digest: bytes, tokenized: Tokenized) -> None:
        if self.cache_size == 0:
            return
        self._cache[digest] = tokenized
        self._cache.move_to_end(digest)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    @property
    def cache_len(self) -> int:
        """Entries currently in the LRU."""
        return len(self._cache)

    def block_keys_sync(self, text: str) -> np.ndarray:
        """Read-only uint64 block keys of ``text`` (cached), computed on the calling thread."""
        return self._cached_sync(self._digest(text), self._compute, text).keys

    async def block_keys(self, text: str) -> np.ndarray:
        """Read-only uint64 block keys of ``text`` (cached): ``tokenize(text).keys``."""
        return (await self.tokenize(text)).keys

    async def tokenize(self, text: str) -> Tokenized:
        """The block keys and exact token count of ``text`` (cached).

        Prompts of at most ``offload_chars`` characters are computed inline (a thread hop would cost
        more than the work); longer ones in the executor, so the event loop keeps serving.
        """
        return await self._cached(self._digest(text), self._compute, text, len(text))

    async def tokenize_ids(self, ids: Sequence[int]) -> Tokenized:
        """The block keys (read-only, cached) and count of a prompt given as token ids (each below
        2**32), hashed as they are; in the executor beyond ``offload_chars`` ids: hashing one id
        costs about what tokenizing and hashing one character does."""
        return await self._cached(self._ids_digest(ids), self._hash_ids, ids, len(ids))

    def _cached_sync(self, digest: bytes, compute: Callable[[_P], Tokenized], prompt: _P) -> Tokenized:
        found = self._lookup(digest)
        if found is None:
            found = compute(prompt)
            self._store(digest, found)
        return found

    async def _cached(
        self, digest: bytes, compute: Callable[[_P], Tokenized], prompt: _P, work: int
    ) -> Tokenized:
        if work <= self.offload_chars:
            return self._cached_sync(digest, compute, prompt)
        found = self._lookup(digest)
        if found is not None:
            return found
        future = self._pending.get(digest)
        if future is None:
            future = asyncio.get_running_loop().run_in_executor(self._executor, compute, prompt)
            self._pending[digest] = future
            future.add_done_callback(lambda fut: self._settle(digest, fut))
        # shield: one cancelled waiter must not cancel the shared computation for the others.
        return await asyncio.shield(future)

    def _settle(self, digest: bytes, future: asyncio.Future[Tokenized]) -> None:
        # Runs on the loop whether or not anyone still awaits, so the result is cached either way.
        self._pending.pop(digest, None)
        if not future.cancelled() and future.exception() is None:
            self._store(digest, future.result())

    def close(self) -> None:
        """Stop the executor; queued offloads are cancelled, a running one finishes in the background."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> PromptTokenizer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
