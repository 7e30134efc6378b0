"""Builders shared by unit tests: a pool from a tiny config, scraped-metrics stand-ins, a dict index."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from router.config import PoolConfig, parse_config
from router.pool import Pool
from router.request import RouteRequest


@dataclass(frozen=True)
class Metrics:
    """Duck-typed ``EngineMetrics`` for unit tests."""

    running: float | None = 0.0
    waiting: float | None = 0.0
    kv_usage: float | None = 0.0
    block_size: int | None = 16
    num_gpu_blocks: int | None = 4096
    prefix_queries: float | None = 0.0
    prefix_hits: float | None = 0.0


class DictIndex:
    """Naive PrefixIndex: slot -> set of keys (the reference behaviour)."""

    def __init__(self) -> None:
        self.blocks: dict[int, set[int]] = {}

    def match(self, block_keys: np.ndarray, slots: np.ndarray) -> np.ndarray:
        out = np.zeros(len(slots), dtype=np.int32)
        for i, slot in enumerate(slots):
            held = self.blocks.get(int(slot), set())
            n = 0
            for key in block_keys.tolist():
                if key not in held:
                    break
                n += 1
            out[i] = n
        return out

    def record(self, slot: int, block_keys: np.ndarray) -> None:
        self.blocks.setdefault(slot, set()).update(block_keys.tolist())

    def drop_slot(self, slot: int) -> None:
        self.blocks.pop(slot, None)


def make_config(endpoints: list[dict[str, Any]], **sections: Any) -> PoolConfig:
    return parse_config({"model": "m", "endpoints": endpoints, **sections})


def make_pool(config: PoolConfig, metrics: dict[str, Metrics] | None = None, now: float = 100.0) -> Pool:
    """A pool with every endpoint scraped at ``now`` (idle unless ``metrics`` says otherwise)."""
    pool = Pool(config.scrape)
    for endpoint_config in config.endpoints:
        endpoint = pool.add(endpoint_config)
        pool.apply_metrics(endpoint, (metrics or {}).get(endpoint.id, Metrics()), now)  # type: ignore[arg-type]
    return pool


def make_request(
    prompt_tokens: int, keys: list[int] | None = None, max_tokens: int = 16, **kw: Any
) -> RouteRequest:
    return RouteRequest(
        model="m",
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        block_keys=np.array(keys if keys is not None else [], dtype=np.uint64),
        body={},
        **kw,
    )
