"""The decode sidecar's CPU per P/D request with each engine-leg HTTP client, side by side in one run
(a script, not a test).

Behind Envoy every P/D request passes through the decode pod's sidecar, which runs both legs: the
prefill leg to the pod named in ``x-prefiller-host-port`` and the decode leg to its own engine.
Two zero-delay null engines stand in for them (answering a prefill leg with
``kv_transfer_params``, as vLLM's NIXL connector does); the sidecar runs in its own process pinned
to its own core, once per client (``--http-client builtin`` and ``aiohttp``) in alternating
rounds; the client, a closed loop of keep-alive connections, and the engines share the other core.
Per client and per answer kind (whole, streamed): requests per second and the sidecar's CPU
milliseconds per request (user + system, from ``/proc``), medians over the rounds.

    python -m loadtests.bench.sidecar                # 3 rounds (~1 minute)
    python -m loadtests.bench.sidecar --rounds 5 --scale 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from typing import Any

import orjson

from loadtests.bench.proxy import (
    MODEL,
    Child,
    HttpConn,
    _client_run,
    _pin,
    _run,
    _serve_until_term,
    drive,
    null_engine_main,
    settle_as_served,
    start_child,
)
from router.http.headers import PREFILLER

CLIENTS = ("builtin", "aiohttp")
SIDECAR_CPU, CLIENT_CPU = 1, 0


def sidecar_main(conn: Any, decode: str, cpu: int | None, http_client: str) -> None:
    _pin(cpu)
    from router.sidecar.server import SidecarServer  # imported in the sidecar's child only

    async def serve() -> None:
        async with SidecarServer(decode, "127.0.0.1", 0, ["127.0.0.1"], http_client=http_client) as server:
            port = server.port
            settle_as_served()

            async def bound() -> int:
                return port

            await _serve_until_term(bound, conn)

    _run(serve())


async def _cell(port: int, prefill: str, stream: bool, requests: int, cpu_s: Any) -> tuple[float, float]:
    """Requests per second and CPU ms per request of one closed loop of 16 connections."""
    body = orjson.dumps(
        {"model": MODEL, "prompt": "Say hello in one word.", "max_tokens": 8, "stream": stream}
    )
    extra = f"{PREFILLER}: {prefill}\r\n"
    errors = 0

    async def one(conn: HttpConn, _t0: float) -> bool:
        nonlocal errors
        try:
            await conn.post("/v1/completions", body, extra)
        except (RuntimeError, OSError, asyncio.IncompleteReadError) as exc:
            errors += 1
            sys.stderr.write(f"  error: {exc}\n")
            return False
        return True

    await drive(port, 16, 100, 60.0, one)  # warm: connections, imports, caches
    cpu0 = cpu_s()
    wall = await drive(port, 16, requests, 120.0, one)
    used = cpu_s() - cpu0
    if errors:
        raise RuntimeError(f"{errors} requests failed through the sidecar")
    return requests / wall, used * 1000.0 / requests


def run(args: argparse.Namespace) -> dict[tuple[str, str], list[tuple[float, float]]]:
    _pin(CLIENT_CPU)
    engines: list[Child] = [start_child(null_engine_main, CLIENT_CPU) for _ in range(2)]
    prefill, decode = (f"127.0.0.1:{e.port}" for e in engines)
    seen: dict[tuple[str, str], list[tuple[float, float]]] = {}
    requests = int(2000 * args.scale)
    try:
        for round_no in range(args.rounds):
            order = CLIENTS if round_no % 2 == 0 else CLIENTS[::-1]
            for client in order:
                sidecar = start_child(sidecar_main, decode, SIDECAR_CPU, client)
                try:
                    for stream in (False, True):
                        cell = _client_run(_cell(sidecar.port, prefill, stream, requests, sidecar.cpu_s))
                        seen.setdefault((client, "stream" if stream else "whole"), []).append(cell)
                finally:
                    sidecar.stop()
            sys.stderr.write(f"  round {round_no + 1} done\n")
    finally:
        for engine in engines:
            engine.stop()
    return seen


def render(seen: dict[tuple[str, str], list[tuple[float, float]]], rounds: int) -> list[str]:
    lines = [
        "The decode sidecar, a P/D request's two legs (prefill pod, local engine), c=16; "
        f"medians of {rounds} rounds",
        "",
        "| engine-leg client | answers | req/s | sidecar CPU ms per request |",
        "|---|---|---:|---:|",
    ]
    for (client, kind), cells in seen.items():
        rps = statistics.median(c[0] for c in cells)
        cpu = statistics.median(c[1] for c in cells)
        lines.append(f"| {client} | {kind} | {rps:,.0f} | {cpu:.3f} |")
    for kind in ("whole", "stream"):
        ours = statistics.median(c[1] for c in seen[("builtin", kind)])
        theirs = statistics.median(c[1] for c in seen[("aiohttp", kind)])
        lines += ["", f"{kind}: builtin over aiohttp, CPU per request {ours / theirs:.2f}x"]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.bench.sidecar", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scale", type=float, default=1.0, help="requests per cell × this")
    args = p.parse_args(argv)
    print("\n".join(render(run(args), args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
