"""Locust load test for pd-router: realistic OpenAI traffic, with TTFT and TPOT as custom metrics.

The target is locust's ``--host``: the pd-router proxy, or an Envoy with pd-router as its ext_proc
endpoint picker (any OpenAI-compatible server works). Against the simulated demo cluster:

    # shell 1: 2 prefill + 2 decode simulated engines and the proxy on 127.0.0.1:8000
    python -m loadtests.locust_target              # or: pd-router demo --keep --port 8000
    # shell 2
    locust -f loadtests/locustfile.py --headless -u 20 -r 5 -t 60s --host http://127.0.0.1:8000

    # the same cluster behind a real Envoy (the ext_proc picker, a sidecar per decode pod)
    python -m loadtests.locust_target --envoy --port 8080
    locust -f loadtests/locustfile.py --headless -u 20 -r 5 -t 60s --host http://127.0.0.1:8080

    # a real fleet: name the model (else GET /v1/models decides), longer answers, CSV files
    locust -f loadtests/locustfile.py --headless -u 64 -r 8 -t 10m --host http://gateway \\
        --pdr-model Qwen/Qwen3-8B --pdr-max-tokens 128 --csv run --exit-code-on-error 1

Traffic: four user classes, spawned in proportion to their weights (20 users: 8/6/4/2):

    class             weight  path                  each request
    SharedPrefixUser  4       /v1/chat/completions  a tenant's long system prompt + a short question
    ChatUser          3       /v1/chat/completions  the next turn of a conversation, history resent
    LongInputUser     2       /v1/completions       a long unique document, a short answer
    LongOutputUser    1       /v1/completions       a short prompt, a long answer

Tenants (``--pdr-tenants``) have a system prompt of ``--pdr-system-tokens`` each, the same in every
locust process (it is derived from ``--pdr-seed``), and are picked with a Zipf skew; their requests
carry llm-d's ``x-llm-d-inference-fairness-id``. A conversation belongs to a tenant too, and
starts over after ``--pdr-turns`` turns. A request streams (``stream: true`` with
``stream_options: {include_usage: true}``) with probability ``--pdr-stream-ratio``.

Statistics, one row per (type, kind); the kinds are ``shared-prefix``, ``multi-turn``,
``long-in-short-out`` and ``short-in-long-out``:

    POST  non-streamed requests: time to the whole answer
    SSE   streamed requests: time to the end of the stream
    TTFT  ms from sending to the first token event (successful streams only)
    TPOT  ms per output token after the first (successful streams of 2+ tokens)

"Content size" is the output tokens for POST, SSE and TPOT (``usage.completion_tokens``, else the
token events counted) and the prompt tokens for TTFT. TTFT and TPOT samples are custom metrics (a
fired ``request`` event each), so locust's "Aggregated" row counts them too: read the typed rows.

A token event is what ``router/request/meter.py`` counts: a ``data:`` event with a choice, but not the
role-only opening chunk (``"role"`` with empty ``content``), not the usage chunk (no choices),
not ``[DONE]``. A request fails (with the reason as its message) on a non-200 answer, a connection
error, an answer that is not what was asked for (JSON without choices, a stream that is not
``text/event-stream``), an ``error`` event in the stream, a stream without a token event, or a
stream that ends without ``data: [DONE]``.

Options, after ``-f`` on locust's command line (each also from an environment variable: the
option's name in capitals, ``--pdr-max-tokens`` is ``PDR_MAX_TOKENS``):

    --pdr-model NAME              the model asked for (default: the first of GET /v1/models, else
                                  sim-model, what examples/pool.yaml and the demo serve)
    --pdr-max-tokens 64           a chat answer's max_tokens; long inputs get 1/8, long outputs 4x
    --pdr-tenants 4               tenants, each with its own system prompt
    --pdr-system-tokens 1024      a tenant's system prompt, in tokens (of about 4 characters)
    --pdr-long-input-tokens 3000  a long-input document, in tokens
    --pdr-turns 6                 turns before a conversation starts over
    --pdr-stream-ratio 0.8        the fraction of requests that stream
    --pdr-think-s 0.5             a user waits 0 to this many seconds between its requests
    --pdr-timeout-s 120           a request's read timeout (between two streamed chunks)
    --pdr-seed 0                  the prompts' seed

Only ever load this file through locust: importing locust patches the process with gevent.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import requests
from locust import HttpUser, events, task
from locust.argument_parser import LocustArgumentParser
from locust.clients import ResponseContextManager
from locust.env import Environment

log = logging.getLogger(__name__)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FALLBACK_MODEL = "sim-model"  # what examples/pool.yaml and the demo serve
FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
CHARS_PER_TOKEN = 4  # the sizes below are in tokens at about this many characters each
QUESTION_TOKENS = 40
CONNECT_TIMEOUT_S = 10.0
SHOWN_CHARS = 200  # of an error body, in a failure message

_WORDS = (  # noqa: SIM905 - a word list reads better as text
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar "
    "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu amber basil cedar dune "
    "ember fjord garnet harbor island jasper kelp lagoon meadow nectar orchard prairie quartz river "
    "summit thicket upland valley willow yarrow zephyr anchor beacon canyon dawn estuary forest"
).split()


@events.init_command_line_parser.add_listener
def _options(parser: LocustArgumentParser) -> None:
    group = parser.add_argument_group("pd-router traffic (loadtests/locustfile.py)")
    group.add_argument(
        "--pdr-model",
        env_var="PDR_MODEL",
        default="",
        help=f"model name to ask for (default: the first of GET /v1/models, else {FALLBACK_MODEL})",
    )
    group.add_argument(
        "--pdr-max-tokens",
        env_var="PDR_MAX_TOKENS",
        type=int,
        default=64,
        help="max_tokens of a chat answer; long inputs get 1/8 of it, long outputs 4x",
    )
    group.add_argument(
        "--pdr-tenants",
        env_var="PDR_TENANTS",
        type=int,
        default=4,
        help="tenants, each with its own shared system prompt",
    )
    group.add_argument(
        "--pdr-system-tokens",
        env_var="PDR_SYSTEM_TOKENS",
        type=int,
        default=1024,
        help="length of a tenant's system prompt, in tokens (about)",
    )
    group.add_argument(
        "--pdr-long-input-tokens",
        env_var="PDR_LONG_INPUT_TOKENS",
        type=int,
        default=3000,
        help="length of a long-input document, in tokens (about)",
    )
    group.add_argument(
        "--pdr-turns",
        env_var="PDR_TURNS",
        type=int,
        default=6,
        help="turns before a conversation starts over",
    )
    group.add_argument(
        "--pdr-stream-ratio",
        env_var="PDR_STREAM_RATIO",
        type=float,
        default=0.8,
        help="fraction of requests that stream",
    )
    group.add_argument(
        "--pdr-think-s",
        env_var="PDR_THINK_S",
        type=float,
        default=0.5,
        help="a user waits uniformly 0..this many seconds between requests",
    )
    group.add_argument(
        "--pdr-timeout-s",
        env_var="PDR_TIMEOUT_S",
        type=float,
        default=120.0,
        help="read timeout of a request (between two streamed chunks)",
    )
    group.add_argument(
        "--pdr-seed",
        env_var="PDR_SEED",
        type=int,
        default=0,
        help="seed of the prompts (tenant prompts depend on nothing else)",
    )


@dataclass(frozen=True)
class Settings:
    model: str
    max_tokens: int
    tenants: int
    system_tokens: int
    long_input_tokens: int
    turns: int
    stream_ratio: float
    think_s: float
    timeout_s: float
    seed: int


_settings: dict[int, Settings] = {}  # by id(environment): one per locust run in this process
_user_ids = itertools.count()


def settings(environment: Environment) -> Settings:
    """This run's settings, the model resolved once (GET /v1/models when not given)."""
    found = _settings.get(id(environment))
    if found is not None:
        return found
    options = environment.parsed_options
    if options is None:  # run as a library without a command line: the option defaults
        parser = LocustArgumentParser()
        _options(parser)
        options = parser.parse_args([])
    model = options.pdr_model or _served_model(environment.host)
    found = Settings(
        model=model,
        max_tokens=max(1, options.pdr_max_tokens),
        tenants=max(1, options.pdr_tenants),
        system_tokens=max(1, options.pdr_system_tokens),
        long_input_tokens=max(1, options.pdr_long_input_tokens),
        turns=max(1, options.pdr_turns),
        stream_ratio=min(1.0, max(0.0, options.pdr_stream_ratio)),
        think_s=max(0.0, options.pdr_think_s),
        timeout_s=options.pdr_timeout_s,
        seed=options.pdr_seed,
    )
    _settings[id(environment)] = found
    log.info("pd-router traffic: %s", found)
    return found


def _served_model(host: str | None) -> str:
    if not host:
        return FALLBACK_MODEL
    try:
        answer = requests.get(f"{host.rstrip('/')}/v1/models", timeout=CONNECT_TIMEOUT_S)
        answer.raise_for_status()
        return str(answer.json()["data"][0]["id"])
    except (requests.RequestException, ValueError, KeyError, IndexError, TypeError) as exc:
        log.warning("GET %s/v1/models failed (%s); asking for model %r", host, exc, FALLBACK_MODEL)
        return FALLBACK_MODEL


@events.test_start.add_listener
def _resolve_model(environment: Environment, **_: Any) -> None:
    # Before any user starts, so the first requests do not all ask /v1/models at once; again at
    # every start, since the web UI can change the options and the host between runs.
    _settings.pop(id(environment), None)
    settings(environment)


def words(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of words."""
    target = tokens * CHARS_PER_TOKEN
    out: list[str] = []
    size = 0
    while size < target:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


_tenant_prompts: dict[tuple[int, int, int], str] = {}


def tenant_prompt(tenant: int, cfg: Settings) -> str:
    """Tenant ``tenant``'s system prompt: the same text in every process and every run with the same
    seed, since every locust worker must send the same prefix for the cache to be shared."""
    key = (cfg.seed, tenant, cfg.system_tokens)
    prompt = _tenant_prompts.get(key)
    if prompt is None:
        rng = random.Random(f"pd-router-tenant-{cfg.seed}-{tenant}")  # str seeds ignore PYTHONHASHSEED
        head = f"You are the assistant of tenant {tenant}. Answer in the tenant's style.\n"
        prompt = _tenant_prompts[key] = head + words(rng, cfg.system_tokens)
    return prompt


@dataclass
class StreamMeter:
    """What a streamed answer said, fed one SSE line at a time as it arrives."""

    events: int = 0  # token events
    first_at: float | None = None
    last_at: float | None = None
    done: bool = False
    error: str | None = None
    usage: dict[str, Any] | None = None
    parts: list[str] = field(default_factory=list)

    def feed(self, line: bytes, now: float) -> None:
        if not line.startswith(b"data:"):
            return  # the blank line between events, comments, event:/id: fields
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            self.error = self.error or f"stream event is not JSON: {data[:SHOWN_CHARS]!r}"
            return
        if not isinstance(event, dict):
            self.error = self.error or f"stream event is not an object: {data[:SHOWN_CHARS]!r}"
            return
        if "error" in event:
            self.error = self.error or f"error event in the stream: {_error_message(event)}"
            return
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        choices = event.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return  # the usage chunk
        choice = choices[0]
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if "role" in delta and delta.get("content") == "":
                return  # the role-only opening chunk: sent before the prompt is computed
            text = delta.get("content")
        else:
            text = choice.get("text")
        self.events += 1
        if self.first_at is None:
            self.first_at = now
        self.last_at = now
        if isinstance(text, str):
            self.parts.append(text)

    @property
    def output_tokens(self) -> int:
        """The engine's count when it gave one (a server may put several tokens in an event)."""
        counted = (self.usage or {}).get("completion_tokens")
        return counted if isinstance(counted, int) and counted >= 0 else self.events

    def failure(self) -> str | None:
        """Why the stream failed, or None."""
        if self.error is not None:
            return self.error
        if not self.done:
            return f"stream ended without [DONE] ({self.events} token events)"
        if self.events == 0:
            return "stream ended without a token event"
        return None


def _error_message(answer: dict[str, Any]) -> str:
    error = answer.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error)[:SHOWN_CHARS]
    return str(error)[:SHOWN_CHARS]


def _http_failure(response: ResponseContextManager) -> str:
    if response.status_code == 0:  # locust's stand-in when no answer came at all
        return f"no answer: {response.error}"
    try:
        answer = response.json()
        shown = _error_message(answer) if isinstance(answer, dict) else str(answer)[:SHOWN_CHARS]
    except (ValueError, requests.RequestException):
        shown = (response.text or "")[:SHOWN_CHARS]
    return f"HTTP {response.status_code}: {shown}"


class OpenAIUser(HttpUser):
    """One simulated client; subclasses are the kinds of traffic."""

    abstract = True
    kind: ClassVar[str] = ""  # the rows' name in locust's statistics
    cfg: Settings
    rng: random.Random

    def on_start(self) -> None:
        self.cfg = settings(self.environment)
        self.rng = random.Random(f"{self.cfg.seed}-{self.kind}-{next(_user_ids)}")

    def wait_time(self) -> float:
        return self.rng.uniform(0.0, self.cfg.think_s)

    def pick_tenant(self) -> int:
        # Zipf-skewed: a few busy tenants and a tail, as shared deployments see.
        weights = [1.0 / (i + 1) for i in range(self.cfg.tenants)]
        return self.rng.choices(range(self.cfg.tenants), weights=weights)[0]

    def complete(self, path: str, body: dict[str, Any], tenant: int | None = None) -> str | None:
        """Send one request and check its answer; the answer's text, or None if it failed."""
        stream = self.rng.random() < self.cfg.stream_ratio
        body = {"model": self.cfg.model, **body}
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        headers = {} if tenant is None else {FAIRNESS_HEADER: f"tenant-{tenant}"}
        started_at = time.time()
        start = time.perf_counter()
        with self.client.post(
            path,
            json=body,
            headers=headers,
            name=self.kind,
            stream=stream,
            catch_response=True,
            timeout=(CONNECT_TIMEOUT_S, self.cfg.timeout_s),
        ) as response:
            if stream:
                return self._read_stream(response, started_at, start)
            return self._read_json(response, chat=path == CHAT)

    def _read_json(self, response: ResponseContextManager, chat: bool) -> str | None:
        meta = cast(dict[str, Any], response.request_meta)
        if response.status_code != 200:
            response.failure(_http_failure(response))
            return None
        try:
            answer = response.json()
        except ValueError:
            response.failure(f"answer is not JSON: {(response.text or '')[:SHOWN_CHARS]!r}")
            return None
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            response.failure(f"answer has no choices: {response.text[:SHOWN_CHARS]!r}")
            return None
        usage = answer.get("usage")
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        meta["response_length"] = tokens if isinstance(tokens, int) else 0
        choice = choices[0]
        text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
        return text if isinstance(text, str) else ""

    def _read_stream(self, response: ResponseContextManager, started_at: float, start: float) -> str | None:
        meta = cast(dict[str, Any], response.request_meta)
        # Its own type, so streamed and whole answers (different timings) get separate rows.
        meta["request_type"] = "SSE"
        if response.status_code != 200:
            response.failure(_http_failure(response))
            return None
        content_type = response.headers.get("content-type", "")
        if not content_type.startswith("text/event-stream"):
            response.failure(f"asked to stream, answered with content-type {content_type!r}")
            return None
        meter = StreamMeter()
        broken: str | None = None
        try:
            # Line by line as the chunks arrive (the answer is chunked), so token times are real.
            for line in response.iter_lines():
                meter.feed(line, time.perf_counter())
        except requests.RequestException as exc:
            broken = f"stream broken after {meter.events} token events: {exc.__class__.__name__}"
        end = time.perf_counter()
        # Locust timed the request to its headers (stream=True); the row shows it to the last byte.
        meta["response_time"] = (end - start) * 1000.0
        meta["response_length"] = meter.output_tokens
        reason = broken or meter.failure()
        if reason is not None:
            response.failure(reason)
            return None
        self._record_token_times(meter, started_at, start)
        return "".join(meter.parts)

    def _record_token_times(self, meter: StreamMeter, started_at: float, start: float) -> None:
        assert meter.first_at is not None and meter.last_at is not None
        prompt = (meter.usage or {}).get("prompt_tokens")
        prompt_tokens = prompt if isinstance(prompt, int) else 0
        self._custom("TTFT", (meter.first_at - start) * 1000.0, prompt_tokens, started_at)
        n = meter.output_tokens
        if n >= 2 and meter.last_at > meter.first_at:
            tpot_ms = (meter.last_at - meter.first_at) * 1000.0 / (n - 1)
            self._custom("TPOT", tpot_ms, n, started_at)

    def _custom(self, metric: str, ms: float, length: int, started_at: float) -> None:
        self.environment.events.request.fire(
            request_type=metric,
            name=self.kind,
            response_time=ms,
            response_length=length,
            response=None,
            context=self.context(),
            exception=None,
            start_time=started_at,
        )


class SharedPrefixUser(OpenAIUser):
    """Tenants' users: one long system prompt per tenant, a short new question each time."""

    weight = 4
    kind = "shared-prefix"

    @task
    def ask(self) -> None:
        tenant = self.pick_tenant()
        messages = [
            {"role": "system", "content": tenant_prompt(tenant, self.cfg)},
            {"role": "user", "content": words(self.rng, QUESTION_TOKENS)},
        ]
        self.complete(CHAT, {"messages": messages, "max_tokens": self.cfg.max_tokens}, tenant)


class ChatUser(OpenAIUser):
    """A conversation that grows turn by turn: every request resends the whole history."""

    weight = 3
    kind = "multi-turn"

    def on_start(self) -> None:
        super().on_start()
        self.tenant = 0
        self.history: list[dict[str, str]] = []
        self.turns = 0

    @task
    def next_turn(self) -> None:
        if not self.history or self.turns >= self.cfg.turns:
            self.tenant = self.pick_tenant()
            self.history = [{"role": "system", "content": tenant_prompt(self.tenant, self.cfg)}]
            self.turns = 0
        question = {"role": "user", "content": f"Turn {self.turns + 1}. {words(self.rng, QUESTION_TOKENS)}"}
        body = {"messages": [*self.history, question], "max_tokens": self.cfg.max_tokens}
        answer = self.complete(CHAT, body, self.tenant)
        if answer is None:
            self.history = []  # a failed turn ends the conversation: the user starts a new one
            return
        self.history += [question, {"role": "assistant", "content": answer}]
        self.turns += 1


class LongInputUser(OpenAIUser):
    """Summaries and classification: a long document nobody sent before, a few tokens back."""

    weight = 2
    kind = "long-in-short-out"

    @task
    def summarize(self) -> None:
        document = words(self.rng, self.cfg.long_input_tokens)
        prompt = f"Document {self.rng.getrandbits(64):016x}:\n{document}\nSummarize it in one line:"
        self.complete(COMPLETIONS, {"prompt": prompt, "max_tokens": max(1, self.cfg.max_tokens // 8)})


class LongOutputUser(OpenAIUser):
    """Generation: a one-line request, a long answer (decode-bound)."""

    weight = 1
    kind = "short-in-long-out"

    @task
    def write(self) -> None:
        prompt = f"Write a long story about {words(self.rng, 12)}:"
        self.complete(COMPLETIONS, {"prompt": prompt, "max_tokens": self.cfg.max_tokens * 4})
