"""The one owner of the engine across Lightning's runs on a Trainer (fit, validate, test, predict), and what a save
writes in each of its states.

[Note: saving after fit]
``trainer.save_checkpoint`` writes the sharded directory a save during fit writes, whenever this process can:

- SHARDED (inside a run): the engine writes its slices, optimizer state included.
- RELEASED (after a run of the plain launcher, where every rank ran it in this process): the released engine still
  holds its slices and, after a fit, the optimizer state keyed by its master pieces (release leaves the optimizers
  pointing at them). The save goes through it: first each rank copies its part of the module's current full
  parameters into the slices (the file holds what the module holds, even if the user changed it since; parameters
  left sharded keep the slices as their only copy). The optimizer state is written when the Trainer's optimizers
  are still the last fit's; a validate/test after the fit keeps them, a new fit replaces them.
- PLAIN (no engine in this process: the main process of a spawn launcher, or a module never sharded here): a
  checkpoint of one rank is written from the module itself (checkpoint/sharded/module_snapshot.py) if the module
  holds the weights: built eagerly, with the trained weights handed back by Lightning after a spawn-launched fit. The
  optimizer state does not exist here; the manifest says so and why, and a resume from it stops with that reason.
  A module that does not hold them — built in ``configure_model`` or under ``init_module(empty_init=True)``, whose
  values only the exited workers held — makes the save raise, naming the saves that work (during fit, or the plain
  launcher), instead of writing an empty checkpoint.

[Note: a copy of the strategy holds no engine]
Lightning's progress bars keep the Trainer, so ``copy.deepcopy(trainer.callbacks)`` or pickling them copies the
strategy. An engine is this process's live hold on the module (hooks, communicators, threads, shared-memory and
file mappings, an opened checkpoint): it cannot travel, and a second one over the same memory would be wrong. A
copy (deepcopy or pickle) of the strategy is therefore PLAIN: its module holds the weights (after a fit that gave
full parameters back, as by default), and it saves from the module as the main process of a spawn launcher does.
The original keeps its engine. DDP's copy likewise drops its reducer and process group.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from enum import Enum, auto

from torch import nn
from torch.optim import Optimizer

from zero_strategy.checkpoint.base.format import CheckpointError
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.engine.release import adopt_module_values


class ModelState(Enum):
    """Where this process's weights of the module live."""

    PLAIN = auto()  # in the module itself (or nowhere: see [Note: saving after fit]); no engine here
    SHARDED = auto()  # an engine drives the module
    RELEASED = auto()  # the last run's engine let the module go and keeps its slices (and a fit's optimizer state)


class ShardedModel:
    """The engine of the current run, or the released engine of the last one (see [Note: saving after fit])."""

    def __init__(self) -> None:
        self.state = ModelState.PLAIN
        self.engine: ZeroEngine | None = None  # SHARDED: driving the module; RELEASED: the last run's
        self.fit_engine: ZeroEngine | None = None  # RELEASED: the last fit's, while its optimizers are the Trainer's
        self._full = True  # RELEASED: whether the module got full parameters back

    def __getstate__(self) -> dict[str, object]:
        """A copy is PLAIN: see [Note: a copy of the strategy holds no engine]."""
        return {"state": ModelState.PLAIN, "engine": None, "fit_engine": None, "_full": True}

    @property
    def active(self) -> ZeroEngine:
        if self.state is not ModelState.SHARDED or self.engine is None:
            raise RuntimeError(f"the model is not sharded now ({self.state.name}): ZeroStrategy.setup() has not run, "
                               "or teardown() has.")
        return self.engine

    def begin(self, engine: ZeroEngine) -> None:
        """PLAIN/RELEASED → SHARDED. A fit's engine (it binds optimizers) ends the previous fit's state."""
        if self.state is ModelState.SHARDED:
            raise RuntimeError("a second engine for a module that is sharded already: release the first")
        if engine.optimizers:
            self.fit_engine = None
        self.engine, self.state = engine, ModelState.SHARDED

    def end(self, full: bool | None = None) -> bool:
        """SHARDED → RELEASED: the engine lets the module go; returns whether the module's parameters are full."""
        engine = self.active
        self._full = engine.release(full)
        if engine.optimizers:
            self.fit_engine = engine
        self.state = ModelState.RELEASED
        return self._full

    @contextmanager
    def parameters_whole(self) -> Iterator[None]:
        """SHARDED: the engine gathers every parameter for the block; PLAIN or RELEASED with full parameters: the
        module holds them whole already. RELEASED with the parameters left sharded raises: they are on the meta
        device and the engine that held their slices no longer drives the module."""
        if self.state is ModelState.SHARDED:
            with self.active.gathered_parameters():
                yield
            return
        if self.left_sharded() is not None:
            raise RuntimeError(
                "the module's parameters were left sharded when the run ended (on the meta device, a model built "
                "sharded at stage 3): read its weights through trainer.save_checkpoint(...) or "
                "strategy.lightning_module_state_dict(), or pass ZeroStrategy(full_params_after_fit=True) to get "
                "full parameters back after fit.")
        yield

    def left_sharded(self) -> ZeroEngine | None:
        """RELEASED with the parameters left sharded: the engine whose slices are the module's weights."""
        return self.engine if self.state is ModelState.RELEASED and not self._full else None

    def save_source(self, optimizers: Iterable[Optimizer]) -> tuple[ZeroEngine, bool] | None:
        """SHARDED/RELEASED: the engine to save through and whether it holds the Trainer's optimizer state; None when
        PLAIN (save from the module itself, see :meth:`check_holds_weights`)."""
        if self.state is ModelState.SHARDED:
            return self.active, True
        if self.state is ModelState.PLAIN or self.engine is None:
            return None
        current = [id(optimizer) for optimizer in optimizers]
        fit = self.fit_engine
        with_optimizer = fit is not None and bool(current) and [id(o) for o in fit.optimizers] == current
        engine = fit if with_optimizer and fit is not None else self.engine
        adopt_module_values(engine.flat_params)  # the module's current values, where it holds them
        return engine, with_optimizer

    @staticmethod
    def check_holds_weights(module: nn.Module, path: object, handed_back: dict[str, bool] | None) -> None:
        """PLAIN: raise when the module does not hold the weights a save must write (see [Note: saving after fit]).
        ``handed_back``: what Lightning loaded into the module after a spawn-launched fit (key → whether it held
        values: a parameter the worker left sharded held none)."""
        keys = module.state_dict(keep_vars=True)
        meta = [name for name, param in module.named_parameters() if param.is_meta]
        handed = handed_back or {}
        lost = sorted(key for key, held in handed.items() if not held or key not in keys)
        if not any(True for _ in module.parameters()):
            why = "the module has no parameters in this process"
        elif meta:
            why = f"its parameters {meta[:3]} are on the meta device"
        elif lost:
            why = f"the trained values of {lost[:3]} stayed in the worker processes"
        else:
            return
        raise CheckpointError(
            f"cannot save {path}: {why}. The model is built in configure_model() or under "
            "Trainer.init_module(empty_init=True), so under a spawn launcher only its worker processes held its "
            "values, and they have exited. Save during fit (a ModelCheckpoint callback, or trainer.save_checkpoint "
            "in on_train_end), or use the plain launcher (strategy='zero3' instead of 'zero3_spawn'), which runs "
            "fit in this process and can save after it."
        )
