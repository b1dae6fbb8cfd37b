"""Deferred initialization: a meta-device build replayed value by value equals an eager build, bit for bit."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from helpers.meta_models import sinusoid_table
from helpers.storage_meter import StoragePeakMeter
from torch import Tensor, nn

from zero_strategy.core.init import DeferredInitError, ModuleReplay, materialize_module, record_construction

SEED = 1234


class MLP(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


class Block(nn.Module):
    def __init__(self, width: int, n_layer: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.c_proj(torch.relu(self.c_fc(self.ln(x))))


class GPT(nn.Module):
    """GPT-2 style init: `self.apply(_init_weights)`, scaled c_proj re-init, embedding tied to the head."""

    def __init__(self, vocab: int = 64, width: int = 32, n_layer: int = 2, context: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, n_layer) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                param.data.normal_(0.0, 0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)


class PositionalWithNorm(nn.Module):
    """A buffer computed with arange/sin in __init__, a BatchNorm's running stats, a padded embedding."""

    def __init__(self, context: int = 12, width: int = 8) -> None:
        super().__init__()
        self.register_buffer("pe", sinusoid_table(context, width))
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))
        self.norm = nn.BatchNorm1d(width)
        self.embed = nn.Embedding(10, width, padding_idx=3)


class SpecialInits(nn.Module):
    """torch.nn.init functions that torch 2.13 skips on meta tensors (trunc_normal_ is rejection sampling)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(6, 10))
        self.b = nn.Parameter(torch.empty(10, 4))
        self.c = nn.Parameter(torch.empty(5, 5))
        self.d = nn.Parameter(torch.empty(4, 2, 3, 3))
        self.e = nn.Parameter(torch.empty(7, 3))
        nn.init.trunc_normal_(self.a, std=0.5, a=-0.6, b=0.6)
        nn.init.trunc_normal_(self.e, std=1.0, a=-3.0, b=0.5)
        nn.init.orthogonal_(self.b, gain=2.0)
        nn.init.sparse_(self.c, sparsity=0.4)
        nn.init.dirac_(self.d)
        nn.init.xavier_normal_(self.c[1:3])  # a partial write after the black box
        nn.init.kaiming_normal_(torch.empty(3, 3))  # dead, but its draws count


class CopiesRealTensor(nn.Module):
    def __init__(self, table: Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.empty(table.shape))
        with torch.no_grad():
            self.table.copy_(table)
        self.proj = nn.Linear(table.shape[1], 3)


class OwnGenerator(nn.Module):
    """Draws from its own seeded torch.Generator, then from the default one."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(5)
        self.w = nn.Parameter(torch.empty(4, 6))
        nn.init.normal_(self.w, generator=generator)
        self.v = nn.Linear(6, 2)
        nn.init.uniform_(self.v.bias, generator=generator)


class ReassignsAndCasts(nn.Module):
    """`weight.data = randn(...)`, a bf16 cast, a conv, a tril mask buffer, padding zeros then re-init."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.a.weight.data = torch.randn(7, 5) * 3
        self.b = nn.Linear(5, 5).to(torch.bfloat16)
        self.c = nn.Conv2d(3, 4, 3)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)).view(1, 1, 4, 4))
        self.e = nn.Embedding(6, 4, padding_idx=0)
        self.e.weight.data.normal_(0, 0.02)


class FromTensorLists(nn.Module):
    """A buffer and a parameter made by ops that take a list of tensors (stack, cat read every one of them)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.stack([torch.arange(3.0), -torch.arange(3.0)]))
        self.weight = nn.Parameter(torch.cat([torch.randn(2, 3), torch.zeros(1, 3)]))


REAL_TABLE = torch.arange(12.0).reshape(4, 3) / 7

BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "mlp": MLP,
    "transformer": lambda: nn.Transformer(
        d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32, batch_first=True
    ),
    "gpt": GPT,
    "positional_batchnorm_padding": PositionalWithNorm,
    "special_inits": SpecialInits,
    "copies_real_tensor": lambda: CopiesRealTensor(REAL_TABLE),
    "own_generator": OwnGenerator,
    "reassigns_and_casts": ReassignsAndCasts,
    "from_tensor_lists": FromTensorLists,
}


def _eager(build: Callable[[], nn.Module]) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(SEED)
    model = build()
    return model, torch.get_rng_state()


def _state(model: nn.Module) -> dict[str, Tensor]:
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_replay_equals_eager_bit_for_bit(name: str) -> None:
    build = BUILDERS[name]
    eager, eager_rng = _eager(build)
    torch.manual_seed(SEED)
    with record_construction() as recording:
        model = build()
    assert all(t.is_meta for t in model.parameters())
    params_before = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    materialize_module(model, recording)
    assert torch.equal(torch.get_rng_state(), eager_rng), "the generator must end where an eager build leaves it"
    expected, got = _state(eager), _state(model)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert not got[key].is_meta, key
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)} == params_before


def test_ties_stay_one_parameter_and_names_share_a_key() -> None:
    torch.manual_seed(SEED)
    with record_construction() as recording:
        model = GPT()
    plan = ModuleReplay(recording, model)
    assert plan.key_of("wte.weight") == plan.key_of("lm_head.weight")
    materialize_module(model, recording)
    assert model.wte.weight is model.lm_head.weight
    assert len({id(p) for p in model.parameters()}) == len(list(model.parameters()))


def test_replay_holds_a_few_tensors_not_the_model() -> None:
    """The storage the replay holds at once, measured by watching every op (StoragePeakMeter), not the replay's
    own count: one value being written + one dead-init scratch + the small biases/norms around them, ≤ 3 × the
    largest tensor, while the model is ≥ 10 × that tensor. The same meter sees a build that keeps every value."""
    torch.manual_seed(SEED)
    with record_construction() as recording:
        model = GPT(vocab=128, width=32, n_layer=6, context=32)
    plan = ModuleReplay(recording, model)
    largest = max(t.ref.nbytes for t in plan.tensors)
    total = sum(t.ref.nbytes for t in plan.tensors)
    assert total >= 10 * largest
    keys: set[int] = set()
    with StoragePeakMeter() as meter:
        stats = plan.replay(lambda final, value: keys.add(final.key))  # allocates nothing of its own
    assert len(keys) == len(plan.tensors)
    assert meter.peak_bytes <= 3 * largest, (meter.peak_bytes, largest)
    assert stats.ops_on_scratch > 0  # the Linear/Embedding defaults, overwritten by _init_weights
    # the control: materialize_module keeps every value in the module, and the meter sees the whole model
    torch.manual_seed(SEED)
    with record_construction() as recording:
        model = GPT(vocab=128, width=32, n_layer=6, context=32)
    with StoragePeakMeter() as meter:
        materialize_module(model, recording)
    assert meter.peak_bytes >= total, (meter.peak_bytes, total)


class ReadsValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        if self.lin.weight.abs().max().item() > 10:
            raise AssertionError("unreachable")


class ReadsNumpy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.max_value = float(self.lin.weight.detach().numpy().max())


class RealRandom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.noise = nn.Parameter(torch.randn(3, device="cpu"))


@pytest.mark.parametrize(
    ("build", "patterns"),
    [
        (ReadsValue, ["reads a tensor's value", "ReadsValue.__init__", "reset_parameters()", "eagerly"]),
        (ReadsNumpy, ["meta device failed", "ReadsNumpy.__init__", "numpy", "eagerly"]),
        (RealRandom, ["real (non-meta) tensor", "RealRandom.__init__", "draw random numbers only"]),
    ],
)
def test_unreplayable_construction_is_a_clear_error(build: Callable[[], nn.Module], patterns: list[str]) -> None:
    torch.manual_seed(SEED)
    with pytest.raises(DeferredInitError) as raised, record_construction():
        build()
    for pattern in patterns:
        assert pattern in str(raised.value), (pattern, str(raised.value))


def test_real_tensor_changed_after_the_copy_is_a_clear_error() -> None:
    table = REAL_TABLE.clone()
    with record_construction() as recording:
        model = CopiesRealTensor(table)
    table.mul_(2)  # replay would read the new values
    with pytest.raises(DeferredInitError, match="modified in place after the copy"):
        materialize_module(model, recording)


@pytest.mark.parametrize("build", [OwnGenerator, GPT])
def test_a_second_replay_gives_the_same_values(build: Callable[[], nn.Module]) -> None:
    torch.manual_seed(SEED)
    with record_construction() as recording:
        model = build()
    plan = ModuleReplay(recording, model)
    first: dict[int, Tensor] = {}
    second: dict[int, Tensor] = {}
    plan.replay(lambda final, value: first.__setitem__(final.key, value))
    torch.manual_seed(SEED + 1)  # whatever ran in between, generators restart from the recorded states
    plan.replay(lambda final, value: second.__setitem__(final.key, value))
    assert first.keys() == second.keys() == {t.key for t in plan.tensors}
    assert all(torch.equal(first[key], second[key]) for key in first)
