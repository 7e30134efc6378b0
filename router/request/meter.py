"""What an engine's answer says happened: token counts and when the tokens came.

``ResponseMeter`` is fed the answer's body as it passes (the proxy's stream, or ext_proc's
response body messages) and keeps only what the router learns from:

* ``usage`` as the API reports it, from a JSON answer or from a streamed event that carries it:
  OpenAI's (vLLM: ``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details.cached_tokens``;
  streamed with ``stream_options.include_usage``), Anthropic's Messages API (``input_tokens``,
  ``output_tokens``, ``cache_read_input_tokens``; streamed in ``message_delta``) and the
  Responses API (``input_tokens``, ``output_tokens``, ``input_tokens_details.cached_tokens``;
  streamed in ``response.completed``, under ``response``);
* for a streamed answer, the number of SSE events that carry text (vLLM sends one per token
  unless told to batch them): OpenAI ``data:`` chunks (not a role-only opening chunk, not the
  usage chunk), Anthropic ``content_block_delta`` events, Responses ``response.*.delta`` events;
  and the times of the first and last of them.

A JSON answer is kept up to ``MAX_JSON_BYTES`` to read its usage; a larger one is counted as
having no usage, never buffered without bound. Parsing is per chunk and only where ``"usage"`` is.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import orjson

MAX_JSON_BYTES = 1 << 20
MAX_EVENT_BYTES = 1 << 16  # an SSE event cut between chunks is kept up to this, to read its usage
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_DONE = b"data: [DONE]"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


class ResponseMeter:
    """Token counts and token times of one answer."""

    __slots__ = (
        "_json",
        "_tail",
        "events",
        "first_at",
        "last_at",
        "response_id",
        "streaming",
        "strip_usage",
        "usage",
    )

    def __init__(self, streaming: bool, *, strip_usage: bool = False) -> None:
        """``strip_usage``: the router asked for the usage chunk; ``feed`` keeps it from the client."""
        self.streaming = streaming
        self.strip_usage = strip_usage
        self.events = 0  # streamed data events (≈ output tokens)
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.usage: Usage | None = None
        # The Responses API's id of this answer (``resp_...``), read with its usage: where a
        # later request naming it as ``previous_response_id`` must go.
        self.response_id: str | None = None
        self._json = bytearray()
        self._tail = b""  # an SSE event cut between two chunks

    def feed(self, chunk: bytes, now: float | None = None) -> bytes:
        """Read ``chunk``; returns what to pass on: ``chunk`` itself, or with ``strip_usage`` its
        complete events but the usage chunk (an event cut between chunks waits for its end)."""
        if not chunk:
            return chunk
        if (
            self.streaming
            and not self._tail
            and self.events == 0
            and not chunk.startswith((b"data", b":", b"event"))
        ):
            self.streaming = False  # asked to stream, answered in JSON (an engine's error): read it whole
            self.strip_usage = False
        if not self.streaming:
            if len(self._json) + len(chunk) <= MAX_JSON_BYTES:
                self._json += chunk
            else:
                self._json = bytearray(b"-")  # too large to read: no usage
            return chunk
        now = time.perf_counter() if now is None else now
        data = self._tail + chunk if self._tail else chunk
        end = data.rfind(b"\n\n")  # events end with a blank line; the rest waits for more
        cut = end + 2 if end >= 0 else 0
        complete, tail = data[:cut], data[cut:]
        self._tail = tail if len(tail) <= MAX_EVENT_BYTES else b""
        events = sum(1 for event in complete.split(b"\n\n") if _is_token(event)) if complete else 0
        if events > 0:
            self.events += events
            if self.first_at is None:
                self.first_at = now
            self.last_at = now
        if b'"usage"' not in complete:
            return complete if self.strip_usage else chunk
        # An Anthropic stream names usage twice (message_start's, then message_delta's) and one
        # chunk can hold both: every event that has it is read, the last one counts.
        kept, at = [], 0
        for match in _USAGE.finditer(complete):
            if match.start() < at:
                continue  # inside an event already read
            start = complete.rfind(b"data:", 0, match.start())
            end = complete.find(b"\n\n", match.end())
            self._read_usage(complete[start + 5 if start >= 0 else 0 : end])
            if self.strip_usage and start >= 0:  # OpenAI's usage chunk, asked for by the router
                kept.append(complete[at:start])
                at = end + 2
            else:
                at = end
        if not self.strip_usage:
            return chunk
        kept.append(complete[at:])
        return b"".join(kept)

    def rest(self) -> bytes:
        """The end of the stream: whatever ``feed`` still held back (an unterminated event)."""
        rest, self._tail = self._tail, b""
        return rest if self.strip_usage else b""

    def finish(self) -> None:
        """The answer ended: read a JSON answer's usage."""
        if not self.streaming and self._json[:1] == b"{":
            self._read_usage(bytes(self._json))
        self._json = bytearray()

    def _read_usage(self, payload: bytes) -> None:
        try:
            answer = orjson.loads(payload)
            usage = answer.get("usage")
            if usage is None and isinstance(answer.get("response"), dict):
                answer = answer["response"]  # the Responses API's closing event
                usage = answer.get("usage")
        except (orjson.JSONDecodeError, AttributeError):
            return
        if answer.get("object") == "response" and isinstance(answer.get("id"), str):
            self.response_id = answer["id"]
        # (Anthropic's message_start nests a usage of no output yet under "message": not read.)
        usage = usage_of(usage)
        if usage is not None:
            self.usage = usage

    @property
    def output_tokens(self) -> int:
        """Tokens generated: the engine's own count when it reported one, else the streamed events."""
        if self.usage is not None and self.usage.completion_tokens is not None:
            return self.usage.completion_tokens
        return self.events

    def tpot(self) -> float | None:
        """Seconds per output token after the first (streamed answers of 2+ tokens only)."""
        n = self.output_tokens
        if not self.streaming or n < 2 or self.first_at is None or self.last_at is None:
            return None
        if self.last_at <= self.first_at:
            return None
        return (self.last_at - self.first_at) / (n - 1)


def usage_of(usage: object) -> Usage | None:
    """An answer's ``usage`` object as counts (a field that is not a count reads None), in the
    OpenAI names or in the Anthropic and Responses ones (``input_tokens``, ``output_tokens``)."""
    if not isinstance(usage, dict):
        return None
    if "prompt_tokens" in usage or "completion_tokens" in usage:
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return Usage(
            _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")), _count(cached)
        )
    details = usage.get("input_tokens_details")
    cached = (
        details.get("cached_tokens") if isinstance(details, dict) else usage.get("cache_read_input_tokens")
    )
    return Usage(_count(usage.get("input_tokens")), _count(usage.get("output_tokens")), _count(cached))


def _is_token(event: bytes) -> bool:
    """An SSE event that carries generated text: a named event (Anthropic's, the Responses API's)
    that is a delta; of OpenAI's unnamed ones, not the role-only opening chunk (some servers send
    it before the prompt is computed), not the usage chunk, not ``[DONE]``."""
    if event.startswith(b"event:"):
        name = event[6 : event.find(b"\n")].strip()
        return name == b"content_block_delta" or (name.startswith(b"response.") and name.endswith(b".delta"))
    if not event.startswith(b"data:") or event.startswith(_DONE):
        return False
    if b'"choices":[]' in event:
        return False
    return not (b'"role"' in event and b'"content":""' in event)


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
