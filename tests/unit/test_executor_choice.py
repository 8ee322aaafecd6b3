"""Executors and launchers are objects, chosen once (issue #43): the host's in hpcgpu/launch/executors.py
(`executor_named`), the job's in hpcgpu/runtime/env.py (`launcher_named`, not scanned: it is the choice).
Anywhere else in launch/, cli/, runtime/requeue.py and the command task, a comparison with an executor's
or a launcher's name (`== "local"`, `!= "slurm"`, `in ("slurm", "local")`) is a branch that belongs in
the executor or launcher object; this test names each one it finds (read from the source, ast)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("hpcgpu/launch", "hpcgpu/cli", "hpcgpu/runtime/requeue.py", "hpcgpu/runtime/tasks/command.py")
NAMES = frozenset({"local", "slurm", "torchrun", "single"})
# file -> the functions where a name may be compared: the choice itself
CHOICE = {"hpcgpu/launch/executors.py": {"executor_named"}}
OPERATORS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def names_in(node: ast.expr) -> set[str]:
    """The executor/launcher names a compared operand spells: a string, or strings in a tuple/list/set."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)} & NAMES


def name_comparisons(source: str, allowed: set[str] = frozenset()) -> list[tuple[int, str]]:
    """(line, names) of each comparison with an executor's or launcher's name outside `allowed` functions."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Compare) and function not in allowed \
                and any(isinstance(op, OPERATORS) for op in node.ops):
            names = set().union(*(names_in(operand) for operand in (node.left, *node.comparators)))
            if names:
                found.append((node.lineno, ", ".join(sorted(names))))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), "")
    return found


def scanned_files() -> list[Path]:
    files: list[Path] = []
    for entry in SCANNED:
        path = ROOT / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def test_no_executor_or_launcher_name_is_compared_outside_the_choice() -> None:
    found = []
    for path in scanned_files():
        rel = path.relative_to(ROOT).as_posix()
        found += [f"{rel}:{line}: compares with {names}"
                  for line, names in name_comparisons(path.read_text(), CHOICE.get(rel, set()))]
    assert found == []


def test_the_scan_finds_each_kind_of_comparison() -> None:
    source = ('def f(job, env):\n'
              '    if job.executor == "local": pass\n'
              '    if "slurm" != env.launcher: pass\n'
              '    return env.launcher in ("slurm", "local") or job.state == "RUNNING"\n'
              'def executor_named(name):\n'
              '    return name == "slurm"\n')
    assert name_comparisons(source, {"executor_named"}) == [(2, "local"), (3, "slurm"), (4, "local, slurm")]
    assert len(name_comparisons(source)) == 4
