"""Property-based fuzzing (hypothesis) of every parser facing the outside: OpenAI bodies, ext_proc
message sequences, vLLM KV-event frames, engine ``/metrics`` text and configuration files.

CI runs a fixed, derandomized set of examples per test (the whole folder in well under a minute on
two cores). ``FUZZ_EXAMPLES=<n>`` turns every test into a long, randomly seeded session of ``n``
examples (a failure prints the seed to replay it with ``--hypothesis-seed``)::

    FUZZ_EXAMPLES=20000 python3 -m pytest -q tests/fuzz -p no:cacheprovider
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

FUZZ_EXAMPLES_ENV = "FUZZ_EXAMPLES"


def fuzz_settings(examples: int, **overrides: object) -> settings:
    """``examples`` derandomized examples in CI; ``$FUZZ_EXAMPLES`` random ones in a long local run.

    No deadline (a loaded CI machine is slow; speed is for the benchmarks, not the tests); no
    example database, so CI never depends on what a previous run found.
    """
    long_run = os.environ.get(FUZZ_EXAMPLES_ENV)
    common: dict[str, object] = {
        "deadline": None,
        "database": None,
        "suppress_health_check": [
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.function_scoped_fixture,
        ],
        "print_blob": True,
    }
    if long_run:
        return settings(max_examples=int(long_run), derandomize=False, **common, **overrides)  # type: ignore[arg-type]
    return settings(max_examples=examples, derandomize=True, **common, **overrides)  # type: ignore[arg-type]
