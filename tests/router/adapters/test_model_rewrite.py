"""Model-name rewrites end to end: the body the engine gets names the target, in the proxy and
through a real Envoy in both body modes; the request is routed and counted for the target."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gateway import SINGLE, gateway
from helpers import eventually, router_on_sim, sse_events

from simulator.engine import EngineSpec, SimCluster

pytestmark = pytest.mark.integration

ADAPTERS = [dataclasses.replace(spec, lora_adapters=("lora-a",)) for spec in SINGLE]
SPLIT = {"name": "public-split", "model": "public", "targets": [{"model": "sim-model"}, {"model": "lora-a"}]}
HEADER = "x-gateway-model-name-rewrite"


def completion(model: str, i: int, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": f"rewrite me {i} " * 30, "max_tokens": 4, **extra}


def models_seen(cluster: SimCluster) -> list[str]:
    return [body["model"] for e in cluster.engines.values() for _, _, body in e.requests_seen if body]


def rewrites_counted(app: Any, rule: str, asked: str, target: str) -> float:
    labels = {"model_rewrite_name": rule, "model_name": asked, "target_model": target}
    registry = app.parts.metrics.registry
    return registry.get_sample_value("inference_extension_model_rewrite_decisions_total", labels) or 0.0


async def test_the_proxy_splits_a_public_name_and_honours_the_header() -> None:
    specs: list[EngineSpec] = ADAPTERS
    sections = {"model_rewrites": [SPLIT]}
    async with router_on_sim(specs, sections) as (cluster, app, base), aiohttp.ClientSession() as http:
        for i in range(24):
            async with http.post(f"{base}/v1/completions", json=completion("public", i)) as resp:
                assert resp.status == 200, await resp.text()
        seen = models_seen(cluster)
        assert set(seen) == {"sim-model", "lora-a"}  # both targets, never the public name
        assert rewrites_counted(app, "public-split", "public", "lora-a") == seen.count("lora-a")
        # The gateway's header wins over the rule; a streamed request's body is rewritten too.
        lora = seen.count("lora-a")
        body = completion("public", 99, stream=True)
        async with http.post(f"{base}/v1/completions", json=body, headers={HEADER: "lora-a"}) as resp:
            assert resp.status == 200 and (await sse_events(resp))[-1] == "[DONE]"
        assert models_seen(cluster).count("lora-a") == lora + 1
        assert rewrites_counted(app, "header", "public", "lora-a") == 1
        # A header naming a model this strict pool does not serve: 404 before any engine is asked.
        before = len(models_seen(cluster))
        async with http.post(
            f"{base}/v1/completions", json=completion("public", 7), headers={HEADER: "x"}
        ) as resp:
            assert resp.status == 404
            assert "'x' (rewritten from 'public') is not served" in (await resp.json())["error"]["message"]
        assert len(models_seen(cluster)) == before
        await eventually(lambda: app.parts.pool.outstanding == 0, what="reservations released")


@pytest.mark.parametrize("mode", ["full-duplex", "buffered"])
async def test_envoy_forwards_the_rewritten_body_in_both_body_modes(tmp_path: Path, mode: str) -> None:
    async with gateway(tmp_path, mode, specs=ADAPTERS, model_rewrites=[SPLIT]) as gw:
        async with aiohttp.ClientSession() as http:
            for i in range(12):
                async with http.post(f"{gw.url}/v1/completions", json=completion("public", i)) as resp:
                    assert resp.status == 200, await resp.text()
            body = completion("public", 50, stream=True)
            async with http.post(f"{gw.url}/v1/completions", json=body, headers={HEADER: "lora-a"}) as resp:
                assert resp.status == 200 and (await sse_events(resp))[-1] == "[DONE]"
        seen = models_seen(gw.cluster)
        assert len(seen) == 13 and set(seen) == {"sim-model", "lora-a"}
        # The engine parsed every rewritten body: its length was sent along with it.
        assert rewrites_counted(gw.app, "header", "public", "lora-a") == 1
        await eventually(lambda: gw.app.parts.pool.outstanding == 0, what="reservations released")
