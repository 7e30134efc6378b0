"""Chat prompts are rendered with the model's template before vLLM-exact hashing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from jinja2.exceptions import SecurityError
from tiny_tokenizer import train_tiny_tokenizer

from kvindex.chat_template import ChatTemplate
from kvindex.tokenize import PromptTokenizer
from kvindex.vllm_hash import HashAlgo, VllmBlockHasher

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


def write_config(tmp_path: Path, template: str = TEMPLATE) -> Path:
    path = tmp_path / "tokenizer_config.json"
    path.write_text(
        json.dumps({"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"})
    )
    return path


def test_renders_like_the_engine_with_the_generation_prompt(tmp_path: Path) -> None:
    template = ChatTemplate(write_config(tmp_path))
    assert template.render(MESSAGES) == "<s><|system|>be brief</s><|user|>hello there</s><|assistant|>"


def test_a_jinja_file_works_too_and_special_tokens_can_be_given(tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert ChatTemplate(path, bos_token="[B]").render(MESSAGES[:1]) == "[B]<|system|>be brief<|assistant|>"


def test_template_text_is_sandboxed(tmp_path: Path) -> None:
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(SecurityError):
        ChatTemplate(write_config(tmp_path, evil)).render(MESSAGES)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),
        ("{not json", "not valid JSON"),
        ('{"bos_token": "<s>"}', "no string 'chat_template'"),
    ],
)
def test_bad_files_name_the_path_and_the_problem(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "tokenizer_config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        ChatTemplate(path)


def test_keys_of_a_chat_equal_the_tokens_of_its_rendering_without_added_specials(tmp_path: Path) -> None:
    tokenizer_path = train_tiny_tokenizer(tmp_path / "tokenizer.json")
    hasher = VllmBlockHasher(HashAlgo.SHA256, 4)
    chat_tokenizer = PromptTokenizer(tokenizer_path, hasher, add_special_tokens=False)
    rendered = ChatTemplate(write_config(tmp_path)).render(MESSAGES * 4)
    ids = chat_tokenizer.token_ids(rendered)
    assert np.array_equal(chat_tokenizer.block_keys_sync(rendered), hasher.keys(ids))
    with_specials = PromptTokenizer(tokenizer_path, hasher, add_special_tokens=True)
    assert with_specials.token_ids(rendered) != ids  # the template's own BOS is not doubled


async def test_the_router_hashes_chat_requests_through_the_template_and_only_then(tmp_path: Path) -> None:
    from router.app import App
    from router.config import parse_config
    from router.request import RequestLimits, parse_request

    tokenizer = str(train_tiny_tokenizer(tmp_path / "tokenizer.json"))
    endpoints = [{"address": "127.0.0.1:9"}]
    chat = {"model": "m", "messages": MESSAGES * 8}
    limits = RequestLimits(1 << 20, 1 << 20, 16, 16, 4.0)
    route = parse_request(json.dumps(chat).encode(), limits)

    without = App(
        parse_config({"model": "m", "endpoints": endpoints, "index": {"precise": {"tokenizer": tokenizer}}})
    )
    assert await without.prepare(route) is None and route.precise_keys is None  # no template: no guessing

    precise = {"tokenizer": tokenizer, "chat_template": str(write_config(tmp_path))}
    app = App(parse_config({"model": "m", "endpoints": endpoints, "index": {"precise": precise}}))
    await app.prepare(route)
    rendered = ChatTemplate(write_config(tmp_path)).render(MESSAGES * 8)
    assert route.precise_keys is not None and len(route.precise_keys) > 2
    assert np.array_equal(route.precise_keys, app.chat_tokenizer.block_keys_sync(rendered))
