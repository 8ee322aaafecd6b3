"""SLURM hostlist expansion (checked against `scontrol show hostnames`) and the rendezvous port rule."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from hpcgpu.hostlist import PORT_SHELL, expand_hostlist, port_for_job

CASES = {
    "gpu[01-04,07]": ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"],
    "n1": ["n1"],
    "n[1-2],m5": ["n1", "n2", "m5"],
    "a[1-2]b[3-4]": ["a1b3", "a1b4", "a2b3", "a2b4"],
    "x[098-101]": ["x098", "x099", "x100", "x101"],
    "n[9-11]": ["n9", "n10", "n11"],
    "node-[1-2],gpu[1-2]": ["node-1", "node-2", "gpu1", "gpu2"],
    "n[0-2]": ["n0", "n1", "n2"],
}
# expressions SLURM itself prints (the oracle runs them through scontrol)
ORACLE = list(CASES) + ["n[01-2]", "n[1,1]", "n[1-2,5-6]x[1-2]", "gpu[001-003,010]", "n[1-2],", "c1,c2,c3",
                        "rack1-node[08-12]"]
INVALID = ["n[1-2", "gpu[01-04", "n1-2]", "n[1-2]]", "n[10-8]", "n[a-b]", "n[]", "n[1-]"]


@pytest.mark.parametrize("expr,hosts", CASES.items(), ids=list(CASES))
def test_expand(expr, hosts):
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize("expr", INVALID)
def test_invalid_raises(expr):
    with pytest.raises(ValueError):
        expand_hostlist(expr)


def _scontrol(expr: str) -> subprocess.CompletedProcess:
    return subprocess.run(["scontrol", "show", "hostnames", expr], capture_output=True, text=True, timeout=20)


@pytest.fixture(scope="module")
def scontrol():
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol not installed")
    probe = _scontrol("n[1-2]")
    if probe.returncode != 0 or probe.stdout.split() != ["n1", "n2"]:
        pytest.skip(f"scontrol show hostnames does not work here: {probe.stderr.strip()}")
    return _scontrol


@pytest.mark.parametrize("expr", ORACLE)
def test_matches_scontrol(scontrol, expr):
    done = scontrol(expr)
    assert done.returncode == 0, done.stderr
    assert expand_hostlist(expr) == done.stdout.split()


@pytest.mark.parametrize("expr", ["n[10-8]", "n[a-b]", "n[]", "n[1-2]]"])
def test_rejects_what_scontrol_rejects(scontrol, expr):
    assert "Invalid hostlist" in scontrol(expr).stdout + scontrol(expr).stderr
    with pytest.raises(ValueError):
        expand_hostlist(expr)


JOB_IDS = [1, 42, 9999, 19999, 20000, 20001, 123456, 987654321]


@pytest.mark.parametrize("job", JOB_IDS)
def test_port_range(job):
    assert 10000 <= port_for_job(job) < 30000
    assert port_for_job(str(job)) == port_for_job(job)


def test_consecutive_jobs_get_different_ports():
    for start in (1, 19990, 4_000_000):
        ports = [port_for_job(j) for j in range(start, start + 50)]
        assert len(set(ports)) == 50


def test_bash_rule_matches_python():
    for job in JOB_IDS:
        env = {**os.environ, "SLURM_JOB_ID": str(job)}
        out = subprocess.run(["bash", "-c", f"echo {PORT_SHELL}"], env=env, capture_output=True, text=True,
                             check=True).stdout.strip()
        assert int(out) == port_for_job(job), job
