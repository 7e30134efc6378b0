"""What every scorer reads, and the two extension points that live in the pure layer.

``Candidates`` gives one aligned ``(k,)`` array per feature the pool declares
(``router/state/features.py``): ``cand.running``, ``cand.kv_usage``, … plus ``slots`` and
``cached_blocks`` (from the pool, each gathered when first read). Scraped features that were
never measured are NaN here; each scorer decides explicitly what unknown means (usually the pool's
worst known value), because treating unknown as idle herds traffic onto pods nobody has measured.

``View`` adds what one pick derives once from them (cached and uncached tokens, queue wait,
prefill time, batch, KV use, TPOT) so that cost terms stay one-liners over shared quantities.

Contracts (``CostTerm``, ``PairPicker``) are stated here and enforced once by their runner
(``matrix.pair_costs``, ``router.scheduling.picker.Picker``), not by each implementation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

import numpy as np

# A requested LoRA adapter on a candidate (``Candidates.adapter_state``), cheapest first; the
# ``lora`` term prices each, ``router/state/lora.py`` says which applies.
ADAPTER_RESIDENT = 0  # loaded (as far as the router can tell): nothing to pay
ADAPTER_FREE_SLOT = 1  # not loaded, a slot is free: one load
ADAPTER_EVICTS = 2  # not loaded, every slot taken (or how many there are is unknown): load + eviction
ADAPTER_NOT_SERVED = 3  # its /v1/models does not list the adapter: the engine would answer 404


class Candidates:
    """Features of k candidate endpoints, gathered from the pool for one pick."""

    slots: np.ndarray
    cached_blocks: np.ndarray  # longest cached prefix of this prompt, in blocks
    # The requested LoRA adapter on each candidate (an ``ADAPTER_*`` value, int8); None when the
    # request names no adapter.
    adapter_state: np.ndarray | None = None
    # ``Pool.candidates``: the pool's arrays, by feature, each gathered at ``slots`` when first read
    # (the compiled cost call reads them at ``slots`` itself, so most picks gather nothing). A pick
    # reads them before it reserves, so what it reads is the pool as it was when the pick began.
    _unread: dict[str, np.ndarray] | None = None

    def __init__(
        self, slots: np.ndarray, cached_blocks: np.ndarray | None = None, **features: np.ndarray
    ) -> None:
        self.slots = slots
        self.cached_blocks = np.zeros(len(slots), dtype=np.int32) if cached_blocks is None else cached_blocks
        # Plain instance attributes (not __getattr__): scorers read them at attribute speed.
        vars(self).update(features)

    @classmethod
    def adopt(cls, slots: np.ndarray, features: dict[str, np.ndarray]) -> Candidates:
        """Candidates whose features are ``features`` itself (taken over, not copied: the pool
        gathers a fresh dict per pick, and building the instance from it saves a third of that)."""
        cand = cls.__new__(cls)
        features["slots"] = slots
        features["cached_blocks"] = np.zeros(len(slots), dtype=np.int32)
        cand.__dict__ = features
        return cand

    @classmethod
    def of_pool(cls, slots: np.ndarray, arrays: dict[str, np.ndarray]) -> Candidates:
        """Candidates at ``slots`` of the pool's ``arrays`` (one per feature), gathered when read."""
        cand = cls.__new__(cls)
        cand.__dict__ = {
            "slots": slots,
            "cached_blocks": np.zeros(len(slots), dtype=np.int32),
            "_unread": arrays,
        }
        return cand

    def __getattr__(self, name: str) -> np.ndarray:
        # Reached for a feature not gathered yet, or one nobody declared: say which.
        unread = self._unread
        if unread is not None and name in unread:
            values = unread[name][self.slots]
            setattr(self, name, values)  # an attribute from now on: read at attribute speed
            return values
        raise AttributeError(
            f"no candidate feature {name!r}; features are declared in router/state/features.py"
        )

    def sources(self, names: tuple[str, ...]) -> list[np.ndarray]:
        """Where each feature of ``names`` is read at ``positions()``: the pool's array, or the
        gathered one."""
        unread = self._unread
        if unread is None:
            return [getattr(self, name) for name in names]
        return [unread[name] for name in names]

    def value(self, name: str, position: int) -> float:
        """Feature ``name`` of one candidate, without gathering the others'."""
        unread = self._unread
        if unread is None:
            return float(getattr(self, name)[position])
        return float(unread[name][self.slots[position]])

    def positions(self) -> np.ndarray:
        """Where each candidate sits in the arrays ``sources`` returns."""
        return np.arange(len(self.slots)) if self._unread is None else self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def take(self, index: np.ndarray) -> Candidates:
        """The subset at ``index`` (a mask or integer positions), every feature gathered."""
        for name in self._unread or ():
            getattr(self, name)  # gathered into the instance's attributes
        return Candidates(**{name: values[index] for name, values in vars(self).items() if name != "_unread"})


class RequestCtx(NamedTuple):
    """The request's numbers every term reads (a named tuple: immutable, and made on every pick at
    half a frozen dataclass's cost)."""

    prompt_tokens: int
    max_tokens: int
    block_tokens: float  # prompt tokens per cached block
    typical_prompt_tokens: float  # stand-in size for queued requests that did not come through us
    # How long a running answer is: the pool's usual max_tokens, times the share answers use
    typical_answer_tokens: float = 256.0
    # How long this request's answer is likely to be (``Pool.expected_answer_tokens``); None: its
    # max_tokens.
    expected_answer_tokens: float | None = None

    @property
    def answer_tokens(self) -> float:
        expected = self.expected_answer_tokens
        return float(self.max_tokens) if expected is None else expected


@dataclass(frozen=True, slots=True)
class EngineModel:
    """Engine speed, for turning tokens into seconds."""

    prefill_tokens_per_s: float
    decode_step_base_s: float  # fixed cost of any engine step
    pd_leg_overhead_s: float  # the extra HTTP exchange of a P/D pair's prefill leg
    decode_s_per_seq: float
    decode_s_per_kv_token: float
    kv_bytes_per_token: int
    lora_load_s: float = 0.1  # loading a LoRA adapter into a GPU slot (the engine's step waits)
    lora_evict_s: float = 0.1  # evicting one: the reload its next request pays


@dataclass(frozen=True, slots=True)
class Objectives:
    """The SLOs costs are measured against, and the exchange rates and thresholds terms share.

    The exchange rates are not derived from the SLOs: the SLOs are targets (shedding, admission,
    the replica recommendation), and a decision's quality must not hinge on how tight they are set
    (docs/quality.md, "Decisions that do not depend on the SLO targets")."""

    ttft_slo_s: float
    tpot_slo_s: float
    # Seconds of TTFT one second of predicted TPOT costs a 100-token answer (``terms/load.py``
    # scales it with the answer's length; a prefill's stall on running decodes is priced at it)
    tpot_weight: float = 10.0
    kv_penalty_s: float = 0.5  # what a unit of KV pressure costs (a pod exactly full), seconds
    kv_soft_threshold: float = 0.85  # KV use above this fraction starts to cost
    max_wait_skew_s: float = 1.0  # locality credit only within this of the least queue wait
    prefix_trust: float = 1.0  # how much of a cached prefix counts (0..1)


@dataclass(slots=True)
class View:
    """One pick's candidates with the quantities every term shares, each computed once (``derive``).

    All ``(k,)``: tokens for ``cached``/``uncached``/``used_kv``/``need_kv``, seconds for the rest.
    """

    cand: Candidates
    ctx: RequestCtx
    model: EngineModel
    objectives: Objectives
    cached: np.ndarray  # prompt tokens this candidate holds (longest cached prefix)
    wait_s: np.ndarray  # queued prefill work ahead of this prompt
    uncached: np.ndarray  # prompt tokens it would compute (locality credit after the fairness cap)
    prefill_s: np.ndarray  # time to compute them
    batch: np.ndarray  # decodes running there (scraped, or our in-flight when larger)
    used_kv: np.ndarray  # KV tokens in use
    need_kv: np.ndarray  # KV tokens this request would allocate there
    tpot_s: np.ndarray  # time per output token with this request added

    def __len__(self) -> int:
        return len(self.cand)


Side = Literal["prefill", "decode", "both"]


class CostTerm(Protocol):
    """One additive term of a route's predicted cost, per candidate, in **seconds**.

    ``side = "prefill"``: paid by the pod that computes the prompt (a pair's prefill pod, or the
    decode pod itself when there is no prefill leg); part of the predicted TTFT.
    ``side = "decode"``: paid by the decode pod whoever computed the prompt (slower tokens, KV
    pressure), in seconds of TTFT-equivalent.
    ``side = "both"``: paid by every pod the request runs on, each before its part can start (a
    LoRA adapter's load): the computing pod's as a prefill-side term, and for a pair the decode
    pod's too, after the KV arrives.

    Contract, checked by the runner: ``seconds`` returns float64 of shape ``(k,)`` (one value per
    candidate in ``view``), never NaN or -inf; ``+inf`` means the candidate cannot serve that side. Pure:
    reads ``view`` only, never the pool, never awaits. The runner multiplies by the configured
    weight (``weights.<name>``) and divides the sum by the TTFT SLO.
    """

    name: str
    side: Side

    def seconds(self, view: View) -> np.ndarray: ...


def fill_unknown(values: np.ndarray, worst: float) -> np.ndarray:
    """Replace NaN (never measured) by the pool's worst known value, or ``worst`` if none is known."""
    # One reduction for the common all-known case (np.add.reduce: .sum()'s Python wrapper costs as
    # much again on a pick's small arrays).
    if not math.isnan(np.add.reduce(values)):
        return values
    unknown = np.isnan(values)
    known = values[~unknown]
    return np.where(unknown, known.max() if known.size else worst, values)
