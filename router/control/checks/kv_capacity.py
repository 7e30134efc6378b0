"""``kv_capacity``: ``/metrics`` scrapes and reports a KV capacity (``vllm:cache_config_info``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from router.control.checks.base import DefaultOn, GateFailed, ReadyCheck, serving
from router.observe.scrape import ScrapeError

if TYPE_CHECKING:
    from router.control.gate import Gate
    from router.control.topology import GroupSpec


async def kv_capacity(gate: Gate, group: GroupSpec) -> str:
    capacities = []
    pool = gate.pool
    for address in serving(group):
        try:
            metrics = await gate.scraper.scrape(address)
        except ScrapeError as exc:
            raise GateFailed(f"metrics: {exc}") from None
        capacity = metrics.kv_capacity_tokens
        if not capacity:
            raise GateFailed(f"{address} reports no KV capacity (vllm:cache_config_info num_gpu_blocks)")
        capacities.append(f"{capacity:.0f}")
        # Fresh metrics: once admitted, the endpoint is a candidate at once, not a scrape later.
        slot = pool.slot_by_address.get(address)
        endpoint = None if slot is None else pool.by_slot[slot]
        if endpoint is not None:
            pool.apply_metrics(endpoint, metrics, time.monotonic())
    return "KV tokens " + ", ".join(capacities)


CHECK = ReadyCheck("kv_capacity", 40, DefaultOn(("static", "kubernetes")), kv_capacity)
