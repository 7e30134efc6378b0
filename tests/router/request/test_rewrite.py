"""Model-name rewrites: weighted rules, the gateway's header, and what parsing does with them."""

from __future__ import annotations

import random

import orjson
import pytest

from router.request.parse import parse_request
from router.request.rejections import BadRequest, UnknownModel
from router.request.rewrite import HEADER_RULE, ModelRewrites
from router.request.types import RequestLimits
from router.server.config import parse_config
from router.state.pool import Pool

LIMITS = RequestLimits(1 << 20, 1 << 20, 16, 16, 4.0, served_model="base")
SPLIT = ModelRewrites([("food", "food-review", [("food-v1", 90.0), ("food-v2", 10.0)])], random.Random(7))


def body(model: str) -> bytes:
    return orjson.dumps({"model": model, "prompt": "hello"})


def test_a_rule_splits_requests_by_weight() -> None:
    draws = [SPLIT.choose("food-review", {}) for _ in range(4000)]
    targets = [d.target for d in draws if d is not None]
    assert len(targets) == 4000 and {d.rule for d in draws if d is not None} == {"food"}
    share = targets.count("food-v2") / len(targets)
    assert 0.08 < share < 0.12  # 10 % ± 5 standard errors
    assert SPLIT.choose("other-model", {}) is None  # no rule: kept


def test_the_gateway_header_wins_over_the_rules_and_a_no_op_is_no_rewrite() -> None:
    for header in ("x-gateway-model-name-rewrite", "x-llm-d-model-name-rewrite"):
        chosen = SPLIT.choose("food-review", {header: " food-v3 "})
        assert chosen is not None and (chosen.rule, chosen.target) == (HEADER_RULE, "food-v3")
    assert SPLIT.choose("food-review", {"x-gateway-model-name-rewrite": "food-review"}) is None
    with pytest.raises(ValueError, match="must name a model"):
        SPLIT.choose("food-review", {"x-gateway-model-name-rewrite": "  "})


def test_parsing_rewrites_the_body_and_checks_the_target_against_what_is_served() -> None:
    rewrites = ModelRewrites([("alias", "public", [("lora-a", 1.0)])])
    request = parse_request(body("public"), LIMITS, {}, rewrites)
    assert (request.model, request.body["model"], request.requested_model) == ("lora-a", "lora-a", "public")
    assert request.rewrite_rule == "alias"
    # A rewrite target is served (a LoRA adapter of the strict pool); the asked name is not.
    assert parse_request(body("lora-a"), LIMITS, {}, rewrites).requested_model is None
    with pytest.raises(UnknownModel, match=r"'elsewhere' \(rewritten from 'public'\) is not served"):
        parse_request(body("public"), LIMITS, {"x-gateway-model-name-rewrite": "elsewhere"}, rewrites)
    request = parse_request(body("public"), LIMITS, {"x-gateway-model-name-rewrite": "base"}, rewrites)
    assert request.model == "base" and request.rewrite_rule == HEADER_RULE
    with pytest.raises(BadRequest, match="x-gateway-model-name-rewrite must name a model"):
        parse_request(body("base"), LIMITS, {"x-gateway-model-name-rewrite": "x" * 300}, rewrites)


def test_config_rules_are_validated_and_conformance_relaxes_the_model_check() -> None:
    base = {"model": "m", "endpoints": [{"address": "10.0.0.1:8000"}]}
    rule = {"model": "m", "targets": [{"model": "a", "weight": 3}, {"model": "b"}]}
    config = parse_config({**base, "model_rewrites": [rule]})
    assert [(t.model, t.weight) for t in config.model_rewrites[0].targets] == [("a", 3.0), ("b", 1.0)]
    with pytest.raises(ValueError, match="a second rule for model 'm'"):
        parse_config({**base, "model_rewrites": [rule, rule]})
    switched = parse_config({**base, "extproc": {"conformance": True}})
    assert switched.strict_model is False and switched.scrape.engine_metrics_required is False
    assert switched.gate.checks == ["ranks"]
    assert parse_config(base).gate.checks is None  # without the switch: by discovery
    explicit = parse_config({**base, "strict_model": True, "extproc": {"conformance": True}})
    assert explicit.strict_model is True  # what the operator wrote wins over the switch's default


def test_a_bare_ip_names_every_port_of_that_host() -> None:
    pool = Pool()
    config = parse_config(
        {
            "model": "m",
            "endpoints": [
                {"address": "10.0.0.1:3000"},
                {"address": "10.0.0.1:3002"},
                {"address": "10.0.0.2:3000"},
                {"address": "[fd00::1]:3000"},
            ],
        }
    )
    slots = {e.address: pool.add(e).slot for e in config.endpoints}
    assert set(pool.slots_of(frozenset({"10.0.0.1"}))) == {slots["10.0.0.1:3000"], slots["10.0.0.1:3002"]}
    assert set(pool.slots_of(frozenset({"10.0.0.1:3002", "10.9.9.9"}))) == {slots["10.0.0.1:3002"]}
    assert set(pool.slots_of(frozenset({"fd00::1"}))) == {slots["[fd00::1]:3000"]}
    pool.remove("10.0.0.1:3000")
    assert set(pool.slots_of(frozenset({"10.0.0.1"}))) == {slots["10.0.0.1:3002"]}
