"""Two optimizers over the same parameters through a checkpoint: saved by 2 ranks at stage 3 (our sharded format
and DCP, written online), resumed on 1 and 2 ranks at other stages, and through ``zero-to-dcp``: each optimizer's
state comes back exactly (bit for bit, per parameter and state), it is the state one process doing the same steps
has, and training continues as the uninterrupted run. A version-1 checkpoint (one optimizer per FlatParam, the
format before several could share one) still loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_workers import INFO, trainer_state
from helpers.models import assert_state_close, clone_state
from helpers.shared_optimizers import PATTERNS, STEPS, batches, make, rank_part, reference_run, train

from zero_strategy.checkpoint.base.format import MANIFEST_NAME, PARAM_GROUPS_KEY, CheckpointError, Manifest
from zero_strategy.checkpoint.base.safetensors_io import SafetensorsReader, write_safetensors
from zero_strategy.checkpoint.dcp.export import export_to_dcp
from zero_strategy.checkpoint.dcp.load import load_dcp
from zero_strategy.checkpoint.dcp.save import save_dcp
from zero_strategy.checkpoint.sharded.load import check_compatible, load_optimizer_state, load_weights
from zero_strategy.checkpoint.sharded.reader import ShardedCheckpoint
from zero_strategy.checkpoint.sharded.save import save_sharded
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.testing import run_in_process, run_ranks

SAVE_AT = 2
Key = tuple[int, str, str]  # (optimizer, parameter, state name)


def _initial(pattern: str) -> dict[str, torch.Tensor]:
    return clone_state(make(PATTERNS[pattern])[0])


def local_optimizer_state(engine: ZeroEngine) -> dict[Key, Any]:
    """This rank's part of every optimizer's state, per parameter: ``[(element offset, values)]`` for per-element
    state, the value for scalars (a piece's ``step`` is its parameters')."""
    found: dict[Key, Any] = {}
    for flat in engine.flat_params:
        overlaps = flat.layout.overlaps(flat.rank)
        for index in flat.optimizers:
            state = engine.optimizers[index].state
            for piece, offset in zip(flat.master_pieces, flat.piece_offset, strict=True):
                for overlap in overlaps:
                    if not offset <= overlap.shard_start < offset + piece.numel():
                        continue
                    for key, value in state.get(piece, {}).items():
                        if isinstance(value, torch.Tensor) and value.dim() > 0:
                            start = overlap.shard_start - offset
                            part = value.reshape(-1)[start : start + overlap.numel].clone()
                            found.setdefault((index, overlap.name, key), []).append((overlap.param_start, part))
                        else:
                            found[(index, overlap.name, key)] = float(value)
    return found


def stitch(per_rank: list[dict[Key, Any]], numel: dict[str, int]) -> dict[Key, Any]:
    """Every rank's parts as whole (flattened) tensors per (optimizer, parameter, state)."""
    whole: dict[Key, Any] = {}
    for parts in per_rank:
        for key, value in parts.items():
            if not isinstance(value, list):
                assert whole.setdefault(key, value) == value, f"{key}: ranks disagree on a scalar"
                continue
            tensor = whole.setdefault(key, torch.full((numel[key[1]],), float("nan")))
            for start, values in value:
                tensor[start : start + values.numel()] = values
    return whole


def _engine(pattern: str, stage: int) -> tuple[torch.nn.Module, list[torch.optim.Optimizer], ZeroEngine]:
    model, optimizers = make(PATTERNS[pattern])
    model.load_state_dict(_INITIAL[pattern])
    return model, optimizers, ZeroEngine(model, optimizers, ZeroConfig(stage=stage))


def _train_and_save(rank: int, world: int, pattern: str, directory: str) -> tuple[dict, dict]:
    model, optimizers, engine = _engine(pattern, 3)
    data, part = batches(PATTERNS[pattern]), rank_part(rank, world)
    train(pattern, model, optimizers, data, engine.optimizer_step, part, range(SAVE_AT))
    save_sharded(engine, f"{directory}/zero", trainer_state(SAVE_AT), INFO)
    save_dcp(engine, f"{directory}/dcp", trainer_state(SAVE_AT), INFO)
    saved = local_optimizer_state(engine)
    train(pattern, model, optimizers, data, engine.optimizer_step, part, range(SAVE_AT, STEPS))
    with engine.gathered_parameters():
        return saved, clone_state(model)


def _resume(rank: int, world: int, pattern: str, stage: int, path: str, kind: str) -> tuple[dict, dict]:
    model, optimizers, engine = _engine(pattern, stage)
    if kind == "dcp":
        load_dcp(engine, path)
    else:
        with ShardedCheckpoint(path) as ckpt:
            check_compatible(engine, ckpt, strict=True, with_optimizer=True)
            load_weights(engine, ckpt)
            load_optimizer_state(engine, ckpt, ckpt.trainer_state()[PARAM_GROUPS_KEY])
    loaded = local_optimizer_state(engine)
    train(pattern, model, optimizers, batches(PATTERNS[pattern]), engine.optimizer_step, rank_part(rank, world),
          range(SAVE_AT, STEPS))
    with engine.gathered_parameters():
        return loaded, clone_state(model)


_INITIAL = {pattern: _initial(pattern) for pattern in ("both", "gan")}


@pytest.fixture(scope="module", params=["both", "gan"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pattern = request.param
    directory = tmp_path_factory.mktemp(f"shared-{pattern}")
    results = run_ranks(_train_and_save, 2, pattern, str(directory), timeout_s=60)
    numel = {name: p.numel() for name, p in make(PATTERNS[pattern])[0].named_parameters()}
    state = stitch([r[0] for r in results], numel)
    export_to_dcp(directory / "zero", directory / "exported")
    return {"pattern": pattern, "dir": directory, "state": state, "final": results[0][1], "numel": numel}


def test_both_optimizers_states_are_saved_and_are_the_reference_states(saved: dict[str, Any]) -> None:
    """What was saved is each optimizer's own state of every parameter it steps (the shared ones twice), equal to
    the state plain torch holds after the same steps."""
    _, expected = reference_run(saved["pattern"], _INITIAL[saved["pattern"]], range(SAVE_AT))
    state = saved["state"]
    assert set(state) == set(expected)
    shared = "out.weight" if saved["pattern"] == "both" else "shared.weight"
    assert {key for key in state if key[1] == shared and key[0] == 0} and {key for key in state if key[1] == shared
                                                                           and key[0] == 1}
    for key, value in expected.items():
        if isinstance(value, float):
            assert state[key] == value, key
        else:
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-7, msg=str(key))


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("kind", "world", "stage"),
    [("zero", 1, 1), ("zero", 2, 2), ("dcp", 1, 3), ("dcp", 2, 1), ("exported", 2, 2)],
    ids=["zero-2to1-zero1", "zero-2to2-zero2", "dcp-2to1-zero3", "dcp-2to2-zero1", "zero-to-dcp-2to2-zero2"],
)
def test_resume_restores_both_optimizers_exactly(saved: dict[str, Any], kind: str, world: int, stage: int) -> None:
    path = str(saved["dir"] / kind)
    loader = "dcp" if kind in ("dcp", "exported") else "zero"
    results = run_in_process(_resume, world, saved["pattern"], stage, path, loader)
    loaded = stitch([r[0] for r in results], saved["numel"])
    assert set(loaded) == set(saved["state"])
    for key, value in saved["state"].items():
        if isinstance(value, float):
            assert loaded[key] == value, key
        else:
            assert torch.equal(loaded[key], value), f"{key} differs after loading {kind} on {world} rank(s)"
    for rank, (_, final) in enumerate(results):
        assert_state_close(final, saved["final"], rel=1e-5, what=f"{kind} → {world} ranks, stage {stage}, rank {rank}")


# --------------------------------------------------------------------------------------------- format version 1
def _rewrite_as_version_1(path: Path) -> None:
    """Turn a version-2 checkpoint whose FlatParams have one optimizer each into what version 1 wrote: the
    manifest's ``optimizer_index``/``group_index``, state tensors ``optim/<key>/<name>``, unnamed scalar records."""
    raw = json.loads((path / MANIFEST_NAME).read_text())
    for flat in raw["flat_params"]:
        optimizers = flat.pop("optimizers")
        assert len(optimizers) <= 1
        flat["optimizer_index"] = optimizers[0] if optimizers else None
        for param in flat["params"]:
            groups = param.pop("groups")
            param["group_index"] = groups[0] if groups else None
    for rank in range(raw["world_size"]):
        shard = path / raw["version_dir"] / f"shard-{rank:05d}.safetensors"
        with SafetensorsReader(shard) as reader:
            tensors = {name: reader.read(name).view(reader.entries[name]["shape"]) for name in reader.names()}
            metadata = dict(reader.metadata)
        renamed = {("optim/" + name.split("/", 2)[2] if name.startswith("optim/") else name): t
                   for name, t in tensors.items()}
        scalars = json.loads(metadata["scalars"])
        for records in scalars.values():
            for record in records:
                del record["optimizer"]
        metadata["scalars"] = json.dumps(scalars)
        specs = [(name, t.dtype, list(t.shape)) for name, t in renamed.items()]
        raw["shard_bytes"][rank] = write_safetensors(shard, specs, iter(renamed.values()), metadata)
    raw["format_version"] = 1
    (path / MANIFEST_NAME).write_text(json.dumps(raw))


def _disjoint(stage: int) -> tuple[torch.nn.Module, list[torch.optim.Optimizer], ZeroEngine]:
    """SGD over the root unit (inp, out), Adam over the blocks: one optimizer per FlatParam, as version 1 knew."""
    model, _ = make("net")
    model.load_state_dict(_INITIAL["both"])
    optimizers = [torch.optim.SGD([*model.inp.parameters(), *model.out.parameters()], lr=0.1, momentum=0.9),
                  torch.optim.Adam(model.blocks.parameters(), lr=0.01)]
    return model, optimizers, ZeroEngine(model, optimizers, ZeroConfig(stage=stage))


def _save_disjoint(rank: int, world: int, path: str) -> None:
    model, optimizers, engine = _disjoint(2)
    train("both", model, optimizers, batches("net"), engine.optimizer_step, rank_part(rank, world), range(SAVE_AT))
    save_sharded(engine, path, trainer_state(SAVE_AT), INFO)


def _load_disjoint(rank: int, world: int, path: str) -> tuple[dict, dict]:
    model, _, engine = _disjoint(3)
    with ShardedCheckpoint(path) as ckpt:
        check_compatible(engine, ckpt, strict=True, with_optimizer=True)
        load_weights(engine, ckpt)
        load_optimizer_state(engine, ckpt, ckpt.trainer_state()[PARAM_GROUPS_KEY])
    with engine.gathered_parameters():
        return local_optimizer_state(engine), clone_state(model)


@pytest.mark.timeout(60)
def test_a_version_1_checkpoint_still_loads(tmp_path: Path) -> None:
    run_in_process(_save_disjoint, 2, str(tmp_path / "v2"))
    shutil.copytree(tmp_path / "v2", tmp_path / "v1")
    _rewrite_as_version_1(tmp_path / "v1")
    manifest = Manifest.from_file(tmp_path / "v1" / MANIFEST_NAME)
    assert manifest.format_version == 1
    assert [flat.optimizers for flat in manifest.flat_params] == [[0], [1], [1]]
    numel = {name: p.numel() for name, p in make("net")[0].named_parameters()}
    (v2_state, v2_model), = run_in_process(_load_disjoint, 1, str(tmp_path / "v2"))
    (v1_state, v1_model), = run_in_process(_load_disjoint, 1, str(tmp_path / "v1"))
    assert v2_state.keys() == v1_state.keys() and {key[0] for key in v2_state} == {0, 1}
    v2, v1 = stitch([v2_state], numel), stitch([v1_state], numel)
    for key, value in v2.items():
        assert v1[key] == value if isinstance(value, float) else torch.equal(v1[key], value), key
    assert_state_close(v1_model, v2_model, rel=0.0, what="weights read from version 1")


def test_a_format_version_it_does_not_know_names_the_versions_it_reads(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"format_version": 3, "versions": {"zero_strategy": "9.9"}}))
    with pytest.raises(CheckpointError, match=r"format version 3 .* reads versions 1, 2\); .* \(9\.9\)"):
        Manifest.from_file(tmp_path / MANIFEST_NAME)
