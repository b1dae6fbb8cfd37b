"""configure_model under ZeRO builds on the meta device and materializes unit by unit; pretrained weights are read
shard by shard. Each run is compared with the same module built eagerly and trained by DDP (spawn launchers)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers.lit import train_loader, trainer_kwargs
from helpers.lit_meta import ConfiguredLM, LoadsInConfigureModel
from helpers.meta_models import TransformerLM
from helpers.models import assert_state_close
from safetensors.torch import save_file

import zero_strategy
from zero_strategy import ZeroStrategy
from zero_strategy.checkpoint.consolidate import consolidate


def _fit(strategy: object, module: ConfiguredLM) -> dict[str, torch.Tensor]:
    """Rank 0's weights after the fit (both ranks checked to agree)."""
    pl.seed_everything(3, verbose=False)
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(max_steps=3, max_epochs=1, accumulate_grad_batches=1,
                                                             gradient_clip_val=None))  # fmt: skip
    trainer.fit(module, train_loader())
    saved = Path(module.out_dir) / "after_fit.ckpt"
    if saved.exists():  # built sharded at stage 3: the parameters stayed sharded and the ranks saved them
        state = torch.load(consolidate(saved, Path(module.out_dir) / "model.pt"), weights_only=True)
        assert set(state) == {f"net.{k}" for k in TransformerLM().state_dict()}  # every tensor, consolidated
        return state
    states = [torch.load(Path(module.out_dir) / f"state_rank{r}.pt", weights_only=True) for r in range(2)]
    assert len(states[0]) == len(TransformerLM().state_dict())  # the network's every tensor, not an empty dict
    assert_state_close(states[1], states[0], rel=0.0, what="rank 1 vs rank 0")
    return states[0]


def _dir(tmp_path: Path, name: str) -> str:
    (tmp_path / name).mkdir()
    return str(tmp_path / name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["zero1_spawn", "zero3_spawn"])
def test_configure_model_on_meta_trains_like_ddp(name: str, tmp_path: Path) -> None:
    reference = _fit("ddp_spawn", ConfiguredLM(_dir(tmp_path, "ddp")))
    assert_state_close(_fit(name, ConfiguredLM(_dir(tmp_path, "zero"))), reference, what=f"{name} vs ddp_spawn")


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

    # One DDP reference for both ZeRO runs (three fits, not four: the test must fit its timeout on a busy
    # machine): the same donor values, loaded eagerly into the whole module from the file without a prefix.
    whole = str(tmp_path / "module.safetensors")
    eager = _fit("ddp_spawn", LoadsInConfigureModel(_dir(tmp_path, "ddp_whole"), whole))
    net_file = str(tmp_path / "net.safetensors")
    zero = _fit("zero3_spawn", ConfiguredLM(_dir(tmp_path, "zero"), net_file, key_map))
    assert_state_close(zero, eager, what="load_pretrained with key_map in configure_model, zero3 vs ddp")
    by_option = _fit(ZeroStrategy(stage=3, start_method="spawn", pretrained=whole), ConfiguredLM(_dir(tmp_path, "o")))
    assert_state_close(by_option, eager, what="pretrained= option")
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
