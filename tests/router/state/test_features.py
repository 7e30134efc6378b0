"""Features are declared once (router/state/features.py) and flow from there: scraped ones from the
engine's /metrics into the pool's arrays, candidate ones into ``Candidates``."""

from __future__ import annotations

import math

import numpy as np
from helpers import SINGLE_PODS, make_config

from router.observe.scrape import parse_vllm_metrics
from router.server.compose import pool_from
from router.state.features import FEATURES, SCRAPED


def exposition() -> tuple[str, dict[str, float]]:
    """A /metrics page with every declared scraped feature under its current name, distinct values."""
    lines, expected = [], {}
    for i, feature in enumerate(f for f in FEATURES if f.scraped is not None):
        metric = feature.scraped.metrics[0]
        if feature.scraped.combine == "capacity":
            lines.append(f'{metric}{{block_size="16",num_gpu_blocks="{100 + i}"}} 1')
            expected[feature.name] = 16.0 * (100 + i)
        else:
            lines.append(f'{metric}{{engine="0"}} {i + 0.5}')
            expected[feature.name] = i + 0.5
    return "\n".join(lines) + "\n", expected


def test_every_scraped_feature_reaches_the_pool_and_the_candidates() -> None:
    text, expected = exposition()
    assert set(expected) == set(SCRAPED)
    pool = pool_from(make_config(SINGLE_PODS))
    endpoint = pool.endpoints["e1"]
    pool.apply_metrics(endpoint, parse_vllm_metrics(text), now=0.0)
    cand = pool.candidates(np.array([endpoint.slot]))
    for feature in FEATURES:
        if feature.name in expected:
            assert getattr(pool, feature.name)[endpoint.slot] == expected[feature.name], feature.name
            if feature.candidate:
                assert getattr(cand, feature.name)[0] == expected[feature.name], feature.name


def test_a_deprecated_name_is_read_only_without_the_current_one() -> None:
    for feature in (f for f in FEATURES if f.scraped is not None and len(f.scraped.metrics) > 1):
        current, old = feature.scraped.metrics[0], feature.scraped.metrics[-1]
        both = parse_vllm_metrics(f"{current} 1\n{old} 2\n")
        assert getattr(both, feature.name) == 1.0, feature.name
        assert getattr(parse_vllm_metrics(f"{old} 2\n"), feature.name) == 2.0, feature.name


def test_an_endpoint_nobody_measured_is_unknown_not_idle() -> None:
    pool = pool_from(make_config(SINGLE_PODS))
    slot = pool.endpoints["e0"].slot
    for feature in FEATURES:
        if feature.scraped is not None:
            assert math.isnan(getattr(pool, feature.name)[slot]), feature.name


def test_a_scrape_remembers_how_many_of_its_waiting_requests_could_be_ours() -> None:
    pool = pool_from(make_config(SINGLE_PODS))
    endpoint = pool.endpoints["e1"]
    reservations = [pool.reserve(endpoint.slot, None, 300.0, 1000.0) for _ in range(3)]
    reservations[0].finish_prefill()  # its first token came back: no longer queued
    pool.apply_metrics(endpoint, parse_vllm_metrics("vllm:num_requests_waiting 2\n"), now=0.0)
    assert pool.waiting_ours[endpoint.slot] == 2
    for reservation in reservations:
        reservation.release()
    # Until the next scrape the count stays the scrape's: it says what that scrape's waiting held.
    assert pool.waiting_ours[endpoint.slot] == 2
    pool.apply_metrics(endpoint, parse_vllm_metrics("vllm:num_requests_waiting 0\n"), now=1.0)
    assert pool.waiting_ours[endpoint.slot] == 0
