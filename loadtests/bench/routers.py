"""The standalone proxy against the Rust routers, side by side in one run (a script, not a test).

Two zero-delay OpenAI workers (the proxy benchmark's null engine, answering a fixed small JSON),
and in front of them, one router at a time, each in its own process pinned to its own core:

* **pd-router**: ``App`` as ``pd-router serve`` runs it, a pool of the two workers (``prefill-decode``);
* **aiohttp-forward**, not a router: aiohttp's server and client (pd-router's server runner and
  its engine session) forwarding to the workers in turn with no decision at all; asked for by name,
  **aiohttp-forward+flow** forwards the same way around pd-router's request flow (the parse, the
  pick, the bookkeeping), to the worker picked: the flow's cost apart from the proxy's HTTP; and
  **pd-router+aiohttp-legs** is pd-router with its engine legs through aiohttp's client
  (``proxy.http_client: aiohttp``) instead of the built-in one;
* **sglang-router** (``sglang-router launch --policy cache_aware``) and **vllm-router**
  (``vllm-router --policy cache_aware``), from their PyPI wheels, installed by this script into a
  virtual environment of their own (``--rust-venv``; the test suite never needs them).

The client (a closed loop of keep-alive connections, non-streaming ``/v1/completions``) and the
workers share the other core. Per router: the p50 latency it adds at c=1 (over the same requests
straight to a worker, measured in the same round), requests/s at c=16, and the router process's
CPU milliseconds per request (user + system from ``/proc``, its child processes included) at c=1
and c=16. Rounds alternate the routers; the table holds each figure's median over the rounds, and
every router's figures over pd-router's.

    python -m loadtests.bench.routers                    # 3 rounds (~2 minutes)
    python -m loadtests.bench.routers --rounds 5 --scale 2
    python -m loadtests.bench.routers --routers pd-router,aiohttp-forward  # without the Rust routers
    python -m loadtests.bench.routers --routers pd-router,aiohttp-forward,aiohttp-forward+flow
    python -m loadtests.bench.routers --routers pd-router,pd-router+aiohttp-legs,aiohttp-forward
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import venv
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from loadtests.bench.proxy import (
    MODEL,
    Child,
    _client_run,
    _null_engine_app,
    _pin,
    _serve_until_term,
    closed_loop,
    null_engine_main,
    process_cpu_s,
    run_profiled,
    settle_as_served,
    start_child,
)

if TYPE_CHECKING:  # the router is imported in its child processes only
    from router.flow.flight import RequestFlow
    from router.server.app import App

RUST_ROUTERS = {"sglang-router": "sglang-router==0.3.2", "vllm-router": "vllm-router==0.1.17"}
# Not routers: the proxy's HTTP stack forwarding with no decision (``aiohttp_forward_main``), and
# the same around pd-router's request flow (asked for by name: not in the default run).
FLOOR = "aiohttp-forward"
FLOOR_FLOW = "aiohttp-forward+flow"
AIOHTTP_LEGS = "pd-router+aiohttp-legs"  # pd-router with proxy.http_client: aiohttp
ROUTERS = ("pd-router", FLOOR, *RUST_ROUTERS)
ROUTER_CPU, CLIENT_CPU = 1, 0


# -- the workers (child processes) -----------------------------------------------------------------


def _worker_app() -> web.Application:
    """The null engine, plus what the Rust routers probe before they route to a worker."""
    # vllm-router opens with an HTTP/2 preface: aiohttp refuses it, and need not log each one.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    app = _null_engine_app()

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def info(_: web.Request) -> web.Response:
        return web.json_response({"model_path": MODEL, "is_generation": True, "max_total_num_tokens": 65536})

    app.router.add_get("/health", ok)
    app.router.add_get("/health_generate", ok)
    app.router.add_get("/v1/models", models)
    for path in ("/get_model_info", "/get_server_info", "/model_info", "/server_info"):
        app.router.add_get(path, info)
    return app


def pd_router_main(conn: object, workers: list[str], cpu: int | None, http_client: str = "builtin") -> None:
    _pin(cpu)
    from router.server.app import App  # imported in the router's child only
    from router.server.compose import build
    from router.server.config import parse_config

    endpoints = [{"address": w, "role": "prefill-decode", "name": f"w{i}"} for i, w in enumerate(workers)]
    proxy = {"port": 0, "http_client": http_client}
    config = parse_config({"model": MODEL, "endpoints": endpoints, "proxy": proxy})

    async def serve() -> None:
        async with App(build(config)) as app:
            port = app.proxy_port
            assert port is not None
            settle_as_served()

            async def bound() -> int:
                return port

            await _serve_until_term(bound, conn)  # type: ignore[arg-type]

    run_profiled(serve(), "")


def aiohttp_forward_main(conn: object, workers: list[str], cpu: int | None, with_flow: bool = False) -> None:
    """aiohttp forwarding and nothing more: pd-router's server runner and its aiohttp engine session
    (``proxy.http_client: aiohttp``), a handler that reads the body, sends it to the workers in
    turn and copies the answer back. Not a router (no decision, no bookkeeping): what aiohttp's
    stack costs alone.

    ``with_flow``: the same forwarding around pd-router's request flow (``App`` with its proxy
    off: the parse, the pick and its reservation, the answer's bookkeeping and metrics, the
    flight's close), the worker the one picked: what the flow costs, apart from how the proxy
    speaks HTTP."""
    _pin(cpu)
    from router.http.server import http_runner
    from router.http.session import upstream_session
    from router.server.app import App
    from router.server.compose import build
    from router.server.config import parse_config

    async def serve(flow: RequestFlow | None) -> None:
        session = upstream_session()
        turn = itertools.cycle(workers)

        async def send(path: str, body: bytes, address: str) -> tuple[int, str, bytes]:
            headers = {"Content-Type": "application/json"}
            async with session.post(f"http://{address}{path}", data=body, headers=headers) as up:
                return up.status, up.content_type, await up.read()

        async def forward(request: web.Request) -> web.Response:
            body = await request.read()
            if flow is None:
                status, content_type, data = await send(request.path, body, next(turn))
                return web.Response(body=data, status=status, content_type=content_type)
            flight = flow.start(request.headers, path=request.path)
            try:
                decision = await flow.route(flight, body, request.path)
                status, content_type, data = await send(request.path, body, decision.decode.address)
                flight.expect_answer(strip_usage=False)
                flight.responded(status)
                flight.prefill_done()
                flight.first_byte()
                data = flight.body(data) + flight.body_rest()
                return web.Response(body=data, status=status, content_type=content_type)
            finally:
                flight.close()

        app = web.Application()
        app.router.add_post("/v1/completions", forward)
        runner = http_runner(app, drain_timeout_s=1.0, cancel_on_disconnect=True)

        async def start() -> int:
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            settle_as_served()  # as the pd-router rows do: the rows differ in what they run, not how
            return int(runner.addresses[0][1])

        try:
            await _serve_until_term(start, conn)  # type: ignore[arg-type]
        finally:
            await runner.cleanup()
            await session.close()

    async def main() -> None:
        if not with_flow:
            await serve(None)
            return
        endpoints = [{"address": w, "role": "prefill-decode", "name": f"w{i}"} for i, w in enumerate(workers)]
        config = parse_config({"model": MODEL, "endpoints": endpoints, "proxy": {"enabled": False}})
        async with App(build(config)) as pd:
            await _admitted(pd)
            await serve(pd.parts.flow)

    run_profiled(main(), "")


async def _admitted(app: App) -> None:
    """Until the gate has admitted a worker (the proxy's readiness), at most 30 s."""
    deadline = time.monotonic() + 30.0
    while not len(app.parts.pool.candidate_slots()):
        if time.monotonic() > deadline:
            raise RuntimeError("no worker admitted within 30 s")
        await asyncio.sleep(0.05)


# -- the Rust routers (subprocesses from their own virtual environment) ----------------------------


def rust_venv(path: Path) -> Path:
    """A virtual environment with both Rust routers' wheels; made (from PyPI) when missing."""
    bin_dir = path / "bin"
    if not all((bin_dir / name).exists() for name in RUST_ROUTERS):
        venv.create(path, with_pip=True)
        subprocess.run(
            [str(bin_dir / "pip"), "install", "-q", *RUST_ROUTERS.values()],
            check=True,
        )
    return bin_dir


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Process:
    """A router running as a subprocess, its CPU read from /proc with its descendants'."""

    popen: subprocess.Popen[bytes]
    port: int

    def cpu_s(self) -> float:
        return sum(process_cpu_s(pid) for pid in _tree(self.popen.pid))

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(10.0)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5.0)


def _tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += parents.get(pid, [])
    return out


def start_rust(name: str, bin_dir: Path, workers: list[str], cpu: int, log: Path) -> Process:
    port = _free_port()
    urls = [f"http://{w}" for w in workers]
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", "cache_aware"]
    argv = (
        [str(bin_dir / "sglang-router"), "launch", *common]
        if name == "sglang-router"
        else [
            str(bin_dir / "vllm-router"),
            *common,
        ]
    )
    if shutil.which("taskset"):
        argv = ["taskset", "-c", str(cpu), *argv]
    out = log.open("wb")
    proc = Process(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT), port)
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:  # ready once it routes a completion
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.popen.returncode}; see {log}")
        with contextlib.suppress(OSError):
            body = b'{"model": "%s", "prompt": "ping", "max_tokens": 1}' % MODEL.encode()
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=2.0) as resp:
                if resp.status == 200:
                    return proc
        time.sleep(0.2)
    proc.stop()
    raise RuntimeError(f"{name} did not route a completion within 60 s; see {log}")


# -- measuring -------------------------------------------------------------------------------------


@dataclass
class Figures:
    """One router's figures in one round."""

    added_p50_ms: float  # its p50 at c=1 minus the direct p50 of the same round
    rps_c16: float
    cpu_ms_c1: float
    cpu_ms_c16: float


@dataclass
class Rows:
    rounds: dict[str, list[Figures]] = field(default_factory=dict)

    def median(self, name: str, attr: str) -> float:
        return statistics.median(getattr(f, attr) for f in self.rounds[name])


async def _figures(port: int, direct_port: int, cpu_s: Callable[[], float], scale: float) -> Figures:
    n1, n16 = int(400 * scale), int(1500 * scale)
    for conc in (1, 16):  # connections and caches warm, off the record
        await closed_loop(port, stream=False, concurrency=conc, requests=100, timeout_s=60)
    direct = await closed_loop(direct_port, stream=False, concurrency=1, requests=n1, timeout_s=120)
    cpu0 = cpu_s()
    c1 = await closed_loop(port, stream=False, concurrency=1, requests=n1, timeout_s=120)
    cpu1 = cpu_s()
    c16 = await closed_loop(port, stream=False, concurrency=16, requests=n16, timeout_s=120)
    cpu16 = cpu_s()
    if c1.errors or c16.errors:
        raise RuntimeError(f"errors through the router: {c1.errors} at c=1, {c16.errors} at c=16")
    return Figures(
        added_p50_ms=(c1.pct(0.5) - direct.pct(0.5)) * 1000.0,
        rps_c16=len(c16.latencies) / c16.wall_s,
        cpu_ms_c1=(cpu1 - cpu0) * 1000.0 / len(c1.latencies),
        cpu_ms_c16=(cpu16 - cpu1) * 1000.0 / len(c16.latencies),
    )


def run(args: argparse.Namespace) -> Rows:
    _pin(CLIENT_CPU)
    bin_dir = rust_venv(Path(args.rust_venv)) if set(args.routers) & set(RUST_ROUTERS) else None
    workers = [start_child(null_engine_main, CLIENT_CPU, _worker_app) for _ in range(2)]
    addresses = [f"127.0.0.1:{w.port}" for w in workers]
    rows = Rows({name: [] for name in args.routers})
    try:
        for round_no in range(args.rounds):
            for name in args.routers:
                router: Child | Process
                if name in ("pd-router", AIOHTTP_LEGS):
                    client = "aiohttp" if name == AIOHTTP_LEGS else "builtin"
                    router = start_child(pd_router_main, addresses, ROUTER_CPU, client)
                elif name in (FLOOR, FLOOR_FLOW):
                    router = start_child(aiohttp_forward_main, addresses, ROUTER_CPU, name == FLOOR_FLOW)
                else:
                    assert bin_dir is not None
                    log = Path(args.log_dir) / f"{name}.log"
                    router = start_rust(name, bin_dir, addresses, ROUTER_CPU, log)
                try:
                    figures = _client_run(_figures(router.port, workers[0].port, router.cpu_s, args.scale))
                finally:
                    router.stop()
                rows.rounds[name].append(figures)
                sys.stderr.write(f"  round {round_no + 1}: {name} done\n")
    finally:
        for worker in workers:
            worker.stop()
    return rows


def render(rows: Rows) -> list[str]:
    names = list(rows.rounds)
    rounds = len(rows.rounds[names[0]])
    lines = [
        f"Two zero-delay workers, non-streaming /v1/completions, medians of {rounds} alternating rounds",
        "",
        "| router | added p50 at c=1, ms | req/s at c=16 | CPU ms per request, c=1 / c=16 |",
        "|---|---:|---:|---:|",
    ]
    for name in names:
        lines.append(
            f"| {name} | {rows.median(name, 'added_p50_ms'):+.2f} | {rows.median(name, 'rps_c16'):,.0f} | "
            f"{rows.median(name, 'cpu_ms_c1'):.2f} / {rows.median(name, 'cpu_ms_c16'):.2f} |"
        )
    if "pd-router" in rows.rounds and len(names) > 1:
        lines += ["", "pd-router over each (CPU per request at c=16; req/s at c=16):"]
        ours_cpu = rows.median("pd-router", "cpu_ms_c16")
        ours_rps = rows.median("pd-router", "rps_c16")
        for name in names:
            if name != "pd-router":
                cpu = ours_cpu / rows.median(name, "cpu_ms_c16")
                rps = ours_rps / rows.median(name, "rps_c16")
                lines.append(f"  vs {name}: CPU {cpu:.2f}x, req/s {rps:.2f}x")
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.bench.routers",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument(
        "--routers",
        type=lambda s: s.split(","),
        default=list(ROUTERS),
        help=f"of {', '.join((*ROUTERS, FLOOR_FLOW, AIOHTTP_LEGS))}",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scale", type=float, default=1.0, help="requests per cell × this")
    p.add_argument("--rust-venv", default="/tmp/pd-router-rust-routers", help="where the Rust routers live")
    p.add_argument("--log-dir", default="/tmp", help="the Rust routers' logs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    known = (*ROUTERS, FLOOR_FLOW, AIOHTTP_LEGS)
    unknown = [name for name in args.routers if name not in known]
    if unknown:
        parser().error(f"unknown routers {unknown}; choose from {list(known)}")
    sys.stdout.write("\n".join(render(run(args))) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
