"""The random generators a recorded build draws from: where each starts, and every reseed made inside the build.

[Note: reseeds inside the build]
Ops on meta tensors draw no random numbers, so while a build is recorded a generator moves only when code sets its
state: `torch.manual_seed`, `torch.set_rng_state`, `torch.random.fork_rng` restoring on exit, Lightning's
`seed_everything` / `isolate_rng`, `Generator.manual_seed` / `set_state` / `seed`. Each of these ends in a call of
a `torch.Generator` method, which the recording's profile hook sees returning (profile_hook.py), and becomes a step of
the recording, replayed in order with the ops:
* a state set from outside the build's draws (a seed, a state captured before the build) is a `SetState` step
  holding the state right after the call;
* a state captured inside the build after random ops (what `fork_rng` restores) is not a value the recording
  knows: an eager build would have advanced the generator by those draws. So after every recorded random op the
  real generator is moved to a *placeholder* state, seeded with a number that names that point of the recording
  (`Placeholder`). Setting a placeholder state back later is a `RestoreState` step that restores what replay
  captured at that point (a `CaptureState` step inserted right after the op).
When recording ends, each generator goes back to the last state the build really set (or found): replay then
moves it to where an eager build leaves it. Only the generators the values come from are tracked: the replay
device's default generator and explicit generators. Others (the CPU generator when the build replays on a GPU,
the CUDA generators `torch.manual_seed` also seeds) draw nothing during a meta build and were set for real by the
call itself, so they are already where an eager build leaves them. A state changed by something the hook cannot
see (a random op on a real tensor) is caught by comparing each generator with the state the recording last
wrote down: an error, never silently different values.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from zero_strategy.core.init.ops import DeferredInitError, RecordedOp

# `torch.Generator` methods that set a generator's state (every reseeding API above ends in one of them).
RESEEDING_METHODS = frozenset({"manual_seed", "set_state", "seed", "set_offset", "graphsafe_set_state"})
# Placeholder seeds: a range no one seeds with by hand, counted per process (so that no two recordings, even
# nested or kept side by side, name two points with one seed).
_PLACEHOLDER_SEEDS = itertools.count(0x5EED_DEFE_2000_0000)


def default_generator(device: torch.device) -> torch.Generator:
    """The default generator for `device`'s type (the one an eager build there draws from)."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        torch.cuda.init()  # the default CUDA generators exist once CUDA is initialized
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    raise DeferredInitError(f"deferred initialization replays on 'cpu' or 'cuda', not on {device}")


def generator_key(generator: torch.Generator) -> int:
    """Identifies the generator itself: ops seen by a dispatch mode get another Python object for the same one."""
    return int(generator._cdata)  # type: ignore[attr-defined]  # the C generator's address


def is_default_generator(generator: torch.Generator) -> bool:
    """Whether `generator` is some device's default generator (not one the build made or was given)."""
    defaults = (torch.default_generator, *torch.cuda.default_generators)
    return any(generator_key(generator) == generator_key(default) for default in defaults)


@dataclass(slots=True)
class SetState:
    """Replay step: set a generator to a state the build set (rank 0's, once the ranks agree on the states)."""

    generator: torch.Generator
    state: Tensor

    def __call__(self) -> None:
        self.generator.set_state(self.state)


@dataclass(slots=True)
class CaptureState:
    """Replay step: remember a generator's state at this point, for a later `RestoreState`."""

    generator: torch.Generator
    state: Tensor | None = None  # filled by each replay

    def __call__(self) -> None:
        self.state = self.generator.get_state()


@dataclass(slots=True)
class RestoreState:
    """Replay step: set a generator to the state a `CaptureState` step remembered."""

    generator: torch.Generator
    capture: CaptureState

    def __call__(self) -> None:
        assert self.capture.state is not None, "replay runs a capture before the restore that reads it"
        self.generator.set_state(self.capture.state)


@dataclass(slots=True)
class Placeholder:
    """The state of `generator` right after the random op `after`, named by a placeholder seed."""

    generator: torch.Generator
    after: RecordedOp
    capture: CaptureState = field(init=False)
    captured: bool = False  # whether the capture step is in the recording yet (inserted when first restored)

    def __post_init__(self) -> None:
        self.capture = CaptureState(self.generator)


class GeneratorStates:
    """Where the build's generators start and every state the build gives them (see [Note: reseeds inside the
    build])."""

    def __init__(self, device: torch.device) -> None:
        self.default = default_generator(device)
        self.entry_state = self.default.get_state()
        # explicit generators the build drew from before setting them: their state at first use
        self.first_use: dict[int, tuple[torch.Generator, Tensor]] = {}
        self.set_states: list[SetState] = []
        self.placeholders: dict[int, Placeholder] = {}  # placeholder seed -> the point it names
        # the last state the build set, or found (entry, first use): what each generator goes back to at the end
        default_key = generator_key(self.default)
        self._last_set: dict[int, tuple[torch.Generator, Tensor]] = {default_key: (self.default, self.entry_state)}
        self._expected: dict[int, Tensor] = {default_key: self.entry_state}  # what each must hold now
        self.moving = False  # True while this class sets a state itself (the profile hook ignores those calls)

    def tracks(self, generator: torch.Generator) -> bool:
        """Whether values come from `generator` (see [Note: reseeds inside the build])."""
        return generator_key(generator) == generator_key(self.default) or not is_default_generator(generator)

    def note_used(self, values: list[Any]) -> None:
        """Explicit generators an op was given: their state is part of what replay restores."""
        for value in values:
            if isinstance(value, torch.Generator) and generator_key(value) not in self._expected:
                state = value.get_state()
                key = generator_key(value)
                self.first_use[key] = (value, state)
                self._last_set[key] = (value, state)
                self._expected[key] = state

    def drawn_from(self, values: list[Any]) -> torch.Generator:
        """The generator a random op with these arguments draws from."""
        return next((v for v in values if isinstance(v, torch.Generator)), self.default)

    def after_random_op(self, generator: torch.Generator, op: RecordedOp) -> None:
        """`op` drew from `generator`: move it to a placeholder state naming this point."""
        seed = next(_PLACEHOLDER_SEEDS)
        self.placeholders[seed] = Placeholder(generator, op)
        self._move(generator, lambda: generator.manual_seed(seed))

    def placeholder_of(self, generator: torch.Generator) -> Placeholder | None:
        """The point of the recording whose placeholder state `generator` holds, if it holds one."""
        return self.placeholders.get(generator.initial_seed())

    def after_set(self, generator: torch.Generator) -> Placeholder | None:
        """A reseeding method of a tracked `generator` returned. Returns the point it was set back to when the
        state is a placeholder; otherwise writes the state down as a `SetState` (the last of `set_states`)."""
        placeholder = self.placeholder_of(generator)
        state = generator.get_state()
        self._expected[generator_key(generator)] = state
        if placeholder is None:
            self.set_states.append(SetState(generator, state))
            self._last_set[generator_key(generator)] = (generator, state)
        return placeholder

    def tracked(self) -> list[torch.Generator]:
        """The generators whose states this recording writes down (the default one and explicit ones it saw)."""
        return [generator for generator, _ in self._last_set.values()]

    def changed_unseen(self) -> torch.Generator | None:
        """A tracked generator whose state moved since the recording last wrote it down (None: all as expected)."""
        for key, (generator, _) in self._last_set.items():
            if not torch.equal(generator.get_state(), self._expected[key]):
                return generator
        return None

    def finish(self) -> None:
        """Recording ends: each generator back to the last state the build set (or found)."""
        for generator, state in self._last_set.values():
            self._move(generator, lambda g=generator, s=state: g.set_state(s))

    def restore(self) -> None:
        """Replay starts here: every generator back to where the build found it."""
        self.default.set_state(self.entry_state)
        for generator, state in self.first_use.values():
            generator.set_state(state)

    def states(self) -> list[Tensor]:
        """Every state the build set or found, in a fixed order (for the ranks to adopt rank 0's)."""
        return [self.entry_state, *(state for _, state in self.first_use.values()), *(s.state for s in self.set_states)]

    def adopt(self, states: list[Tensor]) -> None:
        """Take another rank's `states()` (rank 0's: the values DDP would broadcast)."""
        if len(states) != len(self.states()):
            raise DeferredInitError(
                f"rank 0's build set random generator states {len(states)} times and this rank's "
                f"{len(self.states())} times: the build must run the same code on every rank (no rank-dependent "
                f"seeding or branches inside configure_model)."
            )
        self.entry_state = states[0]
        first_use, set_states = states[1 : 1 + len(self.first_use)], states[1 + len(self.first_use) :]
        for key, state in zip(list(self.first_use), first_use, strict=True):
            self.first_use[key] = (self.first_use[key][0], state)
        for step, state in zip(self.set_states, set_states, strict=True):
            step.state = state

    def _move(self, generator: torch.Generator, move: Any) -> None:
        self.moving = True
        try:
            move()
        finally:
            self.moving = False
        self._expected[generator_key(generator)] = generator.get_state()
