"""Fixtures from ``tests/`` (Envoy and redis-server launchers) for the benchmarks, loaded by path.

``tests/`` is not a package on the benchmarks' path; loading its files keeps one launcher per
server for both the suite and the benchmarks.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parent.parent / "tests"


@functools.cache
def tests_module(name: str) -> ModuleType:
    """``tests/<name>.py`` as a module (loaded once)."""
    spec = importlib.util.spec_from_file_location(f"pd_router_tests_{name}", TESTS / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load tests/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
