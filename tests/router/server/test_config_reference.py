"""The user docs stay true to the code: docs/configuration.md is what the generator renders from
the typed configuration now and covers every field; the metric names, rejection codes, admin verbs
and flags that docs/operations.md and docs/deployment.md mention exist in the code."""

from __future__ import annotations

import argparse
import ast
import itertools
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel, Field

from router.control.admin import VERBS
from router.request.rejections import KINDS
from router.server import config_reference
from router.server.cli import _parser
from router.server.config import ConfigError, PoolConfig, parse_config

ROOT = Path(__file__).resolve().parents[3]
CONFIGURATION = ROOT / "docs" / "configuration.md"
OPERATIONS = ROOT / "docs" / "operations.md"
DEPLOYMENT = ROOT / "docs" / "deployment.md"


# -- docs/configuration.md ----------------------------------------------------------------------------


def test_configuration_md_is_what_the_generator_renders_now() -> None:
    expected = config_reference.render()
    actual = CONFIGURATION.read_text(encoding="utf-8") if CONFIGURATION.exists() else ""
    assert actual == expected, (
        "docs/configuration.md is stale (router/server/config.py changed): "
        f"run `{config_reference.REGENERATE}`"
    )


def test_rendering_is_deterministic() -> None:
    assert config_reference.render() == config_reference.render()


def field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field's dotted path, walked here independently of the generator: ``a.b`` for a nested
    model's field, ``a[].b`` for a list item's, ``a.<key>.b`` for a dict value's."""
    paths = []
    for name, field in model.model_fields.items():
        path = f"{prefix}.{field.alias or name}" if prefix else field.alias or name
        paths.append(path)
        for sub, suffix in _models_in(field.annotation):
            paths += field_paths(sub, path + suffix)
    return paths


def _models_in(annotation: Any) -> list[tuple[type[BaseModel], str]]:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, "")]
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        return [found for arg in args for found in _models_in(arg)]
    if origin in (list, tuple, set, frozenset):
        return [(m, "[]" + s) for arg in args if arg is not Ellipsis for m, s in _models_in(arg)]
    if origin is dict and len(args) == 2:
        return [(m, ".<key>" + s) for m, s in _models_in(args[1])]
    return []


def documented_paths(text: str) -> set[str]:
    return set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.MULTILINE))


def test_every_field_of_the_configuration_has_a_row() -> None:
    paths = field_paths(PoolConfig)
    assert len(paths) > 100 and "endpoints[].kv_events.endpoint" in paths
    rows = documented_paths(config_reference.render())
    missing = [path for path in paths if path not in rows]
    assert not missing, f"fields without a row in the reference: {missing}"
    assert not rows - set(paths) - {flag for flag, _, _ in config_reference.CLI_FLAGS}


class _Inner(BaseModel):
    """An inner block."""

    x: int = Field(1, description="an x")


class _Sample(BaseModel):
    name: str = Field(min_length=1)
    role: Literal["prefill", "decode"] = "decode"
    port: Annotated[int, Field(ge=0, lt=65536)] = 8000
    share: Annotated[float, Field(gt=0, le=1)] = 0.5
    count: Annotated[int, Field(ge=1)] | None = None
    items: list[_Inner] = []
    by_name: dict[str, _Inner] = {}
    weights: dict[str, Annotated[float, Field(ge=0)]] = {}
    inner: _Inner = _Inner()
    other: _Inner = _Inner(x=7)
    version: Literal["1.2", "1.3"] = "1.2"
    pair: tuple[str, str] = ("a", "b")


def test_types_and_defaults_read_as_a_user_writes_them() -> None:
    rows = {row.path: row for table in config_reference.tables(_Sample) for row in table.rows}
    expected = {
        "name": ("str, non-empty", "*required*"),
        "role": ('"prefill" | "decode"', "`decode`"),
        "port": ("0 ≤ int < 65536", "`8000`"),
        "share": ("0 < float ≤ 1", "`0.5`"),
        "count": ("optional int ≥ 1", "`null`"),
        "items": ("list[_Inner]", "`[]`"),
        "items[].x": ("int", "`1`"),
        "by_name.<key>.x": ("int", "`1`"),
        "weights": ("map[str, float ≥ 0]", "`{}`"),
        "inner": ("_Inner", "*its fields' defaults*"),
        "other": ("_Inner", "`{x: 7}`"),
        "other.x": ("int", "`1` (`7` while `other` is not set)"),
        "version": ('"1.2" | "1.3"', "`'1.2'`"),
        "pair": ("[str, str]", "`[a, b]`"),
    }
    assert {path: (rows[path].type, rows[path].default) for path in expected} == expected
    assert rows["inner.x"].description == "an x"
    text = config_reference.render(_Sample)
    assert '| `role` | "prefill" \\| "decode" |' in text  # pipes escaped inside the table
    assert "| `items` | list[[_Inner](#items)] |" in text  # a nested model's type links to its table
    assert "An inner block." in text


def test_the_flag_table_names_real_flags_and_fields() -> None:
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    options = {option for action in serve._actions for option in action.option_strings}
    paths = set(field_paths(PoolConfig))
    for flag, path, _ in config_reference.CLI_FLAGS:
        assert flag.split()[0] in options, flag
        assert path in paths, path


def test_the_example_error_is_what_check_config_prints() -> None:
    endpoints = [{"address": "10.0.0.1:8000"}, {"address": "10.0.0.2:8000", "role": "both"}]
    with pytest.raises(ConfigError) as caught:
        parse_config({"model": "m", "endpoints": endpoints})
    assert f"pd-router: invalid configuration: pool.yaml: {caught.value}" == config_reference.EXAMPLE_ERROR


def test_main_writes_the_reference(tmp_path: Path) -> None:
    out = tmp_path / "configuration.md"
    assert config_reference.main(["--write", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == config_reference.render()


# -- names the operations and deployment guides mention --------------------------------------------------

_FAMILY = r"(?:pd_router|llm_d_epp|inference_objective|inference_pool|inference_extension)_"
_METRIC = re.compile(rf"{_FAMILY}[a-z0-9_]+")
_MENTION = re.compile(rf"\b({_FAMILY}[a-z0-9_]*)")
_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def _is_metric(name: str) -> bool:
    return bool(_METRIC.fullmatch(name)) and not name.endswith("_")


@dataclass
class Registered:
    """Metric names found in the source, and the templates whose placeholders could not be read."""

    names: set[str]
    patterns: list[re.Pattern[str]]

    def __contains__(self, name: object) -> bool:
        assert isinstance(name, str)
        bare = {name} | {name.removesuffix(s) for s in _SUFFIXES if name.endswith(s)}
        return any(b in self.names or any(p.fullmatch(b) for p in self.patterns) for b in bare)


def registered_metrics() -> Registered:
    """Metric names in router/'s source: string literals, and f-string templates
    (``f"pd_router_kv_events_{name}"``, ``f"{prefix}_flow_control_queue_size"``) expanded with the
    values their loop binds (a literal tuple, a dict's keys, or a module constant holding one). A
    template whose placeholders cannot be read that way matches any name part there, unless its
    fixed text is only a family prefix (``f"pd_router_{rejection.code}"``: Envoy's response details,
    not a metric)."""
    found = Registered(set(), [])
    for path in sorted((ROOT / "router").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        assigned: dict[str, list[ast.expr]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        assigned.setdefault(target.id, []).append(node.value)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_metric(node.value):
                found.names.add(node.value)
            elif isinstance(node, ast.JoinedStr) and _template_of_a_metric(node):
                _expand(node, parents, assigned, found)
    return found


def _template_of_a_metric(node: ast.JoinedStr) -> bool:
    fixed = [p.value for p in node.values if isinstance(p, ast.Constant) and isinstance(p.value, str)]
    if not fixed or not all(re.fullmatch(r"[a-z0-9_]+", f) for f in fixed):
        return False
    first = node.values[0]
    return bool(re.match(_FAMILY, fixed[0])) if isinstance(first, ast.Constant) else fixed[0].startswith("_")


def _expand(
    node: ast.JoinedStr,
    parents: dict[ast.AST, ast.AST],
    assigned: dict[str, list[ast.expr]],
    found: Registered,
) -> None:
    parts: list[list[str]] = []
    for part in node.values:
        if isinstance(part, ast.Constant):
            parts.append([str(part.value)])
            continue
        values = None
        if isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name):
            values = _loop_values(node, part.value.id, parents, assigned)
        if values is None:
            fixed = "".join(str(p.value) for p in node.values if isinstance(p, ast.Constant))
            if not re.fullmatch(_FAMILY, fixed):
                found.patterns.append(
                    re.compile(
                        "".join(
                            re.escape(str(p.value)) if isinstance(p, ast.Constant) else "[a-z0-9_]+"
                            for p in node.values
                        )
                    )
                )
            return
        parts.append(values)
    found.names.update(n for n in map("".join, itertools.product(*parts)) if _is_metric(n))


def _loop_values(
    node: ast.AST, name: str, parents: dict[ast.AST, ast.AST], assigned: dict[str, list[ast.expr]]
) -> list[str] | None:
    """The strings the nearest enclosing ``for`` (or comprehension) binds to ``name``."""
    while node in parents:
        node = parents[node]
        loops: list[tuple[ast.expr, ast.expr]] = []
        if isinstance(node, ast.For):
            loops = [(node.target, node.iter)]
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            loops = [(g.target, g.iter) for g in node.generators]
        for target, iterable in loops:
            if isinstance(target, ast.Name) and target.id == name:
                index = None
            elif isinstance(target, ast.Tuple) and any(
                isinstance(e, ast.Name) and e.id == name for e in target.elts
            ):
                index = next(i for i, e in enumerate(target.elts) if isinstance(e, ast.Name) and e.id == name)
            else:
                continue
            items = _items(iterable, assigned)
            if items is None:
                return None
            values = []
            for item in items:
                element = item if index is None else item.elts[index] if isinstance(item, ast.Tuple) else None
                if not (isinstance(element, ast.Constant) and isinstance(element.value, str)):
                    return None
                values.append(element.value)
            return values
    return None


def _items(iterable: ast.expr, assigned: dict[str, list[ast.expr]]) -> list[ast.expr] | None:
    if isinstance(iterable, (ast.Tuple, ast.List, ast.Set)):
        return list(iterable.elts)
    if isinstance(iterable, ast.Dict):
        return [key for key in iterable.keys if key is not None]
    if isinstance(iterable, ast.Name) and len(assigned.get(iterable.id, [])) == 1:
        return _items(assigned[iterable.id][0], assigned)
    if (
        isinstance(iterable, ast.Call)
        and isinstance(iterable.func, ast.Attribute)
        and iterable.func.attr in ("items", "keys")
    ):
        mapping = iterable.func.value
        while isinstance(mapping, ast.Name) and len(assigned.get(mapping.id, [])) == 1:
            mapping = assigned[mapping.id][0]
        if not isinstance(mapping, ast.Dict):
            return None
        keys = [key for key in mapping.keys if key is not None]
        if iterable.func.attr == "keys":
            return keys
        return [ast.Tuple(elts=[k, v]) for k, v in zip(keys, mapping.values, strict=True)]
    return None


def is_registered(name: str, registered: Registered) -> bool:
    return name in registered


def test_the_metric_scan_finds_the_metrics_and_refuses_made_up_names() -> None:
    registered = registered_metrics()
    for name in (
        "pd_router_requests_total",
        "pd_router_pool_load",
        "pd_router_kv_events_gaps_total",
        "pd_router_shared_index_redis_errors_total",
        "llm_d_epp_flow_control_queue_size",
        "inference_extension_flow_control_request_queue_duration_seconds_bucket",
        "llm_d_epp_average_kv_cache_utilization",
        "inference_objective_prompt_cached_tokens",
    ):
        assert is_registered(name, registered), name
    for name in ("pd_router_requests_totals", "pd_router_no_capacity", "pd_router_kv_events_lost_total"):
        assert not is_registered(name, registered), name


@pytest.mark.parametrize("doc", [OPERATIONS, DEPLOYMENT], ids=lambda p: p.name)
def test_every_metric_a_guide_mentions_is_registered(doc: Path) -> None:
    registered = registered_metrics()
    mentioned = {m for m in _MENTION.findall(doc.read_text(encoding="utf-8")) if not m.endswith("_")}
    unknown = sorted(m for m in mentioned if not is_registered(m, registered))
    assert not unknown, f"{doc.name} mentions metrics the code does not register: {unknown}"
    if doc is OPERATIONS:
        assert len(mentioned) >= 40


def test_the_rejection_table_is_the_code_table() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    for kind in set(KINDS.values()):
        assert f"| {kind.status} | `{kind.code}` |" in text, kind
    listed = set(re.findall(r"^\| \d{3} \| `([a-z_]+)` \|", text, flags=re.MULTILINE))
    assert listed == {kind.code for kind in KINDS.values()}


def test_the_admin_verbs_the_guide_uses_exist() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    used = set(re.findall(r"/admin/groups/[^/\s]+/([a-z]+)", text))
    assert used and used <= set(VERBS)


def helm_values(node: object, prefix: str = "") -> set[str]:
    """Dotted paths of the Helm chart's values (``keda.trigger`` is a chart value, not a field)."""
    if not isinstance(node, dict):
        return set()
    out = set()
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        out |= {path} | helm_values(value, path)
    return out


def test_every_config_field_a_guide_names_exists() -> None:
    """``section.field`` in backticks, for the top-level blocks: a renamed field fails here (a name
    that is one of the Helm chart's values is the chart's)."""
    paths = {re.sub(r"\[\]", "", p) for p in field_paths(PoolConfig)}
    blocks = {p for p in paths if "." not in p}
    chart = ROOT / "helm" / "pd-router" / "values.yaml"
    values = helm_values(yaml.safe_load(chart.read_text(encoding="utf-8"))) if chart.exists() else set()
    for doc in (OPERATIONS, DEPLOYMENT):
        text = doc.read_text(encoding="utf-8")
        named = set(re.findall(r"`([a-z_]+(?:\.[a-z_0-9]+)+)(?:[:=][^`]*)?`", text))
        wrong = sorted(
            n
            for n in named
            if n.split(".")[0] in blocks and re.sub(r"\.\d+", "", n) not in paths and n not in values
        )
        assert not wrong, f"{doc.name} names config fields that do not exist: {wrong}"
