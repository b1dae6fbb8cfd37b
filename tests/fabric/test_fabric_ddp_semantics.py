"""Fabric under ZeRO as under DDP: the strategy pickles (the spawn launcher sends it to each rank) and a spawn launch
trains DDP's weights; a ``state_dict_type="full"`` file holds the user's keys only, as DDP's file does (see [Note:
the consolidated file holds the user's keys] in zero_strategy/fabric/checkpoint.py); ``fabric.load_raw`` reads a
torch file whatever its name, as DDP's ``torch.load`` does, and refuses clearly what is no weights file; ``p.grad``
after ``fabric.backward`` (inside and at the end of a ``no_backward_sync`` window) and ``fabric.clip_gradients`` is
DDP's, and a clip by hand with torch's ``clip_grad_norm_`` and gradients replaced by assignment (``p.grad = t``,
``p.grad = None``) are what the step uses. Stages 1, 2, 3 (stage 3 on both
transports), 1 and 2 processes, DDP in the same run."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.compare import assert_state_close, assert_values_close
from helpers.fabric_runs import Net, batch, lm_loss, train, weights
from helpers.fabric_spawn import single_process_reference, train_on_ranks
from helpers.launched import as_launched_rank
from helpers.litgpt_runs import make_fabric
from lightning.fabric import Fabric

from zero_strategy import ZeroFabricStrategy
from zero_strategy.checkpoint.base.format import CheckpointError
from zero_strategy.testing import run_ranks

STRATEGIES = {
    "zero1": dict(stage=1),
    "zero2": dict(stage=2),
    "zero3": dict(stage=3, collectives="auto"),
    "zero3_point_to_point": dict(stage=3, collectives="point_to_point"),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_the_strategy_pickles(name: str) -> None:
    for start_method in ("popen", "spawn"):
        strategy = ZeroFabricStrategy(**STRATEGIES[name], state_dict_type="full", start_method=start_method)
        copy = pickle.loads(pickle.dumps(strategy))
        assert copy.config == strategy.config and copy._checkpoints.full and copy._start_method == start_method


@pytest.mark.timeout(300)
def test_a_spawn_launch_trains_ddps_weights() -> None:
    fabric = Fabric(strategy="zero2_spawn", accelerator="cpu", devices=2, precision="32-true")
    got = {key: torch.tensor(value) for key, value in fabric.launch(train_on_ranks).items()}
    expected = single_process_reference()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


def _strategy(name: str) -> Any:
    return "ddp" if name == "ddp" else ZeroFabricStrategy(**STRATEGIES[name], state_dict_type="full")


def save_load_each(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each strategy: 2 steps, ``fabric.save`` of model, optimizer and a plain value, then what a plain
    ``torch.load`` and ``fabric.load(path)`` find in it; ``load_raw`` of a state dict saved under names without a
    known suffix."""
    as_launched_rank(rank, world)
    out: dict[str, Any] = {}
    for name in ("ddp", *STRATEGIES):
        fabric = make_fabric(_strategy(name), world)
        fabric.seed_everything(0)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = fabric.setup(model, optimizer)
        train(fabric, model, [optimizer], 2)
        path = Path(root) / f"{name}.pt"
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
        fabric.barrier()
        in_file = torch.load(path, weights_only=True)
        returned = fabric.load(path)
        raw: dict[str, Any] = {}
        for file_name in ("weights", "weights.data"):  # torch.save output under names of no known suffix
            target = fabric.setup_module(Net())
            fabric.load_raw(Path(root) / file_name, target)
            raw[file_name] = weights(target)
        out[name] = {"keys": sorted(in_file), "returned": sorted(returned), "model": in_file["model"],
                     "step": in_file["step"], "raw": raw, "trained": weights(model)}
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["1_process", "2_processes"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp(f"fabric_semantics_{request.param}")
    torch.manual_seed(7)
    plain = {key: value.clone() for key, value in Net().state_dict().items()}
    torch.save(plain, root / "weights")
    torch.save(plain, root / "weights.data")
    torch.save(plain, root / "plain.pt")
    return root, run_ranks(save_load_each, request.param, str(root), timeout_s=300)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_the_full_file_holds_the_users_keys_as_ddps(runs: tuple[Path, list[dict]], name: str) -> None:
    _, results = runs
    for rank, result in enumerate(results):
        ddp, got = result["ddp"], result[name]
        assert got["keys"] == ddp["keys"] == ["model", "optimizer", "step"], (rank, got["keys"])
        assert got["returned"] == ddp["returned"], (rank, got["returned"], ddp["returned"])
        assert got["step"] == ddp["step"] == 2
        for key, value in ddp["model"].items():
            torch.testing.assert_close(got["model"][key], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=key, n=rank: f"rank {n} {k}: {m}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_load_raw_reads_a_torch_file_of_any_name_as_ddp(runs: tuple[Path, list[dict]], name: str) -> None:
    root, results = runs
    plain = torch.load(root / "plain.pt", weights_only=True)
    for rank, result in enumerate(results):
        for file_name, loaded in result[name]["raw"].items():
            assert loaded.keys() == result["ddp"]["raw"][file_name].keys() == plain.keys()
            for key, value in result["ddp"]["raw"][file_name].items():
                torch.testing.assert_close(value, plain[key], rtol=0, atol=0)  # DDP's torch.load: the file
                torch.testing.assert_close(loaded[key], value, rtol=0, atol=0,
                                           msg=lambda m, k=key, f=file_name, n=rank: f"rank {n} {f} {k}: {m}")


def test_load_raw_refuses_what_is_no_weights_file(tmp_path: Path) -> None:
    from zero_strategy.checkpoint.pretrained.open import open_pretrained

    (tmp_path / "notes").write_bytes(b"just some text, no tensors")
    with pytest.raises(CheckpointError, match=r"notes is neither a torch file .* nor a safetensors file"):
        open_pretrained(tmp_path / "notes")
    torch.save({"w": torch.zeros(2)}, tmp_path / "legacy", _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="not a zip-format torch file"):  # recognised, refused with its remedy
        open_pretrained(tmp_path / "legacy")


def set_up_twice(rank: int, world: int) -> dict[str, Any]:
    """Each strategy: the module set up alone, then again with its optimizer (trained through the second wrapper),
    then once more alone after a step (trained through the third wrapper): DDP wraps it each time."""
    as_launched_rank(rank, world)
    out: dict[str, Any] = {}
    for name in ("ddp", *STRATEGIES):
        fabric = make_fabric(_strategy(name), world)
        fabric.seed_everything(0)
        raw = Net()
        first = fabric.setup_module(raw)
        optimizer = torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9)
        second, optimizer = fabric.setup(raw, optimizer)
        train(fabric, second, [optimizer], 2)
        third = fabric.setup_module(raw)
        train(fabric, third, [optimizer], 2, first_step=2)
        out[name] = {wrapper: weights(model) for wrapper, model in
                     (("first", first), ("second", second), ("third", third))}
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2])
def test_a_module_set_up_again_trains_as_under_ddp(world: int) -> None:
    for rank, result in enumerate(run_ranks(set_up_twice, world, timeout_s=300)):
        ddp = result["ddp"]["third"]
        for name in STRATEGIES:
            for wrapper, got in result[name].items():  # every wrapper reads the same trained parameters
                for key, value in ddp.items():
                    torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6,
                                               msg=lambda m, k=key, n=name, w=wrapper, r=rank: f"{r} {n} {w} {k}: {m}")


def loss_scale_round_trip(rank: int, world: int, root: str) -> tuple[float, list[str]]:
    as_launched_rank(rank, world)
    fabric = Fabric(strategy=ZeroFabricStrategy(stage=2, state_dict_type="full"), accelerator="cpu", devices=world,
                    precision="16-mixed")
    fabric.launch()
    model, optimizer = fabric.setup(Net(), torch.optim.SGD(Net().parameters(), lr=0.1))
    precision = fabric.strategy.precision
    precision.scaler.scale = 1234.0
    path = Path(root) / "fp16.pt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "precision": precision})
    precision.scaler.scale = 1.0
    fabric.load(path, {"model": model, "optimizer": optimizer, "precision": precision})
    return precision.scaler.scale, sorted(torch.load(path, weights_only=True))


def test_the_full_file_keeps_the_loss_scale_when_the_state_holds_the_precision(tmp_path: Path) -> None:
    """How a full file keeps the fp16 loss scale now that it holds the user's keys only: as Fabric keeps a
    GradScaler, the state names it."""
    scale, keys = run_ranks(loss_scale_round_trip, 1, str(tmp_path), timeout_s=120)[0]
    assert scale == 1234.0 and keys == ["model", "optimizer", "precision"], (scale, keys)


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}


def grad_reads_each(rank: int, world: int) -> dict[str, Any]:
    """Each strategy: 2 steps of 2 micro-batches (the first under ``no_backward_sync``); ``p.grad`` after each
    ``fabric.backward``, after ``fabric.clip_gradients``, after a further clip by hand with torch's
    ``clip_grad_norm_`` and after replacing one gradient and clearing another (what the step then uses), and after
    the step."""
    as_launched_rank(rank, world)
    out: dict[str, Any] = {}
    for name in ("ddp", *STRATEGIES):
        fabric = make_fabric(_strategy(name), world)
        fabric.seed_everything(0)
        net = Net()
        model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        seen: dict[str, Any] = {}
        for step in range(2):
            for micro in range(2):
                with fabric.no_backward_sync(model, enabled=micro == 0):
                    fabric.backward(lm_loss(model, batch(step, micro, fabric)) / 2)
                seen[f"{step}/backward/{micro}"] = _grads(model)
            seen[f"{step}/norm"] = fabric.clip_gradients(model, optimizer, max_norm=1.0).detach().clone()
            seen[f"{step}/clipped"] = _grads(model)
            seen[f"{step}/by_hand"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).detach().clone()
            params = list(model.parameters())
            params[0].grad = params[0].grad * -2.0 + 0.01  # replaced: the step uses it
            params[-1].grad = None  # cleared: the step skips it (AdamW leaves it and its state alone)
            seen[f"{step}/assigned"] = _grads(model)
            optimizer.step()
            seen[f"{step}/after_step"] = _grads(model)
            optimizer.zero_grad()
            seen[f"{step}/after_zero_grad"] = _grads(model)
        out[name] = {"seen": seen, "weights": weights(model)}
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["1_process", "2_processes"])
def grad_reads(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return run_ranks(grad_reads_each, request.param, timeout_s=300)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_p_grad_after_backward_and_clipping_is_ddps(grad_reads: list[dict[str, Any]], name: str) -> None:
    for rank, runs in enumerate(grad_reads):
        ddp, got = runs["ddp"], runs[name]
        assert ddp["seen"]["0/backward/1"] and not ddp["seen"]["0/after_zero_grad"]  # the comparison is not empty
        assert got["seen"].keys() == ddp["seen"].keys()
        for point, want in ddp["seen"].items():
            value = got["seen"][point]
            if isinstance(want, dict):
                assert value.keys() == want.keys(), f"rank {rank}, {point}: {sorted(set(value) ^ set(want))}"
                assert_state_close(value, want, rel=1e-5, what=f"rank {rank}, {name}, {point}")
            else:
                assert_values_close([value.item()], [want.item()], rel=1e-5, what=f"rank {rank}, {name}, {point}")
        assert_state_close(got["weights"], ddp["weights"], rel=1e-5, what=f"rank {rank}, {name}, weights")
