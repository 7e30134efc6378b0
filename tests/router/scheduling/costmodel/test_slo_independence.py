"""The SLO targets do not set the routing trade: TPOT and KV pressure are priced by their own
exchange rates (``picker.tpot_weight``, ``picker.kv_penalty_tokens``), so a pool configured with a
tight or a loose SLO routes the same requests the same way (docs/quality.md: the ratio of the SLOs
used as the rate made routing up to 2× worse at the targets users set)."""

import numpy as np
from scorer_cases import LINKS, cands, ctx

from router.scheduling.costmodel.matrix import derive, pair_costs
from router.server.compose import cost_model_from
from router.server.config import PoolConfig

TABLE = LINKS.table({"a": 0, "b": 1})


def busy_pool():
    """Three pods that decode, unevenly loaded and nearly full: every decode-side term is non-zero."""
    return cands(
        running=[2.0, 20.0, 40.0],
        inflight_requests=[2, 20, 40],
        kv_usage=[0.5, 0.8, 0.9],
        queued_prefill_tokens=[0.0, 3000.0, 500.0],
        can_decode=[True, True, True],
        cached_blocks=[0, 40, 60],
    )


def seconds(config: dict) -> tuple[np.ndarray, np.ndarray]:
    """Each pod's prefill-side and decode-side seconds under the pool configured by ``config``."""
    endpoints = [{"address": "127.0.0.1:8000", "role": "prefill-decode"}]
    cm = cost_model_from(PoolConfig.model_validate({"model": "m", "endpoints": endpoints, **config}))
    cand = busy_pool()
    everyone = np.ones(len(cand), dtype=bool)
    costs = pair_costs(derive(cand, ctx(prompt_tokens=2000), cm), everyone, everyone, cm, TABLE)
    return costs.route_s, costs.column_s


def test_how_tight_the_slos_are_set_does_not_change_a_pod_s_price() -> None:
    route, column = seconds({"slo": {"ttft_ms": 500, "tpot_ms": 50}})
    for slo in ({"ttft_ms": 2000, "tpot_ms": 100}, {"ttft_ms": 1000, "tpot_ms": 20}):
        other_route, other_column = seconds({"slo": slo})
        np.testing.assert_array_equal(other_route, route)
        np.testing.assert_array_equal(other_column, column)


def test_the_exchange_rates_are_what_prices_tpot_and_kv_pressure() -> None:
    _, column = seconds({})
    _, heavier = seconds({"picker": {"tpot_weight": 20.0, "kv_penalty_tokens": 20000.0}})
    # Both decode-side terms (load, kv) double with their rates; the busiest pod's price with them.
    np.testing.assert_allclose(heavier, 2.0 * column)
    assert column[2] > column[0] > 0
