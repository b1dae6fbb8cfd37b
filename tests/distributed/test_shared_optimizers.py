"""Several optimizers stepping the same parameters (manual optimization): every stage matches a single process
doing DDP's math, with ranks simulated by threads (world sizes 1 and 2) and with real processes (stage 3 on both
transports); the FlatParam/master-piece plan; the step lifecycle per optimizer (zero_grad of one clears the shared
gradient for the other, fp16 unscaling once per gradient)."""

from __future__ import annotations

import pytest
import torch
from helpers.models import assert_state_close, clone_state
from helpers.shared_optimizers import PATTERNS, batches, make, rank_part, reference, train
from torch import nn

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.engine.window import StepOrderError
from zero_strategy.core.flat.grads import GradientScaleError
from zero_strategy.testing import RankFailed, run_in_process, run_ranks

CONFIGS = [(1, "auto"), (2, "auto"), (3, "auto")]


def _initial(kind: str) -> dict[str, torch.Tensor]:
    return clone_state(make(kind)[0])


def _zero_run(rank: int, world_size: int, pattern: str, stage: int, collectives: str) -> dict[str, torch.Tensor]:
    kind = PATTERNS[pattern]
    model, optimizers = make(kind)
    model.load_state_dict(_INITIAL[kind])  # threads share the generator: every rank starts from the same values
    engine = ZeroEngine(model, optimizers, ZeroConfig(stage=stage, collectives=collectives))
    train(pattern, model, optimizers, batches(kind), engine.optimizer_step, rank_part(rank, world_size))
    with engine.gathered_parameters():
        state = clone_state(model)
    engine.release()
    return state


def _all_runs(rank: int, world_size: int, configs: list[tuple[int, str]]) -> dict:
    return {(pattern, stage, collectives): _zero_run(rank, world_size, pattern, stage, collectives)
            for pattern in PATTERNS for stage, collectives in configs}


_INITIAL = {kind: _initial(kind) for kind in ("net", "gan")}


def _check(results: list[dict], world_size: int) -> None:
    references = {pattern: reference(pattern, _INITIAL[PATTERNS[pattern]]) for pattern in PATTERNS}
    for pattern, ref in references.items():
        assert not torch.equal(ref["out.weight" if PATTERNS[pattern] == "net" else "shared.weight"],
                               _INITIAL[PATTERNS[pattern]]["out.weight" if PATTERNS[pattern] == "net" else
                                                           "shared.weight"])  # it trained
    for rank, runs in enumerate(results):
        for (pattern, stage, collectives), state in runs.items():
            assert_state_close(state, references[pattern], rel=1e-5,
                               what=f"{pattern}, stage {stage} ({collectives}), rank {rank} of {world_size}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2])
def test_shared_optimizers_match_one_process_in_process(world_size: int) -> None:
    """Alternating, both-in-one-step, accumulating, GAN with a shared layer: zero1/2/3 end where one process doing
    DDP's math ends (ranks simulated by threads: the step logic, bit-identical to point-to-point)."""
    _check(run_in_process(_all_runs, world_size, CONFIGS, timeout_s=100), world_size)


@pytest.mark.timeout(150)
def test_shared_optimizers_match_one_process_on_both_transports() -> None:
    """Real processes: stage 3 through one host's shared memory ("auto") and point-to-point; stages 1/2 reduce
    through the shared-memory arenas."""
    configs = [(3, "auto"), (3, "point_to_point"), (1, "auto"), (2, "auto")]
    _check(run_ranks(_all_runs, 2, configs, timeout_s=140), 2)


# ------------------------------------------------------------------------------------------------------- plan
def test_a_layer_both_optimizers_step_is_one_flat_param_cut_where_either_group_changes() -> None:
    model, optimizers = make("net")
    engine = ZeroEngine(model, optimizers, ZeroConfig(stage=2))
    root = next(flat for flat in engine.flat_params if flat.spec.unit == "")
    assert root.optimizers == (0, 1)
    # sorted by (SGD group, AdamW group): the pieces are cut at every change of either
    assert root.names == ["inp.weight", "out.weight", "inp.bias", "out.bias"]
    assert root.pieces.groups == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [p.numel() for p in root.master_pieces] == [5 * 9, 9 * 3, 9, 3]
    # each optimizer lists the same piece objects, in its own groups
    sgd, adamw = optimizers
    pieces = {id(p) for p in root.master_pieces}
    assert {id(p) for p in sgd.param_groups[0]["params"]} & pieces == {id(p) for p in root.master_pieces[:2]}
    assert {id(p) for p in adamw.param_groups[0]["params"]} & pieces == {id(root.master_pieces[i]) for i in (0, 2)}
    assert {id(p) for p in adamw.param_groups[1]["params"]} & pieces == {id(root.master_pieces[i]) for i in (1, 3)}
    engine.release()

    gan, gan_opts = make("gan")
    engine = ZeroEngine(gan, gan_opts, ZeroConfig(stage=3))
    kinds = {flat.spec.unit: flat.optimizers for flat in engine.flat_params}
    assert kinds == {"": (0, 1), "gen.0": (0,), "gen.1": (0,), "disc.0": (1,), "disc.1": (1,)}
    engine.release()


# ------------------------------------------------------------------------------------------ the step lifecycle
class Branchy(nn.Module):
    """One unit; ``b`` is used only where a rank asks for it (rank-dependent use, as DDP(find_unused_parameters))."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + (self.b(x) if use_b else 0)


def _branchy_steps(model: Branchy, sgd, adam, data, step, ranks: list[int], world_size: int,
                   clip) -> None:
    """Adam clips (its window agrees on the gradient), SGD's zero_grad() clears it, a second backward in which only
    rank 0 uses ``b``, Adam steps."""
    for r in ranks:  # one rank, or every rank's share of the loss (the reference)
        (model(data[0][r::world_size], use_b=False).square().mean() / len(ranks)).backward()
    clip(adam)
    sgd.zero_grad()  # the gradient Adam agreed on is gone, for Adam too
    for r in ranks:
        (model(data[1][r::world_size], use_b=r == 0).square().mean() / len(ranks)).backward()
    step(adam)


def _branchy_zero(rank: int, world_size: int, stage: int, initial: dict, data: list) -> dict:
    model = Branchy()
    model.load_state_dict(initial)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [sgd, adam], ZeroConfig(stage=stage))
    _branchy_steps(model, sgd, adam, data, engine.optimizer_step, [rank], world_size,
                   lambda opt: engine.clip_grad_norm_(opt, 1e6))
    with engine.gathered_parameters():
        return clone_state(model)


@pytest.mark.timeout(60)
def test_zero_grad_of_one_optimizer_restarts_the_agreement_of_the_other() -> None:
    """A parameter only rank 0 uses after another optimizer's zero_grad() still moves on every rank, as under
    DDP(find_unused_parameters=True): the window that had agreed before the zero_grad agrees again."""
    torch.manual_seed(0)
    model = Branchy()
    initial = clone_state(model)
    data = [torch.randn(4, 3), torch.randn(4, 3)]
    sgd, adam = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters(), lr=0.1)
    _branchy_steps(model, sgd, adam, data, lambda opt: opt.step(), [0, 1], 2, lambda opt: None)
    expected = clone_state(model)
    assert not torch.equal(expected["b.weight"], initial["b.weight"])
    for stage in (1, 2, 3):
        for rank, state in enumerate(run_in_process(_branchy_zero, 2, stage, initial, data)):
            assert_state_close(state, expected, rel=1e-5, what=f"stage {stage}, rank {rank}")


SCALE = 1024.0  # a power of two: scaling and unscaling are exact


def _scaled_steps(rank: int, world_size: int, stage: int, mixed: bool) -> dict:
    model, optimizers = make("net")
    model.load_state_dict(_INITIAL["net"])
    first, second = optimizers
    engine = ZeroEngine(model, optimizers, ZeroConfig(stage=stage))
    (x, y), (x1, y1) = batches("net")[:2]
    part = rank_part(rank, world_size)
    (nn.functional.mse_loss(model(part(x)), part(y)) * SCALE).backward()
    for optimizer in (first, second):
        if mixed and optimizer is second:  # a backward after the first step, no zero_grad(): half scaled, half not
            (nn.functional.mse_loss(model(part(x1)), part(y1)) * SCALE).backward()
        with engine.step_window(optimizer):
            assert not engine.unscale_and_check_overflow(optimizer, 1.0 / SCALE)
            engine.step(optimizer)
    with engine.gathered_parameters():
        return clone_state(model)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_unscaling_happens_once_per_gradient(stage: int) -> None:
    """Two optimizers step one scaled gradient in turn: the second finds it unscaled already (unscaling it again
    would divide by the scale twice). A gradient reduced after the first unscaling cannot be unscaled right: an
    error naming the FlatParam, on every rank."""
    model, (first, second) = make("net")
    model.load_state_dict(_INITIAL["net"])
    (x, y) = batches("net")[0]
    nn.functional.mse_loss(model(x), y).backward()
    first.step()
    second.step()
    expected = clone_state(model)
    for rank, state in enumerate(run_in_process(_scaled_steps, 2, stage, False)):
        assert_state_close(state, expected, rel=1e-5, what=f"stage {stage}, rank {rank}")
    with pytest.raises(RankFailed, match="reduced again after they had been unscaled") as info:
        run_in_process(_scaled_steps, 2, stage, True)
    assert isinstance(info.value.__cause__, GradientScaleError)


def test_zero_grad_of_one_optimizer_inside_the_others_step_is_refused() -> None:
    """Clearing the gradient another optimizer is stepping with (a zero_grad() inside its window) is an error that
    says so, instead of a step with half its gradients."""
    model, (first, second) = make("net")
    engine = ZeroEngine(model, [first, second], ZeroConfig(stage=2))
    nn.functional.mse_loss(model(torch.randn(4, 5)), torch.randn(4, 3)).backward()
    with pytest.raises(StepOrderError, match=r"zero_grad\(\) of optimizer 1 .* optimizer 0 is stepping"):
        with engine.step_window(first):
            second.zero_grad()
    engine.release()
