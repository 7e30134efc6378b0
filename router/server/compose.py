"""From a validated ``PoolConfig`` to the domain objects, units converted once (ms → s, GB/s → B/s).

Part of the composition root with ``app`` and ``cli``: the domain modules below take plain values
in seconds and never see the configuration's shape.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvindex.base import PrefixIndex
from router.control.gate import GateSettings
from router.flow.hold_queue import FlowSettings
from router.request.rewrite import ModelRewrites
from router.scheduling.costmodel.link import LinkCosts, LinkOverlay
from router.scheduling.costmodel.matrix import CostModel, WeightedTerm
from router.scheduling.costmodel.policies import POLICIES
from router.scheduling.costmodel.registry import load_term
from router.scheduling.costmodel.view import EngineModel, Objectives
from router.scheduling.filters import SubsetHint
from router.scheduling.picker import Picker, PickerSettings
from router.server.config import PoolConfig
from router.signals.perf import LearnSettings
from router.signals.scaling import ScalingSettings
from router.state.pool import Pool

# A file's endpoints are what the operator wrote: cheap checks. A cluster's pods come and go with
# rollouts, so their weights and connectors are proven before traffic.
STATIC_CHECKS = ("ranks", "revision", "kv_capacity")
KUBERNETES_CHECKS = ("ranks", "revision", "model", "kv_capacity", "canary", "canary_pair")


def model_rewrites_from(config: PoolConfig, seed: int | None = None) -> ModelRewrites:
    return ModelRewrites(
        [
            (rule.name or rule.model, rule.model, [(t.model, t.weight) for t in rule.targets])
            for rule in config.model_rewrites
        ],
        random.Random(seed),
    )


def gate_settings_from(config: PoolConfig) -> GateSettings:
    gate = config.gate
    checks = (
        gate.checks
        if gate.checks is not None
        else (KUBERNETES_CHECKS if config.kubernetes is not None else STATIC_CHECKS)
    )
    return GateSettings(
        model=config.model,
        checks=tuple(checks),
        check_timeout_s=gate.check_timeout_s,
        canary_max_tokens=gate.canary_max_tokens,
        canary_min_interval_s=gate.canary_min_interval_s,
    )


def empty_pool(config: PoolConfig) -> Pool:
    """The pool's settings from the configuration, no endpoint yet: the service fills it from
    discovery and the gate (``router.server.app``)."""
    return Pool(
        stale_after_s=config.scrape.stale_after_ms / 1000.0,
        eject_after_failures=config.scrape.eject_after_failures,
        typical_prompt_tokens=config.engine.typical_prompt_tokens,
        typical_answer_tokens=config.limits.default_max_tokens,
    )


def pool_from(config: PoolConfig) -> Pool:
    """The configured endpoints, admitted without a gate: for unit tests and benchmarks of the
    picker alone."""
    pool = empty_pool(config)
    for endpoint in config.endpoints:
        pool.add(endpoint)
    return pool


def link_costs_from(config: PoolConfig) -> LinkCosts:
    links = config.links
    return LinkCosts(
        same=links.same.cost(),
        default=links.default.cost(),
        pairs=tuple((p.between, p.cost()) for p in links.pairs),
    )


def cost_model_from(config: PoolConfig) -> CostModel:
    engine = config.engine
    return CostModel(
        objectives=Objectives(
            ttft_slo_s=config.slo.ttft_ms / 1000.0,
            tpot_slo_s=config.slo.tpot_ms / 1000.0,
            kv_soft_threshold=config.picker.kv_soft_threshold,
            max_wait_skew_s=config.picker.max_wait_skew_ms / 1000.0,
            prefix_trust=config.weight("prefix"),
        ),
        model=EngineModel(
            prefill_tokens_per_s=engine.prefill_tokens_per_s,
            decode_step_base_s=engine.decode_step_base_ms / 1000.0,
            pd_leg_overhead_s=engine.pd_leg_overhead_ms / 1000.0,
            decode_s_per_seq=engine.decode_ms_per_seq / 1000.0,
            decode_s_per_kv_token=engine.decode_ms_per_1k_kv_tokens / 1e6,
            kv_bytes_per_token=engine.kv_bytes_per_token,
        ),
        links=link_costs_from(config),
        terms=tuple(WeightedTerm(load_term(name), w) for name, w in config.term_weights().items()),
        link_weight=config.weight("link"),
        allow_local_prefill=config.picker.allow_local_prefill,
        pair_waits_for_decode_queue=config.picker.pair_waits_for_decode_queue,
        # Role-flexible P/D is the joint picker's own move (the baselines pair as their peers do),
        # and an operator who asked for pairs always (no local prefill) gets pairs.
        prefill_may_decode=config.picker.prefill_may_decode
        and config.picker.policy == "joint"
        and config.picker.allow_local_prefill,
    )


def picker_from(
    config: PoolConfig,
    pool: Pool,
    index: PrefixIndex,
    *,
    precise: PrefixIndex | None = None,
    seed: int | None = None,
    defer: Callable[..., object] | None = None,
    links: LinkOverlay | None = None,
) -> Picker:
    return Picker(
        pool,
        index,
        cost_model_from(config),
        POLICIES[config.picker.policy](seed),
        PickerSettings(
            block_tokens=config.limits.block_tokens,
            fallbacks=config.picker.fallbacks,
            shed_ttft_factor=config.picker.shed_ttft_factor,
            max_wait_s=config.flow_control.max_wait_ms / 1000.0 if config.flow_control.enabled else None,
        ),
        filters=(SubsetHint(pool),),
        precise=precise,
        defer=defer,
        links=links,
    )


def learn_settings_from(config: PoolConfig) -> LearnSettings:
    signals = config.signals
    return LearnSettings(
        perf_model=signals.learns("perf_model"),
        token_ratio=signals.learns("token_ratio"),
        cached_evidence=signals.learns("cached_evidence"),
        engine_speed=signals.learns("engine_speed"),
        min_samples=signals.min_samples,
        prior_samples=signals.prior_samples,
        observed_window_s=signals.observed_window_s,
    )


def scaling_settings_from(config: PoolConfig) -> ScalingSettings:
    signals = config.signals
    roles = ("prefill", "decode")
    return ScalingSettings(
        tick_s=signals.tick_ms / 1000.0,
        ready_time_s=signals.ready_time_s,
        scale_down_window_s=signals.scale_down_window_s,
        level_window_s=signals.level_window_s,
        trend_window_s=signals.trend_window_s,
        max_growth=signals.max_growth,
        trend_significance=signals.trend_significance,
        min_rate_requests=signals.min_rate_requests,
        backlog_drain_s=signals.backlog_drain_s,
        max_utilization=signals.max_utilization,
        kv_target=signals.kv_target,
        min_replicas=tuple(getattr(signals.min_replicas, role) for role in roles),  # type: ignore[arg-type]
        max_replicas=tuple(getattr(signals.max_replicas, role) for role in roles),  # type: ignore[arg-type]
    )


def flow_settings_from(config: PoolConfig) -> FlowSettings:
    flow = config.flow_control
    return FlowSettings(flow.max_queue, flow.queue_timeout_ms / 1000.0, flow.poll_ms / 1000.0)
