"""Per-request SLOs through the proxy, on simulated engines over real HTTP: a request whose SLO
no route can meet is refused by criticality, a bad header is a 400 naming it, an objective's
default applies, one that can be met is served, and the SLO series count each outcome."""

from __future__ import annotations

import aiohttp
import orjson
from helpers import router_on_sim

from simulator.engine import EngineSpec

SPECS = [EngineSpec("e0", "prefill-decode"), EngineSpec("e1", "prefill-decode")]
SECTIONS = {"slo": {"exploration": 0, "objectives": {"premium": {"ttft_ms": 0.001}}}}
BODY = {"model": "sim-model", "prompt": "tell me about foxes " * 20, "max_tokens": 4}


async def post(http: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> tuple[int, dict, dict]:
    async with http.post(f"{base}/v1/completions", json=BODY, headers=headers) as resp:
        return resp.status, dict(resp.headers), orjson.loads(await resp.read())


async def test_slo_headers_through_the_proxy() -> None:
    async with router_on_sim(SPECS, SECTIONS) as (_, _app, base), aiohttp.ClientSession() as http:
        status, headers, body = await post(http, base, {"x-slo-ttft-ms": "0.001"})
        assert status == 503 and headers["x-pd-router-reject"] == "slo_unattainable"
        assert headers["Retry-After"] == "1" and "best predicted TTFT" in body["error"]["message"]

        sheddable = {"x-slo-ttft-ms": "0.001", "x-pd-router-priority": "-1"}
        status, headers, _ = await post(http, base, sheddable)
        assert status == 429 and headers["x-pd-router-reject"] == "slo_unattainable"

        status, _, body = await post(http, base, {"x-slo-tpot-ms": "soon"})
        assert status == 400 and "x-slo-tpot-ms" in body["error"]["message"]

        status, headers, _ = await post(http, base, {"x-gateway-inference-objective": "premium"})
        assert status == 503 and headers["x-pd-router-reject"] == "slo_unattainable"

        status, _, _ = await post(http, base, {"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "60000"})
        assert status == 200
        status, _, _ = await post(http, base, {})  # no SLO: served, and not an SLO request
        assert status == 200

        text = await (await http.get(f"{base}/metrics")).text()
    counts = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith("pd_router_slo_requests_total{")
    }
    assert counts == {
        'pd_router_slo_requests_total{objective="none",outcome="rejected"}': 2.0,
        'pd_router_slo_requests_total{objective="premium",outcome="rejected"}': 1.0,
        'pd_router_slo_requests_total{objective="none",outcome="met"}': 1.0,
    }


async def test_a_default_objective_holds_the_requests_that_name_none() -> None:
    sections = {
        "slo": {
            "exploration": 0,
            "objectives": {"premium": {"ttft_ms": 0.001}, "standard": {"ttft_ms": 60000, "tpot_ms": 60000}},
            "default_objective": "premium",
        }
    }
    async with router_on_sim(SPECS, sections) as (_, _app, base), aiohttp.ClientSession() as http:
        status, headers, _ = await post(http, base, {})  # names none: premium's 1 µs TTFT
        assert status == 503 and headers["x-pd-router-reject"] == "slo_unattainable"
        status, _, _ = await post(http, base, {"x-gateway-inference-objective": "standard"})
        assert status == 200  # one it names wins
        status, _, _ = await post(http, base, {"x-slo-ttft-ms": "60000"})
        assert status == 200  # a header wins over the default for its measure
        text = await (await http.get(f"{base}/metrics")).text()
    assert 'pd_router_slo_requests_total{objective="premium",outcome="rejected"} 1.0' in text
    assert 'pd_router_slo_requests_total{objective="premium",outcome="met"} 1.0' in text
    assert 'pd_router_slo_requests_total{objective="standard",outcome="met"} 1.0' in text
