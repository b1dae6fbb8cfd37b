"""A LightningModule that compiles its network in ``configure_model`` (``self.net = torch.compile(net)``, built on
the meta device under ZeRO) trains under zero3 like a single process doing the same maths eagerly, and nothing
is compiled again after the first step. The fit runs on 2 ranks of one ``run_ranks`` launch, each fitting as a rank
torchrun started and compiling in its own process. Stage 1/2/3 parity with DDP + compile is in
tests/distributed/test_compile.py (core level, cheaper than more Trainer fits)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch._dynamo
import torch._inductor.config
from helpers.launched import as_launched_rank
from helpers.lit import LR, N_TRAIN, IndexedTokens, train_loader, trainer_kwargs
from helpers.lit_compile import CompiledLM
from helpers.models import TiedLM, assert_state_close, lm_loss

from zero_strategy import ZeroStrategy
from zero_strategy.testing import run_ranks

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


def fit_compiled(rank: int, world: int, out_dir: str) -> None:
    """On one rank (launched by run_ranks as torchrun would launch it: Lightning sees LOCAL_RANK): the compiled
    module's fit under zero3, traced from scratch (the forked rank inherits dynamo's caches and counters from the
    test process, which may have compiled before). CompiledLM writes the rank's final weights and what dynamo did
    to ``out_dir``."""
    as_launched_rank(rank, world)
    torch._inductor.config.compile_threads = 1  # no pool of compile workers fighting the ranks for 2 cores
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    pl.seed_everything(SEED, verbose=False)
    kwargs = trainer_kwargs(devices=world, max_steps=STEPS, max_epochs=1, accumulate_grad_batches=1,
                            gradient_clip_val=None)
    # built sharded at stage 3, the model would stay sharded after fit; on_fit_end reads full weights, so ask for them
    strategy = ZeroStrategy(stage=3, full_params_after_fit=True)
    pl.Trainer(strategy=strategy, **kwargs).fit(CompiledLM(out_dir, how="whole"), train_loader())


@pytest.mark.timeout(180)  # compiling in two forked ranks: 5-18 s measured (spawned: 52 s in a full-suite run)
def test_compiled_in_configure_model_trains_under_zero3(tmp_path: Path) -> None:
    run_ranks(fit_compiled, 2, str(tmp_path), timeout_s=170)
    ranks = [torch.load(tmp_path / f"compiled_rank{r}.pt", weights_only=True) for r in range(2)]
    reference = _single_process_reference()
    for rank, result in enumerate(ranks):
        assert_state_close(result["state"], reference, rel=1e-5, what=f"rank {rank}, zero3 + compile vs eager")
        dynamo = result["dynamo"]
        assert dynamo["graphs"] >= 1, "nothing was compiled"
        # compiled in the first step only: a traced gather hook recompiled over the next steps
        assert dynamo["frames_before_step"] == [0] + [dynamo["frames"]] * (STEPS - 1), dynamo
