"""Every value set in helm/pd-router/ci lints and renders objects that validate: built-in kinds
against Kubernetes' schemas (strict), the InferencePool against the upstream CRD, the picker's
arguments and pool configuration through pd-router's own parser and loader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from helm import (
    CHART,
    RELEASE,
    VALUE_SETS,
    of_kind,
    one,
    picker_config,
    render,
    run_helm,
    set_id,
    validate,
    validate_builtin,
    value_set,
)

SETS = pytest.mark.parametrize("values", VALUE_SETS, ids=set_id)


def test_the_value_sets_are_there() -> None:
    names = {set_id(p) for p in VALUE_SETS}
    assert {
        "default",
        "pd-sidecar",
        "redis-internal",
        "redis-external",
        "keda-external",
        "keda-prometheus",
        "tls-secret",
        "tls-off",
        "gie-ported",
    } <= names


@SETS
def test_lint_strict(values: Path) -> None:
    result = run_helm("lint", "--strict", str(CHART), "--values", str(values))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@SETS
def test_every_object_validates(values: Path) -> None:
    docs = render(values)
    assert docs
    for doc in docs:
        assert doc["metadata"]["namespace"] == "llm", doc["metadata"]
        validate(doc)


@SETS
def test_the_picker_accepts_its_command_line_and_config(values: Path, tmp_path: Path) -> None:
    config = picker_config(render(values), tmp_path)
    assert config.extproc.enabled and config.extproc.host == "0.0.0.0"
    assert config.metrics.enabled and config.metrics.host == "0.0.0.0"
    assert not config.proxy.enabled
    assert config.kubernetes is not None
    assert (config.kubernetes.namespace, config.kubernetes.pool_name) == ("llm", RELEASE)
    assert not config.kubernetes.selector


def test_strict_validation_refuses_an_unknown_field() -> None:
    """The strict schemas are what the tests above rely on to catch a misspelt field."""
    deployment = one(render(value_set("default")), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFilesytem"] = True
    with pytest.raises(Exception, match="readOnlyRootFilesytem"):
        validate_builtin(deployment)
    pool = one(render(value_set("default")), "InferencePool")
    pool["spec"]["endpointPickerRef"]["failureMod"] = "FailOpen"
    with pytest.raises(Exception, match="failureMod"):
        validate(pool)


def test_decode_sidecar_snippet_is_a_valid_container_the_cli_accepts() -> None:
    from router.server.cli import _parser

    docs = render(value_set("pd-sidecar"))
    snippet = one(docs, "ConfigMap", f"{RELEASE}-epp-decode-sidecar")["data"]["container.yaml"]
    (container,) = yaml.safe_load(snippet)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "decode"},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}, container]},
    }
    validate_builtin(pod)
    args = _parser().parse_args(container["args"])
    assert args.command == "sidecar"
    assert args.decode == "127.0.0.1:8200"
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert args.allow == ["10.0.0.0/8", "192.168.7.12"]
    assert container["ports"][0]["containerPort"] == 8000
    pool = one(docs, "InferencePool")
    assert {"number": 8000} in pool["spec"]["targetPorts"]


def test_only_expected_kinds_are_rendered() -> None:
    kinds = {doc["kind"] for values in VALUE_SETS for doc in render(values)}
    assert kinds == {
        "ConfigMap",
        "Deployment",
        "InferencePool",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "ScaledObject",
        "Service",
        "ServiceAccount",
        "ServiceMonitor",
    }
    assert len(of_kind(render(value_set("default")), "Deployment")) == 1


def test_the_role_reads_objectives_and_rewrites_under_both_groups() -> None:
    """The picker lists and watches InferenceObjectives and InferenceModelRewrites under llm-d.ai
    and the legacy group (router/control/discovery/inference_objects.py)."""
    role = one(render(value_set("default")), "Role")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    for group in ("llm-d.ai", "inference.networking.x-k8s.io"):
        for resource in ("inferenceobjectives", "inferencemodelrewrites"):
            assert {(group, resource, verb) for verb in ("get", "list", "watch")} <= granted


def test_the_value_sets_the_docs_show_are_the_ones_tested() -> None:
    """A values block in docs/ whose first line names a chart test set is that file, byte for byte."""
    docs = "\n".join(p.read_text() for p in sorted((CHART.parent.parent / "docs").glob("*.md")))
    shown = re.findall(r"```yaml\n(# helm/pd-router/ci/([\w-]+\.yaml)\n.*?)```", docs, re.S)
    assert shown, "the deployment guide shows a chart test set"
    for block, name in shown:
        assert block == (CHART / "ci" / name).read_text(), f"docs show a stale copy of ci/{name}"
