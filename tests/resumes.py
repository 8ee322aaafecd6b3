"""What a resumed train run's metrics.jsonl must show, for every resume test (tests/unit, tests/slurm).

Comparing a resumed run's losses with an uninterrupted run's proves nothing on its own: a deterministic
CPU run that silently started again from step 0 gives the same losses. So a resume test also asserts,
from the records the job wrote, that it resumed once per restart, from the checkpoint its stop saved,
and that no step up to that checkpoint ran twice.
"""
from __future__ import annotations

import json
from pathlib import Path


def run_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl in order; a last line cut short by a kill is left out."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def assert_resumed(run_dir: Path, restarts: int = 1, at: list[int] | None = None) -> list[dict]:
    """Asserts that the run in `run_dir` resumed `restarts` times, each time from the checkpoint of the
    stop record before it, or from the steps `at` where the test knows better (a kill leaves no stop
    record, a damaged newest checkpoint sends the resume to an older one), and that no step up to a
    resume's step was logged twice; returns the resume records."""
    records = run_records(run_dir)
    resumes = [r for r in records if r["kind"] == "resume"]
    assert len(resumes) == restarts, f"{len(resumes)} resume record(s) for {restarts} restart(s): {resumes}"
    stops = stops_before_resumes(records)
    for i, (resume, stop) in enumerate(zip(resumes, stops)):
        assert stop is not None or at is not None, f"a resume with no stop record before it: {resume}"
        step = at[i] if at is not None else stop["step"]  # type: ignore[index]
        assert (resume["step"], resume["checkpoint"]) == (step, f"step-{step:08d}"), (resume, stop, at)
    assert_no_step_ran_twice(records)
    assert_starts_follow_resumes(records)
    return resumes


def stops_before_resumes(records: list[dict]) -> list[dict | None]:
    """For each resume, the stop record since the previous start's resume (None: that start was killed)."""
    out: list[dict | None] = []
    stop = None
    for r in records:
        if r["kind"] == "stop":
            stop = r
        elif r["kind"] == "resume":
            out.append(stop)
            stop = None
    return out


def assert_no_step_ran_twice(records: list[dict]) -> None:
    """The steps a run kept: a resume at step s drops the steps logged after s (a killed attempt ran them
    past its last checkpoint), and any step logged again must be one of those."""
    kept: list[int] = []
    for r in records:
        if r["kind"] == "resume":
            kept = [s for s in kept if s <= r["step"]]
        elif r["kind"] == "train":
            assert r["step"] not in kept, f"step {r['step']} ran twice; steps kept before it: {kept}"
            kept.append(r["step"])


def assert_starts_follow_resumes(records: list[dict]) -> None:
    """Each later start's first step (its "startup" record, train task) comes after its resume's step."""
    first = [r["step"] for r in records if r["kind"] == "startup"]
    resumed = [r["step"] for r in records if r["kind"] == "resume"]
    assert all(f > s for f, s in zip(first[1:], resumed)), f"starts' first steps {first}, resumes {resumed}"
