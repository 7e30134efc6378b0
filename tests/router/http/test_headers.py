"""The prefill leg's report a sidecar puts in ``Server-Timing``, as the picker reads it back."""

from __future__ import annotations

import pytest

from router.http.headers import PrefillTiming, prefill_timing, read_prefill_timing


def test_the_report_a_sidecar_writes_reads_back_as_it_was() -> None:
    timing = PrefillTiming(0.0421, 512, 128)
    assert prefill_timing(timing) == "pd-prefill;dur=42.100;prompt=512;cached=128"
    assert read_prefill_timing(prefill_timing(timing)) == PrefillTiming(pytest.approx(0.0421), 512, 128)
    assert read_prefill_timing(prefill_timing(PrefillTiming(0.5))) == PrefillTiming(0.5, None, None)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("cache;desc=hit, pd-prefill;dur=12.5", (0.0125, None, None)),  # among others (Envoy joins repeats)
        ("pd-prefill;desc=leg;DUR=7;Cached=3", (0.007, None, 3)),  # parameter names: any case
        ('pd-prefill;dur="3";prompt="40"', (0.003, 40, None)),
        ("pd-prefill;dur=3;prompt=-4;cached=1.5", (0.003, None, None)),  # not counts: left out
        (f"pd-prefill;dur=3;prompt={'9' * 5000};cached=", (0.003, None, None)),  # int() would refuse it
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
def test_a_report_is_read_only_with_a_plausible_duration(
    value: str, expected: tuple[float, int | None, int | None] | None
) -> None:
    found = read_prefill_timing(value)
    if expected is None:
        assert found is None
    else:
        assert found == PrefillTiming(pytest.approx(expected[0]), expected[1], expected[2])
