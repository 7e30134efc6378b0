"""``pd-router sim``: simulated vLLM engines for every endpoint of a pool configuration."""

from __future__ import annotations

import argparse
import sys

from router.server.cli import config_args, config_from, run
from router.server.config import ConfigError
from simulator.cluster import link_cost_from, specs_from
from simulator.engine import TimeModel, run_sim


def command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``sim`` to the CLI (through the ``pd_router.commands`` entry points)."""
    sim = sub.add_parser("sim", help="serve simulated vLLM engines for every endpoint of a config")
    config_args(sim)
    sim.add_argument("--speed", type=float, default=1.0, help="time-model speed-up (2 = twice as fast)")
    sim.add_argument("--num-gpu-blocks", type=int, default=2048)
    sim.set_defaults(run=_run_sim)


def _run_sim(args: argparse.Namespace) -> int:
    try:
        config = config_from(args)
    except ConfigError as exc:
        print(f"pd-router: invalid configuration: {exc}", file=sys.stderr)
        return 2
    specs = specs_from(config, TimeModel(speed=args.speed), num_gpu_blocks=args.num_gpu_blocks)
    return run(run_sim(specs, link_cost_from(config.links)))
