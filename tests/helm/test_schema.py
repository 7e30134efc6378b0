"""values.schema.json and the chart's own checks refuse what would not work, naming the value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helm import CHART, picker_config, render, render_error, value_set
from helm.poolconfig_schema import updated
from router.adapters.keda.scaler import SIGNALS

DEFAULT = value_set("default")


@pytest.mark.parametrize(
    ("item", "named"),
    [
        ("replicas=2", "replicas"),  # top level
        ("inferenceExtension.replica=2", "replica"),
        ("inferenceExtension.image.tags=1", "tags"),
        ("inferenceExtension.tls.enable=false", "enable"),
        ("inferenceExtension.failureMode=FailClosed", "failureMode"),  # spelled as the CRD spells it
        ("inferenceExtension.flags.v=3", "'v'"),  # the reference picker's flag, not pd-router's
        ("inferenceExtension.monitoring.prometheus.enable=true", "enable"),
        ("inferenceExtension.poolConfig.slo.ttft=300", "ttft"),  # PoolConfig's own fields
        ("inferenceExtension.poolConfig.picker.policy=fastest", "picker/policy"),
        ("inferenceExtension.poolConfig.extproc.tls.min_version=1.1", "min_version"),
        ("inferencePool.modelServer.matchLabels.app=x", "modelServer"),
        ("inferencePool.modelServerType=triton-tensorrt-llm", "modelServerType"),
        ("inferencePool.targetPorts[0].number=70000", "number"),
        ("redis.external.url=redis://:pw@redis:6379/0", "url"),  # no password in the URL
        ("keda.trigger=promethues", "trigger"),
        ("keda.decode.signal=latency", "signal"),
        ("decodeSidecar.alow[0]=10.0.0.0/8", "alow"),
        ("provider.name=gke", "name"),
    ],
)
def test_the_schema_refuses_a_typo(item: str, named: str) -> None:
    message = render_error(DEFAULT, item)
    assert named in message, message


@pytest.mark.parametrize(
    ("sets", "named"),
    [
        ((), "inferencePool.modelServers.matchLabels is required"),
        (
            ("inferencePool.modelServers.matchLabels.app=vllm",),
            "inferenceExtension.poolConfig.model is required",
        ),
    ],
)
def test_required_values_are_named(sets: tuple[str, ...], named: str) -> None:
    assert named in render_error((), *sets)


@pytest.mark.parametrize(
    ("sets", "named"),
    [
        (("decodeSidecar.enabled=true",), "decodeSidecar.allow is required"),
        (
            ("decodeSidecar.enabled=true", "decodeSidecar.allow[0]=10.0.0.0/8", "decodeSidecar.port=8001"),
            "decodeSidecar.port 8001 must be one of inferencePool.targetPorts",
        ),
        (
            (
                "decodeSidecar.enabled=true",
                "decodeSidecar.allow[0]=10.0.0.0/8",
                "decodeSidecar.vllmPort=8000",
            ),
            "must differ",
        ),
        (
            ("inferenceExtension.tls.enabled=false", "inferenceExtension.tls.secretName=t"),
            "tls.enabled is false",
        ),
        (("inferencePool.targetPorts[0].number=8000", "inferencePool.targetPorts[1].number=8000"), "unique"),
        (("inferenceExtension.metricsPort=9002",), "must differ"),
        (("inferenceExtension.monitoring.prometheus.auth.enabled=true",), "auth.secretName"),
        (
            (
                "inferenceExtension.monitoring.prometheus.auth.enabled=true",
                "inferenceExtension.monitoring.prometheus.auth.secretName=t",
                "inferenceExtension.poolConfig.metrics.token=inline",
            ),
            "unset poolConfig.metrics.token",
        ),
        (("redis.enabled=true", "redis.external.passwordSecret.name=s"), "redis.external.url is empty"),
    ],
)
def test_the_chart_refuses_what_would_not_work(sets: tuple[str, ...], named: str) -> None:
    message = render_error(DEFAULT, *sets)
    assert named in message, message


def test_the_pool_config_schema_is_generated_from_the_picker() -> None:
    """values.schema.json's PoolConfig definitions match router/server/config.py."""
    text = (CHART / "values.schema.json").read_text(encoding="utf-8")
    assert updated(text) == text, "values.schema.json is stale: run python3 tests/helm/poolconfig_schema.py"


def test_the_charts_keda_signals_are_the_scalers_generated() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    keda = schema["properties"]["keda"]["properties"]
    for role in ("prefill", "decode"):
        assert keda[role]["properties"]["signal"] == {"$ref": "#/definitions/KedaSignal"}
    assert schema["definitions"]["KedaSignal"]["enum"] == list(SIGNALS)


def test_pool_config_values_set_on_the_command_line_pass(tmp_path: Path) -> None:
    """The generated part is not stricter than the picker: `--set` leaves 0.5 a string (Helm only
    converts integers), which the picker's loader takes as the number it is."""
    docs = render(
        DEFAULT,
        "inferenceExtension.poolConfig.weights.queue=0.5",
        "inferenceExtension.poolConfig.gate.checks={ranks,revision,model,kv_capacity,canary}",
        "inferenceExtension.poolConfig.flow_control.enabled=true",
        "inferenceExtension.poolConfig.signals.min_replicas.prefill=2",
        "inferenceExtension.poolConfig.signals.min_replicas.decode=2",
        "inferenceExtension.poolConfig.links.pairs[0].between={rack-a,rack-b}",
        "inferenceExtension.poolConfig.links.pairs[0].latency_ms=2",
        "inferenceExtension.poolConfig.links.pairs[0].bandwidth_gbytes_per_s=10",
    )
    config = picker_config(docs, tmp_path)
    assert config.weight("queue") == 0.5
    assert config.gate.checks == ["ranks", "revision", "model", "kv_capacity", "canary"]
    assert config.links.pairs[0].between == ("rack-a", "rack-b")
    assert "weights/queue" in render_error(DEFAULT, "inferenceExtension.poolConfig.weights.queue=half-ish")
