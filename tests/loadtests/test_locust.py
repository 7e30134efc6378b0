"""``loadtests/locustfile.py`` run as its docstring says: ``locust --headless`` in a child process
(locust patches its process with gevent, so it is never imported here), against the demo cluster
behind the proxy and behind a real Envoy, and against a broken server whose failures must show."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from loadtests.locust_target import serve_target

pytestmark = pytest.mark.integration

LOCUSTFILE = Path(__file__).resolve().parents[2] / "loadtests" / "locustfile.py"
KINDS = ("shared-prefix", "multi-turn", "long-in-short-out", "short-in-long-out")
USERS = 10  # weights 4/3/2/1: every user class gets at least one user from 10 on
# Locust's own start (about 1.5 s on an idle machine) and stop, with room for a busy 2-core one.
LOCUST_OVERHEAD_S = 30.0
MAX_TOKENS = 16  # short answers: more requests of every kind in a few seconds


async def run_locust(host: str, workdir: Path, seconds: int, *options: str) -> tuple[int, str]:
    """``locust --headless`` against ``host`` for ``seconds``, CSV files in ``workdir``; (exit code,
    output). Killed and failed if it overruns."""
    # Nothing from the environment steers the run (LOCUST_* / PDR_* set the options too).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCUST_", "PDR_"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--only-summary",
        "--loglevel",
        "WARNING",
        "-u",
        str(USERS),
        "-r",
        str(USERS),
        "-t",
        f"{seconds}s",
        "--host",
        host,
        "--csv",
        str(workdir / "run"),
        "--exit-code-on-error",
        "1",
        *options,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd=workdir,  # no locust.conf or pyproject.toml of ours is read
        env=env,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), seconds + LOCUST_OVERHEAD_S)
    except TimeoutError:
        proc.kill()
        out, _ = await proc.communicate()
        raise AssertionError(f"locust overran {seconds}s by {LOCUST_OVERHEAD_S}s:\n{out.decode()}") from None
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def stats_by_row(workdir: Path) -> dict[tuple[str, str], dict[str, str]]:
    """``run_stats.csv`` by (type, name), the Aggregated row left out."""
    return {(r["Type"], r["Name"]): r for r in read_csv(workdir / "run_stats.csv") if r["Type"]}


def count(stats: dict[tuple[str, str], dict[str, str]], kind: str, name: str) -> int:
    row = stats.get((kind, name))
    return int(row["Request Count"]) if row else 0


# Envoy's start costs a second or two, so its run is shorter: the whole file stays under ~20 s.
@pytest.mark.parametrize(("use_envoy", "seconds"), [(False, 6), (True, 4)], ids=["proxy", "envoy"])
async def test_every_kind_of_traffic_runs_clean_with_ttft_and_tpot(
    tmp_path: Path, use_envoy: bool, seconds: int
) -> None:
    async with serve_target(use_envoy=use_envoy, workdir=tmp_path) as target:
        code, out = await run_locust(
            target.url, tmp_path, seconds, "--pdr-max-tokens", str(MAX_TOKENS), "--pdr-think-s", "0.2"
        )
    stats = stats_by_row(tmp_path)
    failures = read_csv(tmp_path / "run_failures.csv")
    assert code == 0 and not failures, f"{failures}\n{out}"
    assert all(int(row["Failure Count"]) == 0 for row in stats.values()), out
    for kind in KINDS:
        assert count(stats, "SSE", kind) + count(stats, "POST", kind) > 0, f"{kind} never ran:\n{out}"
        for metric in ("TTFT", "TPOT"):
            row = stats.get((metric, kind))
            assert row is not None and int(row["Request Count"]) > 0, f"no {metric} for {kind}:\n{out}"
            assert float(row["Average Response Time"]) > 0 and float(row["Min Response Time"]) > 0
    # Most requests stream, some do not (--pdr-stream-ratio 0.8).
    streamed = sum(count(stats, "SSE", kind) for kind in KINDS)
    whole = sum(count(stats, "POST", kind) for kind in KINDS)
    assert streamed > whole > 0, out
    # TTFT is the first token's time, not the stream's end: a long answer shows the difference.
    long = "short-in-long-out"
    sse_ms = float(stats["SSE", long]["Average Response Time"])
    assert float(stats["TTFT", long]["Average Response Time"]) < sse_ms / 2, out
    # Every streamed token counted: the simulated engine always writes max_tokens of them.
    assert float(stats["TPOT", long]["Average Content Size"]) == 4 * MAX_TOKENS
    assert float(stats["SSE", long]["Average Content Size"]) == 4 * MAX_TOKENS
    assert float(stats["TTFT", "shared-prefix"]["Average Content Size"]) > 1000  # the tenant's prompt


# -- a broken server: each kind of traffic meets a different fault ---------------------------------

ROLE_DELAY_S = 0.05  # between the role-only opening chunk and the first token


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chunk(text: str, chat: bool) -> bytes:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return _sse({"object": "chunk", "choices": [choice]})


async def _models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "broken-model", "object": "model"}]})


async def _answer(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    assert body["model"] == "broken-model"  # resolved from GET /v1/models
    chat = request.path.endswith("/chat/completions")
    if chat:
        text = body["messages"][-1]["content"]
        kind = "multi-turn" if text.startswith("Turn ") else "shared-prefix"
    else:
        kind = "long-in-short-out" if body["prompt"].startswith("Document") else "short-in-long-out"
    if kind == "short-in-long-out":
        return web.json_response({"error": {"message": "no capacity", "code": 503}}, status=503)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
        await resp.write(_sse({"object": "chunk", "choices": [role]}))
        await asyncio.sleep(ROLE_DELAY_S)
    await resp.write(_chunk("one", chat))
    if kind == "long-in-short-out":
        await resp.write(_sse({"error": {"message": "engine fell over", "code": 500}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp
    await resp.write(_chunk(" two", chat))
    if kind == "shared-prefix":
        return resp  # cut short: no usage, no [DONE]
    await resp.write(_chunk(" three", chat))
    # No completion_tokens: the token count must come from the token events themselves.
    usage = {"prompt_tokens": 7}
    await resp.write(_sse({"object": "chunk", "choices": [], "usage": usage}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


@contextlib.asynccontextmanager
async def broken_server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/chat/completions", _answer)
    app.router.add_post("/v1/completions", _answer)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_broken_answers_are_failures_that_say_why(tmp_path: Path) -> None:
    async with broken_server() as url:
        code, out = await run_locust(url, tmp_path, 3, "--pdr-stream-ratio", "1", "--pdr-think-s", "0.05")
    assert code == 1, out  # --exit-code-on-error
    # Locust shows a failure as its exception's repr: CatchResponseError('<our message>').
    failures = {r["Name"]: r["Error"] for r in read_csv(tmp_path / "run_failures.csv")}
    assert failures.keys() == {"shared-prefix", "long-in-short-out", "short-in-long-out"}, out
    assert "'stream ended without [DONE] (2 token events)'" in failures["shared-prefix"]
    assert "'error event in the stream: engine fell over'" in failures["long-in-short-out"]
    assert "'HTTP 503: no capacity'" in failures["short-in-long-out"]
    stats = stats_by_row(tmp_path)
    for kind in ("shared-prefix", "long-in-short-out", "short-in-long-out"):
        row = stats["SSE", kind]
        assert int(row["Failure Count"]) == int(row["Request Count"]) > 0
        assert (("TTFT", kind) not in stats) and (("TPOT", kind) not in stats)  # failures are not timed
    # The one healthy kind: the role-only opening chunk is not the first token, and neither it
    # nor the usage chunk nor [DONE] is counted as one.
    assert int(stats["SSE", "multi-turn"]["Failure Count"]) == 0
    assert float(stats["TTFT", "multi-turn"]["Min Response Time"]) >= ROLE_DELAY_S * 1000
    assert float(stats["TPOT", "multi-turn"]["Average Content Size"]) == 3
