"""The package's import graph, read from the source (ast): no cycles, and the layers import downward
only (docs/architecture.md, "Code map"). A new cycle or a sideways import fails here, named."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hpcgpu"

# package -> packages of ours it must never import (at module level, in a function, or for types)
FORBIDDEN = {
    "hpcgpu.spec": ("hpcgpu.launch", "hpcgpu.runtime", "hpcgpu.cli", "hpcgpu.gpu", "hpcgpu.report",
                    "hpcgpu.data"),
    "hpcgpu.gpu": ("hpcgpu.launch", "hpcgpu.runtime", "hpcgpu.cli", "hpcgpu.report"),
    "hpcgpu.launch": ("hpcgpu.runtime", "hpcgpu.cli"),
    "hpcgpu.report": ("hpcgpu.runtime", "hpcgpu.cli"),
    "hpcgpu.data": ("hpcgpu.runtime", "hpcgpu.launch", "hpcgpu.cli"),
    "hpcgpu.runtime": ("hpcgpu.cli", "hpcgpu.launch"),
    "hpcgpu.cli": ("hpcgpu.runtime",),
}
# the one door from the host into the job: `hpcgpu run` starts the task (torch loads only there)
ALLOWED = {("hpcgpu.cli.run", "hpcgpu.runtime.tasks")}


def module_files() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def imported(module: str, path: Path, node: ast.Import | ast.ImportFrom, mods: dict[str, Path]) -> set[str]:
    """Our modules an import statement loads: `from pkg import sub` is the submodule, not pkg."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
        names = subs if len(subs) == len(node.names) else [base, *subs]
    return {n for n in names if n in mods and n != module and not module.startswith(n + ".")}


def import_graph() -> dict[str, set[str]]:
    """Every import counts, also those inside functions and under TYPE_CHECKING: a cycle hidden in a
    function or behind a type annotation is still a cycle of who depends on whom."""
    mods = module_files()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module] |= imported(module, path, node, mods)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            nxt = next((w for w in edges if w not in index or w in stack), None)
            if nxt is not None and nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
                continue
            if nxt is not None:
                low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_layers_import_downward_only():
    wrong = []
    for module, targets in import_graph().items():
        for package, banned in FORBIDDEN.items():
            if module == package or module.startswith(package + "."):
                wrong += [f"{module} -> {t}" for t in sorted(targets)
                          if t.startswith(banned) and (module, t) not in ALLOWED]
    assert wrong == []
