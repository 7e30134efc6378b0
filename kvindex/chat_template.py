"""The model's chat template, so chat prompts hash to the tokens the engine actually computes.

vLLM renders ``messages`` with the model's Jinja chat template (``chat_template`` in
``tokenizer_config.json``, or a ``.jinja`` file) with ``add_generation_prompt=True`` and then
tokenizes the result *without* adding special tokens (the template writes BOS itself). Precise
locality must do the same, or every chat prompt's block hashes differ from block 0 on.
Rendering uses Jinja's sandbox, as Hugging Face does: templates are data, not code we trust.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplate:
    def __init__(self, path: str | Path, bos_token: str | None = None, eos_token: str | None = None) -> None:
        """``path``: a ``tokenizer_config.json`` (its ``chat_template``) or a Jinja template file."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ValueError(f"chat template {path}: cannot read: {exc.strerror}") from None
        if path.suffix == ".json":
            try:
                config = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"chat template {path}: not valid JSON: {exc}") from None
            text = config.get("chat_template")
            if not isinstance(text, str):
                raise ValueError(f"chat template {path}: no string 'chat_template' field")
            bos_token = bos_token or _token(config.get("bos_token"))
            eos_token = eos_token or _token(config.get("eos_token"))
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise
        try:
            self._template = environment.from_string(text)
        except TemplateError as exc:
            raise ValueError(f"chat template {path}: {exc}") from None
        self._specials = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text vLLM's chat endpoint would tokenize for ``messages``."""
        return self._template.render(messages=messages, add_generation_prompt=True, **self._specials)


def _token(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as {"content": "..."}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise(message: str) -> None:
    raise TemplateError(message)
