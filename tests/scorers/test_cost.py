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


def brute_force(prefill, decode, c, p) -> np.ndarray:
    """Reference: the full P×D matrix by explicit per-pair arithmetic."""
    costs = pair_costs(prefill, decode, c, p)
    full = np.full((len(prefill), len(decode)), np.inf)
    for i in range(len(prefill)):
        for j in range(len(decode)):
            if prefill.slots[i] == decode.slots[j]:
                continue
            transfer = costs.transfer_s[costs.prefill_class[i], j]
            ttft = costs.prefill_cost_s[i] + transfer + costs.tpot_s[j]
            column = costs.cost[0, j] - costs.ttft_s[0, j] / p.ttft_slo_s
            full[i, j] = ttft / p.ttft_slo_s + column
    return full


def test_class_reduction_equals_the_full_pair_matrix() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        kp, kd = rng.integers(1, 7), rng.integers(1, 7)
        prefill = cands(
            kp,
            queued_prefill_tokens=rng.integers(0, 20000, kp).tolist(),
            link_index=rng.integers(0, 2, kp).tolist(),
            cached_blocks=rng.integers(0, 60, kp).tolist(),
        )
        # Some decode pods are the same pods as prefill ones (prefill-decode role).
        slots = rng.choice(np.arange(10), size=kd, replace=False)
        decode = cands(
            kd, running=rng.integers(0, 30, kd).tolist(), link_index=rng.integers(0, 2, kd).tolist()
        )
        decode.slots = slots
        prefill.slots = rng.choice(np.arange(10), size=kp, replace=False)
        costs = pair_costs(prefill, decode, ctx(1000), params())
        expected = brute_force(prefill, decode, ctx(1000), params())
        assert np.allclose(costs.cost[1:].min(axis=0), expected.min(axis=0))
        for row in range(1, costs.cost.shape[0]):
            for col in range(kd):
                p = costs.prefill_of[row, col]
                if p >= 0:
                    assert np.isclose(costs.cost[row, col], expected[p, col])


def test_local_prefill_pays_for_stalling_the_running_batch() -> None:
    busy, idle = cands(1, running=[40]), cands(1, running=[0])
    no_prefill = cands(0)
    c = ctx(2000)
    assert pair_costs(no_prefill, busy, c, params()).interference_s[0] > 0
    assert pair_costs(no_prefill, idle, c, params()).interference_s[0] == 0


def test_a_prefill_on_a_pod_that_also_decodes_pays_for_its_stall_too() -> None:
    decode = cands(1, slots=[9])
    prefill_only = cands(1, running=[30], decodes=[False])
    both_roles = cands(1, running=[30], decodes=[True])
    c = ctx(2000)
    assert pair_costs(prefill_only, decode, c, params()).prefill_stall_s[0] == 0
    assert pair_costs(both_roles, decode, c, params()).prefill_stall_s[0] > 0


def test_disallowing_local_prefill_leaves_only_pairs() -> None:
    costs = pair_costs(cands(2), cands(2, slots=[5, 6]), ctx(), params(allow_local_prefill=False))
    assert np.isinf(costs.cost[0]).all() and np.isfinite(costs.cost[1:]).any()
