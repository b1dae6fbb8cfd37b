"""The main job: train the character-level GPT on the bundled corpus with a ZeRO strategy.

Run from anywhere (configs live in ``conf/``, schemas in ``examples/schema.py``)::

    python examples/train.py                                   # zero3 on 2 CPU processes, about a minute
    python examples/train.py strategy=zero1 trainer.devices=4 trainer.max_steps=100
    python examples/train.py strategy=zero2_spawn trainer.accumulate_grad_batches=2

Every setting is checked before the Trainer exists: types and key names by Hydra while it composes, values by the
library's dataclasses here, so a bad override ends with one line naming the key rather than a traceback from
every rank.

[Note: Hydra and the popen launcher]
With ``start_method="popen"`` Lightning starts ranks 1..N-1 by re-running this script with the same overrides.
When Hydra is initialised it appends ``hydra.run.dir=<rank 0's run dir>`` and ``hydra.output_subdir=null``, so
every rank shares rank 0's output directory and only rank 0 writes the ``.hydra/`` config record; each rank
writes its own ``<job name>.log`` there. Nothing in this script depends on the working directory
(``hydra.job.chdir`` stays off). Sweeps (``-m``) need the ``_spawn`` strategies: a re-run rank would repeat the
whole sweep.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import NoReturn

# `python examples/train.py` puts examples/ on sys.path; the modules import each other as `examples.*`.
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.utils import to_absolute_path  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from lightning.pytorch.utilities import rank_zero_only  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

import zero_strategy  # noqa: E402
from examples.data import CharDataModule  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from examples.run_summary import MeasureRun, append_summary  # noqa: E402
from examples.schema import StrategyName, StrategySchema, register_schemas  # noqa: E402
from zero_strategy.config import ZeroConfig  # noqa: E402

BUNDLED_CORPUS = REPO_ROOT / "examples" / "data" / "corpus.txt"

register_schemas()


def fail(group: str, message: str) -> NoReturn:
    """Exit with status 1 and one line naming the offending key, e.g. ``error: strategy.stage=7 is not ...``."""
    # The library's and GPTConfig's messages start with `key=value` when they concern one key.
    qualified = f"{group}.{message}" if re.match(r"[A-Za-z_]\w*=", message) else f"{group}: {message}"
    raise SystemExit(f"error: {qualified}")


def check_strategy(cfg: DictConfig) -> tuple[StrategyName, ZeroConfig]:
    """Validate the ``strategy`` group with the library's own :class:`ZeroConfig` (a bad value exits with one line)."""
    try:
        # Instantiating the schema runs ZeroConfig.__post_init__, the library's own validation.
        schema: StrategySchema = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except ValueError as error:  # ZeroConfigError is one
        fail("strategy", str(error))
    name = schema.name
    zero_config = ZeroConfig(**{f.name: getattr(schema, f.name) for f in fields(ZeroConfig)})
    if name.is_deepspeed:
        if not schema.config:
            fail("strategy", "config=<path of a DeepSpeed JSON config> is required with strategy=deepspeed.")
        return name, zero_config
    if schema.config is not None:
        fail("strategy", f"config={schema.config!r} is only read with strategy=deepspeed.")
    if zero_config.zero_stage is not name.stage:
        fail(
            "strategy",
            f"stage={zero_config.stage} contradicts strategy.name={name.value}; "
            f"pick the stage with strategy=zero{zero_config.stage}.",
        )
    return name, zero_config


def build_strategy(
    name: StrategyName, zero_config: ZeroConfig, cfg: DictConfig, precision: zero_strategy.ZeroPrecision
) -> zero_strategy.ZeroStrategy:
    """``ZeroStrategy(stage=..., start_method=..., **options)`` from a validated config, or from a DeepSpeed
    config with ``strategy=deepspeed strategy.config=ds_config.json``."""
    if name.is_deepspeed:
        from zero_strategy.deepspeed_import import DeepSpeedConfigError

        try:
            return zero_strategy.ZeroStrategy.from_deepspeed_config(
                to_absolute_path(cfg.strategy.config), start_method=name.start_method
            )
        except (DeepSpeedConfigError, ValueError) as error:
            fail("strategy", f"config: {error}")
    options = {f.name: getattr(zero_config, f.name) for f in fields(zero_config) if f.name != "stage"}
    return zero_strategy.ZeroStrategy(
        stage=zero_config.stage, start_method=name.start_method, precision_plugin=precision, **options
    )


def build_precision(cfg: DictConfig) -> zero_strategy.ZeroPrecision:
    """``ZeroPrecision`` from the ``precision`` group (a bad value exits with one line naming the key)."""
    try:
        return zero_strategy.ZeroPrecision(**OmegaConf.to_container(cfg.precision))  # type: ignore[arg-type]
    except ValueError as error:
        fail("precision", str(error))


def build_data(cfg: DictConfig) -> CharDataModule:
    """The data module; ``data.path: null`` is the bundled corpus, a relative path is taken from the start dir."""
    path = BUNDLED_CORPUS if cfg.data.path is None else Path(to_absolute_path(cfg.data.path))
    if not path.is_file():
        fail("data", f"path={str(path)!r} is not a file.")
    try:
        return CharDataModule(
            path=path,
            block_size=cfg.data.block_size,
            batch_size=cfg.data.batch_size,
            val_fraction=cfg.data.val_fraction,
            num_workers=cfg.data.num_workers,
        )
    except ValueError as error:
        fail("data", str(error))


def build_model_config(cfg: DictConfig, vocab_size: int) -> GPTConfig:
    """``GPTConfig`` from the ``model`` group, with ``vocab_size`` taken from the data."""
    if not OmegaConf.is_missing(cfg.model, "vocab_size") and cfg.model.vocab_size != vocab_size:
        fail(
            "model", f"vocab_size={cfg.model.vocab_size} is set, but the corpus has {vocab_size} characters; unset it."
        )
    model_cfg = cfg.model.copy()
    model_cfg.vocab_size = vocab_size
    try:
        config: GPTConfig = OmegaConf.to_object(model_cfg)  # type: ignore[assignment]
    except ValueError as error:
        fail("model", str(error))
    if cfg.data.block_size > config.block_size:
        fail("data", f"block_size={cfg.data.block_size} exceeds model.block_size={config.block_size}.")
    return config


@rank_zero_only
def say(message: str) -> None:
    """Print on global rank 0 only (every rank runs this script)."""
    print(message, flush=True)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Validate, build, fit, then report the final validation loss and perplexity."""
    name, zero_config = check_strategy(cfg.strategy)
    precision = build_precision(cfg)
    seed_everything(cfg.seed, workers=True)
    data = build_data(cfg)
    model = GPT(build_model_config(cfg, data.vocab_size))
    say(f"GPT: {model.num_parameters() / 1e6:.2f} M parameters, vocab {data.vocab_size}; strategy {name.value}")
    run_dir = HydraConfig.get().runtime.output_dir
    trainer = Trainer(
        strategy=build_strategy(name, zero_config, cfg, precision),
        default_root_dir=run_dir,
        callbacks=[MeasureRun(run_dir)],
        **OmegaConf.to_container(cfg.trainer),  # type: ignore[arg-type]
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    fit_s = time.perf_counter() - start
    metrics = trainer.validate(model, datamodule=data, verbose=False)[0]
    say(f"fit: {fit_s:.1f} s, {cfg.trainer.devices * cfg.trainer.num_nodes} rank(s)")
    say(f"final val_loss={metrics['val_loss']:.4f} val_ppl={metrics['val_ppl']:.3f}")
    if trainer.is_global_zero:
        # one row per run; in a sweep (-m) the rows of all runs share the sweep directory's summary.md
        hydra_cfg = HydraConfig.get()
        multirun = hydra_cfg.mode is not None and hydra_cfg.mode.name == "MULTIRUN"
        summary_dir = Path(hydra_cfg.sweep.dir) if multirun else Path(run_dir)
        label = ",".join(hydra_cfg.overrides.task) or "defaults"
        table = append_summary(summary_dir, Path(run_dir), label, metrics["val_loss"], metrics["val_ppl"])
        say(f"summary: {table}")


if __name__ == "__main__":
    main()
