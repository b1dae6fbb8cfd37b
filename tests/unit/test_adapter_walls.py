"""The adapters only adapt: zero_strategy/lightning/ and zero_strategy/fabric/ issue no collective and import no
torch.distributed, and hold no logic that could live without Lightning. Lightning's strategy API (``barrier``,
``broadcast``, ``reduce``/``all_reduce``) and the process group's set-up are the shared plumbing's
(zero_strategy/adapter_plumbing/), which delegates to core/comm/control.py; a module allowed either exception is
named below with the reason."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "zero_strategy"
ADAPTERS = ("lightning", "fabric", "adapter_plumbing")

# torch.distributed's collectives, Lightning's reductions and the methods of our Comm (core/comm/comm.py)
COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object", "broadcast_object_list", "barrier", "monitored_barrier", "send", "recv",
    "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "scatter_object_list", "gather", "gather_object", "barrier_on",
    "broadcast_object_on", "_sync_ddp", "_sync_ddp_if_available", "_all_gather_ddp_if_available",
})
# modules whose functions issue collectives: importing them is issuing collectives
COLLECTIVE_MODULES = ("torch.distributed", "zero_strategy.core.comm.control", "zero_strategy.core.comm.backend")

PLUMBING = {  # module -> why it may import torch.distributed and call collectives
    "zero_strategy/adapter_plumbing/process_group.py": "creates and destroys the default process group and "
    "implements Lightning's strategy collectives (barrier, broadcast, reduce) for both adapters, through "
    "core/comm/control.py and Lightning's own reduction",
}
LIGHTNING_FREE = {  # adapter modules that import no Lightning yet are adapter code: what each adapts
    "zero_strategy/lightning/hook_state_dict.py": "what edits in Lightning's on_save/on_load_checkpoint hooks mean",
    "zero_strategy/lightning/private_tensors.py": "the remedy for tensors Lightning's spawn launcher leaves shared",
    "zero_strategy/fabric/optimizer_class.py": "zero_grad through Fabric's _FabricOptimizer wrapper",
    "zero_strategy/fabric/sharded_modules.py": "the modules Fabric's setup_module/setup_optimizers set up, in "
    "Fabric's order",
    "zero_strategy/lightning/sharded_model.py": "the engine across the Trainer's runs (fit, validate, test) and what "
    "trainer.save_checkpoint writes in each of its states",
    "zero_strategy/adapter_plumbing/precision_takeover.py": "one Lightning connector's precision choice",
    "zero_strategy/adapter_plumbing/forward_entry.py": "the module handed to Lightning as its forward module",
    "zero_strategy/adapter_plumbing/strategy_options.py": "the Lightning strategies' constructor arguments",
    "zero_strategy/fabric/tensor_parallel.py": "the parallelize_fn of Fabric's ModelParallelStrategy",
}


def _adapter_files() -> list[Path]:
    return sorted(p for room in ADAPTERS for p in (PACKAGE / room).rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _imported_from(tree: ast.AST) -> dict[str, str]:
    """Local name -> the module it was imported from (``from m import n``) or the module itself (``import m``)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name
    return names


def collective_uses(source: str) -> list[str]:
    """Every import of a collective module and every collective call in ``source``, as "line: what". A call on
    ``self`` is the strategy's own Lightning method (its body is checked where it is defined); a bare name imported
    from the plumbing is the plumbing's."""
    tree = ast.parse(source)
    imported = _imported_from(tree)
    found = []
    for node in ast.walk(tree):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for module in modules:
            if any(module == bad or module.startswith(bad + ".") for bad in COLLECTIVE_MODULES):
                found.append(f"{node.lineno}: imports {module}")
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if alias.name in COLLECTIVES and not node.module.startswith("zero_strategy.adapter_plumbing."):
                    found.append(f"{node.lineno}: imports the collective {node.module}.{alias.name}")
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in COLLECTIVES:
            receiver = func.value
            if isinstance(receiver, ast.Name) and receiver.id == "self":
                continue
            if isinstance(receiver, ast.Name) and imported.get(receiver.id, "").startswith(
                    "zero_strategy.adapter_plumbing."):
                continue
            found.append(f"{node.lineno}: calls {ast.unparse(func)}")
        elif isinstance(func, ast.Name) and func.id in COLLECTIVES:
            if not imported.get(func.id, "").startswith("zero_strategy.adapter_plumbing."):
                found.append(f"{node.lineno}: calls {func.id}")
    return found


@pytest.mark.timeout(30)
def test_no_collective_and_no_torch_distributed_in_the_adapters():
    offenders = {}
    for path in _adapter_files():
        if _rel(path) in PLUMBING:
            continue
        uses = collective_uses(path.read_text())
        if uses:
            offenders[_rel(path)] = uses
    assert offenders == {}, (
        "the adapters issue no collectives: call the engine, the checkpoint code or adapter_plumbing/process_group.py"
    )
    assert all((REPO / p).exists() for p in PLUMBING), "a listed module no longer exists: remove it"


def _is_alias(tree: ast.Module) -> bool:
    """A module kept for an old import path: a docstring, imports and ``__all__`` only."""
    body = [node for node in tree.body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    return all(isinstance(node, (ast.Import, ast.ImportFrom)) or (
        isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"]) for node in body)


def _imports_lightning(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        if any(name.split(".")[0] in {"lightning", "lightning_utilities", "zero_strategy"} and (
                name.split(".")[0] != "zero_strategy" or name.split(".")[1:2] in (["lightning"], ["fabric"]))
               for name in names):
            return True
    return False


@pytest.mark.timeout(30)
def test_adapter_modules_need_lightning():
    """A module in the adapters or their plumbing imports Lightning (or an adapter module that does), is an alias
    kept for an old import path, or is listed with what it adapts: logic that needs no Lightning lives below."""
    lightning_free = []
    for path in _adapter_files():
        tree = ast.parse(path.read_text())
        if path.name in ("__init__.py", "__main__.py") or _is_alias(tree) or _rel(path) in LIGHTNING_FREE:
            continue
        if not _imports_lightning(tree):
            lightning_free.append(_rel(path))
    assert lightning_free == [], "move Lightning-free logic below the adapters (core/, checkpoint/, initial_values.py)"
    assert all((REPO / p).exists() for p in LIGHTNING_FREE), "a listed module no longer exists: remove it"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("planted, what", [
    ("import torch.distributed as dist\n", "imports torch.distributed"),
    ("from torch.distributed import all_reduce\n", "imports torch.distributed"),
    ("def f(flat):\n    flat.comm.all_gather(None, None, 'x')\n", "calls flat.comm.all_gather"),
    ("def f(strategy):\n    strategy.engine.comms.world.barrier('x')\n", "calls strategy.engine.comms.world.barrier"),
    ("from zero_strategy.core.comm.control import barrier\n", "imports zero_strategy.core.comm.control"),
    ("from lightning.fabric.utilities.distributed import _sync_ddp_if_available\n", "imports the collective"),
])
def test_the_wall_check_sees_a_planted_collective(planted, what):
    assert any(what in use for use in collective_uses(textwrap.dedent(planted))), collective_uses(planted)


@pytest.mark.timeout(30)
def test_the_wall_check_allows_the_plumbing_and_the_strategy_api():
    allowed = textwrap.dedent("""
        from zero_strategy.adapter_plumbing.process_group import barrier, broadcast_object
        from zero_strategy.adapter_plumbing import process_group
        class S:
            def barrier(self):
                barrier()
            def save(self, path):
                return self.broadcast(broadcast_object(path)), process_group.reduce_tensor(1, None, "mean")
    """)
    assert collective_uses(allowed) == []


@pytest.mark.timeout(30)
def test_the_lightning_check_sees_lightning_free_logic():
    assert not _imports_lightning(ast.parse("import torch\ndef f():\n    return torch.zeros(1)\n"))
    assert _imports_lightning(ast.parse("from lightning.pytorch import Trainer\n"))
    assert not _is_alias(ast.parse("from x import y\ndef f():\n    return y\n"))
    assert _is_alias(ast.parse('"""Moved."""\nfrom x import y\n__all__ = ["y"]\n'))
