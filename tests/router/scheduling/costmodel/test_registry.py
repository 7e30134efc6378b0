"""Cost terms by name: a scorer module selected in ``weights`` joins the cost model."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from helpers import SINGLE_PODS, make_config, make_picker, make_pool, make_request

from router.scheduling.costmodel.registry import DEFAULT_WEIGHTS, load_term
from router.scheduling.costmodel.view import Side, View
from router.server.config import ConfigError

NOW = 100.0


class AvoidE0:
    """A scorer over an existing feature: a flat 10 s on the endpoint in slot 0."""

    name = "avoid_e0"
    side: Side = "decode"

    def seconds(self, view: View) -> np.ndarray:
        return np.where(view.cand.slots == 0, 10.0, 0.0)


@pytest.fixture
def avoid_e0(monkeypatch: pytest.MonkeyPatch) -> None:
    """What dropping ``terms/avoid_e0.py`` (the class and a ``term()``) into the tree does."""
    module = types.ModuleType("router.scheduling.costmodel.terms.avoid_e0")
    module.term = AvoidE0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "router.scheduling.costmodel.terms.avoid_e0", module)


def test_every_built_in_term_loads_by_name() -> None:
    for name in DEFAULT_WEIGHTS:
        term = load_term(name)
        assert term.name == name and term.side in ("prefill", "decode", "both")


def test_a_scorer_named_in_weights_changes_the_choice(avoid_e0: None) -> None:
    def first_decode(weights: dict[str, float]) -> str:
        config = make_config(SINGLE_PODS, weights=weights)
        picker = make_picker(config, make_pool(config, now=NOW))
        return picker.pick(make_request(100), now=NOW).decode.id

    picks = {first_decode({}) for _ in range(8)} | {first_decode({"avoid_e0": 0.0}) for _ in range(8)}
    assert "e0" in picks  # idle pods tie: without the term (or at weight 0) e0 is sometimes chosen
    assert all(first_decode({"avoid_e0": 1.0}) != "e0" for _ in range(16))


def test_a_broken_scorer_module_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("router.scheduling.costmodel.terms.no_factory")
    monkeypatch.setitem(sys.modules, "router.scheduling.costmodel.terms.no_factory", module)
    with pytest.raises(
        ConfigError,
        match=r"no_factory: scorer module router\.scheduling\.costmodel\.terms\.no_factory has no term",
    ):
        make_config(SINGLE_PODS, weights={"no_factory": 1.0})
    with pytest.raises(ConfigError, match="weights: Bad-Name: 'Bad-Name' is not a scorer name"):
        make_config(SINGLE_PODS, weights={"Bad-Name": 1.0})
