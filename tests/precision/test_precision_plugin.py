"""ZeroPrecision's validation and its step logic on real ranks: overflow agreement, skipped steps change nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_strategy import ZeroConfig, ZeroEngine, ZeroPrecision
from zero_strategy.core.engine.loss_scaler import LossScaleAtMinimumError
from zero_strategy.testing import run_ranks


@pytest.mark.parametrize(
    ("args", "word"),
    [
        (("64-true",), "64-true"),
        (("16-true",), "16-mixed"),
        (("bf16-true",), "bf16-mixed"),
        (("nonsense",), "nonsense"),
    ],
)
def test_bad_precision_strings(args: tuple, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        ZeroPrecision(*args)


def test_bad_scaler_knobs_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="loss_scale_window"):
        ZeroPrecision("16-mixed", loss_scale_window=0)
    with pytest.raises(ValueError, match="min_loss_scale"):
        ZeroPrecision("16-mixed", min_loss_scale=1e9)
    with pytest.raises(ValueError, match="reduce_dtype"):
        ZeroPrecision("bf16-mixed", reduce_dtype="int8")


def test_aliases_and_properties() -> None:
    assert ZeroPrecision("16").precision == "16-mixed"
    plugin = ZeroPrecision("16-mixed", initial_scale_power=10)
    assert plugin.loss_scale == 1024.0 and plugin.skipped_steps == 0
    assert ZeroPrecision("bf16-mixed").loss_scale == 1.0


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _train(rank: int, world: int, stage: int, poison: dict[int, list[int]], knobs: dict,
           head_bias_only: bool = False) -> dict:
    """Steps with fp16 + dynamic scaling; at step s, ranks in poison[s] produce an inf gradient (everywhere, or in
    the head's bias alone)."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plugin = ZeroPrecision("16-mixed", **knobs)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, min_unit_numel=10**9), policy=plugin.policy())
    plugin.attach(engine)
    data = torch.randn(6, 8, 8, generator=torch.Generator().manual_seed(1))
    per = 8 // world
    for step in range(len(data)):

        def closure(step: int = step) -> torch.Tensor:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(data[step][rank * per : (rank + 1) * per]).float().pow(2).mean()
            if rank in poison.get(step, []):
                loss = loss + float("inf") * model.head.bias.sum() if head_bias_only else loss * float("inf")
            (loss * plugin.loss_scale).backward()  # what ZeroPrecision.pre_backward does inside Lightning
            return loss

        plugin.optimizer_step(opt, model=model, closure=closure)
    with engine.gathered_parameters():
        weights = {k: v.float().clone() for k, v in model.state_dict().items()}
    owns_head_bias = any(piece.name == "head.bias" for flat in engine.flat_params
                         for piece in flat.layout.overlaps(flat.rank))
    return {"weights": weights, "scale": plugin.loss_scale, "skipped": plugin.skipped_steps,
            "owns_head_bias": owns_head_bias}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage", [1, 3])
def test_overflow_on_one_rank_equals_overflow_on_every_rank(stage: int) -> None:
    knobs = {"initial_scale_power": 8, "hysteresis": 1}
    one = run_ranks(_train, 2, stage, {2: [1], 4: [0]}, knobs, timeout_s=60)
    every = run_ranks(_train, 2, stage, {2: [0, 1], 4: [0, 1]}, knobs, timeout_s=60)
    clean = run_ranks(_train, 2, stage, {}, knobs, timeout_s=60)
    assert one[0]["skipped"] == one[1]["skipped"] == 2
    assert one[0]["scale"] == every[0]["scale"] == 2.0**6
    for key, value in one[0]["weights"].items():
        assert torch.equal(value, every[0]["weights"][key]), key
        assert torch.equal(value, one[1]["weights"][key]), key
    # the skipped steps really were skipped: the result differs from a run without them
    assert any(not torch.equal(v, clean[0]["weights"][k]) for k, v in one[0]["weights"].items())


@pytest.mark.timeout(90)
def test_an_overflow_only_one_ranks_slice_holds_is_agreed() -> None:
    """An inf in the head's bias alone lands, after the reduce-scatter, in the slice of the one rank that owns the
    bias (rank 1); rank 0 poisons it, and its own slice stays finite: it must skip the step all the same. Stage 3:
    a rank stepping alone there leaves the ranks' weights apart instead of hanging in a gather."""
    results = run_ranks(_train, 2, 3, {2: [0]}, {"initial_scale_power": 8, "hysteresis": 1}, True, timeout_s=60)
    assert [result["owns_head_bias"] for result in results] == [False, True]  # the premise: one owner
    assert [result["skipped"] for result in results] == [1, 1]
    assert results[0]["scale"] == results[1]["scale"] == 2.0**7
    for key, value in results[0]["weights"].items():
        assert torch.equal(value, results[1]["weights"][key]), key


def _skip_changes_nothing(rank: int, world: int) -> bool:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    plugin = ZeroPrecision("16-mixed", initial_scale_power=4)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=2, min_unit_numel=10**9), policy=plugin.policy())
    plugin.attach(engine)
    x = torch.randn(4, 8)

    def closure(poison: bool) -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        (loss * (float("inf") if poison else 1.0) * plugin.loss_scale).backward()
        return loss

    plugin.optimizer_step(opt, model=model, closure=lambda: closure(False))
    masters = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    states = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
    plugin.optimizer_step(opt, model=model, closure=lambda: closure(True))
    after = [p.detach() for g in opt.param_groups for p in g["params"]]
    same_masters = all(torch.equal(a, b) for a, b in zip(masters, after, strict=True))
    same_state = all(
        torch.equal(v, s2[k]) for s1, s2 in zip(states, opt.state.values(), strict=True) for k, v in s1.items()
    )
    no_grads = all(p.grad is None for g in opt.param_groups for p in g["params"])
    return same_masters and same_state and no_grads and plugin.skipped_steps == 1


@pytest.mark.timeout(60)
def test_skipped_step_leaves_masters_state_and_grads_untouched() -> None:
    assert run_ranks(_skip_changes_nothing, 2, timeout_s=45) == [True, True]


def _overflow_forever(rank: int, world: int) -> str:
    try:
        _train(rank, world, 2, {s: [0] for s in range(6)}, {"initial_scale_power": 2, "min_loss_scale": 2.0,
                                                            "hysteresis": 1})
    except LossScaleAtMinimumError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(60)
def test_overflow_at_minimum_scale_stops_with_a_named_error() -> None:
    messages = run_ranks(_overflow_forever, 2, timeout_s=45)
    for message in messages:
        assert "minimum" in message and "bf16" in message and "step 1" in message
        assert "blocks." in message or "head." in message  # names the first non-finite parameter


def _manual_clip_then_step(rank: int, world: int, stage: int) -> dict:
    """Manual optimization's order in fp16: backward of the scaled loss, clip, step — twice, the second step with
    an overflow. Returns the global norm of the first update of the fp32 masters and the scaler's state."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: the update is exactly -lr * clipped grad
    plugin = ZeroPrecision("16-mixed", initial_scale_power=8, hysteresis=1)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, min_unit_numel=10**9), policy=plugin.policy())
    plugin.attach(engine)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    update_norm = 0.0
    for poison in (False, True):
        masters = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean() * 100.0  # large gradients: clipping to 0.01 bites
        (loss * (float("inf") if poison and rank == 1 else 1.0) * plugin.loss_scale).backward()
        plugin.clip_grad_by_norm(opt, 0.01)  # what self.clip_gradients(opt, ...) runs
        plugin.optimizer_step(opt, model=model, closure=lambda: None)  # what opt.step() runs
        if not poison:
            after = [p.detach() for g in opt.param_groups for p in g["params"]]
            local = torch.stack([(a - b).double().pow(2).sum() for a, b in zip(after, masters, strict=True)]).sum()
            dist.all_reduce(local)
            update_norm = float(local.sqrt())
    return {"update_norm": update_norm, "scale": plugin.loss_scale, "skipped": plugin.skipped_steps}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_manual_clipping_unscales_once_before_the_step(stage: int) -> None:
    """The clip unscales (and, at stage 1, reduces) the gradients; the step must not unscale them again nor move
    the scale twice. An update norm of lr * max_norm proves both: clipping scaled gradients, or unscaling twice,
    would give lr * max_norm / 256."""
    for result in run_ranks(_manual_clip_then_step, 2, stage, timeout_s=45):
        assert result["update_norm"] == pytest.approx(0.1 * 0.01, rel=1e-4)
        assert result["skipped"] == 1 and result["scale"] == 2.0**7  # one overflow: halved once
