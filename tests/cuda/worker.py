"""One rank of the CUDA tier, launched by ``torchrun`` (CUDA cannot be used in forked children).

Device-parametrised: ``--device cuda`` runs on this rank's GPU with NCCL, ``--device cpu`` on the CPU with gloo
(how CI proves this script without a GPU). Each scenario asserts on its own and a failure exits non-zero with the
reason; rank 0 prints one ``ok <scenario>`` line per scenario that passed.

Scenarios (comma-separated ``--scenarios``):
- ``parity:<stage>:<precision>[:<offload>]``: ZeRO against an independent single-process computation of the same
  maths on the same device (every rank's micro-batches, fp32 masters, a low-precision compute copy under
  autocast, gradients averaged in fp32); precision fp32 | bf16 | fp16 (a static loss scale of 2**8, unscaled and
  checked for overflow by ZeroPrecision); offload none | cpu | nvme. Each parameter's update ``w - w0`` is held to
  the reference's, relative to the size of that update (see [Note: compare updates, not weights]).
- ``sync:<stage>:<precision>``: steady-state steps (clipping included) under
  ``torch.cuda.set_sync_debug_mode("error")``: any host synchronisation raises (CUDA only; on the CPU the steps run
  without the mode).
- ``save:<stage>:<dir>`` / ``resume:<stage>:<dir>``: train 2 AdamW steps and save a sharded checkpoint, train 2
  more and record the result; another launch (any device, any world size) loads it, checks the step counters are
  on the CPU, restores this rank's RNG, trains the same 2 steps and must reach the same weights.
- ``lightning:<stage>:<precision>:<dir>``: the Lightning adapter on this device: a ``Trainer`` fit with clipping and
  the communication profiler saving a sharded checkpoint (``ModelCheckpoint`` at an epoch end), a resumed fit from
  it (strategy barrier, precision plugin, checkpoint IO, RNG restore), whose weights' updates must match an
  uninterrupted ``ddp`` fit's with the same precision flag (fp32 reference for fp16 on a CPU, where Lightning
  has no fp16 autocast).

[Note: compare updates, not weights]
A few steps move a weight by a small fraction of its size (the embedding and LayerNorm weights here by 0.1-0.4 %
of their largest value), so a tolerance relative to the weights would let a parameter that never moved pass.
Every comparison here holds ``w - w0`` to the reference's ``r - w0``, relative to the largest element of the
reference's update: a missing update scores 1, a doubled one 1. The tolerance is then the rounding each precision
adds to an update, with room for the device's kernels: fp32 (the same maths, summed in another order) 1e-3; bf16
and fp16 5e-2 (against the single-process reference the compute copies round alike until the masters differ in a
last bit; against DDP's autocast, which keeps fp32 weights and embedding outputs, activations round differently).
Measured on 2 CPU ranks (tests/cuda/test_worker_on_cpu.py): parity fp32 1.5e-5, bf16 and fp16 0 (bit-identical);
Lightning against DDP fp32 4.5e-6, bf16 7.7e-3, fp16 (against fp32 on a CPU) 1.2e-3. Not yet measured on a GPU.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zero_strategy import ZeroConfig, ZeroEngine, ZeroPrecision
from zero_strategy.checkpoint.base.format import PARAM_GROUPS_KEY
from zero_strategy.checkpoint.sharded.load import check_compatible, load_optimizer_state, load_weights, restore_rank_rng
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint
from zero_strategy.checkpoint.sharded.save import SaveInfo, save_sharded
from zero_strategy.core.plan.precision import NORMALIZATION_LAYERS

STEPS, ACCUM, PER_RANK, VOCAB, WIDTH = 3, 2, 4, 32, 64
PRECISIONS = {"fp32": ("32-true", torch.float32), "bf16": ("bf16-mixed", torch.bfloat16),
              "fp16": ("16-mixed", torch.float16)}
FP16_SCALE = 2.0**8
# Largest update error relative to the reference's largest update: see [Note: compare updates, not weights].
TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 5e-2}


class Net(nn.Module):
    """A small language model: embedding, pre-norm residual MLP blocks (units of their own), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
            for _ in range(3)
        )
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def batches(world: int, device: torch.device, steps: int = STEPS, seed: int = 3) -> Tensor:
    tokens = torch.randint(0, VOCAB, (steps, ACCUM, world * PER_RANK, 9), generator=torch.Generator().manual_seed(seed))
    return tokens.to(device)


def loss_of(model: nn.Module, x: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(x[:, :-1])
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1)) / ACCUM


def reference(world: int, dtype: torch.dtype, device: torch.device) -> dict[str, Tensor]:
    """Plain torch in this one process: what ZeRO over ``world`` ranks must compute."""
    torch.manual_seed(0)
    master = Net().to(device)
    opt = torch.optim.SGD(master.parameters(), lr=0.3, momentum=0.9)
    scale = FP16_SCALE if dtype == torch.float16 else 1.0
    for step in batches(world, device):
        compute = copy.deepcopy(master)
        for module in compute.modules():
            if not isinstance(module, NORMALIZATION_LAYERS):
                for param in module.parameters(recurse=False):
                    param.data = param.data.to(dtype)
        grads = {n: torch.zeros_like(p) for n, p in master.named_parameters()}
        for micro in step:
            for rank in range(world):
                compute.zero_grad()
                (loss_of(compute, micro[rank * PER_RANK : (rank + 1) * PER_RANK], dtype, device) * scale).backward()
                for name, param in compute.named_parameters():
                    grads[name] += param.grad.float() / scale / world  # type: ignore[union-attr]
        for name, param in master.named_parameters():
            param.grad = grads[name]
        opt.step()
    return {k: v.detach().clone() for k, v in master.state_dict().items()}


def initial_state() -> dict[str, Tensor]:
    """Net's weights before training (every run and the references start from seed 0)."""
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in Net().state_dict().items()}


def assert_updates_match(got: dict[str, Tensor], expected: dict[str, Tensor], initial: dict[str, Tensor],
                         tolerance: float, what: str) -> None:  # fmt: skip
    """Every parameter's update ``got - initial`` equals ``expected - initial`` within ``tolerance`` of the largest
    element of the expected update (see [Note: compare updates, not weights]). Keys must agree, shapes too, and
    every value be finite: ``nan < tolerance`` is False, but an explicit check names the tensor and the side."""
    # this script runs under torchrun without tests/ on the path, so it checks here what helpers.compare would
    assert got.keys() == initial.keys() == expected.keys(), (
        f"{what}: keys differ: got {sorted(got.keys() ^ initial.keys())}, "
        f"reference {sorted(expected.keys() ^ initial.keys())} (against the initial state)")
    for key, start in initial.items():
        for side, value in (("result", got[key]), ("reference", expected[key])):
            assert value.shape == start.shape, f"{what}: {key}: the {side}'s shape {tuple(value.shape)}"
            assert bool(torch.isfinite(value).all()), f"{what}: {key}: the {side} holds non-finite values"
        start = start.float().cpu()
        reference = expected[key].float().cpu() - start
        update = got[key].float().cpu() - start
        size = float(reference.abs().max())
        assert size > 0, f"{what}: the reference did not move {key}: nothing to compare"
        error = float((update - reference).abs().max()) / size
        assert error < tolerance, f"{what}: {key}'s update is {error:.2e} off the reference's (limit {tolerance})"


def offload_config(offload: str, nvme_dir: str) -> dict[str, object]:
    if offload == "none":
        return {}
    return {"offload_optimizer": offload, "nvme_path": nvme_dir if offload == "nvme" else None}


def parity(stage: int, precision: str, offload: str, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    name, dtype = PRECISIONS[precision]
    expected = reference(world, dtype, device)
    torch.manual_seed(0)
    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    plugin = ZeroPrecision(name, loss_scale=FP16_SCALE if precision == "fp16" else 0.0)
    with tempfile.TemporaryDirectory() as nvme:
        config = ZeroConfig(stage=stage, min_unit_numel=1, **offload_config(offload, nvme))  # type: ignore[arg-type]
        engine = ZeroEngine(model, [opt], config, policy=plugin.policy())
        plugin.attach(engine)
        for step in batches(world, device):

            def closure(step: Tensor = step) -> Tensor:
                opt.zero_grad()
                for micro in step:
                    loss = loss_of(model, micro[rank * PER_RANK : (rank + 1) * PER_RANK], dtype, device)
                    (loss * plugin.loss_scale).backward()
                return loss

            plugin.optimizer_step(opt, model=model, closure=closure)
        engine.release()  # the module gets the fp32 masters back
    assert_updates_match(model.state_dict(), expected, initial_state(), TOLERANCE[precision],
                         f"stage {stage}, {precision}, offload {offload}")  # fmt: skip


def sync_free_steps(stage: int, precision: str, device: torch.device) -> None:
    """Steady-state steps may not synchronise with the host (stage 3: the gathers of the next forward included)."""
    rank = dist.get_rank()
    _, dtype = PRECISIONS[precision]
    assert precision != "fp16", "an fp16 step reads its overflow flag on the host, as torch's GradScaler does"
    torch.manual_seed(0)
    model = Net().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plugin = ZeroPrecision(PRECISIONS[precision][0])
    engine = ZeroEngine(model, [opt], ZeroConfig(stage=stage, min_unit_numel=1), policy=plugin.policy())
    data = batches(dist.get_world_size(), device, steps=6)

    def step(index: int) -> None:
        opt.zero_grad()
        for micro in data[index]:
            loss_of(model, micro[rank * PER_RANK : (rank + 1) * PER_RANK], dtype, device).backward()
        with engine.step_window(opt):
            engine.clip_grad_norm_(opt, 1.0)
            engine.step(opt)

    for index in range(3):  # warm-up: first-step agreements, optimizer state, allocator caches
        step(index)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        for index in range(3, 6):
            step(index)
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    engine.release()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _trained(stage: int, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer, ZeroEngine]:
    torch.manual_seed(0)
    model = Net().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, ZeroEngine(model, [opt], ZeroConfig(stage=stage, min_unit_numel=1))


def _train(model: nn.Module, opt: torch.optim.Optimizer, engine: ZeroEngine, steps: Tensor) -> None:
    rank, world, device = dist.get_rank(), dist.get_world_size(), next(model.parameters()).device
    per_rank = steps.shape[2] // world  # the same global batch whatever the world size
    for step in steps.to(device):
        opt.zero_grad()
        for micro in step:
            loss_of(model, micro[rank * per_rank : (rank + 1) * per_rank], torch.float32, device).backward()
        engine.optimizer_step(opt)


def _full_state(model: nn.Module, engine: ZeroEngine) -> dict[str, Tensor]:
    with engine.gathered_parameters():
        return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


def save(stage: int, folder: str, device: torch.device) -> None:
    model, opt, engine = _trained(stage, device)
    data = batches(4, torch.device("cpu"), steps=4, seed=5)  # a global batch of 16, any world size divides it
    _train(model, opt, engine, data[:2])
    save_sharded(engine, Path(folder) / "ckpt", {"optimizer_states": [{}], "global_step": 2, "epoch": 0},
                 SaveInfo("32-true", {}, {"zero_strategy": "cuda-tier", "torch": torch.__version__}))
    _train(model, opt, engine, data[2:])
    final = _full_state(model, engine)
    if dist.get_rank() == 0:
        torch.save(final, Path(folder) / "expected.pt")
    dist.barrier()


def resume(stage: int, folder: str, device: torch.device) -> None:
    model, opt, engine = _trained(stage, device)
    with ShardedCheckpoint(Path(folder) / "ckpt") as ckpt:
        state = ckpt.trainer_state()
        check_compatible(engine, ckpt, strict=True, with_optimizer=True)
        load_weights(engine, ckpt)
        load_optimizer_state(engine, ckpt, state[PARAM_GROUPS_KEY])
        restore_rank_rng(engine, ckpt)  # a CUDA generator saved on a GPU is skipped on a CPU rank, and the reverse
    steps = [s["step"] for s in opt.state.values() if isinstance(s.get("step"), Tensor)]
    assert steps and all(s.device.type == "cpu" for s in steps), "Adam's step counters must stay on the CPU"
    _train(model, opt, engine, batches(4, torch.device("cpu"), steps=4, seed=5)[2:])
    got = _full_state(model, engine)
    expected = torch.load(Path(folder) / "expected.pt", weights_only=True)
    assert_updates_match(got, expected, initial_state(), 1e-3, f"stage {stage}, resumed vs uninterrupted")


def lightning_fit(stage: int, precision: str, folder: str, device: torch.device) -> None:
    """A Trainer on this device (torchrun's environment: Lightning does not launch) saving at its first epoch's end,
    a resumed one, and an uninterrupted DDP fit as the reference (see the module docstring)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from zero_strategy.lightning.profiler import CommunicationProfiler

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()
            self.start_step = -1

        def on_train_start(self) -> None:
            self.start_step = self.trainer.global_step  # 2 when resumed: the fit continues, it does not restart

        def training_step(self, batch: Tensor, index: int) -> Tensor:
            logits = self.net(batch[:, :-1]).float()
            return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            # SGD: its update is proportional to the gradient, so a gradient error shows in the update (Adam's
            # first steps are near lr * sign(gradient) whatever the gradient's size)
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    world = dist.get_world_size()
    samples = list(batches(world, torch.device("cpu"), steps=1).reshape(-1, 9))  # 2 batches of 4 per rank: an epoch
    data: torch.utils.data.DataLoader[Tensor] = torch.utils.data.DataLoader(samples, batch_size=4)  # type: ignore[arg-type]

    def fit(strategy: str, flag: str, steps: int, ckpt: str | None, callbacks: list[Callback]) -> Lit:
        torch.manual_seed(0)
        model = Lit()
        trainer = pl.Trainer(
            accelerator="gpu" if device.type == "cuda" else "cpu", devices=world, strategy=strategy,
            precision=flag, max_steps=steps, gradient_clip_val=1.0, callbacks=callbacks, logger=False,  # type: ignore[arg-type]
            enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=folder,
        )  # fmt: skip
        trainer.fit(model, data, ckpt_path=ckpt)
        assert trainer.global_step == steps, (strategy, trainer.global_step)
        return model

    flag = PRECISIONS[precision][0]
    every_epoch = ModelCheckpoint(dirpath=Path(folder) / "ckpts", filename="step={step}", auto_insert_metric_name=False,
                                  every_n_train_steps=2, save_top_k=-1)  # fmt: skip
    fit(f"zero{stage}", flag, 2, None, [CommunicationProfiler(), every_epoch])
    resumed = fit(f"zero{stage}", flag, 4, str(Path(folder) / "ckpts" / "step=2.ckpt"), [CommunicationProfiler()])
    assert resumed.start_step == 2, f"the resumed fit started at step {resumed.start_step}"
    reference_flag = "32-true" if precision == "fp16" and device.type == "cpu" else flag  # no fp16 autocast on CPU
    reference = fit("ddp", reference_flag, 4, None, [])
    assert_updates_match(resumed.net.state_dict(), reference.net.state_dict(), initial_state(),
                         TOLERANCE[precision], f"Lightning zero{stage} {precision} (resumed) vs DDP")  # fmt: skip


def scenario(spec: str, device: torch.device) -> Callable[[], None]:
    kind, *args = spec.split(":")
    if kind == "parity":
        offload = args[2] if len(args) > 2 else "none"
        return lambda: parity(int(args[0]), args[1], offload, device)
    if kind == "sync":
        return lambda: sync_free_steps(int(args[0]), args[1], device)
    if kind == "lightning":
        return lambda: lightning_fit(int(args[0]), args[1], ":".join(args[2:]), device)
    if kind in ("save", "resume"):
        action = save if kind == "save" else resume
        return lambda: action(int(args[0]), ":".join(args[1:]), device)
    raise SystemExit(f"unknown scenario {spec!r}; see the module docstring")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--scenarios", required=True)
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA GPU visible to this process")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        for spec in args.scenarios.split(","):
            scenario(spec, device)()
            if dist.get_rank() == 0:
                print(f"ok {spec}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
