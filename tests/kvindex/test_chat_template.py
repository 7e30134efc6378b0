"""Chat prompts are rendered with the model's template before vLLM-exact hashing."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from jinja2.exceptions import SecurityError, TemplateError

from kvindex.chat_template import ChatTemplate
from kvindex.tokenize import PromptTokenizer
from kvindex.vllm_hash import HashAlgo, VllmBlockHasher
from simulator.tiny_tokenizer import train_tiny_tokenizer

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


def render(tmp_path: Path, template: str, messages: list[dict[str, object]]) -> str:
    return ChatTemplate(write_config(tmp_path, template)).render(messages)


def test_loop_controls_compile_and_render(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "{% if loop.index > 3 %}{% break %}{% endif %}[{{ m['content'] }}]{% endfor %}"
    )
    messages = [{"role": "system", "content": "s"}] + [{"role": "user", "content": c} for c in "abcd"]
    assert render(tmp_path, template, messages) == "[a][b]"


def test_strftime_now_renders_the_local_date(tmp_path: Path) -> None:
    before = datetime.now().strftime("%Y-%m-%d")
    got = render(tmp_path, "Today is {{ strftime_now('%Y-%m-%d') }}.", MESSAGES)
    after = datetime.now().strftime("%Y-%m-%d")
    assert got in (f"Today is {before}.", f"Today is {after}.")


def test_tojson_is_plain_json_not_html_escaped(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "a<b & 'c'"}]
    assert render(tmp_path, "{{ messages[0].content | tojson }}", messages) == "\"a<b & 'c'\""
    assert render(tmp_path, "{{ 'é' | tojson }}", messages) == '"é"'  # no ASCII escaping either
    assert render(tmp_path, "{{ {'b': 1, 'a': [2]} | tojson(indent=2, sort_keys=True) }}", messages) == (
        '{\n  "a": [\n    2\n  ],\n  "b": 1\n}'
    )
    assert render(tmp_path, "{{ [1, 2] | tojson(separators=(',', ':')) }}", messages) == "[1,2]"


def test_generation_blocks_render_their_body_unchanged(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}"
        "{% generation %}<{{ m['content'] }}>{% endgeneration %}"
        "{% else %}{{ m['content'] }}{% endif %}|{% endfor %}"
    )
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert render(tmp_path, template, messages) == "q|<a>|"
    # The body is a call block with its own scope, as in transformers: its set does not leak out.
    scoped = "{% set n = 1 %}{% generation %}{% set n = 2 %}{{ n }}{% endgeneration %}{{ n }}"
    assert render(tmp_path, scoped, messages) == "21"


def test_raise_exception_fails_the_render(tmp_path: Path) -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    with pytest.raises(TemplateError, match="user first"):
        render(tmp_path, template, MESSAGES)


# A template in the style of current models': user content serialized with tojson, the system turn
# skipped by a loop control, the assistant turn in a generation block, the year from strftime_now.
TOOL_TEMPLATE = """{{ bos_token }}
{% for m in messages %}
{% if m['role'] == 'system' %}{% continue %}{% endif %}
<|{{ m['role'] }}|>
{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}
{% else %}{{ m['content'] | tojson }}
{% endif %}
{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>{{ strftime_now('%Y') }}{% endif %}"""


def test_keys_of_a_chat_from_such_a_template_equal_the_keys_of_the_expected_text(tmp_path: Path) -> None:
    tokenizer_path = train_tiny_tokenizer(tmp_path / "tokenizer.json")
    hasher = VllmBlockHasher(HashAlgo.SHA256, 4)
    chat_tokenizer = PromptTokenizer(tokenizer_path, hasher, add_special_tokens=False)
    messages = [
        {"role": "system", "content": "never shown"},
        {"role": "user", "content": "the router <routes> every request & 'keeps' the prefix"},
        {"role": "assistant", "content": "the cache hits again"},
        {"role": "user", "content": "which pod stores this block?"},
    ]
    year = datetime.now().strftime("%Y")
    expected = (
        "<s>\n<|user|>\n\"the router <routes> every request & 'keeps' the prefix\"\n</s>\n"
        "<|assistant|>\nthe cache hits again</s>\n"
        '<|user|>\n"which pod stores this block?"\n</s>\n'
        f"<|assistant|>{year}"
    )
    rendered = ChatTemplate(write_config(tmp_path, TOOL_TEMPLATE)).render(messages)
    assert rendered == expected
    keys = chat_tokenizer.block_keys_sync(rendered)
    assert len(keys) >= 4
    assert np.array_equal(keys, hasher.keys(chat_tokenizer.token_ids(expected)))
    escaped = expected.replace("<routes>", "\\u003croutes\\u003e")  # what Jinja's own tojson writes
    assert not np.array_equal(keys, chat_tokenizer.block_keys_sync(escaped))
