"""A request body (and headers) → ``RouteRequest``, with the size limits enforced.

The one parser for every adapter: the proxy, the ext_proc picker (through ``router.flow.flight``) and the
sidecar's body check all reject the same mistakes with the same ``router.request.rejections`` answer.

The request path names the API, so the body's shape is read as that API's (``API_PATHS``):

* ``/v1/completions`` (``prompt``: a string, token ids, or a batch of either) and
  ``/v1/chat/completions`` (``messages``);
* ``/v1/messages``, Anthropic's Messages API (``system``, ``messages``, ``max_tokens`` required);
* ``/v1/responses``, OpenAI's Responses API (``instructions``, ``input``, ``max_output_tokens``).

The last two become the chat conversation vLLM renders for them (``kvindex.chat_messages``), so
they are routed on the same prompt text as a chat request. Any other path is an API we do not
read: its request is routed on load alone, to one pod (``other_request``). Without a path (an
ext_proc stream whose headers had no ``:path``) the body's keys decide between completions and chat.
"""

from __future__ import annotations

import math
import os
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from kvindex.chat_messages import anthropic_messages, responses_messages
from kvindex.hashing import MAX_TOKEN_ID, estimate_tokens, text_block_keys, token_block_keys
from router.request.rejections import BadRequest, BodyTooLarge, UnknownModel
from router.request.rewrite import ModelRewrites
from router.request.types import RequestLimits, RouteRequest, new_request_id

COMPLETIONS, CHAT, MESSAGES, RESPONSES, OTHER = "completions", "chat", "messages", "responses", "other"
# The APIs whose bodies are read, by path. A path that ends with one of these (a gateway's prefix
# before it) is that API too.
API_PATHS = {
    "/v1/completions": COMPLETIONS,
    "/v1/chat/completions": CHAT,
    "/v1/messages": MESSAGES,
    "/v1/responses": RESPONSES,
}
# Where a prefill leg can hand its KV to a decode leg: vLLM answers these with the prefill's
# ``kv_transfer_params``. Its Responses API takes them in a request but never answers with them.
PD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/messages"})


def api_of(path: str | None) -> str | None:
    """The API a request path names (``API_PATHS``), ``OTHER``, or None without a path."""
    if path is None:
        return None
    path = path.split("?", 1)[0].rstrip("/")
    api = API_PATHS.get(path)
    if api is None:
        api = next((name for known, name in API_PATHS.items() if path.endswith(known)), OTHER)
    return api


def stored_response_of(path: str | None) -> str | None:
    """The stored Responses API answer a path acts on: ``/v1/responses/{id}`` (retrieve, delete)
    or ``/v1/responses/{id}/{action}`` (``cancel``, ``input_items``); vLLM keeps the answer on the
    engine that gave it. None for any other path."""
    if path is None:
        return None
    parts = path.split("?", 1)[0].rstrip("/").split("/")
    for at in (len(parts) - 1, len(parts) - 2):
        if at >= 2 and parts[at - 2 : at] == ["v1", "responses"] and 0 < len(parts[at]) <= MAX_RESPONSE_ID:
            return parts[at]
    return None


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
    objective = objective_of(headers)
    if not objective:
        return 0
    if objectives and objective in objectives:
        return objectives[objective]
    try:
        return int(objective)
    except ValueError:
        return -1 if objective.lower().endswith("sheddable") else 0


def objective_of(headers: Mapping[str, str]) -> str:
    """The InferenceObjective the request names: the first objective header that is not empty
    ("" when none); its priority and its default SLOs both come from it."""
    for name in OBJECTIVE_HEADERS:
        value = headers.get(name)
        if value:
            return value
    return ""


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


def text_batch(body: dict[str, Any]) -> list[str] | None:
    """A completions ``prompt`` that is a batch of two or more strings, else None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        return prompt
    return None


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt as one string: a completions ``prompt`` or the rendered chat ``messages``.

    A prompt of token ids has no text (``token_prompt``), a batch of strings is read by
    ``text_batch``.
    """
    if "messages" in body:
        return chat_text(body["messages"])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    raise BadRequest(
        "'prompt' must be a string, an array of strings, an array of token ids (integers from 0 to "
        f"{MAX_TOKEN_ID}) or an array of such arrays"
    )


def chat_text(messages: Any) -> str:
    """Chat ``messages`` rendered as one string.

    The rendering is ours, not the model's chat template: approximate locality only needs equal
    conversations to give equal prefixes. The simulated engine renders the same way.
    """
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array")
    parts = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"'messages[{i}]' must be an object with a string 'role'")
        parts.append(f"<|{message['role']}|>\n{_content_text(message.get('content'), i)}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def _content_text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "".join(t for t in texts if isinstance(t, str))
    raise BadRequest(f"'messages[{index}].content' must be a string or an array of parts")


def max_tokens_of(
    body: dict[str, Any],
    default: int | None,
    names: tuple[str, ...] = ("max_completion_tokens", "max_tokens"),
) -> int:
    """The first of ``names`` present, validated; else ``default`` (None: one of them is required)."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadRequest(f"'{name}' must be a positive integer, got {_shown(value)}")
        return value
    if default is None:
        raise BadRequest(f"missing required field '{names[0]}'")
    return default


def _too_deep(raw: bytes, body: dict[str, Any]) -> bool:
    """Whether ``body`` (parsed from ``raw``) is nested too deep to be encoded again."""
    # Only a body with that many brackets can be that deep: the common case costs two counts in C.
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return False
    try:
        orjson.dumps(body)
    except orjson.JSONEncodeError:
        return True
    return False


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
    if _too_deep(raw, body):
        raise BadRequest(f"request body is nested more than {MAX_JSON_DEPTH} levels deep")
    # A client-chosen remote_host would make an engine pull KV from a host of the client's choice.
    if "kv_transfer_params" in body:
        raise BadRequest("'kv_transfer_params' is set by the router, not by clients")
    return body


@dataclass(frozen=True, slots=True)
class _Prompt:
    """What a body's prompt gives the picker."""

    text: str  # the text to route on (a batch: what every prompt starts with); "" for token ids
    tokens: int  # prompt tokens the engine computes (a batch: every prompt's), exact or estimated
    ids: TokenPrompt | None = None
    chat: list[dict[str, Any]] | None = None  # the conversation, for the model's chat template
    prompts: int = 1


def _prompt(api: str, body: dict[str, Any], limits: RequestLimits) -> _Prompt:
    chat: list[dict[str, Any]] | None = None
    try:
        if api == MESSAGES:
            chat = anthropic_messages(body)
        elif api == RESPONSES:
            chat = responses_messages(body)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    if chat is not None:
        text = chat_text(chat)
    elif (ids := token_prompt(body)) is not None:
        return _Prompt("", ids.tokens, ids=ids, prompts=ids.prompts)  # counted, not estimated
    elif (batch := text_batch(body)) is not None:
        # As a batch of ids: routed on what all its prompts start with, every prompt's work counted.
        tokens = sum(estimate_tokens(p, limits.chars_per_token) for p in batch)
        # Characters, not path parts, are what text blocks are cut from.
        return _Prompt(os.path.commonprefix(batch), tokens, prompts=len(batch))  # noqa: RUF071
    else:
        text = prompt_text(body)
        if "messages" in body:
            chat = body["messages"]
    return _Prompt(text, estimate_tokens(text, limits.chars_per_token), chat=chat)


def _model_of(
    body: dict[str, Any],
    limits: RequestLimits,
    headers: Mapping[str, str],
    rewrites: ModelRewrites | None,
    default: str | None,
    adapters: Callable[[str], bool] | None = None,
) -> tuple[str, str | None, str]:
    """The body's ``model`` after any rewrite (written back into ``body``), the name the client
    asked for when a rewrite changed it, and the rule; checked against a strict pool's model,
    which also serves the LoRA adapters ``adapters`` says an engine lists.
    ``default``: the model of a body that may omit it (None: it may not)."""
    model = body.get("model")
    if model is None and default is not None:
        model = default
    elif model is None:
        raise BadRequest("missing required field 'model'")
    elif not isinstance(model, str) or not model:
        raise BadRequest(f"'model' must be a non-empty string, got {_shown(model)}")
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
    if (
        served is not None
        and model != served
        and (rewrites is None or model not in rewrites.targets)
        and not (adapters is not None and adapters(model))
    ):
        asked = f"model {_shown(model)}" + (f" (rewritten from {_shown(requested)})" if requested else "")
        raise UnknownModel(f"{asked} is not served here; this pool serves {served!r}")
    return model, requested, rule


def parse_request(
    raw: bytes,
    limits: RequestLimits,
    headers: Mapping[str, str] | None = None,
    rewrites: ModelRewrites | None = None,
    objectives: Mapping[str, int] | None = None,
    *,
    path: str | None = None,
    pool_model: str = "",
    adapters: Callable[[str], bool] | None = None,
) -> RouteRequest:
    """Validate and digest one request body (with its request headers, lower-case keys or
    case-insensitive) as the API its ``path`` names (``api_of``). ``rewrites``: model-name
    rewrites, applied to ``body`` (what goes upstream) before the served-model check;
    ``objectives``: each InferenceObjective's priority by name; ``pool_model``: the model of a
    body that may omit it (the Responses API's); ``adapters``: whether an engine serves a LoRA
    adapter of that name (a strict pool accepts those too). Raises a ``Rejection`` subclass."""
    headers = headers or {}
    if len(raw) > limits.max_body_bytes:
        raise BodyTooLarge(f"request body is {len(raw)} bytes; the limit is {limits.max_body_bytes}")
    api = api_of(path)
    if api == OTHER:
        stored = stored_response_of(path)
        return other_request(raw, limits, headers, rewrites, objectives, pool_model, adapters, stored)
    body = client_json(raw)
    if api is None:
        api = CHAT if "messages" in body else COMPLETIONS
    default = (limits.served_model or pool_model or None) if api == RESPONSES else None
    model, requested, rule = _model_of(body, limits, headers, rewrites, default, adapters)
    prompt = _prompt(api, body, limits)
    counted = str(prompt.tokens) if prompt.ids is not None else f"about {prompt.tokens}"
    if prompt.tokens > limits.max_prompt_tokens:
        raise BodyTooLarge(f"prompt is {counted} tokens; the limit is {limits.max_prompt_tokens}")
    stream = body.get("stream", False)
    # Anthropic's and the Responses API's schemas take a null stream as false; the OpenAI ones here do not.
    if stream is None and api in (MESSAGES, RESPONSES):
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    if prompt.ids is None:
        block_chars = max(1, round(limits.block_tokens * limits.chars_per_token))
        block_keys = text_block_keys(prompt.text, block_chars)
    else:
        # No tokenizer needed: blocks of exactly block_tokens ids, as in vLLM's own index.
        block_keys = token_block_keys(prompt.ids.ids, limits.block_tokens)
    raw_session = headers.get(SESSION_HEADER)
    session_id = _session_key(raw_session)
    if api == MESSAGES:
        max_tokens = max_tokens_of(body, None, ("max_tokens",))  # required by the Messages API
    elif api == RESPONSES:
        max_tokens = max_tokens_of(body, limits.default_max_tokens, ("max_output_tokens",))
    else:
        max_tokens = max_tokens_of(body, limits.default_max_tokens)
    return RouteRequest(
        model=model,
        prompt_tokens=prompt.tokens,
        # A batch's completions all run on the pod chosen: its KV and decode work are all of them.
        max_tokens=max_tokens * prompt.prompts,
        block_keys=block_keys,
        body=body,
        request_id=headers.get("x-request-id") or new_request_id(),
        stream=stream,
        priority=priority_of(headers, objectives),
        prompt=prompt.text,
        prompt_ids=None if prompt.ids is None else prompt.ids.ids,
        # A P/D pair only where the engine hands a prefill's KV over for this one prompt: a
        # prefill answer carries one kv_transfer_params, so a batch is computed where it decodes.
        prefill_leg=api != RESPONSES and prompt.prompts == 1,
        exact_tokens=prompt.ids is not None,
        requested_model=requested,
        rewrite_rule=rule,
        api=api,
        chat=prompt.chat,
        prompts=prompt.prompts,
        previous_response_id=_previous_response(body) if api == RESPONSES else None,
        session_id=session_id,
        user=_session_key(body.get("user")),
        session_id_invalid=raw_session is not None and session_id is None,
    )


SESSION_HEADER = "x-session-id"
MAX_SESSION_ID = 128


def _session_key(value: object) -> str | None:
    """A session id (or ``user``) the router keys on: 1-128 visible ASCII characters. Anything else
    is ignored rather than refused: the id only hints where a cache is, the request is fine."""
    if isinstance(value, str) and 0 < len(value) <= MAX_SESSION_ID and all("!" <= c <= "~" for c in value):
        return value
    return None


MAX_RESPONSE_ID = 256  # an id the router keeps (and shares through Redis) as a key


def _previous_response(body: dict[str, Any]) -> str | None:
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not 0 < len(previous) <= MAX_RESPONSE_ID):
        raise BadRequest(
            f"'previous_response_id' must be a string of 1-{MAX_RESPONSE_ID} characters, "
            f"got {_shown(previous)}"
        )
    return previous


def other_request(
    raw: bytes,
    limits: RequestLimits,
    headers: Mapping[str, str],
    rewrites: ModelRewrites | None,
    objectives: Mapping[str, int] | None,
    pool_model: str,
    adapters: Callable[[str], bool] | None = None,
    stored_response: str | None = None,
) -> RouteRequest:
    """A request to an API whose body we do not read (embeddings, scoring, audio, ...): routed on
    load alone, to one pod, its body passed on as it came. ``stored_response``: the Responses API
    answer the path acts on (``stored_response_of``; ``/cancel`` has no body): routed to the pod
    that gave it (``previous_response_id``), and never refused for naming no model.

    Never refused for its shape. A strict pool (``strict_model``) still refuses what it exists
    to refuse: a body that names another model, or none it can read (a body that is not a JSON
    object naming its ``model``), since it cannot tell which model such a request is for.
    """
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        body = None
    # Too deep to encode again (as a model rewrite would): not a body we can read either.
    if not isinstance(body, dict) or _too_deep(raw, body):
        if limits.served_model is not None and stored_response is None:
            raise BadRequest(
                "this pool serves one model only (strict_model): a request to this path needs a "
                "JSON object body with its 'model'"
            )
        body = {}
    elif "kv_transfer_params" in body:  # the same rule as for every body: only the router sets them
        raise BadRequest("'kv_transfer_params' is set by the router, not by clients")
    named = body.get("model")
    if (isinstance(named, str) and named) or (limits.served_model is not None and stored_response is None):
        model, requested, rule = _model_of(body, limits, headers, rewrites, None, adapters)
    else:  # a lenient pool does not need the name: whatever its shape, the request goes on
        model, requested, rule = pool_model, None, ""
    # Its prompt is unknown: the body's size, in tokens, stands for the work it brings.
    tokens = min(limits.max_prompt_tokens, max(1, math.ceil(len(raw) / limits.chars_per_token)))
    limit = next(
        (
            v
            for v in (body.get(n) for n in ("max_completion_tokens", "max_tokens", "max_output_tokens"))
            if isinstance(v, int) and not isinstance(v, bool) and v >= 1
        ),
        1,
    )
    return RouteRequest(
        model=model,
        prompt_tokens=tokens,
        max_tokens=limit,
        block_keys=_NO_BLOCKS,
        body=body,
        request_id=headers.get("x-request-id") or new_request_id(),
        stream=body.get("stream") is True,
        priority=priority_of(headers, objectives),
        prefill_leg=False,
        requested_model=requested,
        rewrite_rule=rule,
        api=OTHER,
        previous_response_id=stored_response,
    )


_NO_BLOCKS = np.empty(0, dtype=np.uint64)


def headers_only_request(
    model: str, headers: Mapping[str, str], subset: frozenset[str] | None, path: str | None = None
) -> RouteRequest:
    """A request without a body (``GET /v1/models``): any one pod answers it, no prompt to score;
    one for a stored Responses API answer (``GET /v1/responses/{id}``), the pod that gave it."""
    return RouteRequest(
        model=model,
        prompt_tokens=1,
        max_tokens=1,
        block_keys=_NO_BLOCKS,
        body={},
        request_id=headers.get("x-request-id") or new_request_id(),
        subset=subset,
        prefill_leg=False,
        previous_response_id=stored_response_of(path),
    )
