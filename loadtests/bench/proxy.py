"""Proxy overhead: small requests through pd-router's proxy vs straight to the engine.

Three processes, all on 127.0.0.1:

* **null engine** — a minimal aiohttp server that answers instantly: ``/metrics`` with a static
  vLLM exposition (``SimEngine.metrics_text``'s shape), completions with a fixed small JSON or a
  fixed 8-chunk SSE stream (chunks ``x-null-gap-ms`` apart when that header is sent).
* **proxy** — ``router.server.app.App`` with a ``prefill-decode`` pool of that ONE engine, run the way
  ``pd-router serve`` runs it (uvloop when installed).
* **client** (this process) — a closed loop of ``c`` keep-alive connections written on raw asyncio
  streams (a minimal HTTP/1.1 client, far cheaper per request than aiohttp's), a fixed number of
  requests per cell.

On 2 cores the proxy is pinned to its own core and the engine and client share the other, so the
proxy never competes with the load generator for CPU; the direct runs use the same engine and
client on the same core, so "proxied minus direct" is what the proxy adds. The proxy's CPU cost is
read from ``/proc/<pid>/stat`` (user + system) before and after each proxied cell. If the
client's core saturates first, requests/s is a lower bound for the proxy; CPU-ms per request
(and the proxy core's utilisation, printed) says what the proxy alone could do. A last cell
streams at c=16 with the engine's chunks 2 ms apart, each arriving on its own as a real engine's
tokens do (the other cells' chunks come in a burst): against the stream c=16 row, the proxy's CPU
per chunk.

    python -m loadtests.bench.proxy                    # default cells (~1 minute)
    python -m loadtests.bench.proxy --scale 3          # 3x the requests per cell
    python -m loadtests.bench.proxy --profile 30       # also cProfile the proxy; top 30 functions
    python -m loadtests.bench.proxy --tracing --baseline-src /tmp/base   # tracing's cost, below

``--tracing`` compares proxies instead of the proxy with the engine: the same proxied cells, one
after the other on the same pinned core, through ``base`` (the router at ``--baseline-src``, e.g.
``git archive <commit> | tar -x -C /tmp/base``; left out without it), ``off`` (this checkout,
tracing off) and ``on`` (this checkout, ``tracing.enabled``, every request sampled, spans exported
in batches over OTLP/HTTP to the null engine, which accepts and drops them). Each cell is run
``--rounds`` times, the order of the proxies rotating, and the medians are reported.

Every loop is bounded by its request count and ``--cell-timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import itertools
import logging
import multiprocessing as mp
import os
import pstats
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import orjson
from aiohttp import web

from simulator.workloads.client import percentile

MODEL = "sim-model"
SSE_CHUNKS = 8
SPREAD_MS = 2.0  # the engine's chunk gap in the spread-streams cell
GAP_HEADER = "x-null-gap-ms"
CLK_TCK = os.sysconf("SC_CLK_TCK")
MS = 1000.0
T = TypeVar("T")


# -- null engine (child process) -------------------------------------------------------------------


def _static_metrics() -> bytes:
    # The exact exposition a simulated engine serves when idle (same names, labels and histogram).
    from simulator.engine import EngineSpec, SimEngine  # only the engine child needs it

    return SimEngine(EngineSpec("null", "prefill-decode", model=MODEL)).metrics_text().encode()


_ANSWER: dict[str, Any] = {
    "id": "cmpl-null",
    "object": "text_completion",
    "created": 0,
    "model": MODEL,
    "choices": [{"index": 0, "text": " ok", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
}
_COMPLETION = orjson.dumps(_ANSWER)
_SSE = [
    b"data: "
    + orjson.dumps(
        {
            "id": "cmpl-null",
            "object": "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "text": f" tok{i}", "logprobs": None, "finish_reason": None}],
        }
    )
    + b"\n\n"
    for i in range(SSE_CHUNKS - 1)
] + [b"data: [DONE]\n\n"]


# A prefill leg's answer, as vLLM's NIXL connector gives it: one token and where to pull the KV from.
_PREFILL_ANSWER = orjson.dumps(
    {
        **_ANSWER,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "null-prefill",
            "remote_block_ids": [1],
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
        },
    }
)


def _null_engine_app() -> web.Application:
    metrics = _static_metrics()

    async def get_metrics(_: web.Request) -> web.Response:
        return web.Response(body=metrics, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        params = body.get("kv_transfer_params")
        if isinstance(params, dict) and params.get("do_remote_decode"):  # a P/D pair's prefill leg
            return web.Response(body=_PREFILL_ANSWER, content_type="application/json")
        if not body.get("stream"):
            return web.Response(body=_COMPLETION, content_type="application/json")
        gap = float(request.headers.get(GAP_HEADER, "0")) / MS
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for i, chunk in enumerate(_SSE):
            if gap and i:
                await asyncio.sleep(gap)
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def traces(_: web.Request) -> web.Response:  # an OTLP/HTTP collector that keeps nothing
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/metrics", get_metrics)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    return app


async def _serve_until_term(start: Callable[[], Awaitable[int]], conn: Connection) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    conn.send(await start())
    await stop.wait()


def _run(coro: Awaitable[None]) -> None:
    try:
        import uvloop  # optional, as in the router CLI
    except ImportError:
        asyncio.run(coro)  # type: ignore[arg-type]
        return
    uvloop.run(coro)  # type: ignore[arg-type]


def _pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {cpu})


def null_engine_main(
    conn: Connection, cpu: int | None, app: Callable[[], web.Application] = _null_engine_app
) -> None:
    _pin(cpu)

    async def start() -> int:
        runner = web.AppRunner(app(), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner.addresses[0][1]

    _run(_serve_until_term(start, conn))


# -- proxy (child process) -------------------------------------------------------------------------


def proxy_main(
    conn: Connection, engine: str, cpu: int | None, profile_path: str, tracing: bool = False, src: str = ""
) -> None:
    """``tracing``: spans on, exported to the null engine; ``src``: the router's source tree to run
    (default: this checkout's)."""
    _pin(cpu)
    logging.basicConfig(level=logging.WARNING)
    if src:
        sys.path.insert(0, src)
    from router.server.app import App  # the router is imported in its own child only
    from router.server.compose import build
    from router.server.config import parse_config

    data: dict[str, Any] = {
        "model": MODEL,
        "endpoints": [{"address": engine, "role": "prefill-decode", "name": "null"}],
        "proxy": {"port": 0},
    }
    if tracing:
        data["tracing"] = {"enabled": True}
        traced_env(engine)
    config = parse_config(data)

    async def serve() -> None:
        async with App(build(config)) as app:
            assert app.proxy_port is not None
            port = app.proxy_port
            settle_as_served()
            await _serve_until_term(lambda: _const(port), conn)

    run_profiled(serve(), profile_path)


def settle_as_served() -> None:
    """What ``pd-router serve`` and ``pd-router sidecar`` do once started, in the tree this
    server was imported from (an older tree may not do it)."""
    import router.server.cli as cli

    settle = getattr(cli, "settle_heap", None)
    if settle is not None:
        settle()


def traced_env(engine: str) -> None:
    """This process's OpenTelemetry environment for a traced router: every request sampled, spans
    exported over OTLP/HTTP to the null engine at ``engine``, which drops them."""
    os.environ.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://{engine}",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_TRACES_SAMPLER="always_on",
    )


def run_profiled(coro: Awaitable[None], profile_path: str) -> None:
    """Run ``coro`` (uvloop when installed), under cProfile when ``profile_path`` is set."""
    profiler = cProfile.Profile() if profile_path else None
    if profiler is not None:
        profiler.enable()
    try:
        _run(coro)
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile_path)


async def _const(value: int) -> int:
    return value


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


@dataclass
class Child:
    proc: mp.process.BaseProcess
    port: int

    def cpu_s(self) -> float:
        """User + system CPU seconds of the child so far."""
        return process_cpu_s(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()  # SIGTERM: the child leaves its loop and cleans up
        self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)


def start_child(target: Callable[..., None], *args: Any) -> Child:
    ctx = mp.get_context("spawn")  # a clean interpreter: no inherited event loop or sockets
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    if not parent.poll(30.0):
        proc.kill()
        raise RuntimeError(f"{target.__name__} did not start within 30 s")
    return Child(proc, parent.recv())


# -- client (this process) -------------------------------------------------------------------------


class HttpConn:
    """One keep-alive HTTP/1.1 connection; just enough protocol for these two response shapes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader = reader
        self.writer = writer
        self.host = host
        # When the last answer ended (its chunked terminator, or its last byte): a client has the
        # answer only then, though its pieces (``post``'s times) came before.
        self.ended_at = 0.0

    @classmethod
    async def open(cls, port: int) -> HttpConn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            # Small requests must leave at once; Nagle would add up to a delayed-ACK timeout.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer, f"127.0.0.1:{port}")

    async def post(self, path: str, body: bytes, extra: str = "") -> list[float]:
        """Send one request; returns the arrival times of the response body's pieces."""
        self.writer.write(
            (
                f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{extra}\r\n"
            ).encode()
            + body
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {head[:200]!r}")
        lower = head.lower()
        times: list[float] = []
        if b"transfer-encoding: chunked" in lower:
            while True:
                size = int((await self.reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
                data = await self.reader.readexactly(size + 2)
                if size == 0:
                    self.ended_at = time.perf_counter()
                    break
                times.append(time.perf_counter())
                del data
        else:
            start = lower.index(b"content-length:") + 15
            length = int(lower[start : lower.index(b"\r\n", start)])
            await self.reader.readexactly(length)
            times.append(time.perf_counter())
            self.ended_at = times[-1]
        return times

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


@dataclass
class Cell:
    latencies: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    errors: int = 0

    def pct(self, q: float, values: list[float] | None = None) -> float:
        return percentile(self.latencies if values is None else values, q)


async def drive(
    port: int,
    concurrency: int,
    requests: int,
    timeout_s: float,
    one: Callable[[HttpConn, float], Awaitable[bool]],
    rate: float = 0.0,
) -> float:
    """Run ``requests`` calls of ``one(conn, t0)`` over ``concurrency`` connections; the wall seconds.

    Closed loop: each connection sends its next request when the last one is done. With ``rate``
    > 0 the requests are paced instead: request i is due at ``i / rate`` seconds, sent by the first
    connection free by then, and ``t0`` is when it was due (a request kept waiting for a free
    connection is charged for the wait). ``one`` returns False when its connection is unusable.
    """
    remaining = requests
    conns = [await HttpConn.open(port) for _ in range(concurrency)]
    begin = time.perf_counter()

    async def worker(conn: HttpConn) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            if rate > 0:
                due = begin + (requests - remaining - 1) / rate
                if due > t0:
                    await asyncio.sleep(due - t0)
                t0 = due
            if not await one(conn, t0):
                return

    try:
        await asyncio.wait_for(asyncio.gather(*(worker(c) for c in conns)), timeout_s)
    finally:
        wall_s = time.perf_counter() - begin
        for conn in conns:
            await conn.close()
    return wall_s


async def closed_loop(
    port: int, *, stream: bool, concurrency: int, requests: int, timeout_s: float, gap_ms: float = 0.0
) -> Cell:
    """``concurrency`` connections, each sending its next request when the last one is done."""
    body = orjson.dumps(
        {"model": MODEL, "prompt": "Say hello in one word.", "max_tokens": 8, "stream": stream}
    )
    extra = f"{GAP_HEADER}: {gap_ms:g}\r\n" if gap_ms else ""
    cell = Cell()

    async def one(conn: HttpConn, t0: float) -> bool:
        try:
            times = await conn.post("/v1/completions", body, extra)
        except (RuntimeError, OSError, asyncio.IncompleteReadError):
            cell.errors += 1
            return False
        cell.latencies.append(conn.ended_at - t0)
        cell.gaps.extend(b - a for a, b in itertools.pairwise(times))
        return True

    cell.wall_s = await drive(port, concurrency, requests, timeout_s, one)
    return cell


# -- the benchmark ---------------------------------------------------------------------------------


def _f(value: float, digits: int = 3) -> str:
    return "-" if value != value else f"{value:.{digits}f}"


@dataclass
class ProxyCell:
    """One (mode, concurrency) cell: the same requests straight to the engine, then through the proxy."""

    mode: str  # "json" or "stream"
    concurrency: int
    requests: int
    direct: Cell
    proxied: Cell
    proxy_cpu_s: float  # the proxy process's user + system CPU seconds during the proxied run

    @property
    def cpu_ms(self) -> float:
        """Proxy CPU milliseconds per proxied request."""
        ok = len(self.proxied.latencies)
        return self.proxy_cpu_s * MS / ok if ok else float("nan")

    @property
    def proxy_rps(self) -> float:
        return len(self.proxied.latencies) / self.proxied.wall_s if self.proxied.wall_s else float("nan")

    @property
    def direct_rps(self) -> float:
        return len(self.direct.latencies) / self.direct.wall_s if self.direct.wall_s else float("nan")


@dataclass
class ProxyResults:
    cells: list[ProxyCell]
    gap_ms: float  # the engine's chunk gap in the stall test
    gap_requests: int
    gap_direct: Cell
    gap_proxied: Cell
    spread: ProxyCell  # streams at c=16 whose chunks come ``SPREAD_MS`` apart (no direct run)


async def measure(args: argparse.Namespace, engine: Child, proxy: Child) -> ProxyResults:
    counts = {1: 500, 16: 1500, 64: 2000}
    cells: list[ProxyCell] = []
    for stream in (False, True):
        for conc in (1, 16, 64):
            n = int(counts[conc] * args.scale)
            # Warm both paths (connections, JIT-less caches, the router's first scrape) off the record.
            await closed_loop(engine.port, stream=stream, concurrency=conc, requests=100, timeout_s=30)
            await closed_loop(proxy.port, stream=stream, concurrency=conc, requests=100, timeout_s=30)
            direct = await closed_loop(
                engine.port, stream=stream, concurrency=conc, requests=n, timeout_s=args.cell_timeout
            )
            cpu0 = proxy.cpu_s()
            proxied = await closed_loop(
                proxy.port, stream=stream, concurrency=conc, requests=n, timeout_s=args.cell_timeout
            )
            mode = "stream" if stream else "json"
            cells.append(ProxyCell(mode, conc, n, direct, proxied, proxy.cpu_s() - cpu0))
            sys.stderr.write(f"  done {mode} c={conc}\n")

    # Streaming chunk delivery: chunks 5 ms apart must come out 5 ms apart (no Nagle/delayed-ACK).
    gap_n = int(50 * args.scale)
    gap_direct = await closed_loop(
        engine.port, stream=True, concurrency=1, requests=gap_n, timeout_s=60, gap_ms=args.gap_ms
    )
    gap_proxied = await closed_loop(
        proxy.port, stream=True, concurrency=1, requests=gap_n, timeout_s=60, gap_ms=args.gap_ms
    )
    # A real engine's tokens arrive one by one, each a read, an SSE scan and a write of its own
    # (the cells above get theirs in a burst): streams at c=16 with their chunks spread.
    spread_n = int(counts[16] * args.scale)
    await closed_loop(proxy.port, stream=True, concurrency=16, requests=100, timeout_s=30, gap_ms=SPREAD_MS)
    cpu0 = proxy.cpu_s()
    spread = await closed_loop(
        proxy.port,
        stream=True,
        concurrency=16,
        requests=spread_n,
        timeout_s=args.cell_timeout,
        gap_ms=SPREAD_MS,
    )
    spread_cell = ProxyCell("stream", 16, spread_n, Cell(), spread, proxy.cpu_s() - cpu0)
    return ProxyResults(cells, args.gap_ms, gap_n, gap_direct, gap_proxied, spread_cell)


def render(args: argparse.Namespace, results: ProxyResults) -> list[str]:
    lines = [
        "",
        "proxy overhead — null engine (zero delay), 1 prefill-decode endpoint; "
        f"proxy pinned to CPU {args.proxy_cpu}, engine + client on CPU {args.client_cpu}",
        "",
        f"  {'mode':<10} {'conc':>4} {'reqs':>5} {'direct p50':>10} {'direct p99':>10} "
        f"{'proxy p50':>9} {'proxy p99':>9} {'added p50':>9} {'added p99':>9} {'proxy rps':>9} "
        f"{'direct rps':>10} {'CPU ms/req':>10} {'proxy CPU%':>10}",
    ]
    lines.append("  " + "-" * (len(lines[-1]) - 2))
    worst: dict[str, float] = {"added_p50_c1": 0.0, "cpu_ms": 0.0, "rps": float("inf")}
    for cell in results.cells:
        direct, proxied, conc = cell.direct, cell.proxied, cell.concurrency
        cpu_ms = cell.cpu_ms
        added50 = (proxied.pct(0.5) - direct.pct(0.5)) * MS
        added99 = (proxied.pct(0.99) - direct.pct(0.99)) * MS
        rps = cell.proxy_rps
        d50, d99 = direct.pct(0.5) * MS, direct.pct(0.99) * MS
        lines.append(
            f"  {cell.mode:<10} {conc:>4} {cell.requests:>5} {_f(d50):>10} {_f(d99):>10} "
            f"{_f(proxied.pct(0.5) * MS):>9} {_f(proxied.pct(0.99) * MS):>9} {_f(added50):>9} "
            f"{_f(added99):>9} {rps:>9.0f} {cell.direct_rps:>10.0f} "
            f"{_f(cpu_ms):>10} {100.0 * cell.proxy_cpu_s / proxied.wall_s:>9.0f}%"
            + (f"  ({proxied.errors + direct.errors} errors)" if proxied.errors + direct.errors else "")
        )
        if conc == 1:
            worst["added_p50_c1"] = max(worst["added_p50_c1"], added50)
        worst["cpu_ms"] = max(worst["cpu_ms"], cpu_ms)
        if conc == 64:
            worst["rps"] = min(worst["rps"], rps)

    gap_n = results.gap_requests
    lines += [
        "",
        f"  streaming inter-chunk gaps, engine emits a chunk every {results.gap_ms:g} ms "
        f"({gap_n} streams × {SSE_CHUNKS - 1} gaps, c=1):",
        f"  {'path':<8} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'gaps > 20 ms':>12}",
    ]
    for name, cell_ in (("direct", results.gap_direct), ("proxied", results.gap_proxied)):
        g = cell_.gaps
        lines.append(
            f"  {name:<8} {_f(cell_.pct(0.5, g) * MS, 2):>7} {_f(cell_.pct(0.99, g) * MS, 2):>7} "
            f"{_f(max(g) * MS if g else float('nan'), 2):>7} {sum(x > 0.020 for x in g):>12}"
        )
    streams_c16 = [c.cpu_ms for c in results.cells if c.mode == "stream" and c.concurrency == 16]
    bunched = streams_c16[0] if streams_c16 else float("nan")
    per_chunk = (results.spread.cpu_ms - bunched) / (SSE_CHUNKS - 1) * 1000.0
    lines.append(
        f"  proxy CPU ms per stream at c=16: {_f(results.spread.cpu_ms)} with its {SSE_CHUNKS} chunks "
        f"{SPREAD_MS:g} ms apart, {_f(bunched)} in a burst (the row above): {per_chunk:.0f} µs per chunk "
        "arriving on its own"
    )
    lines += [
        "",
        "  targets: added p50 at c=1 ≤ 0.6 ms: "
        f"{worst['added_p50_c1']:.3f} ms -> {'PASS' if worst['added_p50_c1'] <= 0.6 else 'FAIL'}; "
        f"CPU ≤ 0.4 ms/request: {worst['cpu_ms']:.3f} -> {'PASS' if worst['cpu_ms'] <= 0.4 else 'FAIL'}; "
        f"≥ 2000 req/s at c=64: {worst['rps']:.0f} -> {'PASS' if worst['rps'] >= 2000 else 'FAIL'}",
        "  (worst over json and stream; added latency is proxied minus direct on the same engine/client)",
    ]
    return lines


@dataclass
class VariantCell:
    """One (mode, concurrency) cell through several proxies; per proxy, the medians over rounds."""

    mode: str
    concurrency: int
    requests: int
    p50_ms: dict[str, float]
    p99_ms: dict[str, float]
    rps: dict[str, float]
    cpu_ms: dict[str, float]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


async def measure_variants(args: argparse.Namespace, proxies: dict[str, Child]) -> list[VariantCell]:
    """The proxied cells through each of ``proxies`` in turn, ``args.rounds`` times, rotating the
    order so no proxy always runs first (or last) in a cell."""
    counts = {1: 500, 16: 1500, 64: 2000}
    names = list(proxies)
    cells: list[VariantCell] = []
    for stream in (False, True):
        for conc in (1, 16, 64):
            n = int(counts[conc] * args.scale)
            for proxy in proxies.values():
                await closed_loop(proxy.port, stream=stream, concurrency=conc, requests=100, timeout_s=30)
            seen: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in names}
            for round_ in range(args.rounds):
                for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                    proxy = proxies[name]
                    cpu0 = proxy.cpu_s()
                    cell = await closed_loop(
                        proxy.port, stream=stream, concurrency=conc, requests=n, timeout_s=args.cell_timeout
                    )
                    cpu_ms = (proxy.cpu_s() - cpu0) / n * MS
                    seen[name].append((cell.pct(0.5) * MS, cell.pct(0.99) * MS, n / cell.wall_s, cpu_ms))
            mode = "stream" if stream else "json"
            cells.append(
                VariantCell(
                    mode,
                    conc,
                    n,
                    *({name: _median([r[i] for r in seen[name]]) for name in names} for i in range(4)),
                )
            )
            sys.stderr.write(f"  done {mode} c={conc}\n")
    return cells


def render_variants(args: argparse.Namespace, cells: list[VariantCell]) -> list[str]:
    names = list(cells[0].p50_ms) if cells else []
    lines = [
        "",
        f"tracing overhead — the same proxied cells through each proxy ({', '.join(names)}); null "
        f"engine, proxy pinned to CPU {args.proxy_cpu}; medians of {args.rounds} rounds",
        "",
    ]
    columns = [
        ("p50 ms", "p50_ms", 3),
        ("p99 ms", "p99_ms", 3),
        ("req/s", "rps", 0),
        ("CPU ms/req", "cpu_ms", 3),
    ]
    head = f"  {'mode':<7} {'conc':>4} {'reqs':>5}"
    for title, _, _ in columns:
        head += "  " + " ".join(
            f"{title + ' ' + name:>{max(len(title) + len(name) + 1, 8)}}" for name in names
        )
    lines += [head, "  " + "-" * (len(head) - 2)]
    for cell in cells:
        row = f"  {cell.mode:<7} {cell.concurrency:>4} {cell.requests:>5}"
        for title, attribute, digits in columns:
            values = getattr(cell, attribute)
            row += "  " + " ".join(
                f"{values[name]:>{max(len(title) + len(name) + 1, 8)}.{digits}f}" for name in names
            )
        lines.append(row)
    return lines


def run_variants(args: argparse.Namespace) -> list[VariantCell]:
    """``--tracing``: the null engine, then ``base`` (with ``--baseline-src``), ``off`` and ``on``."""
    proxy_cpu = None if args.proxy_cpu < 0 else args.proxy_cpu
    client_cpu = None if args.client_cpu < 0 else args.client_cpu
    engine = start_child(null_engine_main, client_cpu)
    proxies: dict[str, Child] = {}
    try:
        address = f"127.0.0.1:{engine.port}"
        if args.baseline_src:
            proxies["base"] = start_child(proxy_main, address, proxy_cpu, "", False, args.baseline_src)
        proxies["off"] = start_child(proxy_main, address, proxy_cpu, "", False)
        proxies["on"] = start_child(proxy_main, address, proxy_cpu, "", True)
        _pin(client_cpu)
        return _client_run(measure_variants(args, proxies))
    finally:
        for proxy in proxies.values():
            proxy.stop()
        engine.stop()


async def bench(args: argparse.Namespace, engine: Child, proxy: Child) -> list[str]:
    return render(args, await measure(args, engine, proxy))


def _top(profile_path: str, n: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(profile_path, stream=out)
    stats.sort_stats("tottime").print_stats(n)
    out.write("\n")
    stats.sort_stats("cumulative").print_stats(n)
    return out.getvalue()


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.proxy",
        description="Proxy overhead vs direct on a zero-delay null engine (separate processes).",
    )
    parser.add_argument("--scale", type=float, default=2.0, help="multiply requests per cell")
    parser.add_argument("--gap-ms", type=float, default=5.0, help="engine chunk gap for the stall test")
    parser.add_argument("--proxy-cpu", type=int, default=1, help="CPU to pin the proxy to (-1: no pinning)")
    parser.add_argument("--client-cpu", type=int, default=0, help="CPU for engine + client (-1: none)")
    parser.add_argument("--cell-timeout", type=float, default=120.0, help="max seconds per cell")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="cProfile the proxy and print its top N functions"
    )
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="compare proxies: base (--baseline-src), tracing off, tracing on",
    )
    parser.add_argument(
        "--baseline-src", default="", help="with --tracing: a source tree of the router to compare with"
    )
    parser.add_argument("--rounds", type=int, default=3, help="with --tracing: runs of each cell per proxy")
    return parser


def run(args: argparse.Namespace, profile_path: str = "") -> ProxyResults:
    """Start the null engine and the proxy, measure, stop them. Pins this process to
    ``--client-cpu`` (a caller that goes on afterwards restores its own affinity)."""
    proxy_cpu = None if args.proxy_cpu < 0 else args.proxy_cpu
    client_cpu = None if args.client_cpu < 0 else args.client_cpu
    engine = start_child(null_engine_main, client_cpu)
    try:
        proxy = start_child(proxy_main, f"127.0.0.1:{engine.port}", proxy_cpu, profile_path)
        try:
            _pin(client_cpu)
            return _client_run(measure(args, engine, proxy))
        finally:
            proxy.stop()
    finally:
        engine.stop()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.tracing:
        sys.stdout.write("\n".join(render_variants(args, run_variants(args))) + "\n")
        return 0
    profile_path = f"/tmp/pd-router-proxy-{os.getpid()}.prof" if args.profile else ""
    lines = render(args, run(args, profile_path))
    sys.stdout.write("\n".join(lines) + "\n")
    if profile_path and os.path.exists(profile_path):
        sys.stdout.write(f"\ncProfile of the proxy process (top {args.profile}):\n")
        sys.stdout.write(_top(profile_path, args.profile))
        os.unlink(profile_path)
    return 0


def _client_run(coro: Awaitable[T]) -> T:
    try:
        import uvloop  # optional: the cheaper the client, the cleaner the number
    except ImportError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    return uvloop.run(coro)  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
