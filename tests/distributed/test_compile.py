"""torch.compile under ZeRO stages 1/2/3: the same weights as eager ZeRO and as DDP + compile, no graph break
inside a compiled block, no recompilation after the first step, and one graph break per unit (at most) where a
whole stage-3 model is compiled around its units' gather hooks, and ``fullgraph=True`` there fails with an error
that names the fix (see [Note: torch.compile] in core/runtime/compile_check.py).

One ``run_ranks`` call (2 ranks) trains every configuration in turn, 3 steps each, and the tests read its results.
Dynamo is reset between configurations, so each one is traced from scratch and its counters are its own.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.models import TiedLM, assert_state_close, clone_state, lm_loss, make_batches, make_model, rank_slice
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.testing import run_ranks

STEPS = 3
GLOBAL_BATCH = 8
N_BLOCKS = 3  # TiedLM's default: three block units besides the root


class UnrolledLM(TiedLM):
    """TiedLM with its blocks called one by one rather than in a loop: dynamo then keeps compiling the root's own
    code around each block call (a graph break inside a loop would give the whole frame up to eager instead)."""

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.emb(tokens)
        h = self.blocks[0](h)
        h = self.blocks[1](h)
        h = self.blocks[2](h)
        return self.head(self.ln_f(h))


def _dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "frames": counters["frames"]["total"],  # every compilation of a frame, recompilations included
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def _train(rank: int, world_size: int, method: str, compiled: str) -> dict[str, Any]:
    """``method``: "ddp" or "zero<stage>"; ``compiled``: "eager", "blocks" (each block's ``compile()``, the README's
    recommendation) or "whole_unrolled" (``torch.compile`` of the whole UnrolledLM)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model: nn.Module = make_model() if compiled != "whole_unrolled" else _unrolled()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=int(method[-1]))) if method != "ddp" else None
    forward: nn.Module = DistributedDataParallel(model) if engine is None else model
    if compiled == "blocks":
        for block in model.blocks:  # type: ignore[union-attr]
            block.compile()
    elif compiled == "whole_unrolled":
        forward = torch.compile(forward)
    frames_before_step = []
    for micro in make_batches(STEPS, 1, GLOBAL_BATCH):
        frames_before_step.append(_dynamo_counts()["frames"])
        optimizer.zero_grad()
        lm_loss(forward, rank_slice(micro[0], rank, world_size)).backward()
        engine.optimizer_step(optimizer) if engine is not None else optimizer.step()
    if engine is not None:
        engine.release()
    state = {name.replace("_orig_mod.", ""): value for name, value in clone_state(model).items()}
    return {"state": state, "frames_before_step": frames_before_step, **_dynamo_counts()}


def _unrolled() -> UnrolledLM:
    torch.manual_seed(0)  # the same initial weights as make_model()
    return UnrolledLM()


CONFIGS = [
    ("ddp", "eager"), ("ddp", "blocks"),
    ("zero1", "eager"), ("zero1", "blocks"),
    ("zero2", "eager"), ("zero2", "blocks"),
    ("zero3", "eager"), ("zero3", "blocks"), ("zero3", "whole_unrolled"),
]  # fmt: skip


def _fullgraph_error(rank: int, world_size: int) -> str:
    """``fullgraph=True`` on a whole stage-3 model cannot work (the gathers are collectives): dynamo's error."""
    import torch._dynamo

    torch._dynamo.reset()
    model = _unrolled()
    engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=3))
    tokens = rank_slice(make_batches(1, 1, GLOBAL_BATCH)[0][0], rank, world_size)
    try:
        lm_loss(torch.compile(model, backend="aot_eager", fullgraph=True), tokens)
    except Exception as error:  # every rank fails at the same point: tracing the first block unit's call
        return str(error)
    finally:
        del engine  # held to here: an engine nobody holds goes at any garbage collection, hooks and all
    return "no error"


def _all_configs(rank: int, world_size: int) -> dict[Any, Any]:
    torch._inductor.config.compile_threads = 1  # no pool of compile workers fighting the ranks for 2 cores
    results: dict[Any, Any] = {config: _train(rank, world_size, *config) for config in CONFIGS}
    results["fullgraph_error"] = _fullgraph_error(rank, world_size)
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict[tuple[str, str], dict[str, Any]]]:
    return run_ranks(_all_configs, 2, timeout_s=110)


@pytest.mark.timeout(120)
def test_compiled_zero_trains_like_eager_zero_and_ddp_compile(runs: list[dict[tuple[str, str], Any]]) -> None:
    results = runs[0]
    ddp_eager, ddp_compiled = results["ddp", "eager"]["state"], results["ddp", "blocks"]["state"]
    assert_state_close(ddp_compiled, ddp_eager, rel=1e-5, what="ddp + compile vs ddp")
    for stage in (1, 2, 3):
        eager = results[f"zero{stage}", "eager"]["state"]
        assert_state_close(eager, ddp_eager, rel=1e-5, what=f"zero{stage} vs ddp")
        compiled = results[f"zero{stage}", "blocks"]["state"]
        assert_state_close(compiled, eager, rel=1e-5, what=f"zero{stage} + compile vs zero{stage}")
        assert_state_close(compiled, ddp_compiled, rel=1e-5, what=f"zero{stage} + compile vs ddp + compile")
    unrolled = results["zero3", "whole_unrolled"]["state"]
    assert_state_close(unrolled, results["zero3", "eager"]["state"], rel=1e-5, what="zero3, whole model compiled")
    for rank, other in enumerate(runs[1:], start=1):  # every rank ends with the same weights
        for config in CONFIGS:
            assert_state_close(other[config]["state"], results[config]["state"], rel=0.0, what=f"rank {rank} {config}")


@pytest.mark.timeout(120)
def test_compiled_blocks_have_no_graph_break_and_compile_once(runs: list[dict[tuple[str, str], Any]]) -> None:
    """Each block's ``compile()`` leaves the gather hooks outside the graph: one graph for the three identical
    blocks, no graph break, and nothing compiled after the first step (a hook traced by dynamo guarded on the
    hooks' Python state and recompiled when it changed, and broke the graph at the collectives)."""
    for rank_results in runs:
        for method in ("ddp", "zero1", "zero2", "zero3"):
            run = rank_results[method, "blocks"]
            assert run["graph_breaks"] == 0, f"{method}: {run['graph_breaks']} graph breaks"
            assert run["graphs"] == 1, f"{method}: {run['graphs']} graphs for three identical blocks"
            assert run["frames_before_step"] == [0] + [run["frames"]] * (STEPS - 1), (
                f"{method}: frames compiled before each step {run['frames_before_step']}, {run['frames']} in all: "
                "compiled again after the first step"
            )


@pytest.mark.timeout(120)
def test_whole_stage3_model_breaks_at_most_once_per_unit(runs: list[dict[tuple[str, str], Any]]) -> None:
    """The whole model compiled at stage 3: each unit's gather is a collective that cannot be traced, so the graph
    breaks at each unit's call (at most one break per unit, none inside our hooks) and nothing recompiles."""
    for rank_results in runs:
        run = rank_results["zero3", "whole_unrolled"]
        assert 0 < run["graph_breaks"] <= N_BLOCKS, f"{run['graph_breaks']} graph breaks for {N_BLOCKS} units"
        assert run["frames_before_step"][1:] == [run["frames"]] * (STEPS - 1), run["frames_before_step"]


def test_fullgraph_on_a_whole_stage3_model_names_the_fix(runs: list[dict[Any, Any]]) -> None:
    for rank_results in runs:
        message = rank_results["fullgraph_error"]
        assert "ZeRO gathers or frees a unit's parameters here" in message, message
        assert "block.compile()" in message, message
