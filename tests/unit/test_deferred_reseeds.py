"""Reseeding inside a meta-device build (torch.manual_seed, set_rng_state, fork_rng, Generator.manual_seed/set_state,
Lightning's seed_everything / isolate_rng) is replayed in order: the values equal an eager build's bit for bit, and
every generator (torch's, an explicit one, Python's and numpy's) ends where the eager build leaves it."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch.utilities.seed import isolate_rng
from torch import Tensor, nn

from zero_strategy.core.init import DeferredInitError, ModuleReplay, materialize_module, record_construction

SEED = 1234
# a generator state taken before (outside) any build: setting it inside the build is a value, not a position
EARLIER_STATE = torch.Generator().manual_seed(99).get_state()


class SeedsBetweenLayers(nn.Module):
    """Lightning's demo pattern (seed first), then the same seed again after draws, then another seed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.first = nn.Linear(5, 6)
        torch.manual_seed(7)  # the generator's state equals the one before `first` only in an eager build
        self.second = nn.Linear(5, 6)
        self.third = nn.Linear(6, 3)
        torch.manual_seed(11)
        self.emb = nn.Embedding(9, 4)


class ForkRngAfterDraws(nn.Module):
    """`fork_rng` saves the state inside the build after draws and restores it on exit."""

    def __init__(self) -> None:
        super().__init__()
        self.before = nn.Linear(4, 4)
        with torch.random.fork_rng():
            torch.manual_seed(3)
            self.inside = nn.Linear(4, 4)
        self.after = nn.Linear(4, 4)  # draws what it would have drawn without the block
        saved = torch.get_rng_state()
        self.dead = nn.Linear(4, 4)
        torch.set_rng_state(saved)  # rewinds over `dead`'s draws
        self.again = nn.Linear(4, 4)  # equals `dead` in an eager build


class SetsAnEarlierState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        torch.set_rng_state(EARLIER_STATE)
        self.b = nn.Linear(3, 3)


class LightningSeeding(nn.Module):
    """seed_everything and isolate_rng inside the build; Python and numpy draws shape the initialization."""

    def __init__(self) -> None:
        super().__init__()
        seed_everything(7, verbose=False)
        self.a = nn.Linear(4, 4)
        with isolate_rng():
            torch.manual_seed(5)
            nn.init.normal_(self.a.weight, std=random.random())
        self.b = nn.Linear(4, 4)
        nn.init.constant_(self.b.bias, float(np.random.rand()))


class ReseedsItsGenerator(nn.Module):
    """An explicit generator: seeded, drawn from, its state saved and set back, reseeded; the default one between."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 6))
        generator.manual_seed(1)
        nn.init.normal_(self.w, generator=generator)
        saved = generator.get_state()
        self.v = nn.Parameter(torch.empty(6))
        nn.init.uniform_(self.v, generator=generator)
        self.lin = nn.Linear(6, 2)
        generator.set_state(saved)
        self.u = nn.Parameter(torch.empty(6))
        nn.init.uniform_(self.u, generator=generator)  # equals v in an eager build
        generator.manual_seed(2)
        nn.init.uniform_(self.lin.bias, generator=generator)


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "seeds_between_layers": SeedsBetweenLayers,
    "fork_rng_after_draws": ForkRngAfterDraws,
    "sets_an_earlier_state": SetsAnEarlierState,
    "lightning_seeding": LightningSeeding,
    "reseeds_its_generator": lambda: ReseedsItsGenerator(torch.Generator()),
}


def _generators() -> tuple[Tensor, Any, Any]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _seed_all() -> None:
    torch.manual_seed(SEED)
    random.seed(SEED)
    np.random.seed(SEED)


def _values(model: nn.Module) -> dict[str, Tensor]:
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


def _assert_same_generators(got: tuple[Tensor, Any, Any], expected: tuple[Tensor, Any, Any]) -> None:
    assert torch.equal(got[0], expected[0]), "torch's generator must end where an eager build leaves it"
    assert got[1] == expected[1], "Python's random state must end where an eager build leaves it"
    assert all(np.array_equal(a, b) for a, b in zip(got[2], expected[2], strict=True)), "numpy's state differs"


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_reseeds_inside_the_build_replay_bit_for_bit(name: str) -> None:
    build = BUILDERS[name]
    _seed_all()
    eager = build()
    eager_generators = _generators()
    _seed_all()
    with record_construction() as recording:
        model = build()
    assert all(p.is_meta for p in model.parameters())
    materialize_module(model, recording)
    _assert_same_generators(_generators(), eager_generators)
    expected, got = _values(eager), _values(model)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), f"{name}: {key} differs from the eager build"


def test_rewinding_states_give_the_eager_repeats() -> None:
    """The builds rewind on purpose: the replayed values repeat where the eager ones do."""
    built = []
    for build in (SeedsBetweenLayers, ForkRngAfterDraws, lambda: ReseedsItsGenerator(torch.Generator())):
        torch.manual_seed(SEED)
        with record_construction() as recording:
            model = build()
        materialize_module(model, recording)
        built.append(model)
    seeds, forks, own = built
    assert torch.equal(seeds.first.weight, seeds.second.weight)
    assert torch.equal(forks.again.weight, forks.dead.weight)
    assert torch.equal(own.u, own.v)


def test_an_explicit_generator_ends_like_in_the_eager_build() -> None:
    eager_generator, generator = torch.Generator(), torch.Generator()
    torch.manual_seed(SEED)
    eager = ReseedsItsGenerator(eager_generator)
    torch.manual_seed(SEED)
    with record_construction() as recording:
        model = ReseedsItsGenerator(generator)
    materialize_module(model, recording)
    assert torch.equal(generator.get_state(), eager_generator.get_state())
    assert all(torch.equal(a, b) for a, b in zip(eager.parameters(), model.parameters(), strict=True))


class SeedsFromTheClock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seed = torch.seed()  # a seed nobody chose: the recorded state is what replay uses
        self.lin = nn.Linear(4, 4)


def test_a_nondeterministic_seed_replays_the_recorded_state() -> None:
    with record_construction() as recording:
        model = SeedsFromTheClock()
    plan = ModuleReplay(recording, model)
    first: dict[int, Tensor] = {}
    second: dict[int, Tensor] = {}
    plan.replay(lambda final, value: first.__setitem__(final.key, value))
    torch.manual_seed(SEED)
    plan.replay(lambda final, value: second.__setitem__(final.key, value))
    torch.manual_seed(model.seed)
    eager = nn.Linear(4, 4)
    assert torch.equal(first[plan.key_of("lin.weight")], eager.weight)
    assert all(torch.equal(first[key], second[key]) for key in first)


class ReadsTheSeedAfterDraws(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seed = torch.initial_seed()


def test_reading_the_seed_after_draws_is_a_clear_error() -> None:
    torch.manual_seed(SEED)
    with pytest.raises(DeferredInitError, match=r"initial_seed\(\).*ReadsTheSeedAfterDraws.__init__"):
        with record_construction():
            ReadsTheSeedAfterDraws()
    assert torch.initial_seed() == SEED, "the generator is left where the build found it"


def test_a_generator_state_is_not_left_at_a_placeholder_after_recording() -> None:
    torch.manual_seed(SEED)
    before = torch.get_rng_state()
    with record_construction():
        nn.Linear(4, 4)
    assert torch.equal(torch.get_rng_state(), before), "until replay, the generator stays where the build found it"
    torch.manual_seed(SEED)
    with record_construction():
        SeedsBetweenLayers()
    assert torch.initial_seed() == 11, "the last seed the build set, as in an eager build"
