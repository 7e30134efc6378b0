"""OpenAI request body (and headers) → ``RouteRequest``, with the size limits enforced.

The one parser for every adapter: the proxy, the ext_proc picker (through ``router.flow.flight``) and the
sidecar's body check all reject the same mistakes with the same ``router.request.rejections`` answer.
"""

from __future__ import annotations

import reprlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from kvindex.hashing import MAX_TOKEN_ID, estimate_tokens, text_block_keys, token_block_keys
from router.request.rejections import BadRequest, BodyTooLarge, UnknownModel
from router.request.rewrite import ModelRewrites
from router.request.types import RequestLimits, RouteRequest

COMPLETION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# orjson encodes at most this many nested arrays/objects (it reads up to 1024), and the proxy
# re-encodes bodies (the usage request of a streamed answer, both legs of a P/D pair): a deeper
# body is refused at parse, whichever adapter it came through, instead of failing half-way.
MAX_JSON_DEPTH = 254


# Client values quoted in error messages are cut short: an answer (or a log line) never echoes
# megabytes of the client's own body back.
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = _SHOWN.maxlong = 80
_SHOWN.maxlist = _SHOWN.maxdict = 4
_SHOWN.maxlevel = 2


def _shown(value: object) -> str:
    """``repr(value)``, shortened for an error message."""
    return _SHOWN.repr(value)


PRIORITY_HEADER = "x-pd-router-priority"
OBJECTIVE_HEADERS = ("x-gateway-inference-objective", "x-llm-d-inference-objective")


def priority_of(headers: Mapping[str, str], objectives: Mapping[str, int] | None = None) -> int:
    """Priority from ``x-pd-router-priority`` (an integer) or an objective header; < 0 is sheddable.

    An objective header names an InferenceObjective: its priority in ``objectives`` (the cluster's
    objects, or the file's ``objectives``), else a number taken as the priority itself, else a
    name ending in ``sheddable`` (``batch-sheddable``) counts as -1 and any other as the default 0.
    """
    value = headers.get(PRIORITY_HEADER)
    if value is not None:
        try:
            return int(value)
        except ValueError:
            raise BadRequest(f"header {PRIORITY_HEADER} must be an integer, got {_shown(value)}") from None
    for name in OBJECTIVE_HEADERS:
        objective = headers.get(name)
        if objective is not None:
            if objectives and objective in objectives:
                return objectives[objective]
            try:
                return int(objective)
            except ValueError:
                return -1 if objective.lower().endswith("sheddable") else 0
    return 0


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    """A completions ``prompt`` given as token ids, which the engine takes as they are."""

    ids: list[int]  # what to route on: the prompt, or the ids every prompt of a batch starts with
    tokens: int  # prompt tokens the engine computes: every prompt's, for a batch
    prompts: int = 1  # a batch's prompts: each gets its own completion of up to max_tokens


def token_prompt(body: dict[str, Any]) -> TokenPrompt | None:
    """The completions ``prompt`` as token ids (an array of ids, or a batch: an array of such
    arrays), or None when it is not given as ids.

    A batch is routed on the ids all its prompts start with: the engine runs each prompt as a
    request of its own, so the blocks of that shared prefix are the ones every prompt reuses
    where they are cached; routing on the first prompt alone could favour an engine that helps
    only that one.
    """
    if "messages" in body:
        return None
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return None
    if _token_ids(prompt):
        return TokenPrompt(prompt, len(prompt))
    if not all(isinstance(p, list) and p and _token_ids(p) for p in prompt):
        return None
    return TokenPrompt(_common_prefix(prompt), sum(map(len, prompt)), len(prompt))


def _token_ids(values: list[Any]) -> bool:
    # type(), not isinstance(): JSON true is a bool, never a token id.
    return all(type(v) is int for v in values) and min(values) >= 0 and max(values) <= MAX_TOKEN_ID


def _common_prefix(prompts: list[list[int]]) -> list[int]:
    first = prompts[0]
    n = min(map(len, prompts))
    for other in prompts[1:]:
        n = next((i for i in range(n) if first[i] != other[i]), n)
    return first[:n]


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt as one string: a completions ``prompt`` or the rendered chat ``messages``.

    The rendering is ours, not the model's chat template: approximate locality only needs equal
    conversations to give equal prefixes. The simulated engine renders the same way. A prompt of
    token ids has no text (``token_prompt``).
    """
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array")
        parts = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadRequest(f"'messages[{i}]' must be an object with a string 'role'")
            parts.append(f"<|{message['role']}|>\n{_content_text(message.get('content'), i)}\n")
        parts.append("<|assistant|>\n")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    raise BadRequest(
        "'prompt' must be a string, a one-string array, an array of token ids (integers from 0 to "
        f"{MAX_TOKEN_ID}) or an array of such arrays"
    )


def _content_text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "".join(t for t in texts if isinstance(t, str))
    raise BadRequest(f"'messages[{index}].content' must be a string or an array of parts")


def max_tokens_of(body: dict[str, Any], default: int) -> int:
    """``max_completion_tokens`` or ``max_tokens`` (the first present), validated; else ``default``."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadRequest(f"'{name}' must be a positive integer, got {_shown(value)}")
        return value
    return default


def client_json(raw: bytes) -> dict[str, Any]:
    """A client's body as a JSON object, with no field only the router may set."""
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    # Only a body with that many brackets can be that deep: the common case costs two counts in C.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        try:
            orjson.dumps(body)
        except orjson.JSONEncodeError:
            raise BadRequest(f"request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    # A client-chosen remote_host would make an engine pull KV from a host of the client's choice.
    if "kv_transfer_params" in body:
        raise BadRequest("'kv_transfer_params' is set by the router, not by clients")
    return body


def parse_request(
    raw: bytes,
    limits: RequestLimits,
    headers: Mapping[str, str] | None = None,
    rewrites: ModelRewrites | None = None,
    objectives: Mapping[str, int] | None = None,
) -> RouteRequest:
    """Validate and digest one completions/chat body (with its request headers, lower-case keys
    or case-insensitive). ``rewrites``: model-name rewrites, applied to ``body`` (what goes
    upstream) before the served-model check; ``objectives``: each InferenceObjective's priority
    by name. Raises a ``Rejection`` subclass."""
    headers = headers or {}
    if len(raw) > limits.max_body_bytes:
        raise BodyTooLarge(f"request body is {len(raw)} bytes; the limit is {limits.max_body_bytes}")
    body = client_json(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("missing required field 'model'")
    requested, rule = None, ""
    if rewrites is not None:
        try:
            rewrite = rewrites.choose(model, headers)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if rewrite is not None:
            requested, model, rule = model, rewrite.target, rewrite.rule
            body["model"] = model
    served = limits.served_model
    if served is not None and model != served and (rewrites is None or model not in rewrites.targets):
        asked = f"model {_shown(model)}" + (f" (rewritten from {_shown(requested)})" if requested else "")
        raise UnknownModel(f"{asked} is not served here; this pool serves {served!r}")
    ids = token_prompt(body)
    if ids is None:
        text = prompt_text(body)
        prompt_tokens = estimate_tokens(text, limits.chars_per_token)
        counted = f"about {prompt_tokens}"
    else:
        text, prompt_tokens = "", ids.tokens  # counted, not estimated
        counted = str(prompt_tokens)
    if prompt_tokens > limits.max_prompt_tokens:
        raise BodyTooLarge(f"prompt is {counted} tokens; the limit is {limits.max_prompt_tokens}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    if ids is None:
        block_keys = text_block_keys(text, max(1, round(limits.block_tokens * limits.chars_per_token)))
    else:
        # No tokenizer needed: blocks of exactly block_tokens ids, as in vLLM's own index.
        block_keys = token_block_keys(ids.ids, limits.block_tokens)
    return RouteRequest(
        model=model,
        prompt_tokens=prompt_tokens,
        # A batch's completions all run on the pod chosen: its KV and decode work are all of them.
        max_tokens=max_tokens_of(body, limits.default_max_tokens) * (1 if ids is None else ids.prompts),
        block_keys=block_keys,
        body=body,
        request_id=headers.get("x-request-id") or uuid.uuid4().hex,
        stream=stream,
        priority=priority_of(headers, objectives),
        prompt=text,
        prompt_ids=None if ids is None else ids.ids,
        exact_tokens=ids is not None,
        requested_model=requested,
        rewrite_rule=rule,
    )


_NO_BLOCKS = np.empty(0, dtype=np.uint64)


def headers_only_request(
    model: str, headers: Mapping[str, str], subset: frozenset[str] | None
) -> RouteRequest:
    """A request without a body (``GET /v1/models``): any one pod answers it, no prompt to score."""
    return RouteRequest(
        model=model,
        prompt_tokens=1,
        max_tokens=1,
        block_keys=_NO_BLOCKS,
        body={},
        request_id=headers.get("x-request-id") or uuid.uuid4().hex,
        subset=subset,
        prefill_leg=False,
    )
