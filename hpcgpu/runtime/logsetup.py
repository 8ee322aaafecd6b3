"""The `hpcgpu` logger of a rank: INFO from rank 0, warnings from the others (no torch here, so the
command task's wrapper can use it too)."""
from __future__ import annotations

import logging
import sys

from hpcgpu.runtime.env import DistEnv


def setup_logging(env: DistEnv) -> None:
    level = logging.INFO if env.is_main else logging.WARNING
    logger = logging.getLogger("hpcgpu")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        prefix = f"[rank {env.rank}] " if env.world_size > 1 else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)
