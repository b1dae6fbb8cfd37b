"""A LightningModule that compiles its network in ``configure_model`` (``self.net = torch.compile(net)``, built on
the meta device under ZeRO) trains under ``zero3_spawn`` like a single process doing the same maths eagerly, and
nothing is compiled again after the first step. Stage 1/2/3 parity with DDP + compile is in
tests/distributed/test_compile.py (core level, cheaper than more spawn fits)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers.lit import LR, N_TRAIN, IndexedTokens, train_loader, trainer_kwargs
from helpers.lit_compile import CompiledLM
from helpers.models import TiedLM, assert_state_close, lm_loss

from zero_strategy import ZeroStrategy

STEPS = 4
GLOBAL_BATCH = 8  # 2 ranks x train_loader()'s batch of 4
SEED = 3


def _single_process_reference() -> dict[str, torch.Tensor]:
    """The same seed, model and data as the fit, one process, eager: each step's global batch is the two ranks'
    batches together. Lightning shuffles training data with a DistributedSampler seeded by the global seed, which
    deals a permutation out in turn, so step s uses samples ``order[8s:8s+8]``."""
    pl.seed_everything(SEED, verbose=False)
    net = TiedLM()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    tokens = IndexedTokens(N_TRAIN, 11).tokens  # train_loader()'s data
    order = torch.randperm(N_TRAIN, generator=torch.Generator().manual_seed(SEED))  # epoch 0 of the sampler
    for step in range(STEPS):
        optimizer.zero_grad()
        lm_loss(net, tokens[order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]]).backward()
        optimizer.step()
    return {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.timeout(180)  # compiling in two spawned ranks: 52 s measured in a full-suite run (3x: 155 s)
def test_compiled_in_configure_model_trains_under_zero3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # the spawned ranks inherit it: no compile pool
    pl.seed_everything(SEED, verbose=False)
    kwargs = trainer_kwargs(max_steps=STEPS, max_epochs=1, accumulate_grad_batches=1, gradient_clip_val=None)
    # built sharded at stage 3, the model would stay sharded after fit; on_fit_end reads full weights, so ask for them
    strategy = ZeroStrategy(stage=3, start_method="spawn", full_params_after_fit=True)
    trainer = pl.Trainer(strategy=strategy, **kwargs)
    trainer.fit(CompiledLM(str(tmp_path), how="whole"), train_loader())
    ranks = [torch.load(tmp_path / f"compiled_rank{r}.pt", weights_only=True) for r in range(2)]
    reference = _single_process_reference()
    for rank, result in enumerate(ranks):
        assert_state_close(result["state"], reference, rel=1e-5, what=f"rank {rank}, zero3 + compile vs eager")
        dynamo = result["dynamo"]
        assert dynamo["graphs"] >= 1, "nothing was compiled"
        # compiled in the first step only: a traced gather hook recompiled over the next steps
        assert dynamo["frames_before_step"] == [0] + [dynamo["frames"]] * (STEPS - 1), dynamo
