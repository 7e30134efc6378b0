"""The x-slo-* headers and objective defaults: read in seconds, per measure, and every value
that is not a positive number of milliseconds up to an hour refused with a 400 naming the header."""

from __future__ import annotations

import pytest

from router.request.parse import priority_of
from router.request.rejections import BadRequest, answer
from router.request.slo import UNNAMED, slo_of
from router.request.types import SloTarget

DEFAULTS = {"premium": SloTarget(0.2, 0.03, "premium"), "batch": SloTarget(None, 0.2, "batch")}


def test_headers_give_both_objectives_in_seconds() -> None:
    assert slo_of({"x-slo-ttft-ms": "250", "x-slo-tpot-ms": "12.5"}) == SloTarget(0.25, 0.0125, "")


def test_no_header_and_no_objective_default_means_no_slo() -> None:
    assert slo_of({}) is None
    assert slo_of({"x-gateway-inference-objective": "unknown"}, DEFAULTS) is None


def test_an_objective_gives_its_defaults_and_a_header_overrides_one_measure() -> None:
    named = {"x-gateway-inference-objective": "premium"}
    assert slo_of(named, DEFAULTS) == SloTarget(0.2, 0.03, "premium")
    assert slo_of({**named, "x-slo-ttft-ms": "900"}, DEFAULTS) == SloTarget(0.9, 0.03, "premium")
    # An objective with only a TPOT default: the header adds the TTFT one.
    batch = {"x-llm-d-inference-objective": "batch", "x-slo-ttft-ms": "5000"}
    assert slo_of(batch, DEFAULTS) == SloTarget(5.0, 0.2, "batch")


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("fast", "must be a number of milliseconds"),
        ("", "must be a number of milliseconds"),
        ("0", "must be a positive number"),
        ("-5", "must be a positive number"),
        ("nan", "must be a positive number"),
        ("inf", "must be a positive number"),
        ("3600001", "at most 3.6e+06 ms (an hour)"),
    ],
)
@pytest.mark.parametrize("header", ["x-slo-ttft-ms", "x-slo-tpot-ms"])
def test_invalid_values_are_a_400_naming_the_header(header: str, value: str, says: str) -> None:
    with pytest.raises(BadRequest) as refused:
        slo_of({header: value}, DEFAULTS)
    assert header in refused.value.message and says in refused.value.message
    assert answer(refused.value).status == 400


def test_an_hour_exactly_is_accepted() -> None:
    assert slo_of({"x-slo-ttft-ms": "3600000"}) == SloTarget(3600.0, None, "")


def test_priority_and_slo_defaults_come_from_the_same_objective_header() -> None:
    """An empty first objective header is no objective: both read the next one (the priority
    used to stop at the empty one and take the default while the SLO took the next)."""
    headers = {"x-gateway-inference-objective": "", "x-llm-d-inference-objective": "batch"}
    assert slo_of(headers, DEFAULTS) == DEFAULTS["batch"]
    assert priority_of(headers, {"batch": -1}) == -1


def test_a_request_naming_no_objective_takes_the_default_one() -> None:
    defaults = {**DEFAULTS, UNNAMED: DEFAULTS["premium"]}
    assert slo_of({}, defaults) == SloTarget(0.2, 0.03, "premium")  # counted under its name
    assert slo_of({"x-slo-tpot-ms": "50"}, defaults) == SloTarget(0.2, 0.05, "premium")
    assert slo_of({"x-gateway-inference-objective": "batch"}, defaults) == DEFAULTS["batch"]
    # One it names that has no SLO defaults keeps none: naming an objective is not naming none.
    assert slo_of({"x-gateway-inference-objective": "unknown"}, defaults) is None
