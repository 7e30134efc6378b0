"""Two picker replicas behind one gateway, in virtual time (``loadtests/bench/replicas.py``): sharing
through Redis keeps them close to one replica, and without it they route blind to each other."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from loadtests.bench.replicas import Setup, main, paired_ratio, row, run_setup
from loadtests.bench.scenarios import SCENARIOS

REQUESTS = 300


def _p90(setup: Setup, seeds: tuple[int, ...] = (0,), **redis: float) -> float:
    """p90 TTFT of ``setup`` on (b), the seeds' requests pooled."""
    scn = SCENARIOS["b"]
    summaries = [run_setup(scn, setup, seed, requests=REQUESTS, redis_settings=redis) for seed in seeds]
    return row(scn, setup, summaries, None)["ttft_p90_ms"]


def test_replicas_that_share_their_index_and_load_route_better_than_those_that_do_not() -> None:
    # Pooled over three draws: on one, sharing the index alone can come within a few percent of
    # sharing the reservations too (seed 0: 87.5 against 84.5 ms), on another it is 1.6x slower
    # (seed 1: 276 against 174).
    seeds = (0, 1, 2)
    shared, index_only, blind = (
        _p90(Setup(2, True), seeds),
        _p90(Setup(2, True), seeds, share_load_ms=0),  # the prefix index shared, the reservations not
        _p90(Setup(2, False), seeds),
    )
    assert shared < index_only < blind


def test_replicas_that_share_their_load_route_nearly_as_one() -> None:
    # Pushed (index.redis.push, the default), each replica's view of a pod follows every replica's
    # writes to it in order, held to the pod's KV cache as one replica's is; asked, a replica learns
    # the others' blocks from Redis lookups only (seed 0: one replica 80.4 ms, pushed 84.5, asked 90.6).
    one, pushed, asked = _p90(Setup(1, False)), _p90(Setup(2, True)), _p90(Setup(2, True, push=False))
    assert pushed <= 1.1 * one  # virtual time: the same numbers on every machine
    assert pushed < asked


def test_the_command_prints_one_row_per_setup(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--scenarios", "b", "--replicas", "2", "--requests", "40", "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["setup"] for r in rows] == ["1 replica", "2 replicas, shared", "2 replicas, independent"]
    assert rows[0]["p90_vs_one"] == 1.0 and all(r["ok"] == "40/40" for r in rows)


def test_paired_compares_each_run_with_one_replicas_run_of_the_same_seeds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--scenarios", "b", "--replicas", "2", "--requests", "30", "--seeds", "0,1"]
    assert main([*argv, "--router-seeds", "2", "--no-independent", "--json"]) == 0
    one, shared = json.loads(capsys.readouterr().out)
    assert len(one["run_p90_ms"]) == len(shared["run_p90_ms"]) == 4  # 2 workload × 2 router seeds
    assert one["paired_vs_one"] == 1.0
    ratios = [mine / theirs for mine, theirs in zip(shared["run_p90_ms"], one["run_p90_ms"], strict=True)]
    assert shared["paired_vs_one"] == pytest.approx(statistics.median(ratios))


def test_paired_ratio_holds_each_run_to_its_own_seeds() -> None:
    # Seed 1 saturates (ten times seed 0's p90): pooled, it decides; paired, each seed is its own yardstick.
    one = [100.0, 1000.0, 120.0]
    assert paired_ratio([110.0, 1100.0, 132.0], one) == pytest.approx(1.1)
    assert paired_ratio([1100.0, 110.0, 132.0], one) == pytest.approx(1.1)  # the median of 11, 0.11, 1.1
    assert paired_ratio([1000.0, 100.0, 90.0], one) == pytest.approx(0.75)  # 10, 0.1, 0.75: by seed
    assert math.isnan(paired_ratio([1.0], None)) and math.isnan(paired_ratio([1.0], [1.0, 2.0]))


def test_router_seeds_are_pooled_per_row_and_move_the_tie_breaks(capsys: pytest.CaptureFixture[str]) -> None:
    scn = SCENARIOS["b"]

    def routes(router_seed: int) -> list[str]:
        summary = run_setup(scn, Setup(1, False), 0, requests=20, router_seed=router_seed)
        return [r.decode for r in summary.results]

    # An idle pool's pods tie exactly: the router's own seed decides, and so moves the whole run.
    assert routes(0) == routes(0)
    assert routes(0) != routes(1)
    argv = ["--scenarios", "b", "--replicas", "2", "--requests", "20", "--router-seeds", "2"]
    assert main([*argv, "--no-independent", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["ok"] for r in rows] == ["40/40", "40/40"]  # two router seeds pooled in each row
    with pytest.raises(SystemExit):
        main([*argv, "--envoy"])
    assert "--router-seeds is for the virtual runs" in capsys.readouterr().err


def test_behind_a_real_envoy_every_replica_setup_answers(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--envoy", "--scenarios", "b", "--replicas", "2", "--requests", "30", "--lone", "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["setup"] for r in rows] == [
        "1 replica",
        "1 replica, with Redis",
        "2 replicas, shared",
        "2 replicas, independent",
    ]
    for r in rows:
        ok, sent = r["ok"].split("/")
        assert ok == sent and int(sent) > 0  # every request routed by the replicas through Envoy
        assert r["decision_ms"] > 0 and r["router_cpu_ms"] > 0
        # Redis's CPU is counted where there is one, and only there.
        assert (r["redis_cpu_ms"] > 0) == (r["setup"] in ("1 replica, with Redis", "2 replicas, shared"))
    assert rows[0]["p90_vs_one"] == 1.0  # the one without Redis is the yardstick


def test_push_both_runs_asked_and_pushed_replicas_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--scenarios", "b", "--replicas", "2", "--requests", "40", "--push", "both", "--no-independent"]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["setup"] for r in rows] == ["1 replica", "2 replicas, shared, asked", "2 replicas, shared"]
    assert all(r["ok"] == "40/40" for r in rows)


def test_a_setup_sets_push_over_the_other_redis_settings() -> None:
    assert Setup(2, True).redis({"share_load_ms": 20}) == {"share_load_ms": 20, "push": True}
    assert Setup(2, True, push=False).redis({"share_load_ms": 20}) == {"share_load_ms": 20, "push": False}
