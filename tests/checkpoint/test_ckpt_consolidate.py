"""Consolidation (``zero-to-fp32``): a sharded checkpoint becomes one file holding exactly the module's
``state_dict()`` (keys, order, values; parameters in fp32, buffers in their own dtype), loadable without
zero_strategy; the CLI's exit codes and messages; atomic writes; bounded memory for ``.safetensors``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ckpt_workers import INFO, train_and_save, trainer_state
from safetensors.torch import load_file
from torch import Tensor, nn

import zero_strategy.checkpoint.export.consolidate as consolidate_module
from zero_strategy.checkpoint.base.format import BUFFERS_KEY, MANIFEST_NAME, TRAINER_STATE_NAME, CheckpointError
from zero_strategy.checkpoint.export.cli import main as zero_to_fp32
from zero_strategy.checkpoint.export.consolidate import consolidate
from zero_strategy.checkpoint.sharded.save import save_sharded
from zero_strategy.config import ZeroConfig
from zero_strategy.core.engine.engine import ZeroEngine
from zero_strategy.testing import run_ranks


class Opaque:
    """A hyper-parameter object that ``weights_only=True`` refuses to unpickle."""

    def __init__(self, value: int) -> None:
        self.value = value


class Mixed(nn.Module):
    """Tied weights, a frozen bf16 parameter, BatchNorm statistics, bool / bf16 buffers, and non-tensor extra
    state: everything a state_dict can hold besides fp32 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.frozen = nn.Parameter(torch.randn(5, 6).to(torch.bfloat16), requires_grad=False)
        self.bn = nn.BatchNorm1d(6)
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("bf16_buffer", torch.randn(3).to(torch.bfloat16))
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.bn(self.emb(tokens)) + self.frozen.float().sum(0))


class WithExtraState(Mixed):
    def get_extra_state(self) -> dict:
        return {"vocab": 11}

    def set_extra_state(self, state: dict) -> None:
        pass


def _save_one_rank(model: nn.Module, path: Path, state: dict | None = None) -> dict[str, Tensor]:
    """Train one AdamW step on one rank at stage 3, save, return the module's full state_dict."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3))
    model(torch.randint(0, 11, (8,))).square().mean().backward()
    engine.optimizer_step(optimizer)
    save_sharded(engine, path, state or trainer_state(1), INFO)
    with engine.gathered_parameters():
        return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}


def _expected_fp32(state: dict[str, Tensor], params: set[str]) -> dict[str, Tensor]:
    return {k: v.float() if k in params else v for k, v in state.items()}


def _assert_identical(got: dict, ref: dict, what: str) -> None:
    assert list(got) == list(ref), f"{what}: keys/order {list(got)} != {list(ref)}"
    for key, value in ref.items():
        if not torch.is_tensor(value):
            assert got[key] == value, key
            continue
        assert got[key].dtype == value.dtype, f"{what}: {key} is {got[key].dtype}, expected {value.dtype}"
        assert torch.equal(got[key], value), f"{what}: {key} differs"


@pytest.fixture(scope="module")
def tied_2ranks(tmp_path_factory):
    """The tied-embedding LM trained on 2 ranks at stage 3 (parameters split across both shards)."""
    path = tmp_path_factory.mktemp("tied") / "ck"
    state = run_ranks(train_and_save, 2, 3, 2, str(path), timeout_s=60)[0]
    return path, state


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mixed") / "ck"
    return path, _save_one_rank(Mixed(), path)


def _load(path: Path) -> dict:
    if path.suffix == ".safetensors":
        return load_file(path)
    if path.suffix == ".ckpt":
        return torch.load(path, weights_only=True)["state_dict"]
    return torch.load(path, weights_only=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".bin", ".ckpt"])
def test_tied_model_from_two_ranks(tied_2ranks, tmp_path, suffix):
    path, state = tied_2ranks
    out = consolidate(path, tmp_path / f"model{suffix}", progress=False)
    assert out == tmp_path / f"model{suffix}"
    got = _load(out)
    _assert_identical(got, state, suffix)
    assert torch.equal(got["head.weight"], got["emb.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name], "no temporary file may remain"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".ckpt"])
def test_parameters_become_fp32_and_buffers_keep_their_dtype(mixed, tmp_path, suffix):
    path, state = mixed
    assert state["frozen"].dtype == torch.bfloat16, "the frozen parameter is stored in bf16"
    got = _load(consolidate(path, tmp_path / f"model{suffix}", progress=False))
    params = {"frozen", "emb.weight", "bn.weight", "bn.bias", "head.weight"}
    _assert_identical(got, _expected_fp32(state, params), suffix)
    assert got["mask"].dtype == torch.bool and got["bn.num_batches_tracked"].dtype == torch.int64


def _add_extra_state(path: Path, value: object) -> list[str]:
    """Rewrite a saved Mixed checkpoint as WithExtraState's would be (kept as a direct check of consolidation of
    hand-built entries): the extra state joins the buffers in the trainer state and the manifest's key list."""
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    state_path = path / manifest["version_dir"] / TRAINER_STATE_NAME
    state = torch.load(state_path, weights_only=True)
    state[BUFFERS_KEY]["_extra_state"] = value
    torch.save(state, state_path)
    kinds = {key: entry for key, *entry in manifest["state_dict_keys"]}
    keys = list(WithExtraState().state_dict())
    manifest["state_dict_keys"] = [[k, *kinds.get(k, ["buffer", k])] for k in keys]
    manifest["trainer_state_bytes"] = state_path.stat().st_size
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    return keys


@pytest.mark.timeout(60)
def test_non_tensor_extra_state(tmp_path):
    torch.manual_seed(0)
    state = _save_one_rank(Mixed(), tmp_path / "ck")
    keys = _add_extra_state(tmp_path / "ck", {"vocab": 11})
    got = torch.load(consolidate(tmp_path / "ck", tmp_path / "model.pt", progress=False), weights_only=True)
    assert list(got) == keys and got["_extra_state"] == {"vocab": 11}
    assert all(torch.equal(got[k], state[k].float()) for k in state)
    with pytest.raises(ValueError, match=r"'_extra_state'.*\.pt"):
        consolidate(tmp_path / "ck", tmp_path / "model.safetensors", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "model.pt"]


@pytest.mark.timeout(60)
def test_module_with_non_tensor_extra_state_can_be_saved(tmp_path):
    torch.manual_seed(0)
    _save_one_rank(WithExtraState(), tmp_path / "ck")
    got = torch.load(consolidate(tmp_path / "ck", tmp_path / "model.pt", progress=False), weights_only=True)
    assert got["_extra_state"] == {"vocab": 11}


@pytest.mark.timeout(60)
def test_lightning_keys_of_a_core_checkpoint(mixed, tmp_path):
    """A checkpoint written without a Trainer still gives a .ckpt that Lightning accepts (version key)."""
    path, _ = mixed
    checkpoint = torch.load(consolidate(path, tmp_path / "m.ckpt", progress=False), weights_only=True)
    assert checkpoint["pytorch-lightning_version"]
    assert checkpoint["global_step"] == 1
    assert not {"optimizer_states", "lr_schedulers", "zero_module_buffers", "zero_optimizer_param_groups"} & set(
        checkpoint
    )


@pytest.mark.timeout(60)
def test_unsupported_suffix(mixed, tmp_path, capsys):
    path, _ = mixed
    with pytest.raises(ValueError, match=r"\.safetensors, \.pt, \.bin, \.ckpt"):
        consolidate(path, tmp_path / "model.npz")
    assert zero_to_fp32([str(path), str(tmp_path / "model.h5")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ".safetensors" in err and "model.h5" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_failed_consolidation_keeps_the_previous_output(mixed, tmp_path):
    path, _state = mixed
    out = consolidate(path, tmp_path / "model.pt", progress=False)
    previous = out.read_bytes()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / MANIFEST_NAME).write_text(json.dumps({"format_version": 1}))
    with pytest.raises(CheckpointError, match="malformed manifest"):
        consolidate(broken, out, progress=False)
    assert out.read_bytes() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "model.pt"]


@pytest.mark.timeout(60)
def test_hyper_parameter_objects_need_the_unsafe_flag(tmp_path, capsys):
    torch.manual_seed(0)
    _save_one_rank(Mixed(), tmp_path / "ck", {**trainer_state(1), "hyper_parameters": {"tokenizer": Opaque(3)}})
    out = tmp_path / "model.ckpt"
    with pytest.raises(CheckpointError, match="weights_only"):
        consolidate(tmp_path / "ck", out, progress=False)
    assert zero_to_fp32([str(tmp_path / "ck"), str(out), "--no-progress"]) == 2
    assert "--unsafe-trainer-state" in capsys.readouterr().err
    assert not out.exists()
    assert zero_to_fp32([str(tmp_path / "ck"), str(out), "--no-progress", "--unsafe-trainer-state"]) == 0
    assert torch.load(out, weights_only=False)["hyper_parameters"]["tokenizer"].value == 3


@pytest.mark.timeout(60)
def test_progress_bar_only_for_large_checkpoints(mixed, tmp_path, capfd, monkeypatch):
    path, _ = mixed
    consolidate(path, tmp_path / "a.safetensors", progress=True)  # small, stderr is not a terminal: quiet
    assert capfd.readouterr().err == ""
    monkeypatch.setattr(consolidate_module, "PROGRESS_MIN_BYTES", 0)
    consolidate(path, tmp_path / "b.safetensors", progress=True)
    assert "zero-to-fp32" in capfd.readouterr().err
    consolidate(path, tmp_path / "c.safetensors", progress=False)
    assert capfd.readouterr().err == ""


@pytest.mark.timeout(90)
def test_cli_outputs_load_without_zero_strategy(tied_2ranks, tmp_path, capsys):
    path, state = tied_2ranks
    assert zero_to_fp32([str(path), str(tmp_path / "m.safetensors")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m.safetensors")
    assert zero_to_fp32([str(path), str(tmp_path / "m.pt"), "--no-progress"]) == 0
    check = textwrap.dedent(
        f"""
        import sys
        sys.modules["zero_strategy"] = None  # any import of it now fails
        import torch
        from safetensors.torch import load_file
        a = load_file({str(tmp_path / "m.safetensors")!r})
        b = torch.load({str(tmp_path / "m.pt")!r}, weights_only=True)
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
        assert not any(name.startswith("zero_strategy") for name in sys.modules if sys.modules[name] is not None)
        print(len(a))
        """
    )
    loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == str(len(state))


RSS_DRIVER = """
import json, sys
from zero_strategy.checkpoint.export.consolidate import consolidate
from zero_strategy.process_memory import reset_peak, status_bytes

def rss_mib(field):
    return status_bytes(field) / 2**20

reset_peak()
base = rss_mib("VmRSS")
consolidate(sys.argv[1], sys.argv[2] + ".safetensors", progress=False)
streamed = rss_mib("VmHWM")
reset_peak()
base_pt = rss_mib("VmRSS")
consolidate(sys.argv[1], sys.argv[2] + ".pt", progress=False)
print(json.dumps({"base": base, "streamed": streamed, "base_pt": base_pt, "in_memory": rss_mib("VmHWM")}))
"""


class Wide(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))


@pytest.mark.timeout(90)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak-RSS reset through /proc is Linux-only")
def test_streamed_consolidation_memory_stays_far_below_the_model_size(tmp_path):
    """64 MiB of parameters, none larger than 1 MiB: writing .safetensors raises the peak RSS by a fixed ~10 MiB
    (lazy initialisation, buffers) plus about one tensor, far less than the model; a .pt (built in memory) raises
    it by at least the model, which shows the probe can see such growth."""
    model = Wide(64, 512)
    engine = ZeroEngine(model, [], ZeroConfig(stage=3, min_unit_numel=2**18))
    save_sharded(engine, tmp_path / "ck", {"global_step": 0}, INFO)
    model_mib = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    run = subprocess.run(
        [sys.executable, "-c", RSS_DRIVER, str(tmp_path / "ck"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert run.returncode == 0, run.stderr
    rss = json.loads(run.stdout)
    streamed, in_memory = rss["streamed"] - rss["base"], rss["in_memory"] - rss["base_pt"]
    assert streamed < 0.4 * model_mib, (
        f"streaming raised the peak by {streamed:.1f} MiB for a {model_mib:.0f} MiB model"
    )
    assert in_memory > 0.9 * model_mib, rss
