"""Fuzzing OpenAI request bodies: ``router.request.parse.parse_request``, then the proxy over real HTTP.

Every body (wrong types, huge numbers, deep nesting, invalid UTF-8, huge strings, random bytes)
either becomes a ``RouteRequest`` the proxy can forward or raises a ``Rejection`` that answers
4xx with an OpenAI-style JSON error; through a running ``App`` each answer is a
JSON 4xx or a 200, nothing stays reserved, and the next valid request is served.

Example counts: fixed and derandomized for CI; ``FUZZ_EXAMPLES=<n>`` runs ``n`` random examples
per test (see ``tests/fuzz/__init__.py``).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from fuzz import fuzz_settings
from router.request.parse import MAX_JSON_DEPTH, parse_request
from router.request.rejections import BadRequest, BodyTooLarge, Rejection, UnknownModel, answer
from router.request.types import RequestLimits, RouteRequest

# -- strategies ---------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)  # past int64 and uint64
    | st.floats(allow_nan=True, allow_infinity=True)  # NaN/Infinity: not JSON at all
    | st.text(max_size=30)
)
json_values = st.recursive(
    json_scalars,
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=8), kids, max_size=5),
    max_leaves=20,
)
small_ints = st.integers(min_value=-3, max_value=8)
token_counts = small_ints | st.integers(min_value=-(1 << 65), max_value=1 << 65) | json_values
content_parts = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]) | json_values},
        optional={"text": st.text(max_size=40) | json_values},
    )
    | json_values,
    max_size=4,
)
messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["system", "user", "assistant"]) | json_values,
            "content": st.text(max_size=80) | content_parts | json_values,
        },
    )
    | json_values,
    max_size=4,
)
prompts = (
    st.text(max_size=300)
    | st.lists(st.text(max_size=20), max_size=3)
    | st.lists(st.integers(min_value=-(1 << 64), max_value=1 << 64) | st.booleans(), max_size=20)
    | st.lists(st.lists(st.integers(min_value=-2, max_value=1 << 33), max_size=40), max_size=3)  # batches
    | json_values
)


def openai_bodies(models: st.SearchStrategy[Any], max_tokens: st.SearchStrategy[Any]) -> st.SearchStrategy:
    """A completions or chat body, each field plausible, of a wrong type, or absent."""
    return st.fixed_dictionaries(
        {},
        optional={
            "model": models | json_values,
            "prompt": prompts,
            "messages": messages | json_values,
            "max_tokens": max_tokens,
            "max_completion_tokens": max_tokens,
            "stream": st.booleans() | json_values,
            "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
            "kv_transfer_params": json_values,
            "temperature": json_values,
            "extra": json_values,
            # The Messages and Responses APIs' own fields (their messages are the ones above).
            "system": st.text(max_size=80) | content_parts | json_values,
            "input": st.text(max_size=80) | messages | json_values,
            "instructions": st.text(max_size=80) | json_values,
            "max_output_tokens": max_tokens,
        },
    )


def plausible_bodies(model: str) -> st.SearchStrategy:
    """A body an engine would take, plus extra fields of any JSON value."""
    chat = st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=80)}
        ),
        min_size=1,
        max_size=3,
    )
    return st.fixed_dictionaries(
        {"model": st.just(model), "max_tokens": st.integers(min_value=1, max_value=3)},
        optional={
            "prompt": st.text(min_size=1, max_size=300),
            "messages": chat,
            "stream": st.booleans(),
            "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
            "temperature": json_values,
            "user": json_values,
        },
    )


def encode(value: Any, ensure_ascii: bool) -> bytes:
    """JSON as a client might write it (NaN and Infinity included: invalid JSON for the server)."""
    return json.dumps(value, allow_nan=True, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")


# Bytes that break UTF-8 or JSON: lone continuation/lead bytes, an encoded surrogate, overlong
# forms, a BOM, NUL, a lone surrogate escape, bare control characters.
NASTY = [b"\xff", b"\xc3", b"\x80", b"\xed\xa0\x80", b"\xc0\xaf", b"\xef\xbb\xbf"]
NASTY += [b"\x00", b'\\ud800"', b"\n\t"]


@st.composite
def mutated(draw: st.DrawFn, raw: bytes) -> bytes:
    """``raw`` truncated, or with nasty or random bytes inserted or overwritten."""
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        at = draw(st.integers(min_value=0, max_value=len(raw)))
        op = draw(st.sampled_from(["truncate", "insert", "overwrite"]))
        piece = draw(st.sampled_from(NASTY) | st.binary(min_size=1, max_size=4))
        if op == "truncate":
            raw = raw[:at]
        elif op == "insert":
            raw = raw[:at] + piece + raw[at:]
        else:
            raw = raw[:at] + piece + raw[at + len(piece) :]
    return raw


@st.composite
def deep(draw: st.DrawFn, model: str) -> bytes:
    """A valid body with one field nested around the re-encoding and parsing depth limits."""
    depth = draw(st.sampled_from([MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, 600, 1030]))
    depth = depth + draw(st.integers(min_value=-1, max_value=1))
    opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
    inner = opener * depth + b"1" + closer * depth if opener == b'{"a":' else opener * depth + closer * depth
    stream = draw(st.sampled_from([b"", b'"stream":true,']))
    return b'{"model":"' + model.encode() + b'",' + stream + b'"prompt":"hi","deep":' + inner + b"}"


def raw_bodies(model: str, max_tokens: st.SearchStrategy[Any]) -> st.SearchStrategy:
    """Bodies for a pool serving ``model``: encoded, mutated, not an object, deep, random bytes."""
    bodies = openai_bodies(st.sampled_from([model, "other", ""]), max_tokens)
    encoded = st.builds(encode, bodies, st.booleans())
    return st.one_of(
        st.builds(encode, plausible_bodies(model), st.booleans()),
        encoded,
        encoded.flatmap(mutated),
        st.builds(encode, json_values, st.booleans()),  # not an object
        deep(model),
        st.binary(max_size=200),
    )


priority_values = (
    st.integers(min_value=-(10**30), max_value=10**30).map(str)
    | st.text(max_size=20)
    | st.sampled_from(["9" * 4301, " 7 ", "²", "batch-sheddable", "1_000"])
)
request_headers = st.fixed_dictionaries(
    {},
    optional={
        "x-pd-router-priority": priority_values,
        "x-gateway-inference-objective": priority_values,
        "x-request-id": st.text(max_size=40),
    },
)
limits = st.builds(
    RequestLimits,
    max_body_bytes=st.sampled_from([64, *[4 * 1024 * 1024] * 3]),
    max_prompt_tokens=st.sampled_from([8, *[131072] * 3]),
    default_max_tokens=st.just(256),
    block_tokens=st.integers(min_value=1, max_value=64),
    chars_per_token=st.sampled_from([0.5, 1.0, 4.0, 7.3]),
    served_model=st.sampled_from([None, "m"]),
)

# -- the parser -----------------------------------------------------------------------------------


# Each API the parser reads, one it does not, and none (an ext_proc stream without :path).
paths = st.sampled_from(
    [None, "/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/embeddings"]
)


def parse_or_reject(
    raw: bytes, limits: RequestLimits, headers: Mapping[str, str], path: str | None = None
) -> RouteRequest | Rejection:
    """``parse_request``'s result or its rejection; any other exception fails the test."""
    try:
        return parse_request(raw, limits, headers, path=path, pool_model="m")
    except Rejection as rejection:
        return rejection


def check_rejection(rejection: Rejection) -> None:
    """A parse rejection is the client's mistake: a 4xx with an OpenAI-style JSON error."""
    assert isinstance(rejection, BadRequest | BodyTooLarge | UnknownModel), type(rejection)
    reply = answer(rejection)
    assert reply.status in (400, 404, 413)
    assert reply.headers["content-type"] == "application/json"
    error = orjson.loads(reply.body)["error"]
    assert error["code"] == rejection.code and isinstance(error["message"], str) and error["message"]
    # Clear, and never an echo of a huge value the client sent.
    assert len(error["message"]) < 400, error["message"][:400]


def check_request(request: RouteRequest, limits: RequestLimits) -> None:
    """An accepted body is one the proxy can forward: sane fields, re-encodable as it must be."""
    assert isinstance(request.model, str) and request.model
    assert limits.served_model in (None, request.model)
    assert 0 <= request.prompt_tokens <= limits.max_prompt_tokens
    assert type(request.max_tokens) is int and request.max_tokens >= 1
    assert type(request.stream) is bool and type(request.priority) is int
    assert "kv_transfer_params" not in request.body
    if request.prompt_ids is not None:  # a prompt of token ids: blocks of block_tokens ids
        assert not request.prompt and request.exact_tokens
        assert len(request.block_keys) == len(request.prompt_ids) // limits.block_tokens
    else:
        block_chars = max(1, round(limits.block_tokens * limits.chars_per_token))
        assert len(request.block_keys) == len(request.prompt) // block_chars
    orjson.dumps(request.body)  # the proxy re-encodes it (usage request, both P/D legs)


@fuzz_settings(250)
@given(raw_bodies("m", token_counts), limits, request_headers, paths)
def test_every_body_is_a_route_request_or_a_4xx_json_rejection(
    raw: bytes, limits: RequestLimits, headers: dict[str, str], path: str | None
) -> None:
    result = parse_or_reject(raw, limits, headers, path)
    event(type(result).__name__)  # --hypothesis-show-statistics
    if isinstance(result, Rejection):
        check_rejection(result)
    else:
        check_request(result, limits)


def test_depth_at_the_re_encoding_limit() -> None:
    # A body nested deeper than orjson re-encodes (255..1023 levels) must be refused at the parse,
    # not accepted and then failed in the proxy with a 500 text/plain "Internal Server Error".
    limits = RequestLimits(4 << 20, 131072, 256, 16, 4.0)
    for depth, ok in ((MAX_JSON_DEPTH - 1, True), (MAX_JSON_DEPTH, False), (1000, False)):
        raw = b'{"model":"m","prompt":"hi","x":' + b"[" * depth + b"]" * depth + b"}"
        result = parse_or_reject(raw, limits, {})
        assert isinstance(result, RouteRequest) is ok, (depth, result)
        if not ok:
            assert isinstance(result, BadRequest) and "nested" in result.message
    # Many brackets side by side are not deep.
    flat = b'{"model":"m","prompt":"hi","x":[' + b",".join([b"[]"] * 5000) + b"]}"
    assert isinstance(parse_or_reject(flat, limits, {}), RouteRequest)


def test_error_messages_never_echo_a_huge_client_value() -> None:
    # A message quoting the whole value would send a 4 MB model name back in the answer.
    limits = RequestLimits(8 << 20, 10**9, 256, 16, 4.0, served_model="m")
    for raw, headers in (
        (orjson.dumps({"model": "x" * 1_000_000, "prompt": "hi"}), {}),
        (orjson.dumps({"model": "m", "prompt": "hi", "max_tokens": "9" * 1_000_000}), {}),
        (orjson.dumps({"model": "m", "prompt": "hi", "max_tokens": [[1] * 1000] * 1000}), {}),
        (orjson.dumps({"model": "m", "prompt": "hi"}), {"x-pd-router-priority": "p" * 100_000}),
    ):
        result = parse_or_reject(raw, limits, headers)
        assert isinstance(result, Rejection)
        check_rejection(result)


def _huge_bodies() -> Iterator[tuple[str, bytes]]:
    size = 4 * 1024 * 1024 - 4096
    yield "ascii prompt", orjson.dumps({"model": "m", "prompt": "a" * size})
    yield "2-byte prompt", orjson.dumps({"model": "m", "prompt": "é" * (size // 2)})
    yield "4-byte prompt", orjson.dumps({"model": "m", "prompt": "\U0001f600" * (size // 4)})
    yield "escaped prompt", b'{"model":"m","prompt":"' + b"\\u00e9" * (size // 6) + b'"}'
    yield "token ids", orjson.dumps({"model": "m", "prompt": list(range(size // 8))})
    yield "tiny messages", orjson.dumps({"model": "m", "messages": [{"role": "u"}] * (size // 13)})
    parts = [{"type": "text", "text": "ab"}] * (size // 28)
    yield "content parts", orjson.dumps({"model": "m", "messages": [{"role": "u", "content": parts}]})
    yield "many keys", orjson.dumps({"model": "m", "prompt": "x", **{f"k{i}": 0 for i in range(size // 12)}})
    yield "long model name", orjson.dumps({"model": "q" * size, "prompt": "x"})
    yield "huge number", b'{"model":"m","prompt":"x","max_tokens":' + b"9" * size + b"}"
    yield "flat brackets", b'{"model":"m","prompt":"x","a":[' + b",".join([b"[]"] * (size // 6)) + b"]}"
    yield "deep then wide", b'{"model":"m","prompt":"x","a":' + b"[" * 1000 + b"0," * (size // 2) + b"]}"


@pytest.mark.parametrize(("shape", "raw"), list(_huge_bodies()), ids=[s for s, _ in _huge_bodies()])
def test_bodies_at_the_size_limit_are_a_route_request_or_a_4xx(shape: str, raw: bytes) -> None:
    # How fast they parse is a benchmark's business, not a test's.
    limits = RequestLimits(4 * 1024 * 1024, 10**8, 256, 16, 4.0, served_model="m")
    result = parse_or_reject(raw, limits, {"x-pd-router-priority": "9" * 4300})
    if isinstance(result, Rejection):
        check_rejection(result)
    else:
        check_request(result, limits)


# -- through the proxy ------------------------------------------------------------------------------

# Every request takes a P/D pair (both legs re-encode the body); small limits make 413s cheap.
BODY_LIMIT = 16384
PROXY_SECTIONS = {
    "picker": {"allow_local_prefill": False},
    "limits": {"max_body_bytes": BODY_LIMIT, "default_max_tokens": 2},
}
VALID = orjson.dumps({"model": "sim-model", "prompt": "the next valid request " * 8, "max_tokens": 1})


# The App runs in a child process: hypothesis checks that nothing touches the global ``random``
# while it generates an example, and the App's scrape loop (jitter) would from a thread.
SERVER = """
import asyncio, sys
from helpers import eventually, router_on_sim
from simulator.engine import EngineSpec

async def main():
    specs = [EngineSpec("p0", "prefill"), EngineSpec("d0", "decode")]
    async with router_on_sim(specs, SECTIONS) as (_, app, _base):
        await eventually(lambda: len(app.parts.pool.candidate_slots()) == 2, what="both engines admitted")
        print(app.proxy_port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test ends

asyncio.run(main())
"""
ROOT = Path(__file__).resolve().parents[2]


class ProxyProcess:
    """A simulated P/D pair behind an ``App``, in a child process; requests go over HTTP."""

    def __init__(self, log: Path) -> None:
        script = SERVER.replace("SECTIONS", repr(PROXY_SECTIONS))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
        self._log = log.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-c", script],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], 60)
        line = self.process.stdout.readline() if ready else b""
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError(f"the proxy did not start:\n{log.read_text()[-3000:]}")
        self.port = int(line)

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            connection.request(method, path, body=body, headers=dict(headers or {}))
            response = connection.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            connection.close()

    def outstanding(self) -> float:
        _, _, text = self.request("GET", "/metrics")
        (value,) = re.findall(rb"^pd_router_outstanding_reservations (\S+)$", text, re.MULTILINE)
        return float(value)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    server = ProxyProcess(tmp_path_factory.mktemp("proxy") / "stderr.log")
    try:
        yield server
    finally:
        server.close()


def check_served(server: ProxyProcess) -> None:
    status, _, reply = server.request("POST", "/v1/completions", VALID, {"content-type": "application/json"})
    assert status == 200, reply[:300]
    assert orjson.loads(reply)["choices"]


http_headers = st.fixed_dictionaries(
    {"content-type": st.sampled_from(["application/json", "text/plain", "multipart/form-data"])},
    optional={
        "x-pd-router-priority": st.integers(min_value=-3, max_value=3).map(str) | st.text("ab-1", max_size=6),
        "x-gateway-inference-objective": st.sampled_from(["batch-sheddable", "critical", "7"]),
    },
)


@pytest.mark.integration
@fuzz_settings(200)
@given(
    st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    st.builds(encode, plausible_bodies("sim-model"), st.booleans())
    | raw_bodies("sim-model", small_ints | json_values)
    | st.binary(min_size=BODY_LIMIT + 1, max_size=BODY_LIMIT + 600),
    http_headers,
)
def test_the_proxy_answers_every_body_with_a_4xx_json_error_or_a_200(
    proxy: ProxyProcess, path: str, raw: bytes, headers: dict[str, str]
) -> None:
    try:
        status, reply_headers, reply = proxy.request("POST", path, raw, headers)
    except OSError:
        # Over the limit, the server may answer 413 and close before reading the whole body: the
        # client can then see its send or read fail instead of the answer.
        assert len(raw) > BODY_LIMIT
        status, reply_headers, reply = 413, {"content-type": "application/json"}, b""
    event(f"HTTP {status}")  # --hypothesis-show-statistics
    if status == 413 and not reply and len(raw) > BODY_LIMIT:
        event("closed on an oversized body")
    elif status != 200:
        assert 400 <= status < 500, (status, reply[:300])
        assert reply_headers.get("content-type", "").startswith("application/json"), reply[:300]
        assert orjson.loads(reply)["error"]["message"]
    check_served(proxy)
    wait_until(lambda: proxy.outstanding() == 0, "every reservation released")


@pytest.mark.integration
def test_an_engine_error_to_a_streamed_request_keeps_its_body(proxy: ProxyProcess) -> None:
    # The engine refuses a chat request without messages (400 JSON); the router accepts it.
    raw = orjson.dumps({"model": "sim-model", "prompt": "hi", "stream": True, "max_tokens": 1})
    status, headers, reply = proxy.request(
        "POST", "/v1/chat/completions", raw, {"content-type": "application/json"}
    )
    assert status == 400 and headers["content-type"].startswith("application/json")
    assert orjson.loads(reply)["error"]["message"]


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)
