"""The compiled path (``costmodel/compiled.py``) against the numpy path, float for float.

Random pools cover what the loops branch on: unknown (NaN) features, unknown KV capacity, requests
that cannot fit, every role mix, one to four link classes, sidecars, LoRA adapter states, weights
of 0, 1 and others, any subset of the built-in terms in any order, and the cost model's switches.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import SINGLE_PODS, make_config, make_picker, make_pool
from scorer_cases import LINKS, MODEL, objectives

from router.scheduling.costmodel import compiled
from router.scheduling.costmodel.compiled import CompiledCosts
from router.scheduling.costmodel.link import LinkCosts
from router.scheduling.costmodel.matrix import CostModel, Layout, PairCosts, WeightedTerm, costs_over, derive
from router.scheduling.costmodel.policies import JointArgmin
from router.scheduling.costmodel.registry import DEFAULT_WEIGHTS, load_term
from router.scheduling.costmodel.view import Candidates, RequestCtx

needs_numba = pytest.mark.skipif(not compiled.installed(), reason="numba (the fast extra) is not installed")

_FLOAT_FEATURES = (
    "running",
    "waiting",
    "kv_usage",
    "kv_capacity_tokens",
    "queued_prefill_tokens",
    "slowness",
    "reserved_kv_tokens",
)


def _pool(rng: np.random.Generator, k: int) -> Candidates:
    def maybe_unknown(values: np.ndarray) -> np.ndarray:
        if rng.random() < 0.4:
            values[rng.random(k) < 0.3] = np.nan
        return values

    role = rng.integers(0, 3, size=k)  # prefill, decode, prefill-decode
    features = {
        "slots": rng.permutation(4 * k)[:k].astype(np.int64),
        "running": maybe_unknown(rng.integers(0, 40, size=k).astype(float)),
        "waiting": maybe_unknown(rng.integers(0, 6, size=k).astype(float)),
        "kv_usage": maybe_unknown(rng.uniform(0, 1.1, size=k)),
        "kv_capacity_tokens": maybe_unknown(rng.choice([4000.0, 20000.0, 65536.0], size=k)),
        "queued_prefill_tokens": rng.choice([0.0, 300.0, 5000.0], size=k) * rng.integers(0, 2, size=k),
        "slowness": rng.choice([1.0, 0.8, 1.7], size=k),
        "reserved_kv_tokens": rng.choice([0.0, 1000.0, 30000.0], size=k),
        "inflight_requests": rng.integers(0, 40, size=k).astype(np.int64),
        "decoding_requests": rng.integers(0, 30, size=k).astype(np.int64),
        "decoding_kv_tokens": rng.choice([0.0, 7000.0, 40000.0], size=k),
        "waiting_ours": rng.choice([0.0, 1.0, 3.0, 9.0], size=k),
        "prefill_rate": rng.choice([0.0, 2000.0, 15000.0], size=k),
        "link_index": rng.integers(0, int(rng.integers(1, 5)), size=k).astype(np.int64),
        "can_prefill": role != 1,
        "can_decode": role != 0,
        "sidecar": rng.random(k) < 0.7,
        "cached_blocks": rng.choice([0, 3, 40, 200], size=k).astype(np.int32),
    }
    cand = Candidates(**features)
    if rng.random() < 0.3:
        cand.adapter_state = rng.integers(0, 4, size=k).astype(np.int8)
    return cand


def _cost_model(rng: np.random.Generator) -> CostModel:
    names = list(DEFAULT_WEIGHTS)  # a configuration has every built-in (weights.<name>: 0 keeps it)
    rng.shuffle(names)
    weights = rng.choice([1.0, 0.0, 0.5, 2.5], size=len(names), p=[0.6, 0.1, 0.15, 0.15])
    terms = tuple(WeightedTerm(load_term(name), float(w)) for name, w in zip(names, weights, strict=True))
    return CostModel(
        objectives=objectives(
            max_wait_skew_s=float(rng.choice([1.0, 0.05])), prefix_trust=float(rng.choice([1.0, 0.6]))
        ),
        model=MODEL,
        links=LINKS,
        terms=terms,
        link_weight=float(rng.choice([1.0, 3.0])),
        allow_local_prefill=bool(rng.random() < 0.8),
        prefill_may_decode=bool(rng.random() < 0.3),
        pair_waits_for_decode_queue=bool(rng.random() < 0.7),
    )


def _layout(rng: np.random.Generator, cand: Candidates, cm: CostModel) -> Layout:
    labels = {f"rack{i}": i for i in range(4)}
    table = LinkCosts(same=(0.0001, 50e9), default=(0.005, 1e9), pairs=((("rack0", "rack1"), (0.001, 3e9)),))
    is_prefill = cand.can_prefill if rng.random() < 0.8 else np.zeros(len(cand), dtype=bool)
    is_decode = cand.can_decode | cand.can_prefill if cm.prefill_may_decode else cand.can_decode
    pairs_into = cand.sidecar if rng.random() < 0.3 else None
    return Layout.of(cand, is_prefill, is_decode, table.table(labels), pairs_into)


def _assert_same(fast: PairCosts, slow: PairCosts) -> None:
    for field in dataclasses.fields(PairCosts):
        a, b = getattr(fast, field.name), getattr(slow, field.name)
        if field.name == "view":
            for name in (
                "cached",
                "wait_s",
                "uncached",
                "prefill_s",
                "batch",
                "used_kv",
                "need_kv",
                "tpot_s",
            ):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        elif field.name == "terms":
            assert list(a) == list(b)
            for name in a:
                np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        elif isinstance(b, np.ndarray):
            np.testing.assert_array_equal(a, b, err_msg=field.name)
            assert a.shape == b.shape, field.name
        else:
            assert a == b, field.name


@needs_numba
def test_the_compiled_costs_are_the_numpy_paths_float_for_float() -> None:
    rng = np.random.default_rng(7)
    for case in range(600):
        k = int(rng.integers(1, 40))
        cand = _pool(rng, k)
        cm = _cost_model(rng)
        ctx = RequestCtx(
            prompt_tokens=int(rng.choice([1, 200, 3000, 70000])),
            max_tokens=int(rng.choice([1, 256, 2000])),
            block_tokens=float(rng.choice([16.0, 13.7])),
            typical_prompt_tokens=float(rng.choice([500.0, 2000.0])),
            typical_answer_tokens=float(rng.choice([0.5, 256.0])),
            # None: max_tokens; the load term's weight follows it within its bounds
            expected_answer_tokens=rng.choice([None, 10.0, 80.0, 300.0, 5000.0]),
        )
        layout = _layout(rng, cand, cm)
        slow = costs_over(derive(cand, ctx, cm), cm, layout)
        for source in (cand, _in_pool_arrays(rng, cand)):
            fast = CompiledCosts(cm).costs(source, ctx, layout)
            assert fast is not None, case
            _assert_same(fast, slow)


def _in_pool_arrays(rng: np.random.Generator, cand: Candidates) -> Candidates:
    """The same candidates as ``Pool.candidates`` makes them: their features left in arrays over
    every slot (the others' values anything), read at their slots."""
    size = int(cand.slots.max()) + 1
    arrays = {}
    for name, values in vars(cand).items():
        if name in ("slots", "cached_blocks", "adapter_state"):
            continue
        whole = rng.permutation(np.resize(values, size))  # other slots: other candidates' values
        whole[cand.slots] = values
        arrays[name] = whole
    lazy = Candidates.of_pool(cand.slots, arrays)
    lazy.cached_blocks = cand.cached_blocks
    lazy.adapter_state = cand.adapter_state
    return lazy


def test_pool_candidates_read_the_pool_at_their_slots_when_asked() -> None:
    arrays = {"running": np.array([5.0, 6.0, 7.0, 8.0]), "waiting": np.array([0.0, 1.0, 2.0, 3.0])}
    cand = Candidates.of_pool(np.array([3, 1], dtype=np.int64), arrays)
    assert cand.value("running", 0) == 8.0 and "running" not in vars(cand)  # nothing gathered
    assert cand.sources(("waiting",))[0] is arrays["waiting"]
    np.testing.assert_array_equal(cand.positions(), [3, 1])
    np.testing.assert_array_equal(cand.running, [8.0, 6.0])  # gathered when read, and kept
    assert "running" in vars(cand)
    kept = cand.take(np.array([False, True]))
    np.testing.assert_array_equal(kept.slots, [1])
    assert (kept.running.tolist(), kept.waiting.tolist()) == ([6.0], [1.0])
    np.testing.assert_array_equal(kept.positions(), [0])  # a subset holds its own arrays
    with pytest.raises(AttributeError, match="no candidate feature 'runing'"):
        _ = cand.runing


@needs_numba
def test_a_custom_term_takes_the_numpy_path() -> None:
    class Custom:
        name = "queue"  # a built-in's name, but not the built-in's code
        side = "prefill"

        def seconds(self, view: object) -> np.ndarray:
            raise AssertionError("not called here")

    cm = dataclasses.replace(_cost_model(np.random.default_rng(0)), terms=(WeightedTerm(Custom(), 1.0),))
    assert CompiledCosts.of(cm) is None
    builtin = dataclasses.replace(cm, terms=(WeightedTerm(load_term("queue"), 1.0),))
    assert CompiledCosts.of(builtin) is not None


@needs_numba
def test_a_nan_sum_is_left_to_the_numpy_path_that_names_its_term() -> None:
    rng = np.random.default_rng(1)
    cand = _pool(rng, 6)
    cand.slowness = np.full(6, np.nan)  # nothing should ever scrape this, but a NaN must not route
    cm = dataclasses.replace(_cost_model(rng), terms=(WeightedTerm(load_term("queue"), 1.0),))
    ctx = RequestCtx(1000, 100, 16.0, 500.0)
    assert CompiledCosts(cm).costs(cand, ctx, _layout(rng, cand, cm)) is None


@needs_numba
def test_the_compiled_joint_choice_is_the_numpy_ones_with_the_same_draws() -> None:
    rng = np.random.default_rng(11)
    numpy_picker, compiled_picker = JointArgmin(seed=3, compiled=False), JointArgmin(seed=3)
    chosen_pairs = 0
    for case in range(600):
        cand = _pool(rng, int(rng.integers(1, 40)))
        cm = _cost_model(rng)
        ctx = RequestCtx(int(rng.choice([200, 3000])), 256, 16.0, 500.0)
        costs = costs_over(derive(cand, ctx, cm), cm, _layout(rng, cand, cm))
        if rng.random() < 0.3:  # exact ties: what the jitter is for
            costs.cost = np.round(costs.cost, 1)
        fallbacks = int(rng.choice([0, 1, 2, 9]))
        slow = numpy_picker.choose(costs, fallbacks)
        fast = compiled_picker.choose(costs, fallbacks)
        if slow is None:
            assert fast is None, case
            continue
        assert fast is not None, case
        assert (fast.prefill, fast.decode) == (slow.prefill, slow.decode), case
        assert fast.prefill_fallbacks.tolist() == slow.prefill_fallbacks.tolist(), case
        assert fast.decode_fallbacks.tolist() == slow.decode_fallbacks.tolist(), case
        chosen_pairs += fast.prefill >= 0
    assert chosen_pairs > 50  # the prefill side was exercised, not only local routes


_PICKS_AFTER_WARM = """
import numpy as np
from loadtests.bench.pick import build
from router.request.types import RouteRequest
from router.scheduling.costmodel import compiled

compiled.warm()
kernels = (compiled._costs, compiled.joint_choice)
warmed = [list(kernel.signatures) for kernel in kernels]
for endpoints in (2, 8, 64):  # one link class, and four
    picker, systems, _ = build(endpoints, np.random.default_rng(endpoints))
    assert picker._compiled is not None and picker.pair_picker._compiled  # the loops do pick
    for keys in (systems[0], systems[1][:5]):
        picker.pick(RouteRequest(model="m", prompt_tokens=4096, max_tokens=256, block_keys=keys, body={}))
assert [list(kernel.signatures) for kernel in kernels] == warmed, "a pick compiled a new signature"
print("ok")
"""


@needs_numba
def test_picks_after_warm_compile_nothing_new() -> None:
    """A signature a pick needs and ``warm`` did not compile would be compiled during a request,
    seconds of one request's latency: a fresh process checks that picks use only warm's."""
    _in_a_fresh_process(_PICKS_AFTER_WARM)


_PICK_WITHOUT_NUMBA = """
import sys
sys.modules["numba"] = None  # as on an install without the fast extra
import numpy as np
from loadtests.bench.pick import build
from router.request.types import RouteRequest
from router.scheduling.costmodel import compiled

assert not compiled.installed()
picker, systems, _ = build(8, np.random.default_rng(0))
assert picker._compiled is None
request = RouteRequest(model="m", prompt_tokens=4096, max_tokens=256, block_keys=systems[0], body={})
decision = picker.pick(request)
assert decision.prediction.ttft_s > 0
print("ok")
"""


def test_without_numba_the_picker_runs_on_numpy() -> None:
    """The ``fast`` extra is optional: without numba the module imports and every pick is numpy's."""
    _in_a_fresh_process(_PICK_WITHOUT_NUMBA)


def _in_a_fresh_process(script: str) -> None:
    """Run ``script`` in a new interpreter (nothing compiled or imported yet); it prints ``ok``."""
    root = Path(__file__).resolve().parents[4]
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@needs_numba
def test_the_picker_compiled_setting_chooses_the_path() -> None:
    """The default runs the loops; ``picker.compiled: false`` runs numpy for costs and choice."""
    for compiled_on in (True, False):
        config = make_config(SINGLE_PODS, picker={"compiled": compiled_on})
        picker = make_picker(config, make_pool(config))
        assert (picker._compiled is not None) is compiled_on
        assert picker.pair_picker._compiled is compiled_on


def _plus_one(x: float) -> float:
    return x + 1.0


@needs_numba
def test_a_read_only_install_compiles_each_process_without_a_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """numba refuses ``cache=True`` where it finds no writable cache directory (a read-only image
    without ``NUMBA_CACHE_DIR``): the loops are then compiled in each process instead."""
    assert compiled._numba is not None
    real = compiled._numba.njit
    asked: list[bool] = []

    def njit(*args: object, **kwargs: object) -> object:
        if args or kwargs.get("error_model") != "numpy":  # numba's own uses while it compiles
            return real(*args, **kwargs)
        asked.append(bool(kwargs.get("cache")))
        if kwargs.get("cache"):
            raise RuntimeError("cannot cache function '_plus_one': no locator available for file")
        return real(*args, **kwargs)

    monkeypatch.setattr(compiled._numba, "njit", njit)
    fn = compiled._jit(_plus_one)
    assert fn(1.0) == 2.0
    assert asked == [True, False]
    assert hasattr(fn, "signatures") and fn.signatures  # a numba dispatcher that compiled, not the Python
