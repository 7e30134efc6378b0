"""``vllm:lora_requests_info`` and ``/v1/models`` as vLLM writes them, read for LoRA affinity."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web

from router.observe.scrape import Scraper, parse_vllm_metrics
from router.request.types import LoraInfo

FIXTURE = (Path(__file__).parents[2] / "data" / "vllm_metrics.txt").read_text()

# vLLM's PrometheusStatLogger: labels in its labelnames order, the value set_to_current_time(), and
# every label set the gauge ever had still exported (prometheus_client keeps its children).


def series(waiting: str, running: str, at: str, max_lora: str = "4") -> str:
    labels = f'max_lora="{max_lora}",waiting_lora_adapters="{waiting}",running_lora_adapters="{running}"'
    return f"vllm:lora_requests_info{{{labels}}} {at}\n"


LORA = (
    "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
    "# TYPE vllm:lora_requests_info gauge\n"
    + series("", "", "1.7646576000123e+09")
    + series("tool-lora", "sql-lora,chat-lora", "1.7646576093456e+09")
    + series("", "sql-lora", "1.7646576051e+09")
)


def test_the_newest_label_set_is_the_engines_lora_state() -> None:
    metrics = parse_vllm_metrics(FIXTURE + LORA)
    assert metrics.lora == LoraInfo(4, running=("sql-lora", "chat-lora"), waiting=("tool-lora",))
    assert metrics.running == 5.0  # the other features as before


def test_an_engine_without_lora_says_nothing_about_adapters() -> None:
    assert parse_vllm_metrics(FIXTURE).lora is None


def test_an_idle_engine_has_its_slots_and_no_adapters() -> None:
    assert parse_vllm_metrics(FIXTURE + series("", "", "1.7e+09")).lora == LoraInfo(4)


def test_a_max_lora_that_is_no_number_is_unknown() -> None:
    odd = series("", "a", "1.0", max_lora="None")
    assert parse_vllm_metrics(FIXTURE + odd).lora == LoraInfo(None, running=("a",))


# vLLM's /v1/models with two adapters from --lora-modules: each has the base model as its parent.
MODELS = {
    "object": "list",
    "data": [
        {
            "id": "meta-llama/Llama-3.1-8B",
            "object": "model",
            "root": "meta-llama/Llama-3.1-8B",
            "parent": None,
        },
        {"id": "sql-lora", "object": "model", "root": "/adapters/sql", "parent": "meta-llama/Llama-3.1-8B"},
        {"id": "chat-lora", "object": "model", "root": "/adapters/chat", "parent": "meta-llama/Llama-3.1-8B"},
    ],
}


@pytest.fixture
async def engine() -> AsyncIterator[str]:
    async def models(request: web.Request) -> web.Response:
        return web.json_response(body=orjson.dumps(MODELS))

    async def broken(request: web.Request) -> web.Response:
        return web.json_response({"data": "nope"})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/broken/v1/models", broken)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"{host}:{port}"
    await runner.cleanup()


async def test_served_adapters_are_the_models_with_a_parent(engine: str) -> None:
    async with aiohttp.ClientSession() as session:
        assert await Scraper(session, 2.0).served_adapters(engine) == ("sql-lora", "chat-lora")


async def test_an_unreadable_model_list_is_unknown_not_empty(engine: str) -> None:
    async with aiohttp.ClientSession() as session:
        scraper = Scraper(session, 2.0)
        assert await scraper.served_adapters(f"{engine}/broken") is None
        assert await scraper.served_adapters("127.0.0.1:1") is None
