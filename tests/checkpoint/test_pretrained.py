"""Pretrained weights read by name and element range (``open_pretrained``), key matching with one error, and
loading into an ordinary module. Reference: the tensors that were written, sliced by torch itself."""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from ckpt_workers import INFO, train_and_save
from helpers.models import make_model
from safetensors.torch import load, save_file
from torch import Tensor, nn

from zero_strategy.checkpoint.base.format import CheckpointError
from zero_strategy.checkpoint.base.safetensors_io import write_safetensors
from zero_strategy.checkpoint.export.consolidate import consolidate
from zero_strategy.checkpoint.pretrained.keys import PretrainedMismatchError, alias_groups, expected_shapes, match_keys
from zero_strategy.checkpoint.pretrained.open import load_pretrained_into_module, open_pretrained
from zero_strategy.checkpoint.sharded.save import save_sharded
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.process_memory import reset_peak, status_bytes
from zero_strategy.testing import run_ranks


def _tensors() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "enc.weight": torch.randn(7, 13, generator=g),
        "enc.bf16": torch.randn(5, 9, generator=g).to(torch.bfloat16),
        "enc.half": torch.randn(4, 4, generator=g).half(),
        "enc.cube": torch.randn(3, 4, 5, generator=g),
        "steps": torch.arange(6) * 1_000_003,
        "scale": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
    }


def _write_index(directory: Path, parts: list[dict[str, Tensor]], suffix: str, index_name: str) -> None:
    weight_map = {}
    for i, part in enumerate(parts):
        name = f"model-{i + 1:05d}-of-{len(parts):05d}{suffix}"
        if suffix == ".safetensors":
            save_file(part, directory / name)
        else:
            torch.save(part, directory / name)
        weight_map.update(dict.fromkeys(part, name))
    (directory / index_name).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def _make_source(kind: str, root: Path, tensors: dict[str, Tensor]) -> Path:
    """Write ``tensors`` as ``kind``; return the path a user would pass."""
    names = list(tensors)
    halves = [{k: tensors[k] for k in names[:3]}, {k: tensors[k] for k in names[3:]}]
    if kind == "safetensors":
        save_file(tensors, root / "w.safetensors")
        return root / "w.safetensors"
    if kind == "dir_safetensors":
        save_file(tensors, root / "model.safetensors")
        return root
    if kind == "hf_index_dir":
        _write_index(root, halves, ".safetensors", "model.safetensors.index.json")
        return root
    if kind == "hf_index_file":
        _write_index(root, halves, ".safetensors", "model.safetensors.index.json")
        return root / "model.safetensors.index.json"
    if kind == "bin_index_dir":
        _write_index(root, halves, ".bin", "pytorch_model.bin.index.json")
        return root
    if kind == "pt":
        torch.save(tensors, root / "w.pt")
        return root / "w.pt"
    assert kind == "ckpt"
    torch.save({"state_dict": tensors, "epoch": 3, "hyper_parameters": {"lr": 0.1}}, root / "w.ckpt")
    return root / "w.ckpt"


def _ranges(shape: tuple[int, ...], numel: int, g: torch.Generator) -> list[tuple[int, int]]:
    """Whole tensor, empty at both ends, one crossing a row boundary, and random ones."""
    ranges = [(0, numel), (0, 0), (numel, 0)]
    if len(shape) >= 2 and numel > shape[-1] + 3:
        ranges.append((shape[-1] - 2, shape[-1] + 3))
    for _ in range(4):
        start = int(torch.randint(0, numel + 1, (), generator=g))
        ranges.append((start, int(torch.randint(0, numel - start + 1, (), generator=g))))
    return ranges


def _check_reads(path: Path, reference: dict[str, Tensor], key_map: object = None) -> None:
    g = torch.Generator().manual_seed(1)
    with open_pretrained(path, key_map) as source:  # type: ignore[arg-type]
        assert sorted(source.keys()) == sorted(reference)
        for name, tensor in reference.items():
            assert source.shape(name) == tuple(tensor.shape) and source.dtype(name) == tensor.dtype, name
            flat = tensor.reshape(-1)
            for start, count in _ranges(tuple(tensor.shape), tensor.numel(), g):
                got = source.read(name, start, count)
                assert got.dtype == torch.float32 and got.shape == (count,)
                # bf16/fp16 -> fp32 is exact, so equality with torch's own conversion is the bit-exact check
                assert torch.equal(got, flat[start : start + count].float()), (name, start, count)
                stored = source.read(name, start, count, dtype=None)
                assert stored.dtype == tensor.dtype and torch.equal(stored, flat[start : start + count])


KINDS = ["safetensors", "dir_safetensors", "hf_index_dir", "hf_index_file", "bin_index_dir", "pt", "ckpt"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_reads_ranges_bit_equal(kind, tmp_path):
    tensors = _tensors()
    _check_reads(_make_source(kind, tmp_path, tensors), tensors)


def test_non_contiguous_tensor_in_a_torch_file(tmp_path):
    """torch.save keeps strides: a saved transpose is read in its row-major (logical) order."""
    base = torch.randn(6, 11)
    torch.save({"t": base.t()}, tmp_path / "t.pt")
    _check_reads(tmp_path / "t.pt", {"t": base.t().contiguous()})


# ------------------------------------------------------------------------------- this project's outputs
@pytest.fixture(scope="module")
def trained_2ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Tensor]]:
    """A TiedLM (odd width: padded flat buffers, parameters split across the two ranks' shards) trained and saved
    at stage 3 by two ranks; its full state_dict as the ranks saw it."""
    path = tmp_path_factory.mktemp("sharded") / "ck"
    state = run_ranks(train_and_save, 2, 3, 2, str(path), timeout_s=60)[0]
    return path, state


@pytest.mark.parametrize("output", ["sharded", "model.safetensors", "model.pt", "model.ckpt"])
def test_sharded_checkpoint_and_consolidated_outputs(trained_2ranks, tmp_path, output):
    path, state = trained_2ranks
    if output != "sharded":
        path = consolidate(path, tmp_path / output, progress=False)
    expected = {k: v.float() for k, v in state.items()}
    _check_reads(path, expected)
    model = make_model(seed=5)  # other values, same architecture
    match = load_pretrained_into_module(model, path)
    assert match.missing == [] and match.unexpected == []
    got = model.state_dict()
    assert list(got) == list(state) and all(torch.equal(got[k], expected[k]) for k in got)
    assert model.head.weight is model.emb.weight  # loading kept the tie


# ------------------------------------------------------------------------------- key_map
@pytest.mark.parametrize(
    ("key_map", "renamed"),
    [
        ("model.", {"model.a": "a", "model.b.c": "b.c", "head": "head"}),
        ({"strip_prefix": "model."}, {"model.a": "a", "model.b.c": "b.c", "head": "head"}),
        ({"add_prefix": "net."}, {"model.a": "net.model.a", "model.b.c": "net.model.b.c", "head": "net.head"}),
        (
            {"strip_prefix": "model.", "add_prefix": "enc."},
            {"model.a": "enc.a", "model.b.c": "enc.b.c", "head": "enc.head"},
        ),
        ({"head": "classifier", "model.a": None}, {"model.b.c": "model.b.c", "head": "classifier"}),
        (lambda k: None if k == "head" else k.upper(), {"model.a": "MODEL.A", "model.b.c": "MODEL.B.C"}),
    ],
)
def test_key_map_variants(tmp_path, key_map, renamed):
    tensors = {"model.a": torch.randn(3), "model.b.c": torch.randn(2, 2), "head": torch.randn(4)}
    save_file(tensors, tmp_path / "w.safetensors")
    _check_reads(tmp_path / "w.safetensors", {new: tensors[old] for old, new in renamed.items()}, key_map)
    with open_pretrained(tmp_path / "w.safetensors", key_map) as source:
        assert {source.file_key(new): new for new in source.keys()} == renamed


def test_key_map_errors(tmp_path):
    save_file({"a.x": torch.zeros(1), "b.x": torch.zeros(1)}, tmp_path / "w.safetensors")
    with pytest.raises(CheckpointError, match=r"renames both 'a.x' and 'b.x' to 'x'"):
        open_pretrained(tmp_path / "w.safetensors", lambda k: k.split(".")[1])
    with pytest.raises(TypeError, match="key_map must be"):
        open_pretrained(tmp_path / "w.safetensors", 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must return a str or None"):
        open_pretrained(tmp_path / "w.safetensors", lambda k: 1)  # type: ignore[arg-type,return-value]


# ------------------------------------------------------------------------------- matching keys
class Net(nn.Module):
    def __init__(self, head: int = 3) -> None:
        super().__init__()
        self.body = nn.Linear(4, 5)
        self.norm = nn.BatchNorm1d(5)
        self.head = nn.Linear(5, head)


def test_one_error_lists_missing_unexpected_and_mismatched(tmp_path):
    saved = {f"model.{k}": v for k, v in Net(head=7).state_dict().items()}
    saved["model.extra"] = torch.zeros(2)
    save_file(saved, tmp_path / "w.safetensors")
    module = Net(head=3)
    with pytest.raises(PretrainedMismatchError) as error:  # no key_map: every module key missing
        load_pretrained_into_module(module, tmp_path / "w.safetensors")
    message = str(error.value)
    assert "9 missing" in message and "10 unexpected" in message and "model.extra" in message
    assert "key_map={'strip_prefix': 'model.'}" in message and "strict=False" in message
    with pytest.raises(PretrainedMismatchError) as error:
        load_pretrained_into_module(module, tmp_path / "w.safetensors", key_map="model.")
    message = str(error.value)
    assert "1 unexpected (in the file, not in the module): extra" in message
    assert "head.weight: module [3, 5], file [7, 5]; head.bias: module [3], file [7]" in message
    assert " missing (" not in message
    # strict=False: a new head of another size still needs its old keys dropped; then the rest loads
    with pytest.raises(PretrainedMismatchError, match="shape mismatch"):
        load_pretrained_into_module(module, tmp_path / "w.safetensors", strict=False, key_map="model.")
    head_before = module.head.weight.detach().clone()
    rename = lambda k: None if k.startswith("model.head.") else k.removeprefix("model.")  # noqa: E731
    match = load_pretrained_into_module(module, tmp_path / "w.safetensors", strict=False, key_map=rename)
    assert match.missing == ["head.weight", "head.bias"] and match.unexpected == ["extra"]
    assert torch.equal(module.head.weight, head_before)
    assert torch.equal(module.body.weight, saved["model.body.weight"])
    assert torch.equal(module.norm.num_batches_tracked, saved["model.norm.num_batches_tracked"])


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(6, 4)
        self.lm_head = nn.Linear(4, 6, bias=False)
        self.lm_head.weight = self.wte.weight
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)


@pytest.mark.parametrize("stored", ["wte.weight", "lm_head.weight"])
def test_tied_weights_stored_under_one_name(tmp_path, stored):
    torch.manual_seed(0)
    weight, frozen = torch.randn(6, 4), torch.randn(3)
    save_file({stored: weight, "frozen": frozen}, tmp_path / "w.safetensors")
    module = Tied()
    assert alias_groups(module) == [("wte.weight", "lm_head.weight")]
    with open_pretrained(tmp_path / "w.safetensors") as source:
        with pytest.raises(PretrainedMismatchError, match="1 missing"):  # without the alias group
            match_keys(source, expected_shapes(module), strict=True)
        match = match_keys(source, expected_shapes(module), True, alias_groups(module))
    assert match.sources == {"wte.weight": stored, "lm_head.weight": stored, "frozen": "frozen"}
    load_pretrained_into_module(module, tmp_path / "w.safetensors")
    assert torch.equal(module.lm_head.weight, weight) and module.lm_head.weight is module.wte.weight
    assert torch.equal(module.frozen, frozen)  # frozen parameters load too


def test_meta_module_is_refused(tmp_path):
    save_file({"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, tmp_path / "w.safetensors")
    with torch.device("meta"):
        module = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="meta device"):
        load_pretrained_into_module(module, tmp_path / "w.safetensors")


class WithBuffers(nn.Module):
    """BatchNorm statistics (fp32 and int64), a frozen bf16 parameter and a tie: a sharded checkpoint keeps the
    parameters in its shards and the buffers in its trainer state."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(9, 6)
        self.frozen = nn.Parameter(torch.randn(5, 6).to(torch.bfloat16), requires_grad=False)
        self.bn = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 9, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.bn(self.emb(tokens)) + self.frozen.float().sum(0))


def _save_with_buffers(path: Path, trainer_state: dict) -> dict[str, Tensor]:
    """One rank, stage 3, one SGD step; the state_dict as saved."""
    torch.manual_seed(0)
    model = WithBuffers()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3))
    model(torch.randint(0, 9, (8,))).square().mean().backward()
    engine.optimizer_step(optimizer)
    save_sharded(engine, path, trainer_state, INFO)
    with engine.gathered_parameters():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_sharded_checkpoint_buffers_and_frozen_parameters(tmp_path):
    state = _save_with_buffers(tmp_path / "ck", {"global_step": 1})
    assert state["bn.num_batches_tracked"] == 1 and state["frozen"].dtype == torch.bfloat16
    _check_reads(tmp_path / "ck", state)  # the frozen parameter's shard keeps its bf16; reads convert exactly
    torch.manual_seed(3)
    fresh = WithBuffers()
    load_pretrained_into_module(fresh, tmp_path / "ck")
    assert all(torch.equal(v, state[k]) for k, v in fresh.state_dict().items())
    # buffers sit next to the trainer state: a hyper-parameter object there is refused like any pickle
    _save_with_buffers(tmp_path / "ck2", {"global_step": 1, "hyper_parameters": {"obj": Payload("unused")}})
    with pytest.raises(CheckpointError, match=r"trainer_state\.pt holds the module's buffers.*--unsafe-trainer-state"):
        open_pretrained(tmp_path / "ck2")


# ------------------------------------------------------------------------------- refusals
class Payload:
    """Unpickling it would write a marker file: proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __setstate__(self, state: dict) -> None:
        Path(state["marker"]).write_text("ran")


def test_pickle_with_a_custom_class_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "marker"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "hyper_parameters": Payload(str(marker))}, tmp_path / "x.ckpt")
    with pytest.raises(CheckpointError, match=r"weights_only=True.*--unsafe-trainer-state") as error:
        open_pretrained(tmp_path / "x.ckpt")
    assert str(tmp_path / "x.ckpt") in str(error.value) and not marker.exists()


def test_legacy_torch_file_is_refused_with_the_remedy(tmp_path):
    torch.save({"w": torch.zeros(2)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(
        CheckpointError, match=r"not a zip-format torch file.*zero-to-fp32 .*old\.pt model\.safetensors"
    ):
        open_pretrained(tmp_path / "old.pt")


def test_unknown_and_broken_sources_name_the_file(tmp_path):
    (tmp_path / "w.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"w\.txt is neither a torch file.*any torch\.save output"):
        open_pretrained(tmp_path / "w.txt")
    with pytest.raises(CheckpointError, match="do not exist"):
        open_pretrained(tmp_path / "nope.safetensors")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.md").write_text("")
    with pytest.raises(CheckpointError, match=r"directory with none of .*notes\.md"):
        open_pretrained(tmp_path / "d")
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match=r"list\.pt holds list, not weights"):
        open_pretrained(tmp_path / "list.pt")
    save_file({"a": torch.zeros(100)}, tmp_path / "cut.safetensors")
    data = (tmp_path / "cut.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match=r"cut\.safetensors is truncated"):
        open_pretrained(tmp_path / "cut.safetensors")
    _write_index(tmp_path, [{"a": torch.zeros(1)}, {"b": torch.zeros(1)}], ".safetensors", "m.index.json")
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors is missing"):
        open_pretrained(tmp_path / "m.index.json")


def test_ranges_and_names_are_checked(tmp_path):
    save_file({"a": torch.zeros(3, 4)}, tmp_path / "w.safetensors")
    with open_pretrained(tmp_path / "w.safetensors") as source:
        for start, count in [(-1, 2), (0, 13), (12, 1), (5, -1)]:
            with pytest.raises(ValueError, match=r"outside tensor 'a'.*which has 12 \(shape \[3, 4\]\)"):
                source.read("a", start, count)
        with pytest.raises(KeyError, match="no tensor named 'b'"):
            source.read("b")


# ------------------------------------------------------------------------------- memory
def _reset_peak_rss() -> float:
    """Linux: VmHWM := current RSS; returns the current RSS in MiB. Freed heap memory glibc still holds is handed
    back first: allocations could otherwise reuse it unseen, and the probe would under-count."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return reset_peak() / 2**20


def _rss_mib(field: str) -> float:
    return status_bytes(field) / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak-RSS reset through /proc is Linux-only")
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_reading_ranges_of_a_64_mib_file_stays_far_below_its_size(tmp_path, suffix):
    """Four 16 MiB fp32 tensors; six reads of 1 MiB ranges (fp32, so no conversion). The process's own memory
    (RssAnon, sampled while each result is alive) may grow by at most 2 x the range (the result and one transient)
    + 8 MiB (allocator and lazy-initialisation slack): 10 MiB, less than one tensor. The peak RSS obeys the same
    bound for safetensors (plain file reads, nothing mapped); a memory-mapped torch file also maps the pages it
    touched, clean page cache the kernel can drop, about 2 x the bytes read (fault-around), so it gets 3 x the
    bytes read on top: 28 MiB, still far below the file. Loading the file whole raises the peak by at least its
    size, which shows the probe sees such growth."""
    numel, chunk, reads = 4 * 2**20, 2**18, 6
    path = tmp_path / f"big{suffix}"
    if suffix == ".safetensors":  # written one tensor at a time
        specs = [(f"t{i}", torch.float32, [1024, 4096]) for i in range(4)]
        tensors = ((torch.arange(numel, dtype=torch.float32) + i * numel).view(1024, 4096) for i in range(4))
        write_safetensors(path, specs, tensors, {"format": "pt"})
    else:
        torch.save(
            {f"t{i}": (torch.arange(numel, dtype=torch.float32) + i * numel).view(1024, 4096) for i in range(4)}, path
        )
    g = torch.Generator().manual_seed(0)
    range_mib = chunk * 4 / 2**20
    with open_pretrained(path) as source:
        base, base_anon, anon_growth = _reset_peak_rss(), _rss_mib("RssAnon"), 0.0
        for _ in range(reads):
            i, start = int(torch.randint(0, 4, (), generator=g)), int(torch.randint(0, numel - chunk, (), generator=g))
            got = source.read(f"t{i}", start, chunk)
            anon_growth = max(anon_growth, _rss_mib("RssAnon") - base_anon)
            assert got[0] == i * numel + start and got[-1] == i * numel + start + chunk - 1
            del got
        growth = _rss_mib("VmHWM") - base
    mapped_allowance = 3 * reads * range_mib if suffix == ".pt" else 0
    assert anon_growth <= 2 * range_mib + 8, f"reading 1 MiB ranges allocated {anon_growth:.1f} MiB"
    assert growth <= 2 * range_mib + 8 + mapped_allowance, (
        f"reading 1 MiB ranges raised the peak RSS by {growth:.1f} MiB"
    )
    base = _reset_peak_rss()
    # what a loader without ranged reads does
    whole = load(path.read_bytes()) if suffix == ".safetensors" else torch.load(path, weights_only=True)
    whole_growth = _rss_mib("VmHWM") - base
    assert whole_growth > 0.9 * 64, "the probe did not see a whole-file load"
    print(
        f"{suffix}: 6 reads of 1 MiB: +{anon_growth:.1f} MiB anon, +{growth:.1f} MiB peak; whole: +{whole_growth:.1f}"
    )
    del whole


# ------------------------------------------------------------------------------- Hugging Face
def test_hugging_face_gpt2_sharded_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2 and "lm_head.weight" not in weight_map  # sharded, tie stored once
    state = model.state_dict()
    _check_reads(tmp_path, {k: state[k] for k in weight_map})
    with open_pretrained(tmp_path) as source:
        match = match_keys(source, expected_shapes(model), True, alias_groups(model))
    assert match.sources["lm_head.weight"] == "transformer.wte.weight"
    torch.manual_seed(1)
    fresh = transformers.GPT2LMHeadModel(config)
    load_pretrained_into_module(fresh, tmp_path)
    assert all(torch.equal(v, state[k]) for k, v in fresh.state_dict().items())
