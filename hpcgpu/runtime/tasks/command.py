"""`task: command`: the user's own program, one per rank, with the torchrun variables exported.

The run's lifecycle is every task's (runtime/run.py) without torch and without a Context: its start,
its stop signals (runtime/signals.py: here each one is also handed to the program where the launcher
does not signal it), and its one stop. The ranks do not agree among themselves: each program gets the
signal (from the launcher, or from its wrapper) and its framework decides; this wrapper's safe point is
the program's end (`wait_for_program`, which ends a program that outlives the stop allowance).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from hpcgpu.errors import HpcgpuError
from hpcgpu.contract import ENV_CHECKPOINT_DIR, ENV_PENDING_SIGNAL, ENV_RUN_DIR, ENV_SPEC, RunPaths
from hpcgpu.runtime.metrics import MetricsWriter
from hpcgpu.gpu.nvml import gpu_count
from hpcgpu.runtime.code import code_map
from hpcgpu.runtime.env import DistEnv
from hpcgpu.procs import child_dies_with_me
from hpcgpu.runtime.run import Run
from hpcgpu.runtime.stop import StopNote
from hpcgpu.spec import Spec
from hpcgpu.spec.derive import nccl_env, signal_lead_s, signal_name


def command_env(spec: Spec, spec_path: Path, paths: RunPaths, env: DistEnv) -> dict[str, str]:
    out = dict(os.environ)
    for key, value in nccl_env(spec).items():
        out.setdefault(key, value)
    out.update(env.torchrun_vars())
    has_gpus = ranks_have_gpus(out)
    if not has_gpus:
        # accelerate-based scripts (the HF Trainer, run_clm_no_trainer.py) would otherwise train one
        # model per rank on CPU, all writing the same output dir, without a word
        out.setdefault("ACCELERATE_USE_CPU", "true")
    for key, value in lightning_env(env, paths, has_gpus, spec.gpus_per_task).items():
        out.setdefault(key, value)
    out.update(spec.env)
    threads = str(thread_cap(out, spec, env))
    for name in THREAD_VARS:  # unless the user set them: OpenMP and MKL take every core otherwise
        out.setdefault(name, threads)
    out.pop(ENV_PENDING_SIGNAL, None)  # taken by this wrapper, not the program's business
    out[ENV_SPEC] = str(spec_path)
    out[ENV_RUN_DIR] = str(paths.run_dir)
    # where a preemptible program should write its checkpoints (documented in the README)
    out.setdefault(ENV_CHECKPOINT_DIR, str(paths.checkpoints))
    return out


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def lightning_env(env: DistEnv, paths: RunPaths, has_gpus: bool, gpus_per_task: int) -> dict[str, str]:
    """The job's shape as Lightning's Trainer defaults (it reads PL_TRAINER_<ARG> for any argument the
    script does not pass): an unchanged `Trainer()` takes 1 device and, on a 1x2 allocation, ran as two
    lone trainings writing the same lightning_logs/. default_root_dir is the run dir: its logs, its
    checkpoints and its SLURM requeue checkpoint (hpc_ckpt_N.ckpt) belong to this run, and a new run
    of the spec does not resume from the last one's."""
    out = {"PL_TRAINER_DEFAULT_ROOT_DIR": str(paths.run_dir)}
    if gpus_per_task == 1:  # a rank driving several GPUs is its program's own layout, not Lightning's
        out["PL_TRAINER_DEVICES"] = str(env.local_world_size)
        out["PL_TRAINER_NUM_NODES"] = str(env.num_nodes)
    if not has_gpus:
        out["PL_TRAINER_ACCELERATOR"] = "cpu"
    return out


def thread_cap(environ: dict[str, str], spec: Spec, env: DistEnv) -> int:
    """A command rank's CPU threads, as hpcgpu's own ranks take them (runtime/dist.py set_cpu_threads):
    the cores srun gives the task (SLURM_CPUS_PER_TASK, else the spec's), at most this node's cores
    shared among its ranks: two local ranks of nanoGPT ran 4-5x slower with torch's every-core default."""
    given = environ.get("SLURM_CPUS_PER_TASK", "")
    cpus = int(given) if given.isdigit() else spec.resources.cpus_per_gpu * spec.gpus_per_task
    share = (os.cpu_count() or 1) // max(1, env.local_world_size)
    return max(1, min(cpus, share))


def ranks_have_gpus(environ: dict[str, str]) -> bool:
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "NoDevFiles"):
        return False
    return gpu_count() > 0


def run_command(spec: Spec, spec_path: Path, paths: RunPaths) -> int:
    env = DistEnv.from_environ()
    run = Run.begin(spec, paths.run_dir, env, records=False)  # metrics.jsonl is the program's
    received = run.signals.received  # each stop signal once: under `scancel --full` from SLURM and the batch script
    proc: subprocess.Popen | None = None

    relay = not launcher_signals_the_program(env)
    allowance = stop_allowance_s(spec)

    def hand_over(signum: int) -> None:
        if proc is not None:
            warn_unhandled(proc.pid, signum, spec, env)
            if relay:
                proc.send_signal(signum)  # the program decides how to checkpoint and stop

    run.catch_signals(hand_over)
    try:
        if run.signals.is_set:
            return stop_before_start(run)
        proc = start_program(spec, spec_path, paths, env)
        if received:
            proc.send_signal(received[0])  # it came in the instant the program was being started
        rendezvous = RendezvousWatch(env) if env.is_main and env.world_size > 1 else None
        # local rank 0 of each node samples the node's GPUs while the program runs, as for train
        with run.monitor(True):
            code, ended_by_us = wait_for_program(proc, received, allowance, env)
        told_to_stop = bool(received)  # before the program ended: a signal after it is not why it ended
        if code != 0 and not received:  # it may have ended of SLURM's own copy of a stop signal
            wait_for_our_copy(received)
            told_to_stop = bool(received)
        if rendezvous is not None:
            rendezvous.stop()
    finally:
        run.close()
    code = 128 - code if code < 0 else code  # killed by signal N -> 128+N, as a shell reports it
    if rendezvous is not None and code == 0 and not received and not rendezvous.seen:
        report_lone_runs(rendezvous.lone_runs_text(), paths)
    if not told_to_stop:
        # the program ended on its own (a crash is this rank's failure, recorded as such) even where
        # srun's teardown of the step reached this wrapper a moment later
        return code
    # the program was told to stop (preemption/timeout): rank 0 requeues, capped; a program that
    # checkpointed resumes from HPCGPU_CHECKPOINT_DIR next time
    note = StopNote({}, f"the program exited with code {code} after the stop signal" + (
        f", ended by hpcgpu: it was still running {allowance:.0f}s after it" if ended_by_us else ""))
    return run.stop(note, torn_down_code=code, say=rank0_prints(env))


STOP_MARGIN_S = 10.0  # before SLURM's kill: time for rank 0 to ask the controller and requeue
MIN_ALLOWANCE_S = 10.0  # a lead of a few seconds (TERM@0) still leaves the program time to save
KILL_AFTER_S = 5.0  # SIGTERM, then SIGKILL


def stop_allowance_s(spec: Spec) -> float:
    """How long a program may go on after the stop signal: slurm.signal's lead (the time SLURM gives
    before its kill) less a margin, so that the job is still there to be requeued."""
    lead = float(signal_lead_s(spec))
    return max(MIN_ALLOWANCE_S, lead - min(STOP_MARGIN_S, lead / 4))


def wait_for_program(proc: subprocess.Popen, received: list[int], allowance_s: float,
                     env: DistEnv) -> tuple[int, bool]:
    """The program's exit code, and whether hpcgpu ended it. A program still running `allowance_s`
    after a stop signal is ended here (SIGTERM, then SIGKILL), so the job requeues from the program's
    last checkpoint instead of running into its time limit: Lightning's handler, for one, can hang in
    its barrier (docs/frameworks.md), and a program may catch the signal and never stop."""
    since: float | None = None
    while True:
        try:
            return proc.wait(timeout=0.2), False
        except subprocess.TimeoutExpired:
            pass
        if received and since is None:
            since = time.monotonic()
        if since is not None and time.monotonic() - since >= allowance_s:
            break
    print(f"hpcgpu: rank {env.rank}: the program is still running {allowance_s:.0f}s after the stop signal "
          f"({signal.Signals(received[0]).name}): ending it so the job can requeue", file=sys.stderr, flush=True)
    proc.terminate()
    try:
        return proc.wait(timeout=KILL_AFTER_S), True
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(), True


def report_lone_runs(text: str, paths: RunPaths) -> None:
    """In the log, and in metrics.jsonl for `hpcgpu status`: the job itself completed."""
    print(f"hpcgpu: warning: {text}", file=sys.stderr, flush=True)
    metrics = MetricsWriter(paths.metrics)
    metrics.write("warning", text=text)
    metrics.close()


def launcher_signals_the_program(env: DistEnv) -> bool:
    """SLURM signals every process of the step (srun relays the batch script's copy the same way) and
    the local executor each rank's whole process group: the program has its own copy. A second one
    from us runs a handler that checkpoints and requeues (Lightning's) twice, the second inside the
    first, where Lightning's TensorBoard logger deadlocks."""
    return env.launcher.signals_the_program


def start_program(spec: Spec, spec_path: Path, paths: RunPaths, env: DistEnv) -> subprocess.Popen:
    program_env = command_env(spec, spec_path, paths, env)
    argv = [run_vars_in(arg, program_env) for arg in spec.command or []]
    if (code := code_map(paths)) is not None:  # the submit-time code, never the working tree of now
        # the working dir stays the submit folder (data and outputs by relative path, ignored files
        # included, are where they were); the script, file arguments and PYTHONPATH come from the copy
        argv = [code.argument(arg) for arg in argv]
        if program_env.get("PYTHONPATH"):
            program_env["PYTHONPATH"] = os.pathsep.join(
                str(code.mapped(e) or e) if e else e for e in program_env["PYTHONPATH"].split(os.pathsep))
    try:
        # through a shim that dies with this wrapper: no program outlives a killed launcher
        return subprocess.Popen(child_dies_with_me(argv, program_env), env=program_env)
    except FileNotFoundError:
        raise HpcgpuError(f"command: program {argv[0]!r} not found on PATH") from None
    except PermissionError:
        raise HpcgpuError(f"command: program {argv[0]!r} is not executable") from None


# what only the job knows, for arguments: --output_dir under the run dir, the --local_rank=N that
# DeepSpeed's launcher passes its scripts
RUN_VARS = (ENV_RUN_DIR, ENV_CHECKPOINT_DIR, "LOCAL_RANK", "RANK", "WORLD_SIZE")


def run_vars_in(arg: str, environ: dict[str, str]) -> str:
    """`${NAME}` / `$NAME` of RUN_VARS in an argument replaced by this rank's value: a command is run
    without a shell."""
    for name in RUN_VARS:
        arg = arg.replace("${" + name + "}", environ[name])
        arg = re.sub(r"\$" + name + r"(?![A-Za-z0-9_])", lambda _: environ[name], arg)
    return arg


def rank0_prints(env: DistEnv) -> Callable[[str], None]:
    """The stop line of the command task: printed among the program's output, once per job, by rank 0
    (the one that knows the reason: it asks the controller)."""
    def say(text: str) -> None:
        if env.is_main:
            print(f"hpcgpu: {text}", flush=True)

    return say


OUR_COPY_WAIT_S = 2.0


def wait_for_our_copy(received: list[int]) -> None:
    """The program failed and we have seen no stop signal: SLURM signals every process of the step
    (preemption, `scontrol requeue`, scancel), and the program may end of its copy (die of it, or
    handle it and exit) before ours arrives. Without this wait that would read as the program
    crashing on its own; a real crash is reported OUR_COPY_WAIT_S later."""
    deadline = time.monotonic() + OUR_COPY_WAIT_S
    while not received and time.monotonic() < deadline:
        time.sleep(0.02)


def stop_before_start(run: Run) -> int:
    """A stop signal came while the rank was starting: nothing ran, so nothing is lost by leaving (and
    nothing failed: no torn-down check)."""
    note = StopNote({}, "the stop signal came before the program started; not starting it")
    return run.stop(note, checked=False, say=rank0_prints(run.env))


def caught_signals(pid: int) -> set[int] | None:
    """The signals process `pid` has a handler for or ignores (Linux /proc: SigCgt | SigIgn); None
    where that cannot be read."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
        mask = int(fields["SigCgt"], 16) | int(fields["SigIgn"], 16)
    except (OSError, KeyError, ValueError):
        return None
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


def warn_unhandled(pid: int, signum: int, spec: Spec, env: DistEnv) -> None:
    """The preemption signal about to reach a program that has no handler for it ends the program at
    once, without a checkpoint: said once, by rank 0, with the signal its framework listens to."""
    ours = getattr(signal, f"SIG{signal_name(spec)}", None)
    caught = caught_signals(pid)
    if not env.is_main or signum != ours or caught is None or signum in caught:
        return
    hint = " (Lightning saves on SIGUSR1: set slurm.signal: USR1)" if signal.SIGUSR1 in caught else ""
    print(f"hpcgpu: warning: the program has no handler for {signal.Signals(signum).name}: it ends now without a "
          f"checkpoint of its own{hint}; docs/frameworks.md lists the signal each framework listens to",
          file=sys.stderr, flush=True)


class RendezvousWatch:
    """Whether anything listened on MASTER_PORT while the program ran, seen by rank 0's wrapper on its
    node: torch.distributed's env:// rendezvous (torchrun scripts, Lightning, accelerate, the HF
    Trainer) starts a store there in rank 0. A job of N ranks that never did ran N lone programs (a
    Lightning `Trainer(devices=1)` on a 1x2 allocation trained twice, COMPLETED without a word)."""

    FAST_S, SLOW_S, FAST_FOR_S = 0.1, 1.0, 30.0  # a short program binds and ends quickly

    def __init__(self, env: DistEnv):
        self.env, self.seen = env, False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="hpcgpu-rendezvous")
        self._thread.start()

    def _watch(self) -> None:
        start = time.monotonic()
        while not self._done.is_set():
            listening = port_listening(self.env.master_port)
            if listening is None or listening:
                self.seen = True  # found, or cannot be told here (no /proc): never a false warning
                return
            fast = time.monotonic() - start < self.FAST_FOR_S
            self._done.wait(self.FAST_S if fast else self.SLOW_S)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=2)

    def lone_runs_text(self) -> str:
        n = self.env.world_size
        return (f"the {n} ranks did not form one job: nothing listened on MASTER_PORT {self.env.master_port} while "
                f"the program ran, where torch.distributed's rendezvous starts, so each rank most likely ran alone "
                f"({n} separate runs writing the same outputs; e.g. a Lightning Trainer(devices=1), or a script "
                f"that does not read WORLD_SIZE). Ignore this if the ranks are meant to work apart")


LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def port_listening(port: int) -> bool | None:
    """Whether a TCP socket on this host listens on `port` (IPv4 or IPv6); None without /proc."""
    found_table = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        found_table = True
        for line in lines:
            parts = line.split()
            if len(parts) > 3 and parts[3] == LISTEN and int(parts[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False if found_table else None
