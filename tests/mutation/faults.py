"""The faults the mutation check plants (see [Note: how the mutation check stays honest] in check.py).

Each is a plausible logic error (a wrong index, a forgotten call, a value used before it was agreed), never an
exception or a broken import, and each names the tests that must fail because of it, fastest first (the run stops
at the first failure). ``original`` must occur exactly once in ``file``: when the code moves or changes, the check
stops with an error naming the fault, and the fault is updated here (re-pointed to the moved code), never dropped
to make the check pass.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Fault:
    name: str
    area: str  # the room of the library it hits: comm, flat, engine, checkpoint, precision, lightning, fabric
    file: str  # relative to the repository root
    original: str  # exact text, found exactly once in `file`
    replacement: str
    description: str
    tests: tuple[str, ...]  # pytest node ids (or files) that must fail with the fault planted


P2P = "tests/distributed/test_point_to_point.py"
PARITY = "tests/distributed/test_zero_parity.py"
PRECISION_PARITY = "tests/precision/test_precision_parity.py"
PLUGIN = "tests/precision/test_precision_plugin.py"
HYBRID_CKPT = "tests/checkpoint/test_ckpt_hybrid.py"
RESHARD = "tests/checkpoint/test_ckpt_reshard_core.py"
CONSOLIDATE = "tests/checkpoint/test_ckpt_consolidate.py"

FAULTS: tuple[Fault, ...] = (
    # ------------------------------------------------------------------------------------- tensor parallel
    Fault(
        name="tp-norm-not-summed-over-tensor-parallel",
        area="engine",
        file="zero_strategy/core/engine/gradients.py",
        original='ReduceOp.SUM, "gradient norm across tensor parallel")',
        replacement='ReduceOp.MAX, "gradient norm across tensor parallel")',
        description="tensor parallelism: the global gradient norm leaves out the other TP ranks' blocks",
        tests=("tests/lightning/test_tp_trainer.py::test_every_stage_and_model_parallel_strategy_match_one_process",),
    ),
    Fault(
        name="tp-overflow-not-agreed-over-tensor-parallel",
        area="engine",
        file="zero_strategy/core/engine/gradients.py",
        original='found = tensor.all_reduce(found, ReduceOp.MAX, "overflow check across tensor parallel")',
        replacement='found = comm.all_reduce(found, ReduceOp.MAX, "overflow check across tensor parallel")',
        description="tensor parallelism + fp16: the flag is agreed over the data-parallel group again, not over "
                    "tensor parallel: the TP ranks whose block overflowed skip alone",
        tests=("tests/distributed/test_tensor_parallel_engine.py::"
               "test_an_overflow_in_one_tensor_parallel_block_is_agreed_by_every_rank",),
    ),
    Fault(
        name="tp-partial-gradient-not-summed",
        area="flat",
        file="zero_strategy/core/plan/tensor_parallel.py",
        original="    if tuple(grad.placements) != tuple(placements):",
        replacement="    if False:",
        description="tensor parallelism: a SequenceParallel norm's Partial gradient is flattened unsummed over TP",
        tests=("tests/lightning/test_tp_trainer.py::test_every_stage_and_model_parallel_strategy_match_one_process",),
    ),
    # ------------------------------------------------------------------------------------------------ comm
    Fault(
        name="p2p-sum-adds-a-chunk-twice",
        area="comm",
        file="zero_strategy/core/comm/point_to_point.py",
        original="            for part in parts[1:]:\n                result.add_(part)",
        replacement="            for part in parts:\n                result.add_(part)",
        description="point-to-point reduce-scatter (3+ ranks): rank 0's chunk is added twice to the sum",
        tests=(f"{P2P}::test_exchanges_match_torch_collectives[4-False]",
               f"{P2P}::test_reduction_sums_in_rank_order_on_every_rank"),
    ),
    Fault(
        name="p2p-send-counted-twice",
        area="comm",
        file="zero_strategy/core/comm/point_to_point.py",
        original="            self.log.record_moved(kind, self.group.me, self.group.global_rank(peer), nbytes)",
        replacement="            self.log.record_moved(kind, self.group.me, self.group.global_rank(peer), 2 * nbytes)",
        description="point-to-point: each send is logged twice (bytes per peer doubled in the communication report)",
        tests=(f"{P2P}::test_exchanges_match_torch_collectives[2-False]",),
    ),
    Fault(
        name="p2p-peers-share-one-receive-buffer",
        area="comm",
        file="zero_strategy/core/comm/point_to_point.py",
        original="received = {peer: result if self.size == 2 else torch.empty_like(result) for peer in",
        replacement="received = {peer: result for peer in",
        description="point-to-point reduce-scatter (3+ ranks): every peer's chunk is received into one buffer "
                    "still in use by the others",
        tests=(f"{P2P}::test_exchanges_match_torch_collectives[4-False]",),
    ),
    Fault(
        name="shm-reduce-scatter-sums-without-averaging",
        area="comm",
        file="zero_strategy/core/comm/shared_memory.py",
        original="            return result.div_(size)",
        replacement="            return result",
        description="shared-memory reduce-scatter: the gradient is summed over the ranks, not averaged (wrong divisor)",
        tests=(f"{PARITY}::test_sgd_momentum_weight_decay_parity[2-2-1]",),
    ),
    Fault(
        name="shm-reduced-slice-left-in-the-arena",
        area="comm",
        file="zero_strategy/core/comm/shared_memory.py",
        original="                torch.add(parts[0][lo:hi], parts[1][lo:hi])",
        replacement="                torch.add(parts[0][lo:hi], parts[1][lo:hi], out=parts[rank][lo:hi])",
        description="shared-memory reduce-scatter: the reduced slice is a view into the exchange's arena, which a "
                    "later exchange reuses (a buffer used after it was handed back)",
        tests=(f"{PARITY}::test_adamw_parity[2-2-1]", f"{PARITY}::test_sgd_momentum_weight_decay_parity[2-4-3]"),
    ),
    Fault(
        name="in-process-reduce-drops-a-rank",
        area="comm",
        file="zero_strategy/core/comm/in_process.py",
        original="            for part in parts[1:]:\n                result.add_(part[lo:hi])",
        replacement="            for part in parts[2:]:\n                result.add_(part[lo:hi])",
        description="in-process reduce-scatter: rank 1's contribution is left out of the sum",
        tests=("tests/unit/test_in_process_comm.py",),
    ),
    # ------------------------------------------------------------------------------------------------ flat
    Fault(
        name="layout-shard-range-shifted",
        area="flat",
        file="zero_strategy/core/plan/layout.py",
        original="shard_start=lo - start, numel=hi - lo",
        replacement="shard_start=lo - start + 1, numel=hi - lo",
        description="flat layout: each parameter piece is placed one element later in its rank's shard",
        tests=("tests/unit/test_layout.py",),
    ),
    Fault(
        name="step-reduction-drops-a-unit",
        area="engine",
        file="zero_strategy/core/engine/window.py",
        original="        for unit in self.units:\n            unit.start_reduce(index, force=force)",
        replacement="        for unit in self.units[1:]:\n            unit.start_reduce(index, force=force)",
        description="stage 1: the reduce-scatter of the first unit's gradients is dropped at the step (on every rank)",
        tests=(f"{PARITY}::test_sgd_momentum_weight_decay_parity[1-2-1]",),
    ),
    Fault(
        name="forced-reduction-skipped",
        area="flat",
        file="zero_strategy/core/flat/grads.py",
        original="        if not (self.has_pending() or force):\n            return",
        replacement="        if not self.has_pending():\n            return",
        description="a rank without a local gradient skips a reduce-scatter its peers take part in (a dropped "
                    "reduce-scatter: parameters only some ranks used)",
        tests=("tests/unit/test_gradients_held.py::test_held_gradients_are_reduced_once_with_the_same_result"
               "[1-rank-dependent-fp32]",),
    ),
    Fault(
        name="stale-compute-copy-gathered",
        area="flat",
        file="zero_strategy/core/flat/flat_param.py",
        original="if self.storage.shard_aliases_full else self.storage.gather_source()",
        replacement="if self.storage.shard_aliases_full else self.storage.own_slice_of_full()",
        description="stages 1/2 in bf16/fp16: after the step the old compute copy is re-gathered instead of the "
                    "updated fp32 masters (the master -> compute copy skipped)",
        tests=(f"{PRECISION_PARITY}::test_low_precision_matches_reference_at_every_stage[bf16-mixed]",),
    ),
    Fault(
        name="host-wide-slice-not-rewritten",
        area="flat",
        file="zero_strategy/core/flat/flat_param.py",
        original="            self.storage.write_own_slice()\n",
        replacement="",
        description="stage 3 on one host in bf16/fp16: the stepped masters are never copied into the host-wide "
                    "compute buffer the forward reads",
        tests=(f"{PRECISION_PARITY}::test_low_precision_matches_reference_at_every_stage[bf16-mixed]",),
    ),
    Fault(
        name="forward-write-not-refused",
        area="flat",
        file="zero_strategy/core/runtime/forward_writes.py",
        original="        if lo >= end or _engine_handle(flat, target):",
        replacement="        if lo >= start or _engine_handle(flat, target):",
        description="stage 3 on one host: a write inside forward is compared with the buffer's start instead of "
                    "its end, so a change of a host-wide parameter is let through and lands once per rank",
        tests=("tests/unit/test_forward_writes.py",
               "tests/distributed/test_in_place_changes.py::"
               "test_writes_inside_forward_are_refused_before_they_land_or_taken_in_exactly[auto]"),
    ),
    # ------------------------------------------------------------------------------------------------ step
    Fault(
        name="norm-not-all-reduced",
        area="engine",
        file="zero_strategy/core/engine/gradients.py",
        original='    total = comm.all_reduce(local_sum, ReduceOp.SUM, "gradient norm")',
        replacement='    total = comm.all_reduce(local_sum, ReduceOp.MAX, "gradient norm")',
        description="gradient clipping: the ranks clip by the largest slice's norm (squared norms not summed)",
        tests=(f"{PARITY}::test_clip_grad_norm_parity[2-2-l2]",),
    ),
    Fault(
        name="inf-norm-summed",
        area="engine",
        file="zero_strategy/core/engine/gradients.py",
        original='ReduceOp.MAX, "gradient norm")',
        replacement='ReduceOp.SUM, "gradient norm")',
        description="gradient clipping, inf-norm: the ranks' maxima are summed instead of maxed",
        tests=(f"{PARITY}::test_clip_grad_norm_parity[2-2-inf]",),
    ),
    Fault(
        name="overflow-not-agreed",
        area="engine",
        file="zero_strategy/core/engine/gradients.py",
        original='    found = comm.all_reduce(found, ReduceOp.MAX, "overflow check").wait()',
        replacement="    found = found",
        description="fp16: each rank decides alone whether its gradients overflowed (no agreement across ranks)",
        tests=(f"{PLUGIN}::test_an_overflow_only_one_ranks_slice_holds_is_agreed",),
    ),
    Fault(
        name="unscale-skipped",
        area="engine",
        file="zero_strategy/core/flat/grads.py",
        original="            for grad in grads:\n                grad.mul_(inv_scale)",
        replacement="            for grad in grads:\n                pass",
        description="fp16: the reduced gradients are marked unscaled but keep the loss scale",
        tests=(f"{PRECISION_PARITY}::test_low_precision_matches_reference_at_every_stage[16-mixed]",),
    ),
    Fault(
        name="loss-scale-window-not-restarted",
        area="engine",
        file="zero_strategy/core/engine/loss_scaler.py",
        original="            self.last_overflow_iteration = self.iteration\n",
        replacement="",
        description="fp16 loss scaler: an overflow does not restart the growth window, so the scale grows too soon",
        tests=("tests/precision/test_loss_scaler.py::test_growth_after_window_counts_from_last_overflow",),
    ),
    Fault(
        name="buffers-not-broadcast",
        area="engine",
        file="zero_strategy/core/engine/buffers.py",
        original='        comm.broadcast(flat, 0, "buffers").wait()',
        replacement="        pass",
        description="buffers (BatchNorm statistics) are not taken from rank 0 before forward",
        tests=("tests/lightning/test_broadcast_buffers.py"
               "::test_with_accumulation_every_training_forward_starts_from_rank_0_unlike_ddp",),
    ),
    # ------------------------------------------------------------------------------------------ checkpoint
    Fault(
        name="manifest-offset-off-by-one",
        area="checkpoint",
        file="zero_strategy/checkpoint/sharded/save.py",
        original="ParamEntry(stored[span.name], list(span.shape), span.offset, span.numel,",
        replacement="ParamEntry(stored[span.name], list(span.shape), span.offset + 1, span.numel,",
        description="the manifest records each parameter one element after where its shard holds it",
        tests=(f"{RESHARD}::test_resume_on_another_layout_matches_uninterrupted_run[sgd-2to4-zero2]",),
    ),
    Fault(
        name="rng-not-restored",
        area="checkpoint",
        file="zero_strategy/checkpoint/base/rng.py",
        original='    torch.set_rng_state(tensors["rng/torch_cpu"])\n',
        replacement="",
        description="resume: torch's CPU generator is not restored (dropout masks differ from the uninterrupted run)",
        tests=(f"{HYBRID_CKPT}::test_another_layout_restores_each_rank_by_its_position_in_the_run",
               f"{HYBRID_CKPT}::test_hybrid_resume_with_dropout_is_bit_identical"),
    ),
    Fault(
        name="optimizer-state-skipped-on-resume",
        area="checkpoint",
        file="zero_strategy/checkpoint/sharded/load.py",
        original="    for name in names:\n",
        replacement="    for name in names[1:]:\n",
        description="resume: the first element-wise optimizer state (momentum / exp_avg) is not loaded",
        tests=(f"{RESHARD}::test_resume_on_another_layout_matches_uninterrupted_run[sgd-2to4-zero2]",),
    ),
    Fault(
        name="consolidation-forgets-tied-key",
        area="checkpoint",
        file="zero_strategy/checkpoint/export/consolidate.py",
        original="            yield entry.key, seen[entry.param]",
        replacement="            continue",
        description="zero-to-fp32 (.pt/.bin/.ckpt): a tied parameter's second key is left out of the state_dict",
        tests=(f"{CONSOLIDATE}::test_tied_model_from_two_ranks[.pt]",),
    ),
    Fault(
        name="save-not-staged",
        area="checkpoint",
        file="zero_strategy/checkpoint/sharded/save.py",
        original='        root, fresh = path.parent / f".{path.name}.partial-{checkpoint_id}", True',
        replacement="        root, fresh = path, False",
        description="save: a new checkpoint is written in place instead of under a temporary name renamed at the end",
        tests=("tests/checkpoint/test_ckpt_crash.py::test_crash_during_save_keeps_previous_checkpoint"
               "[rank1-in-shard-write-new-last-v1]",),
    ),
    Fault(
        name="save-returns-before-publish",
        area="checkpoint",
        file="zero_strategy/checkpoint/sharded/save.py",
        original='    failures = everyone.broadcast_object(failures, 0, "checkpoint outcome")',
        replacement="    pass",
        description="save: ranks other than 0 return without waiting for rank 0 to publish (the closing barrier "
                    "dropped), so a save that failed at rank 0 looks done to them",
        tests=("tests/checkpoint/test_ckpt_crash.py::test_crash_during_save_keeps_previous_checkpoint"
               "[rank0-before-manifest-overwrite-last]",),
    ),
    # ------------------------------------------------------------------------------------------- adapters
    Fault(
        name="lightning-clip-before-unscale",
        area="lightning",
        file="zero_strategy/lightning/precision.py",
        original="        if self.scaler is not None:\n"
                 "            self.engine.unscale_and_check_overflow(optimizer, 1.0 / self.scaler.scale)\n",
        replacement="",
        description="Lightning fp16: gradient clipping runs on the still-scaled gradients",
        tests=(f"{PLUGIN}::test_fp16_manual_clipping_unscales_once_before_the_step[1]",),
    ),
    Fault(
        name="lightning-rng-not-restored",
        area="lightning",
        file="zero_strategy/lightning/checkpoint_hooks.py",
        original="        restore_rank_rng(self.engine, pending.view)\n",
        replacement="",
        description="Lightning resume: the checkpoint's generator states are never restored into the ranks",
        tests=("tests/checkpoint/test_ckpt_lightning.py::test_resume_from_last_is_bit_identical_with_dropout",),
    ),
    Fault(
        name="fabric-loss-not-scaled",
        area="fabric",
        file="zero_strategy/fabric/precision.py",
        original="        self.settings.scale(tensor).backward(*args, **kwargs)",
        replacement="        tensor.backward(*args, **kwargs)",
        description="Fabric fp16: backward runs on the unscaled loss, and the step still divides by the scale",
        tests=("tests/fabric/test_fabric_precision.py::test_precision_strings_and_skipped_fp16_steps",),
    ),
    Fault(
        name="grad-read-not-averaged",
        area="engine",
        file="zero_strategy/core/engine/ddp_gradients.py",
        original="        return self._averaged(flat, index)\n",
        replacement="        return torch_value\n",
        description="a read of p.grad returns torch's attribute (None at stages 2/3) instead of DDP's average",
        tests=("tests/distributed/test_ddp_grad_reads.py::test_p_grad_reads_equal_ddps_at_every_point",),
    ),
    Fault(
        name="grad-edit-not-taken",
        area="engine",
        file="zero_strategy/core/engine/ddp_gradients.py",
        original="                piece.grad.copy_(copy.whole[start + offset : start + offset + piece.numel()])\n",
        replacement="                pass\n",
        description="a clip of p.grad by hand (clip_grad_norm_ over module.parameters()) never reaches the step",
        tests=("tests/distributed/test_ddp_grad_reads.py::test_p_grad_reads_equal_ddps_at_every_point",),
    ),
)
