"""`hpcgpu hw [SPEC]`: the GPUs, CPUs and RAM seen here, which GPUs are busy, and settings for SPEC.

Light on purpose: pynvml and psutil only (no torch), so it answers in a fraction of a second on a
login node. A machine without an NVIDIA driver is a normal answer ("no GPUs"), exit 0.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click

from hpcgpu.cli.options import busy_options, gpus_option, nodes_option, read_spec, set_option
from hpcgpu.errors import HpcgpuError, UsageError
from hpcgpu.gpu.busy import BusyThresholds, busy_reasons, busy_warnings, select
from hpcgpu.gpu.estimate import fmt_bytes
from hpcgpu.gpu.readings import GpuReading
from hpcgpu.gpu.source import default_source
from hpcgpu.gpu.recommend import (Recommendation, fine_tuning_methods, lighter_method, loader_workers,
                                  method_recommendation, recommend_for_job)
from hpcgpu.spec import Spec

GiB = 1 << 30


def host_info() -> dict[str, Any]:
    import psutil

    vm = psutil.virtual_memory()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": {"cores": psutil.cpu_count(logical=False), "threads": psutil.cpu_count(logical=True),
                    "usable": usable},  # usable: what this process may run on (SLURM's cgroup, taskset)
            "memory": {"total": vm.total, "available": vm.available}}


def light_model_config(spec: Spec) -> dict[str, Any] | None:
    """The model config without transformers: the spec's mapping, or config.json of a local model dir."""
    if spec.model.config:
        return dict(spec.model.config)
    path = Path(spec.model.name_or_path or "") / "config.json"
    if spec.model.name_or_path and path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None
    return None


def spec_recommendation(spec: Spec, chosen: list[GpuReading]) -> tuple[Recommendation | None, str]:
    """The settings for a train spec on the chosen GPUs (its train.lora's where it has one), and a note."""
    if spec.task == "callable":  # ctx.loader's DataLoader gets the workers hw recommends (runtime/loader.py)
        workers = loader_workers(spec.resources.cpus_per_gpu)
        return None, (f"task: callable has no batch or strategy to tune; ctx.loader gives each rank {workers} loader "
                      f"workers (resources.cpus_per_gpu {spec.resources.cpus_per_gpu} - 1, at most 8)")
    if spec.task != "train":
        return None, f"task: {spec.task} has no batch or strategy to tune"
    cfg = light_model_config(spec)
    if cfg is None:
        return None, "model size unknown without loading transformers: `hpcgpu estimate SPEC` counts it"
    gpu_total = min((r.memory_total for r in chosen), default=None)
    try:
        rec = recommend_for_job(spec, None, cfg, gpu_total, spec.world_size)
    except HpcgpuError as exc:  # a config that leaves sizes to transformers' defaults: estimate knows them
        return None, f"{exc}; `hpcgpu estimate SPEC` reads the full config"
    return rec, "parameters counted from the config alone: approximate outside GPT-2/Llama families"


def lighter_advice(spec: Spec, chosen: list[GpuReading]) -> str | None:
    """`hpcgpu estimate`'s line where the spec's way of fine-tuning does not fit these GPUs and LoRA or
    QLoRA does (gpu/recommend.py lighter_method); None where it fits or nothing is known to judge by."""
    cfg = light_model_config(spec) if spec.task == "train" else None
    gpu_total = min((r.memory_total for r in chosen), default=None)
    if cfg is None or gpu_total is None:
        return None
    try:
        methods = fine_tuning_methods(spec, cfg)
        recs = [method_recommendation(spec, m, None, cfg, gpu_total, spec.world_size) for m in methods]
    except HpcgpuError:  # the recommendation's note says why the config cannot be judged
        return None
    return lighter_method(methods, recs)


def thresholds(spec: Spec | None, memory: float | None, util: float | None, ignore_processes: bool) -> BusyThresholds:
    base = BusyThresholds.from_spec(spec.resources.busy) if spec else BusyThresholds()
    return BusyThresholds(base.memory_pct if memory is None else memory, base.util_pct if util is None else util,
                          base.processes and not ignore_processes)


def gpu_row(r: GpuReading, th: BusyThresholds) -> dict[str, Any]:
    reasons = busy_reasons(r, th)
    return {**r.to_dict(), "memory_used_pct": round(r.memory_used_pct, 1), "busy": bool(reasons),
            "busy_reasons": reasons}


def _proc_text(r: GpuReading) -> str:
    if not r.processes:
        return "-"
    return ", ".join(f"{p.pid} {p.name or '?'}" + (f" ({fmt_bytes(p.used_bytes)})" if p.used_bytes else "")
                     for p in r.processes)


def _opt(v: float | None, spec: str, unit: str = "") -> str:
    return "-" if v is None else format(v, spec) + unit


def print_text(info: dict[str, Any], chosen: list[GpuReading], th: BusyThresholds) -> None:
    if not info["nvml"]:
        click.echo("GPUs: none: no NVIDIA driver (NVML) on this machine")
    else:
        click.echo(f"GPUs: {len(chosen)} ({info['selection']}), NVIDIA driver {info['driver']}")
        click.echo(f"  {'gpu':>3}  {'name':<24} {'cc':<4} {'memory used / total':>24} {'util':>5} {'temp':>5} "
                   f"{'power / limit':>13}  state  processes")
        for r in chosen:
            reasons = busy_reasons(r, th)
            mem = f"{r.memory_used / GiB:.1f} / {r.memory_total / GiB:.1f} GiB ({r.memory_used_pct:.0f}%)"
            cc = ".".join(map(str, r.compute_capability)) if r.compute_capability else "-"
            power = f"{_opt(r.power_draw, '.0f')} / {_opt(r.power_limit, '.0f')} W"
            click.echo(f"  {r.index:>3}  {r.name[:24]:<24} {cc:<4} {mem:>24} {_opt(r.utilization, '.0f', '%'):>5} "
                       f"{_opt(r.temperature, '.0f', 'C'):>5} {power:>13}  {'BUSY ' if reasons else 'free '}  "
                       f"{_proc_text(r)}" + (f"  [{', '.join(reasons)}]" if reasons else ""))
    cpu, mem = info["cpu"], info["memory"]
    click.echo(f"CPUs: {cpu['cores']} cores ({cpu['threads']} threads), {cpu['usable']} usable here; "
               f"RAM {mem['total'] / GiB:.1f} GiB, {mem['available'] / GiB:.1f} GiB available")


def print_recommendation(spec: Spec, rec: Recommendation | None, note: str, chosen: list[GpuReading],
                         advice: str | None = None) -> None:
    batch = f", global batch {spec.train.global_batch_size}, seq_len {spec.data.seq_len}" if spec.task == "train" else ""
    click.echo(f"Recommended for {spec.name} ({spec.world_size} rank(s){batch}):")
    if rec is None:
        click.echo(f"  {note}")
        return
    if not chosen:
        click.echo("  no GPU here: these are the CPU defaults; `hpcgpu estimate SPEC --gpu-memory 80G` checks a GPU")
    click.echo(f"  {rec.summary()}" + ("" if rec.fits else "  (DOES NOT FIT)"))
    click.echo(f"  why: {rec.reason}")
    if advice:
        click.echo(f"  {advice}")
    click.echo(f"  ({note})")


@click.command()
@click.argument("spec_file", metavar="[SPEC]", required=False, type=click.Path(dir_okay=False))
@set_option
@gpus_option
@nodes_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--devices", default=None, metavar="0,1,4,7",
              help="Only these GPU indices (overrides resources.devices).")
@busy_options("resources.busy")
@click.option("--ignore-processes", is_flag=True, help="A compute process alone does not make a GPU busy.")
def hw(spec_file: str | None, overrides: tuple[str, ...], gpus: int | None, nodes: int | None, as_json: bool,
       devices: str | None, busy_memory_pct: float | None, busy_util_pct: float | None, ignore_processes: bool
       ) -> None:
    """GPUs (memory, utilization, power, processes, busy or free), CPUs and RAM here; with SPEC, the
    micro batch, accumulation, loader workers and strategy that fit it on these GPUs."""
    if not spec_file and (overrides or gpus or nodes):
        raise UsageError("--set/--gpus/--nodes need a SPEC")
    if devices is not None and not all(d.strip().isdigit() for d in devices.split(",")):
        raise UsageError(f"--devices: {devices!r} is not a list of GPU indices like 0,1,4,7")
    spec = read_spec(spec_file, overrides, gpus, nodes) if spec_file else None
    th = thresholds(spec, busy_memory_pct, busy_util_pct, ignore_processes)
    source = default_source()
    nvml = source.available()
    readings = source.read() if nvml else []
    chosen, selection = select(readings, devices or (spec.resources.devices if spec else None),
                               os.environ.get("CUDA_VISIBLE_DEVICES"))
    warnings = busy_warnings(chosen, th) if selection != "all GPUs" else []
    info = {"nvml": nvml, "driver": source.driver_version() if nvml else None, "selection": selection,
            "thresholds": th.__dict__, "gpus": [gpu_row(r, th) for r in chosen], **host_info(), "warnings": warnings}
    rec, note = spec_recommendation(spec, chosen) if spec else (None, "")
    advice = lighter_advice(spec, chosen) if rec else None
    if as_json:
        info["recommendation"] = {**rec.__dict__, "note": note, "advice": advice} if rec else None
        click.echo(json.dumps(info, indent=2))
    else:
        print_text(info, chosen, th)
        if spec:
            print_recommendation(spec, rec, note, chosen, advice)
    for w in warnings:
        click.echo(f"hpcgpu: warning: {w}", err=True)
