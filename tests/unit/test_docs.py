"""The docs stay true to the code where a machine can tell: docs/spec.md is what the schema's field help
renders to now (scripts/render_spec_docs.py, the script that writes it, as sbatch/ is kept current),
every relative link in README.md and docs/*.md points to a file that exists, and the README stays short
(the topics live in docs/)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from conftest import REPO


def renderer():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("render_spec_docs", REPO / "scripts" / "render_spec_docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RENDER = renderer()
REGENERATE = f"regenerate with: {RENDER.COMMAND}"
README_MAX_LINES = 220
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_spec_reference_is_what_the_schema_renders_now():
    problems = RENDER.problems()
    if problems:
        pytest.fail("\n".join(problems) + f"\n{REGENERATE}")


def test_every_spec_key_has_help():
    from hpcgpu.spec.reference import missing_help

    assert missing_help() == [], "give these fields a help text in hpcgpu/spec/schema.py (meta(...))"


def test_the_check_names_a_stale_and_a_missing_reference(tmp_path):
    want = RENDER.expected()
    stale = tmp_path / "spec.md"
    stale.write_text(want.replace("| `train.lr` |", "| `train.learning_rate` |"))
    found = RENDER.problems(want, stale)
    assert len(found) == 1 and "is stale" in found[0]
    assert "-| `train.learning_rate` |" in found[0] and "+| `train.lr` |" in found[0]
    assert RENDER.problems(want, tmp_path / "gone.md") == ["gone.md is missing"]


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text)
    return [target for target in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, spaces to '-', other punctuation dropped."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    heads = re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M)
    return {"".join(c for c in h.lower() if c.isalnum() or c in "-_ ").replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_relative_links_point_to_files_and_headings_that_exist(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path) if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no such heading in {file.resolve().relative_to(REPO)})")
    assert not broken, f"{page.relative_to(REPO)} has broken links: {broken}"


def test_readme_command_table_lists_every_command():
    from hpcgpu.cli import COMMANDS

    table = re.findall(r"^\| `hpcgpu ([a-z]+)", (REPO / "README.md").read_text(), flags=re.M)
    assert set(table) == set(COMMANDS), (f"README.md's command table and `hpcgpu --help` differ: "
                                         f"missing {sorted(set(COMMANDS) - set(table))}, "
                                         f"not a command {sorted(set(table) - set(COMMANDS))}")


def test_docs_pages_exist_and_readme_links_them():
    readme = relative_links(REPO / "README.md")
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert "spec.md" in pages
    unlinked = [name for name in pages if f"docs/{name}" not in {t.split("#")[0] for t in readme}]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_readme_stays_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines (at most {README_MAX_LINES}): "
                                       "put the detail in a docs/ page and link it")


# The newcomer test of docs/architecture.md: each "where is X" is answered by its code map in one look,
# and the answer is still true (the file holds the name the map gives).
WHERE_IS = {
    "the sbatch template": ("hpcgpu/launch/templates/job.sbatch", None),
    "the signal handler": ("hpcgpu/runtime/signals.py", "class StopSignals"),
    "the checkpoint save": ("hpcgpu/runtime/checkpoint.py", "def save("),
    "the infer batching": ("hpcgpu/runtime/tasks/infer.py", "def make_batches("),
    "the slot engine": ("hpcgpu/runtime/slots.py", "class SlotEngine"),
    "the DDP wrap": ("hpcgpu/runtime/strategies/ddp.py", "def wrap_ddp("),
    "the registry schema": ("hpcgpu/launch/registry.py", "SCHEMA = "),
    "the queue's GPU pick": ("hpcgpu/launch/queue.py", "def take("),
    "the estimate formula": ("hpcgpu/gpu/estimate.py", "def infer_row_bytes("),
    "the one stop": ("hpcgpu/runtime/stop.py", "def stop_job("),
    "the one resolve step": ("hpcgpu/launch/resolve.py", "def resolve("),
}


@pytest.mark.parametrize("what", sorted(WHERE_IS))
def test_architecture_code_map_answers_where_is(what):
    path, name = WHERE_IS[what]
    arch = (REPO / "docs" / "architecture.md").read_text()
    short = path.removeprefix("hpcgpu/").removeprefix("runtime/").removeprefix("launch/").removeprefix("gpu/")
    assert what in arch and short in arch, f"docs/architecture.md should say where {what} is ({path})"
    text = (REPO / path).read_text()
    assert name is None or name in text, f"{path} no longer holds {name!r}: update docs/architecture.md"


# ... and each "where to add" question: the bullet names the registry and its file, and the file holds it
WHERE_TO_ADD = {
    "A task": ("runtime/tasks/__init__.py", "TASKS", "TASKS: dict[str, Task] = {"),
    "A strategy": ("runtime/strategies/__init__.py", "STRATEGIES", "STRATEGIES: dict[str, type[Strategy]] = {"),
    "A launcher": ("runtime/env.py", "LAUNCHERS", "LAUNCHERS = {"),
    "An executor": ("launch/executors.py", "EXECUTORS", "EXECUTORS: dict[str, Executor] = {"),
}


@pytest.mark.parametrize("what", sorted(WHERE_TO_ADD))
def test_architecture_says_where_to_add(what):
    path, registry, definition = WHERE_TO_ADD[what]
    arch = (REPO / "docs" / "architecture.md").read_text()
    section = arch.split("## Where to add", 1)[-1].split("\n## ", 1)[0]
    bullet = next((b for b in section.split("\n- ") if b.lstrip("- ").startswith(f"**{what}**")), "")
    assert path in bullet and f"`{registry}`" in bullet, \
        f"docs/architecture.md's 'Where to add' should name {registry} in {path} for {what.lower()}"
    assert definition in (REPO / "hpcgpu" / path).read_text(), f"hpcgpu/{path} no longer defines {registry}"


def test_every_task_the_spec_allows_has_its_registry_line():
    from typing import get_args, get_type_hints

    from hpcgpu.runtime.tasks import TASKS
    from hpcgpu.spec.schema import Spec

    assert set(get_args(get_type_hints(Spec)["task"])) == set(TASKS)
