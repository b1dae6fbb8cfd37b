"""configure_model under ZeRO builds on the meta device and materializes unit by unit (reseeds and metrics built
there included); pretrained weights are read shard by shard. Each run is compared with the same module built eagerly
and trained by DDP."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers.compare import assert_same_keys, assert_state_close, rel_diff
from helpers.launched import as_launched_rank
from helpers.lit import train_loader, trainer_kwargs, val_loader
from helpers.lit_meta import ConfiguredLM, LoadsInConfigureModel, MetricsOnlyInConfigureModel, SeededWithMetrics
from helpers.meta_models import TransformerLM
from safetensors.torch import save_file

import zero_strategy
from zero_strategy import ZeroStrategy
from zero_strategy.checkpoint.export.consolidate import consolidate
from zero_strategy.testing import run_ranks

Run = tuple[Callable[[], object], Callable[[], pl.LightningModule]]  # (strategy, module), made on the rank


def fit_in_turn(rank: int, world_size: int, runs: list[Run]) -> None:
    """On one rank (launched by run_ranks), fit each (strategy, module) of ``runs`` in turn for 3 steps; the modules
    write their weights to their ``out_dir`` (read by ``_trained_state``)."""
    as_launched_rank(rank, world_size)
    for make_strategy, make_module in runs:
        pl.seed_everything(3, verbose=False)
        trainer = pl.Trainer(strategy=make_strategy(), **trainer_kwargs(
            devices=world_size, max_steps=3, max_epochs=1, accumulate_grad_batches=1,
            gradient_clip_val=None))  # fmt: skip
        trainer.fit(make_module(), train_loader())


def _trained_state(out_dir: str) -> dict[str, torch.Tensor]:
    """Rank 0's weights after the fit (both ranks checked to agree)."""
    saved = Path(out_dir) / "after_fit.ckpt"
    if saved.exists():  # built sharded at stage 3: the parameters stayed sharded and the ranks saved them
        state = torch.load(consolidate(saved, Path(out_dir) / "model.pt"), weights_only=True)
        assert set(state) == {f"net.{k}" for k in TransformerLM().state_dict()}  # every tensor, consolidated
        return state
    states = [torch.load(Path(out_dir) / f"state_rank{r}.pt", weights_only=True) for r in range(2)]
    assert len(states[0]) == len(TransformerLM().state_dict())  # the network's every tensor, not an empty dict
    assert_state_close(states[1], states[0], rel=0.0, what="rank 1 vs rank 0")
    return states[0]


def _dir(tmp_path: Path, name: str) -> str:
    (tmp_path / name).mkdir()
    return str(tmp_path / name)


def fit_and_validate_each(rank: int, world_size: int, runs: tuple[tuple[str, str], ...]) -> dict:
    """On one rank of ``world_size`` (launched by run_ranks, as torchrun would: Lightning sees LOCAL_RANK and does not
    launch), fit then validate each (module, strategy) of ``runs`` in turn on the same process group."""
    as_launched_rank(rank, world_size)
    modules = {"seeded": SeededWithMetrics, "metrics_only": MetricsOnlyInConfigureModel}
    out = {}
    for module_name, strategy in runs:
        module = modules[module_name]()
        trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(
            devices=world_size, max_epochs=1, limit_train_batches=3, accumulate_grad_batches=1,
            gradient_clip_val=None))  # fmt: skip
        trainer.fit(module, train_loader(), val_loader())
        fitted = {name: float(value) for name, value in trainer.callback_metrics.items()}
        validated = trainer.validate(module, val_loader(), verbose=False)[0]
        observed = dict(module.observed, fitted=fitted, validated=validated, val_batches=int(module.val_batches))
        module.val_accuracy.reset()  # needs real defaults
        module.train_loss.reset()
        observed["states"] = module.metric_states()
        out[(module_name, strategy)] = observed
    return out


def _assert_like_ddp(got: dict, ddp: dict, what: str) -> None:
    for name, value in ddp["setup"].items():
        assert torch.equal(got["setup"][name], value), f"{what}: {name} differs from DDP's after setup"
    torch_state, python_state, numpy_state = got["generators"]
    assert torch.equal(torch_state, ddp["generators"][0]), f"{what}: torch's generator differs from DDP's"
    assert python_state == ddp["generators"][1], f"{what}: Python's random state differs from DDP's"
    assert all(np.array_equal(a, b) for a, b in zip(numpy_state, ddp["generators"][2], strict=True)), what
    assert torch.equal(got["probe"], ddp["probe"]), f"{what}: a random tensor attribute differs from DDP's"
    if "generators_at_validate" in ddp:
        assert torch.equal(got["generators_at_validate"], ddp["generators_at_validate"]), f"{what}: at validate"
    assert_state_close(got["trained"], ddp["trained"], what=f"{what}, trained")
    for results in ("fitted", "validated"):
        assert_same_keys(got[results], ddp[results], f"{what}, {results}")
        for name, value in ddp[results].items():
            err = rel_diff(got[results][name], value, f"{what}: {results} {name}")
            assert err <= 1e-5, f"{what}: {results} {name} {got[results][name]} != {value}"
    assert got["val_batches"] == ddp["val_batches"], f"{what}: the plain counter tensor differs from DDP's"
    for name, state in got["states"].items():
        reference = ddp["states"][name]
        if isinstance(reference, list):
            assert state == reference == [], f"{what}: {name}"
        else:
            assert not state.is_meta and torch.equal(state, reference), f"{what}: {name} after reset"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_seeded_configure_model_with_metrics_matches_ddp(world_size: int) -> None:
    """``torch.manual_seed``/``seed_everything`` and metrics in ``configure_model``, at stages 1-3: the weights and
    generators after setup equal DDP's bit for bit, training and the logged metrics match DDP's, teardown works
    and the metrics reset to real defaults afterwards. One launch per world size runs every strategy."""
    runs = tuple(("seeded", strategy) for strategy in ("ddp", "zero1", "zero2", "zero3"))
    if world_size == 2:
        runs += (("metrics_only", "ddp"), ("metrics_only", "zero3"))
    results = run_ranks(fit_and_validate_each, world_size, runs, timeout_s=110)
    for rank, result in enumerate(results):
        for module_name, strategy in runs:
            ddp = result[(module_name, "ddp")]
            if strategy != "ddp":
                _assert_like_ddp(result[(module_name, strategy)], ddp, f"{module_name} {strategy} rank {rank}")
    assert results[0][("seeded", "ddp")]["validated"]["val_accuracy"] > 0  # the metrics measured something


@pytest.mark.timeout(120)
def test_pretrained_files_load_shard_by_shard_like_an_eager_load(tmp_path: Path) -> None:
    torch.manual_seed(123)
    donor = TransformerLM()
    tensors = {k: v.contiguous() for k, v in donor.state_dict().items()}
    # a file whose keys carry a prefix the module does not have, loaded into a submodule with key_map
    save_file({f"transformer.{k}": v for k, v in tensors.items()}, tmp_path / "net.safetensors")
    # a file keyed like the LightningModule itself, for ZeroStrategy(pretrained=...)
    save_file({f"net.{k}": v for k, v in tensors.items()}, tmp_path / "module.safetensors")
    key_map = {"strip_prefix": "transformer."}

    net_file, whole = str(tmp_path / "net.safetensors"), str(tmp_path / "module.safetensors")
    dirs = {name: _dir(tmp_path, name) for name in ("ddp", "zero", "option", "ddp_whole")}
    runs = [
        (lambda: "ddp", lambda: ConfiguredLM(dirs["ddp"], net_file, key_map)),
        (lambda: "zero3", lambda: ConfiguredLM(dirs["zero"], net_file, key_map)),
        (lambda: ZeroStrategy(stage=3, pretrained=whole), lambda: ConfiguredLM(dirs["option"])),
        (lambda: "ddp", lambda: LoadsInConfigureModel(dirs["ddp_whole"], whole)),
    ]
    run_ranks(fit_in_turn, 2, runs, timeout_s=110)  # one launch: the four fits in turn on the same two ranks
    zero, by_option = _trained_state(dirs["zero"]), _trained_state(dirs["option"])
    assert_state_close(zero, _trained_state(dirs["ddp"]), what="load_pretrained in configure_model, zero3 vs ddp")
    assert_state_close(by_option, _trained_state(dirs["ddp_whole"]), what="pretrained= option")
    # the runs started from the file, not from their own initialization: 3 small steps stay near the donor
    torch.manual_seed(3)
    fresh = TransformerLM().state_dict()
    for state in (zero, by_option):
        to_donor = (state["net.core.encoder.layers.0.linear1.weight"] - tensors["core.encoder.layers.0.linear1.weight"])
        to_fresh = state["net.core.encoder.layers.0.linear1.weight"] - fresh["core.encoder.layers.0.linear1.weight"]
        assert to_donor.norm() < 0.2 * to_fresh.norm()


def test_pretrained_key_errors_are_listed_before_training(tmp_path: Path) -> None:
    save_file({"net.head.weight": torch.zeros(3, 3), "unrelated": torch.zeros(2)}, tmp_path / "bad.safetensors")
    with torch.device("meta"):
        net = TransformerLM()
    with pytest.raises(Exception, match=r"(?s)missing.*unexpected.*unrelated"):
        zero_strategy.load_pretrained(net, tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="does not exist"):
        ZeroStrategy(stage=3, pretrained=str(tmp_path / "nothing.safetensors"))
