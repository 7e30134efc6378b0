"""Identical bursts, repeated: how far apart the replica recommendations of the same traffic land.

Each run is a fresh simulated fleet (2 prefill + 2 decode replicas, fixed: no autoscaler acts) and
a fresh router, replaying the same seeded burst of long prompts; the router's recommendation is
read every tick. A trustworthy signal recommends the same count for the same traffic: the table
prints each run's peak prefill recommendation, the range of its capacity per replica while the
burst ran, and what the two prefill replicas really computed (prompt tokens per second of the
burst, per replica), then the spread of the peaks.

    python -m loadtests.bench.bursts                 # 6 runs of 48 prompts of 6k tokens
    python -m loadtests.bench.bursts --runs 3 --prompt-tokens 2000
    python -m loadtests.bench.bursts --virtual       # in virtual time, each run's hop different

``--virtual`` replays in virtual time (``simulator.virtual_clock``), where identical runs are
identical; what varies instead is each proxy → engine leg's time (``HOPS``: ¼× to 8× the usual
hop), which moves every observation the router learns from. Deterministic and independent of the
machine's load, it is what the test suite runs; over HTTP the machine's own timing is the noise.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from loadtests.bench.scaling import Settings, serving
from simulator.virtual_clock import run_virtual
from simulator.workloads.generate import Phase, phased

# Wall-clock time over HTTP: how far the real timing of identical runs moves the recommendation is
# the point (in virtual time, identical runs are identical: ``repeat_virtual`` varies the hop).
SETTINGS = Settings(speed=20.0, ready_s=60.0, max_replicas=32, virtual=False)
INITIAL = {"prefill": 2, "decode": 2}
HOPS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)  # × the usual proxy → engine leg, one per virtual run


@dataclass(frozen=True)
class BurstRun:
    peak_prefill: int  # the highest prefill recommendation during the run
    peak_decode: int
    capacity_low: float  # prefill capacity per replica (tokens per simulated s) while demand was seen
    capacity_high: float
    computed_per_replica: float  # prompt tokens per simulated s each prefill replica computed, run-long
    ok: int
    requests: int


def burst(requests: int, prompt_tokens: int, seconds: float) -> Phase:
    return Phase(seconds, requests / seconds, prompt_tokens=prompt_tokens, max_tokens=16)


async def one_run(phase: Phase, settings: Settings, seed: int) -> BurstRun:
    workload = phased([phase], seed=seed, name="burst")
    items = [dataclasses.replace(i, at_s=i.at_s / settings.speed) for i in workload.items]
    async with serving(INITIAL, settings, seed) as (fleet, app, drive):
        peaks = {"prefill": 0, "decode": 0}
        capacities: list[float] = []
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                latest = app.parts.scaling.latest
                for role in peaks:
                    if role in latest:
                        peaks[role] = max(peaks[role], latest[role].recommended)
                prefill = latest.get("prefill")
                if prefill is not None and prefill.demand > 0:  # the router's seconds are wall seconds
                    capacities.append(float(prefill.capacity) / settings.speed)
                await asyncio.sleep(app.parts.scaling.settings.tick_s)

        watcher = asyncio.create_task(watch())
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            summary = await drive(dataclasses.replace(workload, items=items), "burst")
            elapsed_sim = (loop.time() - started) * settings.speed
            # The recommendation a few ticks after the last answer still counts (late observations).
            await asyncio.sleep(5 * app.parts.scaling.settings.tick_s)
        finally:
            done.set()
            await watcher
        computed = sum(
            r.engine.stats.prefill_tokens_computed for r in fleet.replicas.values() if r.role == "prefill"
        )
    return BurstRun(
        peaks["prefill"],
        peaks["decode"],
        min(capacities, default=float("nan")),
        max(capacities, default=float("nan")),
        computed / INITIAL["prefill"] / max(elapsed_sim, 1e-9),
        len(summary.ok),
        len(summary.results),
    )


def table(runs: Sequence[BurstRun], phase: Phase) -> str:
    n = round(phase.rate * phase.duration_s)
    lines = [
        f"### {len(runs)} identical bursts: ~{n} prompts of {phase.prompt_tokens} tokens in "
        f"{phase.duration_s:g} s, 2 prefill + 2 decode replicas (tokens per simulated second)",
        "",
        "| run | peak recommended P | peak recommended D | P capacity/replica, tokens/s | "
        "P computed/replica over the run, tokens/s | ok |",
        "|--:|--:|--:|--:|--:|--:|",
    ]
    for i, r in enumerate(runs, 1):
        lines.append(
            f"| {i} | {r.peak_prefill} | {r.peak_decode} | {r.capacity_low:,.0f}–{r.capacity_high:,.0f} | "
            f"{r.computed_per_replica:,.0f} | {r.ok}/{r.requests} |"
        )
    peaks = [r.peak_prefill for r in runs]
    spread = max(peaks) - min(peaks)
    lines += ["", f"Peak prefill recommendation: {min(peaks)}–{max(peaks)} (spread {spread})"]
    return "\n".join(lines)


async def repeat(runs: int, phase: Phase, settings: Settings, seed: int) -> list[BurstRun]:
    return [await one_run(phase, settings, seed) for _ in range(runs)]


def repeat_virtual(runs: int, phase: Phase, settings: Settings, seed: int) -> list[BurstRun]:
    """``runs`` replays in virtual time, the i-th with its legs ``HOPS[i]`` × the usual hop."""
    out = []
    for hop in itertools.islice(itertools.cycle(HOPS), runs):
        varied = dataclasses.replace(settings, virtual=True, hop_s=settings.hop_s * hop)
        out.append(run_virtual(one_run(phase, varied, seed), seed=seed))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.bursts", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=6000)
    parser.add_argument("--seconds", type=float, default=30.0, help="the burst's length (simulated s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--virtual", action="store_true", help="virtual time, each run's hop different")
    args = parser.parse_args(argv)
    phase = burst(args.requests, args.prompt_tokens, args.seconds)
    if args.virtual:
        runs = repeat_virtual(args.runs, phase, SETTINGS, args.seed)
    else:
        runs = asyncio.run(repeat(args.runs, phase, SETTINGS, args.seed))
    sys.stdout.write(table(runs, phase) + "\n")
    return 0 if all(r.ok == r.requests for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
