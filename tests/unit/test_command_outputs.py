"""Where a command's outputs go: it works in the submit folder (as under sbatch and submitit), its
arguments can name the run dir, and a new run beside earlier ones says the folder is shared."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import job_env, submit_cmd, write_spec_file

# writes its argv and working directory where its first argument says
PROGRAM = ("import json, os, sys; os.makedirs(sys.argv[1], exist_ok=True); "
           "json.dump({'argv': sys.argv[1:], 'cwd': os.getcwd()}, open(os.path.join(sys.argv[1], 'seen.json'), 'w'))")


def test_arguments_name_the_run_dir_and_a_second_run_says_the_folder_is_shared(tmp_path: Path) -> None:
    import json

    spec = write_spec_file(tmp_path, {"name": "outs", "task": "command", "resources": {"gpus": 1},
                                      "command": [sys.executable, "-c", PROGRAM, "${HPCGPU_RUN_DIR}/out",
                                                  "$HPCGPU_CHECKPOINT_DIR", "$HPCGPU_RUN_DIRX",
                                                  "--local_rank=${LOCAL_RANK}"]})
    runs = []
    for _ in range(2):
        proc = subprocess.run(submit_cmd(spec, "--new"), capture_output=True, text=True, env=job_env(),
                              cwd=tmp_path, timeout=60)
        assert proc.returncode == 0, proc.stderr
        runs.append(proc.stderr)
    run_dirs = sorted((tmp_path / "runs" / "outs").iterdir())
    seen = json.loads((run_dirs[0] / "out" / "seen.json").read_text())
    assert seen["argv"] == [f"{run_dirs[0]}/out", f"{run_dirs[0]}/checkpoints", "$HPCGPU_RUN_DIRX",
                            "--local_rank=0"]
    assert seen["cwd"] == str(tmp_path)  # the submit folder, as sbatch gives it
    assert "note:" not in runs[0]
    assert f"note: the program runs in {tmp_path}, which every run of outs submitted from here shares" in runs[1]
