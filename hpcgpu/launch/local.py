"""The local executor: N ranks on this machine with the environment contract SLURM gives.

Each rank gets the SLURM_* variables srun would set (plus HPCGPU_LAUNCHER=local), so the entrypoint
runs the same code path as on the cluster. Rank 0 streams to the console; every rank logs to
<run dir>/logs/rank-N.log. One rank failing stops the others within a few seconds.

No rank outlives its launcher and no run dir gets two live jobs: the executor locks the run dir
(launch/runlock.py) and hands the lock's open file to every rank, so the lock is held while any
rank lives and is released by the kernel when the last one is gone; each rank asks the kernel to
SIGKILL it when the launcher dies (HPCGPU_PARENT_PID, hpcgpu/procs.py), so a launcher killed with
SIGKILL takes its ranks along. Orderly stops (Ctrl-C, SIGTERM, a terminal hang-up, `hpcgpu cancel`)
go through the launcher: the ranks checkpoint and stop; the copies of one stop signal that arrive
together are one stop (hpcgpu/stopwindow.py), a second stop after them kills the ranks.

The job around the ranks (busy GPUs, which run dir, the registry record, how it ended) is
local_submit.py's; this module only starts the ranks and waits for them.
"""
from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Callable

from hpcgpu.contract import (ENV_JOB_START, ENV_LAUNCHER, ENV_LOCAL_JOB, ENV_PENDING_SIGNAL, ENV_RUN_DIR, EXIT_KILLED,
                             EXIT_STOPPED, Failure, RunPaths, attempt_id, flight_recorder_note, in_collective,
                             is_finished, read_failures, record_failure, signal_hint, stalled_peer, write_finished)
from hpcgpu.errors import HpcgpuError
from hpcgpu.gpu.source import default_source
from hpcgpu.launch import runlock
from hpcgpu.launch.container import rank_argv
from hpcgpu.procs import PARENT_PID_VAR
from hpcgpu.spec import Spec
from hpcgpu.spec.derive import signal_name
from hpcgpu.stopwindow import SAME_STOP_S, StopWindow

STOP_GRACE_S = 5.0  # after one rank fails, the others get this long to exit before SIGKILL
PREEMPT_GRACE_S = 120.0  # after Ctrl-C, ranks get this long to checkpoint (a second Ctrl-C kills)
# kills the ranks at once, no checkpoint: `hpcgpu cancel --now`, or Ctrl-\ (quit, by its convention)
KILL_NOW_SIGNAL = signal.SIGQUIT


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_gpus(spec: Spec, environ: dict[str, str] | None = None) -> list[str]:
    """GPU ids the local ranks may use: resources.devices, else CUDA_VISIBLE_DEVICES, else all found
    (through NVML, or the recording HPCGPU_NVML_RECORDED names)."""
    env = os.environ if environ is None else environ
    if spec.resources.devices:
        return spec.resources.devices.split(",")
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        return [d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    source = default_source()
    return [str(r.index) for r in source.read(processes=False)] if source.available() else []


def slurm_job_number(job_id: str) -> str:
    """local-3 -> 3 (a job id that is no number gets a stable one from its digits' hash)."""
    number = job_id.removeprefix("local-")
    return number if number.isdigit() else str(int(hashlib.sha1(job_id.encode()).hexdigest()[:6], 16))


def rank_environ(spec: Spec, rank: int, world: int, job_id: str, port: int, gpus: list[str],
                 run_dir: Path, restart_count: int = 0) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        ENV_LAUNCHER: "local",
        ENV_RUN_DIR: str(run_dir),
        # a number, as SLURM's are (Lightning derives its port from the last digits); the local-N
        # name users see travels beside it
        "SLURM_JOB_ID": slurm_job_number(job_id),
        ENV_LOCAL_JOB: job_id,
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": str(world),
        "SLURM_NTASKS_PER_NODE": str(world),
        "SLURM_TASKS_PER_NODE": str(world),
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_CPUS_PER_TASK": str(spec.resources.cpus_per_gpu * spec.gpus_per_task),
        "SLURM_RESTART_COUNT": str(restart_count),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHONUNBUFFERED": "1",
        ENV_JOB_START: str(int(time.time())),
    })
    for key in ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID",
                "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", ENV_PENDING_SIGNAL):
        env.pop(key, None)  # a local run inside an allocation must not look like its parent job
    if gpus:
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # device ids mean what nvidia-smi/NVML show
        # every rank sees the job's GPUs, as under SLURM's --gres; a model copy over several GPUs
        # takes its own group of them by its local id (runtime/env.py bind_gpu_group)
        chosen = gpus[:spec.resources.gpus]
        env.update({"CUDA_VISIBLE_DEVICES": ",".join(chosen), "SLURM_JOB_GPUS": ",".join(chosen),
                    "SLURM_GPUS_ON_NODE": str(len(chosen))})
    env.update(spec.env)
    return env


@dataclass
class Rank:
    index: int
    proc: subprocess.Popen
    log: IO[str]
    run_dir: Path | None = None
    attempt: str = ""
    stall_s: float = 0.0  # a peer idle this long outside a collective is what this rank waited for (timeout/2)


def _pump(src: IO[str], sinks: list[IO[str]]) -> None:
    sinks = list(sinks)
    for line in iter(src.readline, ""):
        for sink in list(sinks):
            try:
                sink.write(line)
                sink.flush()
            except (OSError, ValueError):  # a closed console (terminal gone): the log keeps going
                sinks.remove(sink)


def check_fits_here(spec: Spec) -> list[str]:
    """The GPUs the local executor gives the job here; HpcgpuError (one line) where it cannot run it
    here at all. Submit calls it before it writes anything (no run dir, no registry row)."""
    if spec.resources.nodes > 1:
        raise HpcgpuError("the local executor runs on one node: use --nodes 1 (or submit to SLURM)")
    gpus = local_gpus(spec)
    if gpus and len(gpus) < spec.resources.gpus:
        raise HpcgpuError(f"--gpus {spec.resources.gpus}: only {len(gpus)} GPU(s) here ({','.join(gpus)}); "
                          "ask for fewer")
    return gpus


def start_ranks(spec: Spec, spec_path: Path, run_dir: Path, job_id: str, echo: IO[str] | None,
                restart_count: int = 0, lock: runlock.RunLock | None = None) -> list[Rank]:
    """Start the ranks from this thread (it must outlive them: the kernel's parent-death signal
    follows the thread that forked). Every rank holds the run dir lock (`lock`, else one taken
    here) for as long as it lives; RunDirLocked if another live job holds it."""
    if lock is None:
        with runlock.hold(run_dir, job_id) as own:
            return start_ranks(spec, spec_path, run_dir, job_id, echo, restart_count, own)
    gpus = check_fits_here(spec)
    world = spec.tasks_per_node
    port = free_port()
    paths = RunPaths(run_dir)
    paths.logs.mkdir(parents=True, exist_ok=True)
    ranks: list[Rank] = []
    for i in range(world):
        log = open(paths.rank_log(i), "a", buffering=1)
        pipe = i == 0 and echo is not None
        env = rank_environ(spec, i, world, job_id, port, gpus, run_dir, restart_count)
        env[PARENT_PID_VAR] = str(os.getpid())  # the rank dies with us (`hpcgpu run` reads it first)
        proc = subprocess.Popen(
            rank_argv(spec, str(spec_path), run_dir, gpus=bool(gpus)),  # through the container, if any
            env=env, stdout=subprocess.PIPE if pipe else log, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,  # Ctrl-C reaches the executor only; it decides what ranks get
            pass_fds=() if lock.fd is None else (lock.fd,),  # the run dir stays locked while a rank lives
        )
        if pipe:
            threading.Thread(target=_pump, args=(proc.stdout, [log, echo]), daemon=True).start()
        ranks.append(Rank(i, proc, log, run_dir, attempt_id(env), spec.distributed.nccl.timeout_s / 2))
    return ranks


def _signal_all(ranks: list[Rank], signum: int) -> None:
    for r in ranks:
        if r.proc.poll() is None:
            try:
                os.killpg(r.proc.pid, signum)
            except ProcessLookupError:
                pass


def record_end(rank: Rank, code: int) -> None:
    """Before the others are stopped: a rank that died without saying why (SIGKILL, the OOM killer)
    still leaves a failure record, so the ranks stopped next know theirs is no preemption."""
    if rank.run_dir is None or code == EXIT_STOPPED:
        return
    shell = _shell_code(code)
    if rank.stall_s and (shell == 128 + signal.SIGABRT or in_collective(rank.run_dir, rank.attempt, rank.index)) \
            and all(f.rank != rank.index for f in read_failures(rank.run_dir, rank.attempt)):
        # NCCL's watchdog ends a rank whose collective timed out (SIGABRT) before the rank can say whom it
        # waited for: a live peer stalled outside a collective is the failure, as the rank's own
        # crashed() would have said (runtime/tasks), timed at that peer's last progress
        peer = stalled_peer(rank.run_dir, rank.attempt, rank.index, rank.stall_s)
        if peer is not None:
            record_failure(rank.run_dir, replace(peer, message=peer.message + flight_recorder_note(rank.run_dir)))
    record_failure(rank.run_dir, Failure(rank.attempt, rank.index, socket.gethostname(), shell, signal_hint(shell),
                                         time.time()))  # kept: a record the rank wrote itself wins


def earliest_recorded(failed: list[tuple[Rank, int]]) -> tuple[Rank, int]:
    """Of the failed ranks, the one whose failure record is oldest, with the exit code it recorded: its
    output holds the error line (the others deferred to it), so its log's end is the one the console is
    shown; and a rank stopped while it was reporting its own error (SIGTERM, 143) failed with that error's code."""
    run_dir, attempt = failed[0][0].run_dir, failed[0][0].attempt
    if run_dir is None or len(failed) == 1:
        return failed[0]
    records = {f.rank: f for f in read_failures(run_dir, attempt)}
    rank, code = min(failed, key=lambda rc: (records[rc[0].index].time if rc[0].index in records else float("inf"),
                                             rc[0].index))
    recorded = records.get(rank.index)
    return rank, recorded.exit_code if recorded is not None and recorded.exit_code is not None else code


def exited_text(failed: list[tuple[Rank, int]]) -> str:
    """'rank 1 exited with code 2', or 'ranks 0, 1 exited with codes 2, 2' for ranks found failed together."""
    if len(failed) == 1:
        return f"rank {failed[0][0].index} exited with code {failed[0][1]}"
    return (f"ranks {', '.join(str(r.index) for r, _ in failed)} exited with codes "
            f"{', '.join(str(c) for _, c in failed)}")


def wait_ranks(ranks: list[Rank], spec: Spec, say: Callable[[str], None]) -> int:
    """Wait for all ranks; a failing rank stops the rest; Ctrl-C asks all to checkpoint and stop, a
    second one (after the copies of the first, StopWindow) or KILL_NOW_SIGNAL kills them."""
    preempt_sig = getattr(signal, f"SIG{signal_name(spec)}", signal.SIGTERM)
    interrupted: list[float] = []
    window = StopWindow()

    def on_interrupt(signum: int, frame: object) -> None:
        now = signum == KILL_NOW_SIGNAL
        if not now and not window.is_new():
            return  # a copy of the stop under way (the shell, `timeout`, srun relay one signal several times)
        if interrupted or now:
            _say_safely(say, "killing all ranks now, without a checkpoint" if now else "second interrupt: killing all ranks")
            _signal_all(ranks, signal.SIGKILL)
            interrupted.extend([time.monotonic()] * (1 if interrupted else 2))  # two stops: the kill's
            return
        what = "hang-up" if signum == getattr(signal, "SIGHUP", None) else "interrupt"
        _say_safely(say, f"{what}: asking all ranks to checkpoint and stop "
                         f"(interrupt again, {SAME_STOP_S:g} s or more from now, to kill)")
        _signal_all(ranks, preempt_sig)
        interrupted.append(time.monotonic())

    previous = {s: signal.signal(s, on_interrupt) for s in [*stop_signals(), KILL_NOW_SIGNAL]}
    try:
        first_failure = watch_ranks(ranks, interrupted, say)
    except BaseException:
        _signal_all(ranks, signal.SIGKILL)  # the launcher's own error leaves no rank behind
        raise
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for r in ranks:
            r.proc.wait()
            try:
                r.log.close()
            except OSError:  # a full disk: the last lines are lost, the job's end is not
                pass
    return ranks_exit_code(ranks, first_failure, killed=len(interrupted) >= 2, say=say)


def stop_signals() -> list[signal.Signals]:
    """The signals that stop the ranks at a checkpoint. A closed terminal (SIGHUP) is one: dying of it
    would SIGKILL them (they die with us); under nohup (SIGHUP ignored) it stays ignored."""
    stops = [signal.SIGINT, signal.SIGTERM]
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        stops.append(signal.SIGHUP)
    return stops


def watch_ranks(ranks: list[Rank], interrupted: list[float], say: Callable[[str], None]) -> tuple[int, int] | None:
    """Poll the ranks until all have ended: the first to fail stops the others (SIGTERM, then SIGKILL
    after a grace), as does an interrupt or a rank stopped at a checkpoint. Returns (rank, code) of
    the first failure seen, or None."""
    first_failure: tuple[int, int] | None = None
    deadline: float | None = None
    while any(r.proc.poll() is None for r in ranks):
        # every rank found failed in one look is named: which of them failed first is for their
        # failure records' times to say, not for the order they are looked at in. A rank that
        # stopped at a checkpoint (75) did not fail: its peers are stopping too, within a grace.
        failed = [(r, r.proc.returncode) for r in ranks if r.proc.poll() not in (None, 0, EXIT_STOPPED)]
        if failed and first_failure is None and len(interrupted) < 2:
            for r, code in failed:
                record_end(r, code)
            first = earliest_recorded(failed)
            first_failure = (first[0].index, first[1])
            say(f"{exited_text(failed)}; stopping the other ranks")
            _signal_all(ranks, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
        stopped = any(r.proc.returncode == EXIT_STOPPED for r in ranks)
        if deadline is None and (interrupted or stopped):
            deadline = (interrupted[0] if interrupted else time.monotonic()) + PREEMPT_GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            _signal_all(ranks, signal.SIGKILL)
        time.sleep(0.1)
    return first_failure


def ranks_exit_code(ranks: list[Rank], first_failure: tuple[int, int] | None, killed: bool,
                    say: Callable[[str], None]) -> int:
    """The job's exit code: the first failing rank's (its log's end shown when it is not rank 0, whose
    output is on the console already); EXIT_KILLED for the user's second interrupt; else 0."""
    if first_failure is None and killed:
        return EXIT_KILLED  # the user's kill, not the job's failure
    if first_failure is None:
        failed = [r for r in ranks if r.proc.returncode not in (0, None)]
        first_failure = (failed[0].index, failed[0].proc.returncode) if failed else None
    if first_failure is None:
        return 0
    failed = [(r, r.proc.returncode) for r in ranks if r.proc.returncode not in (0, None, EXIT_STOPPED)]
    if len(failed) > 1:  # which failed first is for their records to say, not the order they were seen in
        first = earliest_recorded(failed)
        first_failure = (first[0].index, first[1])
    index, code = first_failure
    if index != 0 and code != EXIT_STOPPED:  # rank 0 is on the console already; show where the others failed
        end, error = tail_and_error(ranks[index].log.name)
        say(f"rank {index} exited with code {_shell_code(code)}; the end of its log:\n" + end)
        if error:  # the job's one error line (that rank reported it for all), as rank 0's would read
            say(error.removeprefix("hpcgpu: "))
    return _shell_code(code)


def _say_safely(say: Callable[[str], None], message: str) -> None:
    try:
        say(message)
    except (OSError, ValueError):  # the console is gone (hang-up): the stop itself matters
        pass


def tail_and_error(path: str, lines: int = 15) -> tuple[str, str]:
    """A log's last lines, indented, but for its `hpcgpu: error:` line, which comes back on its own."""
    try:
        text = Path(path).read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "(no log)", ""
    error = next((line for line in reversed(text) if line.startswith("hpcgpu: error:")), "")
    return "\n".join("  | " + line for line in text if line != error) or "  | (nothing else)", error


def _shell_code(code: int) -> int:
    return 128 - code if code < 0 else code


def run_local(spec: Spec, spec_path: Path, run_dir: Path, job_id: str, echo: IO[str] | None = None,
              say: Callable[[str], None] = lambda m: print(f"hpcgpu: {m}", file=sys.stderr)) -> int:
    """Run the job's ranks here and wait for them. The run dir is locked (RunDirLocked, one line,
    if another live job holds it) from before the first rank starts until all have ended."""
    with runlock.hold(run_dir, job_id) as lock:
        if lock.unsupported:
            say(f"warning: {lock.unsupported}")
        ranks = start_ranks(spec, spec_path, run_dir, job_id, echo if echo is not None else sys.stdout,
                            lock=lock)
        code = wait_ranks(ranks, spec, say)
        if code == 0 and not is_finished(run_dir):
            # every rank of a command or callable job ended well: the run is done, like a finished
            # training run, so the same spec again starts afresh instead of re-running in this dir
            write_finished(run_dir)
    return code
