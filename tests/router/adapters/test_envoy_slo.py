"""Per-request SLOs through a real Envoy and the ext_proc picker: refused by criticality when no
route can meet them, 400 for a bad header, served and counted as met when one can; the headers
reach the engine (they are a client input, not a routing header the router strips)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gateway import gateway
from helpers import eventually

pytestmark = pytest.mark.integration

SECTIONS: dict[str, Any] = {"slo": {"exploration": 0}}
BODY = {"model": "sim-model", "prompt": "tell me about foxes " * 20, "max_tokens": 4}


def met(metrics: Any) -> float:
    text = metrics.exposition()[0].decode()
    line = 'pd_router_slo_requests_total{objective="none",outcome="met"} '
    return next((float(row.split(" ")[1]) for row in text.splitlines() if row.startswith(line)), 0.0)


@pytest.mark.parametrize("mode", ["full-duplex", "buffered"])
async def test_slo_headers_through_envoy(tmp_path: Path, mode: str) -> None:
    async with gateway(tmp_path, mode, **SECTIONS) as gw, aiohttp.ClientSession() as http:
        url = f"{gw.url}/v1/completions"
        for headers, status in (
            ({"x-slo-ttft-ms": "0.001"}, 503),
            ({"x-slo-ttft-ms": "0.001", "x-gateway-inference-objective": "batch-sheddable"}, 429),
        ):
            async with http.post(url, json=BODY, headers=headers) as resp:
                assert resp.status == status
                assert resp.headers["x-pd-router-reject"] == "slo_unattainable"
                assert resp.headers["retry-after"] == "1"
                assert (await resp.json())["error"]["code"] == "slo_unattainable"
        async with http.post(url, json=BODY, headers={"x-slo-ttft-ms": "-1"}) as resp:
            assert resp.status == 400
            assert "x-slo-ttft-ms" in (await resp.json())["error"]["message"]
        relaxed = {"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "60000"}
        async with http.post(url, json=BODY, headers=relaxed) as resp:
            assert resp.status == 200
            await resp.read()
        await eventually(lambda: met(gw.app.parts.metrics) == 1.0, what="the answer counted as met")
        seen = [headers for engine in gw.cluster.engines.values() for _, headers, _ in engine.requests_seen]
        assert [h.get("x-slo-ttft-ms") for h in seen] == ["60000"]  # forwarded as the client sent it
        await eventually(lambda: gw.app.parts.pool.outstanding == 0, what="reservations released")
