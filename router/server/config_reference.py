"""The configuration reference, ``docs/configuration.md``, generated from the typed configuration.

It walks ``PoolConfig`` (pydantic v2 ``model_fields``, into nested models, lists of models and
dict values that are models) and renders one section per top-level block and one table per model:
field path, a readable type, the default as YAML writes it, and the field's description. Nothing
is written by hand, so a field added to ``router/server/config.py`` appears here when it is regenerated:

    python -m router.server.config_reference --write docs/configuration.md
    python -m router.server.config_reference > docs/configuration.md
    python -m router.server.config_reference --undocumented     # fields without a description

``tests/router/server/test_config_reference.py`` fails when the file differs from what this renders now.
"""

from __future__ import annotations

import argparse
import enum
import inspect
import math
import re
import sys
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from router.server.config import PoolConfig

REGENERATE = "python -m router.server.config_reference --write docs/configuration.md"

# The listener and discovery flags of ``pd-router serve`` and the fields each sets (router/server/cli.py);
# tests/router/server/test_config_reference.py checks both columns against the parser and the model.
CLI_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("--host HOST", "proxy.host", ""),
    ("--port PORT", "proxy.port", ""),
    ("--grpc-port PORT", "extproc.port", "also sets `extproc.enabled: true`"),
    ("--grpc-health-port PORT", "extproc.health_port", ""),
    ("--metrics-port PORT", "metrics.port", "also sets `metrics.enabled: true`"),
    ("--pool-name NAME", "kubernetes.pool_name", ""),
    (
        "--pool-namespace NS",
        "kubernetes.namespace",
        "default: `$NAMESPACE` when another discovery flag is given",
    ),
    ("--endpoint-selector K=V,...", "kubernetes.selector", "without an InferencePool"),
    ("--endpoint-target-ports PORT,...", "kubernetes.target_ports", "with `--endpoint-selector`"),
)

# What ``pd-router check-config`` prints for ``role: both`` (a test checks it still does).
EXAMPLE_ERROR = (
    "pd-router: invalid configuration: pool.yaml: endpoints.1.role: Input should be 'prefill', "
    "'decode' or 'prefill-decode', got 'both'"
)

_INTRO = """\
# Configuration reference

<!-- Generated from router/server/config.py by `{regenerate}`.
     Do not edit by hand: tests/router/server/test_config_reference.py fails when this file is stale. -->

pd-router reads one YAML file per pool: `pd-router serve --config pool.yaml` (and
`pd-router check-config --config pool.yaml` to validate one and exit). `examples/pool.yaml` is a
commented example. Every field below has a default unless it is marked *required*. Unknown keys
are errors, and every error names the field and the value:

```
{example_error}
```

**Overrides.** `--set dotted.path=value` (repeatable) changes one field at start; the value is read
as YAML and list items are addressed by index: `--set slo.ttft_ms=300`,
`--set endpoints.0.role=decode`, `--set 'kubernetes.selector={{app: vllm}}'`. The flags below are
shorthands for fields; they are applied after `--set`, so they win:

{flags}

Without `kubernetes`, `pd-router serve` re-reads the file when it changes, but only `endpoints`
take effect that way (an invalid file is logged and ignored); every other field needs a restart.

**Reading the tables.** A path like `endpoints[].role` is the field `role` of every item of the
list `endpoints`; `map[str, X]` is a mapping with keys of your choosing. `optional` means the field
may be `null` (or left out: its default is `null`). Bounds are inclusive with `≤`/`≥` and exclusive
with `<`/`>`. A nested block whose default is *its fields' defaults* can be left out entirely.

{contents}
"""


@dataclass(frozen=True, slots=True)
class Row:
    """One field: its dotted path and how it is rendered."""

    path: str
    type: str
    default: str
    description: str


@dataclass(frozen=True, slots=True)
class Table:
    """One model at one path: its fields, in declaration order."""

    path: str  # "" for the root (PoolConfig)
    model: type[BaseModel]
    doc: str
    rows: tuple[Row, ...]


@dataclass(frozen=True, slots=True)
class Section:
    """One top-level block (or the top level itself) and its tables."""

    key: str | None  # None: the top level
    tables: tuple[Table, ...]

    @property
    def heading(self) -> str:
        return "Top level" if self.key is None else f"`{self.key}`"


# -- walking the model ------------------------------------------------------------------------------


def tables(root: type[BaseModel] = PoolConfig) -> list[Table]:
    """Every model reachable from ``root`` with its path, parents before children."""
    out: list[Table] = []
    _walk(root, "", None, out, (root,))
    return out


def sections(root: type[BaseModel] = PoolConfig) -> list[Section]:
    """The top level, then one section per top-level field that holds a model."""
    found = tables(root)
    top = [t for t in found if t.path == ""]
    by_key: dict[str, list[Table]] = {}
    for table in found:
        if table.path:
            by_key.setdefault(_top_key(table.path), []).append(table)
    return [Section(None, tuple(top)), *(Section(key, tuple(ts)) for key, ts in by_key.items())]


def _top_key(path: str) -> str:
    return re.split(r"[.\[]", path, maxsplit=1)[0]


def _walk(
    model: type[BaseModel],
    path: str,
    instance: BaseModel | None,
    out: list[Table],
    stack: tuple[type[BaseModel], ...],
) -> None:
    """Add ``model``'s table at ``path``, then its nested models' tables. ``instance``: the value
    the parent's default gives this block (its fields' values when the block is left out)."""
    rows: list[Row] = []
    nested: list[tuple[type[BaseModel], str, BaseModel | None]] = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        field_path = f"{path}.{key}" if path else key
        inherited = getattr(instance, name) if instance is not None else PydanticUndefined
        rows.append(
            Row(
                field_path,
                render_type(field.annotation, field.metadata),
                _render_default(field, inherited, path),
                _one_line(field.description or ""),
            )
        )
        for sub, suffix in nested_models(field.annotation):
            if sub in stack:
                continue  # a recursive model: its table is already being written
            value = inherited if inherited is not PydanticUndefined else _default_of(field)
            block = value if suffix == "" and isinstance(value, sub) else None
            nested.append((sub, field_path + suffix, block))
    out.append(Table(path, model, _docstring(model), tuple(rows)))
    for sub, sub_path, value in nested:
        _walk(sub, sub_path, value, out, (*stack, sub))


def nested_models(annotation: Any) -> Iterator[tuple[type[BaseModel], str]]:
    """The models inside a field's type, each with the path suffix that reaches its fields:
    ``""`` (the field itself), ``"[]"`` (list items), ``".<key>"`` (dict values)."""
    base, _ = _unwrap(annotation)
    origin = get_origin(base)
    if isinstance(base, type) and issubclass(base, BaseModel):
        yield base, ""
    elif origin in (Union, types.UnionType):
        for arg in get_args(base):
            yield from nested_models(arg)
    elif origin in (list, set, frozenset, tuple, Sequence):
        for arg in get_args(base):
            if arg is not Ellipsis:
                yield from ((model, "[]" + suffix) for model, suffix in nested_models(arg))
    elif origin is dict:
        args = get_args(base)
        if len(args) == 2:
            yield from ((model, ".<key>" + suffix) for model, suffix in nested_models(args[1]))


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """``Annotated[T, ...]`` → (T, its constraints); anything else as is."""
    metadata: list[Any] = []
    while get_origin(annotation) is Annotated:
        base, *extra = get_args(annotation)
        for item in extra:
            metadata.extend(item.metadata if isinstance(item, FieldInfo) else [item])
        annotation = base
    return annotation, metadata


# -- types ------------------------------------------------------------------------------------------

_SCALARS = {str: "str", int: "int", float: "float", bool: "bool", bytes: "bytes", Path: "path"}


def render_type(annotation: Any, metadata: Sequence[Any] = ()) -> str:
    """A field's type as a reader wants it: ``int ≥ 1``, ``"prefill" | "decode"``,
    ``list[EndpointConfig]``, ``optional str``, ``map[str, float ≥ 0]``."""
    base, extra = _unwrap(annotation)
    constraints = [*metadata, *extra]
    origin = get_origin(base)
    if origin in (Union, types.UnionType):
        args = get_args(base)
        present = [arg for arg in args if arg is not type(None)]
        text = " | ".join(render_type(arg) for arg in present)
        text = _constrained(text, constraints, is_text=False)
        return f"optional {text}" if len(present) < len(args) else text
    if origin is Literal:
        return " | ".join(_literal(value) for value in get_args(base))
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return " | ".join(_literal(member.value) for member in base)
    if isinstance(base, type) and issubclass(base, BaseModel):
        return base.__name__
    if origin in (list, set, frozenset, Sequence):
        (item,) = get_args(base) or (Any,)
        kind = "list" if origin in (list, Sequence) else "set"
        return _constrained(f"{kind}[{render_type(item)}]", constraints, is_text=False)
    if origin is tuple:
        args = get_args(base)
        if len(args) == 2 and args[1] is Ellipsis:
            return _constrained(f"list[{render_type(args[0])}]", constraints, is_text=False)
        return "[" + ", ".join(render_type(arg) for arg in args) + "]"
    if origin is dict:
        key, value = get_args(base) or (Any, Any)
        return _constrained(f"map[{render_type(key)}, {render_type(value)}]", constraints, is_text=False)
    if base is Any:
        return "any"
    if base is type(None):
        return "null"
    name = _SCALARS.get(base) if isinstance(base, type) else None
    if name is None:
        name = getattr(base, "__name__", None) or str(base).replace("typing.", "")
    return _constrained(name, constraints, is_text=base in (str, bytes))


def _literal(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else _yaml(value)


def _constrained(name: str, constraints: Sequence[Any], *, is_text: bool) -> str:
    """``name`` with its numeric bounds and length limits."""
    bound = {key: getattr(c, key) for c in constraints for key in ("gt", "ge", "lt", "le") if _has(c, key)}
    lower = ("<", bound["gt"]) if "gt" in bound else ("≤", bound["ge"]) if "ge" in bound else None
    upper = ("<", bound["lt"]) if "lt" in bound else ("≤", bound["le"]) if "le" in bound else None
    text = name
    if lower and upper:
        text = f"{_number(lower[1])} {lower[0]} {name} {upper[0]} {_number(upper[1])}"
    elif lower:
        text = f"{name} {'>' if lower[0] == '<' else '≥'} {_number(lower[1])}"
    elif upper:
        text = f"{name} {upper[0]} {_number(upper[1])}"
    notes = []
    for c in constraints:
        if _has(c, "min_length") and c.min_length:
            unit = "characters" if is_text else "items"
            notes.append("non-empty" if c.min_length == 1 else f"at least {c.min_length} {unit}")
        if _has(c, "max_length"):
            notes.append(f"at most {c.max_length} {'characters' if is_text else 'items'}")
        if _has(c, "pattern"):
            notes.append(f"matching `{c.pattern}`")
        if _has(c, "multiple_of"):
            notes.append(f"a multiple of {_number(c.multiple_of)}")
    return f"{text}, {', '.join(notes)}" if notes else text


def _has(constraint: Any, key: str) -> bool:
    return getattr(constraint, key, None) is not None


def _number(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    return str(value)


# -- defaults ---------------------------------------------------------------------------------------

REQUIRED = "*required*"
_ITS_FIELDS = "*its fields' defaults*"


def _default_of(field: FieldInfo) -> Any:
    return PydanticUndefined if field.is_required() else field.get_default(call_default_factory=True)


def _render_default(field: FieldInfo, inherited: Any, block: str) -> str:
    """The default as YAML writes it; when the enclosing block's own default gives this field
    another value, that value too (it applies while the block is left out)."""
    own = _default_of(field)
    text = REQUIRED if own is PydanticUndefined else _value(own)
    if inherited is not PydanticUndefined and (own is PydanticUndefined or _plain(inherited) != _plain(own)):
        text += f" (`{_yaml(_plain(inherited))}` while `{block}` is not set)"
    return text


def _value(value: Any) -> str:
    if isinstance(value, BaseModel) and _is_blank(value):
        return _ITS_FIELDS
    return f"`{_yaml(_plain(value))}`"


def _is_blank(value: BaseModel) -> bool:
    """True when ``value`` is its model built with no arguments (every field at its default)."""
    try:
        return value == type(value)()
    except Exception:  # required fields: there is no blank instance
        return False


def _plain(value: Any) -> Any:
    return to_jsonable_python(value, by_alias=True)


def _yaml(value: Any) -> str:
    text = yaml.safe_dump(
        value, default_flow_style=True, sort_keys=False, width=1 << 30, allow_unicode=True
    ).strip()
    return text.removesuffix("...").strip()


# -- text -------------------------------------------------------------------------------------------


def _one_line(text: str) -> str:
    return " ".join(text.replace("``", "`").split())


def _docstring(model: type[BaseModel]) -> str:
    doc = model.__dict__.get("__doc__")
    if not doc:
        return ""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(_one_line(p) for p in paragraphs if p.strip())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.lower())
    return text.replace(" ", "-")


def _heading(table: Table, ambiguous: set[str]) -> str:
    text = f"`{table.path}`"
    return f"{text} ({table.model.__name__})" if table.path in ambiguous else text


# -- rendering --------------------------------------------------------------------------------------


def render(root: type[BaseModel] = PoolConfig) -> str:
    """The whole of docs/configuration.md."""
    found = sections(root)
    paths = [t.path for s in found for t in s.tables]
    ambiguous = {p for p in paths if paths.count(p) > 1}
    # Where each table lives: a section's first table under the section's heading, the others
    # under their own (the type column links to them).
    anchors: dict[tuple[str, type[BaseModel]], str] = {}
    for section in found:
        for i, table in enumerate(section.tables):
            heading = section.heading if i == 0 else _heading(table, ambiguous)
            anchors[(table.path, table.model)] = anchor(heading)
    contents = "\n".join(
        f"- [{s.heading}](#{anchor(s.heading)})"
        + (f": {s.tables[0].model.__name__}" if s.key is not None else "")
        for s in found
    )
    flags = _flags_table()
    intro = _INTRO.format(regenerate=REGENERATE, example_error=EXAMPLE_ERROR, flags=flags, contents=contents)
    parts = [intro]
    for section in found:
        parts.append(f"## {section.heading}\n")
        for i, table in enumerate(section.tables):
            if i:
                parts.append(f"### {_heading(table, ambiguous)}\n")
            if table.path and i == 0 and table.path != section.key:
                parts.append(f"Fields of `{table.path}` ({table.model.__name__}).\n")
            if table.doc:
                parts.append(table.doc + "\n")
            parts.append(_table(table, anchors))
    return "\n".join(parts).rstrip() + "\n"


def _table(table: Table, anchors: dict[tuple[str, type[BaseModel]], str]) -> str:
    lines = ["| field | type | default | description |", "|---|---|---|---|"]
    for row, field in zip(table.rows, table.model.model_fields.values(), strict=True):
        kind = row.type
        for sub, suffix in nested_models(field.annotation):
            target = anchors.get((row.path + suffix, sub))
            if target is not None:
                name = sub.__name__
                kind = re.sub(rf"\b{re.escape(name)}\b", f"[{name}](#{target})", kind, count=1)
        lines.append(f"| `{row.path}` | {_cell(kind)} | {_cell(row.default)} | {_cell(row.description)} |")
    return "\n".join(lines) + "\n"


def _flags_table() -> str:
    lines = ["| flag | sets | note |", "|---|---|---|"]
    for flag, path, note in CLI_FLAGS:
        lines.append(f"| `{flag}` | `{path}` | {note} |")
    return "\n".join(lines)


def undocumented(root: type[BaseModel] = PoolConfig) -> list[str]:
    """The paths of fields without a description (their cell is left empty)."""
    return [row.path for table in tables(root) for row in table.rows if not row.description]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m router.server.config_reference", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--write", metavar="PATH", help="write the reference here instead of stdout")
    parser.add_argument(
        "--undocumented", action="store_true", help="list the fields that have no description, and exit"
    )
    args = parser.parse_args(argv)
    if args.undocumented:
        print("\n".join(undocumented()))
        return 0
    text = render()
    if args.write:
        Path(args.write).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
