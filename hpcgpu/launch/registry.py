"""The job registry: every submission (SLURM or local) in one SQLite file.

Where: $HPCGPU_REGISTRY, else ${XDG_STATE_HOME:-~/.local/state}/hpcgpu/jobs.db.

Many `hpcgpu submit` processes may write at once (a shell loop, a sweep script): the database runs
in WAL mode with a busy timeout, and every write is one `BEGIN IMMEDIATE` transaction, so writers
queue instead of failing and no row is lost. WAL's shared memory does not work across the hosts of a
network file system (an NFS or Lustre home seen from several login nodes): there the database keeps
SQLite's rollback journal, which relies on the file system's locks instead.
"""
from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Collection, Iterator, Sequence

from hpcgpu.contract import ENV_REGISTRY
from hpcgpu.errors import HpcgpuError

BUSY_TIMEOUT_MS = 60_000
SCHEMA_VERSION = 3

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    key        INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id     TEXT NOT NULL,             -- SLURM job id (an array's job id), or local-<key>
    name       TEXT NOT NULL,
    spec       TEXT NOT NULL,             -- the spec file as given
    run_dir    TEXT NOT NULL,             -- the run dir (the sweep dir of an array)
    executor   TEXT NOT NULL,             -- slurm | local
    tasks      TEXT NOT NULL DEFAULT '[]',-- array layout: [{id, run_dir, values, state, ...}]
    submitted  REAL NOT NULL,
    state      TEXT NOT NULL,
    reason     TEXT NOT NULL DEFAULT '',
    restarts   INTEGER NOT NULL DEFAULT 0,
    nodes      TEXT NOT NULL DEFAULT '',
    elapsed    TEXT NOT NULL DEFAULT '',
    exit_code  INTEGER,
    pid        INTEGER,                   -- local executor process
    pid_start  TEXT,                      -- its start time, so a reused pid is never signalled
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    ended      REAL,
    updated    REAL NOT NULL,
    failure    TEXT,                      -- JSON {rank, node, exit_code, signal, message}, {}: none found
    earlier_runs_s INTEGER NOT NULL DEFAULT 0, -- seconds of the runs before the current one (requeues)
    run_start  REAL,                      -- when the current run started, as SLURM said while it ran
    gpus       INTEGER,                   -- GPUs of one run, all nodes together (NULL: not known)
    after      TEXT NOT NULL DEFAULT ''   -- the job it runs after (submit --after), '' for none
);
CREATE INDEX IF NOT EXISTS jobs_job_id ON jobs (job_id);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state);
"""
# Columns added since version 1 (ALTER TABLE brings an older registry up to date).
ADDED_COLUMNS = {"failure": "TEXT", "earlier_runs_s": "INTEGER NOT NULL DEFAULT 0", "run_start": "REAL",
                 "gpus": "INTEGER", "after": "TEXT NOT NULL DEFAULT ''"}


NETWORK_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "glusterfs", "fuse.sshfs",
              "panfs", "wekafs", "9p")


def file_system_type(path: Path, mountinfo: str | None = None) -> str:
    """The type of the mount holding `path` (the longest mount point above it), '' if unknown."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return ""
    best, kind = "", ""
    target = os.path.realpath(path)
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields_left, fields_right = left.split(), right.split()
        if len(fields_left) < 5 or not fields_right:
            continue
        mount = fields_left[4].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fields_right[0]
    return kind


def journal_mode_for(path: Path) -> str:
    return "DELETE" if file_system_type(path.parent) in NETWORK_FS else "WAL"


def registry_path() -> Path:
    explicit = os.environ.get(ENV_REGISTRY)
    return Path(explicit).expanduser() if explicit else default_registry_path()


def registry_files(path: Path | None = None) -> set[Path]:
    """The registry's files, sqlite's beside it included: what no copy may open (a snapshot of a folder
    holding them did: closing its descriptor drops the submitting process's POSIX locks on them, and
    concurrent submits then overwrote each other's rows, 20 parallel submits leaving 11-19)."""
    path = (path or registry_path()).expanduser().resolve()
    return {path.with_name(path.name + suffix) for suffix in ("", "-wal", "-shm", "-journal")}


def default_registry_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "hpcgpu" / "jobs.db"


def make_private(path: Path, tighten: bool = False) -> None:
    """Create the registry's folder 0700 and its file 0600, whatever the umask: on a shared cluster
    its rows (spec paths, run dirs, error lines) are nobody else's business. SQLite gives the -wal
    and -shm files the database file's mode. Existing ones keep their mode (a team may share a
    registry through HPCGPU_REGISTRY on purpose), except in the default place when `tighten`:
    there a registry an older hpcgpu made 0644 becomes private."""
    folder = path.parent
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        folder.mkdir(mode=0o700)
        os.chmod(folder, 0o700)  # mkdir's mode is cut by the umask
    except FileExistsError:
        if tighten:
            _chmod_if_mine(folder, 0o700)
    if tighten and path.exists():
        for name in (path.name, path.name + "-wal", path.name + "-shm"):
            _chmod_if_mine(folder / name, 0o600)


def private_file(path: Path) -> None:
    """A new empty file, 0600 whatever the umask (an odd one, 0277, must not leave it read-only)."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    os.chmod(path, 0o600)


def _chmod_if_mine(path: Path, mode: int) -> None:
    try:
        st = path.stat()
        if st.st_uid == os.getuid() and st.st_mode & 0o777 & ~mode:
            os.chmod(path, mode)
    except OSError:
        pass  # gone, or not ours: it keeps working as it is


@dataclass
class TaskRecord:
    """One array task: its id (`123_4`), run dir, swept values and last known state."""

    id: str
    run_dir: str
    values: dict[str, Any] = field(default_factory=dict)
    state: str = "PENDING"
    reason: str = ""
    restarts: int = 0
    nodes: str = ""
    elapsed: str = ""  # all runs together
    exit_code: int | None = None
    failure: dict[str, Any] | None = None  # why it FAILED; None: not looked yet, {}: nothing found
    earlier_runs_s: int = 0
    run_start: float | None = None
    gpus: int | None = None


@dataclass
class JobRecord:
    job_id: str
    name: str
    spec: str
    run_dir: str
    executor: str
    state: str = "PENDING"
    tasks: list[TaskRecord] = field(default_factory=list)
    submitted: float = field(default_factory=time.time)
    reason: str = ""
    restarts: int = 0
    nodes: str = ""
    elapsed: str = ""
    exit_code: int | None = None
    pid: int | None = None
    pid_start: str | None = None
    cancel_requested: bool = False
    ended: float | None = None
    updated: float = field(default_factory=time.time)
    failure: dict[str, Any] | None = None
    earlier_runs_s: int = 0
    run_start: float | None = None
    gpus: int | None = None
    after: str = ""  # the job it runs after (hpcgpu/launch/chain.py)
    key: int | None = None

    @property
    def is_array(self) -> bool:
        return bool(self.tasks)

    def task(self, task_id: str) -> TaskRecord | None:
        return next((t for t in self.tasks if t.id == task_id), None)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


_COLUMNS = [f.name for f in fields(JobRecord) if f.name != "key"]
_TASK_FIELDS = {f.name for f in fields(TaskRecord)}
_JOB_FIELDS = {f.name for f in fields(JobRecord)}



def units_of(job: JobRecord) -> Sequence[JobRecord | TaskRecord]:
    """What has a state of its own: the array tasks, or the job itself."""
    return job.tasks or [job]

def _to_row(job: JobRecord) -> dict[str, Any]:
    row = {name: getattr(job, name) for name in _COLUMNS}
    row["tasks"] = json.dumps([asdict(t) for t in job.tasks])
    row["cancel_requested"] = int(job.cancel_requested)
    row["failure"] = None if job.failure is None else json.dumps(job.failure)
    return row


def _from_row(row: sqlite3.Row) -> JobRecord:
    # columns or task keys that a newer hpcgpu may add are skipped: a shared registry stays readable
    data = {k: v for k, v in dict(row).items() if k in _JOB_FIELDS}
    data["tasks"] = [TaskRecord(**{k: v for k, v in t.items() if k in _TASK_FIELDS})
                     for t in json.loads(data["tasks"] or "[]")]
    data["cancel_requested"] = bool(data["cancel_requested"])
    data["failure"] = json.loads(data["failure"]) if data.get("failure") else None
    return JobRecord(**data)


SAY_WAIT_MS = 2_000  # a registry locked longer than this: say so, then wait on


def begin(db: sqlite3.Connection, path: Path) -> None:
    """BEGIN IMMEDIATE; a lock another hpcgpu holds is waited for, with a word after SAY_WAIT_MS."""
    db.execute(f"PRAGMA busy_timeout = {SAY_WAIT_MS}")
    try:
        db.execute("BEGIN IMMEDIATE")
        return
    except sqlite3.OperationalError as exc:
        if "locked" not in str(exc) and "busy" not in str(exc):
            raise
    finally:
        db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    print(f"hpcgpu: waiting for the job registry {path}: another hpcgpu holds its lock (up to "
          f"{BUSY_TIMEOUT_MS // 1000} s)", file=sys.stderr, flush=True)
    db.execute("BEGIN IMMEDIATE")


def registry_error(path: Path, exc: BaseException) -> HpcgpuError:
    """One line: a damaged file is not an unwritable one, and each has its own way out."""
    text = str(exc)
    if isinstance(exc, sqlite3.DatabaseError) and ("malformed" in text or "not a database" in text):
        return HpcgpuError(f"job registry {path} is damaged ({text}); nothing was submitted. Move it aside "
                           f"(mv {path} {path}.damaged) and run `hpcgpu registry rebuild RUNS_DIR` to recover "
                           "the jobs of a runs_dir from their run dirs")
    if "locked" in text or "busy" in text:
        return HpcgpuError(f"job registry {path}: still locked by another hpcgpu after {BUSY_TIMEOUT_MS // 1000} s "
                           f"({text}); try again, or set HPCGPU_REGISTRY to another file")
    return HpcgpuError(f"job registry {path}: {text} (set HPCGPU_REGISTRY to a writable file)")


class Registry:
    def __init__(self, path: Path | None = None):
        self.path = path or registry_path()
        self._db: sqlite3.Connection | None = None

    # --- connection -------------------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        if self._db is not None:
            return self._db
        try:
            make_private(self.path, tighten=self.path == default_registry_path())
            if not self.path.exists():
                self._make_file()
            db = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
            db.row_factory = sqlite3.Row
            db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            if db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:  # new, or an older hpcgpu's
                self._create(db, journal_mode_for(self.path))
        except (sqlite3.Error, OSError) as exc:
            raise registry_error(self.path, exc) from None
        self._db = db
        return db

    def check(self) -> None:
        """Before anything is submitted: the registry opens, passes sqlite's quick integrity check and
        takes a write lock, so a job never reaches the scheduler untracked. A registry not made yet is
        not made here (a refused submission leaves nothing): its folder must let the first job make it."""
        if not self.path.exists():
            folder = next(p for p in (self.path.parent, *self.path.parent.parents) if p.exists())
            if not os.access(folder, os.W_OK | os.X_OK):
                raise registry_error(self.path, PermissionError(f"cannot be made: {folder} is not writable"))
            return
        db = self._connect()
        try:
            verdict = db.execute("PRAGMA quick_check").fetchone()[0]
            if verdict != "ok":
                raise sqlite3.DatabaseError(f"database disk image is malformed ({verdict})")
            with self._transaction():
                pass
        except sqlite3.Error as exc:
            raise registry_error(self.path, exc) from None

    def _make_file(self) -> None:
        """A new registry appears whole: its schema and journal mode written in a file of its own, then
        linked under the registry's name, where the first of several submits racing to make it wins and
        the others use that one. (Made in place, a second process could open the empty file before the
        first had switched it to WAL and not see its rows: 20 parallel submits left 18 rows.)"""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.new")
        private_file(tmp)
        try:
            db = sqlite3.connect(str(tmp), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
            try:
                self._create(db, journal_mode_for(self.path))
            finally:
                db.close()  # the last connection: its WAL is checkpointed into the file and removed
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                pass
            except OSError:  # a filesystem without hard links: the rename can lose only such a race
                if not self.path.exists():
                    os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)

    @staticmethod
    def _create(db: sqlite3.Connection, journal_mode: str = "WAL") -> None:
        # WAL: readers never block the writer; switching needs a moment alone with the file,
        # which the busy timeout waits for when many first submissions race.
        db.execute(f"PRAGMA journal_mode = {journal_mode}")
        db.execute("BEGIN IMMEDIATE")
        try:
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            have = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
            for name, kind in ADDED_COLUMNS.items():
                if name not in have:  # a registry written by an older hpcgpu
                    db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken up front (BEGIN IMMEDIATE) so concurrent writers queue; a wait
        longer than SAY_WAIT_MS says so (then waits out BUSY_TIMEOUT_MS)."""
        db = self._connect()
        try:
            begin(db, self.path)
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise registry_error(self.path, exc) from None

    def _write(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        with self._transaction() as db:
            return db.execute(sql, params)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    # --- writes -----------------------------------------------------------------------------------
    def add(self, job: JobRecord) -> JobRecord:
        """Insert a job; a local job without an id gets `local-<key>` in the same transaction."""
        row = _to_row(job)
        names = ", ".join(row)
        marks = ", ".join(f":{n}" for n in row)
        with self._transaction() as db:
            key = db.execute(f"INSERT INTO jobs ({names}) VALUES ({marks})", row).lastrowid
            if not job.job_id:
                job.job_id = f"local-{key}"
                db.execute("UPDATE jobs SET job_id = ? WHERE key = ?", (job.job_id, key))
        job.key = key
        return job

    def save(self, job: JobRecord) -> None:
        """Write back a job's mutable fields (state, tasks, ...) after a refresh."""
        assert job.key is not None
        job.updated = time.time()
        row = _to_row(job)
        sets = ", ".join(f"{n} = :{n}" for n in row)
        self._write(f"UPDATE jobs SET {sets} WHERE key = :key", {**row, "key": job.key})

    def update(self, job: JobRecord, **changes: Any) -> None:
        for name, value in changes.items():
            setattr(job, name, value)
        self.save(job)

    # --- reads ------------------------------------------------------------------------------------
    def _select(self, where: str = "", params: Any = (), limit: int | None = None) -> list[JobRecord]:
        db = self._connect()
        sql = f"SELECT * FROM jobs {where} ORDER BY key DESC" + (f" LIMIT {int(limit)}" if limit else "")
        try:
            return [_from_row(r) for r in db.execute(sql, params)]
        except sqlite3.Error as exc:
            raise HpcgpuError(f"job registry {self.path}: {exc}") from None

    def find(self, ref: str) -> tuple[JobRecord, TaskRecord | None]:
        """A job by the id the user typed: `123`, `123_4` (an array task) or `local-7`.

        SLURM reuses ids after a controller reset: the newest submission with that id wins.
        """
        ref = ref.strip()
        rows = self._select("WHERE job_id = ?", (ref,), limit=1)
        if rows:
            return rows[0], None
        base, _, index = ref.partition("_")
        if index:
            for job in self._select("WHERE job_id = ? OR tasks LIKE ?", (base, f'%"{ref}"%'), limit=5):
                task = job.task(ref)
                if task is not None:
                    return job, task
        raise HpcgpuError(f"no job {ref!r} in the registry {self.path} (`hpcgpu list` shows the known ones)")

    def reread(self, job: JobRecord) -> JobRecord | None:
        """The job as the registry holds it now (another process may have saved it since it was read)."""
        if job.key is None:
            return None
        rows = self._select("WHERE key = ?", (job.key,), limit=1)
        return rows[0] if rows else None

    def with_run_dir(self, run_dir: str) -> list[JobRecord]:
        return self._select("WHERE run_dir = ?", (run_dir,))

    def recent(self, limit: int = 20) -> list[JobRecord]:
        return self._select(limit=limit)

    def all(self) -> list[JobRecord]:
        return self._select()

    def not_in_states(self, states: Collection[str]) -> list[JobRecord]:
        """Jobs whose recorded state is none of `states` (the state column is indexed)."""
        marks = ",".join("?" * len(states))
        return self._select(f"WHERE state NOT IN ({marks})", tuple(states))

    def count(self) -> int:
        return int(self._connect().execute("SELECT COUNT(*) FROM jobs").fetchone()[0])

