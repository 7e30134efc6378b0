"""``python -m loadtests.bench.redis_index`` on a throwaway redis-server, at a tiny size: every
section prints, and section 4 shows the blocks written lately not rewritten."""

from __future__ import annotations

import argparse
import asyncio
import re
import sys

import pytest

from loadtests.bench.redis_index import cli, main
from loadtests.servers.redis import available

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not available(), reason="redis-server binary not installed"),
]


def test_the_benchmark_prints_fewer_writes_when_recent_writes_are_not_rewritten(
    capsys: pytest.CaptureFixture[str],
) -> None:
    asyncio.run(main(argparse.Namespace(blocks=512, calls=5, port=None, requests=16)))
    out = capsys.readouterr().out
    assert "lookup all-64" in out and "Redis memory per block" in out
    whole = re.search(r"every prompt written whole\s+Redis CPU [\d.]+ ms, (\d+) HSETs", out)
    lately = re.search(r"blocks written lately not rewritten\s+Redis CPU [\d.]+ ms, (\d+) HSETs", out)
    assert whole is not None and lately is not None, out
    # 16 requests on 8 prefixes: each prefix written once (8 x 192), then 64 new blocks a request.
    assert int(whole.group(1)) == 256
    assert int(lately.group(1)) == round((8 * 192 + 16 * 64) / 16)
    assert "not rewritten / whole, Redis CPU" in out


@pytest.mark.parametrize("option", ["--blocks", "--calls", "--requests"])
def test_a_count_below_one_is_refused_by_name(
    option: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["redis_index", option, "0"])
    with pytest.raises(SystemExit) as exited:
        cli()
    assert exited.value.code == 2
    assert f"{option} must be at least 1" in capsys.readouterr().err
