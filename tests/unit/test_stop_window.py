"""hpcgpu/stopwindow.py: the copies of one person's stop signal are one stop; a stop after the window is a new one."""
from __future__ import annotations

from hpcgpu.stopwindow import SAME_STOP_S, StopWindow


def test_copies_within_the_window_are_one_stop_and_a_later_one_is_new() -> None:
    now = [1000.0]
    window = StopWindow(clock=lambda: now[0])
    assert window.is_new()  # the first interrupt
    for step in (0.0, 0.01, SAME_STOP_S * 0.9):  # timeout's, the shell's, srun's copies
        now[0] = 1000.0 + step
        assert not window.is_new()
    now[0] = 1000.0 + SAME_STOP_S  # a person pressing again once the stop was announced
    assert window.is_new()
    now[0] += SAME_STOP_S / 2  # the copies of that second stop count from it, not from the first
    assert not window.is_new()


def test_the_window_is_a_couple_of_seconds() -> None:
    """Long enough for relayed copies (milliseconds apart), short enough that a second Ctrl-C a person
    means as 'kill now' is not lost."""
    assert 0.5 <= SAME_STOP_S <= 5
