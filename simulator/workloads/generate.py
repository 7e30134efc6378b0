"""Seeded request workloads: shared-prefix (many users, few system prompts), multi-turn chat, and
phased traffic whose rate and request shape change over time (ramps, bursts, periodic load).

A workload is a list of ``WorkItem`` with arrival offsets (Poisson at ``rate`` requests/s), so two
policies can be fed exactly the same requests at exactly the same times.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

_WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
    "amber",
    "basil",
    "cedar",
    "dune",
    "ember",
    "fjord",
]


@dataclass(slots=True)
class WorkItem:
    at_s: float  # arrival offset from the start of the run
    path: str
    body: dict[str, Any]
    session: int = 0  # conversation id (multi-turn), or prefix group (shared-prefix)
    turn: int = 0
    # Request headers of its own (per-request SLOs), and its class in the results ("": none).
    headers: dict[str, str] = field(default_factory=dict)
    tag: str = ""


@dataclass(slots=True)
class Workload:
    name: str
    items: list[WorkItem] = field(default_factory=list)


def text(rng: random.Random, tokens: int, chars_per_token: float = 4.0) -> str:
    """About ``tokens`` tokens of words (``chars_per_token`` characters each on average)."""
    target = int(tokens * chars_per_token)
    words: list[str] = []
    size = 0
    while size < target:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:target]


def _arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def shared_prefix(
    n_requests: int,
    *,
    n_prefixes: int = 4,
    prefix_tokens: int = 1024,
    suffix_tokens: int = 64,
    max_tokens: int = 32,
    rate: float = 20.0,
    model: str = "sim-model",
    seed: int = 0,
) -> Workload:
    """Few long system prompts shared by many short user questions (RAG / agents)."""
    rng = random.Random(seed)
    prefixes = [text(rng, prefix_tokens) for _ in range(n_prefixes)]
    items = []
    for at in _arrivals(rng, n_requests, rate):
        group = rng.randrange(n_prefixes)
        prompt = prefixes[group] + "\nQuestion: " + text(rng, suffix_tokens)
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        items.append(WorkItem(at, "/v1/completions", body, session=group))
    return Workload("shared-prefix", items)


def multi_turn(
    n_sessions: int,
    *,
    turns: int = 4,
    system_tokens: int = 256,
    user_tokens: int = 128,
    answer_tokens: int = 64,
    rate: float = 10.0,
    model: str = "sim-model",
    seed: int = 0,
    phases: Sequence[Phase] | None = None,
) -> Workload:
    """Chat sessions whose every turn resends the whole conversation so far.

    Turns of one session arrive in order, ``turns`` apart on the session's own clock; the
    assistant's earlier answers are fixed text so the workload does not depend on the engine.
    ``phases`` (bursty chat): sessions start at their request rates ÷ ``turns`` instead of at
    ``rate`` ÷ ``turns``, the phases repeated as a cycle (``phase_arrivals``); only their durations
    and rates are used. ``rate`` still sets the pace of turns within a session.
    """
    rng = random.Random(seed)
    items = []
    if phases is None:
        starts = _arrivals(rng, n_sessions, rate / turns)
    else:
        starts = phase_arrivals(rng, n_sessions, phases, scale=1.0 / turns)
    for session, start in enumerate(starts):
        messages: list[dict[str, str]] = [{"role": "system", "content": text(rng, system_tokens)}]
        at = start
        for turn in range(turns):
            messages.append({"role": "user", "content": text(rng, user_tokens)})
            body = {
                "model": model,
                "messages": list(messages),
                "max_tokens": answer_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            items.append(WorkItem(at, "/v1/chat/completions", body, session=session, turn=turn))
            messages.append({"role": "assistant", "content": text(rng, answer_tokens)})
            at += rng.uniform(1.0, 3.0) * turns / rate * 4
    items.sort(key=lambda item: item.at_s)
    return Workload("multi-turn", items)


@dataclass(frozen=True, slots=True)
class Phase:
    """A stretch of phased traffic: Poisson arrivals whose rate goes linearly from ``rate`` to
    ``rate_end`` (default: constant) over ``duration_s``. Each request has ``prompt_tokens`` of prompt,
    the first ``shared_tokens`` of them one of ``n_prefixes`` shared prefixes (the same texts in every
    phase, so caches stay warm across phases; 0: every prompt unique), and ``max_tokens`` out, or a
    uniform draw from ``max_tokens``..``max_tokens_high``."""

    duration_s: float
    rate: float
    rate_end: float | None = None
    prompt_tokens: int = 512
    shared_tokens: int = 0
    n_prefixes: int = 4
    max_tokens: int = 32
    max_tokens_high: int | None = None

    @property
    def end_rate(self) -> float:
        return self.rate if self.rate_end is None else self.rate_end

    def rate_at(self, t: float) -> float:
        """Requests/s at ``t`` seconds into the phase."""
        return self.rate + (self.end_rate - self.rate) * min(1.0, max(0.0, t / self.duration_s))

    def arrivals(self, rng: random.Random, scale: float = 1.0) -> Iterator[float]:
        """Offsets into the phase of Poisson arrivals at ``scale`` × its rate (by thinning), in order.
        The caller may draw from ``rng`` between two of them (the sequence stays seeded)."""
        peak = scale * max(self.rate, self.end_rate)
        t = 0.0
        while peak > 0:
            t += rng.expovariate(peak)
            if t >= self.duration_s:
                return
            if rng.random() * peak <= scale * self.rate_at(t):  # else thinned: the rate here is lower
                yield t


def phase_arrivals(rng: random.Random, n: int, phases: Sequence[Phase], *, scale: float = 1.0) -> list[float]:
    """``n`` arrival offsets of a non-homogeneous Poisson process whose rate is ``scale`` × the
    phases' rates, the phases repeated back to back as a cycle (bursts, periodic load)."""
    cycle = sum(p.duration_s for p in phases)
    if n <= 0:
        return []
    if not phases or cycle <= 0 or scale <= 0 or max(max(p.rate, p.end_rate) for p in phases) <= 0:
        raise ValueError("phase_arrivals needs phases with a positive duration and rate")
    # Bounded: ten times the cycles the expected arrivals per cycle need (and at least 1,000).
    expected = scale * sum(p.duration_s * (p.rate + p.end_rate) / 2 for p in phases)
    cycles = max(1000, math.ceil(10 * n / expected)) if expected > 0 else 1000
    out: list[float] = []
    start = 0.0
    for _ in range(cycles):
        for phase in phases:
            for t in phase.arrivals(rng, scale):
                out.append(start + t)
                if len(out) == n:
                    return out
            start += phase.duration_s
    raise ValueError(f"phase_arrivals: {len(out)} of {n} arrivals after {start:g} s of phases")


def phased(
    phases: Sequence[Phase], *, model: str = "sim-model", seed: int = 0, name: str = "phased"
) -> Workload:
    """Phases back to back (non-homogeneous Poisson arrivals, by thinning); ``session`` is the prefix."""
    rng = random.Random(seed)
    longest = max((p.shared_tokens for p in phases), default=0)
    count = max((p.n_prefixes for p in phases if p.shared_tokens), default=0)
    prefixes = [text(rng, longest) for _ in range(count)]
    items = []
    start = 0.0
    for phase in phases:
        for t in phase.arrivals(rng):
            group = rng.randrange(phase.n_prefixes) if phase.shared_tokens else -1
            shared = prefixes[group][: phase.shared_tokens * 4] if phase.shared_tokens else ""
            prompt = shared + "\nQuestion: " + text(rng, max(1, phase.prompt_tokens - phase.shared_tokens))
            high = phase.max_tokens_high or phase.max_tokens
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": rng.randint(phase.max_tokens, high),
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            items.append(WorkItem(start + t, "/v1/completions", body, session=group))
        start += phase.duration_s
    return Workload(name, items)
