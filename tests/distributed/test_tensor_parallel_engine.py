"""The ZeRO engine over the data-parallel group of a 2 x 2 mesh, with tensor-parallel (DTensor) parameters: the
three quantities that cross the TP dimension, against one process without TP (issue 36).

- the global gradient norm (what clipping scales by): TP-sharded blocks summed over the TP ranks, replicated
  parameters counted once;
- per-parameter gradient norms (``zero_strategy.grad_norm``'s source), the same way;
- the fp16 overflow decision: an inf in one TP rank's block only makes every rank of the world skip.
Each runs at stages 1/2/3, stage 3 on one host's shared memory and on the network path (point-to-point), all
in one launch of 4 ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.tp_toy import apply_plan, global_batch, loss_of, make_model
from torch.distributed.device_mesh import init_device_mesh

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.plan.topology import RankLayout, TensorParallelGroup, Topology
from zero_strategy.testing import run_ranks

WORLD, TP, ROWS = 4, 2, 2  # ROWS per data-parallel rank


def _engine(stage: int, collectives: str) -> tuple[ZeroEngine, Any, torch.optim.Optimizer, Any]:
    mesh = init_device_mesh("cpu", (WORLD // TP, TP), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = make_model()
    apply_plan(model, mesh["tensor_parallel"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    place = TensorParallelGroup(mesh.get_group("tensor_parallel"), mesh.get_local_rank("tensor_parallel"), TP)
    layout = RankLayout(Topology.one_node(WORLD), mesh.get_group("data_parallel"), tensor_parallel=place)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, collectives=collectives), layout)
    data_rank = mesh.get_local_rank("data_parallel")
    tokens, targets = global_batch(0, ROWS * WORLD // TP)
    rows = slice(data_rank * ROWS, (data_rank + 1) * ROWS)
    loss_of(model, (tokens[rows], targets[rows])).backward()
    return engine, model, optimizer, mesh


def norms_on_rank(rank: int, world: int, stage: int, collectives: str) -> dict[str, Any]:
    engine, model, optimizer, _ = _engine(stage, collectives)
    names = [name for name, _ in model.named_parameters()]
    per_parameter = engine.parameter_grad_norms(list(model.parameters()), 2.0)
    result = {"global": engine.grad_norm(optimizer, 2.0), "inf": engine.grad_norm(optimizer, float("inf")),
              "per_parameter": dict(zip(names, per_parameter, strict=True))}
    engine.release()
    return result


def overflow_on_rank(rank: int, world: int, stage: int, collectives: str) -> bool:
    """An inf planted in rank 1's slice of a TP-sharded FlatParam only (rank 1: TP coordinate 1, DP rank 0)."""
    engine, _, optimizer, _ = _engine(stage, collectives)
    index = engine.optimizer_index(optimizer)
    engine.windows.reduce(index)
    if dist.get_rank() == 1:
        flat = next(f for f in engine.windows.flats_of(index) if f.spec.tensor_sharded)
        next(piece for piece in flat.master_pieces if piece.grad is not None).grad[0] = float("inf")
    overflow = engine.unscale_and_check_overflow(optimizer, 1.0)
    engine.windows.discard(index)
    engine.release()
    return overflow


def _reference() -> tuple[float, float, dict[str, float]]:
    model = make_model()
    loss_of(model, global_batch(0, ROWS * WORLD // TP)).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    total = torch.stack([g.double().pow(2).sum() for g in grads.values()]).sum().sqrt().item()
    largest = torch.stack([g.abs().max() for g in grads.values()]).max().item()  # NaN propagates
    return total, largest, {name: g.double().norm().item() for name, g in grads.items()}


CASES = [(1, "auto"), (2, "auto"), (3, "auto"), (3, "point_to_point")]


def each_case(rank: int, world: int) -> dict[tuple[int, str], dict[str, Any]]:
    """Every case in one launch (a fresh engine, model and mesh each): its norms and its overflow decision."""
    return {(stage, collectives): {"norms": norms_on_rank(rank, world, stage, collectives),
                                   "overflow": overflow_on_rank(rank, world, stage, collectives)}
            for stage, collectives in CASES}


@pytest.fixture(scope="module")
def runs() -> list[dict[tuple[int, str], dict[str, Any]]]:
    return run_ranks(each_case, WORLD, timeout_s=250)


# Each timeout covers the launch of every case if its test is the first to use `runs`.
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stage", "collectives"), CASES)
def test_norms_cross_the_tensor_parallel_group(runs: list[dict[tuple[int, str], dict[str, Any]]], stage: int,
                                               collectives: str) -> None:  # fmt: skip
    total, largest, per_parameter = _reference()
    for rank, ranks_cases in enumerate(runs):
        result = ranks_cases[(stage, collectives)]["norms"]
        assert abs(result["global"].item() - total) <= 1e-5 * total, (rank, result["global"], total)
        assert abs(result["inf"].item() - largest) <= 1e-6 * largest, (rank, result["inf"], largest)
        assert result["per_parameter"].keys() == per_parameter.keys()
        for name, expected in per_parameter.items():
            got = result["per_parameter"][name]
            assert got is not None and abs(got.item() - expected) <= 1e-5 * expected + 1e-9, (rank, name, got)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stage", "collectives"), CASES)
def test_an_overflow_in_one_tensor_parallel_block_is_agreed_by_every_rank(
    runs: list[dict[tuple[int, str], dict[str, Any]]], stage: int, collectives: str
) -> None:
    assert [ranks_cases[(stage, collectives)]["overflow"] for ranks_cases in runs] == [True] * WORLD
