"""Runs of :mod:`helpers.tp_llama` that return the final full (unsharded) weights and the losses: the single-process
reference, and a Trainer fit on ``dp x tp`` CPU ranks over gloo with a strategy named by a key of
:data:`STRATEGIES`.

[Note: the math the reference does]
With ``dp`` data-parallel ranks of ``b`` samples each, a step's gradient is the mean over the ``dp`` ranks of each
rank's mean-loss gradient, which is the gradient of the mean loss over the ``dp * b`` samples: one process whose
step ``k`` batch is the ``dp`` ranks' step-``k`` batches together does the same math. Lightning always gives a
training loader a shuffling ``DistributedSampler`` (seed ``PL_GLOBAL_SEED`` or 0, epoch 0) over the strategy's
``distributed_sampler_kwargs`` (the DP ranks only), so the reference builds the same sampler for each DP rank to
know its order (:func:`dp_orders`), and a test can hold each rank's recorded indices to it. Tensor parallelism
changes only where the arithmetic happens (the loss is the same on every TP rank of a DP group). A step's loss in
the reference is the mean of the DP ranks' losses.

The ranks are forked by ``run_ranks`` and Lightning takes them for ranks torchrun started (``helpers.launched``):
one fork per rank, no new interpreter, no pickled strategy (a strategy is built inside the rank from its key).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler

from helpers.launched import as_launched_rank
from helpers.tp_llama import LlamaConfig, TokenSamples, TPLlamaModule, build_llama, lm_loss, make_optimizer
from zero_strategy.testing import STARTING_ENVIRONMENT, run_ranks

LIGHTNING_SAMPLER_SEED = int(STARTING_ENVIRONMENT.get("PL_GLOBAL_SEED", 0))
"""The seed Lightning gives a rank's sampler: ``PL_GLOBAL_SEED`` as every forked rank starts with it."""


@dataclass(frozen=True, kw_only=True)
class TPSettings:
    """One training run, the same for the reference and every strategy."""

    config: LlamaConfig = field(default_factory=LlamaConfig)
    optimizer: str = "sgd"
    lr: float = 0.05
    clip: float | None = None
    """``gradient_clip_val`` (global 2-norm); None: no clipping."""
    steps: int = 4
    """Optimizer steps."""
    batch: int = 2
    """Samples per data-parallel rank per micro-batch (the reference's micro-batch is ``dp * batch``)."""
    accumulate: int = 1
    """``accumulate_grad_batches``: micro-batches per optimizer step."""
    dp: int = 2
    tp: int = 2
    seed: int = 0
    data_seed: int = 1

    @property
    def samples(self) -> int:
        return self.steps * self.accumulate * self.dp * self.batch


@dataclass
class TPRun:
    """What a run returns."""

    state: dict[str, Tensor]
    """Final weights, full and unsharded, under :class:`TPLlama`'s ``state_dict`` names."""
    losses: list[float]
    """Per micro-batch (``training_step`` call), the mean over data-parallel ranks (see [Note: the math the
    reference does])."""
    rank_losses: list[list[float]] = field(default_factory=list)
    """Per global rank, its own losses (empty for the reference)."""
    rank_seen: list[list[int]] = field(default_factory=list)
    """Per global rank, the sample indices it trained on, in order."""
    mesh_coords: list[tuple[int, int]] = field(default_factory=list)
    """Per global rank, its (data-parallel, tensor-parallel) coordinate in the strategy's device mesh."""
    layouts: dict[str, dict[str, str]] = field(default_factory=dict)
    """Rank 0's parameter layouts at the start of training (``TPLlamaModule.layouts``)."""
    grad_norms: list[float] = field(default_factory=list)
    """The reference's global gradient 2-norm per step, before clipping (a test checks that the clip acts)."""


def _model_parallel(settings: TPSettings) -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=settings.dp, tensor_parallel_size=settings.tp,
                                 timeout=timedelta(seconds=60))


def _zero(stage: int, **options: Any) -> Callable[[TPSettings], Any]:
    def make(settings: TPSettings) -> Any:
        from zero_strategy.lightning.strategy import ZeroStrategy

        return ZeroStrategy(stage=stage, tensor_parallel_size=settings.tp, **options)

    return make


STRATEGIES: dict[str, Callable[[TPSettings], Any]] = {
    "mps": _model_parallel,
    "zero1": _zero(1),
    "zero2": _zero(2),
    "zero3": _zero(3),
    "zero3_p2p": _zero(3, collectives="point_to_point"),
}
"""Strategy key -> factory, called inside each rank (strategies may not pickle). The ``zero*`` keys need
``ZeroStrategy(tensor_parallel_size=...)`` (issue 36); ``zero3_p2p`` is stage 3's network path (the others take
``collectives="auto"``: shared memory on one host)."""


def loader(settings: TPSettings) -> DataLoader:
    """The training data of one data-parallel rank's view: the strategy's sampler picks its samples."""
    return DataLoader(TokenSamples(settings.samples, settings.config, settings.data_seed), batch_size=settings.batch)


def dp_orders(settings: TPSettings) -> list[list[int]]:
    """Per data-parallel rank, the sample indices Lightning's sampler gives it in the first epoch."""
    dataset = TokenSamples(settings.samples, settings.config, settings.data_seed)
    return [list(DistributedSampler(dataset, num_replicas=settings.dp, rank=r, shuffle=True,
                                  seed=LIGHTNING_SAMPLER_SEED))
            for r in range(settings.dp)]


def run_reference(settings: TPSettings) -> TPRun:
    """One process, no TP; micro-batch ``m`` is the ``dp`` ranks' micro-batch-``m`` samples together (see [Note: the
    math the reference does]), its loss divided by ``accumulate`` before backward as Lightning does. Clipping as
    Lightning's ``gradient_clip_val`` (``clip_grad_norm_`` over every parameter, 2-norm). ``rank_seen`` holds each
    *data-parallel* rank's expected order."""
    model = build_llama(settings.config, settings.seed)
    optimizer = make_optimizer(settings.optimizer, model.parameters(), settings.lr)
    dataset = TokenSamples(settings.samples, settings.config, settings.data_seed)
    orders, b = dp_orders(settings), settings.batch
    losses: list[float] = []
    norms: list[float] = []
    for k in range(settings.steps):
        optimizer.zero_grad(set_to_none=True)
        for m in range(k * settings.accumulate, (k + 1) * settings.accumulate):
            tokens = dataset.tokens[[i for order in orders for i in order[m * b : (m + 1) * b]]]
            loss = lm_loss(model, tokens)
            (loss / settings.accumulate).backward()
            losses.append(float(loss.detach()))
        max_norm = float("inf") if settings.clip is None else settings.clip
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
    return TPRun(state={k: v.detach().clone() for k, v in model.state_dict().items()}, losses=losses,
                 rank_seen=orders, grad_norms=norms)


def full_state(module: nn.Module) -> dict[str, Tensor]:
    """``module``'s state with every DTensor gathered whole (a collective over its mesh: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        for name, value in module.state_dict().items()
    }


def _fit_rank(rank: int, world_size: int, strategy: str, settings: TPSettings) -> dict[str, Any]:
    as_launched_rank(rank, world_size)
    module = TPLlamaModule(settings.config, settings.optimizer, settings.lr, settings.seed)
    trainer = pl.Trainer(
        strategy=STRATEGIES[strategy](settings), accelerator="cpu", devices=world_size, max_steps=settings.steps,
        max_epochs=1, gradient_clip_val=settings.clip, accumulate_grad_batches=settings.accumulate, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(module, loader(settings))
    mesh = module.device_mesh
    assert mesh is not None
    coords = (mesh["data_parallel"].get_local_rank(), mesh["tensor_parallel"].get_local_rank())
    state = full_state(module.model)  # every rank gathers; rank 0's copy is returned
    return {"state": state if rank == 0 else None, "losses": module.losses, "seen": module.seen, "coords": coords,
            "layouts": module.layouts}


def _fit_cases(rank: int, world_size: int, cases: list[tuple[str, TPSettings]]) -> list[dict[str, Any]]:
    return [_fit_rank(rank, world_size, strategy, settings) for strategy, settings in cases]


def run_2d_many(cases: list[tuple[str, TPSettings]], timeout_s: float = 300.0) -> list[TPRun]:
    """A Trainer fit of :class:`TPLlamaModule` for each ``(strategy, settings)`` case (``STRATEGIES[strategy]`` on
    ``settings.dp * settings.tp`` ranks), one after another in one launch of ranks: the fork, the process group and
    Lightning's first-fit work per rank are paid once, not per case. Every case has the same ``dp * tp``."""
    unknown = sorted({strategy for strategy, _ in cases} - set(STRATEGIES))
    if unknown:
        raise ValueError(f"strategies {unknown} are not keys of STRATEGIES ({sorted(STRATEGIES)}): add a factory")
    worlds = {settings.dp * settings.tp for _, settings in cases}
    if len(worlds) != 1:
        raise ValueError(f"the cases of one launch need one world size (dp * tp), got {sorted(worlds)}: split them")
    world = worlds.pop()
    per_rank = run_ranks(_fit_cases, world, cases, timeout_s=timeout_s, pg_timeout_s=60.0)
    return [_tp_run([ranks[i] for ranks in per_rank], settings) for i, (_, settings) in enumerate(cases)]


def _tp_run(results: list[dict[str, Any]], settings: TPSettings) -> TPRun:
    """One case's per-rank results as a :class:`TPRun`."""
    rank_losses = [r["losses"] for r in results]
    coords = [r["coords"] for r in results]
    # one TP rank per DP group speaks for it (the test checks that the TP ranks agree)
    speakers = [rank_losses[coords.index((dp, 0))] for dp in range(settings.dp)]
    losses = [sum(step) / settings.dp for step in zip(*speakers, strict=True)]
    return TPRun(state=results[0]["state"], losses=losses, rank_losses=rank_losses,
                 rank_seen=[r["seen"] for r in results], mesh_coords=coords, layouts=results[0]["layouts"])
