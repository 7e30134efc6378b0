"""Tokens and the Redis password from files (mounted Secrets), so none sits in a config map or on
the command line."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from helpers import router_for, router_on_sim

from loadtests.servers.redis import RedisServer
from router.server.config import ConfigError, parse_config
from simulator.engine import EngineSpec, SimCluster, TimeModel

BASE = {"model": "m", "endpoints": [{"address": "10.0.0.1:8000"}]}


def secret(tmp_path: Path, name: str, value: str) -> str:
    path = tmp_path / name
    path.write_text(value + "\n")  # a Secret written by hand often ends with a newline
    return str(path)


def test_a_token_or_its_file_but_not_both(tmp_path: Path) -> None:
    path = secret(tmp_path, "token", "t")
    with pytest.raises(ConfigError, match=r"metrics\.token and metrics\.token_file: set one, not both"):
        parse_config({**BASE, "metrics": {"token": "x", "token_file": path}})
    admin = parse_config({**BASE, "admin": {"enabled": True, "token_file": path}})
    assert admin.read_secrets().admin_token == "t"  # admin.enabled is satisfied by a token file
    with pytest.raises(ConfigError, match=r"admin\.enabled needs admin\.token or admin\.token_file"):
        parse_config({**BASE, "admin": {"enabled": True}})


def test_unusable_secret_files_are_errors_that_name_the_field(tmp_path: Path) -> None:
    missing = parse_config({**BASE, "metrics": {"token_file": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match=r"metrics.token_file: cannot read .*nope"):
        missing.read_secrets()
    empty = tmp_path / "empty"
    empty.write_text("\n")
    redis = {"redis": {"url": "redis://10.0.0.2:6379/0", "password_file": str(empty)}}
    with pytest.raises(ConfigError, match=r"index\.redis\.password_file: .*empty is empty"):
        parse_config({**BASE, "index": redis}).read_secrets()
    secrets = parse_config({**BASE, "metrics": {"token": "inline"}}).read_secrets()
    assert secrets.metrics_token == "inline" and "inline" not in repr(secrets)


@pytest.mark.integration
async def test_the_metrics_listener_takes_its_token_from_a_file(tmp_path: Path) -> None:
    sections = {"metrics": {"enabled": True, "port": 0, "token_file": secret(tmp_path, "m", "from-file")}}
    async with (
        router_on_sim([EngineSpec("e0", "prefill-decode")], sections) as (_, app, base),
        aiohttp.ClientSession() as http,
    ):
        for url in (f"http://127.0.0.1:{app.metrics_port}/metrics", f"{base}/metrics"):
            async with http.get(url) as resp:
                assert resp.status == 401
            async with http.get(url, headers={"Authorization": "Bearer from-file"}) as resp:
                assert resp.status == 200


@pytest.mark.integration
async def test_a_redis_that_requires_a_password_is_reached_with_the_password_file(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path, password="s3cret-pw")
    redis.start()
    try:
        async with SimCluster([EngineSpec("e0", "prefill-decode", time=TimeModel(speed=20))]) as cluster:
            url = f"redis://127.0.0.1:{redis.port}/0"  # no password in the URL
            shared = {"url": url, "password_file": secret(tmp_path, "pw", "s3cret-pw")}
            endpoints = [{"address": cluster.address("e0"), "name": "e0"}]
            async with router_for({"endpoints": endpoints, "index": {"redis": shared}}) as (app, base):
                async with aiohttp.ClientSession() as http:
                    body = {"model": "sim-model", "prompt": "hello " * 40, "max_tokens": 2}
                    async with http.post(f"{base}/v1/completions", json=body) as resp:
                        assert resp.status == 200
                assert await app.parts.shared.flush()  # written to the password-protected Redis
                assert app.parts.shared.healthy
    finally:
        redis.kill()
