"""The routing benchmark's full-information reference, and a smoke run of its decode-bound scenario.

The reference must choose the engine whose *true* TTFT is the smallest: the same hand-built
simulator state is built three times over, once routed by the reference through the proxy and
once sent straight to each engine, so "true" is measured, not assumed.
"""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest
from helpers import eventually

from loadtests.bench import routing
from loadtests.bench.scenarios import SCENARIOS
from router.server.app import App
from router.server.compose import build
from simulator.engine import EngineSnapshot, EngineSpec, SimCluster, SimJob, TimeModel
from simulator.workloads.client import Result, send
from simulator.workloads.generate import WorkItem

pytestmark = pytest.mark.integration

TM = TimeModel(speed=2.0)
NAMES = ("warm", "cold")
# ~2048 tokens at 4 characters a token; the queue on "warm" is 4 other prompts of ~4096 tokens.
PROMPT = "".join(f"Shared context line {i:04d} of the prompt, about ten tokens. " for i in range(137))[:8192]
QUEUED = [
    "".join(f"Unrelated document {q} paragraph {i:04d} fills the queue. " for i in range(300))[:16384]
    for q in range(4)
]


def _item(prompt: str, max_tokens: int = 4) -> WorkItem:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    return WorkItem(0.0, "/v1/completions", body)


def _cluster() -> SimCluster:
    return SimCluster([EngineSpec(name, "prefill-decode", link="rack-a", time=TM) for name in NAMES])


async def _build(
    busy: bool, cluster: SimCluster, session: aiohttp.ClientSession
) -> list[asyncio.Task[Result]]:
    """The hand-built state: "warm" holds PROMPT's blocks and, when ``busy``, has four long
    prompts queued ahead; "cold" is idle and empty. Returns the queued requests."""
    warm = f"http://{cluster.address('warm')}"
    assert (await send(session, warm, _item(PROMPT, 1))).ok
    if not busy:
        return []
    queued = [asyncio.create_task(send(session, warm, _item(p, 1))) for p in QUEUED]
    engine = cluster.engines["warm"]
    await eventually(lambda: engine.num_running + engine.num_waiting >= len(QUEUED), what="all queued")
    return queued


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))


async def _measured(busy: bool, name: str) -> float:
    """TTFT of PROMPT sent straight to engine ``name`` in the hand-built state."""
    async with _cluster() as cluster, _session() as session:
        queued = await _build(busy, cluster, session)
        result = await send(session, f"http://{cluster.address(name)}", _item(PROMPT))
        await asyncio.gather(*queued)
    assert result.ok
    return result.ttft_s


async def _routed(busy: bool) -> tuple[Result, routing.ReferencePicker]:
    """PROMPT routed by the reference through the proxy in the hand-built state."""
    async with _cluster() as cluster, App(build(routing.make_config(cluster, TM, {}), seed=0)) as app:
        reference = routing.install_reference(app, cluster)
        async with _session() as session:
            queued = await _build(busy, cluster, session)
            result = await send(session, f"http://127.0.0.1:{app.proxy_port}", _item(PROMPT))
            await asyncio.gather(*queued)
    assert result.ok, result.error
    return result, reference


@pytest.mark.parametrize(("busy", "expected"), [(False, "warm"), (True, "cold")])
async def test_reference_picks_the_true_smallest_ttft(busy: bool, expected: str) -> None:
    """Idle: the engine holding the prefix answers first. Busy: the same engine has ~8 full
    prefill steps queued, so recomputing the prompt on the idle engine is faster."""
    truth = {name: await _measured(busy, name) for name in NAMES}
    assert min(truth, key=truth.__getitem__) == expected
    assert max(truth.values()) > 1.5 * min(truth.values())  # the state makes a clear difference

    result, reference = await _routed(busy)
    assert result.decode == expected and not result.prefill
    # Its forecasts are the measured TTFTs (HTTP, the proxy and a busy machine add some) for every
    # engine...
    for name in NAMES:
        predicted = reference.last_routes[(None, name)]
        assert 0.7 * truth[name] - 0.005 <= predicted <= 1.05 * truth[name] + 0.003, (name, predicted, truth)
    # ... and the pairs it weighed cost a transfer and a second hop more than the best single pod.
    pairs = [t for (p, _), t in reference.last_routes.items() if p is not None]
    assert pairs and min(pairs) > reference.last_routes[(None, expected)]
    assert reference.predicted[result.request_id] == pytest.approx(reference.last_routes[(None, expected)])


def test_forecast_skips_decode_only_stretches_exactly() -> None:
    """The closed-form skip over decode-only steps lands where stepping one by one does."""
    tm = TimeModel()
    decoders = tuple(SimJob(0, tokens, 0, 20) for tokens in (50, 120, 300))
    snap = EngineSnapshot("e", 0.0, 0.0, False, tm, 16, 100, 80, decoders, (), ())
    job = SimJob(32, 1, need_blocks=25, frees_blocks=25)  # 20 blocks free: waits for one to end
    forecast = routing.first_token_at(snap, job, 0.0)
    # By hand, one step at a time: base + per_seq × batch + per_kv × held tokens, the held blocks
    # growing batch / 16 a step, each decoder ending after its last token.
    held, now, batch, ends, step = 80.0, 0.0, 3, [49, 119, 299], 0
    while 100 - held < 25:
        now += tm.step_base_s + tm.decode_s_per_seq * batch + tm.kv_s_per_token * held * 16
        ended = ends.count(step)
        held += batch / 16 - 20 * ended
        batch -= ended
        step += 1
    held += 25
    now += tm.step_base_s + tm.prefill_s_per_token * 32 + tm.decode_s_per_seq * batch
    now += tm.kv_s_per_token * held * 16
    assert step == 50
    assert forecast == pytest.approx(now, rel=1e-9)


def test_smoke_decode_bound_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--scenarios", "e", "--requests", "20", "--speed", "4"]
    assert routing.main([*argv, "--policies", "pd-router,pd-router-rigid,reference"]) == 0
    out = capsys.readouterr().out
    for policy in ("pd-router", "pd-router-rigid", "reference"):
        assert re.search(rf"^  {policy} +20/20 ", out, re.M), out
    assert "goodput" in out and "p99/ref" in out
    assert re.search(r"pd-router: observed / predicted TTFT p10 [\d.>]+, p50 [\d.>]+, p90", out), out
    assert "reference: observed (client) / predicted TTFT" in out


def test_after_s_reports_only_the_requests_that_arrived_that_late(capsys: pytest.CaptureFixture[str]) -> None:
    scn = SCENARIOS["e"]
    arrivals = [item.at_s for item in scn.workload(20, scn.rate, 0).items]
    after = arrivals[12]
    late = sum(at >= after for at in arrivals)
    argv = ["--scenarios", "e", "--requests", "20", "--speed", "4", "--policies", "pd-router"]
    assert routing.main([*argv, "--after-s", str(after)]) == 0
    assert re.search(rf"^  pd-router +{late}/{late} ", capsys.readouterr().out, re.M)
    assert routing.main([*argv, "--after-s", str(arrivals[-1] + 1)]) == 2
    assert "no request arrives that late" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        routing.main([*argv, "--after-s", "-1"])
