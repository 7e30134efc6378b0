"""``served_models``: vLLM's ``/v1/models`` as the scraper and the gate's ``model`` check read it."""

from __future__ import annotations

import orjson
import pytest

from router.http.models import served_models

# The shape vLLM answers with: the base model, then each --lora-modules adapter with its parent.
VLLM = orjson.dumps(
    {
        "object": "list",
        "data": [
            {
                "id": "Qwen/Qwen3-8B",
                "object": "model",
                "owned_by": "vllm",
                "root": "Qwen/Qwen3-8B",
                "parent": None,
            },
            {
                "id": "sql-lora",
                "object": "model",
                "owned_by": "vllm",
                "root": "/adapters/sql",
                "parent": "Qwen/Qwen3-8B",
            },
        ],
    }
)


def test_a_vllm_model_list_gives_each_id_and_its_parent() -> None:
    assert served_models(VLLM) == [("Qwen/Qwen3-8B", None), ("sql-lora", "Qwen/Qwen3-8B")]


def test_entries_without_a_text_id_are_skipped_not_fatal() -> None:
    payload = orjson.dumps({"data": [{"id": 7}, "x", {"object": "model"}, {"id": "m", "parent": ""}]})
    assert served_models(payload) == [("m", None)]


@pytest.mark.parametrize(
    "payload",
    [b"not json", b"[]", b'{"object": "list"}', b'{"data": {"id": "m"}}', b'{"data": null}', b'"data"'],
)
def test_anything_else_is_a_value_error(payload: bytes) -> None:
    with pytest.raises(ValueError, match="not an OpenAI model list"):
        served_models(payload)
