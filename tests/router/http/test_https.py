"""HTTPS on the HTTP listeners when asked for (the proxy, the decode sidecar), and the proxy's own
``/metrics`` behind ``metrics.token``."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import aiohttp
import pytest
from helpers import router_on_sim

from router.sidecar.server import SidecarServer
from router.transport.tls import self_signed
from simulator.engine import EngineSpec, SimCluster

pytestmark = pytest.mark.integration

SPECS = [EngineSpec("e0", "prefill-decode")]
PROMPT = "The quick brown fox jumps over the lazy dog. " * 20


def trusting(cert: Path) -> ssl.SSLContext:
    """A client that trusts ``cert`` (self-signed: its own root) and asks for HTTP/1.1."""
    context = ssl.create_default_context(cafile=str(cert))
    context.set_alpn_protocols(["http/1.1"])
    return context


async def test_the_proxy_serves_https_with_a_generated_certificate_and_refuses_plain_http() -> None:
    sections = {"proxy": {"port": 0, "tls": {"enabled": True}}}
    async with router_on_sim(SPECS, sections) as (_, app, _), aiohttp.ClientSession() as http:
        assert app.proxy.tls is not None
        url = f"https://localhost:{app.proxy_port}/v1/completions"
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4}
        async with http.post(url, json=body, ssl=trusting(app.proxy.tls.cert_file)) as resp:
            assert resp.status == 200
        context = trusting(app.proxy.tls.cert_file)
        _, writer = await asyncio.open_connection(
            "127.0.0.1", app.proxy_port, ssl=context, server_hostname="localhost"
        )
        assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "http/1.1"
        writer.close()
        with pytest.raises(aiohttp.ClientError):
            async with http.get(f"http://127.0.0.1:{app.proxy_port}/health") as resp:
                await resp.read()


async def test_the_proxys_metrics_need_the_metrics_token_when_one_is_set() -> None:
    sections = {"metrics": {"token": "s3cret"}}
    async with router_on_sim(SPECS, sections) as (_, _, base), aiohttp.ClientSession() as http:
        async with http.get(f"{base}/metrics") as resp:
            assert resp.status == 401
        async with http.get(f"{base}/metrics", headers={"Authorization": "Bearer s3cret"}) as resp:
            assert resp.status == 200 and "pd_router_requests" in await resp.text()


async def test_the_sidecar_serves_https_from_given_files(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    async with SimCluster([EngineSpec("d0", "decode")]) as cluster:
        sidecar = SidecarServer(
            cluster.address("d0"),
            "127.0.0.1",
            0,
            ["127.0.0.1"],
            tls=True,
            tls_cert=str(cert),
            tls_key=str(key),
        )
        models = "https://localhost:{}/v1/models"
        async with (
            sidecar,
            aiohttp.ClientSession() as http,
            http.get(models.format(sidecar.port), ssl=trusting(cert)) as resp,
        ):
            assert resp.status == 200  # passed through to the engine
            assert (await resp.json())["data"][0]["id"] == "sim-model"
    with pytest.raises(ValueError, match="go together"):
        SidecarServer("127.0.0.1:1", "127.0.0.1", 0, ["127.0.0.1"], tls=True, tls_cert=str(cert))
