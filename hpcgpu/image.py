"""Inside a container: hpcgpu's dependencies come from the image (docs/containers.md). A rank checks them
before anything imports them, so an image without them fails with one line naming the fix (and a
failure record for `hpcgpu status`), not a traceback. Standard library and the run contract only: it
runs before any dependency is known to be there.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

from hpcgpu.contract import ENV_RUN_DIR, EXIT_USAGE, Failure, attempt_id, node_name, record_failure

ENV_CONTAINER_IMAGE = "HPCGPU_CONTAINER_IMAGE"  # set by launch/container.py for every rank in an image
# what `hpcgpu run` imports (import names); submitit, datasets, matplotlib serve the host or one input kind
IMAGE_MODULES = ("yaml", "click", "numpy", "torch", "transformers")


def missing_modules() -> list[str]:
    return [name for name in IMAGE_MODULES if importlib.util.find_spec(name) is None]


def check_image() -> None:
    """In a container, exit 2 with one line if the image lacks a module `hpcgpu run` needs."""
    image = os.environ.get(ENV_CONTAINER_IMAGE)
    missing = missing_modules() if image else []
    if not missing:
        return
    message = (f"the container image {image} lacks {', '.join(missing)}: install hpcgpu's dependencies in "
               f"the image (docs/containers.md)")
    run_dir = os.environ.get(ENV_RUN_DIR)  # every launcher sets it; a rank run by hand has no record to write
    if run_dir:
        rank = int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)
        node = node_name()
        record_failure(Path(run_dir), Failure(attempt_id(), rank, node, EXIT_USAGE, message, time.time()))
    print(f"hpcgpu: error: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)
