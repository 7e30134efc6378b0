"""The benchmark report (``loadtests.bench.report``) in its smallest form: one scenario, two policies
(plus the misconfigured pair it adds), a dozen requests, every overhead benchmark at quick size.

What is checked is what a reader of docs/benchmarks.md relies on: the machine and the command that
produced the numbers, a row for every policy that ran, and plots that exist where the markdown
links them — not the numbers themselves, which belong to the full run.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from loadtests.bench import report

pytestmark = pytest.mark.integration

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
POLICIES = ("round-robin", "pd-router")


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def test_quick_report_has_machine_command_a_row_per_policy_and_valid_pngs(tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    # Envoy comes with the test extras; without it the rest of the report still has to be right.
    overhead = "pick,proxy,routers,envoy" if _has("envoy") else "pick,proxy,routers"
    argv = ["--quick", "--scenarios", "a", "--policies", ",".join(POLICIES), "--requests", "12"]
    argv += ["--overhead", overhead, "--out", str(out)]

    assert report.main(argv) == 0
    text = out.read_text()

    assert "## Machine and run" in text
    for row in ("CPU", "cores", "RAM", "Python", "Envoy", "commit", "date (UTC)"):
        assert re.search(rf"^\| {re.escape(row)} \| \S", text, re.M), f"no machine row {row!r}"
    assert f"python3 -m loadtests.bench.report {shlex.join(argv)}\n" in text

    # One scenario table, and the misconfigured pair (pd-router vs the same without learning).
    for policy in (*POLICIES, "pd-router-static"):
        assert re.search(rf"^\| `{re.escape(policy)}` \| 12/12 \|", text, re.M), f"no row for {policy}"
    assert "### At a glance" in text

    assert re.search(r"^\| json \| 1 \| ", text, re.M), "no proxy overhead row"
    assert re.search(r"^\| 8 \| shared \| ", text, re.M), "no pick() row"
    assert re.search(r"^\| pd-router \| [+-]\d", text, re.M), "no row against the Rust routers"
    if "envoy" in overhead:
        assert re.search(r"^\| full-duplex \| 1 \| 1 \| extproc \| ", text, re.M), "no Envoy row"
    assert "## Failures" not in text

    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    if not _has("matplotlib"):
        assert images == []
        return
    assert len(images) == 3
    for link in images:
        assert not Path(link).is_absolute()  # relative to the markdown, so the docs render anywhere
        png = out.parent / link
        assert png.is_file(), link
        assert png.read_bytes()[:8] == PNG_MAGIC, link
