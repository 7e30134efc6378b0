"""Configuration: defaults, overrides, and errors that name the field and the bad value."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_picker, make_pool

from router.scheduling.costmodel.policies import POLICIES
from router.server.cli import main
from router.server.compose import gate_settings_from
from router.server.config import ConfigError, load_config, parse_config

MINIMAL = {"model": "m", "endpoints": [{"address": "127.0.0.1:8001", "role": "prefill"}]}


def test_minimal_config_gets_sane_defaults() -> None:
    config = parse_config(MINIMAL)
    endpoint = config.endpoints[0]
    assert endpoint.id == "127.0.0.1:8001" and endpoint.link == "default" and endpoint.group is None
    assert config.proxy.host == "127.0.0.1" and config.slo.ttft_ms > 0
    assert config.request_limits().max_body_bytes == config.limits.max_body_bytes


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({**MINIMAL, "endpoints": [{"address": "127.0.0.1:1", "role": "both"}]}, "endpoints.0.role:"),
        ({**MINIMAL, "endpoints": [{"address": "pod-a:80"}]}, "endpoints.0.address: must be ip:port"),
        ({**MINIMAL, "endpoints": [{"address": "127.0.0.1:99999"}]}, "endpoints.0.address: must be ip:port"),
        ({**MINIMAL, "slo": {"ttft_ms": 0}}, "slo.ttft_ms: Input should be greater than 0, got 0"),
        ({**MINIMAL, "weights": {"prefix": 1.3}}, "weights: prefix: must be in [0, 1]"),
        (
            {**MINIMAL, "weights": {"kv": -1}},
            "weights.kv: Input should be greater than or equal to 0, got -1",
        ),
        (
            {**MINIMAL, "weights": {"nosuch": 1}},
            "weights: nosuch: no scorer 'nosuch': expected a module "
            "router.scheduling.costmodel.terms.nosuch with a term() function",
        ),
        ({**MINIMAL, "picker": {"policy": "random"}}, "picker.policy: Input should be 'joint',"),
        (
            {**MINIMAL, "index": {"redis": {"share_load_ms": 1e9}}},
            "index.redis.share_load_ms: Input should be less than or equal to 10000",
        ),
        (
            {**MINIMAL, "kubernetes": {"namespace": "x"}},
            "kubernetes: set exactly one of pool_name and selector",
        ),
        ({**MINIMAL, "admin": {"enabled": True}}, "admin: admin.enabled needs admin.token"),
        ({**MINIMAL, "gate": {"checks": ["ranks", "ranks"]}}, "gate.checks: each check at most once"),
        ({**MINIMAL, "scorers": {}}, "scorers: unknown field"),
        ({**MINIMAL, "slo": {"ttft": 5}}, "slo.ttft: unknown field"),
        ({"endpoints": MINIMAL["endpoints"]}, "model: required field is missing"),
        (
            {**MINIMAL, "endpoints": []},
            "endpoints: at least one endpoint, or a kubernetes section to discover them",
        ),
        (
            {**MINIMAL, "endpoints": [{"address": "127.0.0.1:1"}, {"address": "127.0.0.1:1"}]},
            "duplicate endpoint '127.0.0.1:1'",
        ),
        ([1, 2], "config: must be a mapping, got list"),
        (
            {**MINIMAL, "slo": {"objectives": {"premium": {"ttft_ms": 300}}, "default_objective": "gold"}},
            "default_objective 'gold' is not among slo.objectives (configured: premium)",
        ),
    ],
)
def test_errors_name_the_field_and_the_value(data: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert message in str(err.value)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_pair_picker_is_a_policy_the_configuration_accepts_and_builds(policy: str) -> None:
    config = parse_config({**MINIMAL, "picker": {"policy": policy}})
    assert make_picker(config, make_pool(config)).pair_picker.name == policy


def test_an_unknown_policy_is_refused_naming_every_pair_picker() -> None:
    with pytest.raises(ConfigError) as error:
        parse_config({**MINIMAL, "picker": {"policy": "random"}})
    assert str(error.value).startswith("picker.policy: ")
    assert all(repr(name) in str(error.value) for name in POLICIES)


def test_without_gate_checks_a_file_gets_the_cheap_ones_and_a_cluster_the_canaries_too() -> None:
    assert gate_settings_from(parse_config(MINIMAL)).checks == ("ranks", "revision", "kv_capacity")
    cluster = parse_config({"model": "m", "kubernetes": {"pool_name": "pool"}})
    assert gate_settings_from(cluster).checks == (
        "ranks",
        "revision",
        "model",
        "kv_capacity",
        "canary",
        "canary_pair",
    )
    # Precise mode adds kv_events on a cluster (discovered pods' streams), not to a file's checks.
    precise = {"precise": {"tokenizer": "tokenizer.json"}}
    precise_cluster = parse_config({"model": "m", "kubernetes": {"pool_name": "pool"}, "index": precise})
    assert gate_settings_from(precise_cluster).checks == (*gate_settings_from(cluster).checks, "kv_events")
    precise_file = parse_config({**MINIMAL, "index": precise})
    assert gate_settings_from(precise_file).checks == ("ranks", "revision", "kv_capacity")
    listed = parse_config({**MINIMAL, "gate": {"checks": ["kv_events", "ranks"]}})
    assert gate_settings_from(listed).checks == ("kv_events", "ranks")


def test_overrides_replace_file_values_including_list_items() -> None:
    config = parse_config(dict(MINIMAL), ["slo.ttft_ms=250", "endpoints.0.role=decode", "proxy.port=9100"])
    assert config.slo.ttft_ms == 250 and config.endpoints[0].role == "decode" and config.proxy.port == 9100
    with pytest.raises(ConfigError, match=r"expected dotted\.path=value"):
        parse_config(dict(MINIMAL), ["slo.ttft_ms"])


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text("model: m\nendpoints: [{address: 127.0.0.1:1, role: nope}]\n")
    with pytest.raises(ConfigError, match=r"pool.yaml: endpoints.0.role"):
        load_config(path)
    path.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_cli_check_config_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("model: m\nendpoints:\n  - {address: 127.0.0.1:8001, role: prefill}\n")
    assert main(["check-config", "--config", str(good)]) == 0
    assert main(["check-config", "--config", str(good), "--set", "slo.tpot_ms=-1"]) == 2
    assert "slo.tpot_ms: Input should be greater than 0, got -1" in capsys.readouterr().err


def test_the_example_pool_file_is_valid() -> None:
    config = load_config(Path(__file__).parents[3] / "examples" / "pool.yaml")
    assert {e.role for e in config.endpoints} == {"prefill", "decode"}


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        (["--pool-name", "qwen", "--pool-namespace", "llm"], {}, "namespace 'llm' from InferencePool 'qwen'"),
        (["--pool-name", "qwen"], {"NAMESPACE": "prod"}, "namespace 'prod' from InferencePool 'qwen'"),
        (
            ["--endpoint-selector", "app=vllm,tier=a", "--endpoint-target-ports", "8000,8001"],
            {},
            "pods {'app': 'vllm', 'tier': 'a'} ports [8000, 8001]",
        ),
    ],
)
def test_the_reference_pickers_discovery_flags(tmp_path, capsys, monkeypatch, flags, env, expected) -> None:
    from router.server.cli import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "pool.yaml"
    path.write_text("model: m\n")
    assert main(["check-config", "--config", str(path), *flags]) == 0
    assert expected in capsys.readouterr().out


async def test_every_pool_built_from_a_config_carries_all_its_pool_settings() -> None:
    """The service's pool, the picker-only pool and the tests' pool come from one constructor:
    none drops a setting (``typical_prompt_tokens`` was lost by two of three)."""
    from helpers import make_pool

    from router.server.compose import build, pool_from

    config = parse_config(
        {
            "model": "m",
            "endpoints": [{"address": "127.0.0.1:1", "role": "decode"}],
            "engine": {"typical_prompt_tokens": 3000},
            "scrape": {"stale_after_ms": 1234, "eject_after_failures": 7},
            "limits": {"default_max_tokens": 99},
        }
    )
    pools = [pool_from(config), make_pool(config), build(config).pool]
    for pool in pools:
        assert (pool.typical_prompt_tokens, pool.stale_after_s, pool.eject_after_failures) == (3000, 1.234, 7)
        assert pool.typical_answer_tokens == 99
