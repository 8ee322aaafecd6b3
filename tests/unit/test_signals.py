"""runtime/signals.py (the one module that installs stop handlers) and runtime/agree.py (the one stop
agreement), in this process: no ranks, no group."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch

from hpcgpu.runtime import signals as stop_signals_module
from hpcgpu.runtime.agree import StopAgreement
from hpcgpu.runtime.signals import StopSignals, catch_early_signals
from hpcgpu.stopwindow import SAME_STOP_S, StopWindow


def test_the_early_handlers_load_nothing_slow() -> None:
    """`hpcgpu run` installs them first: a USR2 while a heavy import runs would kill the rank."""
    code = "import sys, hpcgpu.runtime.signals; print(sorted(m for m in sys.modules if m.startswith('hpcgpu')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(loaded) == ["hpcgpu", "hpcgpu.contract", "hpcgpu.runtime", "hpcgpu.runtime.signals",
                            "hpcgpu.stopwindow"], loaded


def test_a_signal_during_start_up_counts_and_each_signal_is_handed_over_once() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)}
    stop_signals_module._early.clear()
    try:
        catch_early_signals()
        os.kill(os.getpid(), signal.SIGUSR2)  # before the spec is read: remembered, not fatal
        signals, handed, now = StopSignals(), [], [100.0]
        signals._window = StopWindow(clock=lambda: now[0])
        signals.install([signal.SIGUSR1, signal.SIGUSR2], handed.append)
        assert (signals.signum, signals.early, signals.received) == (signal.SIGUSR2, True, [])
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL  # not a stop signal of this spec: given back
        for signum in (signal.SIGUSR1, signal.SIGUSR1, signal.SIGUSR2):  # `scancel --full`: twice
            os.kill(os.getpid(), signum)
        # one stop: a signal of another kind right after it is a relayed copy (`timeout`, srun)
        assert handed == signals.received == [signal.SIGUSR1]
        now[0] += SAME_STOP_S
        for signum in (signal.SIGUSR1, signal.SIGUSR2):  # later: USR1 was handed over already, USR2 is new
            os.kill(os.getpid(), signum)
        assert handed == signals.received == [signal.SIGUSR1, signal.SIGUSR2]
        assert signals.signum == signal.SIGUSR2  # the first one tells why
        signals.restore()
        assert signals.on_signal is None
    finally:
        stop_signals_module._early.clear()
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_the_train_loop_agrees_one_step_late_with_the_stop_first() -> None:
    signals = StopSignals()
    agreement = StopAgreement(signals, torch.device("cpu"))
    assert agreement.at_step([True, False], 1).step is None  # nothing posted before the first step
    signals.signum = signal.SIGUSR1
    assert agreement.now()  # at once, where a loop asks ctx.should_stop()
    agreed = agreement.at_step([False, False], 2)
    assert (agreed.flags, agreed.step) == ([False, True, False], 1)  # step 1's post: the signal not yet
    assert agreement.at_step([False, False], 3).flags[0]  # step 2's post: every rank stops after step 3
    agreement.settle()
