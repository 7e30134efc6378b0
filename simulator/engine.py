"""A simulated vLLM engine server: many engines in one process, real HTTP on loopback.

Each engine speaks vLLM's OpenAI wire format (completions, chat, SSE streaming), exposes vLLM's
``/metrics`` names and implements the NIXL connector's two-leg P/D protocol as llm-d's sidecar
drives it. Behind the HTTP surface runs a continuous-batching loop with a prefix cache keyed by the
router's own approximate block keys, so routing choices show up as measurable differences: a prefix
hit shortens prefill, queued work delays the first token, a bigger batch slows every decode step.

Time is simulated with ``asyncio.sleep`` per engine step; ``TimeModel.speed`` divides every step time
so tests run the same shape much faster (KV transfer delays from ``LinkCost`` are not scaled).

Precise mode (``EngineSpec.tokenizer``): the engine tokenizes prompts with a real ``tokenizer.json``
and keys its prefix cache by vLLM's exact chained block hashes; with ``kv_events`` it also publishes
vLLM-format KV events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``) on ZMQ, so the
router's event-fed index can be exercised end to end.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
import operator
import socket
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

import orjson
from aiohttp import web
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kvindex.chat_messages import anthropic_messages, responses_messages
from kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvindex.hashing import MAX_TOKEN_ID, estimate_tokens, text_block_keys, token_block_keys
from kvindex.vllm_hash import HashAlgo, VllmBlockHasher
from simulator.kv_publisher import KVEventPublisher

log = logging.getLogger(__name__)

LinkCost = Callable[[str, str], tuple[float, float]]
KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

ROLES = frozenset({"prefill", "decode", "prefill-decode"})
DEFAULT_LINK_COST: tuple[float, float] = (0.0005, 25e9)
DEFAULT_MAX_TOKENS = 16
# The generating APIs the engine serves, by path, as vLLM serves them: the Messages and Responses
# bodies become chat conversations (kvindex.chat_messages), answered in their own shapes.
API_PATHS = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}
STORED_RESPONSES = 10_000  # Responses API answers an engine keeps for GET /v1/responses/{id}
_ID_PREFIX = {"completions": "cmpl-", "chat": "chatcmpl-", "messages": "msg_", "responses": "resp_"}
# The simulated model's chat template (vLLM renders chat requests with the model's template, then
# tokenizes the text): "<|role|>\ncontent\n" per message, then "<|assistant|>\n". Text parts of
# multi-part content are joined. Give the router this file's template in precise mode to match it.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for p in m['content'] %}"
    "{% if p is mapping and p.get('type') == 'text' and p.get('text') is string %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}<|assistant|>\n"
)


class InvalidRequest(Exception):
    """A request the engine answers with 400 (as vLLM's BadRequestError)."""


WAITING_LIMIT = 4096
LOCAL_PORTS = 20000  # the first port an in-process cluster names its engines by
SEEN_LIMIT = 1000
# vLLM's own TTFT buckets, so dashboards and the router's TTFT reconciliation see familiar edges.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class TimeModel:
    """Per-step cost model; all seconds, every delay divided by ``speed``."""

    step_base_s: float = 0.004
    prefill_s_per_token: float = 0.00005
    decode_s_per_seq: float = 0.0002
    kv_s_per_token: float = 0.0000002
    max_prefill_tokens_per_step: int = 2048
    max_running: int = 64
    speed: float = 1.0

    def __post_init__(self) -> None:
        if self.speed <= 0:
            raise ValueError(f"TimeModel.speed must be > 0, got {self.speed}")
        if self.max_prefill_tokens_per_step < 1 or self.max_running < 1:
            raise ValueError("TimeModel.max_prefill_tokens_per_step and max_running must be >= 1")


@dataclass(frozen=True)
class EngineSpec:
    """One simulated engine: identity, role, topology label and capacity.

    ``tokenizer`` (a ``tokenizer.json`` path) switches to precise mode: prompt tokens and block keys
    come from real token ids hashed as vLLM does (``hash_algo``, ``python_hash_seed``). ``kv_events``
    publishes vLLM KV events on 127.0.0.1 (``kv_events_port`` / ``kv_replay_port``, 0 = ephemeral).
    """

    name: str
    role: str
    link: str = "default"
    port: int = 0
    model: str = "sim-model"
    lora_adapters: tuple[str, ...] = ()  # served too, as vLLM's --lora-modules names
    max_loras: int = 1  # GPU adapter slots (vLLM's --max-loras); the least recently used is evicted
    lora_load_s: float = 0.1  # loading an adapter into a slot: the engine's next step waits for it
    block_tokens: int = 16
    num_gpu_blocks: int = 2048
    chars_per_token: float = 4.0
    time: TimeModel = TimeModel()
    kv_bytes_per_token: int = 131072
    tokenizer: str | None = None
    hash_algo: str = "sha256"
    python_hash_seed: str | None = None
    kv_events: bool = False
    kv_events_port: int = 0
    kv_replay_port: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"EngineSpec.role must be one of {sorted(ROLES)}, got {self.role!r}")
        if self.block_tokens < 1 or self.num_gpu_blocks < 1:
            raise ValueError("EngineSpec.block_tokens and num_gpu_blocks must be >= 1")
        if self.chars_per_token <= 0:
            raise ValueError(f"EngineSpec.chars_per_token must be > 0, got {self.chars_per_token}")
        HashAlgo.parse(self.hash_algo)  # fail at config time, not on the first request


@dataclass
class EngineStats:
    """Counters since the engine (re)started; tests read these instead of timing anything."""

    requests_served: int = 0
    prefill_tokens_computed: int = 0
    cached_tokens_hit: int = 0
    remote_prefills_received: int = 0
    remote_prefill_fallbacks: int = 0
    remote_prefills_served: int = 0
    kv_tokens_transferred: int = 0
    preemptions: int = 0
    rejected_full: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    steps: int = 0  # batch steps run
    busy_s: float = 0.0  # simulated seconds spent in steps (utilisation = busy_s / wall time)
    lora_loads: int = 0  # adapters loaded into a GPU slot


class EngineStopped(Exception):
    """``local_call``: the engine was stopped while the answer was still coming (over HTTP the
    stream is cut instead)."""


class _EngineDead(EngineStopped):
    """The engine was killed while a request was in flight."""


@dataclass(eq=False, slots=True)
class _Request:
    rid: str
    prompt_tokens: int
    block_keys: list[int]
    max_tokens: int
    out: asyncio.Queue[str | None]
    arrival: float
    token_ids: list[int] | None = None  # precise mode only: BlockStored carries the blocks' tokens
    remote: SimEngine | None = None
    adapter: str | None = None  # the LoRA adapter it runs with (its request named it as the model)
    state: str = "waiting"  # waiting | transfer | running | done
    target: int = 0  # tokens that must be computed before the next token can be sampled
    computed: int = 0
    cached_tokens: int = 0
    generated: int = 0
    blocks: int = 0
    admitted_once: bool = False
    first_token_at: float | None = None
    timer: asyncio.TimerHandle | None = None


@dataclass(frozen=True, slots=True)
class _Call:
    """An accepted completion request and what its answer needs (HTTP or in-process alike)."""

    reqs: tuple[_Request, ...]  # one per prompt: a completions batch is one engine request each
    api: str  # a value of API_PATHS: the answer's shape
    response_id: str
    stream: bool
    include_usage: bool
    remote_decode: bool
    max_tokens: int

    @property
    def req(self) -> _Request:
        return self.reqs[0]


@dataclass(frozen=True, slots=True)
class _Refusal:
    """A completion request answered with an error instead (status, vLLM's message)."""

    status: int
    message: str


@dataclass(slots=True)
class LocalAnswer:
    """What ``SimEngine.local_call`` answers: the status and headers the HTTP app would send, and
    the body as the pieces it would write, each when it would write it."""

    status: int
    headers: dict[str, str]
    body: AsyncIterator[bytes]

    @property
    def content_type(self) -> str:
        return self.headers.get("Content-Type", "").split(";", 1)[0].strip()

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.body])


@dataclass(frozen=True, slots=True)
class SimJob:
    """One request as the engine's scheduler sees it, for read-only forecasts (``snapshot``).

    ``prefill``: tokens still to compute before its next token (at least 1 once admitted, as the
    engine always recomputes the last prompt token); ``tokens``: tokens still to emit; ``need_blocks``:
    blocks its admission takes (waiting requests only); ``frees_blocks``: blocks given back when it
    ends (its private blocks and the prompt blocks no other request references);
    ``transfer_s``: a remote prefill's KV transfer time, started at admission (waiting only)."""

    prefill: int
    tokens: int
    need_blocks: int = 0
    frees_blocks: int = 0
    transfer_s: float | None = None


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """An engine's exact scheduler state at ``now`` (event-loop time), with the step in progress
    (if any) applied as if it had ended: ``start`` is when the next step can begin (its end, or
    ``now`` when idle). ``running`` and ``waiting`` are in the scheduler's order; ``transfers`` are
    ``(done_at, job)`` in loop time, ``job.prefill`` the tail recomputed after the KV arrives."""

    name: str
    now: float
    start: float
    stepping: bool
    time: TimeModel
    block_tokens: int
    num_gpu_blocks: int
    held_blocks: int
    running: tuple[SimJob, ...]
    waiting: tuple[SimJob, ...]
    transfers: tuple[tuple[float, SimJob], ...]


def _blocks_for(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


def _token_text(i: int) -> str:
    return f"tok{i}" if i == 0 else f" tok{i}"


class SimEngine:
    """One simulated engine: its HTTP app, its batching loop and its KV/prefix-cache state."""

    def __init__(self, spec: EngineSpec, cluster: SimCluster | None = None) -> None:
        self.spec = spec
        self.port = spec.port
        self.stats = EngineStats()
        seen = SEEN_LIMIT if cluster is None else cluster.seen_limit
        self.requests_seen: deque[tuple[str, dict[str, str], Any]] = deque(maxlen=seen)
        # (time.monotonic(), headers) of each completion request, in arrival order
        self.arrivals: deque[tuple[float, dict[str, str]]] = deque(maxlen=seen)
        self.alive = False
        self._cluster = cluster
        self._stall = 0.0
        self._host = "127.0.0.1"
        self._waiting: deque[_Request] = deque()
        self._transfer: set[_Request] = set()
        self._lora_slots: OrderedDict[str, None] = OrderedDict()  # resident adapters, LRU first
        self._lora_loads = 0  # adapters loaded since the last step began: the next one waits for them
        # vLLM's lora_requests_info keeps every label set it ever had: (waiting, running) -> set at
        self._lora_series: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._running: list[_Request] = []
        # Blocks in use: private ones (partial tail, generated tokens) plus one per distinct full prompt
        # block referenced by an admitted request. Like vLLM, requests share prompt blocks by hash.
        self._held = 0
        self._refs: dict[int, int] = {}
        # LRU of computed block key -> None; most recently used at the end. Keys that are also
        # referenced are in use; the others are free blocks that keep their content until reused.
        self._cache: OrderedDict[int, None] = OrderedDict()
        self._cached_and_referenced = 0
        # Responses API answers kept for GET /v1/responses/{id} (vLLM's response store), newest last.
        self._stored_responses: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._transports: set[asyncio.BaseTransport] = set()
        self._ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self._ttft_sum = 0.0
        self._block_id_seq = 0
        self._block_chars = max(1, round(spec.block_tokens * spec.chars_per_token))
        templates = ImmutableSandboxedEnvironment(keep_trailing_newline=True)
        self._chat_template = templates.from_string(CHAT_TEMPLATE)
        self._failing: int | None = None
        self._pull_broken = False
        self._tokenizer: Tokenizer | None = None
        self._hasher: VllmBlockHasher | None = None
        if spec.tokenizer is not None:
            self._tokenizer = Tokenizer.from_file(spec.tokenizer)
            self._hasher = VllmBlockHasher(
                HashAlgo.parse(spec.hash_algo), spec.block_tokens, spec.python_hash_seed
            )
        self._publisher: KVEventPublisher | None = None
        self._kv_pending: list[KVEvent] = []
        self._kv_ports = (spec.kv_events_port, spec.kv_replay_port)
        # The step in progress, for read-only forecasts: (loop time it ends, prefill chunks, decodes).
        self._in_step: tuple[float, list[tuple[_Request, int]], list[_Request]] | None = None

    # -- state readable by tests -------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        # Requests whose KV is still arriving hold blocks but are not running, as in vLLM.
        return len(self._waiting) + len(self._transfer)

    @property
    def kv_blocks_used(self) -> int:
        return self._held

    @property
    def cached_blocks(self) -> int:
        return len(self._cache)

    @property
    def kv_events_endpoint(self) -> str | None:
        """The KV-event PUB endpoint (``tcp://127.0.0.1:port``); None unless ``kv_events`` and running."""
        return self._publisher.endpoint if self._publisher is not None else None

    @property
    def kv_replay_endpoint(self) -> str | None:
        """The KV-event replay ROUTER endpoint; None unless ``kv_events`` and running."""
        return self._publisher.replay_endpoint if self._publisher is not None else None

    @property
    def kv_ports(self) -> tuple[int, int]:
        """(PUB, replay) ports the KV-event publisher bound; kept after a kill so revive reuses them."""
        return self._kv_ports

    # -- read-only introspection (forecasts by benchmarks; nothing here changes the engine) -----

    def prompt_blocks(self, body: Mapping[str, Any]) -> tuple[int, list[int]]:
        """(prompt tokens, full-block cache keys) this engine would give a completions body (chat
        when it has ``messages``), exactly as it tokenizes a request; raises ``InvalidRequest``."""
        chat = "messages" in body
        prompt = self._chat_text(dict(body), "chat") if chat else _completion_prompts(dict(body))[0]
        token_ids, block_keys = self._tokenize(prompt)
        if token_ids is not None:
            return len(token_ids), block_keys
        assert isinstance(prompt, str)  # token ids are never estimated
        return estimate_tokens(prompt, self.spec.chars_per_token), block_keys

    def cached_prefix_tokens(self, block_keys: Sequence[int], prompt_tokens: int) -> int:
        """Prompt tokens this engine would not recompute if the prompt were admitted now (its
        cached leading blocks, at most ``prompt_tokens - 1``), without touching the LRU order."""
        return max(0, min(self._hit_blocks(block_keys) * self.spec.block_tokens, prompt_tokens - 1))

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens admitted or waiting that are not computed yet (waiting ones as if admitted now)."""
        snap = self.snapshot()
        return sum(job.prefill for job in (*snap.running, *snap.waiting, *(j for _, j in snap.transfers)))

    def free_kv_tokens(self) -> int:
        """KV tokens not held by any request (cached-but-unreferenced blocks count as free)."""
        return self._free_blocks() * self.spec.block_tokens

    def snapshot(self) -> EngineSnapshot:
        """The scheduler's exact state now, the step in progress applied (see ``EngineSnapshot``)."""
        now = asyncio.get_running_loop().time()
        chunks: dict[int, int] = {}
        emits: set[int] = set()
        start = now
        if self._in_step is not None:
            start, prefill, decoding = self._in_step
            chunks = {id(req): n for req, n in prefill if req.state == "running"}
            emits = {id(req) for req in decoding if req.state == "running"}
        held = self._held
        running: list[SimJob] = []
        for req in self._running:
            computed = req.computed + chunks.get(id(req), 0)
            generated = req.generated
            if id(req) in emits or (id(req) in chunks and computed >= req.target):
                generated += 1
            frees = req.blocks + self._sole_refs(req.block_keys)
            if generated >= req.max_tokens:
                held -= frees  # ends with the step in progress
                continue
            left = req.max_tokens - generated
            frees += left // self.spec.block_tokens  # what it holds when it ends
            running.append(SimJob(max(0, req.target - computed), left, 0, frees))
        waiting = [self._waiting_job(req) for req in self._waiting]
        transfers = sorted(
            (
                (req.timer.when() if req.timer is not None else start, self._arrived_job(req))
                for req in self._transfer
            ),
            key=lambda item: item[0],
        )
        spec = self.spec
        return EngineSnapshot(
            spec.name,
            now,
            max(now, start),
            self._in_step is not None,
            spec.time,
            spec.block_tokens,
            spec.num_gpu_blocks,
            held,
            tuple(running),
            tuple(waiting),
            tuple(transfers),
        )

    def job_for(
        self, block_keys: Sequence[int], prompt_tokens: int, max_tokens: int, remote: SimEngine | None = None
    ) -> SimJob:
        """The job a new request would be if it arrived now (``remote``: a decode leg pulling the
        prompt's KV from that engine), for forecasts."""
        bt = self.spec.block_tokens
        private = _blocks_for(prompt_tokens + 1, bt) - len(block_keys)
        need = private + self._unreferenced(block_keys)
        hit = self._hit_blocks(block_keys)
        computed = max(0, min(hit * bt, prompt_tokens - 1))
        transfer = None
        if remote is not None:
            transfer = self._transfer_s(remote, _blocks_for(prompt_tokens, bt) - hit)
            computed = max(computed, min(len(block_keys) * bt, prompt_tokens - 1))
        return SimJob(prompt_tokens - computed, max_tokens, need, need + max_tokens // bt, transfer)

    def _hit_blocks(self, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` in the prefix cache (as ``_cache_match``, without the LRU touch)."""
        return len(list(itertools.takewhile(self._cache.__contains__, keys)))

    def _sole_refs(self, keys: Sequence[int]) -> int:
        """Blocks of ``keys`` that no other request references (freed when this one ends)."""
        return operator.countOf(map(self._refs.get, keys), 1)

    def _unreferenced(self, keys: Sequence[int]) -> int:
        """Blocks of ``keys`` no admitted request references (what admitting them takes)."""
        return len(keys) - operator.countOf(map(self._refs.__contains__, keys), True)

    def _transfer_s(self, remote: SimEngine, missing_blocks: int) -> float:
        cost = self._cluster.link_cost if self._cluster is not None else _default_link_cost
        latency, bandwidth = cost(remote.spec.link, self.spec.link)
        missing_bytes = max(0, missing_blocks) * self.spec.block_tokens * self.spec.kv_bytes_per_token
        return latency + missing_bytes / bandwidth

    def _waiting_job(self, req: _Request) -> SimJob:
        bt = self.spec.block_tokens
        private = self._private_blocks(req)
        need = private + self._unreferenced(req.block_keys)
        hit_blocks = self._hit_blocks(req.block_keys)
        computed = min(hit_blocks * bt, req.target - 1)
        transfer = None
        if req.remote is not None:
            transfer = self._transfer_s(req.remote, _blocks_for(req.prompt_tokens, bt) - hit_blocks)
            computed = max(computed, min(len(req.block_keys) * bt, req.prompt_tokens - 1))
        left = req.max_tokens - req.generated
        return SimJob(req.target - computed, left, need, need + left // bt, transfer)

    def _arrived_job(self, req: _Request) -> SimJob:
        transferred = min(len(req.block_keys) * self.spec.block_tokens, req.prompt_tokens - 1)
        computed = max(req.computed, transferred)
        left = req.max_tokens - req.generated
        frees = req.blocks + self._sole_refs(req.block_keys) + left // self.spec.block_tokens
        return SimJob(req.target - computed, left, 0, frees)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache and publish ``AllBlocksCleared``, like vLLM's ``BlockPool``.

        As in vLLM, refused (False, nothing published) while any request holds blocks: their cached
        blocks cannot be forgotten while in use.
        """
        if self._held:
            log.warning(
                "sim engine %s: prefix cache reset refused, %d blocks in use", self.spec.name, self._held
            )
            return False
        self._cache.clear()
        self._cached_and_referenced = 0
        self._queue_kv_event(AllBlocksCleared())
        return True

    def set_stall(self, seconds: float) -> None:
        """Fault injection: delay the start of every response (including /metrics) by ``seconds``."""
        self._stall = max(0.0, seconds)

    async def _fault(self, request: web.Request) -> web.Response:
        """``POST /sim/fault?fail=500`` (or ``fail=off``) and ``?pull_broken=1`` (or ``0``)."""
        query = request.query
        try:
            if "fail" in query:
                self.set_failing(None if query["fail"] == "off" else int(query["fail"]))
            if "pull_broken" in query:
                self.set_pull_broken(query["pull_broken"] == "1")
        except ValueError:
            return _error(400, "fail must be an HTTP status or off; pull_broken 0 or 1")
        state = {"failing": self._failing, "pull_broken": self._pull_broken}
        return web.Response(body=orjson.dumps(state), content_type="application/json")

    def set_failing(self, status: int | None) -> None:
        """Fault injection: answer every completion with HTTP ``status`` (None: serve again), as an
        engine with bad weights or a broken runtime would; ``/metrics`` and ``/v1/models`` still work."""
        self._failing = status

    def set_pull_broken(self, broken: bool) -> None:
        """Fault injection: a KV connector that only works one way: this engine cannot pull a
        remote prefill's KV (a decode leg with ``do_remote_prefill`` fails with 500)."""
        self._pull_broken = broken

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1") -> None:
        self._host = host
        app = web.Application(middlewares=[self._middleware])
        for path in API_PATHS:
            app.router.add_post(path, self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/responses/{response_id}", self._stored_response)
        app.router.add_post("/v1/responses/{response_id}/cancel", self._stored_response)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        # Fault injection over HTTP, so `pd-router sim` can play a failing canary or a one-way KV
        # connector without a cluster (simulator only; a real engine has no such routes).
        app.router.add_post("/sim/fault", self._fault)
        app.on_response_prepare.append(self._echo_request_id)
        # aiohttp already sets TCP_NODELAY on every accepted connection (BaseProtocol.connection_made),
        # so each SSE chunk leaves as its own segment without Nagle delay.
        # handler_cancellation: a client that hangs up aborts its request and frees its KV, as vLLM does.
        runner = web.AppRunner(
            app, handle_signals=False, access_log=None, shutdown_timeout=1.0, handler_cancellation=True
        )
        await runner.setup()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        publisher: KVEventPublisher | None = None
        try:
            if self.spec.kv_events:
                # Fixed ports on revive: the router's consumer keeps its SUB connected to the same
                # endpoint and must notice the restart by the new incarnation's seq starting at 0.
                publisher = KVEventPublisher(
                    endpoint=f"tcp://127.0.0.1:{self.spec.kv_events_port}",
                    replay_endpoint=f"tcp://127.0.0.1:{self.spec.kv_replay_port}",
                )
                await publisher.start()
            # SO_REUSEADDR lets a revived engine bind the port its killed predecessor left in TIME_WAIT.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, self.spec.port))
            sock.setblocking(False)
            site = web.SockSite(runner, sock)
            await site.start()
        except BaseException:
            sock.close()
            if publisher is not None:
                await publisher.close()
            await runner.cleanup()
            raise
        self.port = sock.getsockname()[1]
        self._runner = runner
        self._publisher = publisher
        if publisher is not None:
            assert publisher.replay_endpoint is not None
            self._kv_ports = (_port_of(publisher.endpoint), _port_of(publisher.replay_endpoint))
        self._loop_task = asyncio.create_task(self._batch_loop(), name=f"simengine-{self.spec.name}")
        self._loop_task.add_done_callback(self._loop_done)
        self.alive = True
        log.info(
            "sim engine %s (%s, link %s) listening on %s:%d",
            self.spec.name,
            self.spec.role,
            self.spec.link,
            host,
            self.port,
        )

    async def start_local(self, port: int, host: str = "127.0.0.1") -> None:
        """Run the batching loop without listening: requests come in through ``local_call`` (the
        virtual-clock runs, where nothing may touch a socket). ``host:port`` is only the engine's
        name on the in-process network (NIXL ``kv_transfer_params`` carry it, as over HTTP)."""
        if self.spec.kv_events:
            raise ValueError(f"engine {self.spec.name}: KV events need ZMQ sockets; not in-process")
        self._host = host
        self.port = port
        self._loop_task = asyncio.create_task(self._batch_loop(), name=f"simengine-{self.spec.name}")
        self._loop_task.add_done_callback(self._loop_done)
        self.alive = True

    async def shutdown(self) -> None:
        """Crash-stop: cut live connections mid-way, close the listener, stop the batch loop."""
        if self._runner is None and not self.alive:  # never started (or stopped already)
            return
        runner, self._runner = self._runner, None
        self.alive = False
        for transport in list(self._transports):
            transport.abort()
        for task in list(self._tasks):
            task.cancel()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        for req in [*self._waiting, *self._transfer, *self._running]:
            if req.timer is not None:
                req.timer.cancel()
            req.state = "done"
            # Wakes any handler that was not cancelled above (room is guaranteed: it never finished).
            req.out.put_nowait(None)
        self._waiting.clear()
        self._transfer.clear()
        self._running.clear()
        self._lora_slots.clear()
        self._lora_loads = 0
        self._held = 0
        self._refs.clear()
        self._cached_and_referenced = 0
        # A crash loses the events of the step in progress, as a killed vLLM would.
        self._kv_pending.clear()
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            await publisher.close()
        if runner is not None:
            await runner.cleanup()
        log.info("sim engine %s stopped", self.spec.name)

    def _loop_done(self, task: asyncio.Task[None]) -> None:
        # A scheduler bug would otherwise freeze the engine silently, with every request hanging.
        if not task.cancelled() and task.exception() is not None:
            log.error("sim engine %s: batch loop crashed", self.spec.name, exc_info=task.exception())

    # -- HTTP --------------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        task = asyncio.current_task()
        transport = request.transport
        if task is not None:
            self._tasks.add(task)
        if transport is not None:
            self._transports.add(transport)
        try:
            if self._stall > 0:
                await asyncio.sleep(self._stall)
            return await handler(request)
        finally:
            self._tasks.discard(task)  # type: ignore[arg-type]
            self._transports.discard(transport)  # type: ignore[arg-type]

    async def _echo_request_id(self, request: web.Request, response: web.StreamResponse) -> None:
        rid = request.headers.get("X-Request-Id")
        if rid is not None:
            response.headers["X-Request-Id"] = rid

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        return web.Response(body=self._models_body(), content_type="application/json")

    def _models_body(self) -> bytes:
        spec = self.spec
        created = int(time.time())
        base = {
            "id": spec.model,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": spec.model,
            "parent": None,
            "max_model_len": spec.num_gpu_blocks * spec.block_tokens,
        }
        # vLLM lists a LoRA adapter with its base model as the parent.
        adapters = [{**base, "id": name, "root": name, "parent": spec.model} for name in spec.lora_adapters]
        body = {"object": "list", "data": [base, *adapters]}
        return orjson.dumps(body)

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        # vLLM answers 200 either way; a sim-only 409 lets tests tell a refused reset apart.
        if self.reset_prefix_cache():
            return web.Response(status=200)
        return _error(409, "cannot reset prefix cache: some blocks are still in use")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics_text().encode(), headers={"Content-Type": METRICS_TYPE})

    # -- in-process calls (no HTTP) ------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def local_call(
        self, method: str, path: str, headers: Mapping[str, str] | None = None, body: bytes = b""
    ) -> AsyncIterator[LocalAnswer]:
        """The HTTP app's answer to one request, in-process: the completions (the same
        ``_accept`` and the same bytes as the handlers), ``/metrics``, ``/v1/models`` and
        ``/health``. The body's pieces come as the engine produces them; leaving the block is the
        connection closing (a request the engine still holds is dropped, as a client hanging up
        does). Raises ``ConnectionRefusedError`` when the engine is not running, ``EngineStopped``
        from the body when it is stopped mid-answer."""
        if not self.alive:
            raise ConnectionRefusedError(f"engine {self.spec.name} is not running")
        if self._stall > 0:
            await asyncio.sleep(self._stall)
        lowered = {name.lower(): value for name, value in (headers or {}).items()}
        rid = lowered.get("x-request-id")
        echo = {} if rid is None else {"X-Request-Id": rid}
        if method == "POST" and path in API_PATHS:
            call = self._accept(path, lowered, body)
            if isinstance(call, _Refusal):
                yield LocalAnswer(
                    call.status, {**_JSON, **echo}, _once(_error_body(call.status, call.message))
                )
                return
            try:
                if call.stream:
                    stream = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **echo}
                    async with contextlib.aclosing(self._events(call)) as events:
                        yield LocalAnswer(200, stream, events)
                else:
                    yield LocalAnswer(200, {**_JSON, **echo}, self._json_pieces(call))
            finally:
                self._end(call)
        elif method == "GET" and path == "/metrics":
            yield LocalAnswer(200, {"Content-Type": METRICS_TYPE}, _once(self.metrics_text().encode()))
        elif method == "GET" and path == "/v1/models":
            yield LocalAnswer(200, dict(_JSON), _once(self._models_body()))
        elif method == "GET" and path == "/health":
            yield LocalAnswer(200, {}, _once(b""))
        else:
            yield LocalAnswer(404, {"Content-Type": "text/plain; charset=utf-8"}, _once(b"404: Not Found"))

    async def _json_pieces(self, call: _Call) -> AsyncIterator[bytes]:
        yield await self._json_answer(call)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        call = self._accept(request.path, _lower_headers(request), await request.read())
        if isinstance(call, _Refusal):
            return _error(call.status, call.message)
        try:
            if call.stream:
                return await self._stream(request, call)
            return await self._respond(call)
        except _EngineDead:
            return _error(500, "engine stopped")
        finally:
            self._end(call)

    def _accept(self, path: str, headers: dict[str, str], raw: bytes) -> _Call | _Refusal:
        """A completion request as the engine takes it in: logged, validated and queued (the
        ``_Call`` to answer) or refused. The one path of the HTTP handler and ``local_call``."""
        api = API_PATHS[path]
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            self.requests_seen.append((path, headers, None))
            return _Refusal(400, f"request body is not valid JSON: {exc}")
        self.requests_seen.append((path, headers, body))
        self.arrivals.append((time.monotonic(), headers))  # the engine's own log of when work came
        if not isinstance(body, dict):
            return _Refusal(400, "request body must be a JSON object")
        model = body.get("model", self.spec.model)
        if model != self.spec.model and model not in self.spec.lora_adapters:
            return _Refusal(404, f"The model `{model}` does not exist.")
        try:
            parsed = self._parse(body, api)
        except InvalidRequest as exc:
            return _Refusal(400, str(exc))
        prompts, max_tokens, stream, include_usage, kvp = parsed
        remote_decode = bool(kvp.get("do_remote_decode")) if kvp else False
        remote_prefill = bool(kvp.get("do_remote_prefill")) if kvp else False
        role = self.spec.role
        if remote_decode and role == "decode":
            return _Refusal(400, f"engine {self.spec.name} is decode-only: cannot serve do_remote_decode")
        if remote_prefill and role == "prefill":
            return _Refusal(400, f"engine {self.spec.name} is prefill-only: cannot serve do_remote_prefill")
        if self._failing is not None:
            return _Refusal(self._failing, f"engine {self.spec.name} is failing (fault injection)")
        if remote_prefill and self._pull_broken:
            return _Refusal(500, f"engine {self.spec.name}: KV transfer from the prefill engine failed")
        tokenized = [self._tokenize(text) for text in prompts]
        counts = [
            len(ids) if ids is not None else estimate_tokens(text, self.spec.chars_per_token)
            for (ids, _), text in zip(tokenized, prompts, strict=True)
        ]
        if min(counts) == 0:
            return _Refusal(400, "prompt is empty")
        max_len = self.spec.num_gpu_blocks * self.spec.block_tokens
        if (prompt_tokens := max(counts)) + max_tokens > max_len:
            return _Refusal(
                400,
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                f"messages, {max_tokens} in the completion).",
            )
        remote: SimEngine | None = None
        if remote_prefill:
            remote = self._cluster.find_remote(kvp) if self._cluster is not None else None
            if remote is None:
                # vLLM recomputes the prompt when the KV cannot be pulled; count it so tests can see it.
                self.stats.remote_prefill_fallbacks += 1
                log.info(
                    "sim engine %s: remote prefill source %s unknown or dead, recomputing",
                    self.spec.name,
                    kvp.get("remote_engine_id") if kvp else None,
                )
        if len(self._waiting) + len(prompts) > WAITING_LIMIT:
            self.stats.rejected_full += 1
            return _Refusal(503, "waiting queue is full")
        header_rid = headers.get("x-request-id")
        rid = header_rid or uuid.uuid4().hex
        adapter = model if model != self.spec.model else None
        reqs = tuple(
            _Request(
                rid=rid if len(prompts) == 1 else f"{rid}-{i}",  # vLLM's ids for a batch's prompts
                prompt_tokens=count,
                block_keys=block_keys,
                max_tokens=max_tokens,
                out=asyncio.Queue(maxsize=max_tokens + 1),  # every token plus the end marker, never more
                arrival=time.monotonic(),
                token_ids=token_ids,
                remote=remote,
                adapter=adapter,
                target=count,
            )
            for i, ((token_ids, block_keys), count) in enumerate(zip(tokenized, counts, strict=True))
        )
        self._waiting.extend(reqs)
        self._wake.set()
        return _Call(reqs, api, _ID_PREFIX[api] + rid, stream, include_usage, remote_decode, max_tokens)

    def _end(self, call: _Call) -> None:
        """The answer is over (sent, failed or abandoned): free what the request still holds."""
        for req in call.reqs:
            if req.state != "done":
                self._drop(req)

    def _tokenize(self, text: str | list[int]) -> tuple[list[int] | None, list[int]]:
        """(token ids or None, full-block keys): vLLM-exact in precise mode, else the text estimate.
        A prompt of token ids is taken as it is, as vLLM does: no tokenizer, no special tokens."""
        if isinstance(text, list):
            if self._hasher is not None:
                return text, self._hasher.keys(text).tolist()
            return text, token_block_keys(text, self.spec.block_tokens).tolist()
        if self._tokenizer is None or self._hasher is None:
            return None, text_block_keys(text, self._block_chars).tolist()
        # With special tokens, as vLLM's completions API tokenizes (e.g. a BOS). Chat prompts are the
        # router's flattened text, not a chat template: fine as long as the router hashes the same text.
        ids = self._tokenizer.encode(text, add_special_tokens=True).ids
        return ids, self._hasher.keys(ids).tolist()

    def _parse(
        self, body: dict[str, Any], api: str
    ) -> tuple[list[str | list[int]], int, bool, bool, dict[str, Any] | None]:
        """(the prompts, max tokens per prompt, stream, whether a stream ends with its usage,
        kv_transfer_params), as vLLM reads the API's body."""
        prompts = _completion_prompts(body) if api == "completions" else [self._chat_text(body, api)]
        if api == "messages":
            fields: tuple[str, ...] = ("max_tokens",)
            if body.get("max_tokens") is None:
                raise InvalidRequest("Field required: 'max_tokens'")
        elif api == "responses":
            fields = ("max_output_tokens",)
        else:
            fields = ("max_completion_tokens", "max_tokens")
        field = next((f for f in fields if body.get(f) is not None), None)
        max_tokens = DEFAULT_MAX_TOKENS if field is None else body[field]
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise InvalidRequest(f"'{field}' must be a positive integer, got {max_tokens!r}")
        min_tokens = body.get("min_tokens", 0)
        if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 0:
            raise InvalidRequest(f"'min_tokens' must be a non-negative integer, got {min_tokens!r}")
        stream = body.get("stream", False)
        if stream is None and api in ("messages", "responses"):
            stream = False
        if not isinstance(stream, bool):
            raise InvalidRequest("'stream' must be a boolean")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise InvalidRequest("'stream_options' must be an object")
        kvp = body.get("kv_transfer_params")
        if kvp is not None and not isinstance(kvp, dict):
            raise InvalidRequest("'kv_transfer_params' must be an object")
        # A Messages or Responses stream always ends with its usage; an OpenAI one when asked.
        include_usage = api in ("messages", "responses") or bool(options.get("include_usage"))
        return prompts, max_tokens, stream, include_usage, kvp

    def _chat_text(self, body: dict[str, Any], api: str) -> str:
        try:
            if api == "messages":
                messages: Any = anthropic_messages(body)
            elif api == "responses":
                messages = responses_messages(body)
            else:
                messages = body.get("messages")
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("'messages' must be a non-empty array")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise InvalidRequest("every message must be an object with a string 'role'")
        return self._chat_template.render(messages=messages)

    async def _next_token(self, req: _Request) -> str | None:
        token = await req.out.get()
        if token is None and req.generated < req.max_tokens:
            raise _EngineDead
        return token

    async def _respond(self, call: _Call) -> web.Response:
        return web.Response(body=await self._json_answer(call), content_type="application/json")

    async def _json_answer(self, call: _Call) -> bytes:
        """The whole non-streamed answer, once every token is out."""
        texts: list[str] = []
        for req in call.reqs:
            parts: list[str] = []
            while (token := await self._next_token(req)) is not None:
                parts.append(token)
            texts.append("".join(parts))
        kv_params = self._remote_params(call.req) if call.remote_decode else None
        created = int(time.time())
        if call.api == "messages":
            usage = self._usage(call)
            return orjson.dumps(
                {
                    "id": call.response_id,
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "text", "text": texts[0]}],
                    "model": self.spec.model,
                    "stop_reason": "max_tokens",
                    "stop_sequence": None,
                    "usage": {
                        "input_tokens": usage["prompt_tokens"],
                        "output_tokens": usage["completion_tokens"],
                    },
                    "kv_transfer_params": kv_params,
                }
            )
        if call.api == "responses":
            # vLLM's Responses answer has no kv_transfer_params field: a prefill leg gets none back.
            return orjson.dumps(self._store(self._response_object(call, created, "incomplete", texts[0])))
        choices: list[dict[str, Any]]
        if call.api == "chat":
            message = {
                "role": "assistant",
                "content": texts[0],
                "refusal": None,
                "tool_calls": [],
                "reasoning_content": None,
            }
            choices = [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
            ]
        else:
            choices = [
                {
                    "index": i,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                    "prompt_logprobs": None,
                }
                for i, text in enumerate(texts)
            ]
        body = {
            "id": call.response_id,
            "object": "chat.completion" if call.api == "chat" else "text_completion",
            "created": created,
            "model": self.spec.model,
            "choices": choices,
            "usage": self._usage(call),
            "service_tier": None,
            "system_fingerprint": None,
            "prompt_logprobs": None,
            "kv_transfer_params": kv_params,
        }
        return orjson.dumps(body)

    def _response_object(self, call: _Call, created: int, status: str, text: str | None) -> dict[str, Any]:
        """A Responses API response object; ``text`` None: no output yet (the stream's opening)."""
        usage = self._usage(call)
        item_id = "msg_" + call.req.rid
        output = (
            []
            if text is None
            else [
                {
                    "id": item_id,
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}],
                }
            ]
        )
        return {
            "id": call.response_id,
            "object": "response",
            "created_at": created,
            "status": status,
            # The simulated engine always stops at the limit, which vLLM reports as incomplete.
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.spec.model,
            "output": output,
            "max_output_tokens": call.max_tokens,
            "usage": None
            if text is None
            else {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            },
        }

    async def _stream(self, request: web.Request, call: _Call) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Cache-Control": "no-cache"})
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        try:
            async with contextlib.aclosing(self._events(call)) as events:
                async for event in events:
                    await resp.write(event)
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            log.debug("sim engine %s: client went away during stream %s", self.spec.name, call.req.rid)
        return resp

    async def _events(self, call: _Call) -> AsyncIterator[bytes]:
        """The streamed answer's SSE events, each as it becomes available (a token per event)."""
        if call.api == "messages":
            events = self._anthropic_events(call)
        elif call.api == "responses":
            events = self._responses_events(call)
        else:
            events = self._openai_events(call)
        async with contextlib.aclosing(events):
            async for event in events:
                yield event

    async def _openai_events(self, call: _Call) -> AsyncIterator[bytes]:
        chat = call.api == "chat"
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": call.response_id, "object": obj, "created": created, "model": self.spec.model}
        # A batch's prompts are streamed one after the other (vLLM interleaves them; the client
        # tells them apart by index either way).
        for index, req in enumerate(call.reqs):
            sent = 0
            while (token := await self._next_token(req)) is not None:
                if chat and sent == 0:
                    # As vLLM's chat stream: the role chunk goes out with the first engine output,
                    # i.e. once the prompt is computed, so a client's first byte is not earlier than
                    # its first token (the proxy reads the first byte as the end of the prefill).
                    first = {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    yield _sse({**base, "choices": [first]})
                sent += 1
                finish = "length" if sent >= req.max_tokens else None
                if chat:
                    choice = {
                        "index": 0,
                        "delta": {"content": token},
                        "logprobs": None,
                        "finish_reason": finish,
                    }
                else:
                    choice = {
                        "index": index,
                        "text": token,
                        "logprobs": None,
                        "finish_reason": finish,
                        "stop_reason": None,
                    }
                yield _sse({**base, "choices": [choice]})
        if call.include_usage:
            yield _sse({**base, "choices": [], "usage": self._usage(call)})
        yield b"data: [DONE]\n\n"

    async def _anthropic_events(self, call: _Call) -> AsyncIterator[bytes]:
        """vLLM's Messages stream: named events, opened with the first engine output as its chat
        stream is (message_start carries the prompt's tokens), closed with the usage."""
        req = call.req
        sent = 0
        while (token := await self._next_token(req)) is not None:
            if sent == 0:
                usage = {"input_tokens": req.prompt_tokens, "output_tokens": 0}
                message = {
                    "id": call.response_id,
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": self.spec.model,
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": usage,
                }
                yield _named("message_start", {"type": "message_start", "message": message})
                block = {"type": "text", "text": ""}
                yield _named(
                    "content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}
                )
            sent += 1
            delta = {"type": "text_delta", "text": token}
            yield _named("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
        yield _named("content_block_stop", {"type": "content_block_stop", "index": 0})
        usage = self._usage(call)
        closing = {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens"},
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]},
        }
        yield _named("message_delta", closing)
        yield _named("message_stop", {"type": "message_stop"})

    async def _responses_events(self, call: _Call) -> AsyncIterator[bytes]:
        """vLLM's Responses stream: ``response.created`` and ``response.in_progress`` at once
        (before the prompt is computed), a ``response.output_text.delta`` per token, the whole
        response with its usage in ``response.completed``."""
        created = int(time.time())
        seq = itertools.count()
        item_id = "msg_" + call.req.rid
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        opening = self._response_object(call, created, "in_progress", None)
        yield _named(
            "response.created",
            {"type": "response.created", "response": opening, "sequence_number": next(seq)},
        )
        yield _named(
            "response.in_progress",
            {"type": "response.in_progress", "response": opening, "sequence_number": next(seq)},
        )
        parts: list[str] = []
        while (token := await self._next_token(call.req)) is not None:
            if not parts:
                item = {
                    "id": item_id,
                    "type": "message",
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [],
                }
                yield _named(
                    "response.output_item.added",
                    {
                        "type": "response.output_item.added",
                        "output_index": 0,
                        "item": item,
                        "sequence_number": next(seq),
                    },
                )
                part = {"type": "output_text", "text": "", "annotations": []}
                yield _named(
                    "response.content_part.added",
                    {
                        "type": "response.content_part.added",
                        **where,
                        "part": part,
                        "sequence_number": next(seq),
                    },
                )
            parts.append(token)
            delta = {"type": "response.output_text.delta", **where, "delta": token, "logprobs": []}
            yield _named("response.output_text.delta", {**delta, "sequence_number": next(seq)})
        text = "".join(parts)
        done = {"type": "response.output_text.done", **where, "text": text, "logprobs": []}
        yield _named("response.output_text.done", {**done, "sequence_number": next(seq)})
        final = self._store(self._response_object(call, created, "incomplete", text))
        item = final["output"][0]
        yield _named(
            "response.content_part.done",
            {
                "type": "response.content_part.done",
                **where,
                "part": item["content"][0],
                "sequence_number": next(seq),
            },
        )
        yield _named(
            "response.output_item.done",
            {
                "type": "response.output_item.done",
                "output_index": 0,
                "item": item,
                "sequence_number": next(seq),
            },
        )
        yield _named(
            "response.completed",
            {"type": "response.completed", "response": final, "sequence_number": next(seq)},
        )

    def _store(self, response: dict[str, Any]) -> dict[str, Any]:
        """Keep a finished Responses answer where vLLM keeps it: on this engine, in memory."""
        self._stored_responses[response["id"]] = response
        while len(self._stored_responses) > STORED_RESPONSES:
            self._stored_responses.popitem(last=False)
        return response

    async def _stored_response(self, request: web.Request) -> web.Response:
        """``GET /v1/responses/{id}`` (and ``/cancel``, of an answer that already finished): the
        stored answer, or vLLM's 404 where this engine never gave it."""
        response_id = request.match_info["response_id"]
        stored = self._stored_responses.get(response_id)
        if stored is None:
            error = {
                "message": f"Response with id '{response_id}' not found.",
                "type": "invalid_request_error",
                "param": None,
                "code": 404,
            }
            return web.json_response({"error": error}, status=404)
        return web.Response(body=orjson.dumps(stored), content_type="application/json")

    def _usage(self, call: _Call) -> dict[str, Any]:
        prompt = sum(req.prompt_tokens for req in call.reqs)
        generated = sum(req.generated for req in call.reqs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": generated,
            "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": sum(req.cached_tokens for req in call.reqs)},
        }

    def _remote_params(self, req: _Request) -> dict[str, Any]:
        n_blocks = _blocks_for(req.prompt_tokens, self.spec.block_tokens)
        start = self._block_id_seq
        self._block_id_seq = (start + n_blocks) % self.spec.num_gpu_blocks
        self.stats.remote_prefills_served += 1
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [(start + i) % self.spec.num_gpu_blocks for i in range(n_blocks)],
            "remote_engine_id": self.spec.name,
            "remote_host": self._host,
            "remote_port": self.port,
            "tp_size": 1,
        }

    # -- scheduler ---------------------------------------------------------------------------

    def _free_blocks(self) -> int:
        return self.spec.num_gpu_blocks - self._held

    def _trim_cache(self) -> None:
        # Cached-but-unreferenced blocks are exactly the free blocks; running requests evict them.
        capacity = max(0, self.spec.num_gpu_blocks - self._held)
        cache = self._cache
        refs = self._refs
        skipped = 0
        while len(cache) - self._cached_and_referenced > capacity and skipped < len(cache):
            key = next(iter(cache))
            if key in refs:  # in use: not evictable, look further
                cache.move_to_end(key)
                skipped += 1
            else:
                del cache[key]
                if self._publisher is not None:
                    # One hash per event, as vLLM's GPU block pool emits evictions.
                    self._queue_kv_event(BlockRemoved(block_hashes=[key], medium="GPU"))

    def _reference(self, keys: list[int]) -> int:
        """Reference a request's full prompt blocks; returns how many were not in use before."""
        refs, cache = self._refs, self._cache
        new = 0
        for key in keys:
            count = refs.get(key, 0)
            refs[key] = count + 1
            if not count:
                new += 1
                self._cached_and_referenced += key in cache
        return new

    def _release_refs(self, keys: list[int]) -> int:
        """Drop a request's references; returns how many blocks are no longer in use."""
        refs, cache = self._refs, self._cache
        freed = 0
        for key in keys:
            count = refs[key] - 1
            if count:
                refs[key] = count
            else:
                del refs[key]
                freed += 1
                self._cached_and_referenced -= key in cache
        return freed

    def _private_blocks(self, req: _Request) -> int:
        """Blocks only this request uses: its partial last prompt block and its generated tokens."""
        return _blocks_for(req.prompt_tokens + req.generated + 1, self.spec.block_tokens) - len(
            req.block_keys
        )

    def _free_request_blocks(self, req: _Request) -> None:
        if req.blocks:  # admitted: it holds private blocks and prompt-block references
            self._held -= req.blocks + self._release_refs(req.block_keys)
            req.blocks = 0

    def _cache_match(self, keys: list[int]) -> int:
        cache = self._cache
        hits = 0
        for key in keys:
            if key not in cache:
                break
            cache.move_to_end(key)
            hits += 1
        return hits

    def _cache_insert(self, keys: list[int], token_ids: list[int] | None = None) -> None:
        cache, refs = self._cache, self._refs
        run_start: int | None = None  # first index of the current run of newly cached blocks
        for i, key in enumerate(keys):
            if key not in cache:
                self._cached_and_referenced += key in refs
                if run_start is None:
                    run_start = i
            elif run_start is not None:
                # A re-touched block is not a store: each run of new blocks is its own BlockStored,
                # chained to the block before it.
                self._stored(keys, run_start, i, token_ids)
                run_start = None
            cache[key] = None
            cache.move_to_end(key)
        if run_start is not None:
            self._stored(keys, run_start, len(keys), token_ids)
        self._trim_cache()

    def _stored(self, keys: list[int], start: int, end: int, token_ids: list[int] | None) -> None:
        if self._publisher is None:
            return
        bt = self.spec.block_tokens
        self._queue_kv_event(
            BlockStored(
                block_hashes=list(keys[start:end]),
                parent_block_hash=keys[start - 1] if start else None,
                token_ids=token_ids[start * bt : end * bt] if token_ids is not None else [],
                block_size=bt,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        )

    def _queue_kv_event(self, event: KVEvent) -> None:
        # vLLM publishes one batch per engine step. Here a step's bookkeeping (admission, evictions,
        # stores, frees) runs synchronously after its sleep, so everything queued in one turn of the
        # event loop is that step's batch: flush on the next loop iteration.
        if self._publisher is None:
            return
        if not self._kv_pending:
            asyncio.get_running_loop().call_soon(self._flush_kv_events)
        self._kv_pending.append(event)

    def _flush_kv_events(self) -> None:
        events, self._kv_pending = self._kv_pending, []
        if events and self._publisher is not None:
            self._publisher.publish(events)

    def _admit(self) -> None:
        spec = self.spec
        bt = spec.block_tokens
        # vLLM's scheduler passes over a request whose adapter can get no slot (every slot holds
        # an adapter in use) and goes on with the next; otherwise the queue is FIFO.
        skipped = 0
        while (
            len(self._waiting) > skipped and len(self._running) + len(self._transfer) < spec.time.max_running
        ):
            req = self._waiting[skipped]
            if req.adapter is not None and not self._lora_can_load(req.adapter):
                skipped += 1
                continue
            private = self._private_blocks(req)
            refs = self._refs
            need = private + sum(1 for key in req.block_keys if key not in refs)
            if need > self._free_blocks():
                break  # FIFO: the head waits for KV, as vLLM's scheduler does without preemption room
            del self._waiting[skipped]
            if req.adapter is not None:
                self._lora_use(req.adapter)
            req.blocks = private
            self._held += private + self._reference(req.block_keys)
            self._trim_cache()
            hit_blocks = self._cache_match(req.block_keys)
            req.computed = min(hit_blocks * bt, req.target - 1)
            if not req.admitted_once:
                req.admitted_once = True
                req.cached_tokens = req.computed
                self.stats.cached_tokens_hit += req.computed
                self.stats.prefix_cache_queries += req.prompt_tokens
                self.stats.prefix_cache_hits += req.computed
                self.stats.prompt_tokens += req.prompt_tokens
            if req.remote is not None:
                self._start_transfer(req, hit_blocks)
            else:
                req.state = "running"
                self._running.append(req)

    def _lora_can_load(self, adapter: str) -> bool:
        """Whether ``adapter`` is resident or can be: a free slot, or one whose adapter no admitted
        request runs with."""
        if adapter in self._lora_slots or len(self._lora_slots) < self.spec.max_loras:
            return True
        return bool(self._lora_slots.keys() - self._lora_in_use())

    def _lora_in_use(self) -> set[str | None]:
        return {req.adapter for req in (*self._running, *self._transfer)}

    def _lora_use(self, adapter: str) -> None:
        """Admit with ``adapter``: the most recently used now; loaded (evicting the least recently
        used idle one when every slot is taken) if it was not resident."""
        slots = self._lora_slots
        if adapter in slots:
            slots.move_to_end(adapter)
            return
        if len(slots) >= self.spec.max_loras:
            busy = self._lora_in_use()
            del slots[next(name for name in slots if name not in busy)]
        slots[adapter] = None
        self._lora_loads += 1
        self.stats.lora_loads += 1

    def _start_transfer(self, req: _Request, hit_blocks: int) -> None:
        remote = req.remote
        assert remote is not None
        spec = self.spec
        n_blocks = _blocks_for(req.prompt_tokens, spec.block_tokens)
        missing_tokens = max(0, n_blocks - hit_blocks) * spec.block_tokens
        cost = self._cluster.link_cost if self._cluster is not None else _default_link_cost
        latency, bandwidth = cost(remote.spec.link, spec.link)
        # Link costs are wall-clock seconds, not scaled by TimeModel.speed: the router is configured with
        # the same link table (loadtests/cluster.py) and must predict the same transfer time.
        delay = latency + missing_tokens * spec.kv_bytes_per_token / bandwidth
        self.stats.kv_tokens_transferred += missing_tokens
        req.state = "transfer"
        self._transfer.add(req)
        req.timer = asyncio.get_running_loop().call_later(delay, self._transfer_done, req)

    def _transfer_done(self, req: _Request) -> None:
        req.timer = None
        if req.state != "transfer":
            return
        self._transfer.discard(req)
        self._cache_insert(req.block_keys, req.token_ids)
        # vLLM's decode side treats the transferred full blocks as computed and recomputes the tail.
        transferred = min(len(req.block_keys) * self.spec.block_tokens, req.prompt_tokens - 1)
        req.computed = max(req.computed, transferred)
        req.cached_tokens = req.computed
        req.remote = None
        self.stats.remote_prefills_received += 1
        req.state = "running"
        self._running.append(req)
        self._wake.set()

    def _preempt(self, victim: _Request) -> None:
        # Recompute-style preemption: free everything, go back to the head of the queue.
        self._running.remove(victim)
        self._free_request_blocks(victim)
        victim.computed = 0
        victim.target = victim.prompt_tokens + victim.generated
        victim.state = "waiting"
        self._waiting.appendleft(victim)
        self.stats.preemptions += 1

    def _grow(self, req: _Request) -> bool:
        """Make room for the token ``req`` emits this step; False when ``req`` itself was preempted."""
        need = self._private_blocks(req) - req.blocks
        while need > self._free_blocks():
            victim = self._running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            req.blocks += need
            self._held += need
            self._trim_cache()
        return True

    def _drop(self, req: _Request) -> None:
        """Free a request that ended (finished, client gone or cancelled)."""
        state, req.state = req.state, "done"
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None
        if state == "waiting":
            self._waiting.remove(req)
        elif state == "transfer":
            self._transfer.discard(req)
        elif state == "running":
            self._running.remove(req)
        self._free_request_blocks(req)
        self._trim_cache()

    def _emit(self, req: _Request, now: float) -> None:
        i = req.generated
        req.generated += 1
        self.stats.generation_tokens += 1
        if req.first_token_at is None:
            req.first_token_at = now
            ttft = now - req.arrival
            self._ttft_sum += ttft
            self._ttft_counts[bisect.bisect_left(TTFT_BUCKETS, ttft)] += 1
        req.out.put_nowait(_token_text(i))
        if req.generated >= req.max_tokens:
            self.stats.requests_served += 1
            req.out.put_nowait(None)
            self._drop(req)

    async def _batch_loop(self) -> None:
        spec = self.spec
        tm = spec.time
        while True:
            self._admit()
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                continue
            budget = tm.max_prefill_tokens_per_step
            prefill: list[tuple[_Request, int]] = []
            decoding: list[_Request] = []
            for req in list(self._running):
                if req.state != "running":
                    continue  # preempted by an earlier request's growth in this same step
                if req.computed < req.target:
                    n = min(budget, req.target - req.computed)
                    if n > 0:
                        budget -= n
                        prefill.append((req, n))
                elif self._grow(req):
                    decoding.append(req)
            prefill_tokens = sum(n for req, n in prefill if req.state == "running")
            n_decoding = sum(1 for req in decoding if req.state == "running")
            step = (
                tm.step_base_s
                + spec.lora_load_s * self._lora_loads
                + tm.prefill_s_per_token * prefill_tokens
                + tm.decode_s_per_seq * n_decoding
                + tm.kv_s_per_token * self._held * spec.block_tokens
            ) / tm.speed
            self._lora_loads = 0
            self.stats.steps += 1
            self.stats.busy_s += step
            self._in_step = (asyncio.get_running_loop().time() + step, prefill, decoding)
            try:
                await asyncio.sleep(step)
            finally:
                self._in_step = None
            now = time.monotonic()
            for req, n in prefill:
                if req.state != "running":
                    continue  # client left or preempted while the step ran
                req.computed += n
                self.stats.prefill_tokens_computed += n
                if req.computed >= req.target:
                    self._cache_insert(req.block_keys, req.token_ids)
                    self._emit(req, now)
            for req in decoding:
                if req.state == "running":
                    self._emit(req, now)

    # -- metrics -----------------------------------------------------------------------------

    def metrics_text(self) -> str:
        """Prometheus text exposition with vLLM's metric names, written directly for cheap scrapes."""
        spec = self.spec
        s = self.stats
        lbl = f'engine="0",model_name="{spec.model}"'
        usage = self._held / spec.num_gpu_blocks
        cache_labels = (
            f'block_size="{spec.block_tokens}",cache_dtype="auto",enable_prefix_caching="True",'
            f'engine="0",gpu_memory_utilization="0.9",model_name="{spec.model}",num_cpu_blocks="0",'
            f'num_gpu_blocks="{spec.num_gpu_blocks}",prefix_caching_hash_algo="{spec.hash_algo}"'
        )
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{lbl}}} {float(self.num_running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{lbl}}} {float(self.num_waiting)}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{lbl}}} {usage!r}",
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f"vllm:cache_config_info{{{cache_labels}}} 1.0",
        ]
        counters = (
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                s.prefix_cache_queries,
                "",
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                s.prefix_cache_hits,
                "",
            ),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens, ""),
            ("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens, ""),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.preemptions, ""),
            (
                "vllm:request_success",
                "Count of successfully processed requests.",
                s.requests_served,
                'finished_reason="length",',
            ),
        )
        if spec.lora_adapters:
            lines += self._lora_lines()
        for name, help_text, value, extra in counters:
            labels = f'engine="0",{extra}model_name="{spec.model}"'
            lines += [
                f"# HELP {name}_total {help_text}",
                f"# TYPE {name}_total counter",
                f"{name}_total{{{labels}}} {float(value)}",
            ]
        name = "vllm:time_to_first_token_seconds"
        lines += [f"# HELP {name} Histogram of time to first token in seconds.", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip(TTFT_BUCKETS, self._ttft_counts, strict=False):
            cumulative += count
            lines.append(f'{name}_bucket{{{lbl},le="{bound!r}"}} {float(cumulative)}')
        cumulative += self._ttft_counts[-1]
        lines += [
            f'{name}_bucket{{{lbl},le="+Inf"}} {float(cumulative)}',
            f"{name}_count{{{lbl}}} {float(cumulative)}",
            f"{name}_sum{{{lbl}}} {self._ttft_sum!r}",
        ]
        return "\n".join(lines) + "\n"

    def _lora_lines(self) -> list[str]:
        """``vllm:lora_requests_info`` as vLLM exports it: the value is when the label set was last
        set, and the label sets it had before stay (bounded here to the last 16)."""
        waiting = ",".join(dict.fromkeys(r.adapter for r in (*self._waiting, *self._transfer) if r.adapter))
        running = ",".join(dict.fromkeys(r.adapter for r in self._running if r.adapter))
        series = self._lora_series
        series[(waiting, running)] = time.time()
        series.move_to_end((waiting, running))
        while len(series) > 16:
            series.popitem(last=False)
        name = "vllm:lora_requests_info"
        lines = [f"# HELP {name} Running stats on lora requests.", f"# TYPE {name} gauge"]
        for (w, r), at in series.items():
            labels = (
                f'max_lora="{self.spec.max_loras}",waiting_lora_adapters="{w}",running_lora_adapters="{r}"'
            )
            lines.append(f"{name}{{{labels}}} {at!r}")
        return lines


def _port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _default_link_cost(link_a: str, link_b: str) -> tuple[float, float]:
    return DEFAULT_LINK_COST


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _named(event: str, obj: dict[str, Any]) -> bytes:
    """An SSE event with its name, as the Messages and Responses streams send them."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


_ERROR_TYPES: Mapping[int, str] = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_JSON = {"Content-Type": "application/json"}


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _error_body(status: int, message: str) -> bytes:
    """vLLM's OpenAI-style error body."""
    body = {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "Error"),
            "param": None,
            "code": status,
        }
    }
    return orjson.dumps(body)


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=_error_body(status, message), content_type="application/json")


class SimCluster:
    """A set of simulated engines served from this event loop, with crash and restart controls."""

    def __init__(
        self,
        specs: Sequence[EngineSpec],
        link_cost: LinkCost | None = None,
        host: str = "127.0.0.1",
        seen_limit: int = SEEN_LIMIT,
        *,
        in_process: bool = False,
    ) -> None:
        """``seen_limit``: requests each engine keeps in ``requests_seen``/``arrivals`` (for tests;
        a long run keeps few, or they fill memory). ``in_process``: the engines listen nowhere and
        are called with ``SimEngine.local_call`` (``simulator.local_net``); each gets a port of
        its own from ``LOCAL_PORTS`` all the same, its name on that in-process network."""
        names = [spec.name for spec in specs]
        self.seen_limit = seen_limit
        self.in_process = in_process
        self._ports = itertools.count(LOCAL_PORTS)
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        self._specs = list(specs)
        self._link_cost = link_cost or _default_link_cost
        self._host = host
        self._engines: dict[str, SimEngine] = {}

    @property
    def engines(self) -> dict[str, SimEngine]:
        """Engines by name (a copy; a revived engine is a new object)."""
        return dict(self._engines)

    def address(self, name: str) -> str:
        return f"{self._host}:{self._engines[name].port}"

    def link_cost(self, link_a: str, link_b: str) -> tuple[float, float]:
        return self._link_cost(link_a, link_b)

    def find_remote(self, params: Mapping[str, Any]) -> SimEngine | None:
        """The live engine named by NIXL ``kv_transfer_params`` (by port first, then engine id)."""
        port = params.get("remote_port")
        engine_id = params.get("remote_engine_id")
        for engine in self._engines.values():
            if engine.alive and port is not None and engine.port == port:
                return engine
        engine = self._engines.get(engine_id) if isinstance(engine_id, str) else None
        return engine if engine is not None and engine.alive else None

    async def start(self) -> None:
        try:
            for spec in self._specs:
                await self.add(spec)
        except BaseException:
            await self.stop()
            raise

    async def add(self, spec: EngineSpec) -> SimEngine:
        """Start one more engine (a replica scaled up); its name must be new."""
        if spec.name in self._engines:
            raise ValueError(f"engine {spec.name!r} exists already")
        engine = SimEngine(spec, self)
        await self._start(engine, spec.port or next(self._ports))
        self._engines[spec.name] = engine
        return engine

    async def _start(self, engine: SimEngine, port: int) -> None:
        if self.in_process:
            await engine.start_local(port, self._host)
        else:
            await engine.start(self._host)

    async def remove(self, name: str) -> None:
        """Stop an engine and forget it (a replica scaled away): anything still in flight is cut."""
        await self._engines.pop(name).shutdown()

    async def stop(self) -> None:
        for engine in self._engines.values():
            await engine.shutdown()

    async def kill(self, name: str) -> None:
        """Crash the engine: in-flight streams are cut and new connections refused."""
        await self._engines[name].shutdown()

    async def revive(self, name: str) -> None:
        """Start the engine again on the same port with an empty cache and fresh counters."""
        old = self._engines[name]
        await old.shutdown()
        kv_ports = old.kv_ports
        # Same HTTP and KV-event ports; the new publisher's seq restarts at 0 (a new incarnation).
        spec = replace(old.spec, port=old.port, kv_events_port=kv_ports[0], kv_replay_port=kv_ports[1])
        engine = SimEngine(spec, self)
        await self._start(engine, old.port)
        self._engines[name] = engine

    async def __aenter__(self) -> SimCluster:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


async def run_sim(specs: Sequence[EngineSpec], link_cost: LinkCost | None = None) -> None:
    """Serve the simulated engines until cancelled."""
    async with SimCluster(specs, link_cost) as cluster:
        for name, engine in cluster.engines.items():
            log.info(
                "sim engine %s role=%s link=%s model=%s at %s",
                name,
                engine.spec.role,
                engine.spec.link,
                engine.spec.model,
                cluster.address(name),
            )
        await asyncio.Event().wait()


def _completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """The completions prompts: a string, token ids, or a batch (an array) of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        return list(prompt)
    raise InvalidRequest("'prompt' must be a string, token ids, or an array of strings or of token-id arrays")


def _is_ids(prompt: object) -> bool:
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in prompt)
    )


def _lower_headers(request: web.Request) -> dict[str, str]:
    # Header names are case-insensitive on the wire; lower-case them so tests can index reliably.
    return {name.lower(): value for name, value in request.headers.items()}
