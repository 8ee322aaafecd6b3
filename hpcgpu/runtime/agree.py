"""When every rank stops: the one agreement, read at each rank's safe points.

A stop signal only sets this rank's flag (runtime/signals.py). Whatever the task, the rule is one: a
rank posts its flag at its next safe point, and every rank stops at the first safe point at which the
agreement says some rank posted a stop. Where the posts travel depends on how the ranks move:

- Lockstep ranks (train's optimizer steps, the user's loop asking ctx.should_stop) pass the same safe
  points, so the flag is a MAX all-reduce on the gloo coordination group, in host memory (never
  waiting for a GPU stream). `at_step` is the train loop's: it posts the flag beside the loop's own
  flags (a checkpoint due by time, an async save still writing) and returns what the ranks posted
  the step before (dist.LaggedFlags), which has had a whole step to arrive: the loop never waits on
  the GPU or on another rank, and every rank sees the same agreement at the same step, so all stop
  at the same step (one step after the signal's). `now` agrees at once (a blocking all-reduce):
  before the first step, and at each ctx.should_stop(), where the user's loop chose to ask.
- Replicas (infer) run unequal numbers of chunks, so a collective per poll would wait for a replica
  that never polls again (a deadlock). `among_replicas` moves the posts into the process group's
  store (an atomic counter): `replica_poll` posts this rank's stop once and reads the others' at
  most every `every_s`; each replica stops after the chunk in hand.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from hpcgpu.runtime.dist import Agreed, LaggedFlags, any_rank, coordination_group
from hpcgpu.runtime.signals import StopSignals

STORE_KEY = "hpcgpu/stop"


class StopAgreement:
    """This rank's side of the one stop agreement (module docstring): its signals in, the agreed
    stop out."""

    def __init__(self, signals: StopSignals, device: torch.device):
        self.signals, self.device = signals, device
        self._steps: LaggedFlags | None = None
        self._store: Any = None
        self._every_s, self._read_at, self._agreed = 0.0, float("-inf"), False

    def now(self) -> bool:
        """Collective: True on every rank once any rank got a stop signal."""
        return any_rank([self.signals.is_set], coordination_group(self.device))[0]

    def at_step(self, flags: list[bool], step: int) -> Agreed:
        """Post this rank's stop flag and `flags` as of `step` (lockstep: every rank, every step);
        returns the agreement of the previous post: flags[0] the stop, then the caller's."""
        if self._steps is None:
            self._steps = LaggedFlags(1 + len(flags), coordination_group(self.device))
        return self._steps.exchange([self.signals.is_set, *flags], step)

    def settle(self) -> None:
        """Wait for the last step's post (every rank posted it): the group is idle for what follows."""
        if self._steps is not None:
            self._steps.drain()

    def abandon(self) -> None:
        """Forget the last step's post without waiting (a rank failed: its peers may never answer)."""
        if self._steps is not None:
            self._steps.abandon()

    def among_replicas(self, store: Any, every_s: float) -> None:
        """From now on the agreement of replicas: posts in `store`, read at most every `every_s`."""
        self._store, self._every_s = store, every_s

    def replica_poll(self) -> bool:
        """Whether this replica stops now: its own signal (posted for the others), or another's post."""
        if self._agreed:
            return True
        if self.signals.is_set:  # this replica got the signal: the others follow
            self._store.add(STORE_KEY, 1)
            self._agreed = True
        now = time.perf_counter()
        if not self._agreed and now - self._read_at >= self._every_s:
            self._read_at = now
            self._agreed = int(self._store.add(STORE_KEY, 0)) > 0
        return self._agreed
