"""Fabric with tensor parallelism: ``ZeroFabricStrategy(stage=s, tensor_parallel_size=2, parallelize_fn=fn)`` on 4
CPU ranks (2 data-parallel x 2 tensor-parallel) trains tests/helpers/tp_toy.py's ToyNet equal to the single-process
reference and to Lightning's Fabric ``ModelParallelStrategy`` with the same plan, gradients clipped by their global
norm (over both mesh dimensions); the mesh is ModelParallelStrategy's and the sampler's ranks are the data-parallel
ones. Stages 1, 2, 3 (stage 3 on both transports) and ModelParallelStrategy run one after another in one launch of 4
ranks that run_ranks forks and Fabric takes for ranks torchrun started. Also: a bad ``parallelize_fn`` (a lambda
with the spawn launcher, an optimizer set up with the module it replaced the parameters of) is refused with the
remedy. ``fabric.save``/``load`` of a tensor-parallel module: tests/fabric/test_fabric_tp_checkpoint.py."""

from __future__ import annotations

import itertools
import pickle
from typing import Any

import pytest
import torch
from helpers.compare import assert_state_close, assert_values_close
from helpers.launched import as_launched_rank
from helpers.tp_toy import (
    SEQ,
    Tokens,
    ToyNet,
    apply_plan,
    full_state,
    global_batch,
    loss_of,
    make_model,
    reference_states,
)
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader

from zero_strategy import ZeroFabricStrategy
from zero_strategy.testing import run_ranks

WORLD, TP, ROWS, STEPS, LR, CLIP = 4, 2, 2, 3, 1e-2, 0.5  # ROWS per data-parallel rank and step
SAMPLES = 64  # global_batch's dataset size
DP = WORLD // TP
_ROW, _COL, _REP = ["Shard(dim=0)"], ["Shard(dim=1)"], ["Replicate()"]
PLACEMENTS = {
    "emb.weight": _ROW, "norm.weight": _REP, "norm.bias": _REP, "out.weight": _ROW,
    **{f"blocks.{i}.{key}": value for i in range(2) for key, value in (
        ("norm.weight", _REP), ("norm.bias", _REP), ("w1.weight", _ROW), ("w1.bias", _ROW), ("w2.weight", _COL),
        ("w2.bias", _REP))},
}
PLACEMENTS = {key: (("tensor_parallel",), value) for key, value in PLACEMENTS.items()}
ZERO = {
    "zero1": dict(stage=1),
    "zero2": dict(stage=2),
    "zero3": dict(stage=3, collectives="auto"),
    "zero3_point_to_point": dict(stage=3, collectives="point_to_point"),
}


def parallelize(model: ToyNet, mesh: Any) -> ToyNet:
    """The plan alone: ZeRO shards over ``data_parallel`` itself (top level: the spawn launcher pickles it)."""
    apply_plan(model, mesh["tensor_parallel"])
    return model


def parallelize_and_shard(model: ToyNet, mesh: Any) -> ToyNet:
    """What ModelParallelStrategy needs for data-parallel gradient averaging: FSDP2 over ``data_parallel`` per block
    and on the root, after the plan."""
    from torch.distributed.fsdp import fully_shard

    apply_plan(model, mesh["tensor_parallel"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _strategy(name: str) -> Any:
    if name == "model_parallel":
        return ModelParallelStrategy(parallelize_fn=parallelize_and_shard, data_parallel_size=DP,
                                     tensor_parallel_size=TP)
    return ZeroFabricStrategy(**ZERO[name], tensor_parallel_size=TP, parallelize_fn=parallelize,
                              process_group_timeout_s=120.0)


def _rows(step: int, data_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``data_rank``'s rows of step ``step``'s global batch (its TP ranks see the same rows)."""
    tokens, targets = global_batch(step, ROWS * DP)
    picked = slice(data_rank * ROWS, (data_rank + 1) * ROWS)
    return tokens[picked], targets[picked]


def train_each(rank: int, world: int) -> dict[str, Any]:
    """Each strategy: setup_module, AdamW, setup_optimizers, setup_dataloaders, STEPS steps clipped at CLIP; the
    full trained state, the norms clip_gradients returned, the mesh and the sampler's ranks."""
    as_launched_rank(rank, world)
    out: dict[str, Any] = {}
    for name in (*ZERO, "model_parallel"):
        fabric = Fabric(strategy=_strategy(name), accelerator="cpu", devices=world, precision="32-true")
        fabric.launch()
        model = fabric.setup_module(make_model())
        optimizer: Any = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
        fabric.seed_everything(0)  # the sampler's shuffle seed, the one global_batch assumes
        # Fabric's sampler deals Tokens to the data-parallel ranks (a TP group's ranks get the same rows): each step
        # the ranks together take the global batch of reference_states (see global_batch)
        loader = fabric.setup_dataloaders(DataLoader(Tokens(SAMPLES), batch_size=ROWS, shuffle=True))
        norms = []
        for batch in itertools.islice(loader, STEPS):
            fabric.backward(loss_of(model, batch))
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=CLIP)))
            optimizer.step()
            optimizer.zero_grad()
        mesh = fabric.strategy.device_mesh
        result: dict[str, Any] = {
            "state": full_state(model), "norms": norms, "sampler": fabric.strategy.distributed_sampler_kwargs,
            "mesh": (mesh.mesh_dim_names, mesh.mesh.tolist()),
            "placements": {key: (param.device_mesh.mesh_dim_names, [repr(p) for p in param.placements])
                           for key, param in model.module.named_parameters()},
        }
        out[name] = result
        fabric.barrier()
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(train_each, WORLD, timeout_s=900, pg_timeout_s=120)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return reference_states(STEPS, ROWS * DP, lr=LR, clip=CLIP)


def _reference_norms() -> list[float]:
    """The global gradient norm before clipping at each step of the single-process reference."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        loss_of(model, global_batch(step, ROWS * DP)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    return norms


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", list(ZERO))
def test_zero_with_tensor_parallel_trains_the_reference_and_model_parallel_weights(
        runs: list[dict[str, Any]], reference: dict[str, torch.Tensor], name: str) -> None:
    norms = _reference_norms()
    assert all(norm > CLIP for norm in norms), norms  # the clip acts at every step: its norm is what is tested
    for rank, result in enumerate(runs):
        got, model_parallel = result[name], result["model_parallel"]
        assert_state_close(got["state"], reference, rel=1e-5, what=f"rank {rank} {name} vs one process")
        assert_state_close(got["state"], model_parallel["state"], rel=1e-5,
                           what=f"rank {rank} {name} vs ModelParallelStrategy")
        assert_state_close(model_parallel["state"], reference, rel=1e-5, what=f"rank {rank} ModelParallelStrategy")
        assert_values_close(got["norms"], norms, rel=1e-5, what=f"rank {rank} {name} clip_gradients norms")
        # the plan was applied: every parameter is a DTensor over the tensor-parallel dimension, as the plan says
        assert got["placements"] == PLACEMENTS, (rank, got["placements"])
        assert got["mesh"] == model_parallel["mesh"] == (("data_parallel", "tensor_parallel"), [[0, 1], [2, 3]])
        assert got["sampler"] == model_parallel["sampler"] == {"num_replicas": DP, "rank": rank // TP}


def test_the_strategy_with_a_parallelize_fn_pickles() -> None:
    for start_method in ("popen", "spawn"):
        strategy = ZeroFabricStrategy(stage=3, tensor_parallel_size=TP, parallelize_fn=parallelize,
                                      start_method=start_method)
        copy = pickle.loads(pickle.dumps(strategy))
        assert copy._parallelize.fn is parallelize and copy.config.tensor_parallel_size == TP


def test_a_parallelize_fn_the_spawn_launcher_cannot_pickle_is_refused_when_built() -> None:
    with pytest.raises(ValueError, match=r"cannot be pickled .* define it as a top-level function"):
        ZeroFabricStrategy(stage=3, tensor_parallel_size=TP, parallelize_fn=lambda m, mesh: m, start_method="spawn")
    ZeroFabricStrategy(stage=3, tensor_parallel_size=TP, parallelize_fn=lambda m, mesh: m)  # popen pickles nothing
    with pytest.raises(TypeError, match="parallelize_fn=3 is not callable"):
        ZeroFabricStrategy(stage=3, parallelize_fn=3)  # type: ignore[arg-type]


def replaced_parameters(rank: int, world: int) -> dict[str, Any]:
    """With tensor_parallel_size=1 the fn gets a (world, 1) mesh, as under ModelParallelStrategy: its plan makes
    DTensors over one rank, which ZeRO shards over all ranks, trained as ``world`` data-parallel ranks. Refused:
    ``fabric.setup(model, optimizer)`` with a plan that replaces the parameters, and a fn returning no module."""
    as_launched_rank(rank, world)
    out: dict[str, Any] = {}
    fabric = Fabric(strategy=ZeroFabricStrategy(stage=2, parallelize_fn=parallelize), accelerator="cpu",
                    devices=world, precision="32-true")
    fabric.launch()
    mesh = fabric.strategy.device_mesh
    out["mesh"] = repr((mesh.mesh_dim_names, mesh.mesh.tolist()))
    model = make_model()
    try:
        fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    except ValueError as error:
        out["with_optimizer"] = str(error)
    model = fabric.setup_module(make_model())  # the order that works: the module, then its optimizer
    optimizer: Any = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    for step in range(STEPS):
        fabric.backward(loss_of(model, _rows(step, rank)))
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
    out["state"] = full_state(model)
    bad = Fabric(strategy=ZeroFabricStrategy(stage=2, parallelize_fn=_returns_nothing), accelerator="cpu",
                 devices=world, precision="32-true")
    bad.launch()
    try:
        bad.setup_module(make_model())
    except TypeError as error:
        out["returns_nothing"] = str(error)
    bad.barrier()  # no rank leaves (closing the store rank 0 holds) while another still builds its mesh
    return out


def _returns_nothing(model: nn.Module, mesh: Any) -> None:
    apply_plan(model, mesh["tensor_parallel"])  # type: ignore[arg-type]


@pytest.mark.timeout(300)
def test_tensor_parallel_size_1_gives_the_fn_a_mesh_and_refuses_an_optimizer_it_made_stale(
        reference: dict[str, torch.Tensor]) -> None:
    for rank, result in enumerate(run_ranks(replaced_parameters, DP, timeout_s=240, pg_timeout_s=60)):
        assert_state_close(result["state"], reference, rel=1e-5, what=f"rank {rank} tensor_parallel_size=1")
        assert result["mesh"] == repr((("data_parallel", "tensor_parallel"), [[0], [1]]))
        assert "fabric.setup_module(model)" in result["with_optimizer"], result
        assert "fabric.setup_optimizers(optimizer)" in result["with_optimizer"], result
        assert "must return the nn.Module it parallelized, got NoneType" in result["returns_nothing"], result


def test_global_batch_rows_are_dealt_by_data_parallel_rank() -> None:
    """The rows each data-parallel rank trains on are the global batch, each row once (what the reference sees)."""
    tokens, targets = global_batch(1, ROWS * DP)
    dealt = [_rows(1, d) for d in range(DP)]
    assert torch.equal(torch.cat([t for t, _ in dealt]), tokens) and torch.equal(torch.cat([y for _, y in dealt]),
                                                                                  targets)
    assert tokens.shape == (ROWS * DP, SEQ)
