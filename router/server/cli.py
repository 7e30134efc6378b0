"""``pd-router``: serve, check-config, sidecar — plus the commands other packages add.

The composition root's entry: it builds the configuration, wires the ``App`` and owns signal
handling. ``demo`` and ``sim`` live with the simulator in ``loadtests`` and join through the
``pd_router.commands`` entry-point group (see ``pyproject.toml``), so the service never imports
the simulator: an entry point is a function that adds its sub-command to the parser and sets
``run`` (args -> exit code).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Coroutine, Sequence
from importlib.metadata import entry_points
from typing import Any

import orjson

from router.observe.series import version
from router.server.config import ConfigError, PoolConfig, load_config
from router.transport.listen import ListenError

log = logging.getLogger("router")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg (+ exc)."""

    def format(self, record: logging.LogRecord) -> str:
        event: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(event).decode()


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-router", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"pd-router {version()}")
    parser.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="default: info (demo: warning)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the proxy for a pool described in a YAML file")
    config_args(serve)
    serve.add_argument("--host", help="proxy listen address (overrides proxy.host)")
    serve.add_argument("--port", type=int, help="proxy listen port (overrides proxy.port)")
    # The Gateway API Inference Extension's flag names, so charts and habits carry over.
    serve.add_argument("--grpc-port", type=int, help="serve ext_proc on this port (enables extproc)")
    serve.add_argument("--grpc-health-port", type=int, help="gRPC health port (extproc.health_port)")
    serve.add_argument("--metrics-port", type=int, help="serve /metrics on this port (enables metrics)")
    _discovery_args(serve)

    check = sub.add_parser("check-config", help="validate a configuration file and exit")
    config_args(check)
    _discovery_args(check)

    sidecar = sub.add_parser("sidecar", help="decode-side P/D proxy for Envoy/InferencePool deployments")
    sidecar.add_argument("--decode", required=True, metavar="IP:PORT", help="the local decode engine")
    sidecar.add_argument("--host", default="127.0.0.1", help="listen address (0.0.0.0 in a pod)")
    sidecar.add_argument("--port", type=int, default=8000)
    sidecar.add_argument(
        "--allow",
        action="append",
        required=True,
        metavar="CIDR|IP|IP:PORT",
        help="prefill targets this sidecar may contact (repeatable; host names are refused)",
    )
    sidecar.add_argument("--connect-timeout-s", type=float, default=2.0)
    sidecar.add_argument("--request-timeout-s", type=float, default=600.0)
    sidecar.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    sidecar.add_argument("--drain-timeout-s", type=float, default=5.0)
    sidecar.add_argument(
        "--tls", action="store_true", help="serve HTTPS (self-signed unless --tls-cert/--tls-key)"
    )
    sidecar.add_argument("--tls-cert", metavar="PEM", help="certificate file (reloaded when it changes)")
    sidecar.add_argument("--tls-key", metavar="PEM", help="its private key file")
    sidecar.add_argument("--tls-min-version", choices=["1.2", "1.3"], default="1.2")
    sidecar.add_argument(
        "--http-client",
        choices=["builtin", "aiohttp"],
        default="builtin",
        help="the engine legs' HTTP client (builtin: HTTP/1.1 keep-alive, the cheaper)",
    )
    for entry in entry_points(group="pd_router.commands"):
        entry.load()(sub)
    return parser


def _discovery_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pool-name", help="discover from this InferencePool (kubernetes.pool_name)")
    parser.add_argument(
        "--pool-namespace", help="its namespace (kubernetes.namespace; default: $NAMESPACE, else default)"
    )
    parser.add_argument("--endpoint-selector", metavar="K=V,...", help="without an InferencePool: pod labels")
    parser.add_argument("--endpoint-target-ports", metavar="PORT,...", help="with --endpoint-selector")


def config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="pool YAML file")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a config field, e.g. slo.ttft_ms=500",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging(args.log_level or getattr(args, "default_log_level", "info"))
    if hasattr(args, "run"):  # a command from the pd_router.commands entry points
        return int(args.run(args))
    if args.command == "sidecar":
        return _run_sidecar(args)
    try:
        config = config_from(args)
        if args.command == "serve":
            config.read_secrets()  # an unreadable secret file is a configuration error, before start
    except ConfigError as exc:
        print(f"pd-router: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if args.command == "check-config":
        kube = config.kubernetes
        where = (
            f"{len(config.endpoints)} endpoints"
            if kube is None
            else f"discovered in namespace {kube.namespace!r} from "
            + (
                f"InferencePool {kube.pool_name!r}"
                if kube.pool_name
                else f"pods {kube.selector} ports {kube.target_ports}"
            )
        )
        print(f"{args.config}: ok ({where}, model {config.model!r})")
        return 0
    try:
        return run(serve(config, args))
    except ConfigError as exc:  # what only building finds: tracing on without OpenTelemetry installed
        print(f"pd-router: invalid configuration: {exc}", file=sys.stderr)
        return 2


def config_from(args: argparse.Namespace) -> PoolConfig:
    """The ``--config`` file with ``--set`` and the listener flags applied; raises ``ConfigError``."""
    return load_config(args.config, config_overrides(args))


def config_overrides(args: argparse.Namespace) -> list[str]:
    overrides = list(args.set)
    if getattr(args, "host", None):
        overrides.append(f"proxy.host={args.host}")
    if getattr(args, "port", None) is not None:
        overrides.append(f"proxy.port={args.port}")
    if getattr(args, "grpc_port", None) is not None:
        overrides += ["extproc.enabled=true", f"extproc.port={args.grpc_port}"]
    if getattr(args, "grpc_health_port", None) is not None:
        overrides.append(f"extproc.health_port={args.grpc_health_port}")
    if getattr(args, "metrics_port", None) is not None:
        overrides += ["metrics.enabled=true", f"metrics.port={args.metrics_port}"]
    return overrides + _kubernetes_overrides(args)


def _kubernetes_overrides(args: argparse.Namespace) -> list[str]:
    """The reference picker's flag names, as ``kubernetes.*`` overrides (values as YAML)."""
    out = []
    if getattr(args, "pool_name", None):
        out.append(f"kubernetes.pool_name={args.pool_name}")
    selector = getattr(args, "endpoint_selector", None)
    if selector:
        pairs = dict(item.split("=", 1) for item in selector.split(",") if "=" in item)
        out.append("kubernetes.selector=" + orjson.dumps(pairs).decode())
    ports = getattr(args, "endpoint_target_ports", None)
    if ports:
        out.append("kubernetes.target_ports=[" + ports + "]")
    namespace = getattr(args, "pool_namespace", None) or (os.environ.get("NAMESPACE") if out else None)
    if namespace:
        out.append(f"kubernetes.namespace={namespace}")
    return out


async def serve(config: PoolConfig, args: argparse.Namespace | None = None) -> int:
    """Run until SIGTERM/SIGINT, then drain: not ready, stop accepting, finish streams, exit."""
    from router.control.discovery.static import StaticDiscovery
    from router.server.app import App
    from router.server.compose import build

    discovery = None
    if config.kubernetes is None and args is not None:  # the file's endpoints, re-read on change
        discovery = StaticDiscovery(config.endpoints, path=args.config, overrides=config_overrides(args))
    # The drop-in pool series are labelled with the InferencePool's name, as the reference pickers do.
    pool_name = (config.kubernetes.pool_name if config.kubernetes else None) or "pd-router"
    app = App(build(config, discovery=discovery, pool_name=pool_name))
    return await until_signal(app, lame_duck_s=config.shutdown.lame_duck_s)


def _run_sidecar(args: argparse.Namespace) -> int:
    from router.sidecar.server import SidecarServer

    try:
        server = SidecarServer(
            args.decode,
            args.host,
            args.port,
            args.allow,
            connect_timeout_s=args.connect_timeout_s,
            request_timeout_s=args.request_timeout_s,
            max_body_bytes=args.max_body_bytes,
            drain_timeout_s=args.drain_timeout_s,
            tls=args.tls,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_min_version=args.tls_min_version,
            http_client=args.http_client,
        )
    except ValueError as exc:
        print(f"pd-router sidecar: {exc}", file=sys.stderr)
        return 2
    return run(until_signal(server))


def settle_heap() -> None:
    """Once a server has started: what starting made (modules, the compiled cost model, the
    config) lives as long as the process, so it is moved out of the collector's way and its full
    collections walk only what serving makes (``gc.freeze``)."""
    gc.freeze()


async def until_signal(server: Any, *, lame_duck_s: float = 0.0) -> int:
    """Serve until SIGTERM/SIGINT, then leave ``server``'s context (it drains in-flight streams).
    ``lame_duck_s``: first keep serving that long while ``server.lame_duck()`` reports not ready,
    so health-checking gateways move away before the listeners stop accepting (a second signal
    cuts it short)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        settle_heap()
        await stop.wait()
        if lame_duck_s > 0:
            server.lame_duck()
            log.info("shutting down: not ready, still serving for %.1fs (lame duck)", lame_duck_s)
            stop.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), lame_duck_s)
        log.info("shutting down: finishing in-flight requests")
        started = time.monotonic()
    log.info("stopped after %.1fs of draining", time.monotonic() - started)
    return 0


def run(coro: Coroutine[Any, Any, int | None]) -> int:
    """Runs ``coro`` to its exit code; a listener that cannot bind its address (in use, say) is
    one line on stderr and exit code 1, not a traceback."""
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        with contextlib.suppress(KeyboardInterrupt):
            return runner(coro) or 0
    except ListenError as exc:
        print(f"pd-router: {exc.strerror}", file=sys.stderr)
        return 1
    return 130


if __name__ == "__main__":
    sys.exit(main())
