"""vLLM /metrics parsing and the concurrent scraper (against real aiohttp servers on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from router.observe.scrape import ScrapeError, Scraper, ScrapeReason, parse_vllm_metrics
from router.request.types import EngineMetrics

FIXTURE = Path(__file__).parents[2] / "data" / "vllm_metrics.txt"
NOTHING = EngineMetrics()


# ---------------------------------------------------------------- parser


def test_parses_the_vllm_fixture_exactly() -> None:
    # Two engines (DP ranks) behind one address: counts and counters summed, usage averaged.
    assert parse_vllm_metrics(FIXTURE.read_text()) == EngineMetrics(
        running=5.0,
        waiting=1.0,
        kv_usage=0.3125,
        block_size=16,
        num_gpu_blocks=2 * 27840,
        kv_capacity_tokens=16.0 * 2 * 27840,
        prefix_queries=188888.0,
        prefix_hits=95433.0,
    )


def test_absent_metrics_are_none_not_zero() -> None:
    assert parse_vllm_metrics("") == NOTHING
    assert NOTHING.is_empty()
    only_running = parse_vllm_metrics('vllm:num_requests_running{engine="0"} 0.0\n')
    assert only_running.running == 0.0
    assert only_running.waiting is None
    assert only_running.kv_usage is None
    assert only_running.block_size is None
    assert not only_running.is_empty()


def test_several_engine_series_are_summed_and_usage_is_averaged() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="m"} 1',
            'vllm:num_requests_running{engine="1",model_name="m"} 2',
            'vllm:num_requests_running{engine="2",model_name="m"} 4',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25',
            'vllm:kv_cache_usage_perc{engine="2",model_name="m"} 0.0',
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10',
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 5',
            'vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="100"} 1',
            'vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="100"} 1',
        ]
    )
    m = parse_vllm_metrics(text)
    assert (m.running, m.kv_usage, m.prefix_hits) == (7.0, 0.25, 15.0)
    assert (m.block_size, m.num_gpu_blocks) == (32, 200)


def test_deprecated_names_are_read_when_the_current_ones_are_absent() -> None:
    text = (
        "vllm:gpu_cache_usage_perc 0.5\n"
        "vllm:gpu_prefix_cache_queries_total 100\n"
        "vllm:gpu_prefix_cache_hits_total 40\n"
    )
    m = parse_vllm_metrics(text)
    assert (m.kv_usage, m.prefix_queries, m.prefix_hits) == (0.5, 100.0, 40.0)


def test_current_names_win_over_deprecated_ones() -> None:
    text = (
        "vllm:gpu_cache_usage_perc 0.9\n"
        "vllm:kv_cache_usage_perc 0.5\n"
        "vllm:gpu_prefix_cache_hits_total 1\n"
        "vllm:prefix_cache_hits 7\n"
        "vllm:prefix_cache_queries 8\n"
        "vllm:prefix_cache_queries_total 9\n"
    )
    m = parse_vllm_metrics(text)
    assert (m.kv_usage, m.prefix_hits, m.prefix_queries) == (0.5, 7.0, 9.0)


def test_similar_names_are_not_mistaken_for_wanted_ones() -> None:
    text = (
        'vllm:prefix_cache_queries_created{engine="0"} 1.7e9\n'
        "vllm:num_requests_running_total 99\n"
        "xvllm:num_requests_waiting 99\n"
        "# HELP vllm:num_requests_waiting 99\n"
        'vllm:num_requests_waiting{engine="0"} 3\n'
    )
    m = parse_vllm_metrics(text)
    assert (m.prefix_queries, m.running, m.waiting) == (None, None, 3.0)


def test_labels_with_escapes_braces_and_commas() -> None:
    text = (
        'vllm:num_requests_running{model_name="a \\"quoted\\" name, with } brace",engine="0"} 2\n'
        'vllm:cache_config_info{cache_dtype="x\\\\y",note="a,b=\\"c\\"",block_size="16",'
        'num_gpu_blocks="1024"} 1.0\n'
    )
    m = parse_vllm_metrics(text)
    assert (m.running, m.block_size, m.num_gpu_blocks) == (2.0, 16, 1024)


def test_timestamps_crlf_and_the_first_line() -> None:
    text = "vllm:num_requests_running 2 1700000000000\r\nvllm:num_requests_waiting\t5\r\n"
    m = parse_vllm_metrics(text)
    assert (m.running, m.waiting) == (2.0, 5.0)


def test_non_finite_and_malformed_samples_count_as_absent() -> None:
    text = (
        'vllm:num_requests_running{engine="0"} NaN\n'
        'vllm:num_requests_running{engine="1"} 3\n'
        "vllm:num_requests_waiting +Inf\n"
        "vllm:kv_cache_usage_perc banana\n"
        "vllm:prefix_cache_hits_total{unterminated 4\n"
        'vllm:cache_config_info{block_size="None",num_gpu_blocks="lots"} 1\n'
    )
    m = parse_vllm_metrics(text)
    assert m == EngineMetrics(running=3.0)


fragments = st.sampled_from(
    [
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:prefix_cache_hits_total",
        "{",
        "}",
        '"',
        "\\",
        "=",
        ",",
        'block_size="',
        'num_gpu_blocks="',
        " ",
        "\t",
        "\n",
        "\r",
        "# HELP ",
        "NaN",
        "+Inf",
        "-1e309",
        "1",
        "0.5",
        "99999999999999999999",
    ]
)


@settings(max_examples=300)
@given(st.one_of(st.text(), st.lists(fragments, max_size=40).map("".join)))
def test_arbitrary_text_never_raises(text: str) -> None:
    m = parse_vllm_metrics(text)
    assert isinstance(m, EngineMetrics)
    for value in (m.running, m.waiting, m.kv_usage, m.prefix_queries, m.prefix_hits):
        assert value is None or value == value  # never NaN


# ---------------------------------------------------------------- scraper

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Serve = Callable[[Handler], Awaitable[str]]
METRICS_BODY = FIXTURE.read_text()


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Start tiny servers on 127.0.0.1 (port 0) answering /metrics; yields a starter -> address."""
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"{host}:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
def release() -> asyncio.Event:
    """Set at teardown (before the servers stop) so handlers parked on it finish cleanly."""
    return asyncio.Event()


@pytest.fixture
async def hang(release: asyncio.Event) -> AsyncIterator[Handler]:
    async def handler(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text=METRICS_BODY)

    yield handler
    release.set()


async def ok(request: web.Request) -> web.Response:
    return web.Response(text=METRICS_BODY, content_type="text/plain")


async def test_scrape_parses_a_live_endpoint(serve: Serve, session: aiohttp.ClientSession) -> None:
    address = await serve(ok)
    metrics = await Scraper(session, timeout_s=5).scrape(address)
    assert metrics == parse_vllm_metrics(METRICS_BODY)


async def test_http_error_status_is_reported(serve: Serve, session: aiohttp.ClientSession) -> None:
    async def fail(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    address = await serve(fail)
    with pytest.raises(ScrapeError) as info:
        await Scraper(session, timeout_s=5).scrape(address)
    assert info.value.address == address
    assert info.value.reason == ScrapeReason.HTTP_STATUS
    assert "500" in info.value.detail


async def test_slow_endpoint_times_out_with_the_reason(
    serve: Serve, session: aiohttp.ClientSession, hang: Handler
) -> None:
    address = await serve(hang)
    with pytest.raises(ScrapeError) as info:
        await Scraper(session, timeout_s=0.05).scrape(address)
    assert info.value.reason == ScrapeReason.TIMEOUT
    assert "timeout" in str(info.value)


async def test_connection_refused_is_reported(session: aiohttp.ClientSession) -> None:
    # A bound but not listening socket: nobody else can take the port while we hold it.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        with pytest.raises(ScrapeError) as info:
            await Scraper(session, timeout_s=5).scrape(address)
    assert info.value.reason == ScrapeReason.CONNECTION_REFUSED


async def test_a_page_without_vllm_metrics_is_a_parse_error(
    serve: Serve, session: aiohttp.ClientSession
) -> None:
    async def other(request: web.Request) -> web.Response:
        return web.Response(text="<html>not prometheus</html>")

    async def binary(request: web.Request) -> web.Response:
        return web.Response(body=b"\xff\xfe\x00vllm:num_requests_running 1\n")

    scraper = Scraper(session, timeout_s=5)
    for handler in (other, binary):
        with pytest.raises(ScrapeError) as info:
            await scraper.scrape(await serve(handler))
        assert info.value.reason == ScrapeReason.PARSE_ERROR


async def test_an_oversized_body_is_refused(serve: Serve, session: aiohttp.ClientSession) -> None:
    address = await serve(ok)
    with pytest.raises(ScrapeError) as info:
        await Scraper(session, timeout_s=5, max_bytes=1000).scrape(address)
    assert info.value.reason == ScrapeReason.TOO_LARGE


async def test_scrape_all_keeps_order_and_returns_errors_as_values(
    serve: Serve, session: aiohttp.ClientSession, hang: Handler
) -> None:
    async def fail(request: web.Request) -> web.Response:
        return web.Response(status=503)

    good, bad, slow = await serve(ok), await serve(fail), await serve(hang)
    results = await Scraper(session, timeout_s=0.2).scrape_all([good, bad, slow, good])
    assert isinstance(results[0], EngineMetrics)
    assert isinstance(results[1], ScrapeError)
    assert results[1].reason == ScrapeReason.HTTP_STATUS
    assert isinstance(results[2], ScrapeError)
    assert results[2].reason == ScrapeReason.TIMEOUT
    assert results[3] == results[0]
    assert await Scraper(session, timeout_s=1).scrape_all([]) == []


async def test_scrape_all_runs_endpoints_concurrently(serve: Serve, session: aiohttp.ClientSession) -> None:
    # The first endpoint answers only after the second one has been asked: scraping one after
    # the other would time the first out, concurrent scraping lets both succeed.
    second_served = asyncio.Event()

    async def waits_for_second(request: web.Request) -> web.Response:
        await second_served.wait()
        return web.Response(text=METRICS_BODY)

    async def second(request: web.Request) -> web.Response:
        second_served.set()
        return web.Response(text=METRICS_BODY)

    first_address, second_address = await serve(waits_for_second), await serve(second)
    results = await Scraper(session, timeout_s=5).scrape_all([first_address, second_address])
    assert all(isinstance(r, EngineMetrics) for r in results)


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        Scraper(None, timeout_s=0)  # type: ignore[arg-type]
