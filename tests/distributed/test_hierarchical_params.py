"""Hierarchical stage 3 (``hierarchical_params``, ZeRO++ hpZ): a node-local secondary copy of the parameters.

One 4-rank run, launched as 2 "nodes" of 2 ranks (``LOCAL_WORLD_SIZE=2``, as torchrun sets it), serves every
assertion: parity with torch's DDP (SGD with momentum, accumulation, global-norm clipping), no parameter byte
crossing nodes in backward (nor in the forwards after a step's first), inter-node bytes per step against the formula
of [Note: hierarchical parameters] and against ``zero-estimate``'s prediction, and the memory the copy costs.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from helpers.models import assert_state_close, clone_state, lm_loss, make_batches, make_model, rank_slice
from torch.nn.parallel import DistributedDataParallel

from zero_strategy.config import ZeroConfig, ZeroConfigError
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.core.engine.memory import memory_report
from zero_strategy.core.plan.precision import MixedPrecisionPolicy
from zero_strategy.core.plan.topology import INTRA_NODE, Topology
from zero_strategy.estimate.network import estimate_traffic
from zero_strategy.testing import run_ranks

STEPS, ACCUM, GLOBAL_BATCH, MAX_NORM = 3, 2, 8, 0.05
WORLD, PER_NODE = 4, 2
WIDE = 96  # bytes runs: the few scalar all-reduces of a step stay far below the 2 % the formulas are held to


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def _ddp_run(rank: int, world: int) -> list[dict]:
    model = make_model()
    ddp = DistributedDataParallel(model)
    optimizer = _optimizer(model)
    states = []
    for micro in make_batches(STEPS, ACCUM, GLOBAL_BATCH):
        optimizer.zero_grad()
        for index, tokens in enumerate(micro):
            with ddp.no_sync() if index < len(micro) - 1 else torch.enable_grad():
                (lm_loss(ddp, rank_slice(tokens, rank, world)) / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        states.append(clone_state(model))
    return states


def _parity_run(rank: int, world: int) -> list[dict]:
    model = make_model()
    optimizer = _optimizer(model)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3, hierarchical_params="node"))
    assert engine.comms.secondary is not None and engine.comms.secondary.size == PER_NODE
    states = []
    for micro in make_batches(STEPS, ACCUM, GLOBAL_BATCH):
        optimizer.zero_grad()
        for tokens in micro:
            (lm_loss(model, rank_slice(tokens, rank, world)) / ACCUM).backward()
        with engine.step_window(optimizer):
            engine.clip_grad_norm_(optimizer, MAX_NORM)
            optimizer.step()
        with engine.gathered_parameters():
            states.append(clone_state(model))
    engine.release()
    return states


def _bytes_run(rank: int, world: int, config: ZeroConfig) -> dict:
    """Inter-node bytes of each phase (forward / backward of each micro-step, the step) over steps 1-3 (step 0
    also agrees on the reduction order), plus the memory report after the last step."""
    model = make_model(width=WIDE)
    optimizer = _optimizer(model)
    engine = ZeroEngine(model, [optimizer], config)
    log = engine.comm_log
    phases: dict[str, dict[str, int]] = {}

    def phase(name: str) -> None:  # what crossed nodes since the last call by kind; "#": all gathered, intra-node
        entry = phases.setdefault(name, {}) if name != "warm-up" else {}
        for kind, sent in log.inter_node_bytes_by_kind.items():
            entry[kind] = entry.get(kind, 0) + sent
        entry["#all_gather"] = entry.get("#all_gather", 0) + log.bytes_by_kind.get("all_gather", 0)
        entry["#intra"] = entry.get("#intra", 0) + log.bytes_by_link.get(INTRA_NODE, 0)
        log.reset()

    for step, micro in enumerate(make_batches(4, ACCUM, GLOBAL_BATCH)):
        optimizer.zero_grad()
        log.reset()
        for index, tokens in enumerate(micro):
            loss = lm_loss(model, rank_slice(tokens, rank, world)) / ACCUM
            phase(f"forward {index}" if step else "warm-up")
            loss.backward()
            phase(f"backward {index}" if step else "warm-up")
        engine.optimizer_step(optimizer)
        phase("step" if step else "warm-up")
    padded = sum(flat.layout.padded_numel for flat in engine.flat_params)
    report = memory_report(engine)
    engine.release()
    return {"phases": phases, "padded": padded, "memory": (report.parameters, report.gradients,
                                                           report.optimizer_state, report.total)}


def _bf16_run(rank: int, world: int, config: ZeroConfig) -> tuple[dict, int]:
    """Two bf16 steps (accumulation 2): the final fp32 weights and the bytes of the secondary copies."""
    model = make_model()
    optimizer = _optimizer(model)
    engine = ZeroEngine(model, [optimizer], config, policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    for micro in make_batches(2, ACCUM, GLOBAL_BATCH):
        optimizer.zero_grad()
        for tokens in micro:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = lm_loss(model, rank_slice(tokens, rank, world)) / ACCUM
            loss.backward()
        engine.optimizer_step(optimizer)
    copies = sum(flat.secondary.values.untyped_storage().nbytes() for flat in engine.flat_params if flat.secondary)
    # Ψ/K in the compute dtype: bf16, fp32 for the LayerNorms (see [Note: fp32 normalization layers])
    compute = sum(flat.layout.padded_numel * (4 if "ln" in flat.names[0] else 2) for flat in engine.flat_params)
    engine.release()  # the module gets the fp32 masters back
    return clone_state(model), (copies, compute // PER_NODE)


def hierarchical_worker(rank: int, world: int) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = str(PER_NODE)  # two "nodes", as torchrun --nnodes=2 --nproc_per_node=2
    out: dict = {"ddp": _ddp_run(rank, world), "hpz": _parity_run(rank, world)}
    out["bf16 flat"] = _bf16_run(rank, world, ZeroConfig(stage=3))
    out["bf16 hier"] = _bf16_run(rank, world, ZeroConfig(stage=3, hierarchical_params="node"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        engine = ZeroEngine(make_model(), [], ZeroConfig(stage=3, hierarchical_params=4))
        out["world groups"] = engine.comms.secondary  # K = the world: nothing to save, no copy
        engine.release()
        os.environ["LOCAL_WORLD_SIZE"] = "1"  # 4 nodes of 1: groups of 2 span nodes
        ZeroEngine(make_model(), [], ZeroConfig(stage=3, hierarchical_params=2)).release()
        os.environ["LOCAL_WORLD_SIZE"] = "4"  # one node: the world gather stays inside it, no copy is built
        engine = ZeroEngine(make_model(), [], ZeroConfig(stage=3, hierarchical_params=2))
        out["one node groups"] = engine.comms.secondary
        engine.release()
        os.environ["LOCAL_WORLD_SIZE"] = str(PER_NODE)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    out["flat"] = _bytes_run(rank, world, ZeroConfig(stage=3))
    out["hier"] = _bytes_run(rank, world, ZeroConfig(stage=3, hierarchical_params="node"))
    try:
        ZeroEngine(make_model(), [], ZeroConfig(stage=3, hierarchical_params=3))
    except ZeroConfigError as error:
        out["error"] = str(error)
    dist.barrier()
    return out


def _sum(phases: dict[str, dict[str, int]], prefix: str, kind: str) -> int:
    return sum(kinds.get(kind, 0) for name, kinds in phases.items() if name.startswith(prefix))


@pytest.mark.timeout(90)
def test_hierarchical_stage3_matches_ddp_and_gathers_inside_the_node():
    results = run_ranks(hierarchical_worker, WORLD, timeout_s=80)
    ddp_states = results[0]["ddp"]
    count = sum(p.numel() for p in make_model(width=WIDE).parameters())
    estimate = estimate_traffic(count, 3, Topology.uniform(WORLD, PER_NODE), None, (100.0, 10.0),
                                accumulation=ACCUM, hierarchical_params="node")
    remote = (WORLD - PER_NODE) / WORLD  # share of every world exchange that goes to the other node
    for rank, result in enumerate(results):
        for step, (got, ref) in enumerate(zip(result["hpz"], ddp_states, strict=True)):
            assert_state_close(got, ref, rel=1e-5, what=f"hierarchical stage 3 rank {rank} step {step}")
        # bf16: bit-identical to flat stage 3 (the copy holds the bytes a world gather delivers), a bf16 copy of Ψ/K
        (flat_bf16, (no_copies, _)), (hier_bf16, (copies, expected)) = result["bf16 flat"], result["bf16 hier"]
        assert all(torch.equal(hier_bf16[k], flat_bf16[k]) for k in flat_bf16), f"rank {rank}: bf16 runs differ"
        assert no_copies == 0 and copies == expected
        hier, flat = result["hier"]["phases"], result["flat"]["phases"]
        psi = 4 * result["hier"]["padded"]  # padded fp32 bytes of the model (gathered and reduced alike)
        # backward re-gathers (and the second micro-step's forward) stay inside the node ...
        for name in ("backward 0", "forward 1", "backward 1"):
            assert hier[name]["#all_gather"] > 0, f"{name}: the engine gathered nothing (test is blind)"
            assert hier[name].get("all_gather", 0) == 0, f"rank {rank} {name}: parameter bytes crossed nodes"
        # ... while flat stage 3 sends them across (the test would catch a world gather in backward)
        assert _sum(flat, "backward", "all_gather") > 0
        # per step, (N - G)/N × (Ψ + m·Ψ): one world gather (the first forward) and the m reduce-scatters
        steps = 3
        assert _sum(hier, "", "all_gather") == pytest.approx(remote * psi * steps, rel=1e-9)
        inter = sum(sum(sent for k, sent in kinds.items() if k[0] != "#") for kinds in hier.values())
        assert inter / steps == pytest.approx(remote * (psi + ACCUM * psi), rel=0.02)
        flat_inter = sum(sum(sent for k, sent in kinds.items() if k[0] != "#") for kinds in flat.values())
        assert inter < 0.6 * flat_inter, (inter, flat_inter)
        # zero-estimate's hierarchical row predicts the inter-node bytes before any run, and bounds the intra-node
        # ones (it counts 2m - 1 node gathers; the engine keeps the root and the last unit whole into backward)
        assert estimate.inter_bytes == pytest.approx(inter / steps, rel=0.02)
        assert _sum(hier, "", "#intra") / steps <= estimate.intra_bytes <= 1.5 * _sum(hier, "", "#intra") / steps
        # memory: flat stage 3's 3Ψ/N (shard, gradient slice, momentum) plus the Ψ/K secondary copy
        params, _, _, total = result["hier"]["memory"]
        assert total == pytest.approx(psi * (3 / WORLD + 1 / PER_NODE), rel=0.02)
        assert params - result["flat"]["memory"][0] == psi // PER_NODE
        assert result["flat"]["memory"][3] == pytest.approx(psi * 3 / WORLD, rel=0.02)
        assert "hierarchical_params=3 must divide the world size 4" in result["error"]
        assert result["world groups"] is None and result["one node groups"] is None
        assert len(result["warnings"]) == 1 and "groups of 2 ranks span nodes" in result["warnings"][0]


def test_hierarchical_params_validation():
    with pytest.raises(ZeroConfigError, match="needs stage=3"):
        ZeroConfig(stage=2, hierarchical_params="node")
    with pytest.raises(ZeroConfigError, match="do not combine"):
        ZeroConfig(stage=3, hierarchical_params="node", shard_group_size=2)
    with pytest.raises(ZeroConfigError, match="hierarchical_params='rack'"):
        ZeroConfig(stage=3, hierarchical_params="rack")
    with pytest.raises(ZeroConfigError, match="not supported with offload"):
        ZeroConfig(stage=3, hierarchical_params=2, offload_optimizer="cpu")
