"""Lists of names that live in two places, tied together: a name added to one and not the other
fails here, not in front of a user (a KEDA signal the chart refuses or the scaler does not know)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from router.adapters.keda.scaler import SIGNALS
from router.control import topology
from router.server.config import Role

ROOT = Path(__file__).resolve().parent.parent


def test_discovery_and_the_configuration_share_one_role_type() -> None:
    assert topology.Role is Role


def _enums_under(node: Any, key: str) -> list[list[str]]:
    found = []
    if isinstance(node, dict):
        for name, value in node.items():
            if name == key and isinstance(value, dict) and "enum" in value:
                found.append(value["enum"])
            found.extend(_enums_under(value, key))
    elif isinstance(node, list):
        for item in node:
            found.extend(_enums_under(item, key))
    return found


def test_the_charts_keda_signals_are_the_scalers() -> None:
    schema = json.loads((ROOT / "helm/pd-router/values.schema.json").read_text())
    keda = schema["properties"]["keda"]
    enums = _enums_under(keda, "signal")
    assert len(enums) == 2  # prefill and decode
    for enum in enums:
        assert sorted(enum) == sorted(SIGNALS)
