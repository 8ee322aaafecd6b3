"""A thin layer over pynvml. "No NVML" (no driver, no GPU) is a normal state, never a crash."""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence, TypeVar

from hpcgpu.gpu.readings import GpuProcess, GpuReading

T = TypeVar("T")
NOT_AVAILABLE = 2**63  # NVML reports "not available" memory as 2^64-1; anything this large is that


@functools.lru_cache(maxsize=1)
def nvml_available() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return True
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError: all mean "no GPUs here"
        return False


def gpu_count() -> int:
    if not nvml_available():
        return 0
    import pynvml

    try:
        return int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError:
        return 0


def _opt(fn: Callable[[], T]) -> T | None:
    """One optional metric: NotSupported (power on some boards, MIG) or any NVML error gives None."""
    try:
        return fn()
    except Exception:
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlSource:
    """Readings from the NVIDIA driver through pynvml (nvidia-ml-py)."""

    def available(self) -> bool:
        return gpu_count() > 0

    def driver_version(self) -> str | None:
        if not nvml_available():
            return None
        import pynvml

        return _opt(lambda: _text(pynvml.nvmlSystemGetDriverVersion()))

    def read(self, indices: Sequence[int] | None = None, processes: bool = True) -> list[GpuReading]:
        count = gpu_count()
        wanted = range(count) if indices is None else [i for i in indices if 0 <= i < count]
        out = []
        for i in wanted:
            reading = _opt(functools.partial(read_gpu, i, processes))
            if reading is not None:  # a GPU that fell off the bus is left out, not fatal
                out.append(reading)
        return out


def read_gpu(index: int, with_processes: bool = True) -> GpuReading:
    import pynvml

    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
    power = _opt(lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0)  # mW -> W
    limit = _opt(lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0)
    return GpuReading(
        index=index, name=_text(pynvml.nvmlDeviceGetName(h)), uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
        memory_total=int(mem.total), memory_used=int(mem.used), memory_free=int(mem.free),
        compute_capability=_opt(lambda: tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h))),  # type: ignore[arg-type]
        utilization=_opt(lambda: float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)),
        temperature=_opt(lambda: float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))),
        power_draw=power, power_limit=limit,
        sm_clock=_opt(lambda: int(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))),
        processes=_processes(h) if with_processes else (),
    )


def _processes(handle: Any) -> tuple[GpuProcess, ...]:
    import pynvml

    procs = _opt(lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle)) or []
    out = []
    for p in procs:
        used = getattr(p, "usedGpuMemory", None)
        used = None if used is None or used >= NOT_AVAILABLE else int(used)
        out.append(GpuProcess(int(p.pid), used, _process_name(int(p.pid))))
    return tuple(out)


def _process_name(pid: int) -> str | None:
    try:
        import psutil

        return psutil.Process(pid).name()
    except Exception:  # another container's pid, or gone already
        return None
