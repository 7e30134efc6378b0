"""The core value types every layer shares: a request as the picker sees it, its limits, and one
scrape of an engine. Nothing here imports another ``router`` module (``docs/architecture.md``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def new_request_id() -> str:
    """A request's id where the client sent none: 128 random bits as 32 hex digits (a uuid4's
    ``hex`` costs several times as much, in building the UUID)."""
    return os.urandom(16).hex()


@dataclass(frozen=True, slots=True)
class SloTarget:
    """A request's latency objectives, in seconds (None: no objective on that measure), and the
    InferenceObjective they came with ("" when the headers alone set them): the picker routes to
    meet them and the SLO series count, per objective, whether they were met."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    objective: str = ""


@dataclass(slots=True)
class RouteRequest:
    """What the picker needs to know about one request; limits already enforced."""

    model: str
    prompt_tokens: int
    max_tokens: int
    block_keys: np.ndarray
    body: dict[str, Any]
    request_id: str = field(default_factory=new_request_id)
    stream: bool = False
    priority: int = 0
    subset: frozenset[str] | None = None
    prompt: str = ""  # the rendered prompt text (precise mode tokenizes it); never logged
    # A completions prompt given as token ids: the ids to route on (for a batch, the ids every one
    # of its prompts starts with), hashed as they are in precise mode. ``prompt`` is then empty.
    prompt_ids: list[int] | None = None
    precise_keys: np.ndarray | None = None  # vLLM-exact block hashes, when the index is precise
    # False for a request without a body (a GET): one pod answers it, never a prefill -> decode pair.
    prefill_leg: bool = True
    # Behind a gateway, which sends the request to the decode pod only, a pair runs only where a
    # P/D sidecar fronts that pod; the proxy runs its pairs itself (False: any decode pod).
    pairs_need_sidecar: bool = False
    # Prompt tokens one approximate (character) block stands for, once calibrated; 0: the
    # configured block size (``router/signals/calibration.py``).
    block_tokens: float = 0.0
    # ``prompt_tokens`` came from a tokenizer or from token ids, not from characters: the engines'
    # count already, so token calibration never rescales it.
    exact_tokens: bool = False
    # The model the client asked for, when a rewrite changed ``model`` (and the body's "model").
    requested_model: str | None = None
    rewrite_rule: str = ""  # the rule (or "header") that rewrote it
    # The API the body was read as (``router.request.parse.API_PATHS``: "completions", "chat",
    # "messages", "responses"; "other": not read, routed on load alone); "" without a body. The
    # adapters build the legs, and the meter reads the answer, by it.
    api: str = ""
    # The conversation as chat messages (chat, and the Messages and Responses APIs converted as
    # the engine converts them), for the model's chat template in precise mode.
    chat: list[dict[str, Any]] | None = None
    # A completions batch's prompts: each is its own engine request of up to max_tokens / prompts
    # tokens; ``prompt_tokens`` counts them all, ``prompt``/``prompt_ids`` is what they share.
    prompts: int = 1
    # The Responses API's ``previous_response_id``: the conversation vLLM stored with that answer
    # lives on the engine that gave it, so the request must go there.
    previous_response_id: str | None = None
    # The client's session (``x-session-id``) and the body's ``user``, when valid: a soft hint
    # of where the conversation's prefix is cached (``router/state/sessions.py``).
    session_id: str | None = None
    user: str | None = None
    session_id_invalid: bool = False  # an x-session-id was sent that is not one: ignored, counted
    # Per-request latency objectives (``x-slo-ttft-ms``/``x-slo-tpot-ms``, or the objective's);
    # None: routed on cost alone, exactly as before SLOs existed.
    slo: SloTarget | None = None
    # The SLO step's exploration draw, made at the request's first pick (flow control picks a held
    # request again; the draw and its objective's record are once per request).
    slo_explored: bool | None = None


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_body_bytes: int
    max_prompt_tokens: int
    default_max_tokens: int
    block_tokens: int
    chars_per_token: float
    served_model: str | None = None  # strict single-model pool: any other model name is a 404


@dataclass(frozen=True, slots=True)
class LoraInfo:
    """vLLM's ``vllm:lora_requests_info`` at its latest update: ``max_lora`` (adapter slots on the
    GPU; None when the label is not a number) and the adapters of its running and waiting requests."""

    max_lora: int | None
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()


class EngineMetrics:
    """One scrape of one engine address: every scraped feature by name (``None`` = absent), the
    cache configuration and the LoRA state (``None``: the engine has LoRA off or does not say).
    ``metrics.running`` reads ``values["running"]``."""

    __slots__ = ("block_size", "lora", "num_gpu_blocks", "values")

    def __init__(
        self,
        block_size: int | None = None,
        num_gpu_blocks: int | None = None,
        *,
        lora: LoraInfo | None = None,
        **values: float | None,
    ) -> None:
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.lora = lora
        self.values = values

    def __getattr__(self, name: str) -> float | None:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(f"no scraped feature {name!r}; see router/state/features.py") from None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EngineMetrics):
            return NotImplemented
        return (self.block_size, self.num_gpu_blocks, self.lora) == (
            other.block_size,
            other.num_gpu_blocks,
            other.lora,
        ) and {k: v for k, v in self.values.items() if v is not None} == {
            k: v for k, v in other.values.items() if v is not None
        }

    def __repr__(self) -> str:
        fields = {
            "block_size": self.block_size,
            "num_gpu_blocks": self.num_gpu_blocks,
            "lora": self.lora,
            **self.values,
        }
        return "EngineMetrics(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"

    def is_empty(self) -> bool:
        """True when no wanted metric was found (not a vLLM metrics page)."""
        return (
            self.block_size is None
            and self.num_gpu_blocks is None
            and self.lora is None
            and all(v is None for v in self.values.values())
        )
