"""The progress watchdog's rules (runtime/watchdog.py): when a rank counts as stalled, which peer a
timed-out rank names, and where a stack is. The jobs that stall are in test_stall.py."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from hpcgpu.runtime import watchdog
from hpcgpu.contract import stalled_peer
from hpcgpu.runtime.watchdog import Watchdog, where


def test_an_explicit_limit_applies_at_once_and_a_derived_one_after_the_pace_is_known(tmp_path: Path) -> None:
    dog = Watchdog(tmp_path, "1.0", 0, "n1", timeout_s=20)
    assert dog.limit() == 60  # before the first beat: start-up, loading, compiling
    dog.beat()
    assert dog.limit() == 20
    auto = Watchdog(tmp_path, "1.0", 0, "n1", timeout_s=None)
    auto.beat()
    auto.beat()
    assert auto.limit() == float("inf")  # a user's loop that beats once an hour is never cut early
    auto.intervals.extend([30.0, 30.0, 30.0])
    auto.beat()
    assert auto.limit() == 20 * 30.0
    auto.intervals.clear()
    auto.intervals.extend([0.1] * 5)
    assert auto.limit() == watchdog.FLOOR_S


def test_a_checkpoint_gets_more_time_and_counts_as_progress(tmp_path: Path) -> None:
    dog = Watchdog(tmp_path, "1.0", 0, "n1", timeout_s=10)
    dog.beat()
    watchdog._current = dog
    try:
        with watchdog.slow():
            assert dog.limit() == 10 * watchdog.SLOW_FACTOR
            beats = dog.beats
        assert dog.limit() == 10 and dog.beats == beats + 1
    finally:
        watchdog._current = None


def write_progress(folder: Path, rank: int, idle: float, in_collective: bool, written_ago: float = 0.0) -> None:
    now = time.time()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"7.0.progress-{rank}.json").write_text(json.dumps({
        "rank": rank, "node": f"n{rank}", "beats": 5, "last_progress": now - idle, "written": now - written_ago,
        "where": f"step at train.py:{rank}", "in_collective": in_collective}))


def test_a_timed_out_rank_names_the_live_peer_stalled_outside_a_collective(tmp_path: Path) -> None:
    folder = tmp_path / "failures"
    write_progress(folder, 0, 31, True)  # the one asking: itself
    write_progress(folder, 1, 31, True)  # waiting in a collective too: not the cause
    write_progress(folder, 2, 2, False)  # busy, making progress
    write_progress(folder, 3, 90, False, written_ago=60)  # its progress file stopped: gone, not stalled
    assert stalled_peer(tmp_path, "7.0", 0, 15) is None
    write_progress(folder, 4, 40, False)
    write_progress(folder, 5, 20, False)
    failure = stalled_peer(tmp_path, "7.0", 0, 15)
    assert failure is not None and failure.rank == 4 and failure.node == "n4"
    assert failure.message.startswith("made no progress for 40 s (in step at train.py:4)")
    assert "rank 0 timed out waiting" in failure.message
    assert stalled_peer(tmp_path, "8.0", 0, 15) is None  # another attempt's files say nothing


def test_where_is_the_innermost_frame_of_the_users_code() -> None:
    def users_step() -> tuple[str, bool]:
        return where(sys._getframe())

    spot, in_collective = users_step()
    assert spot.startswith("users_step at test_watchdog.py:") and not in_collective


def test_a_failure_names_where_the_nccl_flight_recorder_dumped(tmp_path: Path) -> None:
    from hpcgpu.contract import RunPaths
    from hpcgpu.runtime.dist import flight_recorder_env
    from hpcgpu.runtime.tasks import flight_recorder_note

    traces = RunPaths(tmp_path).nccl_traces
    env = flight_recorder_env(traces)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(traces / "rank_")  # torch appends the rank
    assert flight_recorder_note(tmp_path) == ""  # a CPU job: no recorder, no wait
    traces.mkdir()
    (traces / "rank_1").write_bytes(b"pickled entries")
    assert flight_recorder_note(tmp_path) == f"; NCCL flight recorder dumps in {traces}"
