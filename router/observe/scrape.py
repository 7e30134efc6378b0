"""Engine ``/metrics``: a cheap parser for the few vLLM series the router reads, and the scraper.

``parse_vllm_metrics`` only ever looks at lines that start with one of the wanted metric names:
one compiled regex finds them (its ``\\n`` literal prefix lets ``re`` skip between candidate
lines in C), so HELP/TYPE comments, histogram buckets and every other family cost no Python work
at all. Measured on a 320-line two-engine exposition: ~33 µs per parse, where ``split`` plus a
per-line ``startswith`` alone took ~40 µs, and ``prometheus_client``'s parser ~3.6 ms
(``loadtests/bench/scrape.py``).

Which metrics are read, under which names, and how several series combine is declared once with
the features (``router/state/features.py``). Unknown is never zero: a metric that is absent, or whose
every sample is malformed or not finite, is ``None``. Several series of one metric (one per
``engine`` label when vLLM runs data-parallel ranks behind one address) are combined: counts and
counters are summed, ``kv_usage`` is the mean, ``num_gpu_blocks`` is the sum (the total KV capacity
behind the address, matching summed ``running``) and ``block_size`` is the first series'. Of
``vllm:lora_requests_info`` only the newest series counts (its value is when it was set). The
current names are preferred; the names vLLM deprecated are read only when the current ones are
absent.

``Scraper`` GETs ``http://{address}/metrics`` with a per-endpoint timeout and turns every failure
into a ``ScrapeError`` whose ``reason`` is one of ``ScrapeReason``; ``scrape_all`` runs them
concurrently, so a slow endpoint costs the others nothing. It does not touch the pool.
"""

from __future__ import annotations

import asyncio
import errno
import math
import re
from collections.abc import Sequence
from enum import StrEnum

import aiohttp

from router.http.models import served_models
from router.request.types import EngineMetrics, LoraInfo
from router.state.features import FEATURES

# metric name -> (feature, rank, mean); a lower rank wins when several names of one feature are
# present. Built from the declarations in router/state/features.py.
_SAMPLE_NAMES: dict[str, tuple[str, int, bool]] = {
    metric: (f.name, rank, f.scraped.combine == "mean")
    for f in FEATURES
    if f.scraped is not None and f.scraped.combine != "capacity"
    for rank, metric in enumerate(f.scraped.metrics)
}
_CAPACITY: tuple[tuple[str, str], ...] = tuple(
    (metric, f.name)
    for f in FEATURES
    if f.scraped is not None and f.scraped.combine == "capacity"
    for metric in f.scraped.metrics
)
_SCRAPED = tuple(f.name for f in FEATURES if f.scraped is not None)
# Not a feature column: LoRA state is a set of adapter names per engine (router/state/lora.py).
# Its value is when vLLM last set it, and every label set it ever had stays exported: the series
# with the largest value is the current one.
LORA_INFO = "vllm:lora_requests_info"
_NAMES = "|".join(
    re.escape(name.removeprefix("vllm:")) for name in (*_SAMPLE_NAMES, *dict(_CAPACITY), LORA_INFO)
)
# A wanted sample line: exact name (the separator after it rules out "…_total" matching "…"
# and skips "…_created"), then the labels/value tail. The "\n" literal lets the regex engine
# jump between candidate lines in C instead of Python visiting every line. Blanks and tabs may
# lead a line (the text format ignores leading whitespace).
_SAMPLE_LINE = r"[ \t]*(vllm:(?:" + _NAMES + r"))([{ \t][^\n]*)"
_LINE = re.compile(r"\n" + _SAMPLE_LINE)
_FIRST_LINE = re.compile(_SAMPLE_LINE)
# Past this a block count or size is not a real engine's (and its product must stay a float).
_MAX_CONFIG_INT = 1 << 40


def parse_vllm_metrics(text: str) -> EngineMetrics:
    """Read every scraped feature from a Prometheus text exposition; never raises."""
    # feature -> rank -> [sum, count]
    acc: dict[str, dict[int, list[float]]] = {}
    capacity = dict(_CAPACITY)
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    lora: tuple[float, str] | None = None  # (set at, labels) of the newest lora_requests_info
    lines: list[tuple[str, str]] = _LINE.findall(text)
    first = _FIRST_LINE.match(text)
    if first is not None:  # in text order: the first series' block_size is the one kept
        lines.insert(0, (first[1], first[2]))
    for name, tail in lines:
        if tail[0] != "{" and tail.lstrip(" \t")[:1] == "{":
            tail = tail.lstrip(" \t")  # blanks between the name and its labels
        if tail[0] == "{":
            # Values and timestamps never contain "}", so the last one closes the label set even
            # when a quoted label value holds "}" itself.
            close = tail.rfind("}")
            if close < 0:
                continue
            labels, rest = tail[1:close], tail[close + 1 :]
        else:
            labels, rest = "", tail
        if name in capacity:
            parsed = _parse_labels(labels)
            if block_size is None:
                block_size = _int_or_none(parsed.get("block_size"))
            blocks = _int_or_none(parsed.get("num_gpu_blocks"))
            if blocks is not None:
                num_gpu_blocks = blocks if num_gpu_blocks is None else num_gpu_blocks + blocks
            continue
        value = _sample_value(rest)
        if value is None:
            continue
        if name == LORA_INFO:
            if lora is None or value >= lora[0]:
                lora = (value, labels)
            continue
        feature, rank, _ = _SAMPLE_NAMES[name]
        total = acc.setdefault(feature, {}).setdefault(rank, [0.0, 0])
        total[0] += value
        total[1] += 1

    values: dict[str, float | None] = dict.fromkeys(_SCRAPED)
    for feature, ranks in acc.items():
        best = ranks[min(ranks)]
        value = best[0] / best[1] if _MEAN[feature] else best[0]
        values[feature] = value if math.isfinite(value) else None  # finite samples may overflow a sum
    if block_size and num_gpu_blocks:
        for feature in capacity.values():
            values[feature] = float(block_size * num_gpu_blocks)
    return EngineMetrics(
        block_size, num_gpu_blocks, lora=None if lora is None else _lora_info(lora[1]), **values
    )


def _lora_info(labels: str) -> LoraInfo:
    """vLLM's labels: ``max_lora`` and the comma-joined ``running_lora_adapters`` and
    ``waiting_lora_adapters`` (adapter names, as requests name them)."""
    parsed = _parse_labels(labels)
    return LoraInfo(
        max_lora=_int_or_none(parsed.get("max_lora")),
        running=_names(parsed.get("running_lora_adapters", "")),
        waiting=_names(parsed.get("waiting_lora_adapters", "")),
    )


def _names(joined: str) -> tuple[str, ...]:
    return tuple(name for name in (part.strip() for part in joined.split(",")) if name)


_MEAN = {feature: mean for feature, _, mean in _SAMPLE_NAMES.values()}


def _sample_value(rest: str) -> float | None:
    """The value token after the name/labels (an optional timestamp follows); finite or None.

    NaN and ±Inf are dropped with malformed values: one such sample must not poison a sum that
    the pool turns into feature arrays.
    """
    parts = rest.split(None, 2)
    if not parts:
        return None
    try:
        value = float(parts[0])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _int_or_none(raw: str | None) -> int | None:
    """A non-negative integer label value of a sane size, else None (vLLM prints unset config
    fields as "None")."""
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if 0 <= value <= _MAX_CONFIG_INT else None


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


def _parse_labels(body: str) -> dict[str, str]:
    """``a="x",b="y \\"q\\""`` -> dict (escapes undone); malformed pairs are skipped."""
    labels: dict[str, str] = {}
    for name, raw in _LABEL.findall(body):
        if "\\" in raw:
            raw = _ESCAPE.sub(lambda m: "\n" if m[1] == "n" else m[1], raw)
        labels[name] = raw
    return labels


class ScrapeReason(StrEnum):
    """Why a scrape failed; stable strings, usable as a metric label."""

    TIMEOUT = "timeout"
    CONNECTION_REFUSED = "connection refused"
    CONNECTION_ERROR = "connection error"
    HTTP_STATUS = "http status"
    TOO_LARGE = "response too large"
    PARSE_ERROR = "parse error"


# Failures where the endpoint did answer over HTTP, only without usable engine metrics.
ANSWERED = frozenset({ScrapeReason.HTTP_STATUS, ScrapeReason.TOO_LARGE, ScrapeReason.PARSE_ERROR})


class ScrapeError(Exception):
    """A failed scrape of ``address``; ``reason`` says which kind, ``detail`` the specifics."""

    def __init__(self, address: str, reason: str, detail: str = "") -> None:
        self.address = address
        self.reason = reason
        self.detail = detail
        super().__init__(f"{address}: {reason}" + (f" ({detail})" if detail else ""))


class Scraper:
    """Fetches and parses engine ``/metrics`` over a shared ``aiohttp`` session.

    ``timeout_s`` bounds each endpoint's whole exchange (connect, headers, body). Bodies above
    ``max_bytes`` are refused so a misconfigured target cannot make the router buffer megabytes
    every tick (a 2-engine vLLM exposition is ~40 KB).
    """

    def __init__(
        self, session: aiohttp.ClientSession, timeout_s: float, *, max_bytes: int = 4 * 1024 * 1024
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self._session = session
        self._timeout_s = timeout_s
        self._max_bytes = max_bytes

    async def scrape(self, address: str) -> EngineMetrics:
        """GET ``http://{address}/metrics`` and parse it; raises ``ScrapeError`` on any failure."""
        try:
            async with asyncio.timeout(self._timeout_s):
                body = await self._fetch(address)
        except TimeoutError:
            raise ScrapeError(
                address, ScrapeReason.TIMEOUT, f"no answer within {self._timeout_s:g}s"
            ) from None
        except aiohttp.ClientConnectorError as exc:
            if exc.os_error is not None and exc.os_error.errno == errno.ECONNREFUSED:
                raise ScrapeError(address, ScrapeReason.CONNECTION_REFUSED) from None
            raise ScrapeError(address, ScrapeReason.CONNECTION_ERROR, str(exc.os_error or exc)) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise ScrapeError(
                address, ScrapeReason.CONNECTION_ERROR, f"{type(exc).__name__}: {exc}"
            ) from None
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ScrapeError(address, ScrapeReason.PARSE_ERROR, f"not UTF-8: {exc.reason}") from None
        metrics = parse_vllm_metrics(text)
        if metrics.is_empty():
            # A 200 without any vLLM series is a wrong target (another server on that port), not
            # an idle engine: say so instead of reporting "unknown" forever.
            raise ScrapeError(address, ScrapeReason.PARSE_ERROR, "no vllm: metrics in response")
        return metrics

    async def served_adapters(self, address: str) -> tuple[str, ...] | None:
        """The LoRA adapters ``GET http://{address}/v1/models`` lists (vLLM gives each its base
        model as ``parent``); None when the list could not be read."""
        try:
            async with asyncio.timeout(self._timeout_s):
                body = await self._fetch(address, "/v1/models")
            return tuple(model for model, parent in served_models(body) if parent)
        except (ScrapeError, TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None

    async def scrape_all(self, addresses: Sequence[str]) -> list[EngineMetrics | ScrapeError]:
        """Scrape every address concurrently; results (or errors) in the order of ``addresses``."""
        return list(await asyncio.gather(*(self._scrape_or_error(a) for a in addresses)))

    async def _scrape_or_error(self, address: str) -> EngineMetrics | ScrapeError:
        try:
            return await self.scrape(address)
        except ScrapeError as exc:
            return exc

    async def _fetch(self, address: str, path: str = "/metrics") -> bytes:
        async with self._session.get(f"http://{address}{path}") as resp:
            if resp.status != 200:
                raise ScrapeError(
                    address, ScrapeReason.HTTP_STATUS, f"HTTP {resp.status} {resp.reason or ''}".strip()
                )
            if resp.content_length is not None and resp.content_length > self._max_bytes:
                raise ScrapeError(address, ScrapeReason.TOO_LARGE, f"{resp.content_length} bytes")
            chunks: list[bytes] = []
            size = 0
            async for chunk in resp.content.iter_chunked(64 * 1024):
                size += len(chunk)
                if size > self._max_bytes:
                    raise ScrapeError(address, ScrapeReason.TOO_LARGE, f"over {self._max_bytes} bytes")
                chunks.append(chunk)
            return b"".join(chunks)
