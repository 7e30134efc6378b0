"""How the failover benchmark reads a run: which failed requests the killed replica was serving
(from its own pick log), when the survivor carried all traffic, and what breaks the contract.
The processes themselves run in tests/faults/test_gateway_faults.py."""

from __future__ import annotations

from pathlib import Path

import orjson

from loadtests.bench.failover import Answer, EnvoyWatch, Scenario, Timeline, summarize, table
from loadtests.servers.picker import PICK_LOGGER, PickerProcess

SIGNAL = 1000.0  # wall clock of the signal


def picker_with_log(tmp_path: Path, *runs: list[dict[str, object] | bytes]) -> PickerProcess:
    """A replica that never ran, with one log per past start: each event written as the CLI
    writes it, raw bytes as they are (what else reaches the log: a traceback)."""
    picker = PickerProcess(tmp_path / "a", ["127.0.0.1:1"], log_picks=True)
    for n, events in enumerate(runs, 1):
        picker.logs.append(tmp_path / f"picker.{n}.log")
        lines = (event if isinstance(event, bytes) else orjson.dumps(event) for event in events)
        picker.logs[-1].write_bytes(b"\n".join(lines) + b"\n")
    return picker


def pick(request_id: str, at: float) -> dict[str, object]:
    return {"ts": at, "level": "debug", "logger": PICK_LOGGER, "msg": f"pick {request_id}: single pod e0"}


def test_failures_are_told_apart_by_whether_the_killed_replica_was_serving_them(tmp_path: Path) -> None:
    before: list[dict[str, object] | bytes] = [
        pick("r1", SIGNAL - 0.5),
        pick("r2", SIGNAL - 0.4),
        pick("r3", SIGNAL - 0.9),
    ]
    after_restart: list[dict[str, object] | bytes] = [
        {
            "ts": SIGNAL + 4.0,
            "level": "info",
            "logger": "router.adapters.extproc",
            "msg": "ext_proc listening",
        },
        pick("r9", SIGNAL + 5.0),
    ]
    a = picker_with_log(tmp_path, [*before, b"Traceback (most recent call last):", b"42"], after_restart)
    answers = [
        Answer("r1", SIGNAL - 0.6, SIGNAL + 1.0, False, 0, "ClientPayloadError"),  # A was serving it
        Answer("r2", SIGNAL - 0.5, SIGNAL + 0.2, True, 200, ""),  # A was serving it, it finished
        Answer("r3", SIGNAL - 1.0, SIGNAL - 0.1, True, 200, ""),  # over before the signal
        Answer("r4", SIGNAL + 0.3, SIGNAL + 0.4, False, 500, ""),  # sent after the signal: not A's
        Answer("r5", SIGNAL + 0.5, SIGNAL + 1.5, True, 200, ""),  # routed by the survivor
        Answer("r9", SIGNAL + 4.9, SIGNAL + 6.0, True, 200, ""),
    ]
    envoy = EnvoyWatch("http://127.0.0.1:1")
    envoy.samples = [
        (SIGNAL - 0.05, {a.host: "healthy"}),
        (SIGNAL + 0.05, {a.host: "/failed_outlier_check"}),
        (SIGNAL + 4.5, {a.host: "healthy"}),
    ]
    timeline = Timeline(signalled=SIGNAL, exited=SIGNAL + 0.01, exit_code=-9, restarted=SIGNAL + 3.0)
    row = summarize("full-duplex", "SIGKILL", answers, a, envoy, timeline, {"A": 0.0, "B": 0.0})

    assert (row.requests, row.failed, row.failed_in_flight_on_killed, row.in_flight_on_killed) == (6, 2, 1, 2)
    assert [f["in_flight_on_killed"] for f in row.failures] == [True, False]
    assert round(row.survivor_all_traffic_s, 3) == 0.3  # r4, the last request lost after the signal
    assert (round(row.envoy_out_s, 3), row.envoy_out_by) == (0.05, "failed_outlier_check")
    assert round(row.restart_to_listening_s, 3) == 1.0
    assert round(row.restart_to_healthy_s, 3) == 1.5
    assert round(row.restart_to_serving_s, 3) == 2.0
    assert row.broken == ["1 failed that A was not serving"]
    assert "| full-duplex | SIGKILL | 6 | 2 / 1 | 2 |" in table([row], Scenario())


def test_a_sigterm_breaks_the_contract_with_any_failure_a_bad_exit_or_reservations_left(
    tmp_path: Path,
) -> None:
    a = picker_with_log(
        tmp_path, [pick("r1", SIGNAL - 0.2), pick("r2", SIGNAL + 0.8)], [pick("r3", SIGNAL + 8)]
    )
    answers = [
        Answer("r1", SIGNAL - 0.3, SIGNAL + 0.5, False, 0, "ClientPayloadError"),
        Answer("r2", SIGNAL + 0.7, SIGNAL + 1.5, True, 200, ""),  # routed by A in its lame duck
    ]
    timeline = Timeline(signalled=SIGNAL, exited=SIGNAL + 5.2, exit_code=1, restarted=SIGNAL + 7.0)
    row = summarize("buffered", "SIGTERM", answers, a, EnvoyWatch(""), timeline, {"A": 0.0, "B": 2.0})

    assert round(row.survivor_all_traffic_s, 3) == 0.8  # A's last pick
    assert row.envoy_out_by == ""  # no sample: not seen
    assert row.broken == [
        "1 failed with SIGTERM",
        "A exited with 1 after SIGTERM",
        "reservations left: {'A': 0.0, 'B': 2.0}",
    ]
