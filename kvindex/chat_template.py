"""The model's chat template, so chat prompts hash to the tokens the engine actually computes.

vLLM renders ``messages`` with the model's Jinja chat template (``chat_template`` in
``tokenizer_config.json``, or a ``.jinja`` file) with ``add_generation_prompt=True`` and then
tokenizes the result *without* adding special tokens (the template writes BOS itself). Precise
locality must do the same, or every chat prompt's block hashes differ from block 0 on.

The template must also see the same Jinja environment as in Hugging Face transformers, which vLLM
renders with: a sandbox (templates are data, not code we trust) with ``trim_blocks`` and
``lstrip_blocks``, ``{% break %}``/``{% continue %}``, a ``{% generation %}`` block (transformers
uses it to mark assistant text for training masks; rendering leaves its body unchanged), the
globals ``raise_exception`` and ``strftime_now``, and a ``tojson`` filter that is plain
``json.dumps`` without ASCII escaping. Jinja's own ``tojson`` escapes ``<``, ``>``, ``&`` and ``'``
for HTML (``\\u003c``...), which would change the prompt text, and so every block hash after it,
for any template that serializes tool schemas or message content.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import Macro
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
        try:
            self._template = chat_environment().from_string(text)
        except TemplateError as exc:
            raise ValueError(f"chat template {path}: {exc}") from None
        self._specials = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text vLLM's chat endpoint would tokenize for ``messages``."""
        return self._template.render(messages=messages, add_generation_prompt=True, **self._specials)


def chat_environment() -> ImmutableSandboxedEnvironment:
    """A new Jinja environment that renders chat templates as transformers does (module docstring)."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise
    environment.globals["strftime_now"] = _strftime_now
    return environment


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged.

    The body runs as a call block (a macro), as in transformers, so a ``{% set %}`` inside it does
    not leak into the enclosing scope there either.
    """

    tags = {"generation"}  # noqa: RUF012 - Jinja reads it from the class, never mutates it

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body", []), [], [], body).set_lineno(lineno)

    def _body(self, caller: Macro) -> str:
        return str(caller())


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


# The parameter keeps transformers' name, so a template calling strftime_now(format=...) works too.
def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _token(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as {"content": "..."}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise(message: str) -> None:
    raise TemplateError(message)
