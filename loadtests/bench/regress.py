"""This checkout's routing and scaling against other commits', side by side in one run.

A change that touches routing, learning or scaling is compared with the commit before it and with
the last release point (the last landed commit) in the same run (docs/quality.md, "Before a change
lands"). Each ``--against REV`` becomes a temporary ``git worktree`` (removed at the
end); then

* **routing**: ``loadtests.bench.quality`` (virtual time, deterministic) with this checkout's
  harness, pd-router of this checkout and of each worktree (``--router-tree``), and least-loaded
  and cache-aware (the SGLang and vLLM routers' default) as the baselines; pooled over
  ``--seeds``. ``decisions`` says whether a tree routed every request as this checkout did (the
  run's digest of its routes);
* **scaling**: each tree's own ``loadtests.bench.scaling`` replay (its harness and its router:
  the replay drives the router's internals, which change with it), the verdict table on the means
  over ``--scaling-seeds``.

A line per regression follows the tables (exit status 1 when there is one): TTFT p90 over
``P90_WORSE`` of a tree's, goodput ``GOODPUT_WORSE`` below it, or in a scaling scenario more
violation, or more replica-minutes without less violation, or a scenario that no longer meets the
target.

    python -m loadtests.bench.regress --against HEAD~1 --against 4aec685        # ~6 minutes
    python -m loadtests.bench.regress --against HEAD --scenarios bde --no-scaling
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]
THIS = "this checkout"
BASELINES = ("least-loaded", "cache-aware")
P90_WORSE = 1.05  # the quality gate's own runs agree to the digit; 5 % is a real change
GOODPUT_WORSE = 0.01  # one point of the requests within both SLOs
VIOLATION_WORSE_S = 1.0  # violation area, simulated seconds (means over seeds)
REPLICA_MIN_WORSE = 0.2  # replica-minutes (means over seeds)
# Run a module's ``main`` with only its tree on the import path (an editable install's finder would
# hand out this checkout's modules for any the tree lacks); imported, not run as ``__main__``, so
# its process pool can pickle the module's functions.
_BOOT = (
    "import importlib, sys; "
    "sys.meta_path[:] = [f for f in sys.meta_path "
    "if not getattr(f, '__module__', '').startswith('__editable__')]; "
    "module, args = sys.argv[1], sys.argv[2:]; sys.exit(importlib.import_module(module).main(args))"
)


@dataclass(frozen=True, slots=True)
class Routing:
    ttft_ms: tuple[float, float, float]  # p50, p90, p99
    goodput: float
    digest: str

    def cell(self) -> str:
        return " / ".join(map(_ms, self.ttft_ms)) + f", {100 * self.goodput:.1f} %"


def _ms(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


@dataclass(frozen=True, slots=True)
class Scaling:
    violation_s: float
    replica_min: float
    verdict: str  # PASS / FAIL
    best: str  # the best threshold policy's cell, as the replay prints it

    def cell(self) -> str:
        return f"{self.violation_s:.1f}, {self.replica_min:.1f} {self.verdict}"


@contextlib.contextmanager
def worktrees(revs: Sequence[str]) -> Iterator[dict[str, Path]]:
    """``{rev: path}``: a detached worktree of each rev, removed on the way out."""
    made: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="regress-") as work:
        try:
            for i, rev in enumerate(revs):
                path = Path(work) / f"tree{i}"
                _git("worktree", "add", "--detach", "--quiet", str(path), rev)
                made[rev] = path
            yield made
        finally:
            for path in made.values():
                _git("worktree", "remove", "--force", str(path))


def this_commit() -> str:
    """HEAD's short hash, "+ uncommitted changes" when the tracked files differ from it."""
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return _git("rev-parse", "--short", "HEAD") + (" + uncommitted changes" if dirty else "")


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(HERE), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def routing(tree: Path | None, args: argparse.Namespace, policies: str) -> dict[str, dict[str, Routing]]:
    """``{scenario: {policy: Routing}}`` from the quality bench (``tree``: its router)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "loadtests.bench.quality", "--scenarios", args.scenarios]
        cmd += ["--seeds", args.seeds, "--jobs", str(args.jobs), "--policies", policies]
        cmd += ["--no-reference", "--json", out.name, *(["--requests", "100"] if args.quick else [])]
        if tree is not None:
            cmd += ["--router-tree", str(tree)]
        _run(cmd, HERE)
        report = json.loads(Path(out.name).read_text())
    return {
        scenario: {
            name: Routing((p["ttft_p50_ms"], p["ttft_p90_ms"], p["ttft_p99_ms"]), p["goodput"], p["digest"])
            for name, p in entry["policies"].items()
        }
        for scenario, entry in report["scenarios"].items()
    }


def scaling(tree: Path, args: argparse.Namespace) -> tuple[dict[str, Scaling], str]:
    """The replay's last verdict table (the means over the seeds) and its "meets the target" line."""
    cmd = [sys.executable, "-c", _BOOT, "loadtests.bench.scaling", "--seeds", args.scaling_seeds]
    cmd += ["--jobs", str(args.jobs)]
    if args.scaling_scenarios:
        cmd += ["--scenarios", args.scaling_scenarios]
    if args.quick:
        cmd.append("--quick")
    # The replay exits 1 when any policy failed requests, which the threshold policies do by design
    # (rolling-upgrade): what counts is that it printed its verdicts.
    try:
        return parse_verdicts(_run(cmd, tree, {"PYTHONPATH": str(tree)}, ok=(0, 1)))
    except ValueError as exc:
        raise SystemExit(f"the replay in {tree}: {exc}") from None


_ROW = re.compile(r"^\| ([\w-]+) \| ([\d.]+), ([\d.]+) \| ([^|]+) \| (PASS|FAIL) \|")


def parse_verdicts(text: str) -> tuple[dict[str, Scaling], str]:
    """The last ``### Verdicts`` table of a replay's output, and its summary line."""
    start = text.rfind("### Verdicts")
    if start < 0:
        raise ValueError("no verdict table in the replay's output")
    rows: dict[str, Scaling] = {}
    summary = ""
    for line in text[start:].splitlines():
        if m := _ROW.match(line):
            rows[m[1]] = Scaling(float(m[2]), float(m[3]), m[5], m[4].strip())
        elif line.startswith("pd-router meets the target"):
            summary = line.removeprefix("pd-router meets the target in ").rstrip(".")
    return rows, summary


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, ok: tuple[int, ...] = (0,)) -> str:
    done = subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if done.returncode not in ok:
        raise SystemExit(f"{' '.join(cmd[:4])} … in {cwd} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout


def routing_regressions(ours: Routing, theirs: Routing) -> list[str]:
    out = []
    if ours.ttft_ms[1] > P90_WORSE * theirs.ttft_ms[1]:
        out.append(f"TTFT p90 {ours.ttft_ms[1]:.3g} ms against {theirs.ttft_ms[1]:.3g}")
    if ours.goodput < theirs.goodput - GOODPUT_WORSE:
        out.append(f"goodput {100 * ours.goodput:.1f} % against {100 * theirs.goodput:.1f} %")
    return out


def scaling_regressions(ours: Scaling, theirs: Scaling) -> list[str]:
    more_violation = ours.violation_s > theirs.violation_s + VIOLATION_WORSE_S
    less_violation = ours.violation_s < theirs.violation_s - VIOLATION_WORSE_S
    more_replicas = ours.replica_min > theirs.replica_min + REPLICA_MIN_WORSE
    if more_violation or (more_replicas and not less_violation):
        return [f"{ours.cell()} against {theirs.cell()} (violation area s, replica-minutes)"]
    if ours.verdict == "FAIL" and theirs.verdict == "PASS":
        return [f"fails the target, which it met ({theirs.cell()})"]
    return []


def report(args: argparse.Namespace, trees: dict[str, Path]) -> tuple[list[str], list[str]]:
    """The tables' lines and the regressions found."""
    labels = [THIS, *trees]
    lines = [f"{THIS}: {this_commit()}", ""]
    lines += [f"routing, virtual time, seeds {args.seeds} pooled: TTFT p50 / p90 / p99 ms, goodput", ""]
    found: list[str] = []
    ours = routing(None, args, "least-loaded,cache-aware,pd-router")
    runs = {THIS: ours, **{rev: routing(path, args, "pd-router") for rev, path in trees.items()}}
    head = ["scenario", *BASELINES, *labels, *(f"p90 ÷ {rev}, decisions" for rev in trees)]
    lines += [_row(head), _row(["---"] * len(head))]
    for scenario in ours:
        mine = ours[scenario]["pd-router"]
        cells = [scenario, *(ours[scenario][name].cell() for name in BASELINES)]
        cells += [runs[label][scenario]["pd-router"].cell() for label in labels]
        for rev in trees:
            theirs = runs[rev][scenario]["pd-router"]
            same = "same" if theirs.digest == mine.digest else "differ"
            cells.append(f"{mine.ttft_ms[1] / theirs.ttft_ms[1]:.2f}, {same}")
            found += [f"routing ({scenario}) vs {rev}: {r}" for r in routing_regressions(mine, theirs)]
        lines.append(_row(cells))
    if args.no_scaling:
        return lines, found
    replays = {THIS: scaling(HERE, args), **{rev: scaling(path, args) for rev, path in trees.items()}}
    lines += [
        "",
        f"scaling replay, means over seeds {args.scaling_seeds}: violation area s, replica-minutes",
        "",
    ]
    head = ["scenario", *labels, f"best threshold ({THIS})"]
    lines += [_row(head), _row(["---"] * len(head))]
    mine_rows = replays[THIS][0]
    for scenario, mine in mine_rows.items():
        cells = [scenario] + [_cell(replays[label][0].get(scenario)) for label in labels] + [mine.best]
        lines.append(_row(cells))
        for rev in trees:
            theirs = replays[rev][0].get(scenario)
            if theirs is not None:
                found += [f"scaling ({scenario}) vs {rev}: {r}" for r in scaling_regressions(mine, theirs)]
    lines.append(_row(["meets the target", *(replays[label][1] for label in labels), ""]))
    return lines, found


def _cell(scaling: Scaling | None) -> str:
    return "—" if scaling is None else scaling.cell()


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.regress",
        description="This checkout's routing and scaling beside other commits', in one run.",
    )
    parser.add_argument(
        "--against",
        action="append",
        required=True,
        metavar="REV",
        help="a commit to compare with (repeatable)",
    )
    parser.add_argument("--scenarios", default="abcde", help="routing scenarios (default: %(default)s)")
    parser.add_argument("--seeds", default="0,1,2", help="routing seeds, pooled (default: %(default)s)")
    parser.add_argument("--scaling-seeds", default="0,1,2", help="replay seeds (default: %(default)s)")
    parser.add_argument("--scaling-scenarios", default="", help="replay scenarios (default: all)")
    parser.add_argument("--no-scaling", action="store_true", help="the routing table only")
    parser.add_argument("--jobs", type=int, default=2, help="processes per benchmark (default: %(default)s)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 100 requests a routing scenario, the replay's --quick (the numbers mean little)",
    )
    args = parser.parse_args(argv)
    with worktrees(list(dict.fromkeys(args.against))) as trees:
        lines, found = report(args, trees)
    print("\n".join(lines))
    print()
    print("\n".join(f"REGRESSION {line}" for line in found) if found else "no regression")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
