"""``zero-to-fp32 CHECKPOINT OUTPUT`` (also ``python -m zero_strategy.checkpoint``): consolidate a sharded
checkpoint directory (or convert a plain torch / Lightning checkpoint file) into one fp32 file. Exit status 0 on
success, 2 on a damaged or unusable checkpoint or an unsupported output name, 1 when the output cannot be written
(one line on stderr saying which file and what is wrong)."""

from __future__ import annotations

import argparse
import sys

from zero_strategy.checkpoint.consolidate import ACCEPTED_SUFFIXES, PROGRESS_MIN_BYTES, consolidate
from zero_strategy.checkpoint.format import CheckpointError

EXIT_BAD_CHECKPOINT = 2
EXIT_IO_ERROR = 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zero-to-fp32",
        description=(
            "Consolidate a zero_strategy sharded checkpoint directory (any world size and ZeRO stage) into one "
            "file holding the LightningModule's full state_dict: parameters in fp32, buffers in their own dtype. "
            "The output needs only torch / safetensors to load. A plain Lightning / torch checkpoint file is "
            "converted the same way (floating-point tensors to fp32)."
        ),
    )
    parser.add_argument(
        "checkpoint",
        help="the sharded checkpoint directory (e.g. checkpoints/last.ckpt), or a plain Lightning / torch file",
    )
    parser.add_argument(
        "output",
        help=(
            f"the file to write; its suffix picks the format: {ACCEPTED_SUFFIXES[0]} (streamed, memory near the "
            "largest tensor), .pt/.bin (torch.save'd state_dict), .ckpt (Lightning checkpoint without optimizer "
            "state, for YourModule.load_from_checkpoint)"
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        written = consolidate(
            args.checkpoint,
            args.output,
            progress=not args.no_progress,
            weights_only=not args.unsafe_trainer_state,
        )
    except (CheckpointError, ValueError) as error:
        message = " ".join(str(error).split())  # one line, whatever the message's own line breaks
        if isinstance(error, CheckpointError) and "weights_only=True" in message:
            message += " With zero-to-fp32: --unsafe-trainer-state."
        print(f"zero-to-fp32: error: {message}", file=sys.stderr)
        return EXIT_BAD_CHECKPOINT
    except OSError as error:  # the output could not be written (permissions, disk full, ...)
        print(f"zero-to-fp32: error: cannot write {args.output}: {error}", file=sys.stderr)
        return EXIT_IO_ERROR
    print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
