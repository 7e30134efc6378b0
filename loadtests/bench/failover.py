"""Failover between two picker replicas behind Envoy, measured: one replica stopped under load
(SIGTERM) or killed (SIGKILL), then restarted, in each ext_proc body mode.

Processes, all on 127.0.0.1:

* **engines**: two simulated vLLM engines (``simulator.engine.SimCluster``, real HTTP) in this
  process;
* **pickers**: two ``pd-router serve`` child processes (``loadtests.servers.picker``), A and B,
  ext_proc with response processing, each logging its picks with the request's id;
* **Envoy**: the example config of the body mode (``examples/envoy/full-duplex.yaml`` or
  ``buffered.yaml``) with both replicas as hosts of its ``ext_proc`` cluster (health-checked every
  second, streams retried on another replica, outlier detection) and its fail-open route pointed
  at a port nobody listens on, so a request no picker routed counts as failed;
* **Redis** (``--redis``): a ``redis-server`` per row that both pickers share (``index.redis`` with
  its defaults), as several replicas run;
* **client** (this process): open-loop streaming completions at ``--rate`` (Poisson arrivals), each
  with its own ``x-request-id``.

For each body mode × signal, with fresh pickers and Envoy: load until each replica has routed
``--warmup-picks`` requests; the signal to A; A restarted ``--restart-after-s`` after it exited;
load until the restarted A has routed ``--after-picks`` requests; the load stops (every request
answered) and both replicas' reservations are read until they are back to zero.

Columns: the requests sent; those that failed (not 200, an error event, or the stream cut), and of
those how many A had routed and was still serving at the signal (read from A's own log, which a
SIGKILL does not lose); how many requests A was serving at the signal; from the signal: until the
survivor carries all traffic (no request sent later was routed by A or failed), until Envoy took
A out (its admin, sampled every 0.1 s, and the flag saying how: ``failed_active_hc`` for a
health check, ``failed_outlier_check`` for outlier detection), until A exited; from A's restart:
its ext_proc listener open, Envoy's health check passed, its first pick; each replica's
outstanding reservations at the end.

    python -m loadtests.bench.failover                         # both modes, both signals (about a minute)
    python -m loadtests.bench.failover --modes full-duplex --signals SIGKILL --json
    python -m loadtests.bench.failover --signals SIGTERM --lame-duck-s 0 --no-retries
    python -m loadtests.bench.failover --redis                 # the replicas share one Redis

Every wait is bounded: a replica that does not route, exit or come back in time ends the run with
an error naming it. Exit code 1 when a row breaks the contract: a request failed that A was not
serving at the signal, any request failed with SIGTERM, a SIGTERM'd replica exited non-zero, or
reservations were left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import random
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from kvindex.aio import stop_task
from loadtests.servers.envoy import host_stats, in_front_of_picker, run_envoy
from loadtests.servers.picker import PickerProcess
from loadtests.servers.redis import RedisServer
from simulator.engine import EngineSpec, SimCluster, TimeModel
from simulator.workloads.client import send
from simulator.workloads.generate import WorkItem

MODES = ("full-duplex", "buffered")
SIGNALS = ("SIGTERM", "SIGKILL")
# Slow engines (a 16 ms step): an answer of 32 tokens streams for about a second, so ~20 are open
# at 20 req/s while few chunks pass through the pickers (the CPU is shared with Envoy).
ENGINE_TIME = TimeModel(speed=0.25)
HEALTHY = "healthy"  # Envoy's admin health_flags of a host in rotation


@dataclass(frozen=True)
class Scenario:
    """How one row is run (the command line's options)."""

    rate: float = 20.0  # requests per second, open loop
    max_tokens: int = 32
    warmup_picks: int = 20  # requests each replica routes before the signal
    restart_after_s: float = 3.0  # A stays down this long after it exited
    after_picks: int = 20  # requests the restarted A routes before the load stops
    lame_duck_s: float | None = None  # the pickers' shutdown.lame_duck_s (None: their default)
    retries: bool = True  # False: the ext_proc stream's retry_policy is dropped from Envoy's config
    redis: bool = False  # the replicas share a redis-server of their own per row (``index.redis``)
    seed: int = 0


@dataclass(frozen=True)
class Answer:
    request_id: str
    sent: float  # wall clock (``time.time()``): comparable with the pickers' log timestamps
    finished: float
    ok: bool
    status: int  # 0: no status (connection error, the stream cut)
    error: str


class OpenLoopLoad:
    """Requests at Poisson arrivals of ``rate`` per second until the context exits; each answer is
    kept. Exiting waits for the requests still open (each bounded by ``timeout_s``)."""

    def __init__(self, url: str, rate: float, max_tokens: int, seed: int, timeout_s: float = 30.0) -> None:
        self.url = url
        self.rate = rate
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)
        self.timeout_s = timeout_s
        self.answers: list[Answer] = []
        self._ids = itertools.count()
        self._open: set[asyncio.Task[None]] = set()
        self._arrivals: asyncio.Task[None] | None = None
        self._http: aiohttp.ClientSession | None = None

    async def _one(self, http: aiohttp.ClientSession, n: int) -> None:
        request_id = f"failover-{n}"
        words = " ".join(self.rng.choice("abcdefgh") for _ in range(200))
        body = {"model": "sim-model", "prompt": f"{n} {words}", "max_tokens": self.max_tokens, "stream": True}
        sent = time.time()
        item = WorkItem(0.0, "/v1/completions", body)
        result = await send(http, self.url, item, {"x-request-id": request_id})
        self.answers.append(Answer(request_id, sent, time.time(), result.ok, result.status, result.error))

    async def _arrive(self, http: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        at = loop.time()
        while True:
            at += self.rng.expovariate(self.rate)
            await asyncio.sleep(max(0.0, at - loop.time()))
            task = asyncio.create_task(self._one(http, next(self._ids)))
            self._open.add(task)
            task.add_done_callback(self._open.discard)

    async def __aenter__(self) -> OpenLoopLoad:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)
        self._arrivals = asyncio.create_task(self._arrive(self._http))
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._arrivals is not None and self._http is not None
        await stop_task(self._arrivals)
        if self._open:
            await asyncio.wait(self._open, timeout=self.timeout_s + 5)
        await self._http.close()


@dataclass
class Row:
    mode: str
    signal: str
    requests: int
    failed: int
    failed_in_flight_on_killed: int  # of ``failed``: routed by A and still open at the signal
    in_flight_on_killed: int  # requests A had routed and was still serving at the signal
    survivor_all_traffic_s: float  # signal → every later request routed by B
    envoy_out_s: float  # signal → Envoy's admin shows A out of rotation (sampled)
    envoy_out_by: str  # Envoy's health_flags for A then
    exited_s: float  # signal → A's process exited
    exit_code: int
    restart_to_listening_s: float  # A restarted → its ext_proc listener open (its log)
    restart_to_healthy_s: float  # A restarted → Envoy's admin shows it healthy (sampled)
    restart_to_serving_s: float  # A restarted → A's first pick
    reservations_end: dict[str, float]  # each replica's outstanding reservations once the load stopped
    failures: list[dict[str, object]] = field(default_factory=list)  # each failed request, for --json
    sharing: float = 1.0  # replicas whose reservations B counted at the signal (2: through Redis)

    @property
    def broken(self) -> list[str]:
        """What breaks the contract: SIGTERM loses nothing and exits 0; a kill loses only what A
        was serving; every reservation is given back."""
        broken = []
        if self.failed > self.failed_in_flight_on_killed:
            broken.append(f"{self.failed - self.failed_in_flight_on_killed} failed that A was not serving")
        if self.signal == "SIGTERM" and self.failed:
            broken.append(f"{self.failed} failed with SIGTERM")
        if self.signal == "SIGTERM" and self.exit_code != 0:
            broken.append(f"A exited with {self.exit_code} after SIGTERM")
        if any(self.reservations_end.values()):
            broken.append(f"reservations left: {self.reservations_end}")
        return broken


async def until(predicate: Callable[[], Awaitable[bool] | bool], timeout_s: float, what: str) -> float:
    """Poll ``predicate`` until it holds; the wall-clock time it did. TimeoutError after
    ``timeout_s``, naming ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return time.time()
        if loop.time() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}")
        await asyncio.sleep(0.05)


class EnvoyWatch:
    """Envoy's health flags for each host of the ext_proc cluster, sampled every 0.1 s while the
    context is open."""

    def __init__(self, admin: str) -> None:
        self.admin = admin
        self.samples: list[tuple[float, dict[str, str]]] = []  # (wall clock, host -> health_flags)
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                hosts = await host_stats(self.admin)
                self.samples.append(
                    (time.time(), {host: view.get("health_flags", "") for host, view in hosts.items()})
                )
            await asyncio.sleep(0.1)

    def first_out(self, host: str, after: float) -> tuple[float, str]:
        """When ``host`` was first seen out of rotation at or after ``after``, and its flags then;
        (NaN, "") if never."""
        return next(
            (
                (at, hosts[host])
                for at, hosts in self.samples
                if at >= after and hosts.get(host, HEALTHY) != HEALTHY
            ),
            (float("nan"), ""),
        )

    def first_healthy(self, host: str, after: float) -> float:
        return next(
            (at for at, hosts in self.samples if at >= after and hosts.get(host) == HEALTHY), float("nan")
        )

    async def __aenter__(self) -> EnvoyWatch:
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._task is not None
        await stop_task(self._task)  # its admin reads catch TimeoutError, which can eat a cancel


def ext_proc_filter(config: dict[str, Any]) -> dict[str, Any]:
    """The config's ext_proc filter (its ``typed_config``), to change in place."""
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return next(
        f["typed_config"] for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"
    )


@contextlib.asynccontextmanager
async def two_pickers_behind_envoy(
    mode: str, engines: list[str], workdir: Path, scenario: Scenario
) -> AsyncIterator[tuple[PickerProcess, PickerProcess, str, str]]:
    """Pickers A and B, both in rotation in an Envoy running the example config of ``mode``:
    yields (A, B, Envoy's URL, Envoy's admin URL)."""
    settings: dict[str, Any] = {}
    if scenario.lame_duck_s is not None:
        settings["shutdown"] = {"lame_duck_s": scenario.lame_duck_s}
    async with contextlib.AsyncExitStack() as stack:
        if scenario.redis:  # a fresh one per row: nothing one row's replicas wrote meets the next's
            workdir.mkdir(parents=True, exist_ok=True)
            redis = RedisServer(workdir)
            redis.start()
            stack.callback(redis.kill)
            settings["index"] = {"redis": {"url": f"redis://127.0.0.1:{redis.port}/0"}}
        a = PickerProcess(workdir / "a", engines, log_picks=True, settings=settings)
        b = PickerProcess(workdir / "b", engines, log_picks=True, settings=settings)
        config, listen, admin_port = in_front_of_picker(mode, a.port, replicas=[b.port])
        if not scenario.retries:
            del ext_proc_filter(config)["grpc_service"]["retry_policy"]
        for picker in (a, b):
            stack.push_async_callback(picker.kill)
            await picker.start()
        # Ready once Envoy's health checks passed on both replicas.
        await stack.enter_async_context(run_envoy(config, workdir, admin_port))
        yield a, b, f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{admin_port}"


async def measure(mode: str, signame: str, engines: list[str], scenario: Scenario, workdir: Path) -> Row:
    """One row: ``signame`` to replica A under load behind an Envoy in body mode ``mode``."""
    sig = signal.Signals[signame]
    async with (
        two_pickers_behind_envoy(mode, engines, workdir, scenario) as (a, b, url, admin),
        EnvoyWatch(admin) as envoy,
    ):
        load = OpenLoopLoad(url, scenario.rate, scenario.max_tokens, scenario.seed)
        async with load:
            enough = scenario.warmup_picks
            await until(lambda: min(len(a.picks()), len(b.picks())) >= enough, 60.0, "both replicas routing")
            sharing = ((await b.metrics()) or {}).get("pd_router_shared_load_replicas", 1.0)
            signalled = time.time()
            a.signal(sig)
            exit_code = await a.wait(timeout_s=120.0)
            exited = time.time()
            await asyncio.sleep(scenario.restart_after_s)  # the replica is down: what is measured
            restarted = time.time()
            await a.start()
            enough = scenario.after_picks
            await until(lambda: len(a.picks()) >= enough, 60.0, "the restarted replica routing")
        timeline = Timeline(signalled, exited, exit_code, restarted)
        reservations = {"A": await settled_reservations(a), "B": await settled_reservations(b)}
        row = summarize(mode, signame, load.answers, a, envoy, timeline, reservations)
        return dataclasses.replace(row, sharing=sharing)


async def settled_reservations(picker: PickerProcess, timeout_s: float = 30.0) -> float:
    """The replica's outstanding reservations once they are zero, or what is left after ``timeout_s``."""
    with contextlib.suppress(TimeoutError):
        await until(lambda: _released(picker), timeout_s, "reservations back to zero")
    left = await picker.reservations()
    if left is None:
        raise RuntimeError(f"{picker.host}: /metrics did not answer")
    return left


async def _released(picker: PickerProcess) -> bool:
    return await picker.reservations() == 0


@dataclass(frozen=True)
class Timeline:
    """What happened to replica A, in wall-clock seconds."""

    signalled: float
    exited: float
    exit_code: int
    restarted: float  # its new process started


def summarize(
    mode: str,
    signame: str,
    answers: Sequence[Answer],
    a: PickerProcess,
    envoy: EnvoyWatch,
    timeline: Timeline,
    reservations: dict[str, float],
) -> Row:
    signalled, restarted = timeline.signalled, timeline.restarted
    picked_by_a = {pick.request_id: pick.at for pick in a.picks(0)}  # A's run that got the signal
    by_id = {answer.request_id: answer for answer in answers}
    # In flight on A at the signal: A had picked it, and its answer was not over yet.
    on_a = {
        request_id
        for request_id, at in picked_by_a.items()
        if at <= signalled and request_id in by_id and by_id[request_id].finished > signalled
    }
    failed = [answer for answer in answers if not answer.ok]
    # The survivor carries all traffic once no later request went to A (its pick) or was lost.
    not_on_survivor = [at for at in picked_by_a.values() if at > signalled]
    not_on_survivor += [answer.sent for answer in failed if answer.sent > signalled]
    out_at, out_by = envoy.first_out(a.host, signalled)
    return Row(
        mode=mode,
        signal=signame,
        requests=len(answers),
        failed=len(failed),
        failed_in_flight_on_killed=sum(answer.request_id in on_a for answer in failed),
        in_flight_on_killed=len(on_a),
        survivor_all_traffic_s=max(not_on_survivor, default=signalled) - signalled,
        envoy_out_s=out_at - signalled,
        envoy_out_by=out_by.strip("/"),
        exited_s=timeline.exited - signalled,
        exit_code=timeline.exit_code,
        restart_to_listening_s=(a.listening_since() or float("nan")) - restarted,
        restart_to_healthy_s=envoy.first_healthy(a.host, restarted) - restarted,
        restart_to_serving_s=min(pick.at for pick in a.picks()) - restarted,
        reservations_end=reservations,
        failures=[
            {
                "request_id": answer.request_id,
                "sent_s": round(answer.sent - signalled, 3),  # from the signal
                "finished_s": round(answer.finished - signalled, 3),
                "status": answer.status,
                "error": answer.error,
                "in_flight_on_killed": answer.request_id in on_a,
            }
            for answer in failed
        ],
    )


def table(rows: Sequence[Row], scenario: Scenario) -> str:
    lines = [
        f"Two picker replicas (A, B) behind one Envoy, {scenario.rate:g} req/s open loop; A gets the "
        f"signal and is restarted {scenario.restart_after_s:g} s after it exited. Seconds; Envoy's "
        "view sampled every 0.1 s.",
        "",
        "| body mode | signal | requests | failed / of them in flight on A | in flight on A at the signal "
        "| survivor carries all traffic after | Envoy took A out after (how) | A exited after "
        "| restarted A: listening / healthy in Envoy / serving | reservations at the end (A, B) |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        reservations = ", ".join(f"{value:g}" for value in row.reservations_end.values())
        restart = " / ".join(
            f"{s:.1f}"
            for s in (row.restart_to_listening_s, row.restart_to_healthy_s, row.restart_to_serving_s)
        )
        lines.append(
            f"| {row.mode} | {row.signal} | {row.requests} | {row.failed} / {row.failed_in_flight_on_killed} "
            f"| {row.in_flight_on_killed} | {row.survivor_all_traffic_s:.1f} "
            f"| {row.envoy_out_s:.1f} ({row.envoy_out_by or '-'}) | {row.exited_s:.1f} | {restart} "
            f"| {reservations} |"
        )
    return "\n".join(lines)


async def bench(
    modes: Sequence[str], signals: Sequence[str], scenario: Scenario, workdir: Path | None
) -> list[Row]:
    specs = [EngineSpec(name, "prefill-decode", time=ENGINE_TIME) for name in ("e0", "e1")]
    rows = []
    async with SimCluster(specs) as cluster:
        engines = [cluster.address(name) for name in cluster.engines]
        with contextlib.ExitStack() as stack:
            root = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="failover-")))
            for mode, signame in itertools.product(modes, signals):
                rows.append(await measure(mode, signame, engines, scenario, root / f"{mode}-{signame}"))
    return rows


def _names(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        if not names or set(names) - set(allowed):
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}")
        return names

    return parse


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.failover",
        description=(__doc__ or "").split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join((__doc__ or "").split("\n")[1:]),
    )
    default = Scenario()
    parser.add_argument("--modes", type=_names(MODES), default=list(MODES), help="comma-separated body modes")
    parser.add_argument("--signals", type=_names(SIGNALS), default=list(SIGNALS), help="comma-separated")
    parser.add_argument("--rate", type=float, default=default.rate, help="requests per second (open loop)")
    parser.add_argument("--max-tokens", type=int, default=default.max_tokens, help="tokens per answer")
    parser.add_argument(
        "--warmup-picks", type=int, default=default.warmup_picks, help="requests each replica routes first"
    )
    parser.add_argument(
        "--restart-after-s", type=float, default=default.restart_after_s, help="A stays down this long"
    )
    parser.add_argument(
        "--after-picks", type=int, default=default.after_picks, help="requests the restarted A routes"
    )
    parser.add_argument(
        "--lame-duck-s", type=float, help="the pickers' shutdown.lame_duck_s (default: theirs)"
    )
    parser.add_argument(
        "--no-retries",
        dest="retries",
        action="store_false",
        help="drop the ext_proc stream's retry_policy from Envoy's config (a gateway that retries nothing)",
    )
    parser.add_argument(
        "--redis",
        action="store_true",
        help="the replicas share a redis-server (index.redis with its defaults), as several replicas run",
    )
    parser.add_argument("--seed", type=int, default=default.seed)
    parser.add_argument(
        "--workdir", type=Path, help="keep each process's config and log here (default: a temp dir)"
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    scenario = Scenario(
        rate=args.rate,
        max_tokens=args.max_tokens,
        warmup_picks=args.warmup_picks,
        restart_after_s=args.restart_after_s,
        after_picks=args.after_picks,
        lame_duck_s=args.lame_duck_s,
        retries=args.retries,
        redis=args.redis,
        seed=args.seed,
    )
    rows = asyncio.run(bench(args.modes, args.signals, scenario, args.workdir))
    if args.json:
        sys.stdout.write(
            orjson.dumps([asdict(row) for row in rows], option=orjson.OPT_INDENT_2).decode() + "\n"
        )
    else:
        sys.stdout.write(table(rows, scenario) + "\n")
    for row in rows:
        for broken in row.broken:
            sys.stderr.write(f"{row.mode} {row.signal}: {broken}\n")
    return 1 if any(row.broken for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
