"""`container:`: the lines the sbatch script (and so submitit's job) gets for apptainer, singularity and
pyxis, the host checks, and the local executor running its ranks through a stand-in `apptainer`
(tests/standin_runtime.py says why a stand-in).

The flags checked here are the runtimes' documented ones:
- apptainer-exec(1) (apptainer.org/docs/user/main/cli/apptainer_exec.html): `--nv` (NVIDIA GPUs in the
  container), `-B/--bind src[:dest[:opts]]` with opts ro|rw, `--env K=V`; "the environment variables set on
  your host are passed into the container" unless --cleanenv (apptainer user guide, "Environment and
  Metadata"), and the current working directory is a default bind ("Bind Paths and Mounts").
- pyxis (github.com/NVIDIA/pyxis/wiki/Usage): `--container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH`,
  `--container-mounts=SRC:DST[:FLAGS][,SRC:DST...]`, `--container-workdir=PATH`, `--container-env=NAME[,NAME...]`
  ("all exported host environment variables are set in the container ..., but their existing values in
  the image take precedence; the variables specified with this flag are preserved with the host value").
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import EVAL_TEXT, GOLDEN, job_env, only_run_dir, submit, write_spec_file
from standin_runtime import calls, write_standin
from hpcgpu.errors import SpecError
from hpcgpu.launch.checks import check_host
from hpcgpu.launch.container import HOST_CODE_DIR, hpcgpu_package
from hpcgpu.launch.sbatch import render_sbatch
from hpcgpu.spec import load_spec

UPDATE = os.environ.get("HPCGPU_UPDATE_GOLDEN", "") not in ("", "0")
RUN_DIR = Path("/runs/ctr/RUNID")


def spec_file(folder: Path, container: dict, **more: object) -> Path:
    doc = {"name": "ctr", "task": "command", "command": ["python3", "-c", "pass"],
           "resources": {"gpus": 2, "cpus_per_gpu": 1}, "container": container, **more}
    return write_spec_file(folder, doc)


def rendered(path: Path) -> str:
    """The sbatch text, the host's hpcgpu folder written as HPCGPU_PKG (it differs between checkouts)."""
    text = render_sbatch(load_spec(path), run_dir=RUN_DIR, spec_path=RUN_DIR / "spec.yaml",
                         python="/opt/venv/bin/python", script_hint="job.sbatch")
    return text.replace(str(hpcgpu_package()), "HPCGPU_PKG")


def srun_lines(text: str) -> str:
    return text[text.index("srun --kill-on-bad-exit"):text.index("srun_pid=$!")]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    (tmp_path / "data").mkdir()
    (tmp_path / "img.sif").write_bytes(b"")
    return tmp_path


@pytest.mark.parametrize("runtime", ["apptainer", "pyxis"])
def test_sbatch_lines_match_the_golden_file(data: Path, runtime: str) -> None:
    image = "/images/pt.sif" if runtime == "apptainer" else "nvcr.io#nvidia/pytorch:24.01-py3"
    path = spec_file(data, {"image": image, "runtime": runtime,
                     "mounts": ["/datasets:/data:ro"], "env": {"HF_HOME": "/data/hf"}},
                     runs_dir="/runs", slurm={"gpu_request": "gres"})
    text = srun_lines(rendered(path))
    golden = GOLDEN / f"container_{runtime}.srun"
    if UPDATE:
        golden.write_text(text)
    assert text == golden.read_text()
    done = subprocess.run(["bash", "-n"], input=rendered(path), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_apptainer_wraps_each_rank(data: Path) -> None:
    path = spec_file(data, {"image": "docker://pytorch/pytorch:2.4.0", "mounts": ["/datasets:/data:ro"],
                            "env": {"HF_HOME": "/data/hf"}}, runs_dir="/runs")
    line = srun_lines(rendered(path))
    assert ("  apptainer exec --nv --bind /runs:/runs --bind /datasets:/data:ro "
            f"--bind HPCGPU_PKG:{HOST_CODE_DIR}/hpcgpu:ro --env HF_HOME=/data/hf "
            f"--env HPCGPU_CONTAINER_IMAGE=docker://pytorch/pytorch:2.4.0 --env PYTHONPATH={HOST_CODE_DIR} "
            "docker://pytorch/pytorch:2.4.0 \\\n  python -m hpcgpu run /runs/ctr/RUNID/spec.yaml &") in line


def test_singularity_is_the_same_wrapper_under_its_own_name(data: Path) -> None:
    path = spec_file(data, {"image": str(data / "img.sif"), "runtime": "singularity"})
    assert "  singularity exec --nv --bind " in srun_lines(rendered(path))


def test_no_nv_without_gpus_and_the_spec_inputs_are_mounted(data: Path) -> None:
    path = spec_file(data, {"image": str(data / "img.sif")}, runs_dir="/runs", task="train",
                     data={"train": str(EVAL_TEXT), "seq_len": 64}, slurm={"gpu_request": "none"},
                     model={"config": {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8,
                                       "vocab_size": 256}}, command=None)
    line = srun_lines(rendered(path))
    assert "apptainer exec --bind /runs:/runs " in line and "--nv" not in line
    assert f"--bind {EVAL_TEXT}:{EVAL_TEXT} " in line


def test_pyxis_options_and_exports(data: Path) -> None:
    path = spec_file(data, {"image": "nvcr.io#nvidia/pytorch:24.01-py3", "runtime": "pyxis",
                            "env": {"HF_HOME": "/data/hf"}}, runs_dir="/runs", env={"NCCL_DEBUG": "INFO"})
    text = rendered(path)
    line = srun_lines(text)
    assert "--container-image='nvcr.io#nvidia/pytorch:24.01-py3' " in line
    assert (f'--container-mounts=/runs:/runs,HPCGPU_PKG:{HOST_CODE_DIR}/hpcgpu:ro,"$PWD":"$PWD" '
            '--container-workdir="$PWD" ') in line
    env_names = line.split("--container-env=")[1].split()[0].split(",")
    for name in ("NCCL_DEBUG", "HPCGPU_RUN_DIR", "HPCGPU_JOB_START", "MASTER_ADDR", "MASTER_PORT", "HF_HOME",
                 "HPCGPU_CONTAINER_IMAGE", "PYTHONPATH"):
        assert name in env_names
    assert "\n  python -m hpcgpu run /runs/ctr/RUNID/spec.yaml &" in line
    assert ("export HF_HOME=/data/hf\nexport HPCGPU_CONTAINER_IMAGE='nvcr.io#nvidia/pytorch:24.01-py3'\n"
            "export PYTHONPATH=/opt/hpcgpu-host\n") in text


def test_a_spec_without_container_keeps_the_hosts_python(data: Path) -> None:
    doc = {"name": "plain", "task": "command", "command": ["true"], "resources": {"gpus": 1}}
    text = render_sbatch(load_spec(write_spec_file(data, doc)), run_dir=RUN_DIR, spec_path=RUN_DIR / "spec.yaml",
                         python="/opt/venv/bin/python")
    assert "  /opt/venv/bin/python -m hpcgpu run /runs/ctr/RUNID/spec.yaml &" in text
    assert "container" not in text and "apptainer" not in text


# --- host checks: one line naming the key, before anything is queued -------------------------------

def problem(path: Path, slurm: bool = True, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(SpecError) as err:
        check_host(load_spec(path), slurm=slurm, environ=environ)
    return str(err.value)


@pytest.mark.parametrize("container, key, words", [
    ({"image": "/nowhere/pt.sif"}, "container.image", "image file not found: /nowhere/pt.sif"),
    ({"image": "docker://x;rm -rf ~"}, "container.image", "shell characters"),
    ({"image": "$(id).sif"}, "container.image", "shell characters"),
    ({"image": "/nowhere/pt.sqsh", "runtime": "pyxis"}, "container.image", "image file not found"),
    ({"image": "docker://x", "mounts": ["/nowhere:/data"]}, "container.mounts", "existing SRC"),
    ({"image": "docker://x", "env": {"MASTER_ADDR": "h"}}, "container.env", "MASTER_ADDR: not a name"),
    ({"image": "docker://x", "env": {"HF_TOKEN": "hf_x"}}, "container.env", "use env_passthrough"),
])
def test_host_checks_name_the_key(data: Path, container: dict, key: str, words: str) -> None:
    message = problem(spec_file(data, container))
    assert message.startswith(f"{key}: ") and words in message and "\n" not in message


def test_a_malformed_mount_is_refused_with_its_line(data: Path) -> None:
    path = spec_file(data, {"image": "docker://x", "mounts": ["data:/data"]})
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert "container.mounts" in str(err.value) and "SRC:DST" in str(err.value)


def test_registry_images_need_no_file(data: Path) -> None:
    check_host(load_spec(spec_file(data, {"image": "nvcr.io#nvidia/pytorch:24.01-py3", "runtime": "pyxis"})))
    check_host(load_spec(spec_file(data, {"image": "docker://pytorch/pytorch:2.4.0"})))


def test_the_local_executor_needs_the_runtime_on_path(data: Path) -> None:
    path = spec_file(data, {"image": "docker://x"})
    message = problem(path, slurm=False, environ={"PATH": str(data)})
    assert message == "container.runtime: apptainer is not on PATH here (the local executor runs each rank through it)"
    check_host(load_spec(path), slurm=True, environ={"PATH": str(data)})  # SLURM: the nodes' PATH, not ours


def test_the_local_executor_refuses_pyxis_in_one_line_exit_2(data: Path) -> None:
    path = spec_file(data, {"image": "nvcr.io#nvidia/pytorch:24.01-py3", "runtime": "pyxis"})
    done = submit(path)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "container.runtime: pyxis runs only through SLURM's srun" in done.stderr
    assert not (data / "runs" / "ctr").exists()


# --- the local executor runs every rank through the runtime ------------------------------------------

DUMP_ENV = ["python3", "-c", "import os, json; d = os.environ['HPCGPU_RUN_DIR']; "
            "open(os.path.join(d, 'env-%s.json' % os.environ['RANK']), 'w').write(json.dumps(dict(os.environ)))"]


def test_local_ranks_run_inside_the_container_with_the_contract(data: Path) -> None:
    bin_dir, records = write_standin(data)
    image = str(data / "img.sif")
    path = spec_file(data, {"image": image, "mounts": [f"{data / 'data'}:/data:ro"], "env": {"IN_IMAGE": "yes"}},
                     command=DUMP_ENV, env={"NCCL_DEBUG": "WARN"})
    # the image's `python` is the venv's here (the stand-in runs the command on the host)
    path_var = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])
    done = submit(path, env=job_env(PATH=path_var))
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = only_run_dir(data / "runs", "ctr")
    got = calls(records)
    assert len(got) == 2  # one `apptainer exec` per rank
    for argv, _ in got:
        assert argv[:1] == ["exec"] and "--nv" not in argv  # CPU ranks here: no GPU to pass in
        at = argv.index(image)
        assert argv[at + 1:] == ["python", "-m", "hpcgpu", "run", str(run_dir / "spec.yaml")]
        binds = [argv[i + 1] for i, word in enumerate(argv[:at]) if word == "--bind"]
        runs = str((data / "runs").absolute())
        assert binds == [f"{runs}:{runs}", f"{data / 'data'}:/data:ro", f"{hpcgpu_package()}:{HOST_CODE_DIR}/hpcgpu:ro"]
        assert f"PYTHONPATH={HOST_CODE_DIR}" in argv and "IN_IMAGE=yes" in argv
    envs = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in run_dir.glob("env-*.json")}
    assert sorted(envs) == [0, 1]
    for rank, env in envs.items():
        assert env["APPTAINER_CONTAINER"] == image  # the program ran under the runtime
        assert env["IN_IMAGE"] == "yes" and env["PYTHONPATH"].split(":")[0] == HOST_CODE_DIR
        assert env["SLURM_PROCID"] == env["RANK"] == str(rank) and env["SLURM_NTASKS"] == env["WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == envs[0]["MASTER_PORT"]
        assert env["HPCGPU_RUN_DIR"] == str(run_dir) and env["NCCL_DEBUG"] == "WARN"
        assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert yaml.safe_load((run_dir / "spec.yaml").read_text())["container"]["image"] == image


@pytest.mark.parametrize("runtime, line", [
    ("apptainer", "  apptainer exec --nv --bind "),
    ("pyxis", "  --container-image='nvcr.io#nvidia/pytorch:24.01-py3' --container-mounts="),
])
def test_the_submitit_job_runs_the_same_lines(data: Path, runtime: str, line: str) -> None:
    """`hpcgpu submit` hands submitit the body `hpcgpu sbatch` renders: its batch file has the lines too."""
    image = str(data / "img.sif") if runtime == "apptainer" else "nvcr.io#nvidia/pytorch:24.01-py3"
    path = spec_file(data, {"image": image, "runtime": runtime})
    done = subprocess.run([sys.executable, "-m", "hpcgpu", "submit", str(path), "--dry-run"], capture_output=True,
                          text=True, timeout=60, env=job_env(), cwd=data)
    assert done.returncode == 0, done.stderr
    assert line in done.stdout and "\n  python -m hpcgpu run " in done.stdout


def test_an_image_without_hpcgpus_dependencies_fails_in_one_line(data: Path) -> None:
    """The image's python lacks torch: each rank says so in one line naming the fix, exit 2, not an
    ImportError's traceback, and `hpcgpu status` gives that line as the job's reason."""
    bin_dir, records = write_standin(data)
    no_torch = data / "image-python"  # the image's site-packages, as a sitecustomize that hides torch
    no_torch.mkdir()
    (no_torch / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    image = str(data / "img.sif")
    path = spec_file(data, {"image": image, "env": {"PYTHONPATH": str(no_torch)}})
    path_var = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])
    env = job_env(PATH=path_var, HPCGPU_REGISTRY=str(data / "jobs.db"))  # its own: local-1 is this job
    done = submit(path, env=env)
    line = (f"hpcgpu: error: the container image {image} lacks torch: install hpcgpu's dependencies in the "
            "image (docs/containers.md)")
    assert done.returncode != 0, done.stderr
    assert calls(records)  # through the runtime (the other rank, killed once one failed, may not have got there)
    run_dir = only_run_dir(data / "runs", "ctr")
    logs = [log.read_text() for log in (run_dir / "logs").glob("rank-*.log")]
    assert line + "\n" in logs and not any("Traceback" in log for log in logs)  # that line, nothing else
    status = subprocess.run([sys.executable, "-m", "hpcgpu", "status", "local-1"], capture_output=True, text=True,
                            timeout=60, env=env, cwd=data)
    assert status.returncode == 0, status.stderr
    reason = f"on {socket.gethostname()} failed with exit code 2: {line.removeprefix('hpcgpu: error: ')}\n"
    assert re.search(r"^reason    rank [01] " + re.escape(reason), status.stdout, re.M), status.stdout
