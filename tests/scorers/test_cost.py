import numpy as np
from scorer_cases import MODEL, cands, ctx

from scorers.cost import CostParams, Weights, pair_costs
from scorers.link import LinkTable

TABLE = LinkTable.build({"a": 0, "b": 1}, same=(0.0001, 50e9), default=(0.005, 1e9), pairs={})


def params(**overrides: object) -> CostParams:
    base = dict(
        ttft_slo_s=1.0,
        tpot_slo_s=0.05,
        max_wait_skew_s=1.0,
        kv_soft_threshold=0.9,
        allow_local_prefill=True,
        local_prefill_interference=1.0,
        weights=Weights(),
        model=MODEL,
        links=TABLE,
    )
    return CostParams(**{**base, **overrides})  # type: ignore[arg-type]


def brute_force(costs, cand, c, p) -> np.ndarray:
    """Reference: the full P×D matrix by explicit per-pair arithmetic over candidate positions."""
    column = costs.cost[0] - costs.ttft_s[0] / p.ttft_slo_s
    full = np.full((len(cand), len(costs.decode)), np.inf)
    for i in costs.prefill:
        for j, d in enumerate(costs.decode):
            if i == d:
                continue
            link_i, link_d = cand.link_index[i], cand.link_index[d]
            missing = (
                c.prompt_tokens - min(cand.cached_blocks[d] * 16, c.prompt_tokens - 1)
            ) * MODEL.kv_bytes_per_token
            transfer = TABLE.latency_s[link_i, link_d] + missing / TABLE.bytes_per_s[link_i, link_d]
            ttft = (
                costs.route_s[i]
                + transfer
                + 2 * costs.tpot_s[d]
                + MODEL.decode_step_base_s
                + MODEL.pd_leg_overhead_s
            )
            full[i, j] = ttft / p.ttft_slo_s + column[j]
    return full


def test_class_reduction_equals_the_full_pair_matrix() -> None:
    rng = np.random.default_rng(3)
    for _ in range(60):
        k = int(rng.integers(1, 9))
        cand = cands(
            k,
            queued_prefill_tokens=rng.integers(0, 20000, k).tolist(),
            running=rng.integers(0, 30, k).tolist(),
            link_index=rng.integers(0, 2, k).tolist(),
            cached_blocks=rng.integers(0, 60, k).tolist(),
            decodes=rng.random(k) < 0.5,
        )
        role = rng.integers(0, 3, k)  # 0 prefill, 1 decode, 2 prefill-decode
        is_prefill, is_decode = role != 1, role != 0
        cand.decodes = is_decode
        if not is_decode.any():
            continue
        costs = pair_costs(cand, is_prefill, is_decode, ctx(1000), params())
        expected = brute_force(costs, cand, ctx(1000), params())
        if len(costs.prefill):
            assert np.allclose(costs.cost[1:].min(axis=0), expected.min(axis=0))
        for row in range(1, costs.cost.shape[0]):
            for col in range(len(costs.decode)):
                p = costs.prefill_of[row, col]
                if p >= 0:
                    assert np.isclose(costs.cost[row, col], expected[p, col])
                    assert p != costs.decode[col]


def test_local_prefill_pays_for_stalling_the_running_batch() -> None:
    c = ctx(2000)
    busy = pair_costs(
        cands(1, running=[40], decodes=[True]), np.array([False]), np.array([True]), c, params()
    )
    idle = pair_costs(cands(1, running=[0], decodes=[True]), np.array([False]), np.array([True]), c, params())
    assert busy.stall_s[0] > 0 and idle.stall_s[0] == 0
    assert busy.cost[0, 0] > idle.cost[0, 0]


def test_a_prefill_on_a_pod_that_also_decodes_pays_for_its_stall_too() -> None:
    cand = cands(3, running=[30, 30, 0], decodes=[False, True, True])
    is_prefill, is_decode = np.array([True, True, False]), np.array([False, True, True])
    costs = pair_costs(cand, is_prefill, is_decode, ctx(2000), params())
    assert costs.stall_s[0] == 0 and costs.stall_s[1] > 0
    # Decode on pod 2: prefill-only pod 0 is the cheaper prefill source (same queue, no stall).
    assert costs.prefill_of[1, 1] == 0


def test_disallowing_local_prefill_leaves_only_pairs() -> None:
    cand = cands(4, decodes=[False, False, True, True])
    is_decode = np.array([False, False, True, True])
    costs = pair_costs(cand, ~is_decode, is_decode, ctx(), params(allow_local_prefill=False))
    assert np.isinf(costs.cost[0]).all() and np.isfinite(costs.cost[1:]).any()
