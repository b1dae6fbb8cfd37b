"""``zero-to-fp32 CHECKPOINT OUTPUT`` (also ``python -m zero_strategy.checkpoint``): consolidate a sharded
checkpoint directory (or convert a plain torch / Lightning checkpoint file) into one fp32 file; ``zero-to-fp32
CHECKPOINT --hf OUT_DIR --hf-config CONFIG`` writes a Hugging Face model directory instead. Exit status 0 on
success, 2 on a damaged or unusable checkpoint or an unusable argument (output name, config, key map, existing
directory), 1 when the output cannot be written (one line on stderr saying which file and what is wrong)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zero_strategy.checkpoint.base.format import CheckpointError
from zero_strategy.checkpoint.export.consolidate import ACCEPTED_SUFFIXES, PROGRESS_MIN_BYTES, consolidate
from zero_strategy.checkpoint.export.hf_export import consolidate_hf
from zero_strategy.checkpoint.export.hf_layout import DEFAULT_MAX_SHARD_SIZE, KeyMap

EXIT_BAD_CHECKPOINT = 2
EXIT_IO_ERROR = 1
# Options that only mean something for a Hugging Face directory: given without --hf they are an error, not ignored.
_HF_ONLY = ("hf_config", "max_shard_size", "strip_prefix", "rename", "drop", "no_name_check")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zero-to-fp32",
        description=(
            "Consolidate a zero_strategy sharded checkpoint directory (any world size and ZeRO stage) into one "
            "file holding the LightningModule's full state_dict: parameters in fp32, buffers in their own dtype. "
            "The output needs only torch / safetensors to load. A plain Lightning / torch checkpoint file is "
            "converted the same way (floating-point tensors to fp32). With --hf, write a Hugging Face model "
            "directory that from_pretrained loads."
        ),
    )
    parser.add_argument(
        "checkpoint",
        help="the sharded checkpoint directory (e.g. checkpoints/last.ckpt), a DeepSpeed ZeRO checkpoint directory "
        "(its engine, Lightning DeepSpeedStrategy or universal layout), or a plain Lightning / torch file",
    )
    parser.add_argument(
        "output",
        nargs="?",
        help=(
            f"the file to write (not with --hf); its suffix picks the format: {ACCEPTED_SUFFIXES[0]} (streamed, "
            "memory near the largest tensor), .pt/.bin (torch.save'd state_dict), .ckpt (Lightning checkpoint "
            "without optimizer state, for YourModule.load_from_checkpoint)"
        ),
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help=f"no progress bar (shown by default when parameters exceed {PROGRESS_MIN_BYTES // 2**20} MiB or "
        "stderr is a terminal)",
    )
    parser.add_argument(
        "--unsafe-trainer-state",
        action="store_true",
        help="unpickle the trainer state in full (weights_only=False): only for a checkpoint you trust whose "
        "hyper-parameters hold objects",
    )
    _add_hf_arguments(parser.add_argument_group("Hugging Face directory (--hf)"))
    return parser


def _add_hf_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--hf",
        metavar="OUT_DIR",
        help="write a Hugging Face model directory (config.json + model.safetensors, or shards and "
        "model.safetensors.index.json); OUT_DIR must not exist or be empty",
    )
    group.add_argument(
        "--hf-config",
        metavar="PATH",
        help="the model's config.json, or the directory holding it (required with --hf: from_pretrained needs it)",
    )
    group.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help=f"largest weights file, e.g. 500MB or 2GiB (default {DEFAULT_MAX_SHARD_SIZE}); a larger model is "
        "split into model-0000k-of-0000n.safetensors files and an index",
    )
    group.add_argument(
        "--strip-prefix",
        metavar="PREFIX",
        help="remove PREFIX from every key: the attribute holding the Hugging Face model in the LightningModule, "
        "e.g. 'model.' for self.model (a key without it is an error: see --drop). Not given: when exactly one "
        "prefix makes every name fit the model the config builds, it is stripped (and said on stderr)",
    )
    group.add_argument(
        "--rename",
        metavar="OLD=NEW",
        action="append",
        default=[],
        help="replace the key prefix OLD by NEW (after --strip-prefix); repeatable, the longest OLD matching wins",
    )
    group.add_argument(
        "--drop",
        metavar="PREFIX",
        action="append",
        default=[],
        help="leave out keys starting with PREFIX (modules of the LightningModule that are not part of the "
        "Hugging Face model); repeatable",
    )
    group.add_argument(
        "--no-name-check",
        action="store_true",
        default=None,
        help="do not check the names written against the model the config builds (by default a name that fits "
        "none of its parameters is refused: from_pretrained would leave that weight at its random initial value)",
    )


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.hf is None:
        given = [f"--{name.replace('_', '-')}" for name in _HF_ONLY if getattr(args, name) not in (None, [])]
        if given:
            parser.error(f"{', '.join(given)} only apply with --hf OUT_DIR")
        if args.output is None:
            parser.error("give the OUTPUT file to write, or --hf OUT_DIR for a Hugging Face directory")
    elif args.output is not None:
        parser.error(f"give either the OUTPUT file ({args.output}) or --hf OUT_DIR, not both")


def _key_map(args: argparse.Namespace) -> KeyMap:
    rename: dict[str, str] = {}
    for rule in args.rename:
        old, sep, new = rule.partition("=")
        if not sep:
            raise ValueError(f"--rename {rule!r}: write OLD=NEW (e.g. --rename backbone.=transformer.)")
        rename[old] = new
    return KeyMap(strip_prefix=args.strip_prefix or "", rename=rename, drop=tuple(args.drop))


def _run(args: argparse.Namespace) -> Path:
    if args.hf is None:
        return consolidate(
            args.checkpoint, args.output, progress=not args.no_progress, weights_only=not args.unsafe_trainer_state
        )
    return consolidate_hf(
        args.checkpoint,
        args.hf,
        args.hf_config,
        key_map=_key_map(args),
        max_shard_size=args.max_shard_size or DEFAULT_MAX_SHARD_SIZE,
        progress=not args.no_progress,
        weights_only=not args.unsafe_trainer_state,
        check_names=not args.no_name_check,
        note=lambda message: print(f"zero-to-fp32: note: {message}", file=sys.stderr),
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_arguments(parser, args)
    try:
        written = _run(args)
    except (CheckpointError, ValueError) as error:
        message = " ".join(str(error).split())  # one line, whatever the message's own line breaks
        if isinstance(error, CheckpointError) and "weights_only=True" in message:
            message += " With zero-to-fp32: --unsafe-trainer-state."
        print(f"zero-to-fp32: error: {message}", file=sys.stderr)
        return EXIT_BAD_CHECKPOINT
    except OSError as error:  # the output could not be written (permissions, disk full, ...)
        print(f"zero-to-fp32: error: cannot write {args.hf or args.output}: {error}", file=sys.stderr)
        return EXIT_IO_ERROR
    print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
