"""An engine's ``GET /v1/models`` answer: the OpenAI model list vLLM serves, each entry an ``id``
and, for a LoRA adapter, its base model as ``parent``. Read by the scraper (which adapters an
engine serves) and by the ready gate's ``model`` check (which models it serves)."""

from __future__ import annotations

import orjson


def served_models(payload: bytes) -> list[tuple[str, str | None]]:
    """``(id, parent)`` of every entry with a text ``id`` (``parent`` None for a base model);
    ``ValueError`` when the payload is not an OpenAI model list."""
    try:
        data = orjson.loads(payload)["data"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise ValueError("not an OpenAI model list (no JSON object with a data list)") from None
    if not isinstance(data, list):
        raise ValueError("not an OpenAI model list (data is not a list)")
    return [
        (entry["id"], entry.get("parent") or None)
        for entry in data
        if isinstance(entry, dict) and isinstance(entry.get("id"), str)
    ]
