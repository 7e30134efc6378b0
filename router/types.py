"""The core value types every layer shares: a request as the picker sees it, its limits, and one
scrape of an engine. Nothing here imports another ``router`` module (``docs/architecture.md``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class RouteRequest:
    """What the picker needs to know about one request; limits already enforced."""

    model: str
    prompt_tokens: int
    max_tokens: int
    block_keys: np.ndarray
    body: dict[str, Any]
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    stream: bool = False
    priority: int = 0
    subset: frozenset[str] | None = None
    prompt: str = ""  # the rendered prompt text (precise mode tokenizes it); never logged
    precise_keys: np.ndarray | None = None  # vLLM-exact block hashes, when the index is precise
    # False for a request without a body (a GET): one pod answers it, never a prefill -> decode pair.
    prefill_leg: bool = True


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_body_bytes: int
    max_prompt_tokens: int
    default_max_tokens: int
    block_tokens: int
    chars_per_token: float
    served_model: str | None = None  # strict single-model pool: any other model name is a 404


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """One scrape of one engine address; ``None`` means the metric was absent."""

    running: float | None  # vllm:num_requests_running
    waiting: float | None  # vllm:num_requests_waiting
    kv_usage: float | None  # vllm:kv_cache_usage_perc, 0..1
    block_size: int | None  # label of vllm:cache_config_info
    num_gpu_blocks: int | None  # label of vllm:cache_config_info
    prefix_queries: float | None  # vllm:prefix_cache_queries_total (counter, tokens)
    prefix_hits: float | None  # vllm:prefix_cache_hits_total (counter, tokens)

    @property
    def kv_capacity_tokens(self) -> float | None:
        """KV capacity in tokens (block size × blocks), when the engine reported both."""
        if self.block_size and self.num_gpu_blocks:
            return float(self.block_size * self.num_gpu_blocks)
        return None

    def is_empty(self) -> bool:
        """True when no wanted metric was found (not a vLLM metrics page)."""
        return all(getattr(self, name) is None for name in self.__slots__)
