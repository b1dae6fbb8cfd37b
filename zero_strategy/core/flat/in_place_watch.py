"""Changes made to module parameters in place, outside the optimizer: where ZeRO takes them into the masters, and
where it refuses them.

[Note: in-place changes outside the optimizer]
Under DDP a parameter is one tensor per rank: ``with torch.no_grad(): p.mul_(0.5)`` on every rank changes every
replica, and the change stays. Under ZeRO the weights live in each rank's master slice (fp32 under mixed precision),
and a module parameter is a view of a flat buffer that is not the master copy everywhere. What ZeRO does with such
a change, made by every rank as under DDP:

- stage 3 outside forward (the parameter's values are on other ranks): the change is applied by every rank to a
  whole copy of the parameter's masters, in the masters' dtype, and each rank keeps its own range (see
  core/flat/outside_forward.py). Exact on every transport, in bf16/fp16 (DDP's fp32 parameter) and with offload:
  ``mul_``, ``copy_``, ``p[i] = v``, ``+=``, ``torch.nn.init``'s functions, ``reset_parameters()``. It is a
  collective (a gather of the master slices): every rank must make it, as every DDP replica must. A change through a
  view of the parameter (``p.detach().mul_()``, ``p[0].zero_()``, ``p.view(...).copy_()``, and so
  ``nn.init.orthogonal_``) is refused, naming the parameter: outside forward a view is a copy (values_copy.py).
  ``load_state_dict`` writes the masters itself (see [Note: loading a full state dict into the shards]).
- stages 1/2 whose fp32 masters are kept apart from the parameters in bf16/fp16, a change made on the parameter
  itself while it is watched (outside forward: from the engine's start, after a forward no backward follows, after
  each backward; grad_reads.py): replayed on a whole copy of the masters (exact_writes.py), exact, the same
  collective as at stage 3. The same inside ``gathered_parameters()`` at stage 3 in bf16/fp16.
- stages 1/2 with offload in fp32: before the next optimizer step (or a save) each rank takes the changed
  parameters' ranges into its master slice (engine/in_place_changes.py): exact.
- stages 1/2 in fp32 without offload: each rank's slice of the parameters *is* its master shard: DDP's behaviour,
  nothing to do.
- stage 3 *inside* ``gathered_parameters()`` in fp32 (the parameters are their own class there, nothing sees the
  change as it is made): each rank changes its own copy (through the network the gathered buffer; on one host a
  private copy of the host-wide buffer, made at entry), and the unit's release takes the changed parameters' ranges
  into the masters (master_writes.py; on one host between two barriers): exact. Inside forward through the network
  the same happens at the unit's release. On one host's shared memory forward reads the host-wide buffer in place,
  where a change every rank makes would land once per rank: the change is refused as it is made, with a
  :class:`ShardedParameterError` naming the parameter, before it changes anything (a torch function mode that
  engine pushes for forward; see [Note: writes inside forward on shared memory] in core/runtime/forward_writes.py).
  A change that bypasses torch functions (through numpy) is refused by the unit's release instead, after the fact:
  the buffer is changed by then.
- refused with :class:`InPlaceChangeError`, naming the parameters, before any master takes the change (the module's
  copy holds it already; the run stops): in bf16/fp16 a change found by the version counters that the watch did
  not see being made (inside forward, between forward and backward, through a view or ``p.detach()``), which the
  masters could only take rounded; and a change made during the optimizer step that the step overwrote (offload,
  or one unseen in bf16/fp16). No change is taken in rounded, and none lost with only a warning.

Each parameter that ``.data`` re-pointed at the flat buffer has its own version counter (see [Note: views into
one flat buffer] in flat_param.py), which only in-place operations through that parameter move: the engine writes
through other views (the gathered buffer, the master pieces, the shard), and autograd never writes parameters. So a
moved counter is a user's change. Not seen: changes through ``p.data`` at stages 1/2 (a tensor with a counter of its
own; at stage 3 outside forward ``.data`` is refused).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

HOST_WIDE = (
    "it was made inside forward, where at stage 3 on one host its values live once per host in shared memory, so a "
    "change every rank makes lands once per rank (x0.25 for a mul_(0.5) on 2 ranks). It went past the check that "
    "refuses such a change as it is made (a write that does not go through a torch function: through numpy, or "
    "from a backward hook), so it is found only now, at the unit's release: the shared values ARE changed already "
    "and the run cannot go on. Make it outside forward (with torch.no_grad(): on every rank), or inside "
    "gathered_parameters(), where it is applied to the masters."
)
OVERWRITTEN = (
    "refused: it was made during the optimizer step, after the masters (kept apart from the parameters here: "
    "offload, or bf16/fp16 parameters changed where ZeRO does not see it) took the changes made before it, so the "
    "step overwrote it and the published weights do not hold it. Change parameters before or after the step."
)
ROUNDED = (
    "refused: it was made where ZeRO does not see a change being made (inside forward, between forward and "
    "backward, or through a view, .detach() or .data of the parameter), so the fp32 master weights could only take "
    "it as the parameters hold it, rounded to their dtype (bf16/fp16), where DDP's fp32 parameter keeps the "
    "unrounded result. The masters are unchanged. Make the change on the parameter itself outside forward, on every "
    "rank (`with torch.no_grad(): p.mul_(0.5)`, `p.copy_(...)`, `p[i] = v`, `torch.nn.init.*_(p)`, also inside "
    "gathered_parameters()): ZeRO then applies it to the fp32 masters exactly."
)


def refuse_rounded(names: list[str]) -> None:
    raise InPlaceChangeError(f"ZeRO: {', '.join(names)} changed in place outside the optimizer; {ROUNDED}")


class InPlaceChangeWarning(UserWarning):
    """Kept so that warning filters naming it still import: every in-place change is now exact or refused with
    :class:`InPlaceChangeError`, and nothing emits it."""


class InPlaceChangeError(RuntimeError):
    """A module parameter was changed in place where ZeRO could only take the change in rounded to bf16/fp16 (see
    [Note: in-place changes outside the optimizer])."""


class InPlaceWatch:
    """The version counters of one FlatParam's module parameters (see [Note: in-place changes outside the
    optimizer])."""

    def __init__(self, names: Sequence[str], params: Sequence[Tensor]) -> None:
        self._watched = list(zip(names, params, strict=True))
        self._versions = [param._version for param in params]

    def forget(self) -> None:
        """Take the current values as the baseline (after a write that is not a user's change)."""
        self._versions = [param._version for _, param in self._watched]

    def changed(self) -> list[int]:
        """The positions of the parameters changed in place since the last baseline (which stays)."""
        return [index for index, ((_, param), version) in enumerate(zip(self._watched, self._versions, strict=True))
                if param._version != version]

    def take_changed(self) -> list[int]:
        """The positions of the parameters changed in place since the last baseline, which becomes now."""
        changed = [index for index, ((_, param), version) in enumerate(zip(self._watched, self._versions,
                                                                          strict=True)) if param._version != version]
        if changed:
            self.forget()
        return changed

    def check(self, consequence: str) -> None:
        """Refuse, naming the parameters changed in place since the last check, with what becomes of the change."""
        changed = [
            name for (name, param), version in zip(self._watched, self._versions, strict=True)
            if param._version != version
        ]
        if not changed:
            return
        self.forget()
        raise InPlaceChangeError(f"ZeRO: {', '.join(changed)} changed in place outside the optimizer; {consequence}")
