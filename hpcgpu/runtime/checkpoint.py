"""Checkpoints: step-N folders, written under a temporary name, renamed when complete, with a marker.

Layout of <run dir>/checkpoints/:
    step-00000020/            a complete checkpoint (COMPLETE marker inside)
        COMPLETE              JSON: step, tokens, world size, time
        spec.yaml             the resolved spec that wrote it
        plan.json             the run plan it was trained under (runtime/plan.py): a resume reuses it
        .metadata, __0_0.distcp ...   model + optimizer through torch.distributed.checkpoint (sharded)
        rank-0.pt, rank-1.pt  per-rank state: trainer position and every RNG state
    .step-00000040.tmp/       being written (or left by a kill): never resumed from
    best/                     train.early_stopping: the best eval loss so far, the same contents and
                              marker (with eval_loss), written under .best.tmp/ and renamed over the
                              previous best only when complete; never pruned, never resumed from

Resume takes the newest complete folder; one that fails to load is reported and the one before it is
used. Pruning keeps the newest `keep` complete folders and never deletes the newest.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from hpcgpu.contract import COMPLETE_MARKER, ENV_KILL_IN_CHECKPOINT, PLAN_FILE, checkpoint_step, complete_checkpoints
from hpcgpu.runtime.dist import new_gloo_group

log = logging.getLogger("hpcgpu")

MARKER = COMPLETE_MARKER
SPEC_NAME = "spec.yaml"
BEST_NAME = "best"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass(frozen=True)
class CheckpointPolicy:
    every_steps: int | None = None
    every_minutes: float | None = None
    keep: int = 2
    async_save: bool = False


def read_marker(path: Path) -> dict[str, Any]:
    return json.loads((path / MARKER).read_text())


def best_checkpoint(root: Path) -> Path | None:
    """checkpoints/best/ when complete; else the previous best a crash left between the two renames of
    _install (.best.old/, complete), so a best model once saved is never lost."""
    for path in (root / BEST_NAME, root / f".{BEST_NAME}.old"):
        if (path / MARKER).is_file():
            return path
    return None


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _all_ok(ok: bool) -> bool:
    if not _dist_on():
        return ok
    t = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_cpu_group())
    return int(t.item()) == 0


_CPU_GROUP: Any = None


def _cpu_group() -> Any:
    """A group of our own for checkpoint coordination. An async save runs its collectives from a
    background thread; sharing the training group would interleave them with the training loop's
    all-reduces (a deadlock on gloo, a stream clash on NCCL). Created collectively on first use."""
    global _CPU_GROUP
    if not _dist_on():
        return None
    if _CPU_GROUP is None:
        _CPU_GROUP = new_gloo_group()
    return _CPU_GROUP


def reset_cpu_group() -> None:
    global _CPU_GROUP
    _CPU_GROUP = None


class Payload:
    """What a checkpoint holds besides the per-rank state: written and read collectively."""

    can_async = False

    def write(self, path: Path) -> None:
        raise NotImplementedError

    def write_async(self, path: Path, options: dict[str, Any]) -> Future:
        raise NotImplementedError

    def read(self, path: Path) -> None:
        raise NotImplementedError


class DcpPayload(Payload):
    """Sharded tensors (model, optimizer) through torch.distributed.checkpoint; loads in place."""

    can_async = True

    def __init__(self, tensors: dict[str, Any]):
        self.tensors = tensors

    def write(self, path: Path) -> None:
        dcp.save(self.tensors, checkpoint_id=str(path), process_group=_cpu_group())

    def write_async(self, path: Path, options: dict[str, Any]) -> Future:
        resp = dcp.async_save(self.tensors, checkpoint_id=str(path), process_group=_cpu_group(), **options)
        return cast(Future, getattr(resp, "upload_completion", resp))  # newer torch: a (staging, upload) pair

    def read(self, path: Path) -> None:
        dcp.load(self.tensors, checkpoint_id=str(path), process_group=_cpu_group())


def as_payload(value: Payload | dict[str, Any]) -> Payload:
    return value if isinstance(value, Payload) else DcpPayload(value)


def reusable_pinned_stager(pinned: bool = True) -> Any:
    """A DCP stager whose pinned host buffers live as long as the CheckpointManager.

    torch 2.11's DefaultStager closes its inner StateDictStager at the end of every stage(): that
    drops the cached buffers (each save would pin 1.6 GB again) and empties the copy table, so the
    second save fails with `KeyError: <class 'type'>`; some releases also close a caller's stager
    after the upload. Both closes are no-ops here; release() frees the buffers when the manager
    closes. False where this torch has no DefaultStager.
    """
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return False

    class ReusableStager(DefaultStager):
        def __init__(self, options: Any):
            super().__init__(options)
            inner = getattr(self, "_state_dict_stager", None)
            self._release_inner = inner.close if inner is not None else (lambda: None)
            if inner is not None:
                inner.close = lambda: None

        def close(self) -> None:
            pass

        def release(self) -> None:
            self._release_inner()
            DefaultStager.close(self)

    try:
        return ReusableStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                             use_async_staging=False, use_non_blocking_copy=pinned))
    except TypeError:  # an older StagingOptions
        return False


class CheckpointManager:
    """Collective save/load of (sharded tensors, per-rank state) in the step-N layout."""

    def __init__(self, root: Path, policy: CheckpointPolicy, rank: int = 0, world_size: int = 1,
                 spec_text: str | None = None, plan_text: str | None = None):
        self.root, self.policy = root, policy
        self.rank, self.world_size = rank, world_size
        self.spec_text = spec_text  # written beside every checkpoint by rank 0 (spec.yaml)
        self.plan_text = plan_text  # likewise (plan.json); a task sets it once its plan is settled
        self.last_save_time = time.monotonic()
        self.last_saved_step: int | None = None
        self._pending: tuple[Future, Path, int, dict[str, Any]] | None = None
        self.last_blocking_s = 0.0
        self._stager: Any = None

    # ------------------------------------------------------------------ when
    def due_by_steps(self, step: int) -> bool:
        every = self.policy.every_steps
        return every is not None and int(every) > 0 and step % int(every) == 0

    def due_by_time(self) -> bool:
        """Rank-local clock: callers must agree across ranks (the trainer all-reduces it)."""
        minutes = self.policy.every_minutes
        return minutes is not None and float(minutes) > 0 and \
            time.monotonic() - self.last_save_time >= float(minutes) * 60

    @property
    def pending(self) -> bool:
        return self._pending is not None

    @property
    def pending_step(self) -> int | None:
        """The step of the asynchronous save still being written, if any."""
        return self._pending[2] if self._pending is not None else None

    def pending_done(self) -> bool:
        return self._pending is None or self._pending[0].done()

    # ------------------------------------------------------------------ save
    def save(self, step: int, payload: Payload | dict[str, Any], rank_state: dict[str, Any],
             meta: dict[str, Any], blocking: bool | None = None) -> None:
        """Collective. Writes under .step-N.tmp, then marks complete and renames (now or when async ends)."""
        if self.last_saved_step == step:
            return
        self.finish_pending()
        payload = as_payload(payload)
        use_async = (self.policy.async_save if blocking is None else not blocking) and payload.can_async
        t0 = time.perf_counter()
        tmp = self._fresh_tmp(step_dir_name(step), rank_state)
        meta = dict(meta, step=step, world_size=self.world_size, time=time.time())
        if use_async:
            fut = self._write_async(payload, tmp)
            self._pending = (fut, tmp, step, meta)
        else:
            payload.write(tmp)
            _kill_drill(step)
            self._finalize(tmp, step_dir_name(step), meta)
        self.last_blocking_s = time.perf_counter() - t0
        self.last_save_time = time.monotonic()
        self.last_saved_step = step

    def _fresh_tmp(self, name: str, rank_state: dict[str, Any]) -> Path:
        """Collective: an empty .NAME.tmp/ (rank 0 makes it), holding each rank's own state."""
        tmp = self.root / f".{name}.tmp"
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)  # left by a kill: its contents are unknown
            tmp.mkdir(parents=True)
        self._barrier()
        torch.save(rank_state, tmp / f"rank-{self.rank}.pt")
        return tmp

    def _write_async(self, payload: Payload, tmp: Path) -> Future:
        options = self._stager_kwargs()
        try:
            return payload.write_async(tmp, options)
        except (KeyError, TypeError, RuntimeError) as exc:
            if not options:
                raise
            # a safety net for torch releases whose stager breaks on some state: the default
            # staging still saves asynchronously, only with a slower copy to host memory
            log.warning(f"pinned checkpoint staging failed ({exc.__class__.__name__}: {exc}); "
                        "using torch's default staging")
            self._stager.release()
            self._stager = False
            return payload.write_async(tmp, {})

    def _stager_kwargs(self) -> dict[str, Any]:
        """Stage GPU tensors into pinned host buffers that are kept between saves: the training
        loop waits only for a fast device-to-host copy, the write runs in the background."""
        if self._stager is None:
            self._stager = reusable_pinned_stager() if torch.cuda.is_available() else False
        return {"async_stager": self._stager} if self._stager else {}

    def finish_pending(self) -> None:
        """Collective: wait for an async save and mark it complete."""
        if self._pending is None:
            return
        fut, tmp, step, meta = self._pending
        self._pending = None
        fut.result()
        self._finalize(tmp, step_dir_name(step), meta)

    def save_best(self, payload: Payload | dict[str, Any], rank_state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Collective, blocking: checkpoints/best/ (early stopping's best model so far), written under
        .best.tmp/ and renamed over the previous best once complete. The step checkpoints' rotation
        never sees it: prune() and resume match step-N names only."""
        self.finish_pending()
        payload = as_payload(payload)
        tmp = self._fresh_tmp(BEST_NAME, rank_state)
        payload.write(tmp)
        self._finalize(tmp, BEST_NAME, dict(meta, world_size=self.world_size, time=time.time()), prune=False)

    def load_best(self, payload: Payload | dict[str, Any]) -> dict[str, Any] | None:
        """Collective: load checkpoints/best/ into `payload`; its rank state, or None where there is none
        or it fails to load on some rank (reported)."""
        path = best_checkpoint(self.root)
        if not _all_ok(path is not None) or path is None:
            return None
        ok, rank_state, why = self._try_load(path, as_payload(payload))
        if not _all_ok(ok):
            log.warning(f"checkpoint {path.name} could not be loaded ({why or 'failed on another rank'})")
            return None
        return rank_state

    def _finalize(self, tmp: Path, name: str, meta: dict[str, Any], prune: bool = True) -> None:
        self._barrier()  # every rank's shards are on disk
        if self.rank == 0:
            if self.spec_text is not None:
                (tmp / SPEC_NAME).write_text(self.spec_text)
            if self.plan_text is not None:
                (tmp / PLAN_FILE).write_text(self.plan_text)
            marker = tmp / MARKER
            marker.write_text(json.dumps(meta) + "\n")
            _fsync_dir(tmp)
            final = self.root / name
            _install(tmp, final)
            log.info(f"checkpoint {final.name} saved")
            if prune:
                self.prune()
        self._barrier()

    def prune(self) -> None:
        """Keep the newest `keep` complete checkpoints; drop leftovers older than the newest complete one."""
        done = complete_checkpoints(self.root)
        for old in done[: max(0, len(done) - max(1, self.policy.keep))]:
            shutil.rmtree(old, ignore_errors=True)
        if done:
            newest = checkpoint_step(done[-1])
            for p in self.root.glob(".step-*.tmp"):
                m = re.match(r"^\.step-(\d+)\.tmp$", p.name)
                if m and int(m.group(1)) <= newest and (self._pending is None or self._pending[1] != p):
                    shutil.rmtree(p, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def load_latest(self, payload: Payload | dict[str, Any]) -> tuple[Path, dict[str, Any]] | None:
        """Collective. Load the newest loadable checkpoint into `payload`; return its rank state."""
        payload = as_payload(payload)
        candidates = complete_checkpoints(self.root)
        for path in reversed(candidates):
            ok, rank_state, why = self._try_load(path, payload)
            if _all_ok(ok):
                log.info(f"resumed from {path.name}")
                return path, rank_state
            log.warning(f"checkpoint {path.name} could not be loaded ({why or 'failed on another rank'}); "
                        "trying the one before it")
        return None

    def _try_load(self, path: Path, payload: Payload) -> tuple[bool, dict[str, Any], str]:
        try:
            read_marker(path)
            payload.read(path)
        except (Exception, CheckpointException) as exc:  # truncated or corrupt: fall back, never crash on it
            return False, {}, _first_line(exc)
        rank_file = path / f"rank-{self.rank}.pt"
        if not rank_file.exists():
            rank_file = path / "rank-0.pt"  # resumed at another world size: positions agree, RNG differs
        try:
            state = torch.load(rank_file, weights_only=False)
        except Exception as exc:
            return False, {}, f"{rank_file.name}: {exc.__class__.__name__}: {str(exc)[:200]}"
        return True, state, ""

    def _barrier(self) -> None:
        if _dist_on():
            dist.barrier(group=_cpu_group())

    def close(self) -> None:
        self.finish_pending()
        if self._stager:
            self._stager.release()
        self._stager = None


def _install(tmp: Path, final: Path) -> None:
    """Rename a complete `tmp` to `final`. A folder there already (a best being replaced) is moved
    aside first and removed last: at every moment one complete copy exists (best_checkpoint)."""
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException):
        failures = getattr(exc, "failures", {}) or {}
        inner = next(iter(failures.values()), None)
        if isinstance(inner, BaseException):
            return f"{inner.__class__.__name__} on rank(s) {sorted(failures)}: {str(inner)[:150]}"
    return f"{exc.__class__.__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def _kill_drill(step: int) -> None:
    """HPCGPU_KILL_IN_CHECKPOINT=STEP: SIGKILL this rank with the step's shards written but the
    checkpoint not yet complete, as a node failure mid-write would (a drill for tests and users)."""
    if os.environ.get(ENV_KILL_IN_CHECKPOINT) == str(step):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
