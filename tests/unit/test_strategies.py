"""runtime/strategies/: the registry, the DDP arguments each loop gets from distributed.ddp, and the
rule that nothing outside the plan and the registry asks which strategy runs."""
from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

import hpcgpu.runtime
from hpcgpu.runtime.strategies import STRATEGIES, lone_rank_group
from hpcgpu.runtime.strategies.ddp import ddp_options
from hpcgpu.spec import spec_from_raw
from hpcgpu.spec.schema import Distributed

RUNTIME = Path(hpcgpu.runtime.__file__).parent
# the plan decides the name, the registry maps it to its class: the only places that may compare names
DECIDE = {RUNTIME / "plan.py", RUNTIME / "strategies" / "__init__.py"}


def spec_of(ddp: dict | None = None):  # type: ignore[no-untyped-def]
    return spec_from_raw({"name": "s", "task": "train", "model": {"config": {"model_type": "gpt2"}},
                          "data": {"train": __file__}, "distributed": {"strategy": "ddp", "ddp": ddp or {}}})


def test_a_compiled_model_gets_large_buckets_and_any_other_torchs() -> None:
    # a compiled model is split into a graph per bucket: fewer, larger buckets launch fewer graphs
    assert ddp_options(spec_of(), own_loop=True, compiled=True)["bucket_cap_mb"] == 100
    assert ddp_options(spec_of(), compiled=True)["bucket_cap_mb"] == 100  # ctx.prepare of a compiled model
    assert ddp_options(spec_of(), own_loop=True, compiled=False)["bucket_cap_mb"] == 25
    assert ddp_options(spec_of())["bucket_cap_mb"] == 25
    assert ddp_options(None)["bucket_cap_mb"] == 25


def test_ctx_prepare_sees_a_model_compiled_either_way() -> None:
    import torch

    from hpcgpu.runtime.strategies.ddp import is_compiled

    assert not is_compiled(torch.nn.Linear(2, 2))
    assert is_compiled(torch.compile(torch.nn.Linear(2, 2)))  # compiles lazily: nothing runs here
    in_place = torch.nn.Linear(2, 2)
    in_place.compile()
    assert is_compiled(in_place)


def test_a_bucket_size_given_in_the_spec_is_passed_as_written() -> None:
    assert ddp_options(spec_of({"bucket_cap_mb": 7}), own_loop=True, compiled=True)["bucket_cap_mb"] == 7


# ---------------------------------------------------------------- the registry

def test_every_name_the_spec_allows_has_one_strategy_registered_under_it() -> None:
    allowed = set(typing.get_args(typing.get_type_hints(Distributed)["strategy"])) - {"auto"}
    assert set(STRATEGIES) == allowed
    assert all(cls.name == name for name, cls in STRATEGIES.items())


def test_a_lone_rank_gets_a_group_where_the_strategy_needs_one() -> None:
    assert [name for name in STRATEGIES if lone_rank_group(name)] == ["fsdp", "deepspeed"]
    assert not lone_rank_group("auto")  # not chosen yet: the plan decides, and the train task starts it then


# ---------------------------------------------------------------- no strategy names outside the choice

def name_questions(source: str, names: set[str]) -> list[str]:
    """Where `source` asks for a strategy by name: a comparison with a name (`== "ddp"`, `in ("fsdp",
    "deepspeed")`, a match case), a table keyed by names, or a `.ds` attribute (the DeepSpeed run as
    a flag). "none" is also quantization's word: it counts where the comparison mentions a strategy."""
    found = []
    for node in ast.walk(ast.parse(source)):
        literals: set[str] = set()
        if isinstance(node, ast.Compare):
            literals = {c.value for part in (node.left, *node.comparators) for c in ast.walk(part)
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        elif isinstance(node, ast.Dict):
            literals = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant):
            literals = {node.value.value} if isinstance(node.value.value, str) else set()
        elif isinstance(node, ast.Attribute) and node.attr == "ds":
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
            continue
        hits = literals & names
        if hits == {"none"} and "strateg" not in ast.unparse(node).lower():
            hits = set()
        if hits:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_finds_each_way_of_asking_for_a_strategy_by_name() -> None:
    asks = ['if plan.training.strategy == "ddp": pass', 'x = t.strategy in ("deepspeed", "fsdp")',
            'if self.ds is not None: pass', 'x = {"fsdp": 1}', 'match s:\n    case "deepspeed":\n        pass',
            'if self.strategy != "none": pass']
    for source in asks:
        assert name_questions(source, set(STRATEGIES)), source
    assert not name_questions('if spec.model.quantization != "none": pass', set(STRATEGIES))


def test_only_the_plan_and_the_registry_ask_which_strategy_runs() -> None:
    """The train task, ctx.prepare and the training ask the strategy object, never its name."""
    asked = {str(path.relative_to(RUNTIME)): found for path in sorted(RUNTIME.rglob("*.py")) if path not in DECIDE
             for found in [name_questions(path.read_text(), set(STRATEGIES))] if found}
    assert asked == {}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_each_strategy_is_a_module_of_its_own(name: str) -> None:
    module = STRATEGIES[name].__module__
    assert module.startswith("hpcgpu.runtime.strategies.") and module.count(".") == 3
