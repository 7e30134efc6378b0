"""docs/benchmarks.md's hand-written end survives a regenerated report."""

from __future__ import annotations

from loadtests.bench.report import KEPT, with_kept


def test_a_new_report_keeps_the_hand_written_end_of_the_old_one() -> None:
    old = f"# Benchmarks\n\nold numbers\n\n{KEPT}\n\n## pick() hot path\n\nby hand\n"
    assert with_kept("# Benchmarks\n\nnew numbers\n", old) == (
        f"# Benchmarks\n\nnew numbers\n\n{KEPT}\n\n## pick() hot path\n\nby hand\n"
    )
    assert (
        with_kept("# Benchmarks\n\nnew numbers\n", "# Benchmarks\n\nold\n") == "# Benchmarks\n\nnew numbers\n"
    )
