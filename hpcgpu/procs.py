"""Processes that die with their parent: no rank (and no user program) outlives its launcher.

On Linux a process can ask the kernel for a signal when its parent dies (prctl PR_SET_PDEATHSIG).
The local executor sets HPCGPU_PARENT_PID for each rank; the rank calls `die_with_parent()` first
thing, so a SIGKILLed launcher takes its ranks with it instead of leaving them training as
orphans. The signal is SIGKILL: once the launcher is gone nobody coordinates a checkpoint (orderly
stops, Ctrl-C and `hpcgpu cancel`, go through the launcher while it lives), and a rank that merely
caught a signal could hang in a collective. The kernel sends it when the thread that forked the
process exits: launchers start their children from a thread that outlives them (the main thread).

`child_dies_with_me(argv)` gives the same to a program this process starts (the command task's
user program, a grandchild of the launcher): it runs through a tiny shim that sets the signal and
then execs the program, so the program keeps the pid, exit code and signals it would have had.
A shim, not `preexec_fn`, because preexec_fn is unsafe in a process with threads.

Elsewhere (macOS, ...) all of this is a no-op. Standard library only; no torch.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
from typing import Mapping, MutableMapping, Sequence

from hpcgpu.contract import ENV_PARENT_PID

PARENT_PID_VAR = ENV_PARENT_PID  # set by a launcher for its children: "die when I die"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# Run as `python -I -S -c SHIM <parent pid> <argv...>`: isolated (no PYTHON* variables, no site),
# so it starts in ~10 ms whatever the job's environment; the program gets that environment intact.
SHIM = """\
import ctypes, os, signal, sys
parent, argv = int(sys.argv[1]), sys.argv[2:]
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
except (OSError, AttributeError):
    pass
if os.getppid() != parent:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    os.execvp(argv[0], argv)
except OSError as exc:
    sys.stderr.write(f"hpcgpu: cannot run {argv[0]!r}: {exc.strerror}\\n")
    os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
"""


def supported() -> bool:
    return sys.platform.startswith("linux")


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `signum` to this process when its parent dies; False where it can't."""
    if not supported():
        return False
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    return prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def die_with_parent(environ: MutableMapping[str, str] | None = None) -> bool:
    """If a launcher set HPCGPU_PARENT_PID: die (SIGKILL) when it dies, and at once if it already
    has (it may have died before we asked). The variable is removed so that our own children do not
    take the launcher for their parent. No-op (False) when unset or unsupported."""
    env = os.environ if environ is None else environ
    value = env.pop(PARENT_PID_VAR, None)
    if not value:
        return False
    try:
        expected = int(value)
    except ValueError:
        return False
    if not set_parent_death_signal(signal.SIGKILL):
        return False
    if os.getppid() != expected:
        # re-parented already: the launcher died between starting us and our prctl
        try:
            sys.stderr.write(f"hpcgpu: the launcher (pid {expected}) is gone; this rank stops\n")
            sys.stderr.flush()
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    return True


def _check_program(program: str, environ: Mapping[str, str]) -> None:
    """Raise what Popen would raise for a program that is missing or not executable (the shim
    itself always starts, so these must be found before it)."""
    if os.sep in program:
        candidates = [program]
    else:
        path = environ.get("PATH", os.defpath)
        candidates = [os.path.join(d or os.curdir, program) for d in path.split(os.pathsep)]
    found = [c for c in candidates if os.path.isfile(c)]
    if any(os.access(c, os.X_OK) for c in found):
        return
    if found or (os.sep in program and os.path.isdir(program)):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)


def child_dies_with_me(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """argv to give Popen so that the program gets SIGKILL when this process dies (Linux; argv
    unchanged elsewhere). `environ` is the environment the program gets (its PATH finds the
    program). Raises FileNotFoundError / PermissionError like Popen for a missing or
    non-executable program. Call Popen from a thread that lives as long as the child."""
    argv = [str(a) for a in argv]
    if not argv or not supported() or not sys.executable:
        return argv
    _check_program(argv[0], os.environ if environ is None else environ)
    return [sys.executable, "-I", "-S", "-c", SHIM, str(os.getpid()), *argv]
