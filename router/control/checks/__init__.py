"""The ready gate's checks, one module each: adding a check is adding its module here.

A check module declares ``CHECK = ReadyCheck(name, order, default_on, run)``: ``run(gate, group)``
returns a detail for the debug view or raises ``GateFailed`` naming what differed; ``order`` places
it in the default sequence; ``default_on`` says where it runs when ``gate.checks`` is not set.
``CHECKS`` collects them in that order; the configuration's accepted names and defaults, and the
gate, read them from here.
"""

from __future__ import annotations

import importlib
import pkgutil

from router.control.checks.base import ReadyCheck


def _discover() -> dict[str, ReadyCheck]:
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.name != "base":
            found.append(importlib.import_module(f"{__name__}.{info.name}").CHECK)
    return {check.name: check for check in sorted(found, key=lambda check: check.order)}


CHECKS: dict[str, ReadyCheck] = _discover()
