"""InferenceObjectives and InferenceModelRewrites from the cluster (a fake API server): read as the
CRDs define them, llm-d.ai's overruling the legacy group's, followed live, and applied to routing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import yaml
from helpers import eventually

from kvindex.aio import stop_task
from loadtests.servers.kube import NS, FakeKube, pod, pool, serving
from router.control.discovery.inference_objects import (
    OBJECTIVE_KINDS,
    REWRITE_KINDS,
    ClusterPolicy,
    CustomKind,
    InferenceObjectsWatch,
    MalformedObject,
    objective_priority,
    references_pool,
    rewrite_rules,
)
from router.control.discovery.kubernetes import KubernetesDiscovery
from router.server.app import App
from router.server.compose import build, objectives_and_rewrites_watch
from router.server.config import parse_config
from simulator.engine import EngineSpec, SimCluster, TimeModel

LLM_D_OBJECTIVES, LEGACY_OBJECTIVES = OBJECTIVE_KINDS
LLM_D_REWRITES, LEGACY_REWRITES = REWRITE_KINDS

# As an operator writes them (llm-d-router config/crd/bases/llm-d.ai_*.yaml, v1alpha2).
LLM_D_OBJECTIVE = """
apiVersion: llm-d.ai/v1alpha2
kind: InferenceObjective
metadata:
  name: premium
  namespace: llm
spec:
  priority: 7
  poolRef:
    name: qwen
"""
LLM_D_REWRITE = """
apiVersion: llm-d.ai/v1alpha2
kind: InferenceModelRewrite
metadata:
  name: food-review-canary
  namespace: llm
  creationTimestamp: "2026-11-30T10:00:00Z"
spec:
  poolRef:
    group: llm-d.ai
    kind: InferencePool
    name: qwen
  rules:
  - matches:
    - model:
        type: Exact
        value: food-review
    targets:
    - modelRewrite: food-review-v1
      weight: 90
    - modelRewrite: food-review-v2
      weight: 10
  - targets:
    - modelRewrite: base
"""
# The Inference Extension's (gateway-api-inference-extension config/crd/bases/
# inference.networking.x-k8s.io_*.yaml, v1alpha2), and its older criticality.
LEGACY_OBJECTIVE = """
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata:
  name: premium
  namespace: llm
spec:
  priority: 3
  poolRef:
    group: inference.networking.k8s.io
    name: qwen
"""
LEGACY_REWRITE = """
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModelRewrite
metadata:
  name: legacy-alias
  namespace: llm
spec:
  poolRef:
    name: qwen
  rules:
  - matches:
    - model:
        value: alias
    targets:
    - modelRewrite: sim-model
"""


def load(document: str, **metadata: Any) -> dict[str, Any]:
    obj = yaml.safe_load(document)
    obj["metadata"].update(metadata)
    return obj


def test_objects_read_as_the_crds_define_them() -> None:
    objective = load(LLM_D_OBJECTIVE)["spec"]
    assert references_pool(objective, "qwen") and not references_pool(objective, "other")
    assert objective_priority(objective) == 7
    assert objective_priority(load(LEGACY_OBJECTIVE)["spec"]) == 3
    # llm-d's newer poolRefs, an unset priority, and the older criticality.
    assert references_pool({"poolRefs": [{"name": "a"}, {"name": "qwen"}]}, "qwen")
    assert not references_pool({"poolRef": {"name": "qwen", "kind": "Service"}}, "qwen")
    assert objective_priority({"poolRef": {"name": "qwen"}}) == 0
    assert objective_priority({"criticality": "Sheddable"}) == -1
    assert objective_priority({"criticality": "Critical"}) == 1

    rules = rewrite_rules("food-review-canary", load(LLM_D_REWRITE)["spec"])
    assert rules == [
        (
            False,
            0,
            ("food-review-canary", "food-review", (("food-review-v1", 90.0), ("food-review-v2", 10.0))),
        ),
        (True, 1, ("food-review-canary", None, (("base", 1.0),))),  # no match: every model
    ]
    assert rewrite_rules("legacy-alias", load(LEGACY_REWRITE)["spec"]) == [
        (False, 0, ("legacy-alias", "alias", (("sim-model", 1.0),)))
    ]


@pytest.mark.parametrize(
    "spec",
    [
        {"priority": "high"},
        {"priority": True},
        {"criticality": "Urgent"},
    ],
)
def test_a_malformed_objective_is_refused(spec: dict[str, Any]) -> None:
    with pytest.raises(MalformedObject):
        objective_priority(spec)


@pytest.mark.parametrize(
    "rule",
    [
        {"matches": [{"model": {"value": "a"}}]},  # no targets
        {"targets": [{"modelRewrite": ""}]},
        {"targets": [{"modelRewrite": "b", "weight": 0}]},
        {"targets": [{"modelRewrite": "b", "weight": 2}, {"modelRewrite": "c"}]},  # weights on some
        {
            "matches": [{"model": {"type": "RegularExpression", "value": "a.*"}}],
            "targets": [{"modelRewrite": "b"}],
        },
        {"matches": [{"model": {}}], "targets": [{"modelRewrite": "b"}]},
    ],
)
def test_a_malformed_rewrite_is_refused(rule: dict[str, Any]) -> None:
    with pytest.raises(MalformedObject):
        rewrite_rules("bad", {"poolRef": {"name": "qwen"}, "rules": [rule]})


def install(kube: FakeKube, *kinds: CustomKind) -> None:
    for kind in kinds:
        kube.install(kind.group, kind.version, kind.plural, kind.kind)


@contextlib.asynccontextmanager
async def watching(kube: FakeKube) -> AsyncIterator[list[ClusterPolicy]]:
    published: list[ClusterPolicy] = []
    watch = InferenceObjectsWatch(
        kube.client(), NS, "qwen", published.append, absent_retry_s=0.05, backoff_initial_s=0.01
    )
    task = asyncio.create_task(watch.run())
    try:
        yield published
    finally:
        await stop_task(task)


def objectives(published: list[ClusterPolicy]) -> dict[str, int] | None:
    return dict(published[-1].objectives) if published else None


def rewrites(published: list[ClusterPolicy]) -> list[tuple[str | None, str]] | None:
    """(requested model, rule name) per published rule, in precedence order."""
    return [(rule[1], rule[0]) for rule in published[-1].rewrites] if published else None


async def test_objects_appear_change_and_disappear() -> None:
    async with serving() as kube:
        install(kube, LLM_D_OBJECTIVES, LLM_D_REWRITES)  # the legacy kinds are not installed: 404
        async with watching(kube) as published:
            await eventually(lambda: objectives(published) == {}, 5, "the first, empty policy")
            kube.put(LLM_D_OBJECTIVES.crd_name, load(LLM_D_OBJECTIVE))
            await eventually(lambda: objectives(published) == {"premium": 7}, 5, "the objective")
            changed = load(LLM_D_OBJECTIVE)
            changed["spec"]["priority"] = 9
            kube.put(LLM_D_OBJECTIVES.crd_name, changed)
            await eventually(lambda: objectives(published) == {"premium": 9}, 5, "its new priority")
            kube.delete(LLM_D_OBJECTIVES.crd_name, "premium")
            await eventually(lambda: objectives(published) == {}, 5, "the objective gone")

            kube.put(LLM_D_REWRITES.crd_name, load(LLM_D_REWRITE))
            await eventually(
                lambda: (
                    rewrites(published)
                    == [("food-review", "food-review-canary"), (None, "food-review-canary")]
                ),
                5,
                "the rewrite's rules",
            )
            kube.delete(LLM_D_REWRITES.crd_name, "food-review-canary")
            await eventually(lambda: rewrites(published) == [], 5, "the rewrite gone")


async def test_the_llm_d_group_overrules_the_legacy_one_kind_by_kind() -> None:
    async with serving() as kube:
        install(kube, *OBJECTIVE_KINDS, *REWRITE_KINDS)
        kube.put(LEGACY_OBJECTIVES.crd_name, load(LEGACY_OBJECTIVE))
        kube.put(LEGACY_REWRITES.crd_name, load(LEGACY_REWRITE))
        kube.put(LLM_D_OBJECTIVES.crd_name, load(LLM_D_OBJECTIVE))
        async with watching(kube) as published:
            # Both groups installed: only llm-d.ai's objects count, even where it has none.
            await eventually(lambda: objectives(published) == {"premium": 7}, 5, "llm-d.ai's priority")
            assert rewrites(published) == []
            assert all(policy.objectives.get("premium") != 3 for policy in published)  # never legacy
            kube.uninstall(LLM_D_REWRITES.crd_name)  # llm-d.ai's kind removed: the legacy one counts
            await eventually(lambda: rewrites(published) == [("alias", "legacy-alias")], 5, "legacy rules")
            kube.uninstall(LLM_D_OBJECTIVES.crd_name)
            await eventually(lambda: objectives(published) == {"premium": 3}, 5, "the legacy priority")


async def test_a_kind_installed_later_is_picked_up() -> None:
    async with serving() as kube, watching(kube) as published:
        await eventually(lambda: objectives(published) == {}, 5, "nothing installed: an empty policy")
        install(kube, LEGACY_OBJECTIVES)
        kube.put(LEGACY_OBJECTIVES.crd_name, load(LEGACY_OBJECTIVE))
        await eventually(lambda: objectives(published) == {"premium": 3}, 5, "the CRD's objects")
        assert kube.calls(LLM_D_OBJECTIVES.crd_name, "refused")  # llm-d.ai's kind is still asked for


async def test_other_pools_and_malformed_objects_are_skipped(caplog: pytest.LogCaptureFixture) -> None:
    async with serving() as kube:
        install(kube, LLM_D_OBJECTIVES, LLM_D_REWRITES)
        other = load(LLM_D_OBJECTIVE, name="elsewhere")
        other["spec"]["poolRef"]["name"] = "another-pool"
        broken = load(LLM_D_OBJECTIVE, name="broken")
        broken["spec"]["priority"] = "high"
        older = load(LLM_D_REWRITE, name="older", creationTimestamp="2026-11-01T00:00:00Z")
        older["spec"]["rules"] = older["spec"]["rules"][:1]
        for obj in (load(LLM_D_OBJECTIVE), other, broken):
            kube.put(LLM_D_OBJECTIVES.crd_name, obj)
        for obj in (load(LLM_D_REWRITE), older):
            kube.put(LLM_D_REWRITES.crd_name, obj)
        with caplog.at_level(logging.WARNING):
            async with watching(kube) as published:
                await eventually(lambda: objectives(published) == {"premium": 7}, 5, "only ours, well formed")
                # The older object wins a model both name; a rule for every model comes last.
                assert rewrites(published) == [
                    ("food-review", "older"),
                    ("food-review", "food-review-canary"),
                    (None, "food-review-canary"),
                ]
        skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
        assert len(skipped) == 1 and "broken" in skipped[0] and "spec.priority" in skipped[0]


# -- applied to the router -----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def router_following(kube: FakeKube, **config: Any) -> AsyncIterator[tuple[App, str, SimCluster]]:
    spec = EngineSpec("e0", "prefill-decode", time=TimeModel(speed=20.0))
    async with SimCluster([spec]) as cluster:
        port = int(cluster.address("e0").rsplit(":", 1)[1])
        kube.put("pools", pool("qwen", ports=(port,)))
        kube.put("pods", pod("solo", "127.0.0.1"))
        parsed = parse_config(
            {
                "model": "sim-model",
                "kubernetes": {"namespace": NS, "pool_name": "qwen"},
                "proxy": {"port": 0},
                "gate": {"initial_wait_s": 5, "checks": ["ranks"]},
                **config,
            }
        )
        parts = build(parsed, discovery=KubernetesDiscovery(kube.client(), NS, pool_name="qwen"))
        parts.objectives_and_rewrites = objectives_and_rewrites_watch(parsed, kube.client(), parts.flow)
        async with App(parts) as app:
            await eventually(lambda: app.ready, 5, "ready")
            yield app, f"http://127.0.0.1:{app.proxy_port}", cluster


async def ask(base: str, model: str, headers: dict[str, str] | None = None) -> int:
    async with aiohttp.ClientSession() as http:
        body = {"model": model, "prompt": "hello " * 20, "max_tokens": 2}
        async with http.post(f"{base}/v1/completions", json=body, headers=headers or {}) as resp:
            await resp.read()
            return resp.status


async def test_the_router_follows_the_cluster_and_falls_back_to_the_file() -> None:
    file_rules = {
        "model_rewrites": [{"model": "alias", "targets": [{"model": "no-such-model"}]}],
        "objectives": {"premium": 2},
    }
    async with serving() as kube:
        install(kube, LLM_D_OBJECTIVES, LLM_D_REWRITES)
        async with router_following(kube, **file_rules) as (app, base, cluster):
            engine = cluster.engines["e0"]
            flow = app.parts.flow
            assert await ask(base, "alias") == 404  # the file's rule: a model the engine lacks

            rewrite = load(LEGACY_REWRITE, name="alias-to-sim")
            kube.put(LLM_D_REWRITES.crd_name, {**rewrite, "apiVersion": "llm-d.ai/v1alpha2"})
            await eventually(lambda: flow.rewrites.rules["alias"].targets == ("sim-model",), 5, "applied")
            assert await ask(base, "alias") == 200  # the cluster's rule wins for the model
            assert engine.requests_seen[-1][2]["model"] == "sim-model"
            kube.delete(LLM_D_REWRITES.crd_name, "alias-to-sim")
            await eventually(lambda: flow.rewrites.rules["alias"].targets == ("no-such-model",), 5, "file")

            premium = {"x-gateway-inference-objective": "premium"}
            assert await ask(base, "sim-model", premium) == 200
            kube.put(LLM_D_OBJECTIVES.crd_name, load(LLM_D_OBJECTIVE))
            await eventually(lambda: flow.objectives.get("premium") == 7, 5, "the cluster's priority")
            assert await ask(base, "sim-model", premium) == 200
            exposition = app.parts.metrics.exposition()[0].decode().splitlines()
            counted = [line for line in exposition if line.startswith("llm_d_epp_request_total{")]
            assert any('priority="2"' in line for line in counted)  # the file's, before
            assert any('priority="7"' in line for line in counted)  # the cluster's, after


def test_the_switch_and_a_selector_pool_have_no_watch() -> None:
    base = {"model": "m", "kubernetes": {"namespace": NS, "pool_name": "qwen"}}
    on = parse_config(base)
    assert objectives_and_rewrites_watch(on, object(), build(on).flow) is not None
    off = parse_config({**base, "kubernetes": {**base["kubernetes"], "watch_objectives_and_rewrites": False}})
    assert objectives_and_rewrites_watch(off, object(), build(off).flow) is None
    selector = parse_config({"model": "m", "kubernetes": {"selector": {"app": "x"}, "target_ports": [8000]}})
    assert objectives_and_rewrites_watch(selector, object(), build(selector).flow) is None
