"""The train step log: loss, lr, ms/step, tokens/s and MFU of the logged steps (console + metrics.jsonl).

On a GPU a logged step does not wait for the GPU. Its loss is averaged over the ranks by an all-reduce
that is only enqueued, copied into pinned host memory without blocking, and a CUDA event is recorded
right after: the step is pending until that event is done, and written at a later step boundary
(`StepLog.poll`), so its line may print a step or two after the step. Its ms/step is the GPU timeline
between the previous logged step's event and its own, less the eval and checkpoint time in between:
the host clock would be wrong now that the host runs ahead. A record keeps the lr and tokens of its own
step. Step 1 and the last step are written at once (they wait), and `StepLog.flush` writes the rest at
the end of the loop. On CPU every logged step is written at once, as the averaging waits anyway.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.distributed as dist

from hpcgpu.gpu.peak import peak_flops
from hpcgpu.runtime.metrics import MetricsWriter
from hpcgpu.runtime.plan import TrainPlan

log = logging.getLogger("hpcgpu")


class Steps(Protocol):
    """What the step log reads of the trainer (runtime/tasks/train.py's Trainer)."""

    device: torch.device
    tp: TrainPlan
    step: int
    max_steps: int
    last_lr: float
    tokens_seen: int
    flops_per_token: float
    world: int


class Marks(Protocol):
    """Points on the device's timeline: where the steps queued so far end."""

    def mark(self) -> Any: ...

    def done(self, mark: Any) -> bool: ...

    def wait(self, mark: Any) -> None: ...

    def elapsed_ms(self, start: Any, end: Any) -> float: ...


class HostMarks:
    """CPU: the work is done when the host gets past it, so a mark is the host clock."""

    def mark(self) -> float:
        return time.perf_counter()

    def done(self, mark: Any) -> bool:
        return True

    def wait(self, mark: Any) -> None:
        pass

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return (end - start) * 1000


class CudaMarks:
    """GPU: a mark is a timing event recorded on the current stream, done once the GPU passed it."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def done(self, mark: Any) -> bool:
        return bool(mark.query())

    def wait(self, mark: Any) -> None:
        mark.synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end))


@dataclass
class Logged:
    """One logged step, as of that step; `loss` (a pinned host tensor on GPU) is valid once `end` is done."""
    step: int
    steps: int  # since the previous logged step, or the start
    loss: float | torch.Tensor
    lr: float
    tokens: int
    peak_mem_gib: float | None
    excluded_s: float  # eval and checkpoint time between `start` and `end`
    start: Any
    end: Any


class PendingLog:
    """Logged steps in step order, each handed to `write` with its interval's step time (ms) once the
    device passed its end mark. The marks of one stream complete in order, so checking the oldest suffices."""

    def __init__(self, marks: Marks, write: Callable[[Logged, float], None]):
        self.marks, self.write = marks, write
        self.entries: deque[Logged] = deque()

    def add(self, entry: Logged) -> None:
        self.entries.append(entry)

    def poll(self) -> None:
        """Write the entries that are complete; never waits."""
        while self.entries and self.marks.done(self.entries[0].end):
            self._write_oldest()

    def flush(self, wait: bool = True) -> None:
        """Write every entry, waiting for the device; with wait=False (after an error, when another rank
        may be dead and an all-reduce never end) write the complete ones and drop the rest."""
        if wait:
            while self.entries:
                self.marks.wait(self.entries[0].end)
                self._write_oldest()
        self.poll()
        self.entries.clear()

    def _write_oldest(self) -> None:
        e = self.entries.popleft()
        self.write(e, self.marks.elapsed_ms(e.start, e.end) - e.excluded_s * 1000)


def ranks_mean(value: torch.Tensor) -> torch.Tensor:
    """The value averaged over the ranks, as a float32 tensor on its device. On NCCL the all-reduce is
    only enqueued: nothing here waits for the GPU."""
    v = value.detach().float().clone()  # a copy: the all-reduce must not touch the step's loss
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(v, op=dist.ReduceOp.SUM)
        v /= dist.get_world_size()
    return v


def peak_flops_here(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device))


class StepLog:
    """Turns logged steps into loss, ms/step, tokens/s and MFU lines (console + metrics.jsonl), in step
    order. Collective: every rank logs the same steps (the loss is averaged over them). See the module
    docstring for why, on a GPU, a step's record is written a little later than its step."""

    def __init__(self, tr: Steps, metrics: MetricsWriter, bar: Any, marks: Marks | None = None):
        self.tr, self.metrics, self.bar = tr, metrics, bar
        self.cuda = tr.device.type == "cuda"
        self.peak = peak_flops_here(tr.device)
        self.tokens_per_step = tr.tp.tokens_per_step
        self.marks: Marks = marks or (CudaMarks(tr.device) if self.cuda else HostMarks())
        self.pending = PendingLog(self.marks, self._write)
        self.last_step = tr.step
        self.last_mark = self.marks.mark()  # the first interval of a start is timed from here
        self.excluded_s = 0.0

    @contextlib.contextmanager
    def not_step_time(self) -> Iterator[None]:
        """Eval and checkpoint time is left out of ms/step and tokens/s: it belongs to the interval since
        the last logged step, which the next logged step closes. The steps queued on the GPU finish first,
        so that their time is not left out with it; the pending records are complete then: written here."""
        if self.cuda:
            torch.cuda.synchronize(self.tr.device)
        self.pending.flush()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.excluded_s += time.perf_counter() - t0

    def log(self, loss_t: torch.Tensor) -> None:
        """Log this step: on GPU only enqueued (written by a later `poll`), except step 1 and the last
        step, which wait; on CPU written now."""
        tr = self.tr
        loss = self._loss(loss_t)
        end = self.marks.mark()
        peak_mem = torch.cuda.max_memory_allocated(tr.device) / 2**30 if self.cuda else None
        self.pending.add(Logged(step=tr.step, steps=max(1, tr.step - self.last_step), loss=loss, lr=tr.last_lr,
                                tokens=tr.tokens_seen, peak_mem_gib=peak_mem, excluded_s=self.excluded_s,
                                start=self.last_mark, end=end))
        self.last_step, self.last_mark, self.excluded_s = tr.step, end, 0.0
        # step 1's record time is read as "first step done"; the last one must not wait for a flush
        if tr.step == 1 or tr.step == tr.max_steps:
            self.pending.flush()
        else:
            self.pending.poll()

    def poll(self) -> None:
        """Write the logged steps the GPU has finished; cheap, never waits: call it every step."""
        self.pending.poll()

    def flush(self, wait: bool = True) -> None:
        """Write every logged step (waits for the GPU); wait=False after an error: only the complete ones."""
        if wait:
            self.pending.flush()
            return
        try:
            self.pending.flush(wait=False)
        except Exception as e:  # a broken GPU fails the query too: keep the error that ended the loop
            log.debug("pending step log dropped: %s", e)
            self.pending.entries.clear()

    def _loss(self, loss_t: torch.Tensor) -> float | torch.Tensor:
        v = ranks_mean(loss_t)
        if not self.cuda:
            return float(v.item())
        host = torch.empty((), dtype=torch.float32, pin_memory=True)
        host.copy_(v, non_blocking=True)  # valid once the mark recorded after it is done
        return host

    def _write(self, e: Logged, elapsed_ms: float) -> None:
        ms = elapsed_ms / e.steps
        tok_s = self.tokens_per_step * e.steps * 1000 / elapsed_ms if elapsed_ms > 0 else 0.0
        mfu = tok_s * self.tr.flops_per_token / (self.peak * self.tr.world) if self.peak else None
        loss = float(e.loss)
        self.metrics.write("train", step=e.step, loss=loss, lr=e.lr, ms_per_step=ms, tokens_per_s=tok_s,
                           tokens=e.tokens, mfu=mfu, peak_mem_gib=e.peak_mem_gib, max_steps=self.tr.max_steps)
        msg = (f"step {e.step:>6}/{self.tr.max_steps} | loss {loss:.4f} | lr {e.lr:.2e} | "
               f"{ms:8.1f} ms/step | {tok_s:10,.0f} tok/s" + (f" | mfu {mfu * 100:5.1f}%" if mfu is not None else ""))
        if self.bar is not None:
            self.bar.write(msg)
        else:
            log.info(msg)
