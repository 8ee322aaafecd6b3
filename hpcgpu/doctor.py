"""`hpcgpu doctor`: is this machine (or each node of an allocation) fit to run a job?

Checks, each one row (check, where, result, status ok | warn | FAIL | skip):
- per GPU, from NVML: uncorrected ECC errors, retired pages / remapped rows pending, throttle reasons,
  SM clocks, persistence mode; a bf16 matmul's TFLOP/s against the card's datasheet peak
  (gpu/peak.py) and host -> device bandwidth against the PCIe link NVML reports;
- across the job's ranks (doctor --submit: one rank per GPU over the nodes): an all-reduce's bus
  bandwidth, nccl-tests' definition (bytes x 2(n-1)/n over the time), and the rendezvous it needed;
- the runs_dir: free space and write speed (fsync'd), and a TCP port to listen on.
Where there is no NVIDIA driver the GPU rows say so (skip) and the rest is checked. torch is imported
only for the measurements on GPUs and the all-reduce, never for a machine without GPUs.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from hpcgpu.contract import node_name

MiB = 1 << 20
GiB = 1 << 30
DISK_FAIL_BYTES, DISK_WARN_BYTES = 1 * GiB, 20 * GiB
WRITE_FAIL_MBS, WRITE_WARN_MBS = 20.0, 200.0
MATMUL_FAIL, MATMUL_WARN = 0.4, 0.6  # shares of the datasheet peak (a healthy H100 gives ~0.7)
H2D_FAIL, H2D_WARN = 0.4, 0.6  # shares of the PCIe link's rate
PCIE_LANE_GBS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}  # per lane, one direction
NVLINK_BUSBW_WARN_GBS = 100.0  # all-reduce over NVLink below this: something is off


@dataclass
class Check:
    check: str
    where: str
    result: str
    status: str  # ok | warn | FAIL | skip


def graded(value: float, fail: float, warn: float) -> str:
    return "FAIL" if value < fail else "warn" if value < warn else "ok"


# ---------------------------------------------------------------- GPUs (NVML)

def nvml_checks(host: str, indices: list[int] | None = None) -> tuple[list[Check], list[int]]:
    """NVML's health rows of the GPUs here (or `indices` of them) and the indices it found."""
    from hpcgpu.gpu.nvml import nvml_available

    if not nvml_available():
        return [Check("GPUs", host, "no NVIDIA driver (NVML) here: GPU checks skipped", "skip")], []
    import pynvml

    found = list(range(pynvml.nvmlDeviceGetCount())) if indices is None else indices
    rows: list[Check] = []
    for i in found:
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        name = _nvml(lambda: pynvml.nvmlDeviceGetName(h)) or "?"
        where = f"{host} GPU {i}"
        rows.append(Check("GPU", where, str(name.decode() if isinstance(name, bytes) else name), "ok"))
        rows += gpu_health(pynvml, h, where)
    return rows, found


def _nvml(call: Callable[[], Any]) -> Any:
    """One NVML query; None where the card or driver does not support it."""
    try:
        return call()
    except Exception:  # pynvml.NVMLError_NotSupported and kin
        return None


def gpu_health(nv: Any, h: Any, where: str) -> list[Check]:
    rows = []
    ecc = _nvml(lambda: nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))
    rows.append(Check("ECC uncorrected (volatile)", where, "n/a" if ecc is None else str(ecc),
                      "skip" if ecc is None else "FAIL" if ecc else "ok"))
    remap = _nvml(lambda: nv.nvmlDeviceGetRemappedRows(h))
    if remap is not None:
        _, _, pending, failed = remap
        rows.append(Check("row remapping", where, f"pending {pending}, failed {failed}",
                          "FAIL" if pending or failed else "ok"))
    else:
        pages = _nvml(lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(h))
        rows.append(Check("retired pages pending", where, "n/a" if pages is None else str(bool(pages)),
                          "skip" if pages is None else "FAIL" if pages else "ok"))
    reasons = _nvml(lambda: nv.nvmlDeviceGetCurrentClocksThrottleReasons(h))
    bad = {"HW slowdown": 0x8, "thermal (SW)": 0x20, "thermal (HW)": 0x40, "power brake": 0x80}
    hit = [name for name, bit in bad.items() if reasons is not None and reasons & bit]
    rows.append(Check("throttle reasons", where, "n/a" if reasons is None else ", ".join(hit) or "none",
                      "skip" if reasons is None else "warn" if hit else "ok"))
    sm, sm_max = (_nvml(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
                  _nvml(lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)))
    rows.append(Check("SM clock", where, "n/a" if sm is None else f"{sm} of {sm_max} MHz (idle clocks are low)",
                      "skip" if sm is None else "ok"))
    persistence = _nvml(lambda: nv.nvmlDeviceGetPersistenceMode(h))
    rows.append(Check("persistence mode", where, "n/a" if persistence is None else "on" if persistence else "off",
                      "skip" if persistence is None else "ok" if persistence else "warn"))
    return rows


def pcie_rate_gbs(index: int) -> float | None:
    """The link's one-way rate from NVML (generation x width), or None."""
    try:
        import pynvml

        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        gen, width = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h), pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)
    except Exception:
        return None
    return PCIE_LANE_GBS.get(int(gen), 0.0) * int(width) or None


# ---------------------------------------------------------------- GPUs (torch)

def matmul_check(index: int, where: str, quick: bool = False) -> Check:
    import torch

    from hpcgpu.gpu.peak import peak_flops

    dev = torch.device("cuda", index)
    n, reps = (4096, 10) if quick else (8192, 30)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize(dev)
    tflops = 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12
    peak = peak_flops(torch.cuda.get_device_name(dev))
    if peak is None:
        return Check("matmul bf16", where, f"{tflops:.0f} TFLOP/s (no datasheet figure for this card)", "ok")
    share = tflops * 1e12 / peak
    return Check("matmul bf16", where, f"{tflops:.0f} TFLOP/s, {share:.0%} of the {peak / 1e12:.0f} peak",
                 graded(share, MATMUL_FAIL, MATMUL_WARN))


def h2d_check(index: int, where: str, quick: bool = False) -> Check:
    import torch

    dev = torch.device("cuda", index)
    size = (128 if quick else 512) * MiB
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(size, dtype=torch.uint8, device=dev)
    gpu.copy_(host, non_blocking=True)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(5):
        gpu.copy_(host, non_blocking=True)
    torch.cuda.synchronize(dev)
    gbs = 5 * size / (time.perf_counter() - t0) / 1e9
    link = pcie_rate_gbs(index)
    if link is None:
        return Check("host -> GPU copy", where, f"{gbs:.1f} GB/s (link rate unknown)", "ok")
    share = gbs / link
    return Check("host -> GPU copy", where, f"{gbs:.1f} GB/s, {share:.0%} of the {link:.0f} GB/s PCIe link",
                 graded(share, H2D_FAIL, H2D_WARN))


# ---------------------------------------------------------------- across ranks

def allreduce_check(rank: int, world: int, gpu: int | None, nvlink: bool, quick: bool = False) -> list[Check]:
    """Inside a job of `world` ranks (torchrun variables set): the rendezvous and an all-reduce's bus
    bandwidth, on this rank's GPU `gpu` (None: gloo on CPUs). Rank 0's rows speak for all."""
    import datetime

    import torch
    import torch.distributed as dist

    on_gpu = gpu is not None
    t0 = time.perf_counter()
    device = torch.device("cuda", gpu) if gpu is not None else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=datetime.timedelta(seconds=120))
    rendezvous_s = time.perf_counter() - t0
    numel = (32 if quick or not on_gpu else 256) * MiB // 4
    x = torch.ones(numel, dtype=torch.float32, device=device)
    for _ in range(2):
        dist.all_reduce(x)
    if on_gpu:
        torch.cuda.synchronize(device)
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(x)
    if on_gpu:
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - t0) / reps
    dist.destroy_process_group()
    busbw = numel * 4 * 2 * (world - 1) / world / seconds / 1e9
    where = f"{world} ranks"
    rows = [Check("rendezvous", where, f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} in "
                  f"{rendezvous_s:.1f} s", "ok")]
    if not on_gpu:
        rows.append(Check("all-reduce bus bandwidth", where, f"{busbw:.2f} GB/s (gloo on CPUs: no expectation)", "ok"))
    elif nvlink:
        rows.append(Check("all-reduce bus bandwidth", where, f"{busbw:.0f} GB/s (NVLink: >= {NVLINK_BUSBW_WARN_GBS:.0f} "
                          "expected)", "ok" if busbw >= NVLINK_BUSBW_WARN_GBS else "warn"))
    else:
        rows.append(Check("all-reduce bus bandwidth", where, f"{busbw:.1f} GB/s (no NVLink: PCIe or network)", "ok"))
    return rows


def has_nvlink(index: int) -> bool:
    try:
        import pynvml

        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        return any(_nvml(lambda link=link: pynvml.nvmlDeviceGetNvLinkState(h, link)) for link in range(18))
    except Exception:
        return False


# ---------------------------------------------------------------- the node

def disk_checks(runs_dir: Path, host: str, quick: bool = False) -> list[Check]:
    where = f"{host} {runs_dir}"
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(runs_dir).free
    except OSError as exc:
        return [Check("runs_dir", where, f"cannot use it: {exc.strerror or exc}", "FAIL")]
    rows = [Check("runs_dir free space", where, f"{free / GiB:.1f} GiB", graded(free, DISK_FAIL_BYTES, DISK_WARN_BYTES))]
    size = (32 if quick else 256) * MiB
    if free < 2 * size:
        return rows + [Check("runs_dir write speed", where, "not measured: too little space", "skip")]
    probe = runs_dir / f".hpcgpu-doctor-{host}-{os.getpid()}"
    chunk = os.urandom(8 * MiB)
    try:
        t0 = time.perf_counter()
        with open(probe, "wb") as fh:
            for _ in range(size // len(chunk)):
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        mbs = size / MiB / (time.perf_counter() - t0)
    except OSError as exc:
        return rows + [Check("runs_dir write speed", where, f"write failed: {exc.strerror or exc}", "FAIL")]
    finally:
        probe.unlink(missing_ok=True)
    return rows + [Check("runs_dir write speed", where, f"{mbs:.0f} MB/s ({size // MiB} MiB, fsync'd)",
                         graded(mbs, WRITE_FAIL_MBS, WRITE_WARN_MBS))]


def port_check(host: str) -> Check:
    """A TCP port this node can listen on (what a rendezvous needs of rank 0's node)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            s.listen(1)
            port = s.getsockname()[1]
    except OSError as exc:
        return Check("TCP port to listen on", host, f"none: {exc.strerror or exc}", "FAIL")
    return Check("TCP port to listen on", host, f"{port} (free)", "ok")


# ---------------------------------------------------------------- here and in a job

def check_here(runs_dir: Path, quick: bool = False) -> list[Check]:
    """Every check of this machine: its GPUs one by one, the all-reduce between them, the runs_dir, a port."""
    host = socket.gethostname()
    rows, gpus = nvml_checks(host)
    for i in gpus:
        rows += [matmul_check(i, f"{host} GPU {i}", quick), h2d_check(i, f"{host} GPU {i}", quick)]
    if len(gpus) > 1:
        rows += allreduce_here(len(gpus), quick)
    return rows + disk_checks(runs_dir, host, quick) + [port_check(host)]


def allreduce_here(n: int, quick: bool) -> list[Check]:
    """The all-reduce over this machine's n GPUs: n processes of `hpcgpu doctor --in-job` (the job's
    own code path) on a free local port, their rows read back from a temporary run dir."""
    import subprocess
    import sys
    import tempfile

    from hpcgpu.contract import ENV_RUN_DIR
    from hpcgpu.launch.local import free_port

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="hpcgpu-doctor-") as tmp:
        procs = []
        for rank in range(n):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
                   "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   ENV_RUN_DIR: tmp, "HPCGPU_DOCTOR_ALLREDUCE_ONLY": "1"}
            procs.append(subprocess.Popen([sys.executable, "-m", "hpcgpu", "doctor", "--in-job"]
                                          + (["--quick"] if quick else []), env=env))
        codes = [p.wait(timeout=600) for p in procs]
        if any(codes):
            return [Check("all-reduce bus bandwidth", f"{n} GPUs", f"ranks exited with {codes}", "FAIL")]
        return read_job_rows(Path(tmp) / "doctor")


def check_in_job(out_dir: Path, quick: bool = False) -> int:
    """One rank of `doctor --submit`: its GPU's rows, the node's (local rank 0), the all-reduce over
    all ranks (rank 0 reports it), written to out_dir/rank-<N>.json for the host to print."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    host = node_name()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # unset: every GPU of the node (doctor here, a workstation)
    only_allreduce = os.environ.get("HPCGPU_DOCTOR_ALLREDUCE_ONLY") == "1"  # doctor here, its GPUs measured
    node_rows, gpus = nvml_checks(host)
    rows = node_rows if local == 0 and not only_allreduce else []  # the node's NVML rows once, from local rank 0
    on_gpu = bool(gpus) and (visible is None or visible.strip() not in ("", "-1", "NoDevFiles"))
    index = 0
    if on_gpu:
        import torch

        on_gpu = torch.cuda.is_available()  # GPUs NVML (or a recording) names that CUDA cannot use: gloo
        index = local % max(1, torch.cuda.device_count())  # the GPUs this rank sees (SLURM may narrow them)
    if on_gpu and not only_allreduce:
        where = f"{host} rank {rank} (cuda:{index})"
        rows += [matmul_check(index, where, quick), h2d_check(index, where, quick)]
    if local == 0 and not only_allreduce:
        rows += disk_checks(out_dir.parent, host, quick) + [port_check(host)]
    if world > 1:
        ar = allreduce_check(rank, world, index if on_gpu else None, on_gpu and has_nvlink(index), quick)
        rows += ar if rank == 0 else []
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".rank-{rank}.json.tmp"
    tmp.write_text(json.dumps([asdict(r) for r in rows]))
    os.replace(tmp, out_dir / f"rank-{rank}.json")
    return 0


def read_job_rows(out_dir: Path) -> list[Check]:
    rows: list[Check] = []
    for path in sorted(out_dir.glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[1])):
        rows += [Check(**r) for r in json.loads(path.read_text())]
    return rows


def exit_code(rows: list[Check]) -> int:
    return 1 if any(r.status == "FAIL" for r in rows) else 0
