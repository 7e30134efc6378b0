import math

import numpy as np
from scorer_cases import LINKS, MODEL, cands, cost_model, ctx, view

from router.scheduling.costmodel.matrix import WeightedTerm, derive, pair_costs
from router.scheduling.costmodel.registry import DEFAULT_WEIGHTS, load_term
from router.scheduling.costmodel.terms import lora
from router.scheduling.costmodel.view import (
    ADAPTER_EVICTS,
    ADAPTER_FREE_SLOT,
    ADAPTER_NOT_SERVED,
    ADAPTER_RESIDENT,
)

TERM = lora.term()


def seconds(state: list[int], **features: list[float]) -> np.ndarray:
    c = cands(len(state), **features)
    c.adapter_state = np.array(state, dtype=np.int8)
    return TERM.seconds(view(c))


def test_a_request_without_an_adapter_costs_nothing_anywhere() -> None:
    assert TERM.seconds(view(cands(3))).tolist() == [0.0, 0.0, 0.0]


def test_resident_is_free_a_free_slot_pays_a_load_a_full_pod_a_load_and_an_eviction() -> None:
    s = seconds([ADAPTER_RESIDENT, ADAPTER_FREE_SLOT, ADAPTER_EVICTS])
    assert s[0] == 0.0
    assert math.isclose(s[1], MODEL.lora_load_s)  # idle pods: nothing running to stall
    assert math.isclose(s[2], MODEL.lora_load_s + MODEL.lora_evict_s)


def test_a_load_also_stalls_the_decodes_running_there() -> None:
    s = seconds([ADAPTER_FREE_SLOT, ADAPTER_FREE_SLOT], running=[0, 20], can_decode=[1, 1])
    assert s[1] > s[0] > 0.0


def test_on_a_prefill_pod_a_load_stalls_the_whole_requests_it_answers_not_its_prompts() -> None:
    # Scraped running counts prompts in progress; only the answers this router sent there wait.
    s = seconds(
        [ADAPTER_FREE_SLOT, ADAPTER_FREE_SLOT],
        running=[20, 20],
        decoding_requests=[0, 20],
        can_decode=[0, 0],
    )
    assert math.isclose(s[0], MODEL.lora_load_s) and s[1] > s[0]


def test_a_pod_that_does_not_serve_the_adapter_is_infeasible_unless_none_does() -> None:
    s = seconds([ADAPTER_NOT_SERVED, ADAPTER_EVICTS])
    assert math.isinf(s[0]) and math.isfinite(s[1])
    nobody = seconds([ADAPTER_NOT_SERVED, ADAPTER_NOT_SERVED])
    assert np.isfinite(nobody).all() and nobody[0] == nobody[1] > 0.0


def test_a_pair_pays_the_load_on_both_of_its_pods() -> None:
    """Side ``both``: the computing pod before the prompt, the decode pod after the KV arrives."""
    c = cands(2, can_prefill=[1, 0], can_decode=[0, 1])
    table = LINKS.table({"a": 0})
    cm = cost_model()

    def pair_ttft(state: list[int]) -> float:
        c.adapter_state = np.array(state, dtype=np.int8)
        costs = pair_costs(derive(c, ctx(), cm), c.can_prefill, c.can_decode, cm, table)
        return float(costs.ttft_s[1, 0])

    both_loaded = pair_ttft([ADAPTER_RESIDENT, ADAPTER_RESIDENT])
    assert math.isclose(pair_ttft([ADAPTER_FREE_SLOT, ADAPTER_RESIDENT]) - both_loaded, MODEL.lora_load_s)
    assert math.isclose(pair_ttft([ADAPTER_RESIDENT, ADAPTER_FREE_SLOT]) - both_loaded, MODEL.lora_load_s)


def test_a_local_route_pays_its_pods_load_once() -> None:
    c = cands(1, can_prefill=[1], can_decode=[1])
    table = LINKS.table({"a": 0})
    cm = cost_model()
    ttft = []
    for state in (ADAPTER_RESIDENT, ADAPTER_FREE_SLOT):
        c.adapter_state = np.array([state], dtype=np.int8)
        costs = pair_costs(derive(c, ctx(), cm), c.can_prefill, c.can_decode, cm, table)
        ttft.append(float(costs.ttft_s[0, 0]))
    assert math.isclose(ttft[1] - ttft[0], MODEL.lora_load_s)


def test_without_an_adapter_every_cost_is_exactly_what_it_was_without_the_term() -> None:
    """Adapter-less routing must not move by a bit: the term adds exact zeros."""
    c = cands(4, running=[3, 0, 7, 1], queued_prefill_tokens=[900, 0, 50, 4000], can_decode=[1, 1, 0, 1])
    table = LINKS.table({"a": 0})
    without = cost_model(terms=tuple(WeightedTerm(load_term(n), 1.0) for n in DEFAULT_WEIGHTS if n != "lora"))
    costs = [
        pair_costs(derive(c, ctx(), cm), c.can_prefill, c.can_decode, cm, table).cost
        for cm in (cost_model(), without)
    ]
    assert np.array_equal(costs[0], costs[1])
