"""What each rank holds and what it sends, measured independently of the code under test.

Memory is found by walking tensor storages (optimizer.state tensors, the optimizer's parameters' ``.grad``, the
module parameters' and master pieces' storages); bytes sent come from the engine's communication log and are
held to the ZeRO paper's numbers: Ψ parameters, fp32, N ranks.
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import lm_loss, make_batches, make_model, rank_slice
from helpers.storage import (
    StorageTally,
    host_shared_storages,
    optimizer_params,
    optimizer_state_tensors,
    private_storage_bytes,
)

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.engine.memory import memory_report
from zero_strategy.core.flat.access import own_grad
from zero_strategy.testing import run_ranks

MODEL = {"vocab": 13, "width": 31, "n_blocks": 4}  # Ψ = 4681, every unit's size odd (padding at N = 2, 4)
N_UNITS = MODEL["n_blocks"] + 1  # one per block plus the root (embedding/head, final LayerNorm)
FP32 = 4


def _psi() -> int:
    return sum(p.numel() for p in make_model(**MODEL).parameters())


def _module_grads(model) -> list:
    """The gradient tensors torch holds on the module (memory, not a user's read of p.grad, which gathers)."""
    return [g for g in (own_grad(p) for p in model.parameters()) if g is not None]


def _param_bytes(model, optimizer, engine) -> int:
    """Every storage behind the model's parameters or the optimizer's (master) parameters, counted once (a buffer
    the host's ranks share counts 1/N)."""
    tally = StorageTally(host_shared_storages(engine))
    return tally.bytes_of(list(model.parameters()) + optimizer_params(optimizer))


def memory_worker(rank, world_size, stage):
    model = make_model(**MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # one host's default path (stage 3: parameters once per host); the network path: the tests pinning point_to_point
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, collectives="auto"))
    out = {"params_at_rest": _param_bytes(model, optimizer, engine)}
    out["module_param_storage_at_rest"] = private_storage_bytes(model.parameters(), engine)
    (tokens,) = make_batches(1, 1, 8, vocab=MODEL["vocab"])[0]
    lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
    out["module_grads_after_backward"] = len(_module_grads(model))
    out["master_grad_bytes_after_backward"] = StorageTally().bytes_of(p.grad for p in optimizer_params(optimizer))
    out["params_after_backward"] = _param_bytes(model, optimizer, engine)
    with engine.step_window(optimizer):  # on entry the reduced gradients are on the master pieces
        out["module_grads_after_prepare"] = len(_module_grads(model))
        out["grad_bytes_after_prepare"] = StorageTally().bytes_of(
            [p.grad for p in optimizer_params(optimizer)] + _module_grads(model)
        )
        optimizer.step()
    out["state_bytes"] = StorageTally().bytes_of(optimizer_state_tensors(optimizer))
    out["state_numel_big"] = sum(t.numel() for t in optimizer_state_tensors(optimizer, min_numel=2))
    out["exp_avg_numel"] = sum(s["exp_avg"].numel() for s in optimizer.state.values())
    out["params_after_step"] = _param_bytes(model, optimizer, engine)
    report = memory_report(engine)
    out["report"] = (report.parameters, report.gradients, report.optimizer_state)
    return out


def _within(value: float, per_rank_elements: float, bytes_per_element: int, world_size: int, extra: int = 0) -> bool:
    """``value`` bytes is this rank's 1/N share, up to the padding/rounding of each unit's flat buffer."""
    low = bytes_per_element * (per_rank_elements - 2 * N_UNITS * (world_size - 1))
    high = bytes_per_element * (per_rank_elements + 2 * N_UNITS) + extra
    return low <= value <= high


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_per_rank(stage, world_size):
    psi = _psi()
    share = psi / world_size
    results = run_ranks(memory_worker, world_size, stage, timeout_s=50)
    step_scalars = 4 * 2 * N_UNITS  # AdamW's per-tensor `step` (fp32 scalars), one per master piece
    for rank, r in enumerate(results):
        # optimizer state (exp_avg + exp_avg_sq): 8Ψ/N at every stage
        assert _within(r["state_bytes"], share, 2 * FP32, world_size, extra=step_scalars), (rank, r["state_bytes"])
        # gradients after prepare_step: only the 1/N slice, no full-size .grad left on the module
        assert r["module_grads_after_prepare"] == 0, f"rank {rank}: module .grad not freed"
        assert _within(r["grad_bytes_after_prepare"], share, FP32, world_size), (rank, r["grad_bytes_after_prepare"])
        if stage >= 2:  # stage 2/3 never hold full gradients, not even between micro-steps
            assert r["module_grads_after_backward"] == 0, f"rank {rank}: stage {stage} kept full gradients"
            assert _within(r["master_grad_bytes_after_backward"], share, FP32, world_size)
        if stage == 3:  # outside forward/backward only the 1/N shard exists
            for key in ("params_at_rest", "params_after_backward", "params_after_step"):
                assert _within(r[key], share, FP32, world_size), (rank, key, r[key], 4 * share)
            assert r["module_param_storage_at_rest"] == 0
        else:  # stages 1/2 keep full parameters (the shard is a view of them)
            full = r["params_at_rest"]
            assert FP32 * psi <= full <= FP32 * (psi + N_UNITS * world_size), (rank, full, FP32 * psi)
        # the engine's own report agrees with the storages walked here
        assert r["report"] == (r["params_after_step"], r["grad_bytes_after_prepare"], r["state_bytes"])
    # across ranks, every element's optimizer state exists exactly once
    assert sum(r["exp_avg_numel"] for r in results) == psi
    assert sum(r["state_numel_big"] for r in results) == 2 * psi


def comm_worker(rank, world_size, stage, accum):
    model = make_model(**MODEL)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # the network path (on one host's CPU stage 3 reads its parameters in place and gathers nothing at all)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, collectives="point_to_point"))
    phases = []
    for micro in make_batches(2, accum, 8, vocab=MODEL["vocab"]):
        optimizer.zero_grad()
        for tokens in micro:
            engine.comm_log.reset()
            lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
            phases.append(("micro", engine.comm_log.snapshot()))
        engine.comm_log.reset()
        with engine.step_window(optimizer):
            phases.append(("prepare", engine.comm_log.snapshot()))
            engine.comm_log.reset()
            optimizer.step()
        phases.append(("after", engine.comm_log.snapshot()))
    return phases


def _stage3_gather_bytes(world_size: int, micro_steps: int) -> int:
    """Forward gathers every unit; backward every unit but the root and (once the first forward has recorded the
    order) the last block, which both stay whole from forward into backward. Each unit is padded to a multiple of N."""
    model = make_model(**MODEL)

    def padded(numel: int) -> int:
        return -(-numel // world_size) * world_size

    blocks = [padded(sum(p.numel() for p in block.parameters())) for block in model.blocks]
    root = padded(_psi() - sum(sum(p.numel() for p in block.parameters()) for block in model.blocks))
    forward = root + sum(blocks)
    first_backward = sum(blocks)
    later_backward = sum(blocks[:-1])
    return FP32 * (micro_steps * forward + first_backward + (micro_steps - 1) * later_backward)


def _sum(phases, phase: str, kind: str) -> int:
    return sum(snap.get(kind, 0) for name, snap in phases if name == phase)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_per_step(stage, world_size, accum):
    psi_bytes = _psi() * FP32
    pad = N_UNITS * (world_size - 1) * FP32  # each unit's buffer is padded to a multiple of N

    def approx(value: int, multiple: float) -> bool:
        return multiple * psi_bytes <= value <= multiple * (psi_bytes + pad)

    results = run_ranks(comm_worker, world_size, stage, accum, timeout_s=50)
    for rank, phases in enumerate(results):
        steps = 2
        micro_steps = steps * accum
        kinds = {kind for _, snap in phases for kind, nbytes in snap.items() if nbytes}
        assert kinds <= {"all_gather", "reduce_scatter", "all_reduce"}, f"rank {rank}: unexpected collectives {kinds}"
        # the only all-reduces: which parameters some rank used this step, one byte per parameter tensor, at the step
        # (see [Note: unused parameters] in core/engine/unused.py) and, at stage 1, one per FlatParam (whether some
        # rank still holds gradients for it on the module), and at stage 3 the divergence watch's check (two int64s)
        tensors = len(list(make_model(**MODEL).parameters()))
        held = N_UNITS if stage == 1 else 0  # one trainable FlatParam per unit
        assert _sum(phases, "prepare", "all_reduce") == steps * (tensors + held + (16 if stage == 3 else 0))
        assert _sum(phases, "micro", "all_reduce") == 0 and _sum(phases, "after", "all_reduce") == 0
        rs_micro, rs_prepare = _sum(phases, "micro", "reduce_scatter"), _sum(phases, "prepare", "reduce_scatter")
        ag_micro, ag_after = _sum(phases, "micro", "all_gather"), _sum(phases, "after", "all_gather")
        assert _sum(phases, "prepare", "all_gather") == 0
        assert _sum(phases, "after", "reduce_scatter") == 0
        if stage == 1:
            # nothing at all while accumulating; one reduce-scatter (Ψ) at the boundary + one all-gather (Ψ)
            assert all(not any(snap.values()) for name, snap in phases if name == "micro"), phases
            assert approx(rs_prepare, steps) and approx(ag_after, steps), (rs_prepare, ag_after)
            assert approx(rs_prepare + ag_after, 2 * steps)  # ≈ DDP's all-reduce, 2Ψ per step
        elif stage == 2:
            # a reduce-scatter of Ψ every micro-step, nothing left for the boundary; all-gather Ψ after the step
            assert rs_prepare == 0
            assert approx(rs_micro, micro_steps), (rs_micro, micro_steps * psi_bytes)
            assert ag_micro == 0 and approx(ag_after, steps)
            if accum == 1:
                assert approx(rs_micro + ag_after, 2 * steps)
        else:
            # forward all-gather Ψ + backward all-gather (≤ Ψ: the root may stay whole) + reduce-scatter Ψ,
            # every micro-step; nothing gathered after the step (the next forward gathers the new values)
            assert rs_prepare == 0 and ag_after == 0
            assert approx(rs_micro, micro_steps)
            assert ag_micro == _stage3_gather_bytes(world_size, micro_steps), ag_micro
            if accum == 1:
                total = rs_micro + ag_micro
                assert 2.75 * steps * psi_bytes <= total <= 3 * steps * (psi_bytes + pad)  # ≈ 3Ψ per step


def unit_at_a_time_worker(rank, world_size, prefetch):
    model = make_model(n_blocks=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # gathers through the network (on one host's CPU the units are read in place instead: test_shared_shards.py).
    # Kept in a name: an engine nobody holds goes at the next garbage collection, hooks and all (see [Note: hooks
    # hold the engine weakly]), which made this test fail whenever a collection fell inside its loop
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3, prefetch=prefetch, collectives="point_to_point"))
    seen = []

    def whole():
        return [int(block.fc.weight.untyped_storage().nbytes() > 0) for block in model.blocks]

    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda mod, args, i=i: seen.append(("forward", i, whole())))
        block.fc.register_full_backward_hook(lambda mod, gi, go, i=i: seen.append(("backward", i, whole())))
    for (tokens,) in make_batches(2, 1, 8):
        optimizer.zero_grad()
        lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
        seen.append(("after backward", -1, whole()))
    del engine  # only now may it go
    return seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefetch", [False, True])
def test_stage3_gathers_one_unit_at_a_time(prefetch):
    """Stage 3 gathering through the network keeps whole only the unit computing now (and, with prefetch, the next
    one)."""
    for rank, seen in enumerate(run_ranks(unit_at_a_time_worker, 2, prefetch, timeout_s=50)):
        for phase, i, whole in seen:
            if phase == "after backward":
                assert sum(whole) == 0, (rank, phase, whole)
                continue
            assert whole[i] == 1, (rank, phase, i, whole)
            assert sum(whole) <= (2 if prefetch else 1), (rank, phase, i, whole)
            neighbour = i + 1 if phase == "forward" else i - 1
            if sum(whole) == 2:
                assert whole[neighbour] == 1, (rank, phase, i, whole)


def backward_prefetch_worker(rank, world_size):
    from zero_strategy.core.flat.flat_param import ParamState
    from zero_strategy.core.runtime import unit as unit_module
    from zero_strategy.core.runtime.hooks import in_backward

    model = make_model(n_blocks=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # nested units: each block, and inside it its Linear (the hook order in backward is not reversed forward order);
    # network gathers, whose start and end can be told apart (on one host's CPU nothing would be gathered at all)
    config = ZeroConfig(stage=3, unit_modules=["Block", "Linear"], collectives="point_to_point")
    engine = ZeroEngine(model, [optimizer], config)  # held: see unit_at_a_time_worker
    needed: list[tuple[int, str, bool]] = []  # (step, unit, was its gather already started when backward needed it)
    step = [0]
    original_unshard = unit_module.ZeroUnit.unshard

    def recording_unshard(self):
        if in_backward() and not self.is_root:
            started = all(f.state is not ParamState.SHARDED for f in self.flat_params)
            if not all(f.state is ParamState.UNSHARDED for f in self.flat_params):
                needed.append((step[0], self.name, started))
        original_unshard(self)

    unit_module.ZeroUnit.unshard = recording_unshard
    for index, (tokens,) in enumerate(make_batches(3, 1, 8)):
        step[0] = index
        optimizer.zero_grad()
        lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
    del engine  # only now may it go
    return needed


@pytest.mark.timeout(60)
def test_backward_prefetches_in_recorded_order_with_nested_units():
    """From the second backward on, every unit's gather has started before backward needs it (the first backward
    records the order; reversed forward order would fetch a block's inner unit too late)."""
    for needed in run_ranks(backward_prefetch_worker, 2, timeout_s=50):
        later = [(name, started) for step, name, started in needed if step >= 1]
        # 4 blocks + 4 inner units, less the last inner unit (whole since its forward), in each of two backwards
        assert len(later) == 2 * 7, needed
        assert all(started for _, started in later), later


def _live_tensor_bytes() -> int:
    """Bytes of every storage behind any live tensor of this process (found through the garbage collector, so
    nothing the engine holds can hide from it), each storage counted once."""
    import gc

    gc.collect()  # tensors only kept alive by reference cycles are garbage, not held
    tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    return StorageTally().bytes_of(tensors)


def mixed_precision_memory_worker(rank, world_size, stage):
    from zero_strategy.core.plan.precision import MixedPrecisionPolicy

    batches = make_batches(1, 2, 8, vocab=MODEL["vocab"])[0]
    before = _live_tensor_bytes()  # the batches and whatever torch itself keeps
    model = make_model(**MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    # Point-to-point gathers: on one host's CPU every rank would otherwise view the host-wide parameter buffers,
    # whose peers' slices belong to (and are counted by) their owners, so a walk of this rank's tensors would count
    # them twice.
    config = ZeroConfig(stage=stage, collectives="point_to_point")
    engine = ZeroEngine(model, [optimizer], config, policy=policy)
    out = {}
    for phase, tokens in zip(("after_micro_step", "after_second_micro_step"), batches, strict=True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model, rank_slice(tokens, rank, world_size))
        loss.backward()
        del loss
        out[phase] = (memory_report(engine).total, _live_tensor_bytes() - before)
    out["stash_bytes"] = sum(f.grads.stash.untyped_storage().nbytes() for f in engine.flat_params
                             if f.grads.stash is not None)  # fmt: skip
    engine.optimizer_step(optimizer)
    out["after_step"] = (memory_report(engine).total, _live_tensor_bytes() - before)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [1, 3])
def test_memory_report_counts_every_tensor_in_mixed_precision(stage):
    """Between micro-steps and after the step, the engine's report equals the bytes of every live tensor of the
    rank: nothing but model state is alive then (the batch and the loss were dropped), so any storage the report
    misses — stage 1's fp32 gradient stash under bf16, say — shows as a difference."""
    for rank, r in enumerate(run_ranks(mixed_precision_memory_worker, 2, stage, timeout_s=50)):
        for phase in ("after_micro_step", "after_second_micro_step", "after_step"):
            reported, live = r[phase]
            assert reported == live, f"rank {rank} {phase}: memory_report {reported} B, live tensors {live} B"
        if stage == 1:  # the stash is fp32 and full-size: 4 bytes per bf16 parameter (LayerNorms stay fp32)
            norms = sum(p.numel() for m in make_model(**MODEL).modules() if isinstance(m, torch.nn.LayerNorm)
                        for p in m.parameters())  # fmt: skip
            assert r["stash_bytes"] >= FP32 * (_psi() - norms)
