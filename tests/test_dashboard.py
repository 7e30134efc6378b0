"""The Grafana dashboard (deploy/grafana/pd-router.json) loads as is and queries only metrics a
running router exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
import pytest
from helpers import eventually, router_on_sim
from prometheus_client.parser import text_string_to_metric_families

from simulator.engine import EngineSpec

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "pd-router.json"
_METRIC = re.compile(r"\b([a-z_][a-z0-9_:]*)\{")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def queried_metrics(dashboard: dict) -> set[str]:
    names = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            names.update(_METRIC.findall(target["expr"]))
    return names


def test_dashboard_is_grafana_json_with_unique_ids_and_a_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs))
    titles = " ".join(panel["title"] for panel in dashboard["panels"])
    for needed in ("recommended", "Load per role", "Queued", "KV", "TTFT", "TPOT", "Gate"):
        assert needed in titles


@pytest.mark.integration
async def test_every_queried_metric_is_exported_by_a_running_router() -> None:
    queried = queried_metrics(json.loads(DASHBOARD.read_text()))
    assert len(queried) > 20
    specs = [EngineSpec("p0", "prefill"), EngineSpec("d0", "decode")]
    async with (
        router_on_sim(specs, {"signals": {"tick_ms": 50}}) as (_, app, base),
        aiohttp.ClientSession() as http,
    ):
        body = {"model": "sim-model", "prompt": "hello " * 40, "max_tokens": 4, "stream": True}
        async with http.post(f"{base}/v1/completions", json=body) as resp:
            await resp.read()
        await eventually(lambda: app.parts.scaling.latest, 5.0, "a signals tick")
        async with http.get(f"{base}/metrics") as resp:
            text = await resp.text()
    exported = set()
    for family in text_string_to_metric_families(text):
        exported.add(family.name)
        exported.update(sample.name for sample in family.samples)
    missing = {
        name
        for name in queried
        if name not in exported and not any(name.removesuffix(s) in exported for s in _SUFFIXES)
    }
    assert not missing, f"the dashboard queries metrics nobody exports: {sorted(missing)}"
