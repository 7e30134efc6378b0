import math

import numpy as np
from scorer_cases import MODEL, cands, ctx

from router.scheduling.costmodel import link
from router.scheduling.costmodel.link import LinkTable
from router.scheduling.costmodel.prefix import cached_tokens

TABLE = LinkTable.build(
    {"a": 0, "b": 1, "c": 2},
    same=(0.0001, 100e9),
    default=(0.002, 1e9),
    pairs={("a", "c"): (0.001, 10e9)},
)


def test_transfer_uses_the_link_between_the_two_labels_symmetrically() -> None:
    decode = cands(3, link_index=[0, 1, 2])
    t = link.transfer_s(
        TABLE,
        np.array([0, 2]),
        decode.link_index,
        link.transfer_bytes(cached_tokens(decode, ctx(1000)), ctx(1000), MODEL),
    )
    megabytes = 1000 * MODEL.kv_bytes_per_token
    assert math.isclose(t[0, 0], 0.0001 + megabytes / 100e9)  # same label
    assert math.isclose(t[0, 1], 0.002 + megabytes / 1e9)  # default
    assert math.isclose(t[0, 2], 0.001 + megabytes / 10e9)  # configured pair
    assert math.isclose(t[1, 0], t[0, 2])  # symmetric


def test_a_decode_pod_holding_the_prefix_only_receives_the_rest() -> None:
    decode = cands(2, link_index=[1, 1], cached_blocks=[0, 50])
    t = link.transfer_s(
        TABLE,
        np.array([0]),
        decode.link_index,
        link.transfer_bytes(cached_tokens(decode, ctx(1000)), ctx(1000), MODEL),
    )
    assert math.isclose(t[0, 1] - 0.002, (t[0, 0] - 0.002) * 200 / 1000)


def test_between_reads_one_pair_as_the_table_lays_it_out() -> None:
    from router.scheduling.costmodel.link import LinkCosts

    costs = LinkCosts(same=(0.001, 50e9), default=(0.005, 1e9), pairs=((("a", "b"), (0.002, 10e9)),))
    labels = {"a": 0, "b": 1, "c": 2}
    table = costs.table(labels)
    for x in labels:
        for y in labels:
            i, j = labels[x], labels[y]
            assert costs.between(x, y) == (table.latency_s[i, j], table.bytes_per_s[i, j])
    assert costs.between("b", "a") == (0.002, 10e9) and costs.between("a", "c") == (0.005, 1e9)
