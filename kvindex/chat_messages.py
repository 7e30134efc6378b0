"""The chat conversation an engine renders for an Anthropic Messages or OpenAI Responses body.

vLLM serves ``POST /v1/messages`` and ``POST /v1/responses`` by turning the body into chat
``messages`` and rendering them with the model's chat template, as for ``/v1/chat/completions``.
Prefix locality must hash the same text, so the router's parser (approximate blocks, and the chat
template in precise mode) and the simulated engine both take the conversation from here: a shape
converted twice in two ways would give two prompts for one body.

The conversion keeps what becomes prompt text: system text, message text, tool results and tool
calls. Images and other media are dropped (the engine's token count for them is not knowable
from the body). Malformed bodies raise ``ValueError`` with a message fit for a 400 answer.
"""

from __future__ import annotations

from typing import Any

import orjson

Message = dict[str, Any]

# Claude Code puts a per-request hash in a system block with this prefix; vLLM drops the block
# so that it does not end every conversation's shared prefix at its first block.
_BILLING_HEADER = "x-anthropic-billing-header"
# Responses API content parts that carry text, whatever the side that wrote them.
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def anthropic_messages(body: dict[str, Any]) -> list[Message]:
    """The chat messages of an Anthropic Messages body (``system``, ``messages``)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty array")
    system = _system_parts(body.get("system"), "'system'")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"'messages[{i}]' must be an object with a string 'role'")
        if message["role"] == "system":  # a system turn inside the array joins the top one
            system += _system_parts(message.get("content"), f"'messages[{i}].content'")
    chat: list[Message] = [{"role": "system", "content": "".join(system)}] if system else []
    for i, message in enumerate(messages):
        if message["role"] != "system":
            _anthropic_turn(message, i, chat)
    return chat


def _system_parts(system: Any, name: str) -> list[str]:
    if system is None or isinstance(system, str):
        return [system] if system else []
    if not isinstance(system, list):
        raise ValueError(f"{name} must be a string or an array of content blocks")
    return [
        block["text"]
        for block in system
        if isinstance(block, dict)
        and block.get("type") == "text"
        and isinstance(block.get("text"), str)
        and block["text"]
        and not block["text"].startswith(_BILLING_HEADER)
    ]


def _anthropic_turn(message: dict[str, Any], index: int, chat: list[Message]) -> None:
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        chat.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise ValueError(f"'messages[{index}].content' must be a string or an array of content blocks")
    texts: list[str] = []
    calls: list[Message] = []
    for block in content:
        if not isinstance(block, dict):
            raise ValueError(f"'messages[{index}].content' must hold content block objects")
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str) and block["text"]:
            texts.append(block["text"])
        elif kind == "tool_use":
            arguments = orjson.dumps(block.get("input") or {}).decode()
            function = {"name": str(block.get("name") or ""), "arguments": arguments}
            calls.append({"id": str(block.get("id") or ""), "type": "function", "function": function})
        elif kind == "tool_result":
            result = _tool_result_text(block.get("content"))
            if role == "user":  # the engine sees the user's tool results as tool turns before it
                chat.append(
                    {"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""), "content": result}
                )
            else:
                texts.append(f"Tool result: {result}")
    turn: Message = {"role": role}
    if texts:
        turn["content"] = texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
    if calls:
        turn["tool_calls"] = calls
    if role != "user" or "content" in turn:
        chat.append(turn)


def _tool_result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        )
    return ""


def responses_messages(body: dict[str, Any]) -> list[Message]:
    """The chat messages of an OpenAI Responses body (``instructions``, ``input``).

    A ``previous_response_id`` continues a conversation the engine stored: only the new turns
    are in the body, so they are all that can be read here.
    """
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ValueError("'instructions' must be a string")
    chat: list[Message] = [{"role": "system", "content": instructions}] if instructions else []
    given = body.get("input")
    if isinstance(given, str):
        chat.append({"role": "user", "content": given})
        return chat
    if not isinstance(given, list):
        raise ValueError("'input' must be a string or an array of input items")
    for i, item in enumerate(given):
        if not isinstance(item, dict):
            raise ValueError(f"'input[{i}]' must be an object")
        kind = item.get("type", "message")
        if kind == "message" or (kind is None and "role" in item):
            if not isinstance(item.get("role"), str):
                raise ValueError(f"'input[{i}]' must have a string 'role'")
            chat.append({"role": item["role"], "content": _responses_content(item.get("content"), i)})
        elif kind == "function_call":
            function = {"name": str(item.get("name") or ""), "arguments": str(item.get("arguments") or "")}
            call = {"id": str(item.get("call_id") or ""), "type": "function", "function": function}
            chat.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _responses_content(output, i)
            chat.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""), "content": text})
    return chat


def _responses_content(content: Any, index: int) -> str | list[Message]:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"'input[{index}].content' must be a string or an array of content parts")
    texts = [
        part["text"]
        for part in content
        if isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str)
    ]
    return texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
