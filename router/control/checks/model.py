"""``model``: ``GET /v1/models`` on every serving address lists the pool's model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.control.checks.base import DefaultOn, GateFailed, ReadyCheck, serving
from router.http.models import served_models

if TYPE_CHECKING:
    from router.control.gate import Gate
    from router.control.topology import GroupSpec


async def model(gate: Gate, group: GroupSpec) -> str:
    name = gate.settings.model
    for address in serving(group):
        ids = _model_ids(await gate.request("GET", address, "/v1/models", f"{address}/v1/models"))
        if name not in ids:
            raise GateFailed(f"{address} serves {sorted(ids)[:4]}, not {name!r}")
    return f"serves {name!r}"


def _model_ids(payload: bytes) -> set[str]:
    try:
        return {model for model, _ in served_models(payload)}
    except ValueError:
        raise GateFailed("/v1/models answered something other than an OpenAI model list") from None


CHECK = ReadyCheck("model", 30, DefaultOn(("kubernetes",)), model)
