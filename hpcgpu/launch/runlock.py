"""One live writer per run dir: an exclusive flock on <run dir>/.lock, held by the live job.

The local executor takes the lock before it starts the ranks and gives the same open file to every
rank (Popen pass_fds), so the lock is held while any process of the job lives, also after the
launcher itself was SIGKILLed, and the kernel releases it when the last of them is gone: no stale
lock to clean up, no pid guessing. A second job on a locked run dir is refused with one line.

The lock file keeps a JSON line about the holder (pid, host, job id, since), written after locking,
for that message only; whether a dir is in use is always the flock, never the file's content.
Within one process the lock is re-entrant (submit takes it before registering the job, the
executor takes it again around the ranks). Standard library only (fcntl: POSIX); no torch.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from hpcgpu.errors import HpcgpuError

LOCK_NAME = ".lock"  # <run dir>/.lock


def lock_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / LOCK_NAME


def holder(run_dir: str | os.PathLike) -> dict:
    """What the lock file says about the job that holds (or last held) the lock; {} if nothing."""
    try:
        data = json.loads(lock_path(run_dir).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe_holder(info: dict) -> str:
    """'job local-3, pid 1234 on node1, since 12:03:04' (or what is known of it)."""
    parts = []
    if info.get("job"):
        parts.append(f"job {info['job']}")
    pid, host = info.get("pid"), info.get("host")
    if pid:
        where = f" on {host}" if host else ""
        gone = isinstance(pid, int) and host == socket.gethostname() and not _pid_alive(pid)
        parts.append(f"launcher pid {pid}{where}" + (" (gone; its ranks still run)" if gone else ""))
    if info.get("since"):
        parts.append("since " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"]))))
    return ", ".join(parts)


class RunDirLocked(HpcgpuError):
    """A live job already writes this run dir. One line: the dir, the holder, what to do."""

    def __init__(self, run_dir: str | os.PathLike, info: dict | None = None):
        self.run_dir = Path(run_dir)
        self.info = holder(run_dir) if info is None else info
        who = describe_holder(self.info)
        job = self.info.get("job")
        stop = f"`hpcgpu cancel {job}`" if job else "stop it"
        super().__init__(f"{self.run_dir}: a live job still writes this run dir ({who or 'holder unknown'}); "
                         f"wait for it to end or {stop}, or add --new to start a fresh run dir")


@dataclass
class RunLock:
    """A held lock. `fd` is the open lock file (None where the filesystem has no flock): give it to
    every process of the job (pass_fds) so the lock lives as long as the last of them."""

    run_dir: Path
    fd: int | None
    depth: int = 1
    unsupported: str = ""  # why there is no lock (a filesystem without flock), for a warning

    def note(self, job_id: str) -> None:
        """Record the job id in the lock file (for the message another job gets)."""
        if self.fd is None:
            return
        info = {"pid": os.getpid(), "host": socket.gethostname(), "job": job_id, "since": time.time()}
        old = holder(self.run_dir)
        if old.get("pid") == os.getpid() and old.get("since"):
            info["since"] = old["since"]
        data = (json.dumps(info) + "\n").encode()
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, data, 0)
        except OSError:
            pass  # only the message loses its detail


_held: dict[str, RunLock] = {}  # this process's locks by resolved run dir (re-entrant)


def acquire(run_dir: str | os.PathLike, job_id: str = "") -> RunLock:
    """Lock `run_dir` for this job, without waiting: RunDirLocked if a live job holds it."""
    key = str(Path(run_dir).resolve())
    lock = _held.get(key)
    if lock is not None:
        lock.depth += 1
        if job_id:
            lock.note(job_id)
        return lock
    path = lock_path(key)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise HpcgpuError(f"{key}: cannot create the run dir lock {path.name}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirLocked(key) from None
    except OSError as exc:  # a filesystem without flock (e.g. Lustre mounted noflock): run unlocked
        os.close(fd)
        lock = RunLock(Path(key), None, unsupported=f"{key}: no run dir lock on this filesystem "
                                                     f"({exc.strerror}); nothing stops a second job on it")
        _held[key] = lock
        return lock
    lock = RunLock(Path(key), fd)
    _held[key] = lock
    lock.note(job_id)
    return lock


def release(lock: RunLock) -> None:
    """Drop this process's hold (the lock stays held while any process given the fd lives)."""
    lock.depth -= 1
    if lock.depth > 0:
        return
    _held.pop(str(lock.run_dir), None)
    if lock.fd is not None:
        os.close(lock.fd)  # the file stays: removing it would race with one being opened
        lock.fd = None


@contextlib.contextmanager
def hold(run_dir: str | os.PathLike, job_id: str = "") -> Iterator[RunLock]:
    lock = acquire(run_dir, job_id)
    try:
        yield lock
    finally:
        release(lock)


def is_locked(run_dir: str | os.PathLike) -> bool:
    """Does a live job (this process included) write this run dir? Never blocks, never creates."""
    if str(Path(run_dir).resolve()) in _held:
        return True
    try:
        fd = os.open(lock_path(run_dir), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # no lock file: no job of this version ever ran here
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops the probe's own shared lock
    return False
