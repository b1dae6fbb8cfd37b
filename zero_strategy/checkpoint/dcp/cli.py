"""``zero-to-dcp CHECKPOINT OUTPUT``: rewrite a zero_strategy sharded checkpoint directory as a
``torch.distributed.checkpoint`` directory (FSDP2, torchtitan, Lightning's ModelParallelStrategy read that format).
One process, no GPU, memory near one tensor. Exit status 0 on success, 2 on a damaged or unusable checkpoint or
an output it must not overwrite, 1 when the output cannot be written (one line on stderr saying what is wrong)."""

from __future__ import annotations

import argparse
import sys

from zero_strategy.checkpoint.base.format import CheckpointError
from zero_strategy.checkpoint.dcp.export import export_to_dcp

EXIT_BAD_CHECKPOINT = 2
EXIT_IO_ERROR = 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zero-to-dcp",
        description=(
            "Rewrite a zero_strategy sharded checkpoint directory (any world size and ZeRO stage) as a "
            "torch.distributed.checkpoint (DCP) directory, without gathering: each rank's slices become boxes of "
            "the tensors. Keys: model.<state_dict key> (fp32 masters, buffers), optim.state.<fqn>.<name> and "
            "optim.param_groups (as torch's get_optimizer_state_dict), zero_strategy.trainer_state. FSDP2 loads "
            "it with dcp.load({'model': ..., 'optim': ...}) at any world size. A DeepSpeed ZeRO checkpoint "
            "directory (stage 1/2/3, its engine, Lightning or universal layout) is accepted too."
        ),
    )
    parser.add_argument(
        "checkpoint", help="the sharded checkpoint directory (e.g. checkpoints/last.ckpt), or a DeepSpeed one"
    )
    parser.add_argument(
        "output", help="the DCP directory to write: must not exist, be empty, or be a DCP checkpoint (replaced)"
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
        written = export_to_dcp(args.checkpoint, args.output, weights_only=not args.unsafe_trainer_state)
    except CheckpointError as error:
        message = " ".join(str(error).split())
        if "weights_only=True" in message:
            message += " With zero-to-dcp: --unsafe-trainer-state."
        print(f"zero-to-dcp: error: {message}", file=sys.stderr)
        return EXIT_BAD_CHECKPOINT
    except OSError as error:
        print(f"zero-to-dcp: error: cannot write {args.output}: {error}", file=sys.stderr)
        return EXIT_IO_ERROR
    print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
