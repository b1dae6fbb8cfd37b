"""Models, optimizers and training patterns where several optimizers step the same parameters, with a
single-process reference (plain torch: the global batch's mean loss is what DDP averages, so its gradients are
DDP's).

- ``SharedNet`` + ``net_optimizers``: two optimizers over *every* parameter, with param groups that split the
  root unit's parameters differently in each (the master pieces are cut where either optimizer's group changes).
  Patterns: ``alternate`` (Lightning's manual-optimization example: one optimizer per batch, in turn, each followed
  by its zero_grad), ``both`` (one backward, both optimizers step with the same gradient, then one zero_grad clears
  it for both), ``accumulate`` (two micro-batches per step, alternating).
- ``SharedGAN`` + ``gan_optimizers``: a GAN whose generator's optimizer also covers a layer the discriminator's
  holds (``shared``, in the root unit). Patterns: ``gan`` (both zero_grads after G's step, as Lightning's GAN
  example), ``gan_keep_d`` (D's gradients from G's loss are kept and reach D's step; ``shared``'s are cleared by
  G's zero_grad).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from helpers.models import rank_slice

WIDTH = 9  # odd: every flat buffer is padded for 2 ranks
STEPS = 4
GLOBAL_BATCH = 8


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.ln = nn.LayerNorm(width)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.ln(self.fc(x)))


class SharedNet(nn.Module):
    """inp → two blocks (units: children of a ModuleList) → out; ``inp`` and ``out`` are the root unit."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(2))
        self.out = nn.Linear(WIDTH, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def net_optimizers(model: SharedNet) -> list[Optimizer]:
    """SGD with momentum grouped by weights/biases, AdamW grouped by ``inp`` vs the rest: in the root unit the two
    optimizers' groups cross (inp.weight (0,0), out.weight (0,1), inp.bias (1,0), out.bias (1,1))."""
    weights = [model.inp.weight, model.out.weight] + [b.fc.weight for b in model.blocks]
    rest = [p for p in model.parameters() if all(p is not w for w in weights)]
    sgd = torch.optim.SGD([{"params": weights}, {"params": rest, "lr": 0.05}], lr=0.1, momentum=0.9)
    inp = list(model.inp.parameters())
    others = [p for p in model.parameters() if all(p is not q for q in inp)]
    adamw = torch.optim.AdamW([{"params": inp}, {"params": others, "lr": 0.02}], lr=0.01, weight_decay=0.1)
    return [sgd, adamw]


class SharedGAN(nn.Module):
    """``shared`` ends the generator and starts the discriminator; G's and D's layers are units of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = nn.ModuleList([nn.Linear(4, 7), nn.Linear(7, 6)])
        self.shared = nn.Linear(6, 6)
        self.disc = nn.ModuleList([nn.Linear(6, 7), nn.Linear(7, 1)])

    def generate(self, z: Tensor) -> Tensor:
        return self.shared(self.gen[1](torch.tanh(self.gen[0](z))))

    def discriminate(self, x: Tensor) -> Tensor:
        return self.disc[1](torch.tanh(self.disc[0](torch.tanh(self.shared(x))))).squeeze(-1)


def gan_optimizers(model: SharedGAN) -> list[Optimizer]:
    """G: Adam over gen + shared; D: SGD over disc, and shared in a group of its own."""
    opt_g = torch.optim.Adam([*model.gen.parameters(), *model.shared.parameters()], lr=1e-2, betas=(0.5, 0.9))
    opt_d = torch.optim.SGD([{"params": model.disc.parameters()}, {"params": model.shared.parameters(), "lr": 0.02}],
                            lr=0.1, momentum=0.5)
    return [opt_g, opt_d]


PATTERNS = {"alternate": "net", "both": "net", "accumulate": "net", "gan": "gan", "gan_keep_d": "gan"}


def make(kind: str, seed: int = 0) -> tuple[nn.Module, list[Optimizer]]:
    torch.manual_seed(seed)
    if kind == "net":
        net = SharedNet()
        return net, net_optimizers(net)
    gan = SharedGAN()
    return gan, gan_optimizers(gan)


def batches(kind: str, seed: int = 5) -> list[tuple[Tensor, Tensor]]:
    """Per step, two global micro-batches (inputs, targets)."""
    g = torch.Generator().manual_seed(seed)
    width = 5 if kind == "net" else 4
    out = []
    for _ in range(STEPS * 2):
        x = torch.randn(GLOBAL_BATCH, width, generator=g)
        y = torch.randn(GLOBAL_BATCH, 3 if kind == "net" else 6, generator=g)
        out.append((x, y))
    return out


Step = Callable[[Optimizer], None]


def train(pattern: str, model: nn.Module, optimizers: list[Optimizer], data: list[tuple[Tensor, Tensor]],
          step: Step, part: Callable[[Tensor], Tensor], steps: range = range(STEPS)) -> None:
    """Run ``pattern`` for ``steps``; ``step(opt)`` steps (ZeRO: ``engine.optimizer_step``), ``part`` cuts a global
    batch to this rank's share (the reference: the whole batch)."""
    first, second = optimizers
    for index in steps:
        (x0, y0), (x1, y1) = data[2 * index], data[2 * index + 1]
        if pattern == "alternate":
            _mse(model, part(x0), part(y0)).backward()
            opt = first if index % 2 == 0 else second
            step(opt)
            opt.zero_grad()
        elif pattern == "both":
            _mse(model, part(x0), part(y0)).backward()
            order = (first, second) if index % 2 == 0 else (second, first)
            step(order[0])
            step(order[1])  # the same gradient, as under DDP
            order[0].zero_grad()  # clears it for both
        elif pattern == "accumulate":
            for x, y in ((x0, y0), (x1, y1)):
                (_mse(model, part(x), part(y)) / 2).backward()
            opt = first if index % 2 == 0 else second
            step(opt)
            opt.zero_grad()
        else:
            _gan_step(model, first, second, (part(x0), part(y0)), step, keep_d=pattern == "gan_keep_d")


def _mse(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return nn.functional.mse_loss(model(x), y)


def _gan_step(gan: nn.Module, opt_g: Optimizer, opt_d: Optimizer, batch: tuple[Tensor, Tensor], step: Step,
              keep_d: bool) -> None:
    z, real = batch
    bce = nn.functional.binary_cross_entropy_with_logits
    d_fake = gan.discriminate(gan.generate(z))
    bce(d_fake, torch.ones_like(d_fake)).backward()  # reaches D's parameters too
    step(opt_g)
    opt_g.zero_grad()  # clears shared's gradient for D as well
    if not keep_d:
        opt_d.zero_grad()
    d_real, d_fake = gan.discriminate(real), gan.discriminate(gan.generate(z).detach())
    (bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))).backward()
    step(opt_d)
    opt_d.zero_grad()


def reference(pattern: str, initial: dict[str, Tensor], steps: range = range(STEPS)) -> dict[str, Tensor]:
    """One process, the whole global batch (plain torch steps)."""
    return reference_run(pattern, initial, steps)[0]


def reference_run(
    pattern: str, initial: dict[str, Tensor], steps: range = range(STEPS)
) -> tuple[dict[str, Tensor], dict[tuple[int, str, str], Tensor | float]]:
    """The reference's final state and its optimizers' states as ``{(optimizer, parameter, state name): value}``."""
    model, optimizers = make(PATTERNS[pattern])
    model.load_state_dict(initial)
    train(pattern, model, optimizers, batches(PATTERNS[pattern]), lambda opt: opt.step(), lambda t: t, steps)
    names = {id(p): n for n, p in model.named_parameters()}
    states: dict[tuple[int, str, str], Tensor | float] = {}
    for index, optimizer in enumerate(optimizers):
        for param, state in optimizer.state.items():
            for key, value in state.items():
                scalar = not isinstance(value, Tensor) or value.dim() == 0
                states[(index, names[id(param)], key)] = float(value) if scalar else value.detach().reshape(-1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, states


def rank_part(rank: int, world_size: int) -> Callable[[Tensor], Tensor]:
    return lambda t: rank_slice(t, rank, world_size)
