"""What the chart renders for a given set of values: the picker's pod, its Service and
InferencePool, RBAC, TLS, Redis, KEDA, monitoring and the decode sidecar."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from helm import (
    CHART,
    NAMESPACE,
    RELEASE,
    SECRET_FILES,
    VALUE_SETS,
    of_kind,
    one,
    picker_command,
    picker_config,
    picker_container,
    pod_volumes,
    pool_config_text,
    render,
    render_error,
    set_id,
    value_set,
)

DEFAULT = value_set("default")
EPP = f"{RELEASE}-epp"


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment", EPP)["spec"]["template"]["spec"]


def service_port(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (port,) = [p for p in one(docs, "Service", EPP)["spec"]["ports"] if p["name"] == name]
    return port


def role_rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return one(docs, "Role", EPP)["rules"]


def scale_rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in role_rules(docs) if any(res.endswith("/scale") for res in r["resources"])]


# -- the picker's pod ---------------------------------------------------------------------------


@pytest.mark.parametrize("values", VALUE_SETS, ids=set_id)
def test_the_picker_runs_non_root_on_a_read_only_root(values: Path) -> None:
    docs = render(values)
    spec = pod_spec(docs)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == 65532
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    context = picker_container(docs)["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    # A self-signed certificate (and any temp file) goes to /tmp: an emptyDir.
    mounts = {m["mountPath"]: m["name"] for m in picker_container(docs)["volumeMounts"]}
    (tmp,) = [v for v in spec["volumes"] if v["name"] == mounts["/tmp"]]
    assert "emptyDir" in tmp


def test_probes_are_kubelet_grpc_probes_on_the_cleartext_health_port(tmp_path: Path) -> None:
    docs = render(DEFAULT)
    container = picker_container(docs)
    config = picker_config(docs, tmp_path)
    health = config.extproc.health_port
    assert health == 9003
    assert container["livenessProbe"]["grpc"] == {"port": health, "service": "liveness"}
    assert container["readinessProbe"]["grpc"] == {"port": health, "service": "readiness"}
    assert container["startupProbe"]["grpc"] == {"port": health, "service": "liveness"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 9002, "grpc-health": 9003, "metrics": 9090}


@pytest.mark.parametrize("wait", [30, 120])
def test_the_startup_probe_outlasts_the_first_gate_round(wait: int, tmp_path: Path) -> None:
    """The health port opens after the first gate round (up to gate.initial_wait_s)."""
    docs = render(DEFAULT, f"inferenceExtension.poolConfig.gate.initial_wait_s={wait}")
    assert picker_config(docs, tmp_path).gate.initial_wait_s == wait
    probe = picker_container(docs)["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= wait + 30


def test_image_tag_defaults_to_the_app_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert picker_container(render(DEFAULT))["image"] == f"ghcr.io/pd-router/pd-router:{chart['appVersion']}"
    docs = render(DEFAULT, "inferenceExtension.image.tag=0.2.0-rc.1")
    assert picker_container(docs)["image"] == "ghcr.io/pd-router/pd-router:0.2.0-rc.1"


def test_flags_go_before_the_subcommand_and_namespace_is_in_the_env(tmp_path: Path) -> None:
    docs = render(DEFAULT, "inferenceExtension.flags.log-level=debug")
    args = picker_command(docs, tmp_path)
    assert args[:2] == ["--log-level=debug", "serve"]
    env = {e["name"]: e for e in picker_container(docs)["env"]}
    assert env["NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_a_config_change_rolls_the_pods() -> None:
    def checksum(*sets: str) -> str:
        template = one(render(DEFAULT, *sets), "Deployment")["spec"]["template"]
        return template["metadata"]["annotations"]["checksum/config"]

    assert checksum() == checksum()
    assert checksum() != checksum("inferenceExtension.poolConfig.slo.ttft_ms=300")


def test_pool_config_overlay_cannot_move_the_listeners(tmp_path: Path) -> None:
    docs = render(
        DEFAULT,
        "inferenceExtension.poolConfig.extproc.host=127.0.0.1",
        "inferenceExtension.poolConfig.extproc.grace_s=30",
        "inferenceExtension.poolConfig.proxy.enabled=true",
        "inferenceExtension.poolConfig.slo.ttft_ms=300",
    )
    config = picker_config(docs, tmp_path)
    assert config.extproc.host == "0.0.0.0"  # the chart's
    assert config.extproc.grace_s == 30  # the user's
    assert not config.proxy.enabled
    assert config.slo.ttft_ms == 300


def test_large_numbers_survive_the_trip_through_helm(tmp_path: Path) -> None:
    docs = render(
        DEFAULT,
        "inferenceExtension.poolConfig.limits.max_body_bytes=134217728",
        "inferenceExtension.poolConfig.index.capacity_blocks_per_endpoint=1048576",
    )
    config = picker_config(docs, tmp_path)
    assert config.limits.max_body_bytes == 134217728
    assert config.index.capacity_blocks_per_endpoint == 1048576


def test_pdb_keeps_pickers_up() -> None:
    assert one(render(DEFAULT), "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    pdb = one(render(DEFAULT, "inferenceExtension.podDisruptionBudget.minAvailable=2"), "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 2 and "maxUnavailable" not in pdb["spec"]
    docs = render(DEFAULT, "inferenceExtension.podDisruptionBudget.enabled=false")
    assert not of_kind(docs, "PodDisruptionBudget")


# -- Service and InferencePool --------------------------------------------------------------------


@pytest.mark.parametrize("values", VALUE_SETS, ids=set_id)
def test_the_endpoint_picker_ref_names_the_service_port(values: Path, tmp_path: Path) -> None:
    docs = render(values)
    pool = one(docs, "InferencePool")
    assert pool["metadata"]["name"] == RELEASE
    ref = pool["spec"]["endpointPickerRef"]
    service = one(docs, "Service", ref["name"])
    assert ref["kind"] == "Service" and ref["group"] == ""
    port = service_port(docs, "grpc-ext-proc")
    assert ref["port"]["number"] == port["port"]
    container_ports = {p["name"]: p["containerPort"] for p in picker_container(docs)["ports"]}
    assert container_ports[port["targetPort"]] == picker_config(docs, tmp_path).extproc.port
    # The Service selects the picker's pods.
    labels = one(docs, "Deployment", EPP)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


@pytest.mark.parametrize("mode", ["FailOpen", "FailClose"])
def test_failure_mode_is_passed_through(mode: str) -> None:
    pool = one(render(DEFAULT, f"inferenceExtension.failureMode={mode}"), "InferencePool")
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == mode


def test_the_pool_selects_the_model_servers_on_their_target_ports() -> None:
    pool = one(render(value_set("pd-sidecar")), "InferencePool")
    assert pool["spec"]["selector"]["matchLabels"] == {
        "llm-d.ai/inferenceServing": "true",
        "llm-d.ai/model": "qwen3-32b",
    }
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    pool = one(render(value_set("tls-off")), "InferencePool")
    assert pool["spec"]["targetPorts"] == [{"number": 8000}, {"number": 8001}]


def test_a_changed_ext_proc_port_moves_everything_together(tmp_path: Path) -> None:
    docs = render(DEFAULT, "inferenceExtension.extProcPort=9102")
    assert one(docs, "InferencePool")["spec"]["endpointPickerRef"]["port"]["number"] == 9102
    assert service_port(docs, "grpc-ext-proc")["port"] == 9102
    assert picker_config(docs, tmp_path).extproc.port == 9102


# -- TLS ------------------------------------------------------------------------------------------


def test_tls_is_on_and_self_signed_by_default(tmp_path: Path) -> None:
    docs = render(DEFAULT)
    tls = picker_config(docs, tmp_path).extproc.tls
    assert tls.enabled and tls.accept_cleartext
    assert tls.cert_file is None and tls.key_file is None  # self-signed, written under /tmp
    assert "appProtocol" not in service_port(docs, "grpc-ext-proc")


def test_tls_from_a_secret(tmp_path: Path) -> None:
    docs = render(value_set("tls-secret"))
    tls = picker_config(docs, tmp_path).extproc.tls
    assert tls.enabled and not tls.accept_cleartext and tls.min_version == "1.3"
    (volume,) = [v for v in pod_spec(docs)["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "pd-router-tls"
    (mount,) = [m for m in picker_container(docs)["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    assert tls.cert_file == f"{mount['mountPath']}/tls.crt"
    assert tls.key_file == f"{mount['mountPath']}/tls.key"
    assert one(docs, "InferencePool")["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"


def test_tls_off_is_h2c(tmp_path: Path) -> None:
    docs = render(value_set("tls-off"))
    assert not picker_config(docs, tmp_path).extproc.tls.enabled
    assert service_port(docs, "grpc-ext-proc")["appProtocol"] == "kubernetes.io/h2c"
    docs = render(value_set("tls-off"), "inferenceExtension.extProcAppProtocol=grpc")
    assert service_port(docs, "grpc-ext-proc")["appProtocol"] == "grpc"


# -- RBAC -----------------------------------------------------------------------------------------


def test_rbac_reads_pods_and_inference_pools() -> None:
    rules = role_rules(render(DEFAULT))
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]} in rules
    assert {
        "apiGroups": ["inference.networking.k8s.io"],
        "resources": ["inferencepools"],
        "verbs": ["get", "list", "watch"],
    } in rules
    binding = one(render(DEFAULT), "RoleBinding")
    assert binding["roleRef"]["name"] == EPP
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": EPP, "namespace": NAMESPACE}]
    assert pod_spec(render(DEFAULT))["serviceAccountName"] == EPP


@pytest.mark.parametrize(("replicas", "leases"), [(1, False), (2, True), (3, True)])
def test_leases_only_with_more_than_one_replica(replicas: int, leases: bool) -> None:
    docs = render(DEFAULT, f"inferenceExtension.replicas={replicas}")
    assert one(docs, "Deployment")["spec"]["replicas"] == replicas
    lease_rules = [r for r in role_rules(docs) if "leases" in r["resources"]]
    assert bool(lease_rules) is leases
    for rule in lease_rules:
        assert rule["apiGroups"] == ["coordination.k8s.io"]


def test_the_workloads_scale_subresource_is_read_only() -> None:
    assert not scale_rules(render(DEFAULT))
    assert scale_rules(render(value_set("pd-sidecar"))) == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": ["qwen-prefill"],
            "verbs": ["get"],
        },
        {
            "apiGroups": ["leaderworkerset.x-k8s.io"],
            "resources": ["leaderworkersets/scale"],
            "resourceNames": ["qwen-decode"],
            "verbs": ["get"],
        },
    ]


@pytest.mark.parametrize("values", VALUE_SETS, ids=set_id)
def test_nothing_is_written_but_leases(values: Path) -> None:
    for rule in role_rules(render(values)):
        if rule["resources"] != ["leases"]:
            assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule


# -- Redis ----------------------------------------------------------------------------------------


def test_in_chart_redis_is_reachable_from_the_pickers_only(tmp_path: Path) -> None:
    docs = render(value_set("redis-internal"))
    redis = one(docs, "Deployment", f"{EPP}-redis")
    service = one(docs, "Service", f"{EPP}-redis")
    config = picker_config(docs, tmp_path)
    assert config.index.redis is not None
    assert config.index.redis.url == f"redis://{service['metadata']['name']}:6379/0"
    assert config.index.redis.ttl_s == 300  # the user's, next to the chart's url
    pod = redis["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    policy = one(docs, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (rule,) = policy["spec"]["ingress"]
    picker_labels = one(docs, "Deployment", EPP)["spec"]["template"]["metadata"]["labels"]
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchLabels"].items() <= picker_labels.items()
    assert peer["podSelector"]["matchLabels"] != policy["spec"]["podSelector"]["matchLabels"]


def test_no_redis_by_default(tmp_path: Path) -> None:
    docs = render(DEFAULT)
    assert picker_config(docs, tmp_path).index.redis is None
    assert not [d for d in docs if "redis" in d["metadata"]["name"]]


def secrets_mount(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The picker's mount of the Secret-backed files, and its volume."""
    (mount,) = [m for m in picker_container(docs)["volumeMounts"] if m["name"] == "secrets"]
    return mount, pod_volumes(docs)["secrets"]


def assert_no_secret_in_args_or_env(docs: list[dict[str, Any]]) -> None:
    """Nothing the kubelet would expand into the process arguments or environment."""
    container = picker_container(docs)
    for arg in container["args"]:
        assert "$(" not in arg and "token" not in arg and "password" not in arg, arg
    for env in container["env"]:
        assert "$(" not in str(env.get("value", "")), env
        assert "secretKeyRef" not in env.get("valueFrom", {}), env
    assert "envFrom" not in container


def test_external_redis_password_is_a_mounted_file(tmp_path: Path) -> None:
    docs = render(value_set("redis-external"))
    assert len(of_kind(docs, "Deployment")) == 1  # no in-chart Redis
    assert_no_secret_in_args_or_env(docs)
    mount, volume = secrets_mount(docs)
    assert mount == {"name": "secrets", "mountPath": "/var/run/secrets/pd-router", "readOnly": True}
    assert volume["projected"] == {
        "defaultMode": 0o440,
        "sources": [
            {"secret": {"name": "pd-router-redis", "items": [{"key": "password", "path": "redis/password"}]}}
        ],
    }
    assert pod_spec(docs)["securityContext"]["fsGroup"] == 65532  # the group that may read it
    file_config = yaml.safe_load(pool_config_text(docs))
    server = "redis.cache.svc.cluster.local:6380/2?ssl_cert_reqs=required"
    assert file_config["index"]["redis"] == {
        "url": f"rediss://pd-router@{server}",  # no password in the ConfigMap
        "password_file": "/var/run/secrets/pd-router/redis/password",
        "namespace": "qwen3",
        "lookup_timeout_ms": 20,
    }
    config = picker_config(docs, tmp_path)
    assert config.index.redis.url == f"rediss://pd-router@{server}"
    assert config.index.redis.namespace == "qwen3"
    # As is, not URL-encoded; the trailing newline dropped.
    password = SECRET_FILES[("pd-router-redis", "password")]
    assert config.read_secrets().redis_password == password.rstrip("\n") == "s3cr@t/pw:%2F"
    from redis.connection import parse_url

    parsed = parse_url(config.index.redis.url)
    assert (parsed["username"], parsed["db"]) == ("pd-router", 2) and "password" not in parsed


def test_the_secret_files_follow_the_secrets_key() -> None:
    docs = render(value_set("redis-external"), "redis.external.passwordSecret.key=redis-password")
    (source,) = secrets_mount(docs)[1]["projected"]["sources"]
    assert source["secret"]["items"] == [{"key": "redis-password", "path": "redis/password"}]


@pytest.mark.parametrize("values", VALUE_SETS, ids=set_id)
def test_no_secret_mount_without_a_secret(values: Path) -> None:
    docs = render(
        values,
        "redis.external.passwordSecret.name=",
        "inferenceExtension.monitoring.prometheus.auth.enabled=false",
    )
    assert "secrets" not in pod_volumes(docs)
    assert "secrets" not in {m["name"] for m in picker_container(docs)["volumeMounts"]}
    text = pool_config_text(docs)
    assert "password_file" not in text and "token_file" not in text


# -- KEDA and monitoring ----------------------------------------------------------------------------


def test_no_keda_by_default(tmp_path: Path) -> None:
    docs = render(DEFAULT)
    assert not of_kind(docs, "ScaledObject")
    assert not picker_config(docs, tmp_path).keda.enabled
    assert "grpc-keda" not in {p["name"] for p in one(docs, "Service")["spec"]["ports"]}


def test_keda_external_push_scales_a_role_to_zero(tmp_path: Path) -> None:
    """trigger external-push: the same scaler, KEDA streaming IsActive; with minReplicaCount 0 and
    the pool's min_replicas 0 a role sleeps at zero and wakes on its first request."""
    docs = render(
        value_set("keda-external"),
        "keda.trigger=external-push",
        "keda.decode.minReplicaCount=0",
        "keda.decode.signal=recommendedReplicas",
        "keda.decode.target=1",
        "inferenceExtension.poolConfig.signals.min_replicas.prefill=1",
        "inferenceExtension.poolConfig.signals.min_replicas.decode=0",
    )
    config = picker_config(docs, tmp_path)
    assert config.keda.enabled and config.signals.min_replicas.decode == 0
    objects = {o["metadata"]["name"]: o["spec"] for o in of_kind(docs, "ScaledObject")}
    decode = objects[f"{EPP}-decode"]
    assert decode["minReplicaCount"] == 0
    (trigger,) = decode["triggers"]
    assert trigger["type"] == "external-push" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["signal"] == "recommendedReplicas"  # activation: the scaler's 0


def test_keda_external_scaler(tmp_path: Path) -> None:
    docs = render(value_set("keda-external"))
    config = picker_config(docs, tmp_path)
    assert config.keda.enabled and config.keda.host == "0.0.0.0" and config.keda.port == 9004
    assert service_port(docs, "grpc-keda")["port"] == 9004
    keda_port = {"name": "keda-scaler", "containerPort": 9004, "protocol": "TCP"}
    assert keda_port in picker_container(docs)["ports"]
    objects = {o["metadata"]["name"]: o for o in of_kind(docs, "ScaledObject")}
    assert set(objects) == {f"{EPP}-prefill", f"{EPP}-decode"}
    prefill, decode = objects[f"{EPP}-prefill"]["spec"], objects[f"{EPP}-decode"]["spec"]
    assert prefill["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "qwen-prefill",
    }
    assert decode["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "qwen-decode",
    }
    (trigger,) = prefill["triggers"]
    assert trigger["type"] == "external" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"] == {
        "scalerAddress": f"{EPP}.{NAMESPACE}:9004",
        "role": "prefill",
        "signal": "recommendedReplicas",
        "target": "1",
    }
    assert prefill["maxReplicaCount"] == 8
    (trigger,) = decode["triggers"]
    assert trigger["metricType"] == "Value"
    assert trigger["metadata"]["role"] == "decode"
    assert (trigger["metadata"]["signal"], trigger["metadata"]["target"]) == ("load", "0.8")
    assert trigger["metadata"]["activation"] == "0.1"
    behavior = decode["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 600


def test_keda_prometheus(tmp_path: Path) -> None:
    docs = render(value_set("keda-prometheus"))
    assert not picker_config(docs, tmp_path).keda.enabled  # Prometheus asks, not KEDA
    assert "grpc-keda" not in {p["name"] for p in one(docs, "Service")["spec"]["ports"]}
    (scaled,) = of_kind(docs, "ScaledObject")  # decode only: keda.prefill.enabled=false
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "qwen-decode"}
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["serverAddress"] == "http://prometheus-operated.monitoring:9090"
    assert trigger["metadata"]["query"] == (
        f'max(pd_router_recommended_replicas{{role="decode",namespace="{NAMESPACE}",service="{EPP}"}})'
    )
    assert trigger["metadata"]["threshold"] == "1"


def test_keda_needs_the_workloads_named() -> None:
    message = render_error(DEFAULT, "keda.enabled=true")
    assert "workloads.prefill.name" in message
    message = render_error(DEFAULT, "keda.enabled=true", "workloads.prefill.name=p")
    assert "workloads.decode.name" in message


def test_service_monitor_scrapes_the_metrics_port_with_the_token(tmp_path: Path) -> None:
    docs = render(value_set("keda-prometheus"))
    monitor = one(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    service = one(docs, "Service", EPP)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http-metrics" and service_port(docs, "http-metrics")["port"] == 9090
    assert endpoint["interval"] == "15s"
    assert endpoint["authorization"]["credentials"] == {"name": "pd-router-metrics-token", "key": "token"}
    # The picker reads the same Secret's token from a mounted file, not from its arguments.
    assert_no_secret_in_args_or_env(docs)
    mount, volume = secrets_mount(docs)
    assert mount["mountPath"] == "/var/run/secrets/pd-router" and mount["readOnly"] is True
    assert volume["projected"]["defaultMode"] == 0o440
    assert volume["projected"]["sources"] == [
        {"secret": {"name": "pd-router-metrics-token", "items": [{"key": "token", "path": "metrics/token"}]}}
    ]
    assert yaml.safe_load(pool_config_text(docs))["metrics"]["token_file"] == (
        "/var/run/secrets/pd-router/metrics/token"
    )
    config = picker_config(docs, tmp_path)
    assert config.metrics.token is None
    assert config.read_secrets().metrics_token == SECRET_FILES[("pd-router-metrics-token", "token")]
    assert not of_kind(render(DEFAULT), "ServiceMonitor")


def test_both_secrets_share_one_mount(tmp_path: Path) -> None:
    docs = render([value_set("redis-external"), value_set("keda-prometheus")])
    assert_no_secret_in_args_or_env(docs)
    mount, volume = secrets_mount(docs)
    assert mount["readOnly"] is True
    paths = {item["path"] for source in volume["projected"]["sources"] for item in source["secret"]["items"]}
    assert paths == {"redis/password", "metrics/token"}
    config = picker_config(docs, tmp_path)
    assert config.metrics.token_file.endswith("/metrics/token")
    assert config.index.redis.password_file.endswith("/redis/password")
    secrets = config.read_secrets()
    assert secrets.metrics_token == "tok-123.abc_XYZ" and secrets.redis_password == "s3cr@t/pw:%2F"


# -- the decode sidecar -------------------------------------------------------------------------------


def test_the_decode_sidecar_snippet_only_when_enabled() -> None:
    assert not [d for d in render(DEFAULT) if d["metadata"]["name"].endswith("decode-sidecar")]
    docs = render(value_set("pd-sidecar"))
    (container,) = yaml.safe_load(one(docs, "ConfigMap", f"{EPP}-decode-sidecar")["data"]["container.yaml"])
    assert container["image"] == picker_container(docs)["image"]
    context = container["securityContext"]
    assert context["runAsUser"] == 65532 and context["runAsNonRoot"] is True  # even in a root pod
    assert context["readOnlyRootFilesystem"] is True and context["capabilities"] == {"drop": ["ALL"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
