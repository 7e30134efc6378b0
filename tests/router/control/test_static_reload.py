"""Playing group events without a cluster: the static file re-read on change (a late rank, a
restart, a new revision) and the simulator's fault routes (a failing canary)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import yaml
from helpers import eventually

from router.control.discovery.static import StaticDiscovery
from router.server.app import App
from router.server.compose import build
from router.server.config import load_config
from simulator.engine import EngineSpec, SimCluster, TimeModel


def write(path: Path, endpoints: list[dict]) -> None:
    data = {
        "model": "sim-model",
        "endpoints": endpoints,
        "proxy": {"port": 0},
        "scrape": {"interval_ms": 50, "stale_after_ms": 1000},
        "gate": {
            "checks": ["ranks", "revision", "kv_capacity", "canary"],
            "canary_min_interval_s": 0,
            "retry_base_s": 0.05,
        },
    }
    path.write_text(yaml.safe_dump(data))


async def test_the_static_file_plays_a_late_rank_a_restart_a_revision_and_a_failing_canary(
    tmp_path: Path,
) -> None:
    specs = [EngineSpec("e0", "prefill-decode", time=TimeModel(speed=20.0))]
    async with SimCluster(specs) as cluster:
        e0 = cluster.address("e0")
        leader = {"address": e0, "name": "e0", "group": "tp", "rank": 0, "group_size": 2, "revision": "a"}
        worker = {
            "address": "127.0.0.1:9",
            "name": "e0-w",
            "group": "tp",
            "rank": 1,
            "serves": False,
            "revision": "a",
        }
        path = tmp_path / "pool.yaml"
        write(path, [leader])
        config = load_config(path)
        source = StaticDiscovery(config.endpoints, path=path, poll_s=0.02)
        async with App(build(config, discovery=source)) as app:
            group = app.control.groups["tp"]
            assert group.state.value == "discovered"  # one rank of two: waits at the barrier
            write(path, [leader, worker])  # the late rank
            await eventually(lambda: group.state.value == "admitted", 5, "admitted once complete")
            write(path, [leader, {**worker, "incarnation": "2"}])  # the worker restarted
            await eventually(lambda: group.epoch == 2 and group.state.value == "admitted", 5, "new epoch")
            write(path, [leader, {**worker, "incarnation": "2", "revision": "b"}])  # a bad rollout
            await eventually(lambda: group.state.value == "failed", 5, "revision mismatch")
            assert "rank 0 has a, rank 1 has b" in group.reason
            path.write_text("model: [not valid")  # a broken edit is ignored
            write(path, [leader, {**worker, "incarnation": "2"}])
            await eventually(lambda: group.state.value == "admitted", 5, "rolled back")
            async with aiohttp.ClientSession() as http:
                async with http.post(f"http://{e0}/sim/fault?fail=500") as resp:
                    assert resp.status == 200
                app.control.regate("tp")
                await eventually(lambda: group.state.value == "failed", 5, "the canary fails")
                assert "HTTP 500" in group.reason
                async with http.post(f"http://{e0}/sim/fault?fail=off") as resp:
                    assert resp.status == 200
            await eventually(lambda: group.state.value == "admitted", 5, "recovered")


async def test_a_restarted_engine_leaves_nothing_cached_in_the_index(tmp_path: Path) -> None:
    """The leader's engine restarted (a new incarnation: its KV cache is gone): the index forgets
    what it held for the endpoint, so the next prompt is not priced as cached there."""
    specs = [EngineSpec("e0", "prefill-decode", time=TimeModel(speed=20.0))]
    async with SimCluster(specs) as cluster:
        e0 = {"address": cluster.address("e0"), "name": "e0"}
        path = tmp_path / "pool.yaml"
        write(path, [e0])
        config = load_config(path)
        source = StaticDiscovery(config.endpoints, path=path, poll_s=0.02)
        async with App(build(config, discovery=source)) as app, aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{app.proxy_port}"
            body = {"model": "sim-model", "prompt": "a long shared system prompt " * 40, "max_tokens": 2}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 200
            old = app.parts.pool.endpoints["e0"]
            await eventually(lambda: len(app.parts.index) > 0, 2, "the prompt recorded")
            write(path, [{**e0, "incarnation": "2"}])
            await eventually(lambda: app.parts.pool.endpoints.get("e0") is not old, 5, "a new engine")
            assert len(app.parts.index) == 0  # nothing of the old engine's cache is believed any more
