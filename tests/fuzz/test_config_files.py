"""Fuzzing configuration: ``parse_config`` on random nested mappings, ``load_config`` on YAML text.

Mappings follow the schema's shape (every section and field name, plus unknown ones) with values
of any type (huge numbers, NaN, infinities, wrong containers); YAML documents are such mappings
dumped and then mutated. Property: a ``PoolConfig`` or a ``ConfigError`` whose message names a
field (``section.field: ...``), never another exception.

The bugs this found in ``router/server/config.py`` (``--set`` errors, YAML that is not UTF-8, nested too
deeply or refused by PyYAML's constructors, non-finite numbers, huge inputs echoed in messages)
each have a reproducer at the end.

Example counts: fixed and derandomized for CI; ``FUZZ_EXAMPLES=<n>`` runs ``n`` random examples
per test (see ``tests/fuzz/__init__.py``).
"""

from __future__ import annotations

import copy
import itertools
import math
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from fuzz import fuzz_settings
from router.request.parse import parse_request
from router.server.config import ConfigError, PoolConfig, load_config, parse_config

VALID = {"model": "m", "endpoints": [{"address": "10.0.0.1:8000"}]}

PLAUSIBLE = ["10.0.0.1:8000", "[::1]:8000", "pod-a:80", "10.0.0.1:99999", "10.0.0.1:\u00b2", "10.0.0.1:"]
PLAUSIBLE += ["prefill", "decode", "prefill-decode", "both", "joint", "ranks", "1", "true", "", "None"]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=16)
    | st.sampled_from(PLAUSIBLE)
)
junk = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=8,
)
weights = st.dictionaries(
    st.sampled_from(["queue", "prefill", "kv", "prefix", "link", "absorb", "cost", "base", "registry"])
    | st.sampled_from(["kv_pressure", "nosuch", "Bad-Name", "os", ""])
    | st.text(max_size=6),
    scalars,
    max_size=4,
)


def _models(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The section model inside a field's annotation, and whether the field is a list of it."""
    origin = typing.get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    if origin is list:
        model, _ = _models(typing.get_args(annotation)[0])
        return model, True
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            model, many = _models(arg)
            if model is not None:
                return model, many
    return None, False


Path_ = tuple[str | int, ...]


def field_paths(model: type[BaseModel], prefix: Path_ = ()) -> list[Path_]:
    """Every field's dotted path in the schema (list items at indexes 0 and 1), plus an unknown
    field in every section."""
    paths: list[Path_] = [(*prefix, "no_such_field")]
    for name, info in model.model_fields.items():
        paths.append((*prefix, name))
        inner, many = _models(info.annotation)
        if inner is not None:
            for sub in [(*prefix, name, 0), (*prefix, name, 1)] if many else [(*prefix, name)]:
                paths += field_paths(inner, sub)
    return paths


PATHS = field_paths(PoolConfig)


def with_edits(base: dict[str, Any], edits: list[tuple[Path_, Any]]) -> dict[str, Any]:
    """``base`` with each value set at its path (sections and list items made on the way)."""
    data = copy.deepcopy(base)
    for path, value in edits:
        node: Any = data
        for key, after in itertools.pairwise(path):
            blank: Any = [] if isinstance(after, int) else {}
            if isinstance(key, int):
                while len(node) <= key:
                    node.append({})
                if not isinstance(node[key], dict | list):
                    node[key] = blank
            elif not isinstance(node.get(key), dict | list):
                node[key] = blank
            node = node[key]
            if isinstance(after, int) and not isinstance(node, list):
                break
            if not isinstance(after, int) and not isinstance(node, dict):
                break
        else:
            last = path[-1]
            if isinstance(last, int):
                while len(node) <= last:
                    node.append({})
            node[last] = value
    return data


BASES = [{}, VALID, {**VALID, "endpoints": [{"address": "10.0.0.1:8000"}, {"address": "10.0.0.2:8000"}]}]
edits = st.lists(st.tuples(st.sampled_from(PATHS), scalars | junk | weights), max_size=6)
configs = st.builds(with_edits, st.sampled_from(BASES), edits) | junk


def allowed_prefixes(data: object) -> set[str]:
    keys = {str(key) for key in data} if isinstance(data, dict) else set()
    return {*PoolConfig.model_fields, *keys, "config"}


def check_outcome(data: object, outcome: PoolConfig | ConfigError) -> None:
    if isinstance(outcome, PoolConfig):
        return
    message = str(outcome)
    assert message
    named = [part.split(": ", 1)[0] for part in message.split("; ") if ": " in part]
    assert named, message
    prefixes = allowed_prefixes(data)
    first = named[0]
    assert any(first == p or first.startswith(p + ".") for p in prefixes), message[:500]


def parse(data: object) -> PoolConfig | ConfigError:
    try:
        return parse_config(data)
    except ConfigError as error:
        return error


@fuzz_settings(250)
@given(configs)
def test_any_mapping_is_a_config_or_a_config_error_naming_a_field(data: Any) -> None:
    check_outcome(data, parse(data))


# -- YAML files ---------------------------------------------------------------------------------------

YAML_PIECES = ["\n", ": ", "- ", "{", "}", "[", "]", ",", "&a ", "*a", "!!str ", "!!python/object ", "\t"]
YAML_PIECES += [
    "'",
    '"',
    "#",
    "---\n",
    "...\n",
    "? ",
    "|\n",
    ">\n",
    "%YAML 1.1\n",
    "~",
    ".inf",
    ".nan",
    "0x1F",
]


@st.composite
def yaml_texts(draw: st.DrawFn) -> str:
    data = draw(st.builds(with_edits, st.sampled_from(BASES), edits))
    text = yaml.safe_dump(data, allow_unicode=draw(st.booleans()), default_flow_style=draw(st.booleans()))
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        at = draw(st.integers(min_value=0, max_value=len(text)))
        end = draw(st.integers(min_value=at, max_value=min(len(text), at + 6)))
        text = text[:at] + draw(st.sampled_from(YAML_PIECES) | st.text(max_size=3)) + text[end:]
    return text


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("config") / "pool.yaml"


@fuzz_settings(100)
@given(yaml_texts())
def test_any_yaml_file_is_a_config_or_a_config_error(config_path: Path, text: str) -> None:
    config_path.write_text(text, encoding="utf-8")
    try:
        load_config(config_path)
    except ConfigError as error:
        assert str(error).startswith(f"{config_path}: "), str(error)[:300]


# -- bugs this found in router/server/config.py, one reproducer each -----------------------------------


def _config_error_or_raise(call: Any) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        call()
    return caught.value


@pytest.mark.parametrize(
    "override",
    [
        "endpoints.x.role=decode",  # ValueError: invalid literal for int()
        "endpoints.5.role=decode",  # IndexError
        "model.x=1",  # TypeError: 'str' object does not support item assignment
        "model=[unclosed",  # yaml.parser.ParserError
        "endpoints.0.address.port=1",  # TypeError
    ],
)
def test_a_bad_set_override_is_a_config_error(override: str) -> None:
    # pd-router check-config --config examples/pool.yaml --set endpoints.x.role=decode: a traceback.
    data = {**VALID, "endpoints": [{"address": "10.0.0.1:8000"}]}
    error = _config_error_or_raise(lambda: parse_config(data, [override]))
    assert "--set" in str(error)


@pytest.mark.parametrize(
    "content",
    [
        b"model: m\xff\nendpoints: [{address: '10.0.0.1:8000'}]\n",  # UnicodeDecodeError
        b"model: " + b"[" * 700 + b"]" * 700 + b"\n",  # RecursionError from the YAML composer
        b"model: 2020-13-45\nendpoints: [{address: '10.0.0.1:8000'}]\n",  # ValueError: month must be in 1..12
        b"model: !!int x\n",  # ValueError from the YAML constructor
    ],
    ids=["not-utf8", "deep-nesting", "impossible-date", "bad-int-tag"],
)
def test_a_yaml_value_error_is_a_config_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "pool.yaml"
    path.write_bytes(content)
    assert str(_config_error_or_raise(lambda: load_config(path))).startswith(str(path))


def test_an_alias_bomb_gives_a_short_error() -> None:
    text = "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    for level in range(1, 6):  # 10**6 strings through aliases, in a few hundred bytes
        text += (
            f"l{level}: &l{level} [" + ", ".join([f"*{'a' if level == 1 else f'l{level - 1}'}"] * 10) + "]\n"
        )
    data = {**VALID, "model": yaml.safe_load(text)["l5"]}
    error = _config_error_or_raise(lambda: parse_config(data))
    assert len(str(error)) < 10_000


def test_a_non_finite_number_is_refused() -> None:
    # Positive/NonNegative floats take inf: limits.chars_per_token: .inf loads, then every
    # request fails in parse_request with OverflowError (round(inf)).
    outcome = parse({**VALID, "limits": {"chars_per_token": math.inf}})
    if isinstance(outcome, PoolConfig):
        parse_request(b'{"model": "m", "prompt": "hello"}', outcome.request_limits())
    assert isinstance(outcome, ConfigError)
