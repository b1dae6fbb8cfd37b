"""``zero-to-fp32 CKPT --hf OUT_DIR``: a Hugging Face GPT-2 trained inside a LightningModule under zero3 on 2 ranks
is exported into a directory that ``from_pretrained`` loads with no missing or unexpected key and the logits the
trained module computed in the fit; the sharded layout is the one transformers writes and reads; memory stays near
one tensor; bad inputs are clear errors that leave nothing behind.

References are independent of the export: logits computed by the trained module inside the fit, the key set and
index metadata ``save_pretrained`` writes for the same architecture, transformers' own size parser, and tensors read
back with ``safetensors``."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from safetensors import safe_open
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

transformers = pytest.importorskip("transformers")
from transformers import AutoModel, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel  # noqa: E402

import zero_strategy.checkpoint.export.hf_export as hf_export_module  # noqa: E402
from zero_strategy import ZeroStrategy  # noqa: E402
from zero_strategy.checkpoint.export.cli import main as zero_to_fp32  # noqa: E402
from zero_strategy.checkpoint.export.hf_export import consolidate_hf  # noqa: E402
from zero_strategy.checkpoint.export.hf_layout import HfExportError, KeyMap, parse_size  # noqa: E402
from zero_strategy.checkpoint.sharded.save import SaveInfo, save_sharded  # noqa: E402
from zero_strategy.config import ZeroConfig  # noqa: E402
from zero_strategy.core.engine.engine import ZeroEngine  # noqa: E402

VOCAB, SEQ, STEPS = 100, 12, 4
INFO = SaveInfo("32-true", {}, {"zero_strategy": "test", "torch": torch.__version__})
SMALL_SHARD = "60KB"  # the tiny GPT-2's largest tensor (c_fc, 64 KiB) gets a file of its own, others share


def gpt2_config(**overrides: Any) -> GPT2Config:
    settings: dict[str, Any] = {"vocab_size": VOCAB, "n_positions": 16, "n_embd": 64, "n_layer": 2, "n_head": 4,
                                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0,
                                "eos_token_id": 0}  # fmt: skip
    return GPT2Config(**{**settings, **overrides})


def probe_tokens() -> Tensor:
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(7))


class LitGPT2(pl.LightningModule):
    """A Hugging Face model held as ``self.model``: its state_dict keys are ``model.`` + the model's own."""

    def __init__(self) -> None:
        super().__init__()
        self.model = GPT2LMHeadModel(gpt2_config())

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class SaveAndProbe(pl.Callback):
    """At the end of training, on every rank: save the sharded checkpoint, then compute the probe's logits with the
    trained (stage-3 sharded) module; rank 0 writes them for the test."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.root / "trained.ckpt")
        pl_module.eval()
        with torch.no_grad():
            logits = pl_module.model(input_ids=probe_tokens()).logits
        if trainer.global_rank == 0:
            torch.save(logits, self.root / "fit_logits.pt")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Tensor, Tensor]:
    """(checkpoint, logits of the trained module in the fit, logits of the untrained module)."""
    root = tmp_path_factory.mktemp("gpt2")
    pl.seed_everything(0, verbose=False)
    module = LitGPT2()
    with torch.no_grad():
        initial = module.model.eval()(input_ids=probe_tokens()).logits
    tokens = torch.randint(0, VOCAB, (2 * 4 * STEPS, SEQ), generator=torch.Generator().manual_seed(3))
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=3, start_method="spawn", process_group_timeout_s=60.0),
        accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[SaveAndProbe(root)],
    )  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=4))
    return root / "trained.ckpt", torch.load(root / "fit_logits.pt"), initial


@pytest.fixture
def transformers_warnings() -> Iterator[list[str]]:
    """Warnings transformers logs (missing / unexpected / newly initialized weights are reported this way)."""
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _load(cls: Any, directory: Path) -> Any:
    model, info = cls.from_pretrained(directory, output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.eval()


def _file_keys(directory: Path) -> dict[str, str]:
    """{tensor name: file} read from the safetensors files themselves."""
    keys: dict[str, str] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            assert handle.metadata()["format"] == "pt"  # transformers refuses a file without it
            keys.update((key, file.name) for key in handle.keys())
    return keys


def _save_pretrained(tmp_path: Path, **kwargs: Any) -> Path:
    """What transformers itself writes for the same architecture (values do not matter, names and sizes do)."""
    out = tmp_path / "save_pretrained"
    GPT2LMHeadModel(gpt2_config()).save_pretrained(out, **kwargs)
    return out


def _logits(model: Any) -> Tensor:
    with torch.no_grad():
        return model(input_ids=probe_tokens()).logits


@pytest.mark.timeout(300)
def test_from_pretrained_loads_the_trained_model(trained, tmp_path, capsys, transformers_warnings):
    ckpt, fit_logits, initial_logits = trained
    config_dir = tmp_path / "base"
    gpt2_config().save_pretrained(config_dir)
    out = tmp_path / "hf"
    argv = [str(ckpt), "--hf", str(out), "--hf-config", str(config_dir), "--strip-prefix", "model.", "--no-progress"]
    assert zero_to_fp32(argv) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "hf"], "no temporary directory may remain"
    # the tied head is left out exactly as save_pretrained leaves it out
    assert set(_file_keys(out)) == set(_file_keys(_save_pretrained(tmp_path)))
    assert "lm_head.weight" not in _file_keys(out) and "transformer.wte.weight" in _file_keys(out)

    transformers_warnings.clear()
    model = _load(AutoModelForCausalLM, out)
    assert not transformers_warnings, transformers_warnings
    assert model.lm_head.weight is model.transformer.wte.weight
    logits = _logits(model)
    assert (logits - fit_logits).abs().max().item() <= 1e-6
    assert (logits - initial_logits).abs().max().item() > 1e-2, "the export must hold the trained weights"
    base = _load(AutoModel, out)  # the base model from the same directory (transformers drops the prefix)
    torch.testing.assert_close(base.wte.weight, model.transformer.wte.weight, rtol=0, atol=0)


@pytest.mark.timeout(300)
def test_sharded_directory_and_index(trained, tmp_path):
    ckpt, fit_logits, _ = trained
    out = consolidate_hf(ckpt, tmp_path / "hf", gpt2_config(), key_map=KeyMap(strip_prefix="model."),
                         max_shard_size=SMALL_SHARD, progress=False)  # fmt: skip
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 3 and all(re.fullmatch(rf"model-\d{{5}}-of-{len(files):05d}\.safetensors", f) for f in files)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    stored = _file_keys(out)
    assert index["weight_map"] == stored, "every tensor is in the file the index names, and nothing else is"
    assert sorted(set(index["weight_map"].values())) == files
    reference_dir = _save_pretrained(tmp_path, max_shard_size=SMALL_SHARD)
    reference = json.loads((reference_dir / "model.safetensors.index.json").read_text())
    # total_size in bytes (and, from transformers 5 on, total_parameters), as save_pretrained counts them
    assert "total_size" in reference["metadata"] and reference["metadata"].items() <= index["metadata"].items()
    assert set(index["weight_map"]) == set(reference["weight_map"])
    for file in files:  # a file passes the limit only when it holds a single tensor
        with safe_open(out / file, "pt") as handle:
            sizes = [handle.get_tensor(key).nbytes for key in handle.keys()]
        assert sum(sizes) <= parse_size(SMALL_SHARD) or len(sizes) == 1, (file, sizes)

    single = consolidate_hf(ckpt, tmp_path / "single", tmp_path / "hf" / "config.json",
                            key_map=KeyMap(strip_prefix="model."), progress=False)  # fmt: skip
    with safe_open(single / "model.safetensors", "pt") as whole:
        for key, file in stored.items():
            with safe_open(out / file, "pt") as handle:
                assert torch.equal(handle.get_tensor(key), whole.get_tensor(key)), key
    assert (_logits(_load(AutoModelForCausalLM, out)) - fit_logits).abs().max().item() <= 1e-6


# ------------------------------------------------------------------------------------------------ one-rank saves
class Wrapped(nn.Module):
    """A GPT-2 held as ``model`` next to a buffer that is not part of it (as a loss weight would be)."""

    def __init__(self, **config: Any) -> None:
        super().__init__()
        self.model = GPT2LMHeadModel(gpt2_config(**config))
        self.register_buffer("loss_weight", torch.ones(VOCAB))


def _save_one_rank(module: nn.Module, path: Path) -> Path:
    engine = ZeroEngine(module, [], ZeroConfig(stage=3))
    save_sharded(engine, path, {"global_step": 0}, INFO)
    return path


@pytest.fixture(scope="module")
def wrapped_ckpt(tmp_path_factory) -> tuple[Path, Tensor]:
    torch.manual_seed(0)
    module = Wrapped()
    logits = _logits(module.model.eval())
    return _save_one_rank(module, tmp_path_factory.mktemp("wrapped") / "ck"), logits


@pytest.mark.timeout(120)
def test_untied_config_gets_every_key(tmp_path, transformers_warnings):
    """With ``tie_word_embeddings=False`` the model built from the config has a separate head: both keys are
    written (a tied module's one parameter under both names) and the head loads, not left at its initial values."""
    torch.manual_seed(0)
    module = Wrapped()  # tied, as GPT-2 is by default
    logits = _logits(module.model.eval())
    ckpt = _save_one_rank(module, tmp_path / "ck")
    out = consolidate_hf(ckpt, tmp_path / "hf", gpt2_config(tie_word_embeddings=False),
                         key_map=KeyMap(strip_prefix="model.", drop=("loss_weight",)), progress=False)  # fmt: skip
    assert {"lm_head.weight", "transformer.wte.weight"} <= set(_file_keys(out))
    transformers_warnings.clear()
    model = _load(AutoModelForCausalLM, out)
    assert not transformers_warnings, transformers_warnings
    assert model.lm_head.weight is not model.transformer.wte.weight
    torch.testing.assert_close(model.lm_head.weight, model.transformer.wte.weight, rtol=0, atol=0)
    assert (_logits(model) - logits).abs().max().item() <= 1e-6


@pytest.mark.timeout(120)
def test_keys_outside_the_prefix_are_an_error_until_dropped(wrapped_ckpt, tmp_path, capsys):
    ckpt, logits = wrapped_ckpt
    config = gpt2_config().to_dict()
    with pytest.raises(HfExportError, match=r"no state_dict key starts with the prefix 'transformer\.'.*'model\.'"):
        consolidate_hf(ckpt, tmp_path / "hf", config, key_map=KeyMap(strip_prefix="transformer."))
    with pytest.raises(HfExportError, match=r"'loss_weight'.*--drop loss_weight\."):
        consolidate_hf(ckpt, tmp_path / "hf", config, key_map=KeyMap(strip_prefix="model."), progress=False)
    assert not (tmp_path / "hf").exists()
    out = consolidate_hf(ckpt, tmp_path / "hf", config, key_map=KeyMap(strip_prefix="model.", drop=("loss_weight",)),
                         progress=False)  # fmt: skip
    assert (_logits(_load(AutoModelForCausalLM, out)) - logits).abs().max().item() <= 1e-6
    # the same through the CLI, with a rename on top (a function key map is the Python-only variant)
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = [str(ckpt), "--hf", str(tmp_path / "cli"), "--hf-config", str(tmp_path / "config.json"), "--drop",
            "loss_weight", "--strip-prefix", "model.", "--rename", "transformer.=", "--no-progress"]  # fmt: skip
    assert zero_to_fp32(argv) == 0, capsys.readouterr().err
    assert "wte.weight" in _file_keys(tmp_path / "cli")
    base = _load(AutoModel, tmp_path / "cli")  # GPT2Model's own keys: no "transformer." prefix
    torch.testing.assert_close(base.wte.weight, _load(AutoModel, out).wte.weight, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ bad inputs
# ------------------------------------------------------------------------------- names against the config's model
@pytest.mark.timeout(120)
def test_the_one_prefix_that_fits_is_stripped_and_said(tmp_path, capsys, transformers_warnings):
    """No --strip-prefix for a model held as ``self.model``: the names would fit no parameter of the config's model
    (from_pretrained would load random weights with a warning); the one prefix that makes every name fit is
    stripped, stderr says so, and the directory loads with no missing or unexpected key and the module's logits."""
    torch.manual_seed(0)
    module = nn.ModuleDict({"model": GPT2LMHeadModel(gpt2_config())})
    logits = _logits(module["model"].eval())
    ckpt = _save_one_rank(module, tmp_path / "ck")
    gpt2_config().save_pretrained(tmp_path / "config")
    argv = [str(ckpt), "--hf", str(tmp_path / "hf"), "--hf-config", str(tmp_path / "config"), "--no-progress"]
    assert zero_to_fp32(argv) == 0
    err = capsys.readouterr().err
    assert "note: stripped the prefix 'model.'" in err and "--strip-prefix model." in err, err
    assert "transformer.wte.weight" in _file_keys(tmp_path / "hf")
    transformers_warnings.clear()
    model = _load(AutoModelForCausalLM, tmp_path / "hf")
    assert not [w for w in transformers_warnings if "initialized" in w or "not used" in w], transformers_warnings
    assert (_logits(model) - logits).abs().max().item() <= 1e-6


@pytest.mark.timeout(120)
def test_names_that_fit_nothing_are_refused_naming_the_prefix(wrapped_ckpt, tmp_path, capsys):
    """A key outside every prefix that fits (``loss_weight``), or a config of another architecture: refused before
    anything is written, naming the names, the prefix to strip and what to drop (once dropped, the prefix is found);
    ``check_names=False`` writes."""
    ckpt, logits = wrapped_ckpt
    gpt2_config().save_pretrained(tmp_path / "config")
    argv = [str(ckpt), "--hf", str(tmp_path / "hf"), "--hf-config", str(tmp_path / "config"), "--no-progress"]
    assert zero_to_fp32(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'loss_weight'" in err and "random initial values" in err, err
    assert "--strip-prefix model. --drop loss_weight" in err, err
    assert not (tmp_path / "hf").exists()
    assert zero_to_fp32([*argv, "--drop", "loss_weight"]) == 0  # what is left then fits under one prefix
    assert "note: stripped the prefix 'model.'" in capsys.readouterr().err
    assert (_logits(_load(AutoModelForCausalLM, tmp_path / "hf")) - logits).abs().max().item() <= 1e-6
    (tmp_path / "hf").rename(tmp_path / "hf-dropped")
    bert = {"model_type": "bert", "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 4, "intermediate_size": 37}  # fmt: skip
    key_map = KeyMap(strip_prefix="model.", drop=("loss_weight",))
    with pytest.raises(HfExportError, match=r"fit no parameter or buffer of Bert.*'transformer\.wte\.weight'"):
        consolidate_hf(ckpt, tmp_path / "hf", bert, key_map=key_map, progress=False)
    assert not (tmp_path / "hf").exists()
    out = consolidate_hf(ckpt, tmp_path / "hf", bert, key_map=key_map, progress=False, check_names=False)
    assert "transformer.wte.weight" in _file_keys(out)  # what the caller asked for, unchecked


@pytest.mark.timeout(120)
def test_a_config_transformers_cannot_build_is_written_unchecked_and_said(wrapped_ckpt, tmp_path):
    ckpt, _ = wrapped_ckpt
    notes: list[str] = []
    out = consolidate_hf(ckpt, tmp_path / "hf", {"model_type": "no_such_architecture"}, progress=False,
                         key_map=KeyMap(strip_prefix="model.", drop=("loss_weight",)), note=notes.append)  # fmt: skip
    assert "transformer.wte.weight" in _file_keys(out)
    assert len(notes) == 1 and "not checked" in notes[0] and "no_such_architecture" in notes[0], notes


@pytest.mark.timeout(120)
def test_existing_non_empty_directory_is_refused(wrapped_ckpt, tmp_path, capsys):
    ckpt, _ = wrapped_ckpt
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    config = gpt2_config()
    with pytest.raises(HfExportError, match=r"already exists and is not empty.*remove it or give another path"):
        consolidate_hf(ckpt, out, config, key_map=KeyMap(strip_prefix="model.", drop=("loss_weight",)))
    argv = [str(ckpt), "--hf", str(out), "--hf-config", str(tmp_path), "--no-progress"]
    assert zero_to_fp32(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(out) in err and "not empty" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    (out / "notes.txt").unlink()  # an empty directory is replaced by the export
    consolidate_hf(ckpt, out, config, key_map=KeyMap(strip_prefix="model.", drop=("loss_weight",)), progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.timeout(120)
def test_missing_or_unusable_config_is_refused(wrapped_ckpt, tmp_path, capsys):
    ckpt, _ = wrapped_ckpt
    out = tmp_path / "hf"
    assert zero_to_fp32([str(ckpt), "--hf", str(out), "--strip-prefix", "model.", "--drop", "loss_weight"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json" in err and "--hf-config" in err
    with pytest.raises(HfExportError, match=r"needs config\.json"):
        consolidate_hf(ckpt, out, None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(HfExportError, match=re.escape(f"{tmp_path / 'empty' / 'config.json'} does not exist")):
        consolidate_hf(ckpt, out, tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text('{"n_embd": 64}')
    with pytest.raises(HfExportError, match='no "model_type"'):
        consolidate_hf(ckpt, out, tmp_path / "empty")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(HfExportError, match="not valid JSON"):
        consolidate_hf(ckpt, out, tmp_path / "broken.json")
    with pytest.raises(HfExportError, match="config is a int"):
        consolidate_hf(ckpt, out, 3)  # type: ignore[arg-type]
    assert not out.exists()


def _both_to_head(key: str) -> str:
    return "head" if key in ("loss_weight", "model.lm_head.weight") else key


@pytest.mark.timeout(120)
def test_key_map_giving_two_keys_one_name_is_refused(wrapped_ckpt, tmp_path, capsys):
    ckpt, _ = wrapped_ckpt
    clash = KeyMap(strip_prefix="model.", drop=("loss_weight",), rename={"transformer.h.1.": "transformer.h.0."})
    with pytest.raises(HfExportError, match=r"'model\.transformer\.h\.0\.\S+', 'model\.transformer\.h\.1\.\S+' all "
                                            r"become 'transformer\.h\.0\.\S+'"):  # fmt: skip
        consolidate_hf(ckpt, tmp_path / "hf", gpt2_config(), key_map=clash)
    with pytest.raises(HfExportError, match=r"'loss_weight', 'model\.lm_head\.weight' all become 'head'"):
        consolidate_hf(ckpt, tmp_path / "hf", gpt2_config(), key_map=_both_to_head)
    argv = [str(ckpt), "--hf", str(tmp_path / "hf"), "--hf-config", str(tmp_path), "--drop", "loss_weight",
            "--rename", "model.transformer.ln_f.=x.", "--rename", "model.transformer.wpe.=x."]  # fmt: skip
    (tmp_path / "config.json").write_text(gpt2_config().to_json_string())
    assert zero_to_fp32(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'x.weight'" in err and "model.transformer.wpe.weight" in err
    with pytest.raises(HfExportError, match="empty prefix would drop every key"):
        KeyMap(drop=("",))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"], "nothing written, no temporary left"


@pytest.mark.timeout(120)
def test_failure_while_writing_leaves_nothing(wrapped_ckpt, tmp_path, monkeypatch):
    ckpt, _ = wrapped_ckpt
    real = hf_export_module.write_safetensors
    calls: list[Path] = []

    def fail_on_third_file(path: Path, *args: Any) -> int:
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full (simulated)")
        return real(path, *args)

    monkeypatch.setattr(hf_export_module, "write_safetensors", fail_on_third_file)
    with pytest.raises(OSError, match="simulated"):
        consolidate_hf(ckpt, tmp_path / "hf", gpt2_config(), max_shard_size=SMALL_SHARD,
                       key_map=KeyMap(strip_prefix="model.", drop=("loss_weight",)), progress=False)  # fmt: skip
    assert len(calls) == 3 and calls[0].parent.name.startswith(".hf.tmp-")
    assert list(tmp_path.iterdir()) == []


def test_option_combinations_the_cli_refuses(tmp_path):
    for argv in (["ck", "out.safetensors", "--strip-prefix", "model."], ["ck", "out.safetensors", "--hf", "dir"],
                 ["ck"], ["ck", "out.pt", "--hf-config", "c.json"]):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            zero_to_fp32(argv)
        assert exit_info.value.code == 2, argv
    assert zero_to_fp32([str(tmp_path), "--hf", str(tmp_path / "o"), "--hf-config", "c", "--rename", "x"]) == 2


@pytest.mark.parametrize("size", ["500MB", "5GB", "2GiB", "64KiB", "3KB", 12345, "7mib"])
def test_sizes_read_as_transformers_reads_them(size):
    from transformers.utils.hub import convert_file_size_to_int

    assert parse_size(size) == convert_file_size_to_int(size)
    assert parse_size(str(convert_file_size_to_int(size))) == convert_file_size_to_int(size)  # plain bytes too


@pytest.mark.parametrize(("size", "problem"), [("5 gigs", "not a size"), ("1.5GB", "not a size"),
                                               ("0", "must be positive"), ("5Gb", "bits"), ("500mb", "bits")])
def test_unreadable_sizes_are_refused(size, problem):
    with pytest.raises(HfExportError, match=problem):
        parse_size(size)


# ------------------------------------------------------------------------------------------------ memory
RSS_DRIVER = """
import json, sys
from zero_strategy.checkpoint.export.consolidate import consolidate
from zero_strategy.checkpoint.export.hf_export import consolidate_hf
from zero_strategy.process_memory import reset_peak, status_bytes

def rss_mib(field):
    return status_bytes(field) / 2**20

config = {"model_type": "gpt2"}
# check_names=False: the layers are no GPT-2 (the config is only there to be copied)
consolidate_hf(sys.argv[1], sys.argv[3] + "/warm", config, progress=False, check_names=False)  # lazy initialisation
reset_peak()
base = rss_mib("VmRSS")
consolidate_hf(sys.argv[2], sys.argv[3] + "/hf", config, max_shard_size="40MB", progress=False, check_names=False)
streamed = rss_mib("VmHWM")
reset_peak()
base_pt = rss_mib("VmRSS")
consolidate(sys.argv[2], sys.argv[3] + "/model.pt", progress=False)
print(json.dumps({"streamed": streamed - base, "in_memory": rss_mib("VmHWM") - base_pt}))
"""


class Layers(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak-RSS reset through /proc is Linux-only")
def test_export_holds_about_one_tensor(tmp_path):
    """64 MiB of parameters in four 16 MiB tensors, exported into two files: the peak RSS rises by about one
    tensor (holding two, e.g. the previous one while the next is read, would be 32 MiB); consolidating the same
    checkpoint to .pt (built in memory) rises by the model, which shows the probe sees such growth. glibc is told
    to map every allocation above 64 KiB on its own, so freed tensors leave the RSS at once."""
    largest_mib, model_mib = 16.0, 64.0
    _save_one_rank(Layers(4, 2048), tmp_path / "big")
    _save_one_rank(Layers(2, 8), tmp_path / "small")
    run = subprocess.run(
        [sys.executable, "-c", RSS_DRIVER, str(tmp_path / "small"), str(tmp_path / "big"), str(tmp_path)],
        capture_output=True, text=True, timeout=100, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    rss = json.loads(run.stdout)
    print(f"peak RSS rise: --hf export {rss['streamed']:.1f} MiB, .pt {rss['in_memory']:.1f} MiB")  # README figure
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) == 2
    assert rss["streamed"] < 1.25 * largest_mib, f"{rss['streamed']:.1f} MiB for {largest_mib:.0f} MiB tensors"
    assert rss["in_memory"] > 0.9 * model_mib, rss
