"""Tasks a job runs: train and infer (built in), command (the user's program), callable (the user's function)."""
from __future__ import annotations

import errno
import hashlib
import importlib
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from hpcgpu.contract import (EXIT_STOPPED, Failure, RunPaths, attempt_id, flight_recorder_note, node_name, record_failure,
                             stalled_peer)
from hpcgpu.errors import HpcgpuError
from hpcgpu.runtime.env import DistEnv
from hpcgpu.runtime.requeue import TornDown, peer_failure, requeue_after_crash
from hpcgpu.spec import Spec

MAX_ERROR_CHARS = 400  # an in-job error is one short line: a library's 12 KB message is cut


@dataclass(frozen=True)
class Task:
    """A task a spec can name: its module (imported only when the task runs: train and infer load torch
    and transformers, and task: command's wrapper stays light beside the user's program), its entry,
    and whether hub ids come from the local cache only (checked at submit: a missing one fails at once
    instead of retrying the network for a minute; set HF_HUB_OFFLINE=0 in env: to let the job download;
    not for command/callable, whose own code decides)."""

    module: str
    entry: str
    offline_hub: bool = False
    wants_spec_path: bool = False  # the command task hands the spec's path to the user's program


# A new task: its module under runtime/tasks/, one line here, its name in spec/schema.py's `Spec.task`
TASKS: dict[str, Task] = {
    "train": Task("hpcgpu.runtime.tasks.train", "run_train", offline_hub=True),
    "infer": Task("hpcgpu.runtime.tasks.infer", "run_infer", offline_hub=True),
    "command": Task("hpcgpu.runtime.tasks.command", "run_command", wants_spec_path=True),
    "callable": Task("hpcgpu.runtime.tasks.callable", "run_callable"),
}


def _dispatch(spec: Spec, spec_path: Path, paths: RunPaths) -> int:
    task = TASKS.get(spec.task)
    if task is None:
        raise HpcgpuError(f"task: {spec.task} is not a task of this version; use {', '.join(TASKS)}")
    if task.offline_hub:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers loads: huggingface_hub reads it at import
    entry = getattr(importlib.import_module(task.module), task.entry)
    return entry(spec, spec_path, paths) if task.wants_spec_path else entry(spec, paths)


def run_task(spec: Spec, spec_path: Path, paths: RunPaths) -> int:
    """Run the spec's task in this process (one rank) and return its exit code.

    A rank that fails records why (failures/ in the run dir: rank, node, exit code, last error line)
    for `hpcgpu status`. A crash is requeued only when the spec asks for retries (slurm.max_retries),
    at most that often; a stop after a preemption signal is handled by the task itself and never
    counts as a crash; a rank stopped because another rank failed is neither.
    """
    env = DistEnv.from_environ()
    run_dir = paths.run_dir
    try:
        code = _dispatch(spec, spec_path, paths)
    except TornDown as exc:
        print(f"hpcgpu: rank {env.rank} was stopped because {exc.why}: a crash, not a preemption", flush=True)
        requeue_after_crash(env, spec, run_dir)
        return exc.code
    except HpcgpuError as exc:
        message = short(str(exc))
        record(env, run_dir, exc.exit_code, message)
        if first_to_report(run_dir, message, env.rank):  # the same mistake in every rank: one line per job
            print(f"hpcgpu: error: {message}", file=sys.stderr, flush=True)
        return exc.exit_code  # the user's input is wrong: a retry would fail the same way
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code not in (0, EXIT_STOPPED):
            record(env, run_dir, code, "")
            requeue_after_crash(env, spec, run_dir)
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        crashed(env, spec, run_dir, exc)
        raise
    if code not in (0, EXIT_STOPPED):
        record(env, run_dir, code, "")
        requeue_after_crash(env, spec, run_dir)
    return code


def crashed(env: DistEnv, spec: Spec, run_dir: Path, exc: BaseException) -> None:
    """Record the crash (or name the peer whose death broke a collective) and requeue if asked."""
    first = failed_first(env, run_dir)
    if first is None:
        # a peer that stopped making progress outside a collective (its watchdog's progress file) for
        # half the time this rank waited for it is the failure; this rank's timeout follows from it
        first = stalled_peer(run_dir, attempt_id(), env.rank, spec.distributed.nccl.timeout_s / 2)
        if first is not None:
            first = replace(first, message=first.message + flight_recorder_note(run_dir))
            record_failure(run_dir, first)
    if first is None:
        record(env, run_dir, 1, (disk_full(exc, run_dir) or short(f"{type(exc).__name__}: {exc}"))
               + flight_recorder_note(run_dir))
    else:  # a collective broke because a peer died: that peer's failure is the job's
        print(f"hpcgpu: rank {env.rank} failed after {first.describe()}", file=sys.stderr, flush=True)
    requeue_after_crash(env, spec, run_dir)


FULL_BELOW = 1 << 20  # bytes free under which torch's "unexpected pos" (a short write) means a full disk


def disk_full(exc: BaseException, run_dir: Path) -> str | None:
    """'no space left on device writing PATH (N MB free there)' when the error (or one it came from) is
    ENOSPC, or torch's short-write error on a filesystem that is full; None otherwise."""
    path: Path | None = None
    seen: BaseException | None = exc
    while seen is not None and path is None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            path = Path(seen.filename) if seen.filename else run_dir
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    short_write = path is None and "No space left on device" not in text and "unexpected pos" in text
    if path is None and ("No space left on device" in text or short_write):
        path = run_dir
    if path is None:
        return None
    there = next((p for p in (path, *path.parents) if p.exists()), run_dir)
    try:
        free = shutil.disk_usage(there).free
    except OSError:
        return None
    if short_write and free >= FULL_BELOW:
        return None  # a short write on a disk with room: not this
    return f"no space left on device writing {path} ({free / 1e6:.1f} MB free there)"


def short(text: str) -> str:
    line = next((x.strip() for x in text.splitlines() if x.strip()), "")
    return line if len(line) <= MAX_ERROR_CHARS else line[:MAX_ERROR_CHARS - 1] + "…"


PEER_WAIT_S = 1.0  # a peer killed outright is recorded by its launcher a moment after it died


def failed_first(env: DistEnv, run_dir: Path) -> Failure | None:
    """Another rank's failure of this attempt, if one is (or within PEER_WAIT_S gets) recorded."""
    deadline = time.monotonic() + PEER_WAIT_S
    while True:
        failure = peer_failure(env, run_dir)
        if failure is not None or time.monotonic() >= deadline:
            return failure
        time.sleep(0.1)


def record(env: DistEnv, run_dir: Path, code: int, message: str) -> None:
    node = node_name()
    record_failure(run_dir, Failure(attempt_id(), env.rank, node, code, message, time.time()))


REPORT_DEFER_S = 0.5  # rank 0 (whose output the console shows) gets the first go


def first_to_report(run_dir: Path, message: str, rank: int) -> bool:
    """True in the one rank (of this attempt) that reports this error; the others stay quiet."""
    if rank != 0:
        time.sleep(REPORT_DEFER_S)
    digest = hashlib.sha1(message.encode()).hexdigest()[:12]
    path = RunPaths(run_dir).failures / f"{attempt_id()}.reported-{digest}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return True  # cannot tell: better twice than never
    return True
