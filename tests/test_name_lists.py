"""Lists of names the documentation writes out by hand, tied to their one source in the code (the
KEDA signals, the gate checks, the metric series): prose cannot derive them, so a name added to the
code and not to the docs (or the other way) fails here, not in front of an operator."""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
from helpers import declared_series

from router.adapters.keda.scaler import SIGNALS
from router.server.config import GATE_CHECKS

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _listed(text: str, pattern: str) -> set[str]:
    """The backticked names inside the first parenthesis that follows ``pattern``."""
    found = re.search(pattern + r"[^(]*\(([^)]*)\)", text)
    assert found, f"no list after {pattern!r}"
    return set(re.findall(r"`([^`]+)`", found.group(1)))


@pytest.mark.parametrize("doc", ["autoscaling.md", "deployment.md"])
def test_the_docs_list_every_keda_signal(doc: str) -> None:
    assert _listed((DOCS / doc).read_text(), r"`signal`") == set(SIGNALS)


def test_the_operations_guide_lists_every_gate_check() -> None:
    text = (DOCS / "operations.md").read_text()
    assert _listed(text, re.escape("`pd_router_gate_failures_total{check}`")) == set(GATE_CHECKS)


# A series name as the docs write it: exposed (a counter's ``_total``), or a family ending in ``*``.
_SERIES = re.compile(r"\b(?:pd_router|llm_d_epp|inference_(?:objective|pool|extension))_[a-z0-9_]*[a-z0-9*]")


def test_the_operations_guide_documents_every_declared_series_and_no_other() -> None:
    exposed = {s.name + "_total" if s.type == "counter" else s.name for s in declared_series()}
    documented = set(_SERIES.findall((DOCS / "operations.md").read_text()))
    undocumented = {name for name in exposed if not any(fnmatchcase(name, doc) for doc in documented)}
    assert not undocumented, f"docs/operations.md does not document {sorted(undocumented)}"
    unknown = {doc for doc in documented if not any(fnmatchcase(name, doc) for name in exposed)}
    assert not unknown, f"docs/operations.md documents series nobody declares: {sorted(unknown)}"
