"""``pd-router serve`` as a child process, for failover runs: real signals (SIGTERM, SIGKILL) and
restarts on the same loopback ports, so that a restarted replica comes back where Envoy's ext_proc
cluster expects it.

Each start writes a log of its own (``picker.<n>.log``, one JSON object per line). With
``log_picks`` the replica logs at ``info`` and every pick with the request's ``x-request-id`` (the
picker's debug line); a SIGKILL loses none of it, as each line is written when it happens, so which
requests a dead replica had routed can still be read afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtests.servers.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
PICK_LOGGER = "router.scheduling.picker"
CLI = "router.server.cli"
# The CLI as its entry point runs it, with the picker's debug line (one per pick) on: ``--log-level
# debug`` would also log every HPACK header the h2 library decodes.
LOGGING_PICKS = (
    "import logging, sys; from router.server import cli; "
    f"logging.getLogger({PICK_LOGGER!r}).setLevel(logging.DEBUG); sys.exit(cli.main(sys.argv[1:]))"
)


@dataclass(frozen=True)
class Pick:
    request_id: str
    at: float  # wall-clock seconds (``time.time()``), as the replica's log stamped it


class PickerProcess:
    """One picker replica on fixed ports: ext_proc (``port``), gRPC health and metrics."""

    def __init__(
        self,
        workdir: Path,
        engines: Sequence[str],
        *,
        log_picks: bool = False,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        """``engines``: the pool's ``ip:port`` addresses. ``settings``: config sections merged over
        the defaults here (e.g. ``{"shutdown": {"lame_duck_s": 8}}``)."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.port, self.health_port, self.metrics_port = free_port(), free_port(), free_port()
        self.config = workdir / "pool.yaml"
        self.log_picks = log_picks
        # Scraped fast, so a (re)started replica has fresh engine metrics, and can route, at once.
        scrape = {"interval_ms": 50, "timeout_ms": 300, "stale_after_ms": 1000, "eject_after_failures": 2}
        extproc = {"enabled": True, "port": self.port, "health_port": self.health_port, "grace_s": 5}
        pool: dict[str, Any] = {
            "model": "sim-model",
            "endpoints": [{"address": address} for address in engines],
            "scrape": scrape,
            "proxy": {"enabled": False},
            "extproc": extproc,
            "metrics": {"enabled": True, "port": self.metrics_port},
        }
        for section, values in (settings or {}).items():
            pool[section] = {**pool.get(section, {}), **values} if isinstance(values, dict) else values
        self.config.write_text(yaml.safe_dump(pool))
        self.logs: list[Path] = []  # one per start, in order
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def host(self) -> str:
        """The replica as Envoy's admin names it."""
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    async def start(self) -> None:
        self.logs.append(self.workdir / f"picker.{len(self.logs) + 1}.log")
        command = (
            ("-c", LOGGING_PICKS, "--log-level", "info")
            if self.log_picks
            else ("-m", CLI, "--log-level", "warning")
        )
        with self.logs[-1].open("wb") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *(sys.executable, *command),
                *("serve", "--config", str(self.config)),
                cwd=ROOT,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
            )

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def wait(self, timeout_s: float) -> int:
        """The exit code, once the process exited (TimeoutError after ``timeout_s``)."""
        assert self.proc is not None
        return await asyncio.wait_for(self.proc.wait(), timeout_s)

    async def kill(self) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.kill()
            await self.proc.wait()

    async def reservations(self) -> float | None:
        """``pd_router_outstanding_reservations`` as the replica exports it; None when it does not
        answer (not started, gone)."""
        families = await self.metrics()
        if families is None:
            return None
        return families.get("pd_router_outstanding_reservations", 0.0)

    async def metrics(self) -> dict[str, float] | None:
        """Every sample of the replica's ``/metrics`` by name, labelled series added up; None when
        it does not answer."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        timeout = aiohttp.ClientTimeout(total=2.0)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as http, http.get(url) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return None
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        return totals

    def events(self, start: int = -1) -> list[dict[str, Any]]:
        """The log lines of the ``start``-th run (the latest by default), parsed."""
        if not self.logs:
            return []
        events = []
        for line in self.logs[start].read_bytes().splitlines():
            with contextlib.suppress(orjson.JSONDecodeError):  # not every line is a log record
                event = orjson.loads(line)
                if isinstance(event, dict):
                    events.append(event)
        return events

    def picks(self, start: int = -1) -> list[Pick]:
        """The picks the ``start``-th run logged (the latest by default; needs ``log_picks``)."""
        return [
            Pick(event["msg"][5:].split(":", 1)[0], float(event["ts"]))
            for event in self.events(start)
            if event.get("logger") == PICK_LOGGER and event.get("msg", "").startswith("pick ")
        ]

    def listening_since(self, start: int = -1) -> float | None:
        """When the ``start``-th run's ext_proc listener opened (wall clock), if it did."""
        return next(
            (float(e["ts"]) for e in self.events(start) if e.get("msg", "").startswith("ext_proc listening")),
            None,
        )
