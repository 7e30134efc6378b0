"""``loadtests.bench.hash``: its rows, and ``--against`` another checkout's keys in turns."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from loadtests.bench.hash import main

REPO = Path(__file__).resolve().parents[2]


def test_every_row_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--tokens", "256", "--calls", "3"])
    out = capsys.readouterr().out
    for name, block, blocks in (
        ("sha256", 16, 16),
        ("sha256_cbor", 64, 4),
        ("approx text", 64, 16),
        ("approx text, non-ASCII", 64, 16),
        ("approx token ids", 16, 16),
    ):
        assert re.search(rf"^{re.escape(name)} +{block} +{blocks} +\d+ +\d+ +[\d.]+$", out, re.MULTILINE), (
            name
        )


def test_against_a_tree_with_the_same_keys_gives_a_ratio_per_row(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--tokens", "256", "--calls", "3", "--rounds", "1", "--against", str(REPO)])
    out = capsys.readouterr().out
    assert "differ" not in out
    for name in ("text", "text, non-ASCII", "token ids"):
        assert re.search(rf"^{re.escape(name)} +16 +[\d.]+ +[\d.]+ +[\d.]+×$", out, re.MULTILINE), name


def test_against_a_tree_without_the_module_says_so(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no kvindex/hashing\.py"):
        main(["--tokens", "256", "--calls", "3", "--against", str(tmp_path)])


@pytest.mark.parametrize("flag", ["--tokens", "--calls", "--rounds"])
def test_a_count_below_one_is_refused_by_name(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([flag, "0"])
    assert exit_.value.code == 2 and f"{flag}: at least 1" in capsys.readouterr().err
