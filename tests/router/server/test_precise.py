"""Precise mode end to end: engines publish KV events, the router routes from what they report."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from helpers import eventually, router_for

from kvindex.chat_template import ChatTemplate
from router.request.parse import parse_request
from router.request.types import RequestLimits
from router.server.compose import Parts, build
from router.server.config import parse_config
from simulator.engine import EngineSpec, SimCluster, TimeModel
from simulator.tiny_tokenizer import tiny_corpus, train_tiny_tokenizer

pytestmark = pytest.mark.integration

SENTENCES = list(tiny_corpus(400))
PROMPT = " ".join(SENTENCES[:30])  # a few hundred tokens the tiny tokenizer knows


async def _precise_gateway(tmp_path: Path, names: list[str], **spec_fields: object):
    tokenizer = str(train_tiny_tokenizer(tmp_path / "tokenizer.json"))
    specs = [
        EngineSpec(
            name,
            "prefill-decode",
            tokenizer=tokenizer,
            kv_events=True,
            time=TimeModel(speed=20),
            **spec_fields,
        )
        for name in names
    ]
    return tokenizer, specs


def _sections(cluster: SimCluster, tokenizer: str) -> dict:
    endpoints = [
        {
            "address": cluster.address(name),
            "name": name,
            "kv_events": {"endpoint": e.kv_events_endpoint, "replay_endpoint": e.kv_replay_endpoint},
        }
        for name, e in cluster.engines.items()
    ]
    precise = {"tokenizer": tokenizer, "replay_timeout_s": 1.0}
    return {"endpoints": endpoints, "index": {"precise": precise}, "limits": {"chars_per_token": 4.0}}


async def _until_covered(app, cluster: SimCluster) -> None:
    # Engines only publish when something happens, and a subscriber that just connected misses
    # what was published before (ZMQ's slow joiner): publish harmless resets until all are seen.
    slots = [e.slot for e in app.parts.pool.endpoints.values()]

    def covered() -> bool:
        if not app.parts.pool.kv_covered[slots].all():
            for engine in cluster.engines.values():
                engine.reset_prefix_cache()
            return False
        return True

    await eventually(covered, 10, "coverage of every engine")


async def test_routes_from_reported_blocks_and_forgets_an_engine_that_restarted(tmp_path: Path) -> None:
    tokenizer, specs = await _precise_gateway(tmp_path, ["e0", "e1", "e2"])
    async with SimCluster(specs) as cluster, router_for(_sections(cluster, tokenizer)) as (app, base):
        await _until_covered(app, cluster)
        async with aiohttp.ClientSession() as http:

            async def ask() -> tuple[str, str]:
                body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4}
                async with http.post(f"{base}/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    return resp.headers["x-pd-router-decode"], resp.headers["x-pd-router-reason"]

            first, _ = await ask()
            keys = app.parts.precise_keys.tokenizer.block_keys_sync(PROMPT)
            slot = app.parts.pool.endpoints[first].slot
            # The engine's BlockStored events reach the precise index (not just our optimistic record).
            await eventually(
                lambda: app.parts.kv_events.stats()[first].events > 0, 10, "events from the engine"
            )
            assert app.parts.precise_index.match(keys, np.array([slot]))[0] == len(keys)
            again, reason = await ask()
            assert again == first and f"{(len(keys)) * 16}/" in reason

            # A restart loses the engine's cache; the event stream says so and the router believes it.
            await cluster.revive(first)

            def restart_seen() -> bool:
                if app.parts.kv_events.stats()[first].restarts >= 1:
                    return True
                cluster.engines[first].reset_prefix_cache()  # batches until the SUB reconnected
                return False

            await eventually(restart_seen, 10, "restart detected")
            assert app.parts.precise_index.match(keys, np.array([slot]))[0] == 0
            # The approximate index still remembers our earlier picks: precise mode overrides it.
            text_keys = app.parts.index.match(_text_keys(app, PROMPT), np.array([slot]))
            assert text_keys[0] > 0
            _, reason = await ask()
            assert reason.split(":")[1].strip().startswith("0/")


async def test_a_prompt_of_token_ids_finds_the_blocks_a_text_prompt_left(tmp_path: Path) -> None:
    """vLLM takes a prompt of token ids as it is: the blocks the same tokens left as text are hits."""
    tokenizer, specs = await _precise_gateway(tmp_path, ["e0", "e1", "e2"])
    async with SimCluster(specs) as cluster, router_for(_sections(cluster, tokenizer)) as (app, base):
        await _until_covered(app, cluster)
        async with aiohttp.ClientSession() as http:

            async def ask(prompt: str | list[int]) -> tuple[str, str]:
                body = {"model": "sim-model", "prompt": prompt, "max_tokens": 4}
                async with http.post(f"{base}/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    return resp.headers["x-pd-router-decode"], resp.headers["x-pd-router-reason"]

            first, _ = await ask(PROMPT)
            keys = app.parts.precise_keys.tokenizer.block_keys_sync(PROMPT)
            slot = np.array([app.parts.pool.endpoints[first].slot])
            await eventually(
                lambda: app.parts.precise_index.match(keys, slot)[0] == len(keys), 10, "the engine's events"
            )
            # The text's tokens (as the engine tokenized them, BOS included) but the last block, then
            # an ending of its own.
            ids = app.parts.precise_keys.tokenizer.token_ids(PROMPT)
            shared = 16 * (len(keys) - 1)
            prompt = [*ids[:shared], *reversed(ids[shared:]), *ids[:40]]
            decode, reason = await ask(prompt)
            assert f": {shared}/{len(prompt)} prompt tokens cached" in reason, reason
            assert decode == first
            assert cluster.engines[first].stats.cached_tokens_hit >= shared  # and the engine agrees


async def test_evicted_blocks_leave_the_index(tmp_path: Path) -> None:
    tokenizer, specs = await _precise_gateway(tmp_path, ["e0"], num_gpu_blocks=40)
    async with SimCluster(specs) as cluster, router_for(_sections(cluster, tokenizer)) as (app, base):
        await _until_covered(app, cluster)
        keys = app.parts.precise_keys.tokenizer.block_keys_sync(PROMPT)
        async with aiohttp.ClientSession() as http:
            body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 200
            await eventually(lambda: app.parts.precise_index.match(keys, np.array([0]))[0] > 0, 10, "stored")
            other = " ".join(SENTENCES[200:230])  # a different prompt that evicts the first
            async with http.post(f"{base}/v1/completions", json={**body, "prompt": other}) as resp:
                assert resp.status == 200
        engine_cache = cluster.engines["e0"]._cache
        await eventually(
            lambda: (
                app.parts.precise_index.match(keys, np.array([0]))[0]
                == sum(1 for _ in _prefix_in(keys, engine_cache))
            ),
            10,
            "index agrees with the engine after evictions",
        )
        assert app.parts.precise_index.match(keys, np.array([0]))[0] < len(keys)


def _prefix_in(keys: np.ndarray, cache: dict) -> list[int]:
    out = []
    for key in keys.tolist():
        if key not in cache:
            break
        out.append(key)
    return out


def _text_keys(app, prompt: str) -> np.ndarray:
    from router.request.parse import parse_request

    return parse_request(
        f'{{"model": "sim-model", "prompt": "{prompt}"}}'.encode(), app.config.request_limits()
    ).block_keys


async def test_kv_event_and_coverage_metrics_are_exported(tmp_path: Path) -> None:
    tokenizer, specs = await _precise_gateway(tmp_path, ["e0"])
    async with SimCluster(specs) as cluster, router_for(_sections(cluster, tokenizer)) as (app, base):
        await _until_covered(app, cluster)
        async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics") as resp:
            text = await resp.text()
        assert 'pd_router_endpoint_kv_covered{endpoint="e0"} 1.0' in text
        assert 'pd_router_kv_events_batches_total{endpoint="e0"}' in text


CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


async def test_the_router_hashes_chat_requests_through_the_template_and_only_then(tmp_path: Path) -> None:
    tokenizer = str(train_tiny_tokenizer(tmp_path / "tokenizer.json"))
    endpoints = [{"address": "127.0.0.1:9"}]
    chat = {"model": "m", "messages": CHAT * 8}
    limits = RequestLimits(1 << 20, 1 << 20, 16, 16, 4.0)
    route = parse_request(json.dumps(chat).encode(), limits)

    without = build(
        parse_config({"model": "m", "endpoints": endpoints, "index": {"precise": {"tokenizer": tokenizer}}})
    )
    await without.flow.prepare(route)
    assert route.precise_keys is None  # no template: no guessing

    template_path = tmp_path / "tokenizer_config.json"
    template_path.write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "bos_token": "<s>"}))
    precise = {"tokenizer": tokenizer, "chat_template": str(template_path)}
    parts = build(parse_config({"model": "m", "endpoints": endpoints, "index": {"precise": precise}}))
    await parts.flow.prepare(route)
    rendered = ChatTemplate(template_path).render(CHAT * 8)
    assert route.precise_keys is not None and len(route.precise_keys) > 2
    assert np.array_equal(route.precise_keys, parts.precise_keys.chat_tokenizer.block_keys_sync(rendered))
    # The engine's tokenizer counted the rendered prompt: that count, not a character estimate.
    assert route.prompt_tokens == len(parts.precise_keys.chat_tokenizer.token_ids(rendered))
    assert route.exact_tokens


LIMITS = RequestLimits(1 << 20, 1 << 20, 16, 16, 4.0)


def precise_parts(tmp_path: Path) -> Parts:
    """The service's parts in precise mode with a tiny tokenizer trained here (never started: its
    flow's producers are what these tests call)."""
    tokenizer = str(train_tiny_tokenizer(tmp_path / "tokenizer.json"))
    endpoints = [{"address": "127.0.0.1:9"}]
    return build(
        parse_config({"model": "m", "endpoints": endpoints, "index": {"precise": {"tokenizer": tokenizer}}})
    )


async def test_a_tokenized_prompts_count_is_the_tokenizers_not_a_character_estimate(tmp_path: Path) -> None:
    parts = precise_parts(tmp_path)
    text = "the quick brown fox jumps over the lazy dog " * 40
    route = parse_request(json.dumps({"model": "m", "prompt": text}).encode(), LIMITS)
    estimate = route.prompt_tokens
    await parts.flow.prepare(route)
    exact = len(parts.precise_keys.tokenizer.token_ids(text))
    assert exact != estimate  # the tiny tokenizer's words are not 4 characters each
    assert (route.prompt_tokens, route.exact_tokens) == (exact, True)


async def test_token_ids_are_hashed_as_they_are_and_a_batch_on_the_ids_its_prompts_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parts = precise_parts(tmp_path)

    def untokenized(text: str) -> list[int]:
        raise AssertionError("a prompt of token ids went through the tokenizer")

    monkeypatch.setattr(parts.precise_keys.tokenizer, "token_ids", untokenized)
    hasher = parts.precise_keys.tokenizer.hasher
    ids = list(range(7, 90))  # five full blocks and three over
    for prompt, routed_on in (
        (ids, ids),
        ([ids, [*ids[:50], 1, 2], [*ids[:70], 3]], ids[:50]),  # three full blocks shared
    ):
        route = parse_request(json.dumps({"model": "m", "prompt": prompt}).encode(), LIMITS)
        await parts.flow.prepare(route)
        assert route.precise_keys is not None
        assert np.array_equal(route.precise_keys, hasher.keys(routed_on))
    assert len(route.precise_keys) == 3


async def test_messages_and_responses_bodies_hash_as_the_chat_they_become(tmp_path: Path) -> None:
    tokenizer = str(train_tiny_tokenizer(tmp_path / "tokenizer.json"))
    template_path = tmp_path / "tokenizer_config.json"
    template_path.write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "bos_token": "<s>"}))
    precise = {"tokenizer": tokenizer, "chat_template": str(template_path)}
    parts = build(
        parse_config({"model": "m", "endpoints": [{"address": "127.0.0.1:9"}], "index": {"precise": precise}})
    )
    bodies = [
        ("/v1/chat/completions", {"model": "m", "messages": CHAT[:1] + CHAT[1:] * 8}),
        (
            "/v1/messages",
            {"model": "m", "max_tokens": 5, "system": "You are terse.", "messages": CHAT[1:] * 8},
        ),
        ("/v1/responses", {"model": "m", "instructions": "You are terse.", "input": CHAT[1:] * 8}),
    ]
    keys = []
    for path, body in bodies:
        route = parse_request(json.dumps(body).encode(), LIMITS, path=path)
        await parts.flow.prepare(route)
        assert route.exact_tokens and route.precise_keys is not None
        keys.append(route.precise_keys.tolist())
    # The system prompt given three ways is one conversation, so one prompt: the same blocks.
    assert keys[0] == keys[1] == keys[2] and len(keys[0]) > 2


async def test_a_batch_of_strings_keeps_its_estimated_work_and_hashes_its_shared_text(tmp_path: Path) -> None:
    parts = precise_parts(tmp_path)
    shared = "the quick brown fox jumps over the lazy dog " * 20
    prompts = [shared + "one", shared + "two"]
    route = parse_request(json.dumps({"model": "m", "prompt": prompts}).encode(), LIMITS)
    estimate = route.prompt_tokens
    await parts.flow.prepare(route)
    # The shared text's count is not the batch's work: the estimate of both prompts stays.
    assert (route.prompt_tokens, route.exact_tokens) == (estimate, False)
    assert route.precise_keys is not None
    assert route.precise_keys.tolist() == parts.precise_keys.tokenizer.block_keys_sync(shared).tolist()


async def test_the_gate_waits_for_a_complete_kv_event_stream(tmp_path: Path) -> None:
    tokenizer, specs = await _precise_gateway(tmp_path, ["e0"])
    async with SimCluster(specs) as cluster:
        sections = _sections(cluster, tokenizer)
        sections["gate"] = {
            "checks": ["ranks", "kv_capacity", "kv_events"],
            "check_timeout_s": 5,
            "initial_wait_s": 0.2,
        }
        async with router_for(sections) as (app, _):
            group = app.control.groups["e0"]
            assert group.state.value == "gating"  # admitted only once its events are known
            assert not app.parts.pool.admitted[app.parts.pool.endpoints["e0"].slot]
            await _until_covered(app, cluster)
            await eventually(lambda: group.state.value == "admitted", 5, "admitted once covered")
            assert group.checks[-1].name == "kv_events" and group.checks[-1].ok
