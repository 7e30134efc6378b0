"""The import arrows of docs/architecture.md (its table, parsed here), read from the source:
adapters → flow → scheduling → costmodel → kvindex, never back. A module may import its own package and
what its row allows."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("router", "kvindex", "simulator", "loadtests")
COMPOSITION = {"router", "kvindex"}

TOP_LEVEL = {"kvindex", "simulator", "loadtests"}


def _group(name: str) -> str:
    """A name as the table writes it (``router/observe/``, ``state``, ``scheduling/costmodel``) → dotted."""
    name = name.strip("/").replace("/", ".")
    return name if name.split(".")[0] in TOP_LEVEL or name.startswith("router") else f"router.{name}"


def doc_table(text: str) -> dict[str, set[str]]:
    """group (a module or package, dotted) -> the project groups it may import besides itself,
    read from docs/architecture.md's table: the document is the one source of the rules."""
    section = text.split("## Modules and what each may import", 1)[1].split("\n## ", 1)[0]
    allowed: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        may = cells[2]
        if may == "anything":  # tests/
            continue
        # "everything in router/, kvindex/" (the composition root), "everything above"
        # (loadtests/): what the service is made of, never tests/.
        targets = (
            COMPOSITION
            if may.startswith("everything")
            else {_group(n) for n in re.findall(r"`([^`]+)`", may)}
        )
        for name in re.findall(r"`([^`]+)`", cells[0]):
            allowed[_group(name)] = set(targets)
    return allowed


ALLOWED = {**doc_table((ROOT / "docs/architecture.md").read_text()), "router": set()}  # router: a docstring


def group_of(module: str) -> str | None:
    """The most specific group that ``module`` belongs to (dotted-prefix match)."""
    best = None
    for group in ALLOWED:
        if (module == group or module.startswith(group + ".")) and (best is None or len(group) > len(best)):
            best = group
    return best


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, importer: str) -> list[tuple[int, str]]:
    """(line, module) for every project import in ``source``, wherever it sits (functions and
    TYPE_CHECKING blocks included)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importer's package
                package = importer.rsplit(".", node.level)[0]
                base = f"{package}.{base}" if base else package
            found.append((node.lineno, base))
            # ``from router.flow import flight`` imports the module router.flow.flight.
            found += [
                (node.lineno, f"{base}.{alias.name}")
                for alias in node.names
                if _is_module(f"{base}.{alias.name}")
            ]
    return [(line, name) for line, name in found if name.split(".")[0] in (*PACKAGES, "tests")]


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def violations(source: str, importer: str) -> list[str]:
    group = group_of(importer)
    if group is None:
        return [f"{importer}: in no group of the import table (add it to docs/architecture.md)"]
    allowed = ALLOWED[group]
    out = []
    for line, name in imported_modules(source, importer):
        if name.split(".")[0] == "tests":
            out.append(f"{importer}:{line} imports {name}: nothing outside tests/ may")
            continue
        target = group_of(name)
        if target is None or target == group or name == group or name.startswith(group + "."):
            continue
        if not any(target == a or target.startswith(a + ".") or a == name for a in allowed):
            out.append(f"{importer}:{line} imports {name} ({target}); {group} may import {sorted(allowed)}")
    return out


def project_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_every_import_points_down_the_table() -> None:
    problems = [v for path in project_files() for v in violations(path.read_text(), _module_name(path))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("importer", "source"),
    [
        (
            "router.scheduling.costmodel.terms.queue",
            "from router.flow.flight import RequestFlow",
        ),  # a term -> the flow
        ("router.scheduling.picker", "from router.flow.flight import Flight"),  # picker -> flow
        ("router.flow.flight", "import router.adapters.openai"),  # flow -> an adapter
        ("kvindex.memory", "from router.state.pool import Pool"),  # the index -> the pool
        ("router.sidecar.server", "from router.adapters.openai import Proxy"),  # sidecar -> proxy internals
        ("router.server.cli", "from simulator.demo import run_demo"),  # the service -> the simulator
        ("loadtests.bench.envoy", "import tests.helpers"),  # anything -> tests/
        (
            "router.state.pool",
            "if TYPE_CHECKING:\n    from router.scheduling.picker import Picker",
        ),  # type-only counts too
    ],
)
def test_a_backward_arrow_is_reported(importer: str, source: str) -> None:
    assert violations(source, importer)


def test_the_table_covers_every_module() -> None:
    assert all(group_of(_module_name(path)) is not None for path in project_files())


def test_every_package_directory_is_a_regular_package() -> None:
    # setuptools' package discovery skips folders without __init__.py: a wheel (a container
    # image) would ship without them while an editable install hides the gap.
    folders = {path.parent for path in project_files()}
    assert not [str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists()]


def test_the_documented_table_is_read_whole() -> None:
    # A table the parser silently lost rows of would allow nothing or check nothing.
    assert {
        "kvindex",
        "router.scheduling.costmodel",
        "router.scheduling",
        "router.flow",
        "router.adapters",
        "loadtests",
    } <= set(ALLOWED)
    assert ALLOWED["router.scheduling"] >= {"router.state", "kvindex"}
    assert ALLOWED["router.scheduling.costmodel"] == set()
    assert ALLOWED["kvindex"] == set()
    assert ALLOWED["router.server"] == COMPOSITION
