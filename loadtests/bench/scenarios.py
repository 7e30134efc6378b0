"""The routing benchmarks' scenarios: cluster shapes, seeded workloads, the router configuration
each policy runs with, and goodput. Shared by ``loadtests.bench.routing`` (wall-clock, real HTTP)
and ``loadtests.bench.quality`` (virtual clock, in-process). Of the router only ``router.server.config``
is imported (through ``simulator.cluster``), which every checkout has, so ``quality`` can also
run a router from another checkout (``--router-tree``).

Scenarios:
  a  4 × prefill-decode pods, shared-prefix workload (many long system prompts, short questions)
  b  4 × prefill-decode pods, multi-turn chat (every turn resends the conversation)
  c  2 prefill + 2 decode on two racks (fast links inside a rack, slow across), long shared prefixes
  d  4 × prefill-decode pods, bursty multi-turn chat (session starts in bursts of 1.5× and 2× the
     base rate)
  e  2 prefill + 2 decode, long outputs: decode-bound (decode pods busy, prefill pods half idle)
  f  (c) with the router told only each engine's rack label, not the links' speeds
  g  4 × prefill-decode pods with 4 LoRA slots each, 8 adapters of Zipf popularity (and base-model
     traffic): adapter loads stall an engine's step
  h  (g) with 32 adapters: more than the pool's 16 slots, so some loads are unavoidable
  i, j, k  4 × prefill-decode pods, a quarter of the requests with tight SLOs and the rest relaxed
     (``x-slo-*`` headers), at 0.8, 1.0 and 1.2 × the nominal capacity: SLO attainment per class
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from simulator.cluster import engine_model_for
from simulator.engine import EngineSpec, TimeModel
from simulator.workloads.client import Summary
from simulator.workloads.generate import Phase, WorkItem, Workload, multi_turn, phased, shared_prefix, text

KV_BYTES_PER_TOKEN = 131072  # 128 KiB/token: Llama-3-8B class (32 layers × 8 KV heads × 128 × 2 × bf16)
# Goodput SLOs at speed 1: TTFT ≤ 1 s and TPOT ≤ 20 ms (divided by the simulator's speed).
GOODPUT_TTFT_S, GOODPUT_TPOT_S = 1.0, 0.020
# The proxy's own time between two hops of one request (pick -> engine, prefill answer -> decode
# leg): loopback HTTP in one process, measured p50 0.8–1 ms from the pick to the engine's arrival
# (p90 ~4 ms on a busy loop). The reference assumes it; the virtual-time runs spend it per leg.
HOP_S = 0.001


@dataclass
class Scenario:
    key: str
    title: str
    specs: Callable[[TimeModel], list[EngineSpec]]
    workload: Callable[[int, float, int], Workload]  # (requests, rate, seed)
    policies: list[str]
    rate: float  # default arrival rate, requests/s (chosen from a sweep; see the report)
    requests: int  # default request count
    links: dict[str, Any] = field(default_factory=dict)  # physical link table (before speed scaling)
    # What the router's links section says (None: the physical table; {}: labels only).
    router_links: dict[str, Any] | None = None
    params: str = ""  # one line of parameters for the table header
    # Goodput: a request counts when TTFT ≤ goodput_ttft_s and TPOT ≤ goodput_tpot_s (at speed 1).
    goodput_ttft_s: float = GOODPUT_TTFT_S
    goodput_tpot_s: float = GOODPUT_TPOT_S
    # Settings of the router's configuration this scenario needs (applied to ``config_data``'s).
    configure: Callable[[dict[str, Any], TimeModel], None] | None = None
    # Per-request SLO classes (``WorkItem.tag`` -> (TTFT, TPOT) objectives in seconds at speed 1):
    # the table adds each class's attainment.
    slo_classes: dict[str, tuple[float, float]] = field(default_factory=dict)


# The SLO class of requests that carry the goodput's objectives (``with_goodput_slo``).
GOODPUT_CLASS = "goodput"


# -- scenario definitions --------------------------------------------------------------------------

# (a)/(b): 1024 blocks × 16 = 16k tokens of KV per pod, so one pod cannot hold every system prompt
# (16 × 2k tokens) — the realistic regime where scattering a prefix over all pods costs cache hits.
PD_POOL_BLOCKS = 1024
A_PREFIXES, A_PREFIX_TOKENS, A_SUFFIX_TOKENS, A_MAX_TOKENS = 16, 2048, 64, 16
B_TURNS, B_SYSTEM, B_USER, B_ANSWER = 4, 1024, 256, 32

# (c): two racks; 25 GB/s inside a rack (NVLink/RDMA within a node group), 3 GB/s across.
C_LINKS = {
    "same": {"latency_ms": 0.05, "bandwidth_gbytes_per_s": 25.0},
    "default": {"latency_ms": 1.0, "bandwidth_gbytes_per_s": 3.0},
}
C_BLOCKS = 2048
C_PREFIXES, C_PREFIX_TOKENS, C_SUFFIX_TOKENS, C_MAX_TOKENS = 8, 4096, 192, 16

# (d): the chat of (b), its sessions starting in bursts: base rate, 1.5× burst, base, 2× burst.
# Turns follow each other as in (b) at its 50 req/s (0.3–1 s apart) whatever the base rate: users'
# think time does not depend on how many of them there are.
D_BASE_S, D_BURST_S = 5.0, 2.5
D_BURSTS = (1.5, 2.0)
D_TURN_PACE = 50.0

# (e): one rack (the in-rack link of (c)), long outputs; 8 shared 512-token prefixes + 512 tokens.
E_BLOCKS = 2048
E_PROMPT, E_SHARED, E_PREFIXES, E_OUT_LOW, E_OUT_HIGH = 1024, 512, 8, 192, 384


# (g)/(h): LoRA. Prompts of 512 tokens that share nothing (so prefix locality neither helps nor
# hides adapter placement); adapters are chosen with Zipf popularity (weight 1/rank), a quarter of
# requests go to the base model. A load takes 100 ms (vLLM reading an adapter from local disk) and stalls the
# engine's whole step, as vLLM loads adapters inside its step.
G_POOL_BLOCKS, G_MAX_LORAS, G_LOAD_S = 2048, 4, 0.1
G_PROMPT, G_MAX_TOKENS, G_BASE_SHARE = 512, 32, 0.25


# (i)/(j)/(k): per-request SLOs. 4 prefill-decode pods; prompts of 1024 tokens (512 shared, 8
# prefixes), 64–128 out; a quarter of the requests are interactive with tight objectives, the rest
# relaxed (batch-like). Arrivals at 0.8, 1.0 and 1.2 × the nominal capacity (``nominal_capacity``).
SLO_MIX_TOKENS = (1024, 512, 64, 128)  # prompt, shared, max_tokens low, high
SLO_PREFIXES, SLO_BLOCKS = 8, 2048
SLO_TIGHT_SHARE = 0.25
SLO_CLASSES = {"tight": (0.150, 0.050), "relaxed": (2.0, 0.150)}  # TTFT, TPOT objectives (s)
SLO_LOADS = {"i": 0.8, "j": 1.0, "k": 1.2}


def _slo_pool(tm: TimeModel) -> list[EngineSpec]:
    return [
        EngineSpec(f"pod-{i}", "prefill-decode", link="rack-a", num_gpu_blocks=SLO_BLOCKS, time=tm)
        for i in range(4)
    ]


def _slo_traffic(n: int, rate: float, seed: int) -> Workload:
    prompt, shared, low, high = SLO_MIX_TOKENS
    wl = _poisson(n, rate, seed, "slo-mix", Phase(0.0, rate, None, prompt, shared, SLO_PREFIXES, low, high))
    classes = random.Random(seed + 7919)  # its own stream: the arrivals are phased()'s
    for item in wl.items:
        item.tag = "tight" if classes.random() < SLO_TIGHT_SHARE else "relaxed"
        ttft, tpot = SLO_CLASSES[item.tag]
        item.headers = {"x-slo-ttft-ms": f"{ttft * 1000:g}", "x-slo-tpot-ms": f"{tpot * 1000:g}"}
    return wl


def _slo_scenario(key: str, load: float) -> Scenario:
    prompt, shared, low, high = SLO_MIX_TOKENS
    capacity = nominal_capacity(TimeModel(), Mix("slo", prompt, shared, low, high), "pd", 4)
    classes = ", ".join(
        f"{name} TTFT ≤ {ttft * 1000:g} ms, TPOT ≤ {tpot * 1000:g} ms"
        for name, (ttft, tpot) in SLO_CLASSES.items()
    )
    return Scenario(
        key,
        f"({key}) 4 × prefill-decode, mixed tight/relaxed SLOs at {load:g}× capacity",
        _slo_pool,
        _slo_traffic,
        ["least-loaded", "pd-router"],
        rate=load * capacity,
        requests=600,
        params=(
            f"{prompt} tok prompts ({shared} shared, {SLO_PREFIXES} prefixes), {low}–{high} out; "
            f"{SLO_TIGHT_SHARE:.0%} tight, the rest relaxed ({classes}; x-slo-* headers); nominal "
            f"capacity {capacity:.1f} req/s; {SLO_BLOCKS * 16} KV tokens/pod"
        ),
        slo_classes=SLO_CLASSES,
    )


def _lora_pool(adapters: int) -> Callable[[TimeModel], list[EngineSpec]]:
    def specs(tm: TimeModel) -> list[EngineSpec]:
        return [
            EngineSpec(
                f"pod-{i}",
                "prefill-decode",
                link="rack-a",
                num_gpu_blocks=G_POOL_BLOCKS,
                time=tm,
                lora_adapters=tuple(_adapter(a) for a in range(adapters)),
                max_loras=G_MAX_LORAS,
                lora_load_s=G_LOAD_S,
            )
            for i in range(4)
        ]

    return specs


def _adapter(rank: int) -> str:
    return f"lora-{rank:02d}"


def _lora_traffic(adapters: int) -> Callable[[int, float, int], Workload]:
    def make(n: int, rate: float, seed: int) -> Workload:
        rng = random.Random(seed)
        weights = [1.0 / (rank + 1) for rank in range(adapters)]
        items, at = [], 0.0
        for _ in range(n):
            at += rng.expovariate(rate)
            which = adapters if rng.random() < G_BASE_SHARE else rng.choices(range(adapters), weights)[0]
            body = {
                "model": "sim-model" if which == adapters else _adapter(which),
                "prompt": text(rng, G_PROMPT),
                "max_tokens": G_MAX_TOKENS,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            items.append(WorkItem(at, "/v1/completions", body, session=which))
        return Workload(f"lora-{adapters}", items)

    return make


def _lora_router(data: dict[str, Any], tm: TimeModel) -> None:
    # Adapter names are model names the pool serves besides its own; the router is told the load.
    data["strict_model"] = False
    data["engine"] = {**data["engine"], "lora_load_ms": G_LOAD_S * 1000.0 / tm.speed}


def _lora_scenario(key: str, adapters: int, rate: float) -> Scenario:
    return Scenario(
        key,
        f"({key}) 4 × prefill-decode, {adapters} LoRA adapters (Zipf), {G_MAX_LORAS} slots per pod",
        _lora_pool(adapters),
        _lora_traffic(adapters),
        ["round-robin", "least-loaded", "cache-aware", "pd-router"],
        rate=rate,
        requests=800,
        params=(
            f"{adapters} adapters, Zipf (1/rank), {G_BASE_SHARE:.0%} base model; unshared prompts of "
            f"{G_PROMPT} tok, max_tokens {G_MAX_TOKENS}; {G_MAX_LORAS} adapter slots/pod, "
            f"load {G_LOAD_S * 1000:g} ms (stalls the step); {G_POOL_BLOCKS * 16} KV tokens/pod"
        ),
        configure=_lora_router,
    )


def _pd_pool(tm: TimeModel) -> list[EngineSpec]:
    return [
        EngineSpec(f"pod-{i}", "prefill-decode", link="rack-a", num_gpu_blocks=PD_POOL_BLOCKS, time=tm)
        for i in range(4)
    ]


def _two_racks(tm: TimeModel) -> list[EngineSpec]:
    return [
        EngineSpec(f"{role}-{rack}", role, link=f"rack-{rack}", num_gpu_blocks=C_BLOCKS, time=tm)
        for role in ("prefill", "decode")
        for rack in ("a", "b")
    ]


def _one_rack_pd(tm: TimeModel) -> list[EngineSpec]:
    return [
        EngineSpec(f"{role}-{i}", role, link="rack-a", num_gpu_blocks=E_BLOCKS, time=tm)
        for role in ("prefill", "decode")
        for i in range(2)
    ]


def _shared(prefixes: int, prefix_tokens: int, suffix: int, max_tokens: int) -> Callable[..., Workload]:
    def make(n: int, rate: float, seed: int) -> Workload:
        return shared_prefix(
            n,
            n_prefixes=prefixes,
            prefix_tokens=prefix_tokens,
            suffix_tokens=suffix,
            max_tokens=max_tokens,
            rate=rate,
            seed=seed,
        )

    return make


def _chat(n: int, rate: float, seed: int, phases: list[Phase] | None = None) -> Workload:
    """(b)'s conversations; with ``phases``, sessions start at their rates, turns at ``rate``."""
    return multi_turn(
        max(1, n // B_TURNS),
        turns=B_TURNS,
        system_tokens=B_SYSTEM,
        user_tokens=B_USER,
        answer_tokens=B_ANSWER,
        rate=rate,
        seed=seed,
        phases=phases,
    )


def _bursts(rate: float) -> list[Phase]:
    """One cycle of (d)'s profile at base ``rate`` (requests/s): base, 1.5× burst, base, 2× burst."""
    out = []
    for factor in D_BURSTS:
        out += [Phase(D_BASE_S, rate), Phase(D_BURST_S, rate * factor)]
    return out


def _bursty_chat(n: int, rate: float, seed: int) -> Workload:
    return _chat(n, D_TURN_PACE, seed, _bursts(rate))


def _long_outputs(n: int, rate: float, seed: int) -> Workload:
    shape = Phase(0.0, rate, None, E_PROMPT, E_SHARED, E_PREFIXES, E_OUT_LOW, E_OUT_HIGH)
    return _poisson(n, rate, seed, "long-outputs", shape)


def _poisson(n: int, rate: float, seed: int, name: str, shape: Phase) -> Workload:
    """Exactly ``n`` requests of ``shape`` (its duration ignored), Poisson at ``rate``: arrivals
    over a longer stretch than needed, cut at ``n``."""
    wl = phased([replace(shape, duration_s=1.5 * n / rate + 1.0, rate=rate)], seed=seed, name=name)
    wl.items = wl.items[:n]
    return wl


SCENARIOS: dict[str, Scenario] = {
    "a": Scenario(
        "a",
        "(a) 4 × prefill-decode, shared-prefix",
        _pd_pool,
        _shared(A_PREFIXES, A_PREFIX_TOKENS, A_SUFFIX_TOKENS, A_MAX_TOKENS),
        ["round-robin", "least-loaded", "cache-aware", "pd-router", "reference"],
        rate=40.0,
        requests=600,
        params=(
            f"{A_PREFIXES} prefixes × {A_PREFIX_TOKENS} tok + {A_SUFFIX_TOKENS} tok question, "
            f"max_tokens {A_MAX_TOKENS}; {PD_POOL_BLOCKS * 16} KV tokens/pod"
        ),
    ),
    "b": Scenario(
        "b",
        "(b) 4 × prefill-decode, multi-turn chat",
        _pd_pool,
        _chat,
        ["round-robin", "least-loaded", "cache-aware", "pd-router", "reference"],
        rate=50.0,
        requests=600,
        params=(
            f"{B_TURNS} turns/session, system {B_SYSTEM} tok, user {B_USER} tok/turn, "
            f"answer {B_ANSWER} tok; {PD_POOL_BLOCKS * 16} KV tokens/pod"
        ),
    ),
    "c": Scenario(
        "c",
        "(c) 2 prefill + 2 decode on 2 racks, long shared prefixes",
        _two_racks,
        _shared(C_PREFIXES, C_PREFIX_TOKENS, C_SUFFIX_TOKENS, C_MAX_TOKENS),
        ["round-robin", "independent", "cache-aware", "pd-router", "reference"],
        rate=10.0,
        requests=300,
        links=C_LINKS,
        params=(
            f"{C_PREFIXES} prefixes × {C_PREFIX_TOKENS} tok + {C_SUFFIX_TOKENS} tok, max_tokens "
            f"{C_MAX_TOKENS}; KV {KV_BYTES_PER_TOKEN // 1024} KiB/token; links in-rack "
            f"{C_LINKS['same']['bandwidth_gbytes_per_s']:g} GB/s + {C_LINKS['same']['latency_ms']:g} ms, "
            f"cross-rack {C_LINKS['default']['bandwidth_gbytes_per_s']:g} GB/s + "
            f"{C_LINKS['default']['latency_ms']:g} ms; {C_BLOCKS * 16} KV tokens/pod"
        ),
    ),
    "d": Scenario(
        "d",
        "(d) 4 × prefill-decode, bursty multi-turn chat",
        _pd_pool,
        _bursty_chat,
        ["round-robin", "least-loaded", "cache-aware", "pd-router", "reference"],
        rate=28.0,
        requests=720,
        params=(
            f"the chat of (b); sessions start at the base rate for {D_BASE_S:g} s, then "
            f"{D_BURSTS[0]:g}× for {D_BURST_S:g} s, base, {D_BURSTS[1]:g}× for {D_BURST_S:g} s, "
            f"repeated (rate = base, in requests/s); {PD_POOL_BLOCKS * 16} KV tokens/pod"
        ),
    ),
    "e": Scenario(
        "e",
        "(e) 2 prefill + 2 decode, long outputs (decode-bound)",
        _one_rack_pd,
        _long_outputs,
        ["round-robin", "least-loaded", "cache-aware", "pd-router", "pd-router-rigid", "reference"],
        rate=22.0,
        requests=300,
        links={"same": C_LINKS["same"]},
        params=(
            f"{E_PREFIXES} prefixes × {E_SHARED} tok + {E_PROMPT - E_SHARED} tok, max_tokens "
            f"{E_OUT_LOW}–{E_OUT_HIGH}; one rack ({C_LINKS['same']['bandwidth_gbytes_per_s']:g} GB/s); "
            f"{E_BLOCKS * 16} KV tokens/pod"
        ),
    ),
}
SCENARIOS["g"] = _lora_scenario("g", 8, 30.0)
SCENARIOS["h"] = _lora_scenario("h", 32, 30.0)
# (f): (c) as the router sees it when an operator labels racks and configures no link speeds.
SCENARIOS["f"] = replace(
    SCENARIOS["c"],
    key="f",
    title="(f) (c) with only link labels configured",
    router_links={},
    params=(
        f"(c)'s pool and traffic; the links are (c)'s (cross-rack "
        f"{C_LINKS['default']['bandwidth_gbytes_per_s']:g} GB/s) but the router is told only "
        "each engine's rack label: its link section is the defaults"
    ),
)


# -- the router's configuration --------------------------------------------------------------


def router_links(scn: Scenario, speed: float) -> dict[str, Any]:
    """The link table the router is configured with (``scaled_links`` of what it is told)."""
    return scaled_links(scn.links if scn.router_links is None else scn.router_links, speed)


def scaled_links(links: dict[str, Any], speed: float) -> dict[str, Any]:
    """Link costs in wall-clock terms at ``speed``.

    The simulator divides compute time by ``speed`` but not KV-transfer time, so the link table is
    scaled the same way here (bandwidth × speed, latency ÷ speed) to keep transfer/compute ratios
    physical. Router and simulator get the same scaled table.
    """
    out: dict[str, Any] = {}
    for name in ("same", "default"):
        if name in links:
            cost = links[name]
            out[name] = {
                "latency_ms": cost["latency_ms"] / speed,
                "bandwidth_gbytes_per_s": cost["bandwidth_gbytes_per_s"] * speed,
            }
    return out


def config_data(
    endpoints: Sequence[tuple[str, str, str, str]],
    tm: TimeModel,
    links: dict[str, Any],
    policy: str | dict[str, Any] = "joint",
    *,
    misconfigure: float = 1.0,
    learn: bool | None = None,
) -> dict[str, Any]:
    """The router's configuration (before validation) for a simulated cluster.

    ``endpoints``: ``(name, address, role, link)`` per engine; ``policy``: ``picker.policy``, or
    the whole ``picker`` section; ``misconfigure``: the configured engine claims this × the
    simulator's real speed (3 = the engines are three times slower than the operator wrote);
    ``learn``: ``signals.learn`` (None: the router's default, as a user runs it)."""
    speed = tm.speed
    data: dict[str, Any] = {
        "model": "sim-model",
        "endpoints": [
            {"address": address, "role": role, "link": link, "name": name}
            for name, address, role, link in endpoints
        ],
        "engine": claimed_engine(engine_model_for(tm, KV_BYTES_PER_TOKEN), misconfigure),
        "signals": {"tick_ms": max(50.0, 1000.0 / speed)},
        # SLOs scale with simulated time so the TTFT-vs-TPOT balance of the cost does not change.
        "slo": {"ttft_ms": 500.0 / speed, "tpot_ms": 50.0 / speed},
        "scrape": {"interval_ms": max(50.0, 200.0 / speed), "stale_after_ms": 5000},
        "proxy": {"port": 0, "debug_headers": True},
        "picker": {"policy": policy} if isinstance(policy, str) else dict(policy),
    }
    if learn is not None:
        data["signals"]["learn"] = learn
    if links:
        data["links"] = links
    return data


def slower(tm: TimeModel, factor: float) -> TimeModel:
    """An engine ``factor`` × slower: every step cost scaled (an older GPU beside newer ones)."""
    return replace(
        tm,
        step_base_s=tm.step_base_s * factor,
        prefill_s_per_token=tm.prefill_s_per_token * factor,
        decode_s_per_seq=tm.decode_s_per_seq * factor,
        kv_s_per_token=tm.kv_s_per_token * factor,
    )


def with_slow_pods(scn: Scenario, factor: float) -> Scenario:
    """``scn`` on a mixed fleet: the second half of each role's pods ``factor`` × slower (a role's
    only pod stays as it is). The router is told nothing: its configured engine is the fast pods'."""
    if factor <= 0:
        raise ValueError(f"the slow pods' factor must be > 0, got {factor}")

    def specs(tm: TimeModel) -> list[EngineSpec]:
        pods = scn.specs(tm)
        per_role = Counter(p.role for p in pods)
        seen: Counter[str] = Counter()
        mixed = []
        for pod in pods:
            seen[pod.role] += 1
            slow = seen[pod.role] > (per_role[pod.role] + 1) // 2
            mixed.append(replace(pod, time=slower(pod.time, factor)) if slow else pod)
        return mixed

    return replace(scn, specs=specs, title=f"{scn.title}, half the pods {factor:g}× slower")


def with_goodput_slo(scn: Scenario) -> Scenario:
    """``scn`` with every request carrying the goodput's objectives as its own SLO (``x-slo-*``
    headers): the router is told what it is judged by (its SLO step routes to meet them and refuses
    what no route is predicted to), the way a client that states its SLO is served."""
    ttft_ms, tpot_ms = f"{scn.goodput_ttft_s * 1000:g}", f"{scn.goodput_tpot_s * 1000:g}"

    def workload(n: int, rate: float, seed: int) -> Workload:
        wl = scn.workload(n, rate, seed)
        for item in wl.items:
            item.tag = GOODPUT_CLASS
            item.headers.update({"x-slo-ttft-ms": ttft_ms, "x-slo-tpot-ms": tpot_ms})
        return wl

    return replace(
        scn,
        workload=workload,
        title=f"{scn.title}, the goodput's SLO told",
        slo_classes={GOODPUT_CLASS: (scn.goodput_ttft_s, scn.goodput_tpot_s)},
    )


def claimed_engine(true: dict[str, Any], factor: float) -> dict[str, Any]:
    """The engine section of an operator who believes the engines ``factor`` × faster."""
    if factor == 1.0:
        return true
    slower = ("decode_step_base_ms", "decode_ms_per_seq", "decode_ms_per_1k_kv_tokens")
    return {
        **true,
        "prefill_tokens_per_s": true["prefill_tokens_per_s"] * factor,
        **{key: true[key] / factor for key in slower},
    }


# Bench label -> the ``picker`` section (pd-router is the joint choice; the others are its
# baselines). ``reference`` keeps the joint picker's configuration but its pair picker is replaced
# by ``ReferencePicker`` (bench only).
POLICIES: dict[str, dict[str, Any]] = {
    "round-robin": {"policy": "round-robin"},
    "least-loaded": {"policy": "least-loaded"},
    "independent": {"policy": "independent"},
    # The SGLang / vLLM routers' default policy and the llm-d router's default scoring profile.
    "cache-aware": {"policy": "cache-aware"},
    "weighted-score": {"policy": "weighted-score"},
    "pd-router": {"policy": "joint"},
    # Without role-flexible P/D (the default lets prefill pods serve whole requests).
    "pd-router-rigid": {"policy": "joint", "prefill_may_decode": False},
    # With --misconfigure: the online model's corrections on, and off (the default).
    "pd-router-learning": {"policy": "joint"},
    "pd-router-static": {"policy": "joint"},
    "reference": {"policy": "joint"},
}


# -- measures ----------------------------------------------------------------------------------


def goodput(summary: Summary, ttft_s: float, tpot_s: float) -> float:
    """Share of all requests (failed ones count as missed) with TTFT ≤ ``ttft_s`` and TPOT ≤
    ``tpot_s`` (a one-token answer has no TPOT: only its TTFT counts)."""
    if not summary.results:
        return float("nan")
    good = sum(1 for r in summary.ok if r.ttft_s <= ttft_s and (r.tpot_s != r.tpot_s or r.tpot_s <= tpot_s))
    return good / len(summary.results)


# -- the matrix: generated scenarios over pool sizes, loads and request mixes -------------------


@dataclass(frozen=True)
class Mix:
    """A request shape: ``prompt_tokens`` of prompt, the first ``shared_tokens`` of it one of
    ``prefixes_per_pod`` × pods shared prefixes, ``max_tokens``..``max_tokens_high`` out."""

    name: str
    prompt_tokens: int
    shared_tokens: int
    max_tokens: int
    max_tokens_high: int
    prefixes_per_pod: int = 4


MIXES: dict[str, Mix] = {
    "chat": Mix("chat", 1536, 1024, 32, 96),  # a long shared system prompt, short answers
    "rag": Mix("rag", 3072, 2048, 8, 24, prefixes_per_pod=2),  # long shared documents, short answers
    "long": Mix("long", 768, 256, 192, 384),  # short prompts, long answers: decode-bound
}
MATRIX_BLOCKS = 2048  # 32k KV tokens per pod


def nominal_capacity(tm: TimeModel, mix: Mix, shape: str, pods: int) -> float:
    """Requests/s the pool serves with every shared prefix cached where it is computed and every
    decode batch full (``max_running``): the yardstick the matrix's loads are multiples of, not a
    bound. ``shape``: ``pd`` (every pod prefill-decode) or ``split`` (half prefill, half decode)."""
    answer = (mix.max_tokens + mix.max_tokens_high) / 2.0
    context = mix.prompt_tokens + answer / 2.0
    prefill_s = (mix.prompt_tokens - mix.shared_tokens) * tm.prefill_s_per_token
    batch = tm.max_running
    step = tm.step_base_s + batch * (tm.decode_s_per_seq + tm.kv_s_per_token * context)
    decode_s = answer * step / batch
    if shape == "split":
        half = max(1, pods // 2)
        return tm.speed * min(half / prefill_s, (pods - half) / decode_s)
    return tm.speed * pods / (prefill_s + decode_s)


def matrix_scenario(shape: str, pods: int, mix: Mix, load: float, seconds: float) -> Scenario:
    """A generated scenario: ``pods`` pods of ``shape`` (see ``nominal_capacity``) in one rack, ``mix``
    requests arriving (Poisson) at ``load`` × the nominal capacity for about ``seconds``."""
    if shape not in ("pd", "split"):
        raise ValueError(f"shape must be pd or split, got {shape!r}")
    rate = load * nominal_capacity(TimeModel(), mix, shape, pods)
    requests = max(1, round(rate * seconds))
    n_prefixes = mix.prefixes_per_pod * pods

    def specs(tm: TimeModel) -> list[EngineSpec]:
        if shape == "pd":
            roles = ["prefill-decode"] * pods
        else:
            roles = ["prefill"] * max(1, pods // 2) + ["decode"] * (pods - max(1, pods // 2))
        return [
            EngineSpec(f"{role}-{i}", role, link="rack-a", num_gpu_blocks=MATRIX_BLOCKS, time=tm)
            for i, role in enumerate(roles)
        ]

    def workload(n: int, rate: float, seed: int) -> Workload:
        shape = Phase(
            0.0,
            rate,
            prompt_tokens=mix.prompt_tokens,
            shared_tokens=mix.shared_tokens,
            n_prefixes=n_prefixes,
            max_tokens=mix.max_tokens,
            max_tokens_high=mix.max_tokens_high,
        )
        return _poisson(n, rate, seed, f"matrix-{mix.name}", shape)

    kind = "prefill-decode" if shape == "pd" else "P/D split"
    return Scenario(
        f"{shape}{pods}-{mix.name}-{load:g}",
        f"{pods} × {kind}, {mix.name}, {load:g}× nominal capacity",
        specs,
        workload,
        ["least-loaded", "pd-router"],
        rate=rate,
        requests=requests,
        links={"same": {"latency_ms": 0.05, "bandwidth_gbytes_per_s": 25.0}},
        params=(
            f"{mix.prompt_tokens} tok prompts ({mix.shared_tokens} shared, {n_prefixes} prefixes), "
            f"{mix.max_tokens}–{mix.max_tokens_high} out; nominal capacity {rate / load:.1f} req/s"
        ),
    )


# (i)/(j)/(k) are sized by ``nominal_capacity``, so they join the table once it is defined.
for _key, _load in SLO_LOADS.items():
    SCENARIOS[_key] = _slo_scenario(_key, _load)
