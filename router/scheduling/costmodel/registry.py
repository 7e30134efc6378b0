"""Cost terms by name: ``weights.<name>`` in the configuration selects ``terms/<name>.py``.

A scorer module offers its term through a ``term()`` function (no arguments: a term reads what it
needs from the ``View``). Nothing registers at import time: a name is resolved when the
configuration is loaded, and an unknown one is a configuration error that says what was looked for.
"""

from __future__ import annotations

import importlib
import re

from router.scheduling.costmodel.view import CostTerm

# Weights that tune the cost model itself rather than add a term.
MODEL_WEIGHTS = frozenset({"prefix", "link"})
# The built-in terms and their default weights, in the order they are summed.
DEFAULT_WEIGHTS = {
    "queue": 1.0,
    "prefill": 1.0,
    "interference": 1.0,
    "load": 1.0,
    "kv": 1.0,
    # Half the seconds its formula counts: at 1, prefill pods decoded too little where the decode
    # pods were the bottleneck (docs/quality.md, "The absorb term at half weight").
    "absorb": 0.5,
    "lora": 1.0,
    "step": 1.0,
}
# Who pays a term (``view.CostTerm``).
_SIDES = ("prefill", "decode", "both")
_NAME = re.compile(r"[a-z][a-z0-9_]*")


def load_term(name: str) -> CostTerm:
    """The term ``name`` from ``terms/<name>.py``; ``ValueError`` saying why when there is none."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a scorer name (lower-case letters, digits, _)")
    module_name = f"router.scheduling.costmodel.terms.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise ValueError(
            f"no scorer {name!r}: expected a module {module_name} with a term() function"
        ) from None
    factory = getattr(module, "term", None)
    if not callable(factory):
        raise ValueError(f"scorer module {module_name} has no term() function")
    term = factory()
    if getattr(term, "name", None) != name or getattr(term, "side", None) not in _SIDES:
        raise ValueError(
            f"{module_name}.term() must return a term named {name!r} with side {', '.join(_SIDES)}"
        )
    return term
