"""examples/pool.yaml stays what the README says it is: a valid configuration that shows every
field of ``PoolConfig`` with its default. A field added to router/server/config.py fails here until the
example shows it; a changed default fails until the example follows (or the field is listed in
``EXAMPLE_VALUES`` with the reason it differs).

Blocks whose default is ``null`` (``index.redis``, ``index.precise``, ``kubernetes``) are written
as ``null`` and shown by a commented-out example right below: ``# key: ...`` at the block's
indentation, continued by deeper-indented comment lines. Those examples count as showing their
fields, and they must be valid too."""

from __future__ import annotations

import re
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from router.scheduling.costmodel.registry import DEFAULT_WEIGHTS, MODEL_WEIGHTS
from router.server.config import PoolConfig, load_config, parse_config

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pool.yaml"

# Fields (and everything under them) whose value in the example is deliberately not the default.
EXAMPLE_VALUES = {
    "model": "required: the simulated engines' model name",
    "endpoints": "the demo pool: 2 prefill + 2 decode on two racks (default: empty)",
    "slo.ttft_ms": "the SLOs of the simulator demo and benchmarks (simulator/demo.py)",
    "slo.tpot_ms": "the SLOs of the simulator demo and benchmarks (simulator/demo.py)",
    "links.same": "the demo's rack topology, which the simulator uses too",
    "links.default": "the demo's rack topology, which the simulator uses too",
    "links.pairs": "the demo's cross-rack link",
    "weights": "every term at 1.0, the weight of one left out (default: {}); checked below",
    "index.precise.chat_template": "a commented-out example of precise mode",
    "kubernetes.namespace": "a commented-out example of discovery",
    "kubernetes.pool_name": "a commented-out example of discovery",
    "kubernetes.selector": "a commented-out example of discovery",
    "kubernetes.target_ports": "a commented-out example of discovery",
}


@dataclass(frozen=True)
class Shown:
    """One field of PoolConfig: its path, its default, and the values the example gives it (in
    the file itself or in commented-out examples; none: the example does not show it)."""

    path: str
    default: Any  # PydanticUndefined: required
    values: list[Any]
    leaf: bool
    written: bool  # its key is in the file itself, or it is inside a commented-out example


def _block_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds directly (``X`` or ``X | None``); None for scalars, lists and maps."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        models = [m for m in map(_block_model, get_args(annotation)) if m is not None]
        return models[0] if len(models) == 1 else None
    return None


def commented_examples(text: str, key: str, depth: int, parent: str | None) -> list[Any]:
    """The values of the commented-out ``key:`` examples at ``depth`` (2 spaces a level) under
    ``parent`` (the nearest uncommented key line above with less indentation)."""
    lines = text.splitlines()
    indent = "  " * depth
    found = []
    for i, line in enumerate(lines):
        match = re.fullmatch(rf"{indent}# {re.escape(key)}:(.*)", line)
        if match is None or _parent_key(lines[:i], len(indent)) != parent:
            continue
        prefix = indent + "#"
        block = [f"{key}:{match.group(1)}"]
        for follow in lines[i + 1 :]:
            if not follow.startswith(prefix + "   "):
                break
            block.append(follow[len(prefix) + 1 :])
        found.append(yaml.safe_load("\n".join(block))[key])
    return found


def _parent_key(above: list[str], indent: int) -> str | None:
    for line in reversed(above):
        stripped = line.lstrip(" ")
        if not stripped or stripped.startswith("#") or len(line) - len(stripped) >= indent:
            continue
        return stripped.split(":", 1)[0]
    return None


def shown_fields(
    text: str,
    model: type[BaseModel] = PoolConfig,
    views: list[Any] | None = None,
    defaults: BaseModel | None = None,
    prefix: str = "",
    commented: bool = False,
) -> Iterator[Shown]:
    """Every field of ``model`` reachable through nested blocks (not into lists of models: their
    key is enough), with what the example shows for it."""
    if views is None:
        views = [yaml.safe_load(text)]
    depth = prefix.count(".")
    parent = prefix.rstrip(".").rsplit(".", 1)[-1] or None
    for name, field in model.model_fields.items():
        path = prefix + name
        values = [view[name] for view in views if isinstance(view, dict) and name in view]
        written = commented or bool(values)
        block = _block_model(field.annotation)
        only_comments = commented
        if block is not None and all(v is None for v in values):
            values += commented_examples(text, name, depth, parent)
            only_comments = True
        default = _default(field, defaults, name)
        yield Shown(path, default, values, leaf=block is None, written=written)
        if block is not None:
            inner = default if isinstance(default, BaseModel) else None
            present = [v for v in values if v is not None]
            yield from shown_fields(text, block, present, inner, path + ".", only_comments)


def _default(field: FieldInfo, defaults: BaseModel | None, name: str) -> Any:
    """The value a field has when the file leaves it out: its enclosing block's default decides
    (``links.same.latency_ms``), else its own."""
    if defaults is not None:
        return getattr(defaults, name)
    return PydanticUndefined if field.is_required() else field.get_default(call_default_factory=True)


def _excepted(path: str) -> bool:
    return any(path == p or path.startswith((p + ".", p + "[")) for p in EXAMPLE_VALUES)


@pytest.fixture(scope="module")
def text() -> str:
    return EXAMPLE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def fields(text: str) -> list[Shown]:
    return list(shown_fields(text))


def test_the_example_loads() -> None:
    config = load_config(EXAMPLE)
    assert {e.role for e in config.endpoints} == {"prefill", "decode"}


def test_the_example_shows_every_field(fields: list[Shown]) -> None:
    missing = [f.path for f in fields if not f.values]
    assert not missing, f"examples/pool.yaml does not show: {missing}"
    unwritten = [f.path for f in fields if not f.written]
    assert not unwritten, f"examples/pool.yaml shows these only in a comment (write `key: null`): {unwritten}"
    # Sanity: the walk saw the blocks that are only commented out, and stopped at lists of models.
    paths = {f.path for f in fields}
    assert {
        "index.precise.tokenizer",
        "index.redis.url",
        "kubernetes.pool_name",
        "proxy.tls.enabled",
    } <= paths
    assert {"endpoints", "model_rewrites", "links.pairs"} <= paths
    assert not any(p.startswith(("endpoints.", "model_rewrites.", "links.pairs.")) for p in paths)


def test_the_example_shows_the_defaults(fields: list[Shown]) -> None:
    wrong = {}
    for f in fields:
        if not f.leaf or f.default is PydanticUndefined or _excepted(f.path):
            continue
        expected = to_jsonable_python(f.default)
        off = [value for value in f.values if value != expected]
        if off:
            wrong[f.path] = (off, expected)
    assert not wrong, f"examples/pool.yaml: values other than the defaults ((shown, default)): {wrong}"


def test_the_exceptions_name_fields_that_differ(fields: list[Shown]) -> None:
    by_path = {f.path: f for f in fields}
    for path, reason in EXAMPLE_VALUES.items():
        assert path in by_path, f"{path}: not a field ({reason})"
        f = by_path[path]
        assert f.values, path
        if f.default is not PydanticUndefined:
            expected = to_jsonable_python(f.default)
            assert any(value != expected for value in f.values), f"{path} is the default now: {reason}"


def test_the_example_weighs_every_term_as_an_unset_one(text: str) -> None:
    """The default ``weights: {}`` leaves every built-in term at its DEFAULT_WEIGHTS value and
    prefix and link at 1.0 (``PoolConfig.weight``): the example writes exactly those out."""
    weights = yaml.safe_load(text)["weights"]
    assert weights == {**DEFAULT_WEIGHTS, **dict.fromkeys(MODEL_WEIGHTS, 1.0)}


@pytest.mark.parametrize(
    ("key", "depth", "parent"),
    [("redis", 1, "index"), ("precise", 1, "index"), ("kubernetes", 0, None)],
)
def test_the_commented_examples_are_valid(text: str, key: str, depth: int, parent: str | None) -> None:
    examples = commented_examples(text, key, depth, parent)
    assert examples, f"no commented-out {key} example"
    for example in examples:
        data = yaml.safe_load(text)
        (data[parent] if parent else data)[key] = example
        parse_config(data)


def test_the_commented_rewrite_example_is_valid(text: str) -> None:
    (rules,) = commented_examples(text, "model_rewrites", 0, None)
    data = yaml.safe_load(text)
    assert data["model_rewrites"] == []
    assert parse_config({**data, "model_rewrites": rules}).model_rewrites
