"""The job registry (sqlite3): rows, ids, lookups, concurrent writers, and where it lives."""
from __future__ import annotations

import multiprocessing
import os
import sqlite3
from pathlib import Path

import pytest

from hpcgpu.errors import HpcgpuError
from hpcgpu.launch import registry
from hpcgpu.launch.registry import JobRecord, Registry, TaskRecord, file_system_type, registry_path


def record(job_id: str = "", **more) -> JobRecord:
    return JobRecord(job_id, more.pop("name", "exp"), "/specs/exp.yaml", more.pop("run_dir", "/runs/exp/1"),
                     more.pop("executor", "slurm" if job_id else "local"), **more)


def test_path_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("HPCGPU_REGISTRY", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert registry_path() == tmp_path / "state" / "hpcgpu" / "jobs.db"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert registry_path() == tmp_path / "home" / ".local" / "state" / "hpcgpu" / "jobs.db"
    monkeypatch.setenv("HPCGPU_REGISTRY", str(tmp_path / "x.db"))
    assert registry_path() == tmp_path / "x.db"


def test_add_find_save_roundtrip(tmp_path):
    reg = Registry(tmp_path / "jobs.db")
    job = reg.add(record("123", restarts=0))
    assert job.key == 1
    found, task = reg.find("123")
    assert task is None and found == job
    reg.update(found, state="RUNNING", nodes="n[1-2]", restarts=2)
    again = Registry(tmp_path / "jobs.db").find("123")[0]  # a fresh connection sees the commit
    assert (again.state, again.nodes, again.restarts) == ("RUNNING", "n[1-2]", 2)


def test_local_jobs_get_registry_ids(tmp_path):
    reg = Registry(tmp_path / "jobs.db")
    a, b = reg.add(record()), reg.add(record())
    assert (a.job_id, b.job_id) == ("local-1", "local-2")
    assert reg.find("local-2")[0].key == 2


def test_array_tasks_are_found_by_task_id(tmp_path):
    reg = Registry(tmp_path / "jobs.db")
    tasks = [TaskRecord(f"77_{i}", f"/sweep/{i}", {"train.lr": lr}) for i, lr in enumerate([0.1, 0.2, 0.3])]
    reg.add(record("77", run_dir="/sweep", tasks=tasks))
    job, task = reg.find("77_2")
    assert job.job_id == "77" and task is not None and task.run_dir == "/sweep/2" and task.values == {"train.lr": 0.3}
    with pytest.raises(HpcgpuError, match="no job '77_9'"):
        reg.find("77_9")


def test_reused_slurm_id_finds_the_newest(tmp_path):
    """A reset controller starts job ids again: the newest submission with an id is the one meant."""
    reg = Registry(tmp_path / "jobs.db")
    reg.add(record("5", name="old"))
    reg.add(record("5", name="new"))
    assert reg.find("5")[0].name == "new"


def test_unknown_job_is_one_clear_error(tmp_path):
    with pytest.raises(HpcgpuError, match="no job '42'.*hpcgpu list"):
        Registry(tmp_path / "jobs.db").find("42")


def test_unwritable_place_is_an_hpcgpu_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(HpcgpuError, match="HPCGPU_REGISTRY"):
        Registry(blocker / "jobs.db").add(record("1"))


def test_wal_mode(tmp_path):
    Registry(tmp_path / "jobs.db").add(record("1"))
    mode = sqlite3.connect(tmp_path / "jobs.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def _add_many(path: str, worker: int, count: int) -> None:
    reg = Registry(Path(path))
    for i in range(count):
        reg.add(record(f"{worker}{i:03d}"))


def test_concurrent_writers_lose_no_row(tmp_path):
    """20 processes race to create the database and insert: every row arrives."""
    path = str(tmp_path / "jobs.db")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_add_many, args=(path, w, 5)) for w in range(1, 21)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 20
    reg = Registry(Path(path))
    assert reg.count() == 100
    assert len({j.job_id for j in reg.all()}) == 100


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:41 / /home rw,relatime shared:20 - nfs4 filer:/export/home rw,vers=4.2
41 40 0:42 / /home/alice/scratch\\040space rw - lustre 10.0.0.1@o2ib:/scratch rw
42 22 0:43 / /tmp rw - tmpfs tmpfs rw
"""


@pytest.mark.parametrize("path, kind", [("/home/alice/.local/state/hpcgpu", "nfs4"),
                                        ("/home/alice/scratch space/x", "lustre"),
                                        ("/homework", "ext4"), ("/tmp/r", "tmpfs"), ("/", "ext4")])
def test_file_system_type_of_the_longest_mount_above(path, kind):
    assert file_system_type(Path(path), MOUNTINFO) == kind


def test_a_registry_on_a_network_file_system_keeps_the_rollback_journal(tmp_path, monkeypatch):
    """WAL's shared memory breaks across the login nodes of an NFS home; the rollback journal uses locks."""
    monkeypatch.setattr(registry, "file_system_type", lambda path, mountinfo=None: "nfs4")
    reg = Registry(tmp_path / "jobs.db")
    reg.add(record("1"))
    assert reg.find("1")[0].job_id == "1"
    mode = sqlite3.connect(tmp_path / "jobs.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "delete"


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_a_new_registry_is_private_whatever_the_umask(tmp_path):
    """Its rows (spec paths, run dirs, error lines) are nobody else's business on a shared cluster."""
    old = os.umask(0o022)
    try:
        reg = Registry(tmp_path / "state" / "hpcgpu" / "jobs.db")
        reg.add(record("1"))
        assert mode(tmp_path / "state" / "hpcgpu") == 0o700
        assert mode(tmp_path / "state" / "hpcgpu" / "jobs.db") == 0o600
        wal = [p for p in (tmp_path / "state" / "hpcgpu").iterdir() if p.name != "jobs.db"]
        assert wal and all(mode(p) == 0o600 for p in wal)  # -wal and -shm follow the database
    finally:
        os.umask(old)


# the table as hpcgpu 0.1.0 created it (schema version 1)
V1_SCHEMA = """CREATE TABLE jobs (key INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, name TEXT NOT NULL,
spec TEXT NOT NULL, run_dir TEXT NOT NULL, executor TEXT NOT NULL, tasks TEXT NOT NULL DEFAULT '[]',
submitted REAL NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '', restarts INTEGER NOT NULL DEFAULT 0,
nodes TEXT NOT NULL DEFAULT '', elapsed TEXT NOT NULL DEFAULT '', exit_code INTEGER, pid INTEGER, pid_start TEXT,
cancel_requested INTEGER NOT NULL DEFAULT 0, ended REAL, updated REAL NOT NULL)"""


def test_an_existing_registry_keeps_working_and_keeps_its_mode(tmp_path):
    path = tmp_path / "shared" / "jobs.db"
    path.parent.mkdir()
    db = sqlite3.connect(path)
    db.execute(V1_SCHEMA)
    db.execute("INSERT INTO jobs (job_id, name, spec, run_dir, executor, tasks, submitted, state, updated) "
               "VALUES ('12', 'old', '/s.yaml', '/r', 'slurm', ?, 1.0, 'RUNNING', 1.0)",
               ('[{"id": "12_0", "run_dir": "/r/0", "state": "PENDING"}]',))
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()
    os.chmod(path, 0o640)  # shared with a group on purpose: an explicit HPCGPU_REGISTRY is left as it is
    reg = Registry(path)
    job = reg.find("12")[0]
    assert (job.name, job.tasks[0].id, job.gpus, job.failure, job.earlier_runs_s) == ("old", "12_0", None, None, 0)
    reg.update(job, state="FAILED", failure={"rank": 1}, gpus=4)
    again = Registry(path).find("12")[0]
    assert (again.state, again.failure, again.gpus) == ("FAILED", {"rank": 1}, 4)
    assert mode(path) == 0o640


def test_an_old_default_registry_becomes_private(tmp_path, monkeypatch):
    monkeypatch.delenv("HPCGPU_REGISTRY", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    folder = tmp_path / "hpcgpu"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    Registry(folder / "jobs.db").add(record("1"))
    os.chmod(folder / "jobs.db", 0o644)  # as an older hpcgpu left it
    assert Registry().find("1")[0].job_id == "1"
    assert (mode(folder), mode(folder / "jobs.db")) == (0o700, 0o600)


def _look_then_add(path: str, index: int, barrier) -> None:
    barrier.wait()
    Registry(Path(path)).all()  # a submit reads the registry first (its upstream, a run to resume)
    Registry(Path(path)).add(record(str(1000 + index), run_dir=f"/runs/many/{index}"))


def test_twenty_first_submits_racing_to_make_the_registry_leave_twenty_rows(tmp_path):
    """20 processes whose first look finds no registry: each adds its row, none fails. A registry made
    in place lost rows or failed 'locked' in about 1 round of 15 here (its WAL switch raced the others'
    first reads); made whole in a file of its own and linked, none in 100."""
    fork = multiprocessing.get_context("fork")
    for round_ in range(50):
        path = tmp_path / f"r{round_}" / "jobs.db"
        path.parent.mkdir()
        barrier = fork.Barrier(20)
        procs = [fork.Process(target=_look_then_add, args=(str(path), i, barrier)) for i in range(20)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * 20, f"round {round_}"
        assert sorted(r.job_id for r in Registry(path).all()) == [str(1000 + i) for i in range(20)], f"round {round_}"
        assert not list(path.parent.glob(".jobs.db.*")), "a made file was left behind"
        assert path.stat().st_mode & 0o777 == 0o600
