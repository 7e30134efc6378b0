"""``derive``, the built-in cost terms and the matrix in compiled loops (numba, the ``fast`` extra).

The same arithmetic as ``matrix.derive``, ``terms/*.py`` and ``matrix.costs_over``, operation for
operation in the same order, so every float is bitwise the same and decisions do not move
(``tests/router/scheduling/costmodel/test_compiled.py`` holds both paths to that). It exists because
a pick's arrays are small: the numpy path spends its time in about a hundred calls' fixed overhead,
not in arithmetic, and one compiled call replaces them, a second one ``JointArgmin``'s choice
(``docs/benchmarks.md``, "pick() hot path").

Used by ``Picker`` when numba is installed, ``picker.compiled`` is on and every configured term is a
built-in one; anything else (a custom term, a term returning NaN, which the numpy runner names) takes
the numpy path. Each step of a loop mirrors one numpy operation: ``np.maximum`` lets NaN win, argmin
takes the first of equal minima, ``x / 0`` is inf (``error_model="numpy"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from router.scheduling.costmodel.matrix import CostModel, Layout, PairCosts
from router.scheduling.costmodel.terms.load import awaited_tokens
from router.scheduling.costmodel.terms.step import STEPS_TO_COMPUTE
from router.scheduling.costmodel.view import (
    ADAPTER_EVICTS,
    ADAPTER_NOT_SERVED,
    ADAPTER_RESIDENT,
    Candidates,
    RequestCtx,
    View,
)

# The built-in terms the loops know, by the code they use for each.
TERM_CODES = {
    "queue": 0,
    "prefill": 1,
    "interference": 2,
    "load": 3,
    "kv": 4,
    "absorb": 5,
    "lora": 6,
    "step": 7,
}
# Who pays each (``view.CostTerm.side``): 0 prefill, 1 decode, 2 both.
_SIDE_CODES = {"prefill": 0, "decode": 1, "both": 2}
_NO_ADAPTER = np.zeros(0, dtype=np.int8)
# The candidate features ``_costs`` reads, in the order of its ``<feature>_of`` arguments.
_FEATURES = (
    "slowness",
    "queued_prefill_tokens",
    "waiting",
    "running",
    "inflight_requests",
    "kv_usage",
    "kv_capacity_tokens",
    "reserved_kv_tokens",
    "can_decode",
    "can_prefill",
    "decoding_requests",
    "decoding_kv_tokens",
    "waiting_ours",
)


try:
    import numba as _numba
except ImportError:  # the ``fast`` extra is not installed
    _numba = None


def _jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled, or ``fn`` itself when numba is missing (``installed`` says which)."""
    if _numba is None:
        return fn
    try:  # compiled once per machine where the package directory is writable
        return _numba.njit(cache=True, nogil=True, error_model="numpy")(fn)
    except RuntimeError:  # a read-only install without a cache directory: compiled per process
        return _numba.njit(nogil=True, error_model="numpy")(fn)


def installed() -> bool:
    """Whether numba is there to compile the loops."""
    return _numba is not None


@_jit
def _fill_unknown(values: np.ndarray, worst: float) -> np.ndarray:
    # view.fill_unknown: NaN becomes the largest known value, or ``worst`` when none is known.
    known = -np.inf
    any_known = False
    unknown = False
    for v in values:
        if math.isnan(v):
            unknown = True
        else:
            any_known = True
            known = max(known, v)
    if not unknown:
        return values
    out = values.copy()
    for i in range(values.shape[0]):
        if math.isnan(out[i]):
            out[i] = known if any_known else worst
    return out


@_jit
def _maximum(a: float, b: float) -> float:
    # np.maximum: NaN wins (Python's max keeps its first argument when a comparison is False).
    if math.isnan(a) or math.isnan(b):
        return a + b
    return a if a >= b else b


@_jit
def _costs(
    cached_blocks: np.ndarray,
    at: np.ndarray,
    slowness_of: np.ndarray,
    queued_prefill_tokens_of: np.ndarray,
    waiting_of: np.ndarray,
    running_of: np.ndarray,
    inflight_requests_of: np.ndarray,
    kv_usage_of: np.ndarray,
    kv_capacity_tokens_of: np.ndarray,
    reserved_kv_tokens_of: np.ndarray,
    can_decode_of: np.ndarray,
    can_prefill_of: np.ndarray,
    decoding_requests_of: np.ndarray,
    decoding_kv_tokens_of: np.ndarray,
    waiting_ours_of: np.ndarray,
    adapter_state: np.ndarray,
    prompt: float,
    max_tokens: float,
    block_tokens: float,
    typical_prompt: float,
    typical_answer: float,
    load_weight: float,
    scalars: np.ndarray,
    codes: np.ndarray,
    sides: np.ndarray,
    weights: np.ndarray,
    decode: np.ndarray,
    prefill: np.ndarray,
    no_pairs: np.ndarray,
    class_rows: np.ndarray,
    latency_s: np.ndarray,
    bytes_per_s: np.ndarray,
    matrix_scalars: np.ndarray,
    derived: np.ndarray,
    terms: np.ndarray,
    sums: np.ndarray,
    ttft: np.ndarray,
    prefill_of: np.ndarray,
    cost: np.ndarray,
    transfer: np.ndarray,
    per_decode: np.ndarray,
) -> bool:
    """``derive``, the terms and the matrix in one call: fills ``derived`` (8, k: the ``View``
    quantities), ``terms`` (len(codes), k: the weighted terms), ``sums`` (3, k: prefill side, decode
    side, both sides, each in the terms' order) and the matrix outputs (``_matrix``); returns False,
    with no matrix, when a sum is NaN (the numpy path then names the term). Each ``<feature>_of``
    holds the candidates' values at ``at`` (the pool's arrays at the candidates' slots: gathered
    here, where it costs a fraction of a numpy gather per feature)."""
    slowness = slowness_of[at]
    queued_prefill_tokens = queued_prefill_tokens_of[at]
    waiting = waiting_of[at]
    running = running_of[at]
    inflight_requests = inflight_requests_of[at]
    kv_usage = kv_usage_of[at]
    kv_capacity_tokens = kv_capacity_tokens_of[at]
    reserved_kv_tokens = reserved_kv_tokens_of[at]
    can_decode = can_decode_of[at]
    can_prefill = can_prefill_of[at]
    decoding_requests = decoding_requests_of[at]
    decoding_kv_tokens = decoding_kv_tokens_of[at]
    waiting_ours = waiting_ours_of[at]
    tps, step_base, per_seq, per_kv = scalars[0], scalars[1], scalars[2], scalars[3]
    tpot_weight, kv_penalty_s, kv_soft = scalars[4], scalars[5], scalars[6]
    max_skew, prefix_trust = scalars[7], scalars[8]
    lora_load_s, lora_evict_s = scalars[9], scalars[10]
    k = cached_blocks.shape[0]
    cached, wait, uncached, prefill_s = derived[0], derived[1], derived[2], derived[3]
    batch, used, need, tpot = derived[4], derived[5], derived[6], derived[7]
    waiting_known = _fill_unknown(waiting, 0.0)
    running_known = _fill_unknown(running, 0.0)
    usage_known = _fill_unknown(kv_usage, 1.0)
    cap_prompt = max(prompt - 1.0, 0.0)
    least_wait = np.inf
    nan_wait = False
    for i in range(k):
        cached[i] = min(cached_blocks[i] * block_tokens, cap_prompt)
        elsewhere = _maximum(waiting_known[i] - waiting_ours[i], 0.0)
        wait[i] = _maximum(queued_prefill_tokens[i], elsewhere * typical_prompt) / tps * slowness[i]
        if math.isnan(wait[i]):
            nan_wait = True
        elif wait[i] < least_wait:
            least_wait = wait[i]
    if nan_wait:
        least_wait = np.nan
    per_stalled = tpot_weight / max(typical_answer, 1.0)
    all_decode = True
    frac = np.empty(k)
    stalled = np.empty(k)  # terms/interference.py ``stalled_decodes``: what a stall on the pod holds up
    for i in range(k):
        trust = prefix_trust if wait[i] <= least_wait + max_skew else 0.0
        uncached[i] = prompt - trust * cached[i]
        prefill_s[i] = uncached[i] / tps * slowness[i]
        batch[i] = _maximum(running_known[i], float(inflight_requests[i]))
        stalled[i] = batch[i] if can_decode[i] else float(decoding_requests[i])
        product = usage_known[i] * kv_capacity_tokens[i]
        used[i] = reserved_kv_tokens[i] if math.isnan(product) else max(product, reserved_kv_tokens[i])
        need[i] = (prompt + max_tokens) - cached[i]
        tpot[i] = (step_base + per_seq * (batch[i] + 1.0) + per_kv * (used[i] + need[i])) * slowness[i]
        frac[i] = (used[i] + need[i]) / kv_capacity_tokens[i]
        if not can_decode[i]:
            all_decode = False
    frac = _fill_unknown(frac, 0.0)
    absorb_step = max_tokens * (per_seq + per_kv * (prompt + max_tokens))
    has_adapter = adapter_state.shape[0] == k
    not_served = 0
    if has_adapter:
        for i in range(k):
            if adapter_state[i] == ADAPTER_NOT_SERVED:
                not_served += 1
    refuse = 0 < not_served < k
    for t in range(codes.shape[0]):
        code = codes[t]
        row = terms[t]
        for i in range(k):
            if code == 0:  # queue
                s = wait[i]
            elif code == 1:  # prefill
                s = prefill_s[i]
            elif code == 2:  # interference
                s = prefill_s[i] * stalled[i] * per_stalled
            elif code == 3:  # load
                s = tpot[i] * load_weight
            elif code == 4:  # kv: the penalty on decode-only pods, the filter everywhere
                s = 0.0 if can_prefill[i] else max(0.0, frac[i] - kv_soft) / (1.0 - kv_soft) * kv_penalty_s
                if need[i] > kv_capacity_tokens[i]:
                    s = np.inf
            elif code == 5:  # absorb
                s = 0.0 if all_decode or can_decode[i] else absorb_step * max(waiting_known[i], 1.0)
            elif code == 7:  # step
                own = step_base + per_seq * decoding_requests[i] + per_kv * decoding_kv_tokens[i]
                s = 0.0 if can_decode[i] else STEPS_TO_COMPUTE * own * slowness[i]
            else:  # lora
                s = 0.0
                if has_adapter:
                    state = adapter_state[i]
                    if state != ADAPTER_RESIDENT:
                        s = lora_load_s * (1.0 + stalled[i] * per_stalled)
                    if state >= ADAPTER_EVICTS:
                        s += lora_evict_s
                    if refuse and state == ADAPTER_NOT_SERVED:
                        s = np.inf
            if weights[t] != 1.0 and not math.isinf(s):
                s = s * weights[t]
            row[i] = s
    route, column, both = sums[0], sums[1], sums[2]
    for i in range(k):
        r = 0.0
        c = 0.0
        b = 0.0
        for t in range(terms.shape[0]):
            s = terms[t, i]
            if sides[t] == 1:
                c = c + s
            else:
                r = r + s
                if sides[t] == 2:
                    b = b + s
        route[i] = r
        column[i] = c
        both[i] = b
        if math.isnan(r) or math.isnan(c):
            return False
    _matrix(
        route, column, both, derived, decode, prefill, no_pairs, class_rows, latency_s, bytes_per_s,
        prompt, matrix_scalars, ttft, prefill_of, cost, transfer, per_decode[0], per_decode[1],
    )  # fmt: skip
    return True


@_jit
def _best_two(
    route: np.ndarray, prefill: np.ndarray, class_rows: np.ndarray, best: np.ndarray, second: np.ndarray
) -> None:
    """``matrix.best_two_per_class`` over the prefill pods' routes: per class (a row of positions
    into ``prefill``, ascending, padded with ``len(prefill)``) the cheapest and the runner-up (-1:
    none), ties to the lower position, +inf members included."""
    pad = prefill.shape[0]
    for c in range(class_rows.shape[0]):
        first = -1
        for at in class_rows[c]:
            if at == pad:
                break
            if first < 0 or route[prefill[at]] < route[prefill[first]]:
                first = at
        runner = -1
        for at in class_rows[c]:
            if at == pad:
                break
            if at != first and (runner < 0 or route[prefill[at]] < route[prefill[runner]]):
                runner = at
        best[c] = first
        second[c] = runner


@_jit
def _matrix(
    route: np.ndarray,
    column: np.ndarray,
    both: np.ndarray,
    derived: np.ndarray,
    decode: np.ndarray,
    prefill: np.ndarray,
    no_pairs: np.ndarray,
    class_rows: np.ndarray,
    latency_s: np.ndarray,
    bytes_per_s: np.ndarray,
    prompt: float,
    scalars: np.ndarray,
    ttft: np.ndarray,
    prefill_of: np.ndarray,
    cost: np.ndarray,
    transfer: np.ndarray,
    decode_bytes: np.ndarray,
    after_transfer: np.ndarray,
) -> None:
    """``matrix.costs_over`` from the route and column sums: fills the outputs (the rest)."""
    kv_bytes, step_and_leg, link_weight = scalars[0], scalars[1], scalars[2]
    slo, local_ok, decode_queue, has_both = scalars[3], scalars[4], scalars[5], scalars[6]
    cached, wait, prefill_s, tpot = derived[0], derived[1], derived[3], derived[7]
    kd = decode.shape[0]
    classes = latency_s.shape[0]
    best = np.empty(classes, dtype=np.int64)
    second = np.empty(classes, dtype=np.int64)
    _best_two(route, prefill, class_rows, best, second)
    local_only = local_ok == 0.0 and prefill.shape[0] > 0
    for j in range(kd):
        d = decode[j]
        ttft[0, j] = np.inf if local_only and not no_pairs[j] else route[d]
        prefill_of[0, j] = -1
        after = 2.0 * tpot[d] + step_and_leg
        if has_both != 0.0:
            after = after + both[d]
        after_transfer[j] = after
        decode_bytes[j] = (prompt - cached[d]) * kv_bytes
        for c in range(classes):
            moved = latency_s[c, j] + decode_bytes[j] / bytes_per_s[c, j]
            transfer[c, j] = moved
            chosen = second[c] if prefill[best[c]] == d else best[c]
            if chosen < 0:
                ttft[1 + c, j] = np.inf
                prefill_of[1 + c, j] = -1
                continue
            p = prefill[chosen]
            prefill_of[1 + c, j] = p  # kept on a column without pairs too, as the numpy path does
            if no_pairs[j]:
                ttft[1 + c, j] = np.inf
                continue
            pair = route[p] + link_weight * moved + after
            if decode_queue != 0.0:
                left = wait[d] - ((wait[p] + prefill_s[p]) + moved)
                pair += left if left > 0.0 or math.isnan(left) else 0.0
            ttft[1 + c, j] = pair
        for row in range(1 + classes):
            cost[row, j] = (ttft[row, j] + column[d]) / slo


class CompiledCosts:
    """``costs_over(derive(...))`` for one cost model whose terms are all built-in (``of``)."""

    def __init__(self, cm: CostModel) -> None:
        self.cm = cm
        names = [w.term.name for w in cm.terms]
        self._codes = np.array([TERM_CODES[name] for name in names], dtype=np.int64)
        self._sides = np.array([_SIDE_CODES[w.term.side] for w in cm.terms], dtype=np.int64)
        self._weights = np.array([w.weight for w in cm.terms], dtype=np.float64)
        self._names = names
        self._has_both = any(w.term.side == "both" for w in cm.terms)
        self._one_class: tuple[Layout, np.ndarray] | None = None
        o, model = cm.objectives, cm.model
        self._matrix_scalars = np.array(
            [
                float(model.kv_bytes_per_token),
                model.decode_step_base_s + model.pd_leg_overhead_s,
                cm.link_weight,
                o.ttft_slo_s,
                float(cm.allow_local_prefill),
                float(cm.pair_waits_for_decode_queue),
                float(self._has_both),
            ]
        )
        self._model_scalars = np.array(
            [
                model.prefill_tokens_per_s,
                model.decode_step_base_s,
                model.decode_s_per_seq,
                model.decode_s_per_kv_token,
                o.tpot_weight,
                o.kv_penalty_s,
                o.kv_soft_threshold,
                o.max_wait_skew_s,
                o.prefix_trust,
                model.lora_load_s,
                model.lora_evict_s,
            ]
        )

    @classmethod
    def of(cls, cm: CostModel) -> CompiledCosts | None:
        """The compiled path for ``cm``, or None where it does not apply (numba missing, a term
        the loops do not know)."""
        if _numba is None:
            return None
        for weighted in cm.terms:
            term = weighted.term
            code = TERM_CODES.get(term.name)
            if code is None or type(term).__module__ != f"router.scheduling.costmodel.terms.{term.name}":
                return None
        return cls(cm)

    def _class_rows(self, layout: Layout) -> np.ndarray:
        # ``layout.members.index``, or its one row when there is a single class (kept per layout).
        if layout.members is not None:
            return layout.members.index
        kept = self._one_class
        if kept is None or kept[0] is not layout:
            rows = np.arange(len(layout.prefill))[None, :] if len(layout.classes) else np.empty((0, 0))
            kept = self._one_class = (layout, rows.astype(np.int64))
        return kept[1]

    def costs(self, cand: Candidates, ctx: RequestCtx, layout: Layout) -> PairCosts | None:
        """The pick's ``PairCosts``, bitwise as the numpy path's; None: let the numpy path run
        (no candidates, or a NaN it will name)."""
        k = len(cand)
        if k == 0:
            return None
        cm = self.cm
        derived = np.empty((8, k))
        terms = np.empty((len(self._codes), k))
        sums = np.empty((3, k))
        decode, prefill = layout.decode, layout.prefill
        kd, rows = len(decode), 1 + len(layout.classes)
        ttft = np.empty((rows, kd))
        prefill_of = np.empty((rows, kd), dtype=np.int64)
        cost = np.empty((rows, kd))
        transfer = np.empty((rows - 1, kd))
        per_decode = np.empty((2, kd))
        adapter = cand.adapter_state
        # The pool's arrays as they are (float64, int32 cached blocks, int64 in-flight counts,
        # bool): ``warm`` compiles those, so a pick never waits for a compile.
        if not _costs(
            cand.cached_blocks,
            cand.positions(),
            *cand.sources(_FEATURES),
            _NO_ADAPTER if adapter is None else adapter,
            float(ctx.prompt_tokens),
            float(ctx.max_tokens),
            float(ctx.block_tokens),
            float(ctx.typical_prompt_tokens),
            float(ctx.typical_answer_tokens),
            awaited_tokens(cm.objectives.tpot_weight, ctx.answer_tokens),
            self._model_scalars,
            self._codes,
            self._sides,
            self._weights,
            decode,
            prefill,
            layout.no_pairs,
            self._class_rows(layout),
            layout.latency_s,
            layout.bytes_per_s,
            self._matrix_scalars,
            derived,
            terms,
            sums,
            ttft,
            prefill_of,
            cost,
            transfer,
            per_decode,
        ):
            return None
        route, column = sums[0], sums[1]
        view = View(
            cand=cand,
            ctx=ctx,
            model=cm.model,
            objectives=cm.objectives,
            cached=derived[0],
            wait_s=derived[1],
            uncached=derived[2],
            prefill_s=derived[3],
            batch=derived[4],
            used_kv=derived[5],
            need_kv=derived[6],
            tpot_s=derived[7],
        )
        return PairCosts.of(
            view,
            cm,
            layout,
            cost=cost,
            ttft_s=ttft,
            prefill_of=prefill_of,
            transfer_s=transfer,
            transfer_bytes=per_decode[0],
            after_transfer_s=per_decode[1],
            route_s=route,
            column_s=column,
            terms=dict(zip(self._names, terms)),  # noqa: B905 (one row per name, by construction)
        )


@_jit
def _smallest(values: np.ndarray, limit: int) -> np.ndarray:
    """``matrix.smallest``: positions of the ``limit`` smallest finite values, ascending, ties to
    the lower position (NaN is never taken). Overwrites ``values``."""
    found = np.empty(min(limit, values.shape[0]), dtype=np.int64)
    n = 0
    while n < found.shape[0]:
        at = -1
        for i in range(values.shape[0]):
            v = values[i]
            if math.isfinite(v) and (at < 0 or v < values[at]):
                at = i
        if at < 0:
            break
        found[n] = at
        n += 1
        values[at] = np.inf
    return found[:n]


@_jit
def joint_choice(
    cost: np.ndarray,
    draws: np.ndarray,
    tie_jitter: float,
    prefill_of: np.ndarray,
    route: np.ndarray,
    prefill: np.ndarray,
    prefill_class: np.ndarray,
    transfer: np.ndarray,
    decode: np.ndarray,
    link_weight: float,
    fallbacks: int,
) -> tuple[int, int, np.ndarray, np.ndarray]:
    """``policies.JointArgmin.choose`` on one matrix: (prefill position or -1, decode column,
    prefill fallbacks, decode fallbacks); the column is -1 when no route is finite. ``draws``: the
    ``rows + cols`` numbers its tie-breaking jitter takes."""
    rows, cols = cost.shape
    noisy = np.empty((rows, cols))
    at = -1
    least = np.inf
    for r in range(rows):
        jitter_r = 1.0 + draws[r] * tie_jitter
        for c in range(cols):
            v = cost[r, c] * (jitter_r + draws[rows + c] * tie_jitter)
            noisy[r, c] = v
            # np.argmin: the first of equal minima, or the first NaN
            if at < 0 or v < least or (math.isnan(v) and not math.isnan(least)):
                at = r * cols + c
                least = v
    none = np.empty(0, dtype=np.int64)
    row, col = at // cols, at % cols
    if not math.isfinite(noisy[row, col]):
        return -1, -1, none, none
    chosen = prefill_of[row, col]
    if fallbacks == 0:
        return chosen, col, none, none
    column_best = np.empty(cols)
    for c in range(cols):
        least = noisy[0, c]
        for r in range(1, rows):
            v = noisy[r, c]
            if v < least or math.isnan(v):
                least = v
        column_best[c] = least
    column_best[col] = np.inf
    decode_fallbacks = _smallest(column_best, fallbacks)
    if chosen < 0:
        return chosen, col, none, decode_fallbacks
    pair = np.empty(prefill.shape[0])
    for i in range(prefill.shape[0]):
        p = prefill[i]
        if p == chosen or p == decode[col]:
            pair[i] = np.inf
        else:
            pair[i] = route[p] + link_weight * transfer[prefill_class[i], col]
    return chosen, col, prefill[_smallest(pair, fallbacks)], decode_fallbacks


def warm() -> None:
    """Compile the loops now, for the argument types a pick passes (or load them from numba's
    cache), so that no request waits for it: a few seconds the first time, well under one from the
    cache. The ``Picker`` calls it when it will use them."""
    if _numba is None:
        return
    k, zeros, yes = 2, np.zeros(2), np.ones(2, dtype=np.bool_)
    codes = np.arange(len(TERM_CODES), dtype=np.int64)
    sides = np.array([0, 0, 0, 1, 1, 1, 2, 0], dtype=np.int64)
    index = np.arange(k, dtype=np.int64)
    rows = np.zeros((2, k))
    chosen = np.zeros((2, k), dtype=np.int64)
    sums = np.empty((3, k))
    _costs(
        np.zeros(k, dtype=np.int32), index, zeros, zeros, zeros, zeros, index, zeros, zeros, zeros, yes, yes,
        index, zeros, zeros, _NO_ADAPTER, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, np.full(11, 0.5), codes, sides,
        np.ones(len(codes)),
        index, index, ~yes, index[None, :], np.ones((1, k)), np.ones((1, k)), np.ones(7),
        np.empty((8, k)), np.empty((len(codes), k)), sums, rows, chosen, np.empty((2, k)),
        np.empty((1, k)), np.empty((2, k)),
    )  # fmt: skip
    joint_choice(rows, np.zeros(4), 1e-9, chosen, sums[0], index, index, np.ones((1, k)), index, 1.0, 2)
