"""Frozen parameters, several optimizers, a GAN-style alternating step, and evaluation forwards between steps."""

from __future__ import annotations

import pytest
import torch
from helpers.models import TiedLM, assert_state_close, clone_state, lm_loss, make_batches, make_model, rank_slice
from torch import nn

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.testing import run_ranks

GLOBAL_BATCH = 8


def _freeze(model: nn.Module, which: str) -> None:
    for p in model.get_submodule(which).parameters():
        p.requires_grad_(False)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def _step(engine: ZeroEngine | None, optimizer: torch.optim.Optimizer) -> None:
    """One optimizer step, through the engine when there is one (the reference runs plain torch)."""
    if engine is not None:
        engine.optimizer_step(optimizer)
    else:
        optimizer.step()


def _final_state(engine: ZeroEngine | None, model: nn.Module) -> dict:
    """The full state dict (stage 3 gathers first); the plain-torch reference has no engine."""
    if engine is None:
        return clone_state(model)
    with engine.gathered_parameters():
        return clone_state(model)


def _frozen_run(rank, world_size, stage, which, opt_params, use_zero):
    model = make_model()
    _freeze(model, which)
    params = model.parameters() if opt_params == "all" else [p for p in model.parameters() if p.requires_grad]
    optimizer = _sgd(params)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage)) if use_zero else None
    for micro in make_batches(3, 2, GLOBAL_BATCH):
        optimizer.zero_grad()
        for tokens in micro:
            batch = rank_slice(tokens, rank, world_size) if use_zero else tokens
            (lm_loss(model, batch) / 2).backward()
        _step(engine, optimizer)
    return _final_state(engine, model)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("opt_params", ["all", "trainable"])
@pytest.mark.parametrize("which", ["blocks.0", "blocks.1", "emb"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_frozen_parameters(stage, which, opt_params):
    """A frozen block (first, middle, or the tied embedding/head) keeps its initial values; the rest trains as in
    the single-process reference."""
    initial = clone_state(make_model())
    reference = _frozen_run(0, 1, stage, which, opt_params, use_zero=False)
    results = run_ranks(_frozen_run, 2, stage, which, opt_params, True, timeout_s=50)
    for rank, got in enumerate(results):
        assert_state_close(got, reference, rel=1e-5, what=f"rank {rank}, {which} frozen, stage {stage}")
        frozen_keys = [k for k in got if k.startswith(which + ".")] + (["head.weight"] if which == "emb" else [])
        assert frozen_keys
        for key in frozen_keys:
            torch.testing.assert_close(got[key], initial[key], rtol=0, atol=0, msg=f"frozen {key} changed")
        moved = [k for k in got if k not in frozen_keys and not torch.equal(got[k], initial[k])]
        assert len(moved) == len(got) - len(frozen_keys), "every trainable tensor should have been updated"


def _two_optimizer_run(rank, world_size, stage, use_zero):
    """Optimizer A: AdamW on the embedding (tied head) and block 0; optimizer B: SGD on the rest.
    Phase 1 (3 iterations): both zero_grad, backward, only A steps. Phase 2 (2 iterations): both step."""
    model = make_model()
    a_params = [model.emb.weight, *model.blocks[0].parameters()]
    a_ids = {id(p) for p in a_params}
    opt_a = torch.optim.AdamW(a_params, lr=1e-2)
    opt_b = _sgd([p for p in model.parameters() if id(p) not in a_ids])
    engine = ZeroEngine(model, [opt_a, opt_b], ZeroConfig(stage=stage)) if use_zero else None
    snapshots = []
    for it, (tokens,) in enumerate(make_batches(5, 1, GLOBAL_BATCH)):
        opt_a.zero_grad()
        opt_b.zero_grad()
        lm_loss(model, rank_slice(tokens, rank, world_size) if use_zero else tokens).backward()
        for optimizer in (opt_a, opt_b) if it >= 3 else (opt_a,):
            _step(engine, optimizer)
        if engine is None:
            snapshots.append(clone_state(model))
        else:
            with engine.gathered_parameters():
                snapshots.append(clone_state(model))
    return snapshots


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stepping_one_optimizer_leaves_the_other_untouched(stage, world_size):
    initial = clone_state(make_model())
    reference = _two_optimizer_run(0, 1, stage, use_zero=False)
    b_keys = [k for k in initial if k.startswith(("blocks.1.", "blocks.2.", "ln_f."))]
    results = run_ranks(_two_optimizer_run, world_size, stage, True, timeout_s=50)
    for rank, snapshots in enumerate(results):
        for it in range(3):  # only A stepped: B's weights are untouched, A's match the reference
            for key in b_keys:
                torch.testing.assert_close(snapshots[it][key], initial[key], rtol=0, atol=0, msg=key)
            assert_state_close(snapshots[it], reference[it], what=f"rank {rank} iteration {it} (only A steps)")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_stepped_after_skipped_iterations(stage):
    """B was zero_grad-ed but not stepped for 3 iterations; when it steps it must see only the current
    gradient (torch semantics of zero_grad), as in the reference."""
    reference = _two_optimizer_run(0, 1, stage, use_zero=False)
    results = run_ranks(_two_optimizer_run, 2, stage, True, timeout_s=50)
    for rank, snapshots in enumerate(results):
        for it in (3, 4):
            assert_state_close(snapshots[it], reference[it], what=f"rank {rank} iteration {it} (A and B step)")


class TinyGAN(nn.Module):
    """Generator and discriminator in one module; ``forward`` computes the loss of either player, so the
    root's hooks wrap every forward as in a LightningModule's training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 6)])
        self.disc = nn.ModuleList([nn.Linear(6, 8), nn.Linear(8, 1)])

    def generate(self, z):
        return self.gen[1](torch.tanh(self.gen[0](z)))

    def discriminate(self, x):
        return self.disc[1](torch.tanh(self.disc[0](x))).squeeze(-1)

    def forward(self, z, real, player: str):
        bce = nn.functional.binary_cross_entropy_with_logits
        fake = self.generate(z)
        if player == "d":
            d_real, d_fake = self.discriminate(real), self.discriminate(fake.detach())
            return bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
        d_fake = self.discriminate(fake)  # backward reaches the discriminator's parameters too
        return bce(d_fake, torch.ones_like(d_fake))


def _gan_run(rank, world_size, stage, use_zero):
    torch.manual_seed(0)
    model = TinyGAN()
    opt_g = torch.optim.Adam(model.gen.parameters(), lr=1e-2, betas=(0.5, 0.9))
    opt_d = torch.optim.SGD(model.disc.parameters(), lr=0.1, momentum=0.5)
    engine = ZeroEngine(model, [opt_g, opt_d], ZeroConfig(stage=stage)) if use_zero else None
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        z, real = torch.randn(8, 4, generator=g), torch.randn(8, 6, generator=g) + 1.0
        if use_zero:
            z, real = rank_slice(z, rank, world_size), rank_slice(real, rank, world_size)
        for player, optimizer in (("d", opt_d), ("g", opt_g)):
            optimizer.zero_grad()
            model(z, real, player).backward()
            _step(engine, optimizer)
    return _final_state(engine, model)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gan_alternating_optimizers(stage):
    reference = _gan_run(0, 1, stage, use_zero=False)
    results = run_ranks(_gan_run, 2, stage, True, timeout_s=50)
    for rank, got in enumerate(results):
        assert_state_close(got, reference, rel=1e-5, what=f"GAN rank {rank} stage {stage}")


def _eval_between_steps(rank, world_size, stage):
    """Evaluation forwards (no_grad, eval mode) between training steps see the current weights and do not
    disturb training."""
    model = make_model()
    optimizer = _sgd(model.parameters())
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage))
    probe = make_batches(1, 1, 4, seed=7)[0][0]
    evals = []
    for (tokens,) in make_batches(3, 1, GLOBAL_BATCH):
        optimizer.zero_grad()
        lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
        engine.optimizer_step(optimizer)
        model.eval()
        with torch.no_grad():
            evals.append(model(probe).clone())
        model.train()
    with engine.gathered_parameters():
        return clone_state(model), evals


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_eval_forward_between_steps(stage):
    model = make_model()
    optimizer = _sgd(model.parameters())
    probe = make_batches(1, 1, 4, seed=7)[0][0]
    ref_evals = []
    for (tokens,) in make_batches(3, 1, GLOBAL_BATCH):
        optimizer.zero_grad()
        lm_loss(model, tokens).backward()
        optimizer.step()
        with torch.no_grad():
            ref_evals.append(model(probe))
    results = run_ranks(_eval_between_steps, 2, stage, timeout_s=50)
    for rank, (state, evals) in enumerate(results):
        assert_state_close(state, clone_state(model), what=f"rank {rank}")
        for got, ref in zip(evals, ref_evals, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------- model and optimizer shapes
class UnusedBlock(nn.Module):
    """A block with a parameter the forward never uses (no gradient ever reaches it)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.unused = nn.Linear(width, 2)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


class CheckpointedLM(TiedLM):
    """Activation checkpointing inside the root's forward: stage 3 must gather a unit again to recompute it."""

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return self.head(self.ln_f(h))


def _variant_model(kind: str) -> nn.Module:
    if kind == "checkpointing":
        torch.manual_seed(0)
        return CheckpointedLM()
    model = make_model()
    if kind == "unused_params":
        torch.manual_seed(1)
        model.blocks = nn.ModuleList(UnusedBlock(model.emb.weight.shape[1]) for _ in range(3))
    return model


def _variant_loss(model: nn.Module, tokens, kind: str):
    if kind == "two_forwards":  # two forwards through every unit before one backward
        half = tokens.shape[0] // 2
        return (lm_loss(model, tokens[:half]) + lm_loss(model, tokens[half:])) / 2
    return lm_loss(model, tokens)


def _variant_optimizer(model: nn.Module, kind: str):
    if kind == "param_groups":  # the usual "no weight decay on biases and norms", with its own learning rate
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        return torch.optim.AdamW(
            [{"params": no_decay, "weight_decay": 0.0, "lr": 3e-2}, {"params": decay, "weight_decay": 0.1}], lr=1e-2
        )
    return _sgd(model.parameters())


def _variant_run(rank, world_size, stage, kind, use_zero):
    model = _variant_model(kind)
    optimizer = _variant_optimizer(model, kind)
    config = ZeroConfig(stage=stage, prefetch=kind != "no_prefetch")
    engine = ZeroEngine(model, [optimizer], config) if use_zero else None
    for micro in make_batches(3, 2, GLOBAL_BATCH):
        optimizer.zero_grad()
        for tokens in micro:
            (_variant_loss(model, rank_slice(tokens, rank, world_size) if use_zero else tokens, kind) / 2).backward()
        _step(engine, optimizer)
    return _final_state(engine, model)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["param_groups", "unused_params", "checkpointing", "two_forwards", "no_prefetch"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_and_optimizer_variants(stage, kind):
    """Parity on 4 ranks for: several param groups with their own hyper-parameters, parameters no forward uses
    (compared here on the used ones), activation checkpointing, two forwards per backward, no prefetch."""
    reference = _variant_run(0, 1, stage, kind, use_zero=False)
    results = run_ranks(_variant_run, 4, stage, kind, True, timeout_s=50)
    for rank, got in enumerate(results):
        used = {k: v for k, v in got.items() if ".unused." not in k}
        assert_state_close(used, {k: reference[k] for k in used}, what=f"{kind}, stage {stage}, rank {rank}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unused_parameters_are_not_updated(stage):
    initial = clone_state(_variant_model("unused_params"))
    reference = _variant_run(0, 1, stage, "unused_params", use_zero=False)
    unused = [k for k in reference if ".unused." in k]
    assert all(torch.equal(reference[k], initial[k]) for k in unused)  # torch's SGD skips grad-less parameters
    for rank, got in enumerate(run_ranks(_variant_run, 2, stage, "unused_params", True, timeout_s=50)):
        for key in unused:
            torch.testing.assert_close(got[key], initial[key], rtol=0, atol=0, msg=f"rank {rank}: {key} changed")


def _release_run(rank, world_size, stage):
    model = make_model()
    optimizer = _sgd(model.parameters())
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage))
    (tokens,) = make_batches(1, 1, GLOBAL_BATCH)[0]
    lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
    engine.optimizer_step(optimizer)
    engine.release()
    engine.comm_log.reset()
    storages = [p.untyped_storage() for p in model.parameters()]
    own_storage = all(
        s.nbytes() == p.numel() * p.element_size() for s, p in zip(storages, model.parameters(), strict=True)
    )
    distinct = len({s.data_ptr() for s in storages}) == len(storages)
    probe = make_batches(1, 1, 4, seed=7)[0][0]
    lm_loss(model, probe).backward()  # works as a plain module: no hooks, no communication
    return clone_state(model), own_storage, distinct, engine.comm_log.snapshot(), model.head.weight is model.emb.weight


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_release_gives_back_a_plain_module(stage):
    model = make_model()
    optimizer = _sgd(model.parameters())
    (tokens,) = make_batches(1, 1, GLOBAL_BATCH)[0]
    lm_loss(model, tokens).backward()
    optimizer.step()
    for rank, (state, own_storage, distinct, comm, tied) in enumerate(run_ranks(_release_run, 2, stage)):
        assert_state_close(state, clone_state(model), what=f"rank {rank} after release")
        assert own_storage and distinct, "each parameter must own exactly its own full storage after release"
        assert not any(comm.values()), f"a released module still communicates: {comm}"
        assert tied


def _different_init_run(rank, world_size, stage):
    model = make_model(seed=rank)  # every rank starts from different values
    model.register_buffer("running", torch.full((3,), float(rank)))
    optimizer = _sgd(model.parameters())
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage))
    with engine.gathered_parameters():
        adopted = clone_state(model)
    for (tokens,) in make_batches(2, 1, GLOBAL_BATCH):
        optimizer.zero_grad()
        lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
        engine.optimizer_step(optimizer)
    with engine.gathered_parameters():
        return adopted, clone_state(model)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_rank0_initial_values_are_adopted(stage):
    """As DDP does at wrap time, every rank adopts rank 0's parameters and buffers."""
    model = make_model(seed=0)
    initial = clone_state(model)
    optimizer = _sgd(model.parameters())
    for (tokens,) in make_batches(2, 1, GLOBAL_BATCH):
        optimizer.zero_grad()
        lm_loss(model, tokens).backward()
        optimizer.step()
    for rank, (adopted, trained) in enumerate(run_ranks(_different_init_run, 4, stage, timeout_s=50)):
        torch.testing.assert_close(adopted.pop("running"), torch.zeros(3), rtol=0, atol=0)
        trained.pop("running")
        assert_state_close(adopted, initial, rel=0.0, what=f"rank {rank} initial values")
        assert_state_close(trained, clone_state(model), what=f"rank {rank} after 2 steps")
