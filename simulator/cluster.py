"""Glue between a router configuration and simulated engines: specs, link costs, matched speeds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from simulator.engine import EngineSpec, LinkCost, TimeModel

if TYPE_CHECKING:  # the quality harness runs older trees' routers, whose config lived elsewhere
    from router.server.config import LinksConfig, PoolConfig


def link_cost_from(links: LinksConfig) -> LinkCost:
    """The simulator's transfer cost from the router's link table (same numbers on both sides)."""
    pairs = {frozenset(p.between): p.cost() for p in links.pairs}
    same = links.same.cost()
    default = links.default.cost()

    def cost(link_a: str, link_b: str) -> tuple[float, float]:
        if link_a == link_b:
            return same
        return pairs.get(frozenset((link_a, link_b)), default)

    return cost


def engine_model_for(time_model: TimeModel, kv_bytes_per_token: int) -> dict[str, Any]:
    """The router's ``engine:`` section that predicts this simulator's speed."""
    speed = time_model.speed
    return {
        "prefill_tokens_per_s": speed / time_model.prefill_s_per_token,
        "decode_step_base_ms": time_model.step_base_s * 1000.0 / speed,
        "decode_ms_per_seq": time_model.decode_s_per_seq * 1000.0 / speed,
        "decode_ms_per_1k_kv_tokens": time_model.kv_s_per_token * 1e6 / speed,
        "kv_bytes_per_token": kv_bytes_per_token,
    }


def specs_from(config: PoolConfig, time_model: TimeModel, num_gpu_blocks: int = 2048) -> list[EngineSpec]:
    """One simulated engine per serving endpoint, on the endpoint's own port (a worker-only rank,
    ``serves: false``, holds a rank but no engine: the router never sends it anything)."""
    return [
        EngineSpec(
            name=endpoint.id,
            role=endpoint.role,
            link=endpoint.link,
            port=int(endpoint.address.rpartition(":")[2]),
            model=config.model,
            block_tokens=config.limits.block_tokens,
            num_gpu_blocks=num_gpu_blocks,
            chars_per_token=config.limits.chars_per_token,
            time=time_model,
            kv_bytes_per_token=config.engine.kv_bytes_per_token,
        )
        for endpoint in config.endpoints
        if endpoint.serves
    ]
