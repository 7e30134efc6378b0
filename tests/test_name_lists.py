"""Lists of names the documentation writes out by hand, tied to their one source in the code: prose
cannot derive them, so a name added to the code and not to the docs (or the other way) fails here,
not in front of an operator."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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
