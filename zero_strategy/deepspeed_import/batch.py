"""The batch keys of a DeepSpeed config (``train_batch_size``, ``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps``), checked against the world size and then against the Trainer and its DataLoader."""

from __future__ import annotations

from dataclasses import dataclass

from zero_strategy.deepspeed_import.errors import DeepSpeedConfigError

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_BATCH_RULE = "train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size"


def positive(source: str, name: str, value: object) -> int:
    """``value`` when it is a positive integer, else an error naming ``name`` in ``source``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DeepSpeedConfigError(f"{source}: {name}={value!r} must be a positive integer")
    return value


@dataclass(kw_only=True, slots=True)
class ResolvedBatch:
    """The four batch numbers after a successful check."""

    train_batch_size: int
    """Samples per optimizer step over all ranks: the product of the other three."""
    micro_batch_size: int
    """Samples per rank per forward/backward (the DataLoader's batch_size)."""
    accumulate_grad_batches: int
    """Micro-batches per optimizer step (DeepSpeed's gradient_accumulation_steps)."""
    world_size: int
    """Data-parallel ranks."""


@dataclass(kw_only=True, slots=True)
class BatchRule:
    """The batch keys of a DeepSpeed config, checked against the world size and then against the Trainer.

    A key that is missing or "auto" is None here and :meth:`resolve` fills it from the Trainer; a given key must
    agree with it. Given one key, DeepSpeed assumes ``gradient_accumulation_steps = 1``; we let
    ``Trainer(accumulate_grad_batches)`` decide instead, as Lightning's DeepSpeed integration does.
    """

    train_batch_size: int | None = None
    """``train_batch_size`` (None: missing or "auto")."""
    micro_batch_size: int | None = None
    """``train_micro_batch_size_per_gpu`` (None: missing or "auto")."""
    gradient_accumulation_steps: int | None = None
    """``gradient_accumulation_steps`` (None: missing or "auto")."""
    source: str = "<dict>"
    """The config file, for messages."""

    def __post_init__(self) -> None:
        for name in ("train_batch_size", "micro_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) is not None:
                positive(self.source, f"BatchRule.{name}", getattr(self, name))

    def _origin(self, index: int) -> str:
        return f'{self.source} "{BATCH_KEYS[index]}"'

    def infer(self, world_size: int) -> ResolvedBatch | None:
        """Check with only the world size known, inferring one open key as DeepSpeed does (floor division);
        None when two keys are open (the Trainer fills them in :meth:`resolve`)."""
        positive(self.source, "world_size", world_size)
        tb, mb, ga = self.train_batch_size, self.micro_batch_size, self.gradient_accumulation_steps
        if sum(value is None for value in (tb, mb, ga)) > 1:
            return None
        origins = [self._origin(i) for i in range(3)] + ["the world_size argument"]
        if ga is None:
            assert tb is not None and mb is not None
            ga, origins[2] = tb // mb // world_size, "inferred as DeepSpeed does: train // micro // world"
        elif mb is None:
            assert tb is not None
            mb, origins[1] = tb // world_size // ga, "inferred as DeepSpeed does: train // world // accumulation"
        elif tb is None:
            tb, origins[0] = mb * ga * world_size, "inferred: micro * accumulation * world"
        _raise_if_mismatch(self.source, list(zip((tb, mb, ga, world_size), origins, strict=True)), [])
        return ResolvedBatch(train_batch_size=tb, micro_batch_size=mb, accumulate_grad_batches=ga,
                             world_size=world_size)

    def resolve(self, world_size: int, micro_batch: int, accumulate: int) -> ResolvedBatch:
        """Check against the Trainer (world size, DataLoader batch_size, accumulate_grad_batches), which fill gaps."""
        for name, value in (("world_size", world_size), ("micro_batch", micro_batch), ("accumulate", accumulate)):
            positive(self.source, name, value)
        conflicts = [f"{self._origin(i)} is {given}, not {actual}" for i, given, actual in (
            (1, self.micro_batch_size, micro_batch), (2, self.gradient_accumulation_steps, accumulate))
            if given is not None and given != actual]
        product = micro_batch * accumulate * world_size
        train = (product, "micro * accumulation * world") if self.train_batch_size is None else (
            self.train_batch_size, self._origin(0))
        rows = [train, (micro_batch, "the DataLoader's batch_size"), (accumulate, "Trainer(accumulate_grad_batches)"),
                (world_size, "the Trainer: devices * num_nodes")]
        _raise_if_mismatch(self.source, rows, conflicts)
        return ResolvedBatch(train_batch_size=product, micro_batch_size=micro_batch,
                             accumulate_grad_batches=accumulate, world_size=world_size)


def _raise_if_mismatch(source: str, rows: list[tuple[int, str]], conflicts: list[str]) -> None:
    """Raise showing all four numbers (train, micro, accumulation, world) and where each came from."""
    (train, _), (micro, _), (accum, _), (world, _) = rows
    product = micro * accum * world
    if not conflicts and train == product:
        return
    lines = [f"  {name} = {value}  (from {origin})" for name, (value, origin) in
             zip((*BATCH_KEYS, "world_size"), rows, strict=True)]
    verdict = f"  {micro} * {accum} * {world} = {product}" + (f", not {train}" if train != product else "")
    raise DeepSpeedConfigError(
        f"{source}: the batch sizes disagree. DeepSpeed requires {_BATCH_RULE}; here\n" + "\n".join(lines) + "\n"
        + verdict + "".join(f"\n  and {conflict}" for conflict in conflicts)
        + '\nMake the config and the Trainer/DataLoader agree, or write "auto" to take the Trainer\'s values.'
    )
