"""The one typed configuration object: a pool, its SLOs, scoring, limits and listeners.

Loaded from YAML, overridden by ``--set dotted.path=value`` flags, validated at start. Unknown
keys are errors and every error names the field and the bad value, e.g.
``endpoints.1.role: must be one of prefill, decode, prefill-decode, got 'both'``.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from router.control.checks import CHECKS
from router.request.slo import MAX_SLO_MS
from router.request.types import RequestLimits
from router.scheduling.costmodel.policies import POLICIES
from router.scheduling.costmodel.registry import DEFAULT_WEIGHTS, MODEL_WEIGHTS, load_term

Role = Literal["prefill", "decode", "prefill-decode"]
# picker.policy accepts the pair pickers there are, by their names in POLICIES.
PolicyName = Literal[tuple(POLICIES)]  # type: ignore[valid-type]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]


def _one_of(value: str | None, file: str | None, name: str) -> None:
    if value is not None and file is not None:
        raise ValueError(f"{name} and {name}_file: set one, not both")


def read_secret(path: str | None, field: str) -> str | None:
    """The secret in ``path`` (a mounted Secret: one value, a trailing newline dropped); None
    without a path. Raises ``ConfigError`` naming ``field`` when the file cannot be used."""
    if path is None:
        return None
    try:
        value = Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{field}: cannot read {path}: {exc}") from None
    if not value:
        raise ConfigError(f"{field}: {path} is empty")
    return value


@dataclass(frozen=True, slots=True)
class Secrets:
    """The secrets the configuration names, inline or read from their files."""

    metrics_token: str | None
    admin_token: str | None
    redis_password: str | None

    def __repr__(self) -> str:  # never in a log line or a traceback
        return "Secrets(<hidden>)"


class ConfigError(ValueError):
    """An invalid configuration; the message names every bad field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KVEventsConfig(_Strict):
    """Where an engine publishes vLLM KV events (``--kv-events-config``)."""

    endpoint: str = Field(description="the engine's ZMQ PUB endpoint, e.g. tcp://10.0.0.5:5557")
    replay_endpoint: str | None = Field(None, description="its ZMQ ROUTER replay endpoint, if enabled")


class EndpointConfig(_Strict):
    """One engine (one rank) of the static pool."""

    address: str = Field(description="ip:port of the engine's OpenAI server")
    role: Role = Field(
        "prefill-decode",
        description="prefill: the prompt leg of a P/D pair; decode: the answer (and a local prefill); "
        "prefill-decode: either, or both in one",
    )
    group: str | None = Field(None, description="TP/PP/LWS group; default: the endpoint is its own group")
    link: str = Field("default", description="topology label used by the link-cost scorer")
    name: str | None = Field(None, description="endpoint id; default: the address")
    kv_events: KVEventsConfig | None = Field(None, description="precise mode: the engine's KV events")
    rank: Annotated[int, Field(ge=0)] = Field(0, description="rank within its group; 0 is the leader")
    group_size: Annotated[int, Field(ge=1)] | None = Field(
        None, description="ranks its group needs (default: the group's configured members)"
    )
    revision: str | None = Field(None, description="artifact revision; every rank of a group must agree")
    incarnation: str | None = Field(
        None, description="changes when the rank restarts (a new value starts a new group epoch)"
    )
    serves: bool = Field(True, description="false for a worker rank that holds a rank but serves no HTTP")
    sidecar: bool = Field(
        False,
        description="a P/D sidecar (pd-router sidecar) listens on this address in front of the "
        "engine: behind Envoy, a prefill -> decode pair may end here (extproc.pd_pairs: auto)",
    )

    @field_validator("address")
    @classmethod
    def _ip_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("must be ip:port")
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            raise ValueError("must be ip:port with a literal IP address") from None
        return value

    @property
    def id(self) -> str:
        return self.name or self.address


# An objective beyond an hour is a mistake, not a latency target (as the x-slo-* headers' limit).
SloMs = Annotated[float, Field(gt=0, le=MAX_SLO_MS)]


class ObjectiveSLOConfig(_Strict):
    """An InferenceObjective's default SLOs; a request's ``x-slo-*`` header wins per measure."""

    ttft_ms: SloMs | None = Field(None, description="time to first token objective (ms); unset: none")
    tpot_ms: SloMs | None = Field(None, description="time per output token objective (ms); unset: none")


class SLOConfig(_Strict):
    """The latency objectives: what shedding, admission and the replica recommendation aim for.
    They do not set the routing trade (``picker.tpot_weight``, ``picker.kv_penalty_tokens`` do).
    Requests may carry their own (``x-slo-ttft-ms``/``x-slo-tpot-ms``, or their objective's
    ``objectives`` entry): the picker then prefers routes predicted to meet them (docs/routing.md,
    Per-request SLOs)."""

    ttft_ms: Positive = Field(
        2000.0,
        description="time to first token target (ms): shedding (picker.shed_ttft_factor), the prefill "
        "role's load and replicas; a decision's cost is reported in units of it",
    )
    tpot_ms: Positive = Field(
        100.0, description="time per output token target (ms): the decode role's load and replicas"
    )
    per_request: bool = Field(
        True,
        description="route requests with their own SLOs to meet them; false: route every request on "
        "cost alone (their SLOs are still validated and counted)",
    )
    admission: Literal["reject", "hold", "off"] = Field(
        "hold",
        description="a request whose SLO no route is predicted to meet: reject (429 if sheddable, "
        "else 503 slo_unattainable), hold (with flow_control.enabled: held, earliest deadline first, "
        "until its TTFT objective is spent, then refused as reject; without flow control: reject) or "
        "off (routed on cost, late); requests without an SLO are never refused by this",
    )
    fit: Literal["reserve", "cost"] = Field(
        "reserve",
        description="among routes meeting a request's SLO: reserve (with flow_control.enabled, a "
        "request whose TTFT objective is at least twice the tightest recent one leaves the routes "
        "fast enough for that one to tight requests while a slower route meets its own; then the "
        "cheapest) or cost (the cheapest)",
    )
    exploration: Annotated[float, Field(ge=0, le=1)] = Field(
        0.02,
        description="share of requests with an SLO routed on cost alone, admission included, so the "
        "predictions keep being tested where the SLO logic would not send traffic",
    )
    objectives: dict[Annotated[str, Field(min_length=1)], ObjectiveSLOConfig] = Field(
        default_factory=dict,
        description="default SLOs per InferenceObjective name (the x-gateway-inference-objective header)",
    )
    default_objective: str | None = Field(
        None,
        description="the objective (a key of slo.objectives) whose SLOs hold for requests that name "
        "none, counted under its name; unset: those carry only what their x-slo-* headers say",
    )

    @model_validator(mode="after")
    def _default_is_an_objective(self) -> SLOConfig:
        if self.default_objective is not None and self.default_objective not in self.objectives:
            known = ", ".join(sorted(self.objectives)) or "none"
            raise ValueError(
                f"default_objective {self.default_objective!r} is not among slo.objectives "
                f"(configured: {known})"
            )
        return self


class EngineModelConfig(_Strict):
    """How fast an engine is, for predicting seconds; match your hardware (or the simulator)."""

    prefill_tokens_per_s: Positive = Field(
        20000.0, description="prompt tokens one engine prefills per second"
    )
    decode_step_base_ms: NonNegative = Field(
        4.0, description="fixed time of one engine step (ms), whatever the batch"
    )
    pd_leg_overhead_ms: NonNegative = Field(
        3.0, description="fixed cost of a P/D pair's extra prefill leg (HTTP exchange, second tokenisation)"
    )
    decode_ms_per_seq: NonNegative = Field(0.2, description="step time added per running sequence (ms)")
    decode_ms_per_1k_kv_tokens: NonNegative = Field(
        0.2, description="step time added per 1000 tokens of KV in use (ms)"
    )
    kv_bytes_per_token: Annotated[int, Field(gt=0)] = Field(
        131072, description="KV cache bytes per token (all layers): what a P/D transfer moves"
    )
    lora_load_ms: NonNegative = Field(
        100.0,
        description="time to load a LoRA adapter into an engine's GPU slot (ms): what a request for "
        "an adapter pays on a pod that does not hold it",
    )
    lora_evict_ms: NonNegative = Field(
        100.0,
        description="cost of evicting another adapter on a pod whose adapter slots are all taken "
        "(max_lora) (ms): the reload the evicted adapter's next request pays",
    )
    typical_prompt_tokens: Positive = Field(
        512.0,
        description="the prompt size assumed for queued requests the router did not route, at start; "
        "then a running mean of the prompts it sees",
    )


class LinkCostConfig(_Strict):
    """One link class: a KV transfer takes latency + bytes / bandwidth."""

    latency_ms: NonNegative = Field(description="fixed latency of one KV transfer (ms)")
    bandwidth_gbytes_per_s: Positive = Field(description="transfer bandwidth in GB/s (10^9 bytes per second)")

    def cost(self) -> tuple[float, float]:
        """(latency in seconds, bandwidth in bytes/s): the units the link scorer works in."""
        return self.latency_ms / 1000.0, self.bandwidth_gbytes_per_s * 1e9


class LinkPairConfig(LinkCostConfig):
    between: tuple[str, str] = Field(description="two link labels, in either order")


class LinksConfig(_Strict):
    """KV-transfer cost from a prefill pod to a decode pod, by their endpoints' ``link`` labels."""

    same: LinkCostConfig = Field(
        LinkCostConfig(latency_ms=0.05, bandwidth_gbytes_per_s=50.0),
        description="between endpoints with the same link label",
    )
    default: LinkCostConfig = Field(
        LinkCostConfig(latency_ms=0.5, bandwidth_gbytes_per_s=12.5),
        description="between different labels that no pair names",
    )
    pairs: list[LinkPairConfig] = Field([], description="the cost between two particular labels")


class PickerConfig(_Strict):
    """How each request's (prefill, decode) pair is chosen."""

    max_wait_skew_ms: NonNegative = Field(
        1000.0,
        description="locality credit only on pods whose predicted queue wait is within this of the least",
    )
    prefill_rate_window_ms: Positive = Field(
        1000.0,
        description="the window of each pod's recent prompt-token rate: the share of its time its "
        "prompts take stretches the TPOT predicted for answers there, which per-request TPOT "
        "objectives are held to",
    )
    kv_soft_threshold: Annotated[float, Field(gt=0, lt=1)] = Field(
        0.85,
        description="KV use (with the request) above this share of a decode pod's capacity starts to "
        "cost, the prefill of kv_penalty_tokens at full (decode-only pods: a pod that also computes "
        "prompts keeps the prefix it holds instead)",
    )
    kv_penalty_tokens: Positive = Field(
        10000.0,
        description="what a decode pod exactly full of KV costs, as the time to prefill this many "
        "tokens (the cached prefixes the pressure evicts are recomputed when asked for again)",
    )
    tpot_weight: Positive = Field(
        10.0,
        description="seconds of TTFT one second of predicted time per output token costs a "
        "100-token answer; the load term scales it with a request's expected answer (max_tokens "
        "times the share answers use, counted within 64..1024 tokens), a prefill's stall on running "
        "decodes is priced at it per typical answer; not taken from the SLOs, so how tight they are "
        "set does not change the routing trade",
    )
    allow_local_prefill: bool = Field(
        True,
        description="a decode pod may compute the prompt itself when that is cheaper; false: always a "
        "P/D pair while a prefill pod is a candidate (so prefill pods never serve whole requests "
        "either, whatever prefill_may_decode says)",
    )
    prefill_may_decode: bool = Field(
        True,
        description="prefill pods may serve whole requests when that is cheaper (role-flexible P/D: "
        "a vLLM prefill pod answers a request without kv_transfer_params like any engine); false "
        "for prefill engines that cannot decode",
    )
    pair_waits_for_decode_queue: bool = Field(
        True,
        description="a pair's decode leg waits for what is left of its decode pod's queued prompts "
        "when the KV arrives, and is priced so",
    )
    policy: PolicyName = Field(
        "joint", description="how the pair is chosen; the others are baselines, for comparison"
    )
    fallbacks: Annotated[int, Field(ge=0, le=16)] = Field(
        2, description="other pods per leg the proxy tries, in cost order, when an engine fails"
    )
    shed_ttft_factor: Positive = Field(
        2.0, description="shed sheddable requests when the best predicted TTFT exceeds this × SLO"
    )
    compiled: bool = Field(
        True,
        description="compute the built-in cost terms, the cost matrix and the joint choice in "
        "compiled loops when numba (the fast extra) is installed: the same decisions, a fraction of "
        "the CPU; false: numpy only. Without numba, or with a custom cost term, numpy is used anyway",
    )


class LimitsConfig(_Strict):
    """What a request may be, and how its size is estimated without a tokenizer."""

    max_body_bytes: Annotated[int, Field(gt=0)] = Field(
        4 * 1024 * 1024, description="a larger request body is refused (413)"
    )
    max_prompt_tokens: Annotated[int, Field(gt=0)] = Field(
        131072,
        description="a prompt estimated (or counted) longer is refused (413); for a batch of "
        "prompts, all of them together",
    )
    default_max_tokens: Annotated[int, Field(gt=0)] = Field(
        256,
        description="the answer length assumed for a request without max_tokens (KV need, signals); "
        "not sent upstream",
    )
    block_tokens: Annotated[int, Field(gt=0)] = Field(
        16, description="prompt tokens per prefix-index block; the engines' --block-size in precise mode"
    )
    chars_per_token: Positive = Field(
        4.0, description="prompt characters per token, to estimate tokens (signals.learn corrects it)"
    )


class ScrapeConfig(_Strict):
    """Polling every endpoint's ``/metrics`` for its load and KV use."""

    interval_ms: Positive = Field(200.0, description="time between scrape rounds (±10% jitter)")
    timeout_ms: Positive = Field(1000.0, description="a scrape without an answer within this fails")
    stale_after_ms: Positive = Field(
        2500.0, description="an endpoint whose last good scrape is older is not a candidate"
    )
    eject_after_failures: Annotated[int, Field(ge=1)] = Field(
        3, description="failed scrapes or requests in a row that eject an endpoint until a good scrape"
    )
    engine_metrics_required: bool = Field(
        True,
        description="false: an endpoint that answers /metrics without vLLM series (or with an HTTP "
        "error) stays a candidate with unknown load; only one that cannot be reached is ejected "
        "(non-vLLM backends, the conformance suite's echo servers)",
    )


class PreciseConfig(_Strict):
    """Precise prefix locality from the engines' own KV events (vLLM-exact block hashes)."""

    tokenizer: str = Field(
        description="path of the model's tokenizer.json (local file; nothing is downloaded)"
    )
    hash_algo: Literal["sha256", "sha256_cbor"] = Field(
        "sha256", description="the engines' --prefix-caching-hash-algo"
    )
    python_hash_seed: str | None = Field(None, description="the engines' PYTHONHASHSEED, if set")
    add_special_tokens: bool = Field(
        True, description="as the engines' completions API (BOS for Llama-style models)"
    )
    chat_template: str | None = Field(
        None,
        description="tokenizer_config.json (or a .jinja file) whose chat template the engines apply to "
        "chat requests; without it, chat prompts get no precise keys and use the approximate index",
    )
    rebuild_after_s: Positive = Field(
        30.0, description="after a purge, how long events must flow before an engine counts as known again"
    )
    replay_timeout_s: Positive = Field(
        2.0, description="a KV-event replay not done within this purges the engine's entries"
    )


class RedisConfig(_Strict):
    """Share the prefix index between router replicas through Redis (a local mirror serves pick())."""

    url: str = Field("redis://127.0.0.1:6379/0", description="redis:// URL")
    password_file: str | None = Field(
        None,
        description="a file holding the Redis password (a mounted Secret), read at start; the URL "
        "then carries none",
    )
    namespace: str = Field(
        "pdr", description="key prefix (index and shared gate results); one per pool sharing a Redis"
    )
    ttl_s: Positive = Field(600.0, description="entries expire this long after their last write")
    lookup_timeout_ms: Positive = Field(50.0, description="past this, a request routes on the local view")
    share_load_ms: Annotated[float, Field(ge=0, le=10_000, allow_inf_nan=False)] = Field(
        50.0,
        description="replicas exchange their in-flight reservations per endpoint at least this often "
        "(also when a pick reserves more, at most every 5 ms, and before each pick, while it knows of "
        "others; what a replica gives back goes with its next exchange), so each routes on what all "
        "have in flight; a replica silent for three intervals drops out (0: each sees only its own)",
    )
    push: bool = Field(
        True,
        description="replicas also publish their index writes and reservations (Redis pub/sub) and "
        "apply each other's as they come, so a pick waits for no Redis round trip and each replica's "
        "index is held to every pod's KV cache as one replica's is (index lookups still ask Redis for "
        "one ttl_s after a replica starts while Redis holds older blocks, and while the subscription "
        "is down); each replica then does every other's share of that work. false: each pick asks "
        "Redis instead (less CPU with many replicas, routing further from one replica's: "
        "docs/deployment.md)",
    )


class IndexConfig(_Strict):
    """Prefix locality: which endpoint holds which prompt blocks."""

    capacity_blocks_per_endpoint: Annotated[int, Field(gt=0)] = Field(
        65536,
        description="blocks remembered per endpoint (LRU); an endpoint whose engine reports its KV "
        "cache size (vllm:cache_config_info) is held to that size too",
    )
    redis: RedisConfig | None = Field(None, description="share the approximate index through Redis")
    precise: PreciseConfig | None = Field(
        None, description="enable precise mode (needs kv_events per endpoint)"
    )


class SessionsConfig(_Strict):
    """Session affinity (soft): a conversation's home pods count as holding its last prompt."""

    enabled: bool = Field(
        True,
        description="credit a session's home pods (x-session-id) with its last prompt as cached, where "
        "the prefix index knows less; requests without a session route as without this",
    )
    max_entries: Annotated[int, Field(gt=0)] = Field(
        100_000, description="sessions remembered (least recently used forgotten first)"
    )
    ttl_s: Positive = Field(600.0, description="a session's home is forgotten this long after its last turn")
    user_weight: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = Field(
        0.0,
        description="take the body's 'user' as a session when no x-session-id is sent, crediting this "
        "share of its last prompt (a user may hold several conversations; 0: ignore 'user')",
    )


class _TlsFiles(_Strict):
    cert_file: str | None = Field(None, description="PEM certificate; unset: a self-signed one is generated")
    key_file: str | None = Field(None, description="PEM private key of cert_file")
    min_version: Literal["1.2", "1.3"] = Field("1.2", description="the oldest TLS version accepted")
    reload_interval_s: Positive = Field(5.0, description="how often changed certificate files are reloaded")

    @model_validator(mode="after")
    def _pair(self) -> _TlsFiles:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (neither: self-signed)")
        return self


class TlsConfig(_TlsFiles):
    """TLS on the ext_proc port (ALPN h2), on by default with a self-signed certificate as the
    reference picker does. The gRPC health port stays cleartext: kubelet's gRPC probes do not speak
    TLS."""

    enabled: bool = Field(True, description="serve TLS on the ext_proc port (false: cleartext h2c only)")
    accept_cleartext: bool = Field(
        True,
        description="also serve h2c clients on the same port (told apart by their first byte); "
        "false refuses them",
    )


class HttpTlsConfig(_TlsFiles):
    """HTTPS on the proxy's port (ALPN http/1.1), when asked for."""

    enabled: bool = Field(False, description="serve HTTPS instead of HTTP")


class ProxyConfig(_Strict):
    """The OpenAI-compatible HTTP proxy: completions and chat, ``/v1/models``, ``/health`` and
    ``/metrics``."""

    enabled: bool = Field(True, description="serve the proxy")
    host: str = Field("127.0.0.1", description="listen address (0.0.0.0 in a pod)")
    port: Annotated[int, Field(ge=0, lt=65536)] = Field(8000, description="listen port (0: any free one)")
    connect_timeout_s: Positive = Field(2.0, description="connecting to an engine fails after this")
    request_timeout_s: Positive = Field(
        600.0, description="one engine leg, the whole streamed answer included, fails after this"
    )
    drain_timeout_s: NonNegative = Field(30.0, description="on shutdown, how long open requests may finish")
    debug_headers: bool = Field(False, description="add x-pd-router-decode/-prefill/-reason to responses")
    tls: HttpTlsConfig = Field(HttpTlsConfig(), description="HTTPS on the proxy's port")
    http_client: Literal["builtin", "aiohttp"] = Field(
        "builtin",
        description="the engine legs' HTTP client: builtin (HTTP/1.1 keep-alive, about half aiohttp's "
        "CPU per leg) or aiohttp's",
    )


class ExtProcConfig(_Strict):
    """The Envoy ext_proc endpoint picker (Gateway API InferencePool protocol) and its gRPC health."""

    enabled: bool = Field(False, description="serve the ext_proc picker (--grpc-port turns it on)")
    host: str = Field("127.0.0.1", description="listen address of both ports (0.0.0.0 in a pod)")
    port: Annotated[int, Field(ge=0, lt=65536)] = Field(
        9002, description="ext_proc gRPC port Envoy connects to (gRPC health too; 0: any free one)"
    )
    health_port: Annotated[int, Field(ge=0, lt=65536)] = Field(
        9003, description="gRPC health port for kubelet's probes, always cleartext (0: any free one)"
    )
    response_processing: bool = Field(
        True,
        description="follow the response (status, usage); false: close the stream once routed, which "
        "needs Envoy's response_header_mode SKIP and response_body_mode NONE (ignored otherwise)",
    )
    max_concurrent_streams: Annotated[int, Field(gt=0)] = Field(
        10000,
        description="per gRPC connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); Envoy opens one "
        "connection per worker thread, and a stream over the cap is refused (REFUSED_STREAM)",
    )
    grace_s: NonNegative = Field(10.0, description="on shutdown, how long open streams may finish")
    tls: TlsConfig = Field(TlsConfig(), description="TLS on the ext_proc port")
    max_connections: Annotated[int, Field(gt=0)] = Field(
        1024, description="gRPC connections at most; the oldest one without a stream makes room"
    )
    idle_timeout_s: Positive = Field(300.0, description="a connection with no open call is closed after this")
    pd_pairs: Literal["auto", "always", "never"] = Field(
        "auto",
        description="which decode pods a prefill -> decode pair may end on behind Envoy, which sends "
        "the request to the decode pod only: auto, those a P/D sidecar fronts (an endpoint's "
        "sidecar: true, or discovered: a pd-sidecar container port or the pd-router.io/pd-sidecar "
        "annotation); always, every decode pod (each has a sidecar); never, none (one pod computes "
        "and answers every request). The proxy runs its pairs itself and ignores this",
    )
    conformance: bool = Field(
        False,
        description="Gateway API Inference Extension conformance hooks: honour the "
        "test-epp-endpoint-selection header, echo the served endpoint in "
        "x-conformance-test-served-endpoint; also defaults strict_model to false and the gate to "
        "its ranks check (the suite's backends are echo servers). Never in production: a client "
        "could steer routing",
    )


DiscoverySource = Literal["static", "kubernetes"]


# Every ready-gate check (one module each in router/control/checks/), in the order they run by
# default, and where it runs when gate.checks is not set: a file's endpoints are what the operator
# wrote, so cheap checks; a cluster's pods come and go with rollouts, so their weights, connectors
# and KV-event streams are proven before traffic.
GATE_CHECKS = {name: check.default_on for name, check in CHECKS.items()}
GateCheck = Literal[tuple(GATE_CHECKS)]  # type: ignore[valid-type]


def default_checks(source: DiscoverySource, *, precise: bool) -> tuple[str, ...]:
    """The gate checks a pool discovered by ``source`` runs when ``gate.checks`` is not set;
    ``precise``: in precise mode."""
    return tuple(
        name for name, on in GATE_CHECKS.items() if source in on.sources and (precise or not on.precise_only)
    )


def _default_checks_described() -> str:
    described = []
    sources: tuple[tuple[DiscoverySource, str], ...] = (
        ("static", "for a static file"),
        ("kubernetes", "on Kubernetes"),
    )
    for source, where in sources:
        checks = default_checks(source, precise=False)
        extra = [name for name in default_checks(source, precise=True) if name not in checks]
        described.append(
            f"{', '.join(checks)} {where}" + (f" (plus {', '.join(extra)} in precise mode)" if extra else "")
        )
    return "; ".join(described)


class GateConfig(_Strict):
    """The ready gate every group's epoch passes before any of its endpoints gets traffic."""

    checks: list[GateCheck] | None = Field(
        None,
        description=f"run in this order; default: {_default_checks_described()}; kv_events passes "
        "at once for endpoints that publish no KV events",
    )
    check_timeout_s: Positive = Field(10.0, description="a check that takes longer fails the gate")
    canary_max_tokens: Annotated[int, Field(ge=1, le=2)] = Field(
        1, description="max_tokens of the canary completions"
    )
    canary_min_interval_s: NonNegative = Field(30.0, description="at most one canary per group this often")
    retry_base_s: Positive = Field(1.0, description="a failed gate is retried after this, doubling")
    retry_max_s: Positive = Field(60.0, description="the doubling retry delay stops growing here")
    drain_timeout_s: NonNegative = Field(
        600.0, description="a draining group leaves at the latest after this"
    )
    initial_wait_s: NonNegative = Field(
        30.0, description="at start, how long to wait for the first gate round before listening"
    )
    share_results: bool = Field(
        True, description="with index.redis: replicas share gate results, one gate run (canary) per epoch"
    )

    @field_validator("checks")
    @classmethod
    def _unique(cls, checks: list[str] | None) -> list[str] | None:
        if checks is not None and len(set(checks)) != len(checks):
            raise ValueError("each check at most once")
        return checks


# Where a discovered pod's engine publishes its KV events, before the configured templates: the
# pod's annotations, else a container port so named.
KV_EVENTS_ANNOTATION = "pd-router.io/kv-events"
KV_REPLAY_ANNOTATION = "pd-router.io/kv-events-replay"
KV_EVENTS_PORT_NAME = "kv-events"
KV_REPLAY_PORT_NAME = "kv-replay"
IP_PLACEHOLDER = "{ip}"
WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]")  # what vLLM binds to (its default is tcp://*:5557)


def is_tcp_endpoint(value: str) -> bool:
    """``tcp://host:port``, a ZMQ endpoint a subscriber can connect to (an IPv6 host in brackets)."""
    scheme, sep, rest = value.partition("://")
    host, colon, port = rest.rpartition(":")
    return scheme == "tcp" and bool(sep and host and colon) and port.isdigit() and 0 < int(port) < 65536


def pod_endpoint(template: str, ip: str) -> str | None:
    """The endpoint ``template`` names for the pod at ``ip``: ``{ip}``, or a wildcard host as vLLM's
    own setting has it (``tcp://*:5557``), is that IP. None unless the result is ``tcp://host:port``."""
    host = f"[{ip}]" if ":" in ip else ip
    value = template.replace(IP_PLACEHOLDER, host)
    scheme, sep, rest = value.partition("://")
    bound, colon, port = rest.rpartition(":")
    if bound in WILDCARD_HOSTS:
        value = f"{scheme}{sep}{host}{colon}{port}"
    return value if is_tcp_endpoint(value) else None


class KubernetesConfig(_Strict):
    """Discover the pool from Kubernetes: one InferencePool, or a plain label selector."""

    namespace: str = Field("default", description="the pool's namespace (the picker's own, usually)")
    pool_name: str | None = Field(
        None, description="the InferencePool (inference.networking.k8s.io/v1) to follow"
    )
    watch_objectives_and_rewrites: bool = Field(
        True,
        description="with pool_name: follow the InferenceObjective and InferenceModelRewrite objects "
        "whose poolRef names the pool (llm-d.ai; inference.networking.x-k8s.io where llm-d.ai's kind "
        "is not installed), live, ahead of objectives and model_rewrites here",
    )
    selector: dict[str, str] = Field(
        default_factory=dict, description="without an InferencePool: the pods' labels (matchLabels)"
    )
    target_ports: list[Annotated[int, Field(gt=0, lt=65536)]] = Field(
        default_factory=list, description="without an InferencePool: the serving ports"
    )
    group_label: str | None = Field(
        None, description="group ranks by this label instead of LeaderWorkerSet's group-key"
    )
    workers_serve: bool = Field(
        False, description="every rank serves (wide-EP), not only each group's leader"
    )
    kv_events_endpoint: str | None = Field(
        None,
        description="precise mode: each pod's KV-event publisher (vLLM --kv-events-config endpoint) "
        f"when neither its annotation {KV_EVENTS_ANNOTATION} nor a container port named "
        f"{KV_EVENTS_PORT_NAME} names it; {IP_PLACEHOLDER} (or a wildcard host, as vLLM binds) is the "
        f"pod's IP, e.g. tcp://{IP_PLACEHOLDER}:5557 (vLLM's default port); unset: only those pods are "
        "subscribed to",
    )
    kv_events_replay_endpoint: str | None = Field(
        None,
        description=f"the same for its replay socket (annotation {KV_REPLAY_ANNOTATION}, port name "
        f"{KV_REPLAY_PORT_NAME}), e.g. tcp://{IP_PLACEHOLDER}:5558; vLLM has none unless "
        "replay_endpoint is configured",
    )

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _endpoint_template(cls, value: str | None) -> str | None:
        if value is not None and (
            pod_endpoint(value, "10.0.0.1") is None
            or pod_endpoint(value, "10.0.0.1") == pod_endpoint(value, "10.0.0.2")
        ):
            raise ValueError(f"must be tcp://{IP_PLACEHOLDER}:<port> (or tcp://*:<port>, as vLLM binds)")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> KubernetesConfig:
        if (self.pool_name is None) == (not self.selector):
            raise ValueError("set exactly one of pool_name and selector")
        if self.selector and not self.target_ports:
            raise ValueError("selector needs target_ports")
        return self


class AdminConfig(_Strict):
    """Drain, undrain and re-gate groups over HTTP on the metrics listener; off by default."""

    enabled: bool = Field(
        False,
        description="serve POST /admin/groups/<group>/<drain|undrain|regate> (needs metrics.enabled)",
    )
    token: str | None = Field(
        None, description="bearer token every admin request must carry; when set, /debug/pool too"
    )
    token_file: str | None = Field(
        None, description="a file holding that token (a mounted Secret), read at start; instead of token"
    )

    @model_validator(mode="after")
    def _token_when_on(self) -> AdminConfig:
        _one_of(self.token, self.token_file, "admin.token")
        if self.enabled and not (self.token or self.token_file):
            raise ValueError("admin.enabled needs admin.token or admin.token_file")
        return self


class ShutdownConfig(_Strict):
    """What ``pd-router serve`` does on SIGTERM before its listeners drain."""

    lame_duck_s: Annotated[float, Field(ge=0, le=600)] = Field(
        5.0,
        description="keep accepting and answering while reporting not ready (gRPC health "
        "NOT_SERVING, /health 503) this long, so gateways that health-check the picker (Envoy, a "
        "Kubernetes Service) move new requests to other replicas before it stops accepting; at "
        "least their detection time (check interval x unhealthy threshold); a second signal ends "
        "it early; 0: drain at once",
    )


class KedaConfig(_Strict):
    """KEDA's external scaler (gRPC ``externalscaler.ExternalScaler``): scale prefill and decode
    workloads on pd-router's per-role signals without a Prometheus in between."""

    enabled: bool = Field(False, description="serve the external scaler")
    host: str = Field("127.0.0.1", description="listen address (0.0.0.0 in a pod)")
    port: Annotated[int, Field(ge=0, lt=65536)] = Field(
        9004, description="gRPC port KEDA's ScaledObject points at (0: any free one)"
    )


class FlowControlConfig(_Strict):
    """Hold requests in the router while every eligible pod is saturated, and bind each to the pod
    that is best when one has room (``router/flow/hold_queue.py``)."""

    enabled: bool = Field(False, description="hold requests instead of queueing them on saturated pods")
    max_wait_ms: NonNegative = Field(
        500.0, description="a route whose predicted queue wait is over this counts as saturated"
    )
    max_queue: Annotated[int, Field(ge=1)] = Field(
        1024, description="requests held at most; then 503 queue_full (429 if sheddable)"
    )
    queue_timeout_ms: Positive = Field(
        30000.0, description="a request held longer gets 503 queue_timeout (429 if sheddable)"
    )
    poll_ms: Annotated[float, Field(ge=5)] = Field(
        50.0, description="held requests are tried again at least this often, and when capacity frees"
    )


class RoleCounts(_Strict):
    """Replicas per role (a prefill-decode pod counts in both)."""

    prefill: Annotated[int, Field(ge=0)] = Field(description="replicas that prefill")
    decode: Annotated[int, Field(ge=0)] = Field(description="replicas that decode")


class SignalsConfig(_Strict):
    """The online performance model and the replica recommendation per role (``router/signals``)."""

    tick_ms: Annotated[float, Field(ge=50)] = Field(
        1000.0,
        description="how often the model is refitted, replicas recommended and engine speeds applied",
    )
    learn: bool = Field(
        False,
        description="route with what answers teach, each part as its learn_* switch says (off: "
        "every part off; observed and exported only). Off by default: on the routing benchmarks "
        "it did not beat the configured engine model (docs/benchmarks.md)",
    )
    learn_perf_model: bool = Field(
        True,
        description="price routes with the engine speeds fitted from observed TTFT/TPOT instead of "
        "the engine section's",
    )
    learn_engine_speed: bool = Field(
        True, description="a per-engine slowness factor: each engine's speed against the pool's model"
    )
    learn_token_ratio: bool = Field(
        True,
        description="scale character estimates of prompt tokens by the tokens per character the "
        "engines report (never a tokenizer's count)",
    )
    learn_cached_evidence: bool = Field(
        True,
        description="an engine reporting far fewer cached prompt tokens than the index said it "
        "held makes the index keep less for it",
    )
    learn_links: bool = Field(
        True,
        description="price KV transfers with the bandwidth each pair of link labels showed in "
        "answered P/D pairs (the links section's numbers are the priors)",
    )
    min_samples: Annotated[int, Field(ge=2)] = Field(
        16, description="observed answers per role before a fit replaces the configured engine model"
    )
    prior_samples: NonNegative = Field(
        0.1,
        description="how many samples the configured engine model counts as once min_samples exist "
        "(it still decides what the samples do not show)",
    )
    ready_time_s: Positive = Field(
        480.0, description="how long a new replica takes to serve, until the gate has measured it"
    )
    scale_down_window_s: NonNegative = Field(300.0, description="scale down only to the max need over this")
    level_window_s: Positive = Field(10.0, description="demand level: the mean over this")
    trend_window_s: Positive = Field(
        120.0,
        description="request-rate trend: least-squares slopes of the arrivals counted per tick over this",
    )
    max_growth: Annotated[float, Field(ge=1)] = Field(3.0, description="forecast at most this × the level")
    observed_window_s: Positive = Field(30.0, description="observed TTFT/TPOT: the p90 over this")
    trend_significance: NonNegative = Field(
        2.0,
        description="extrapolate the request-rate trend only when its slope is this many standard errors "
        "above 0",
    )
    min_rate_requests: Annotated[int, Field(ge=1)] = Field(
        32, description="the arrival rate spans at least this many requests (up to trend_window_s)"
    )
    min_mix_requests: Annotated[int, Field(ge=1)] = Field(
        16,
        description="what a request brings (uncached prompt, max_tokens) is averaged over at least "
        "this many (up to trend_window_s)",
    )
    backlog_drain_s: Positive = Field(
        30.0, description="drain the queued backlog over at least this (and never faster than the ready time)"
    )
    max_utilization: Annotated[float, Field(gt=0, le=1)] = Field(
        0.85, description="a prefill replica's utilisation at most, whatever the SLO allows"
    )
    kv_target: Annotated[float, Field(gt=0, le=1)] = Field(
        0.8,
        description="share of a decode replica's KV to plan for: caps its batch, and a scale-down "
        "that would exceed it is refused",
    )
    min_replicas: RoleCounts = Field(
        RoleCounts(prefill=1, decode=1),
        description="the recommendation's floor per role (0: may scale to zero)",
    )
    max_replicas: RoleCounts = Field(
        RoleCounts(prefill=64, decode=64), description="the recommendation's ceiling per role"
    )
    share_demand: bool = Field(
        True,
        description="with index.redis: router replicas add up their arrival rates through Redis, so "
        "each recommends replicas for the whole pool's demand, not for the share it routed",
    )

    @model_validator(mode="after")
    def _bounds(self) -> SignalsConfig:
        for role in ("prefill", "decode"):
            if getattr(self.min_replicas, role) > getattr(self.max_replicas, role):
                raise ValueError(f"min_replicas.{role} is above max_replicas.{role}")
        return self

    def learns(
        self, part: Literal["perf_model", "engine_speed", "token_ratio", "cached_evidence", "links"]
    ) -> bool:
        """Whether learned ``part`` is applied: ``learn`` and its own ``learn_<part>``."""
        return self.learn and bool(getattr(self, f"learn_{part}"))


class MetricsConfig(_Strict):
    """A separate Prometheus listener (the proxy also serves /metrics on its own port)."""

    enabled: bool = Field(
        False, description="serve /metrics, /debug/pool and the admin API (--metrics-port turns it on)"
    )
    host: str = Field("127.0.0.1", description="listen address (0.0.0.0 in a pod)")
    port: Annotated[int, Field(ge=0, lt=65536)] = Field(9090, description="listen port (0: any free one)")
    token: str | None = Field(None, description="bearer token /metrics requires (unset: open)")
    token_file: str | None = Field(
        None, description="a file holding that token (a mounted Secret), read at start; instead of token"
    )

    @model_validator(mode="after")
    def _one_token(self) -> MetricsConfig:
        _one_of(self.token, self.token_file, "metrics.token")
        return self


class TracingConfig(_Strict):
    """OpenTelemetry spans per request, exported over OTLP as the standard ``OTEL_*`` environment
    variables say (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_SERVICE_NAME``, ``OTEL_TRACES_SAMPLER``,
    ...); needs the ``tracing`` extra. Off by default (docs/operations.md)."""

    enabled: bool = Field(
        False,
        description="a span per request with the routing decision, child spans for flow control's "
        "queue and the proxy's prefill and decode legs, W3C trace context to the engines",
    )


class RewriteTargetConfig(_Strict):
    """One name a rewritten request may go upstream as."""

    model: str = Field(min_length=1, max_length=256, description="the name the engines serve it under")
    weight: Annotated[float, Field(gt=0)] = Field(1.0, description="relative share of the requests")


class ModelRewriteConfig(_Strict):
    """Requests for ``model`` go upstream as one of ``targets`` (weighted random per request)."""

    name: str | None = Field(None, description="the rule's name in metrics; default: the model")
    model: str = Field(min_length=1, description="the model name clients ask for")
    targets: list[RewriteTargetConfig] = Field(
        min_length=1, description="where the requests go, one chosen per request by weight"
    )


class PoolConfig(_Strict):
    """One pool of engines serving one model."""

    model: str = Field(
        min_length=1, description="the model name the engines serve: what clients ask for and the gate checks"
    )
    strict_model: bool = Field(
        True,
        description="404 for any other model name; a request to an API the router does not read "
        "is then forwarded only with a JSON body naming this model (else 400)",
    )
    endpoints: list[EndpointConfig] = Field(
        default_factory=list, description="the static pool; with kubernetes, may be empty"
    )
    slo: SLOConfig = Field(SLOConfig(), description="the latency objectives")
    engine: EngineModelConfig = Field(EngineModelConfig(), description="engine speed, to predict seconds")
    links: LinksConfig = Field(LinksConfig(), description="KV-transfer cost between link labels")
    weights: dict[str, NonNegative] = Field(
        default_factory=dict,
        description="multiplier per cost term (router/scheduling/costmodel/terms/<name>.py; 0 turns one "
        "off, a term's filter stays), plus prefix (locality trust, 0..1) and link; an unset one weighs "
        "its default: absorb 0.5, the others 1",
    )
    picker: PickerConfig = Field(PickerConfig(), description="how a pair is chosen")
    limits: LimitsConfig = Field(LimitsConfig(), description="request limits and size estimates")
    scrape: ScrapeConfig = Field(ScrapeConfig(), description="polling the engines' /metrics")
    index: IndexConfig = Field(IndexConfig(), description="the prefix index")
    sessions: SessionsConfig = Field(SessionsConfig(), description="session affinity (x-session-id)")
    proxy: ProxyConfig = Field(ProxyConfig(), description="the OpenAI-compatible HTTP proxy")
    extproc: ExtProcConfig = Field(ExtProcConfig(), description="the Envoy ext_proc endpoint picker")
    metrics: MetricsConfig = Field(MetricsConfig(), description="a separate Prometheus listener")
    gate: GateConfig = Field(GateConfig(), description="the ready gate before an endpoint gets traffic")
    kubernetes: KubernetesConfig | None = Field(None, description="discover the pool from Kubernetes")
    admin: AdminConfig = Field(AdminConfig(), description="drain, undrain and re-gate groups over HTTP")
    keda: KedaConfig = Field(KedaConfig(), description="KEDA's external scaler")
    shutdown: ShutdownConfig = Field(ShutdownConfig(), description="what SIGTERM does before draining")
    signals: SignalsConfig = Field(
        SignalsConfig(), description="the online performance model and replica recommendations"
    )
    flow_control: FlowControlConfig = Field(
        FlowControlConfig(), description="hold requests while the pool is saturated"
    )
    tracing: TracingConfig = Field(TracingConfig(), description="OpenTelemetry spans per request")
    model_rewrites: list[ModelRewriteConfig] = Field(
        default_factory=list,
        description="rewrite a requested model name to weighted targets (model versions, LoRA "
        "adapters); the x-gateway-model-name-rewrite header wins over these",
    )
    objectives: dict[Annotated[str, Field(min_length=1)], int] = Field(
        default_factory=dict,
        description="priority per InferenceObjective name (the x-gateway-inference-objective header): "
        "higher is served first, negative is sheddable; the cluster's InferenceObjectives win",
    )

    @field_validator("weights")
    @classmethod
    def _known_terms(cls, weights: dict[str, float]) -> dict[str, float]:
        if weights.get("prefix", 1.0) > 1.0:
            raise ValueError("prefix: must be in [0, 1] (the share of a cached prefix that counts)")
        for name in weights:
            if name not in MODEL_WEIGHTS and name not in DEFAULT_WEIGHTS:
                try:
                    load_term(name)
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        return weights

    def weight(self, name: str) -> float:
        return self.weights.get(name, DEFAULT_WEIGHTS.get(name, 1.0))

    def term_weights(self) -> dict[str, float]:
        """Every cost term and its weight: the built-ins (``DEFAULT_WEIGHTS``), then any others
        configured."""
        merged = {**DEFAULT_WEIGHTS, **self.weights}
        return {name: w for name, w in merged.items() if name not in MODEL_WEIGHTS}

    @model_validator(mode="before")
    @classmethod
    def _conformance_defaults(cls, data: Any) -> Any:
        # The conformance suite's backends are echo servers: asked for a model nobody serves, no
        # engine metrics, no model list or completions for the gate. Every default the switch
        # changes is here; fields the operator wrote keep their values.
        if not isinstance(data, dict):
            return data
        extproc = data.get("extproc")
        conformance = extproc.get("conformance") if isinstance(extproc, dict) else None
        if conformance is not True and not (isinstance(extproc, ExtProcConfig) and extproc.conformance):
            return data
        data = {"strict_model": False, **data}
        for block, defaults in (
            ("scrape", {"engine_metrics_required": False}),
            ("gate", {"checks": ["ranks"]}),
        ):
            given = data.get(block, {})
            if isinstance(given, dict):
                data[block] = {**defaults, **given}
        return data

    @model_validator(mode="after")
    def _unique_rewrites(self) -> PoolConfig:
        seen: set[str] = set()
        for i, rule in enumerate(self.model_rewrites):
            if rule.model in seen:
                raise ValueError(f"model_rewrites.{i}: a second rule for model {rule.model!r}")
            seen.add(rule.model)
        return self

    @model_validator(mode="after")
    def _unique_endpoints(self) -> PoolConfig:
        if not self.endpoints and self.kubernetes is None:
            raise ValueError("endpoints: at least one endpoint, or a kubernetes section to discover them")
        seen: set[str] = set()
        sizes: dict[str, int] = {}
        for i, endpoint in enumerate(self.endpoints):
            if endpoint.id in seen:
                raise ValueError(f"endpoints.{i}: duplicate endpoint {endpoint.id!r}")
            seen.add(endpoint.id)
            group = endpoint.group or endpoint.id
            if (
                endpoint.group_size is not None
                and sizes.setdefault(group, endpoint.group_size) != endpoint.group_size
            ):
                raise ValueError(f"endpoints.{i}: group {group!r} has two group_size values")
        return self

    def read_secrets(self) -> Secrets:
        """The tokens and the Redis password, read from their files where files are named;
        raises ``ConfigError`` naming the field."""
        redis = self.index.redis
        return Secrets(
            self.metrics.token or read_secret(self.metrics.token_file, "metrics.token_file"),
            self.admin.token or read_secret(self.admin.token_file, "admin.token_file"),
            None if redis is None else read_secret(redis.password_file, "index.redis.password_file"),
        )

    def request_limits(self) -> RequestLimits:
        return RequestLimits(
            max_body_bytes=self.limits.max_body_bytes,
            max_prompt_tokens=self.limits.max_prompt_tokens,
            default_max_tokens=self.limits.default_max_tokens,
            block_tokens=self.limits.block_tokens,
            chars_per_token=self.limits.chars_per_token,
            served_model=self.model if self.strict_model else None,
        )


def parse_config(data: Any, overrides: list[str] | tuple[str, ...] = ()) -> PoolConfig:
    """Validate a loaded mapping (plus ``a.b=value`` overrides) into a ``PoolConfig``."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: must be a mapping, got {type(data).__name__}")
    for override in overrides:
        _apply_override(data, override)
    try:
        return PoolConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PoolConfig:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: byte {exc.start}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML: nested too deeply") from None
    except (yaml.YAMLError, ValueError, TypeError) as exc:  # the constructor's own (a 13th month, !!int x)
        raise ConfigError(f"{path}: not valid YAML: {_short(str(exc))}") from None
    try:
        return parse_config(data, overrides)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _apply_override(data: dict[str, Any], override: str) -> None:
    try:
        _set_path(data, override)
    except ConfigError:
        raise
    except (
        ValueError,
        IndexError,
        TypeError,
        AttributeError,
        KeyError,
        RecursionError,
        yaml.YAMLError,
    ) as exc:
        raise ConfigError(
            f"--set {_short(override)}: cannot apply ({type(exc).__name__}: {_short(str(exc))})"
        ) from None


def _short(text: str, limit: int = 200) -> str:
    """A value as it goes into an error message: bounded, so a huge input gives a short message."""
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"


def _set_path(data: dict[str, Any], override: str) -> None:
    path, sep, raw = override.partition("=")
    if not sep or not path:
        raise ConfigError(f"--set {override!r}: expected dotted.path=value")
    keys = path.split(".")
    node: Any = data
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    value = yaml.safe_load(raw)
    if isinstance(node, list):
        node[int(keys[-1])] = value
    else:
        node[keys[-1]] = value


def _describe(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "config"
        message = error["msg"].removeprefix("Value error, ")
        if not error["loc"] or (error["type"] == "value_error" and isinstance(error.get("input"), dict)):
            lines.append(message if not error["loc"] else f"{where}: {message}")  # a rule over many fields
        elif error["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown field")
        elif error["type"] == "missing":
            lines.append(f"{where}: required field is missing")
        else:
            lines.append(f"{where}: {message}, got {_short(repr(error.get('input')))}")
    return "; ".join(lines)
