"""The Helm chart's checks (helm/pd-router): a real ``helm`` renders the chart offline, and what it
renders is validated against the Kubernetes schemas (kubernetes-validate), the InferencePool CRD
(vendored in crds/) and pd-router's own configuration loader.

helm is ``$HELM``, else ``helm`` on PATH, else ``.ci/bin/helm`` (``bash .ci/install-helm`` puts it
there). These helpers are shared by the test modules of this folder.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pd-router"
VALUE_SETS = sorted((CHART / "ci").glob("*-values.yaml"))
CRD = Path(__file__).resolve().parent / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
RELEASE = "pdr"
NAMESPACE = "llm"
KUBE_VERSION = "1.35"  # the helm binary's client version; kubernetes-validate bundles its schemas
BUILTIN_GROUPS = {"v1", "apps/v1", "policy/v1", "rbac.authorization.k8s.io/v1", "networking.k8s.io/v1"}


class RenderError(Exception):
    """``helm template`` failed; the message is helm's."""


def set_id(path: Path) -> str:
    return path.name.removesuffix("-values.yaml")


@functools.cache
def helm_binary() -> str:
    candidates = [os.environ.get("HELM"), shutil.which("helm"), str(ROOT / ".ci" / "bin" / "helm")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail(
        "no helm binary: run `bash .ci/install-helm` (it puts helm v4 into .ci/bin/helm), "
        "or set HELM=/path/to/helm",
        pytrace=False,
    )


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm_binary(), *args], capture_output=True, text=True, timeout=60, check=False, cwd=ROOT
    )


@functools.cache
def _render(values: tuple[str, ...], sets: tuple[str, ...]) -> tuple[dict[str, Any], ...]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    for path in values:
        args += ["--values", path]
    for item in sets:
        args += ["--set", item]
    result = run_helm(*args)
    if result.returncode != 0:
        raise RenderError(result.stderr.strip())
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def render(values: Path | Iterable[Path] = (), *sets: str) -> list[dict[str, Any]]:
    """The chart's objects for these values files and ``--set`` items (each a deep copy)."""
    paths = (values,) if isinstance(values, Path) else tuple(values)
    return copy.deepcopy(list(_render(tuple(str(p) for p in paths), sets)))


def render_error(values: Path | Iterable[Path] = (), *sets: str) -> str:
    """helm's error for values the chart must refuse."""
    try:
        render(values, *sets)
    except RenderError as exc:
        return str(exc)
    raise AssertionError(f"helm template accepted {values} {sets}")


def value_set(name: str) -> Path:
    path = CHART / "ci" / f"{name}-values.yaml"
    assert path.is_file(), path
    return path


def of_kind(docs: Sequence[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: Sequence[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [doc for doc in of_kind(docs, kind) if name is None or doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} named {name or 'anything'}: {found}"
    return found[0]


def picker_container(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    deployment = one(docs, "Deployment", f"{RELEASE}-epp")
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "epp"]
    return container


def pool_config_text(docs: Sequence[dict[str, Any]]) -> str:
    return one(docs, "ConfigMap", f"{RELEASE}-epp")["data"]["pool.yaml"]


# -- validation -------------------------------------------------------------------------------


def validate_builtin(obj: dict[str, Any]) -> None:
    """A built-in kind against Kubernetes' own schema; strict: unknown fields are errors."""
    kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused: the API server would prune them silently."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def inference_pool_validator() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load(CRD.read_text(encoding="utf-8"))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta is not in the CRD
    return jsonschema.Draft7Validator(schema)


def validate_inference_pool(obj: dict[str, Any]) -> None:
    """The upstream CRD's openAPIV3Schema, plus its two CEL rules (jsonschema cannot run CEL)."""
    assert obj["apiVersion"] == "inference.networking.k8s.io/v1"
    inference_pool_validator().validate(obj)
    spec = obj["spec"]
    numbers = [port["number"] for port in spec["targetPorts"]]
    assert len(numbers) == len(set(numbers)), f"port number must be unique: {numbers}"
    ref = spec.get("endpointPickerRef")
    if ref is not None and ref.get("kind", "Service") == "Service":
        assert "port" in ref, "port is required when kind is 'Service'"


_SECONDS = re.compile(r"^([0-9]+(ms|s|m|h))+$")


def validate_service_monitor(obj: dict[str, Any]) -> None:
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(obj) <= {"apiVersion", "kind", "metadata", "spec"}
    spec = obj["spec"]
    assert spec["selector"]["matchLabels"]
    assert spec["endpoints"], "at least one endpoint"
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "scheme", "interval", "authorization"}
        assert endpoint["port"] and endpoint["path"].startswith("/")
        assert _SECONDS.match(endpoint["interval"]), endpoint["interval"]
        if "authorization" in endpoint:
            credentials = endpoint["authorization"]["credentials"]
            assert set(credentials) == {"name", "key"}


def validate_scaled_object(obj: dict[str, Any]) -> None:
    assert obj["apiVersion"] == "keda.sh/v1alpha1"
    spec = obj["spec"]
    assert set(spec) <= {
        "scaleTargetRef",
        "minReplicaCount",
        "maxReplicaCount",
        "pollingInterval",
        "cooldownPeriod",
        "advanced",
        "triggers",
    }
    assert {"apiVersion", "kind", "name"} == set(spec["scaleTargetRef"])
    assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
    if behavior is not None:
        assert set(behavior) <= {"scaleUp", "scaleDown"}
    assert spec["triggers"]
    for trigger in spec["triggers"]:
        assert trigger["type"] in {"external", "external-push", "prometheus"}
        assert trigger["metricType"] in {"AverageValue", "Value"}
        assert all(isinstance(v, str) for v in trigger["metadata"].values()), trigger["metadata"]
        required = (
            {"scalerAddress", "role", "signal", "target"}
            if trigger["type"] in ("external", "external-push")
            else {"serverAddress", "query", "threshold"}
        )
        assert required <= set(trigger["metadata"]), trigger["metadata"]


def validate(obj: dict[str, Any]) -> None:
    """Any object the chart renders, by its kind."""
    if obj["apiVersion"] in BUILTIN_GROUPS:
        validate_builtin(obj)
    elif obj["kind"] == "InferencePool":
        validate_inference_pool(obj)
    elif obj["kind"] == "ServiceMonitor":
        validate_service_monitor(obj)
    elif obj["kind"] == "ScaledObject":
        validate_scaled_object(obj)
    else:
        raise AssertionError(f"the chart renders a kind no check knows: {obj['apiVersion']} {obj['kind']}")


# -- what the picker makes of it --------------------------------------------------------------

# Stand-ins for the Secrets the chart mounts as files, by (Secret name, key); a mounted Secret's
# value often ends in a newline (kubectl create secret --from-file), which the picker drops.
SECRET_FILES = {
    ("pd-router-redis", "password"): "s3cr@t/pw:%2F\n",
    ("pd-router-metrics-token", "token"): "tok-123.abc_XYZ",
}


def pod_volumes(docs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    deployment = one(docs, "Deployment", f"{RELEASE}-epp")
    return {v["name"]: v for v in deployment["spec"]["template"]["spec"].get("volumes", [])}


def secret_files(volume: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """The files a secret or projected volume holds: relative path -> (Secret name, key)."""
    if "secret" in volume:
        secret = volume["secret"]
        sources = [{"secret": {"name": secret["secretName"], "items": secret.get("items", [])}}]
    else:
        sources = volume.get("projected", {}).get("sources", [])
    files = {}
    for source in sources:
        if "secret" in source:
            secret = source["secret"]
            for item in secret.get("items", []):
                files[item["path"]] = (secret["name"], item["key"])
    return files


def _materialize_secret_mounts(docs: Sequence[dict[str, Any]], tmp_path: Path, text: str) -> str:
    """Writes the stand-in of every file a Secret-backed mount of the picker holds under
    ``tmp_path`` and points the pool config's paths there, as the kubelet would mount them."""
    volumes = pod_volumes(docs)
    for mount in picker_container(docs).get("volumeMounts", []):
        files = secret_files(volumes[mount["name"]])
        if not files:
            continue
        local = tmp_path / "mounts" / mount["name"]
        for relative, ref in files.items():
            target = local / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(SECRET_FILES[ref], encoding="utf-8")
        text = text.replace(mount["mountPath"].rstrip("/") + "/", f"{local}/")
    return text


def picker_command(docs: Sequence[dict[str, Any]], tmp_path: Path) -> list[str]:
    """The picker container's arguments, the ConfigMap's pool.yaml written where ``--config``
    names it and the Secret-backed files where it names them (both moved into ``tmp_path``)."""
    container = picker_container(docs)
    (config_arg,) = [a for a in container["args"] if a.startswith("--config=")]
    mounted = Path(config_arg.removeprefix("--config="))
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "config"]
    assert mounted.parent == Path(mount["mountPath"]) and mounted.name == "pool.yaml", config_arg
    local = tmp_path / "pool.yaml"
    local.write_text(_materialize_secret_mounts(docs, tmp_path, pool_config_text(docs)), encoding="utf-8")
    return [f"--config={local}" if a == config_arg else a for a in container["args"]]


def picker_config(docs: Sequence[dict[str, Any]], tmp_path: Path) -> Any:
    """The PoolConfig the picker starts with: its own command-line parser and configuration loader
    on the rendered arguments and ConfigMap, and its secret files read as ``serve`` reads them
    (raises ConfigError as the picker would exit on)."""
    from router.server.cli import _parser, config_from

    args = _parser().parse_args(picker_command(docs, tmp_path))
    assert args.command == "serve"
    config = config_from(args)
    config.read_secrets()
    return config
