"""The prefill leg's time a sidecar reports in ``Server-Timing``, as the picker reads it back."""

from __future__ import annotations

import pytest

from router.http.headers import prefill_seconds, prefill_timing


def test_the_timing_a_sidecar_writes_reads_back_as_its_seconds() -> None:
    assert prefill_seconds(prefill_timing(0.0421)) == pytest.approx(0.0421)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("cache;desc=hit, pd-prefill;dur=12.5", 0.0125),  # among other metrics (Envoy joins repeats)
        ("pd-prefill;desc=leg;DUR=7", 0.007),  # parameter names are case-insensitive
        ('pd-prefill;dur="3"', 0.003),
        ("prefill;dur=5", None),  # another metric's name
        ("pd-prefill", None),  # no duration
        ("pd-prefill;dur=abc", None),
        ("pd-prefill;dur=-1", None),
        ("pd-prefill;dur=nan", None),
        ("pd-prefill;dur=inf", None),
        ("pd-prefill;dur=4000000", None),  # over an hour: no prompt's compute time
        ("", None),
    ],
)
def test_a_prefill_timing_is_read_only_when_plausible(value: str, seconds: float | None) -> None:
    found = prefill_seconds(value)
    assert found == (None if seconds is None else pytest.approx(seconds))
