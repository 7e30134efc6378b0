"""``loadtests.bench.regress``: the side-by-side tables of this checkout and other commits, what
counts as a regression, and one short run end to end against a worktree of HEAD."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from loadtests.bench.regress import (
    Routing,
    Scaling,
    main,
    parse_verdicts,
    routing_regressions,
    scaling_regressions,
)

REPO = Path(__file__).resolve().parents[2]

# The end of a replay over two seeds, as loadtests.bench.scaling prints it: a table per seed, then
# the one on the means, which is the one to read.
HEADER = (
    "| scenario | pd-router: violation area s, replica-min | best threshold | the issue's target "
    "| a threshold better on both? |"
)
REPLAY = f"""
### Verdicts (seed 0)

{HEADER}
|---|---|---|---|---|
| drain | 0.0, 24.2 | queue: 0.0, 18.3 | FAIL | queue, kv, running |
| ramp | 6.7, 20.1 | running: 124.3, 20.8 | PASS | none |

pd-router meets the target in 1 of 2.

### Verdicts (mean over seeds 0, 1)

{HEADER}
|---|---|---|---|---|
| drain | 0.0, 25.0 | running: 0.0, 21.0 | FAIL | running |
| ramp | 56.1, 17.0 | running: 95.7, 19.3 | PASS | none |

pd-router meets the target in 1 of 2.
"""


def test_the_replays_last_verdict_table_is_read() -> None:
    rows, summary = parse_verdicts(REPLAY)
    assert rows == {
        "drain": Scaling(0.0, 25.0, "FAIL", "running: 0.0, 21.0"),
        "ramp": Scaling(56.1, 17.0, "PASS", "running: 95.7, 19.3"),
    }
    assert summary == "1 of 2"
    with pytest.raises(ValueError, match="no verdict table"):
        parse_verdicts("the replay printed nothing")


def test_a_slower_p90_or_a_lower_goodput_is_a_routing_regression_and_a_better_one_is_not() -> None:
    before = Routing((10.0, 100.0, 300.0), 0.90, "a")
    assert routing_regressions(before, before) == []
    assert routing_regressions(Routing((10.0, 104.0, 900.0), 0.895, "b"), before) == []  # within the margins
    assert routing_regressions(Routing((9.0, 80.0, 200.0), 0.95, "b"), before) == []
    worse = routing_regressions(Routing((10.0, 110.0, 300.0), 0.85, "b"), before)
    assert worse == ["TTFT p90 110 ms against 100", "goodput 85.0 % against 90.0 %"]


def test_scaling_regressions_count_violation_first_then_replica_minutes() -> None:
    before = Scaling(10.0, 20.0, "PASS", "")
    assert scaling_regressions(before, before) == []
    assert scaling_regressions(Scaling(12.0, 19.0, "PASS", ""), before)  # more violation
    assert scaling_regressions(Scaling(10.0, 20.5, "PASS", ""), before)  # more replicas, same violation
    assert scaling_regressions(Scaling(5.0, 21.0, "PASS", ""), before) == []  # replicas bought less violation
    assert scaling_regressions(Scaling(10.0, 20.1, "FAIL", ""), before) == [
        "fails the target, which it met (10.0, 20.0 PASS)"
    ]


def _worktrees() -> list[str]:
    listed = subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True)
    return listed.stdout.splitlines()


def test_a_short_run_against_head_prints_both_tables_and_leaves_no_worktree(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = _worktrees()
    argv = ["--against", "HEAD", "--scenarios", "e", "--seeds", "0", "--jobs", "1", "--quick"]
    status = main([*argv, "--scaling-seeds", "0", "--scaling-scenarios", "short-burst"])
    out = capsys.readouterr().out
    assert _worktrees() == before
    assert status in (0, 1)  # 1 only with a regression listed, which a change under work may have
    assert ("no regression" in out) == (status == 0)
    routing_row = re.search(r"^\| e \| (.+) \|$", out, re.MULTILINE)
    assert routing_row is not None
    cells = routing_row[1].split(" | ")
    assert len(cells) == 5  # least-loaded, cache-aware, this checkout, HEAD, p90 ratio and decisions
    assert all(re.fullmatch(r"[\d.]+ / [\d.]+ / [\d.]+, [\d.]+ %", cell) for cell in cells[:4])
    assert re.fullmatch(r"[\d.]+, (same|differ)", cells[4])
    scaling_row = re.search(r"^\| short-burst \| (.+) \|$", out, re.MULTILINE)
    assert scaling_row is not None
    mine, head, best = scaling_row[1].split(" | ")
    assert re.fullmatch(r"[\d.]+, [\d.]+ (PASS|FAIL)", mine) and re.fullmatch(
        r"[\d.]+, [\d.]+ (PASS|FAIL)", head
    )
    assert best.split(":")[0] in ("queue", "kv", "running")
    assert re.search(r"^\| meets the target \| \d+ of 1 \| \d+ of 1 \|", out, re.MULTILINE)
