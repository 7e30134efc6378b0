"""Fuzzing engine ``/metrics`` text: ``parse_vllm_metrics`` against ``prometheus_client``'s parser.

Generated expositions are valid Prometheus text (vLLM's metric names, current and deprecated,
among look-alike names; labels with escapes, braces, commas and unicode; NaN and ±Inf; HELP, TYPE
and free comments; duplicate series; blanks and tabs wherever the format allows them, CRLF, no
newline at the end). For the features ``router/state/features.py`` declares, the values our parser
extracts must equal what the reference parser (the oracle) says, combined as declared: sums,
means, the current name before deprecated ones, non-finite samples left out, KV capacity from
``vllm:cache_config_info``'s labels. Any other text, mutated or random, never raises; through
``Scraper`` every body is metrics or a ``ScrapeError`` with its documented reason.

Example counts: fixed and derandomized for CI; ``FUZZ_EXAMPLES=<n>`` runs ``n`` random examples
per test (see ``tests/fuzz/__init__.py``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from fuzz import fuzz_settings
from router.observe.scrape import ScrapeError, Scraper, ScrapeReason, parse_vllm_metrics
from router.request.types import EngineMetrics
from router.state.features import FEATURES

# metric name -> (feature, rank, combine), from the declarations (not from the parser's tables).
DECLARED: dict[str, tuple[str, int, str]] = {
    metric: (f.name, rank, f.scraped.combine)
    for f in FEATURES
    if f.scraped is not None
    for rank, metric in enumerate(f.scraped.metrics)
}
SCRAPED = [f.name for f in FEATURES if f.scraped is not None]
CAPACITY_METRICS = [name for name, (_, _, combine) in DECLARED.items() if combine == "capacity"]
LOOK_ALIKES = [
    "vllm:num_requests_running_created",
    "vllm:num_requests_waiting_by_reason",
    "vllm:kv_cache_usage_perc_sum",
    "vllm:prefix_cache_queries_created",
    "vllm:cache_config_info_extra",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:num_requests",
    "process_cpu_seconds_total",
    "xvllm:num_requests_running",
]
LABEL_NAMES = ["engine", "model_name", "block_size", "num_gpu_blocks", "cache_dtype", "le", "a_1"]
SANE_INT = 10**12  # config ints are generated sane (<= this) or absurd (>= 10**30, or negative)

# -- a valid exposition, as a model -------------------------------------------------------------------


@dataclass
class Series:
    name: str
    labels: dict[str, str]
    value: str  # as written
    timestamp: int | None = None


@dataclass
class Exposition:
    lines: list[str] = field(default_factory=list)
    newline: str = "\n"
    final_newline: bool = True

    def text(self) -> str:
        return self.newline.join(self.lines) + (self.newline if self.final_newline else "")


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


label_values = (
    st.text(st.characters(codec="utf-8"), max_size=12)
    | st.sampled_from(['a "quoted" } brace, with = signs', "back\\slash", "two\nlines", "", "None", "lots"])
    | st.integers(min_value=0, max_value=SANE_INT).map(str)
    | st.sampled_from([" 16", "+16", "1_6", "-16", "16.0", "0x10", str(10**30), "9" * 500])
)
sample_values = (
    st.floats(allow_nan=False, allow_infinity=False).map(repr)
    | st.integers(min_value=-(10**20), max_value=10**20).map(str)
    | st.sampled_from(["NaN", "+Inf", "-Inf", "Inf", "nan", "-0", "1e309", "1e3", ".5", "0.0"])
)
blanks = st.sampled_from([" ", "\t", "  ", " \t "])


@st.composite
def series(draw: st.DrawFn) -> Series:
    name = draw(st.sampled_from(list(DECLARED)) | st.sampled_from(LOOK_ALIKES))
    names = draw(st.lists(st.sampled_from(LABEL_NAMES), unique=True, max_size=4))
    labels = {n: draw(label_values) for n in names}
    timestamp = draw(st.none() | st.integers(min_value=0, max_value=2**41))
    return Series(name, labels, draw(sample_values), timestamp)


@st.composite
def sample_line(draw: st.DrawFn, s: Series) -> str:
    """One sample line, with blanks wherever the text format allows them."""
    lead = draw(st.sampled_from(["", "", "", " ", "\t "]))
    out = lead + s.name
    if s.labels or draw(st.booleans()):
        pairs = []
        for key, value in s.labels.items():
            around = draw(st.sampled_from(["", "", " "]))
            pairs.append(f'{key}{around}={around}"{escape(value)}"')
        comma = draw(st.sampled_from([",", ",", ", "]))
        trailing = draw(st.sampled_from(["", "", ","])) if pairs else ""
        out += draw(st.sampled_from(["", "", " "])) + "{" + comma.join(pairs) + trailing + "}"
    out += draw(blanks) + s.value
    if s.timestamp is not None:
        out += draw(blanks) + str(s.timestamp)
    return out + draw(st.sampled_from(["", "", " "]))


@st.composite
def expositions(draw: st.DrawFn) -> tuple[str, list[Series]]:
    exposition = Exposition(
        newline=draw(st.sampled_from(["\n", "\n", "\r\n"])), final_newline=draw(st.booleans())
    )
    written: list[Series] = []
    for s in draw(st.lists(series(), max_size=12)):
        if draw(st.booleans()):  # its family's comments
            help_text = draw(st.text(st.characters(codec="utf-8", exclude_characters="\n\r"), max_size=20))
            exposition.lines.append(f"# HELP {s.name} {help_text.replace(chr(92), chr(92) * 2)}")
            kind = "counter" if s.name.endswith("_total") else draw(st.sampled_from(["gauge", "untyped"]))
            exposition.lines.append(f"# TYPE {s.name} {kind}")
        if draw(st.integers(min_value=0, max_value=5)) == 0:  # a blank line or a free comment
            exposition.lines.append(draw(st.sampled_from(["", " ", "# vllm:num_requests_running 99", "#"])))
        for _ in range(draw(st.sampled_from([1, 1, 1, 2]))):  # sometimes a duplicate series
            exposition.lines.append(draw(sample_line(s)))
            written.append(s)
    return exposition.text(), written


# -- the oracle ------------------------------------------------------------------------------------


def _float(value: float) -> float:
    try:
        return float(value)
    except OverflowError:  # the reference parser keeps integer values as Python ints
        return math.inf if value > 0 else -math.inf


def _config_int(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if 0 <= value <= SANE_INT else None


def oracle(text: str) -> EngineMetrics:
    """The declared features, read from ``prometheus_client``'s parse of ``text``."""
    ranks: dict[str, dict[int, list[float]]] = {}
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in DECLARED:
                continue
            feature, rank, combine = DECLARED[sample.name]
            if combine == "capacity":
                if block_size is None:
                    block_size = _config_int(sample.labels.get("block_size"))
                blocks = _config_int(sample.labels.get("num_gpu_blocks"))
                if blocks is not None:
                    num_gpu_blocks = blocks if num_gpu_blocks is None else num_gpu_blocks + blocks
                continue
            value = _float(sample.value)
            if math.isfinite(value):
                ranks.setdefault(feature, {}).setdefault(rank, []).append(value)
    values: dict[str, float | None] = dict.fromkeys(SCRAPED)
    for feature, by_rank in ranks.items():
        samples = by_rank[min(by_rank)]
        total = 0.0
        for value in samples:  # in text order, as a scrape adds them
            total += value
        mean = next(combine for _, (f, _, combine) in DECLARED.items() if f == feature) == "mean"
        value = total / len(samples) if mean else total
        values[feature] = value if math.isfinite(value) else None  # finite samples may overflow a sum
    if block_size and num_gpu_blocks:
        for name in CAPACITY_METRICS:
            values[DECLARED[name][0]] = float(block_size * num_gpu_blocks)
    return EngineMetrics(block_size, num_gpu_blocks, **values)


def same(ours: EngineMetrics, reference: EngineMetrics) -> bool:
    if (ours.block_size, ours.num_gpu_blocks) != (reference.block_size, reference.num_gpu_blocks):
        return False
    for name in SCRAPED:
        a, b = ours.values[name], reference.values[name]
        if (a is None) != (b is None) or (
            a is not None and b is not None and not math.isclose(a, b, rel_tol=1e-12)
        ):
            return False
    return True


def check_sane(metrics: EngineMetrics) -> None:
    assert isinstance(metrics, EngineMetrics)
    for name in SCRAPED:
        value = metrics.values[name]
        assert value is None or (type(value) is float and math.isfinite(value)), (name, value)
    for value in (metrics.block_size, metrics.num_gpu_blocks):
        assert value is None or (type(value) is int and value >= 0)


@fuzz_settings(120)
@given(expositions())
def test_valid_expositions_read_as_the_reference_parser_reads_them(
    exposition: tuple[str, list[Series]],
) -> None:
    text, _ = exposition
    reference = oracle(text)  # raises if the generator wrote invalid text
    ours = parse_vllm_metrics(text)
    check_sane(ours)
    assert same(ours, reference), f"\n{text!r}\nours:      {ours}\nreference: {reference}"


@pytest.mark.parametrize(
    "text",
    [
        # The first series' block_size, also when the first series is the text's first line.
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="10"} 1\n'
        'vllm:cache_config_info{block_size="32",num_gpu_blocks="10"} 1\n',
        # Blanks before a sample and between its name and labels.
        ' vllm:num_requests_running 3\n\tvllm:num_requests_waiting {engine="0"} 4\n',
        # An absurd capacity: unknown, not an OverflowError that fails every engine's scrape.
        'vllm:cache_config_info{block_size="1' + "0" * 400 + '",num_gpu_blocks="7"} 1\n',
        'vllm:cache_config_info{block_size="-16",num_gpu_blocks="100"} 1\n',
        # Finite samples whose sum overflows: unknown, not +Inf in the pool's arrays.
        "vllm:num_requests_waiting 1e308\nvllm:num_requests_waiting 1e308\n",
    ],
)
def test_regressions_found_by_the_differential(text: str) -> None:
    ours = parse_vllm_metrics(text)
    check_sane(ours)
    assert same(ours, oracle(text)), ours


# -- any text ----------------------------------------------------------------------------------------

FRAGMENTS = [*DECLARED, *LOOK_ALIKES, "{", "}", '"', "\\", "=", ",", " ", "\t", "\n", "\r\n", "# HELP "]
FRAGMENTS += ["# TYPE ", 'block_size="', 'num_gpu_blocks="', "NaN", "+Inf", "1e309", "9" * 400, "-5", "0.5"]
FRAGMENTS += ["1e308", "\u2028", "\x00"]
fragments = st.sampled_from(FRAGMENTS)


@st.composite
def mutated_texts(draw: st.DrawFn) -> str:
    text, _ = draw(expositions())
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        at = draw(st.integers(min_value=0, max_value=len(text)))
        end = draw(st.integers(min_value=at, max_value=min(len(text), at + 8)))
        text = text[:at] + draw(fragments | st.text(max_size=3)) + text[end:]
    return text


any_text = mutated_texts() | st.lists(fragments, max_size=40).map("".join) | st.text(max_size=200)


@fuzz_settings(100)
@given(any_text)
def test_any_text_is_parsed_without_raising(text: str) -> None:
    check_sane(parse_vllm_metrics(text))


# -- through the scraper ------------------------------------------------------------------------------


class _Content:
    def __init__(self, body: bytes) -> None:
        self.body = body

    async def iter_chunked(self, size: int) -> AsyncIterator[bytes]:
        for start in range(0, len(self.body), size):
            yield self.body[start : start + size]


class _Response:
    def __init__(self, body: bytes, declared: bool) -> None:
        self.status, self.reason = 200, "OK"
        self.content_length = len(body) if declared else None
        self.content = _Content(body)

    async def __aenter__(self) -> _Response:
        return self

    async def __aexit__(self, *_: object) -> None:
        return None


class FakeSession:
    """What ``Scraper`` uses of ``aiohttp.ClientSession``: ``get(url)`` answering one body."""

    def __init__(self, body: bytes, declared: bool) -> None:
        self.response = _Response(body, declared)

    def get(self, url: str) -> _Response:
        return self.response


bodies = (
    expositions().map(lambda e: e[0].encode())
    | any_text.map(lambda t: t.encode("utf-8", "surrogatepass"))  # lone surrogates: not UTF-8
    | st.binary(max_size=200)
    | expositions().map(lambda e: e[0].encode() + b"\xff\xfe")
)


async def scrape(body: bytes, declared: bool, max_bytes: int) -> Any:
    scraper = Scraper(FakeSession(body, declared), timeout_s=5, max_bytes=max_bytes)  # type: ignore[arg-type]
    try:
        return await scraper.scrape("10.0.0.1:8000")
    except ScrapeError as error:
        return error


@fuzz_settings(80)
@given(bodies, st.booleans(), st.sampled_from([64, 1 << 20]))
def test_every_body_is_metrics_or_a_documented_scrape_error(
    body: bytes, declared: bool, max_bytes: int
) -> None:
    result = asyncio.run(scrape(body, declared, max_bytes))
    if len(body) > max_bytes:
        assert isinstance(result, ScrapeError) and result.reason == ScrapeReason.TOO_LARGE
        return
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        assert isinstance(result, ScrapeError) and result.reason == ScrapeReason.PARSE_ERROR
        assert "not UTF-8" in result.detail
        return
    expected = parse_vllm_metrics(text)
    if expected.is_empty():
        assert isinstance(result, ScrapeError) and result.reason == ScrapeReason.PARSE_ERROR
        assert "no vllm: metrics" in result.detail
    else:
        assert isinstance(result, EngineMetrics) and result == expected
