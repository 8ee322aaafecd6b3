"""Whether model.config.model_type is one the installed transformers knows, asked without importing it.

The list comes from transformers' config mapping, asked in a subprocess (it imports torch) and cached
on disk per transformers version, so host commands never import transformers or torch themselves;
without transformers here the check is skipped. Used by the host checks (hpcgpu/launch/checks.py) and
by the estimate's config reader (hpcgpu/gpu/estimate.py), so it lives below both.
"""
from __future__ import annotations

import difflib
import functools
import json
import os
import subprocess
import sys
import importlib.metadata
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcgpu.spec import Spec

# run in a subprocess: importing transformers' mapping imports torch
_ASK = ("import json, sys\n"
        "from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES\n"
        "sys.stdout.write('\\n' + json.dumps(sorted(CONFIG_MAPPING_NAMES)) + '\\n')\n")


def cache_dir() -> Path:
    """hpcgpu's per-user cache folder (XDG_CACHE_HOME, else ~/.cache)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpcgpu"


def transformers_version() -> str | None:
    try:
        return importlib.metadata.version("transformers")  # looked up at call time: tests stand in for it
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def known_model_types(version: str) -> frozenset[str] | None:
    """The model types transformers `version` (installed here) knows; None if it cannot say.

    Read from the disk cache, else asked of transformers in a subprocess and cached."""
    cache = cache_dir() / f"model-types-transformers-{version}.json"
    try:
        names = json.loads(cache.read_text())
        if isinstance(names, list) and names and all(isinstance(n, str) for n in names):
            return frozenset(names)
    except (OSError, ValueError):
        pass
    try:
        done = subprocess.run([sys.executable, "-c", _ASK], capture_output=True, text=True, timeout=180,
                              env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
        names = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        names = None
    if not isinstance(names, list) or not names:
        return None  # transformers is broken here: the job will say so; nothing to check against
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(names) + "\n")
        os.replace(tmp, cache)
    except OSError:
        pass  # an unwritable cache only costs the next command the same second
    return frozenset(names)


def model_type_problem(spec: Spec) -> str | None:
    """Why model.config.model_type is not one transformers knows (with close matches), or None."""
    config = spec.model.config
    if not config or "model_type" not in config:
        return None
    model_type = config["model_type"]
    if not isinstance(model_type, str):
        return f"must be a string like gpt2 or llama, got {model_type!r}"
    version = transformers_version()
    known = known_model_types(version) if version else None
    if known is None or model_type in known:
        return None
    close = difflib.get_close_matches(model_type, sorted(known), n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}?" if close else "no close match"
    return f"unknown model type {model_type!r} (transformers {version} knows {len(known)}; {hint})"
