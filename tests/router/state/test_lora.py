import numpy as np

from router.request.types import EngineMetrics, LoraInfo
from router.scheduling.costmodel.view import (
    ADAPTER_EVICTS,
    ADAPTER_FREE_SLOT,
    ADAPTER_NOT_SERVED,
    ADAPTER_RESIDENT,
)
from router.server.config import EndpointConfig
from router.state.pool import Pool

SLOTS = np.array([0, 1])


def pool_of_two() -> Pool:
    pool = Pool(capacity=2)
    for i in range(2):
        pool.add(EndpointConfig(name=f"pod-{i}", address=f"10.0.0.{i}:8000", role="prefill-decode"))
    return pool


def scrape(pool: Pool, slot: int, lora: LoraInfo | None) -> None:
    endpoint = pool.by_slot[slot]
    assert endpoint is not None
    pool.apply_metrics(endpoint, EngineMetrics(lora=lora, running=0.0, waiting=0.0), now=0.0)


def test_the_base_model_and_unknown_names_are_no_adapter() -> None:
    pool = pool_of_two()
    scrape(pool, 0, LoraInfo(2, running=("a",)))
    assert pool.lora.states("sim-model", SLOTS) is None
    assert pool.lora.states("a", SLOTS) is not None


def test_an_adapter_running_on_a_pod_is_resident_there_and_a_free_slot_elsewhere() -> None:
    pool = pool_of_two()
    scrape(pool, 0, LoraInfo(2, running=("a",)))
    scrape(pool, 1, LoraInfo(2))
    assert pool.lora.states("a", SLOTS).tolist() == [ADAPTER_RESIDENT, ADAPTER_FREE_SLOT]


def test_unknown_lora_state_is_never_resident_even_where_we_sent_the_adapter() -> None:
    pool = pool_of_two()
    scrape(pool, 0, LoraInfo(2, running=("a",)))
    scrape(pool, 1, None)  # no lora_requests_info: how many slots, what is loaded: unknown
    pool.lora.routed("a", [1])
    assert pool.lora.states("a", SLOTS).tolist() == [ADAPTER_RESIDENT, ADAPTER_EVICTS]


def test_the_least_recently_used_adapter_is_the_one_evicted() -> None:
    pool = pool_of_two()
    scrape(pool, 0, LoraInfo(2, running=("a",)))
    scrape(pool, 0, LoraInfo(2, running=("b",)))
    assert pool.lora.states("a", SLOTS)[0] == ADAPTER_RESIDENT  # idle, still in its slot
    scrape(pool, 0, LoraInfo(2, waiting=("c",)))  # c loads next: a was used longest ago
    assert pool.lora.states("a", SLOTS)[0] == ADAPTER_EVICTS
    assert pool.lora.states("b", SLOTS)[0] == ADAPTER_RESIDENT
    pool.lora.routed("a", [0])  # a request we routed brings it back, evicting b
    assert pool.lora.states("a", SLOTS)[0] == ADAPTER_RESIDENT
    assert pool.lora.states("b", SLOTS)[0] == ADAPTER_EVICTS


def test_a_pod_whose_model_list_lacks_the_adapter_does_not_serve_it() -> None:
    pool = pool_of_two()
    scrape(pool, 0, LoraInfo(2))
    scrape(pool, 1, LoraInfo(2))
    pool.lora.observe_served(0, ["a"])
    pool.lora.observe_served(1, ["b"])
    assert pool.lora.states("a", SLOTS).tolist() == [ADAPTER_FREE_SLOT, ADAPTER_NOT_SERVED]


def test_a_removed_endpoints_slot_forgets_its_adapters() -> None:
    pool = pool_of_two()
    scrape(pool, 1, LoraInfo(2, running=("a",)))
    pool.lora.observe_served(1, ["a"])
    pool.remove("pod-1")
    pool.add(EndpointConfig(name="pod-9", address="10.0.0.9:8000", role="prefill-decode"))
    assert pool.lora.states("a", SLOTS)[1] == ADAPTER_EVICTS


def test_the_matrix_grows_with_the_pool() -> None:
    pool = Pool(capacity=1)
    for i in range(3):
        pool.add(EndpointConfig(name=f"pod-{i}", address=f"10.0.0.{i}:8000", role="prefill-decode"))
    scrape(pool, 2, LoraInfo(1, running=("a",)))
    assert pool.lora.states("a", np.array([0, 1, 2])).tolist() == [ADAPTER_EVICTS] * 2 + [ADAPTER_RESIDENT]
