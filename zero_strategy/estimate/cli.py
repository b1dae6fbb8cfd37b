"""The ``zero-estimate`` front end: command-line parsing and the GiB tables (the optional chart: :mod:`.chart`).

Apart from :mod:`zero_strategy.estimate.memory` so the arithmetic stays small and importable on its own.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

from torch import nn

from zero_strategy.core.plan.topology import Topology
from zero_strategy.estimate.chart import plot_estimates, require_matplotlib
from zero_strategy.estimate.fit import GPTFamily, Largest, Machine, Peaks, compare_peaks, largest_fitting, parse_family
from zero_strategy.estimate.memory import CONFIGURATIONS, OPTIMIZER_STATE_BYTES, MemoryEstimate
from zero_strategy.estimate.model_spec import load_model
from zero_strategy.estimate.network import estimate_traffic, format_traffic

GiB = 2**30
_SIZES = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
_COUNTS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
EXAMPLE = "zero-estimate --params 65e9 --world-size 8 --precision bf16-mixed --device-memory 80GB"


# ------------------------------------------------------------------------------------------------------ input
def _parse_with(text: str, table: dict[str, int], what: str) -> float:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in table:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return float(match.group(1)) * table[match.group(2)]


def parse_bytes(text: str) -> float:
    """``"80GB"`` (10⁹ bytes, the safe reading of a GPU's label), ``"80GiB"`` (2³⁰), ``"1.5TB"``, or bytes."""
    return _parse_with(text, _SIZES, "a size such as 80GB, 80GiB or 1.5TB")


def parse_count(text: str) -> int:
    """``"7e9"``, ``"7B"``, ``"350M"``."""
    return int(_parse_with(text, _COUNTS, "a parameter count such as 7e9, 7B or 350M"))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zero-estimate",
        description="Per-rank memory of every ZeRO stage with and without offload, and the cheapest that fits.",
        epilog=f"Example, fine-tuning a 65B model on 8 x 80 GB GPUs:  {EXAMPLE}",
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--params", type=parse_count, help="parameter count: 7e9, 7B, 350M")
    what.add_argument("--model", help="package.module:ClassName, constructed with no arguments (or --model-kwargs) "
                      "on the meta device only: its shapes, never its memory")
    parser.add_argument("--model-kwargs", help='JSON keywords for --model, e.g. \'{"n_layers": 24}\'')
    parser.add_argument("--world-size", type=int, default=1, help="ranks (GPUs) in total")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="K",
                        help="tensor-parallel size: each rank holds its 1/K of every Linear and Embedding weight "
                        "(or of --tp-fraction of the parameters) and ZeRO shards over world-size / K ranks")
    parser.add_argument("--tp-fraction", type=float, metavar="F",
                        help="with --tensor-parallel: the share of the parameters split K ways (default: the Linear "
                        "and Embedding weights of --model, all of --params)")
    parser.add_argument("--precision", default="32-true", help="32-true, bf16-mixed or 16-mixed")
    parser.add_argument("--optimizer", default="adamw", help=", ".join(OPTIMIZER_STATE_BYTES))
    parser.add_argument("--device-memory", type=parse_bytes, help="memory of one GPU: 80GB, 40GiB")
    parser.add_argument("--host-memory", type=parse_bytes, help="the same as --ram (either name; both must agree)")
    parser.add_argument("--gpus-per-node", type=int, help="ranks per node (default: min(8, world size))")
    parser.add_argument("--largest-unit-params", type=parse_count, help="elements of the largest unit (a block)")
    parser.add_argument("--root-unit-params", type=parse_count, help="elements of the root unit (embeddings, head)")
    parser.add_argument("--activations", type=parse_bytes, help="activation bytes per rank, if known")
    parser.add_argument("--no-prefetch", action="store_true", help="stage 3 without prefetching the next unit")
    parser.add_argument("--collectives", choices=("auto", "point_to_point"), default="auto",
                        help="CPU ranks: 'auto' gathers and reduces through shared memory (and also prints what "
                             "the network fallback a full /dev/shm causes would need); 'point_to_point' through the "
                             "network only")
    parser.add_argument("--nodes", type=int, help="nodes: also predict bytes per link and communication time per step")
    parser.add_argument("--intra-gbps", type=float, default=100.0, help="bandwidth inside a node, Gbit/s per rank")
    parser.add_argument("--inter-gbps", type=float, default=25.0, help="bandwidth across nodes, Gbit/s per rank")
    parser.add_argument("--ram", type=parse_bytes, help="RAM (host memory) of one node, shared by its ranks; "
                        "without --device-memory the ranks compute on CPUs (their device bytes are RAM)")
    parser.add_argument("--disk", type=parse_bytes, help="free space of the nvme path on one node")
    parser.add_argument("--largest", action="store_true", help="the largest model each configuration fits into "
                        "--ram/--disk/--device-memory (15%% headroom): of --family, else a bare parameter count")
    parser.add_argument("--family", help="with --largest: 'gpt' (width = width_per_layer x layers)")
    parser.add_argument("--family-kwargs", help='JSON for --family, e.g. \'{"width_per_layer": 64, "vocab": 8192, '
                        '"max_seq": 128}\' (defaults 64, 50257, 1024)')
    parser.add_argument("--meta-init", action=argparse.BooleanOptionalAction, default=True,
                        help="set-up of a model built on the meta device (configure_model); default: on. "
                        "--no-meta-init: built eagerly, whole on every rank before the engine shards it")
    parser.add_argument("--plot", metavar="FILE.png", help="stacked bar chart per configuration (needs matplotlib)")
    return parser


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The estimate's keywords from the command line (``--ram`` without ``--device-memory``: CPU ranks)."""
    return {
        "precision": args.precision, "optimizer": args.optimizer, "largest_unit_numel": args.largest_unit_params,
        "root_unit_numel": args.root_unit_params, "prefetch": not args.no_prefetch,
        "activation_bytes": None if args.activations is None else int(args.activations),
        "compute_device": "cpu" if args.ram is not None and args.device_memory is None else "cuda",
        "collectives": args.collectives, "tensor_parallel": args.tensor_parallel, "tp_fraction": args.tp_fraction,
    }  # fmt: skip


def _machine(args: argparse.Namespace) -> Machine:
    ranks = args.gpus_per_node or (min(8, args.world_size) if args.device_memory is not None else args.world_size)
    return Machine(ram=args.ram, disk=args.disk, device_memory=args.device_memory, ranks_per_node=ranks)


def _largest(args: argparse.Namespace) -> str:
    if args.model:
        raise ValueError("--largest searches a family or a parameter count, not one --model: use --family gpt")
    if args.ram is None and args.device_memory is None:
        raise ValueError("--largest needs the machine: --ram (CPU ranks; --disk for nvme) or --device-memory")
    family = parse_family(args.family, json.loads(args.family_kwargs) if args.family_kwargs else None) \
        if args.family else None  # fmt: skip
    options = _options(args)
    if family is not None:  # its shapes give the units; a guess would override them
        options.update(largest_unit_numel=None, root_unit_numel=None)
    machine = _machine(args)
    results = largest_fitting(machine, world_size=args.world_size, family=family, meta_init=args.meta_init,
                              **options)  # fmt: skip
    return format_largest(results, machine, family, args.world_size)


def _one_host_memory(args: argparse.Namespace) -> float | None:
    """``--ram`` and ``--host-memory`` name one setting, the RAM of one node: both tables judge fits by it."""
    if args.ram is not None and args.host_memory is not None and args.ram != args.host_memory:
        raise SystemExit(f"zero-estimate: --ram ({args.ram / GiB:.1f} GiB) and --host-memory "
                         f"({args.host_memory / GiB:.1f} GiB) are the same setting, the RAM of one node shared by "
                         "its ranks, and they disagree: give one of them")
    return args.ram if args.ram is not None else args.host_memory


def main(argv: list[str] | None = None) -> int:
    """``zero-estimate`` (and ``python -m zero_strategy.estimate``): print the table, optionally draw the chart."""
    args = _parser().parse_args(argv)
    args.ram = _one_host_memory(args)
    if args.nodes is not None:
        args.gpus_per_node = args.gpus_per_node or 1
        args.world_size = args.nodes * args.gpus_per_node
    if not args.largest and args.params is None and args.model is None:
        raise SystemExit("zero-estimate: give --params or --model (or --largest with --ram / --device-memory)")
    if args.nodes is not None and args.tensor_parallel > 1:
        raise SystemExit("zero-estimate: --nodes predicts ZeRO's traffic without tensor parallelism; the "
                         "tensor-parallel traffic is not modelled: drop --nodes or --tensor-parallel")
    if args.plot:
        require_matplotlib()  # before the work, so a missing package costs nothing
    try:
        if args.largest:
            print(_largest(args))
            return 0
        subject: nn.Module | float = load_model(args.model, args.model_kwargs) if args.model else args.params
        peaks = compare_peaks(subject, world_size=args.world_size, meta_init=args.meta_init, **_options(args))
    except ValueError as error:
        raise SystemExit(f"zero-estimate: {error}") from None
    estimates = [p.estimate for p in peaks]
    # One machine, one verdict per configuration: the first table's fits column is the second's (its set-up and
    # training peaks against the same RAM, disk and device memory), so the two can never disagree.
    machine = _machine(args) if args.ram is not None or args.device_memory is not None else None
    fits = [machine.fits(p) for p in peaks] if machine is not None else None
    print(format_report(estimates, machine, fits))
    print("\n" + format_peaks(peaks, machine))
    options = _options(args)
    if options["compute_device"] == "cpu" and args.world_size > 1 and args.collectives == "auto":
        # Shared memory is what "auto" prefers, not what it gets: with too little room in /dev/shm the run warns
        # and gathers through the network, each rank then holding the units it gathers itself.
        options["collectives"] = "point_to_point"
        fallback = compare_peaks(subject, world_size=args.world_size, meta_init=args.meta_init, **options)
        print("\nIf /dev/shm lacks room (the run warns, then gathers and reduces through the network), or with "
              "collectives='point_to_point':\n" + format_peaks(fallback, machine))
    if args.nodes is not None:
        count = float(sum(p.numel() for p in subject.parameters())) if isinstance(subject, nn.Module) else subject
        print(_traffic_report(args, count))
    if args.plot:
        plot_estimates(estimates, args.plot, args.device_memory)
        print(f"chart written to {args.plot}")
    return 0


def _traffic_report(args: argparse.Namespace, param_count: float) -> str:
    """Bytes per link and communication time per step, flat and hybrid (one shard group per node), per stage, and
    at stage 3 hierarchical (a secondary parameter copy per node)."""
    topology = Topology.uniform(args.world_size, args.gpus_per_node)
    gathered = 4 if args.precision == "32-true" else 2  # gradients are reduced in fp32 by default
    bandwidth, per_node = (args.intra_gbps, args.inter_gbps), args.nodes > 1 and args.gpus_per_node > 1
    blocks = []
    for stage in (1, 2, 3):
        layouts = [None] + (["node"] if per_node else [])
        rows = [estimate_traffic(param_count, stage, topology, k, bandwidth, (gathered, 4)) for k in layouts]
        if stage == 3 and per_node:
            rows.append(estimate_traffic(param_count, 3, topology, None, bandwidth, (gathered, 4),
                                         hierarchical_params="node"))
        blocks.append(format_traffic(rows, stage))
    return "\n".join(blocks)


# ------------------------------------------------------------------------------------------- peaks, largest
def format_peaks(peaks: Sequence[Peaks], machine: Machine | None) -> str:
    """Set-up and training peak per rank of every configuration (GiB) and, given a machine, whether it fits."""
    on_host = machine is None or machine.device_memory is None
    how = "built on the meta device (configure_model)" if peaks[0].meta_init else "built eagerly on every rank"
    header = ["configuration", "setup dev", "setup host", "train dev", "train host", "nvme", "RAM/rank"]
    rows = []
    for p in peaks:
        cells = [p.estimate.label, _gib(p.setup.device), _gib(p.setup.host), _gib(p.training.device),
                 _gib(p.training.host), _gib(max(p.setup.nvme, p.training.nvme)), _gib(p.ram(on_host))]  # fmt: skip
        rows.append([*cells, "yes" if machine.fits(p) else "no"] if machine is not None else cells)
    if machine is not None:
        header.append("fits")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [f"Set-up and training peak per rank (GiB), model {how}"
             + ("; --no-meta-init for an eager build" if peaks[0].meta_init else "") + ":", "",
             _row(header, widths), _row(["-" * w for w in widths], widths)]  # fmt: skip
    lines += [_row(r, widths) for r in rows]
    if machine is not None:
        lines.append(f"\nfits: {machine.ranks_per_node} ranks x RAM/rank within {1 - machine.headroom:.0%} of the RAM "
                     "(and of the disk for nvme, of the device memory on GPUs)")
    return "\n".join(lines)


def format_largest(results: Sequence[Largest], machine: Machine, family: GPTFamily | None, world_size: int) -> str:
    """The largest model of each configuration that fits the machine."""
    budget = ", ".join(f"{name} {value / GiB:.0f} GiB" for name, value in
                       (("RAM", machine.ram), ("disk", machine.disk), ("device", machine.device_memory)) if value)
    what = (f"GPT family (width = {family.width_per_layer} x layers, vocab {family.vocab})" if family
            else "a bare parameter count (units guessed)")  # fmt: skip
    lines = [f"Largest model per configuration: {what}; {world_size} ranks, {machine.ranks_per_node} per node, "
             f"{budget}, {machine.headroom:.0%} headroom; set-up "
             + ("meta-built" if results[0].peaks is None or results[0].peaks.meta_init else "eager") + ".", ""]
    for result, config in zip(results, CONFIGURATIONS, strict=True):
        label = " ".join([f"zero{config[0]}"] + [f"{w}→{d}" for w, d in (("opt", config[1]), ("param", config[2]))
                                                 if d != "none"])  # fmt: skip
        if result.peaks is None:
            lines.append(f"{label:<28} nothing fits")
            continue
        shape = f" ({result.shape.n_layer} layers, width {result.shape.width})" if result.shape else ""
        p = result.peaks
        # a family member's own count; a bare count under tensor parallelism is one TP rank's part of it
        count = result.shape.num_params if result.shape else p.estimate.num_params
        part = " per TP rank" if result.shape is None and p.estimate.tensor_parallel > 1 else ""
        lines.append(f"{label:<28} {count / 1e9:8.3f} B params{part}{shape}: RAM/rank "
                     f"{_gib(p.ram(machine.device_memory is None))} GiB, nvme/rank "
                     f"{_gib(max(p.setup.nvme, p.training.nvme))} GiB")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- table
def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f}" if nbytes < 10 * GiB else f"{nbytes / GiB:.1f}"


def _row(cells: Sequence[str], widths: Sequence[int]) -> str:
    """The configuration name left-aligned, numbers right-aligned."""
    padded = [cell.rjust(width) for cell, width in zip(cells, widths, strict=True)]
    return "  ".join([cells[0].ljust(widths[0]), *padded[1:]])


def describe_machine(machine: Machine) -> str:
    """The budget a fits verdict is judged against, in words."""
    if machine.device_memory is not None:
        text = f"{machine.device_memory / 1e9:.0f} GB ({machine.device_memory / GiB:.1f} GiB) per device"
    else:
        text = "CPU ranks"
    node = [f"{name} {value / GiB:.0f} GiB" for name, value in (("RAM", machine.ram), ("disk", machine.disk))
            if value is not None]  # fmt: skip
    if node:
        text += f", {' and '.join(node)} per node shared by {machine.ranks_per_node} ranks"
    return text + f", {machine.headroom:.0%} of each kept free"


def format_table(estimates: Sequence[MemoryEstimate], fits: Sequence[bool] | None = None) -> str:
    """One row per configuration: device bytes by category, then device/host/nvme totals, in GiB per rank; with
    ``fits``, each configuration's verdict (:meth:`Machine.fits` of its peaks)."""
    header = ["configuration", "params", "master", "grads", "optim", "comm", "activ", "DEVICE", "host", "nvme"]
    if fits is not None:
        header.append("fits")
    rows = []
    for index, e in enumerate(estimates):
        cells = [e.label] + [_gib(p.device) for p in e.categories.values()]
        cells += [_gib(e.total.device), _gib(e.total.host), _gib(e.total.nvme)]
        if fits is not None:
            cells.append("yes" if fits[index] else "no")
        rows.append(cells)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [_row(header, widths), _row(["-" * w for w in widths], widths)]
    return "\n".join(lines + [_row(r, widths) for r in rows])


def format_report(
    estimates: Sequence[MemoryEstimate], machine: Machine | None = None, fits: Sequence[bool] | None = None
) -> str:
    """The table, the cheapest configuration that fits ``machine`` (``fits``: one verdict per estimate, from
    :meth:`Machine.fits`), and the assumptions behind the numbers."""
    first = estimates[0]
    tp = first.tensor_parallel
    ranks = f"{first.world_size} ranks" + (f" (tensor parallel {tp} x ZeRO over {first.world_size // tp})" if tp > 1
                                           else "")  # fmt: skip
    per = " per tensor-parallel rank" if tp > 1 else ""
    lines = [
        f"ZeRO memory per rank (GiB): {first.num_params / 1e9:.3g}B parameters{per}, {ranks}, "
        f"{first.precision}, {first.optimizer}. Columns params..activ are on the device.",
        "",
        format_table(estimates, fits),
        "",
    ]
    if machine is not None and fits is not None:
        budget = describe_machine(machine)
        best = next((e for e, fit in zip(estimates, fits, strict=True) if fit), None)
        if best is None:
            lines.append(f"Nothing fits in {budget}: use more ranks, a smaller model or shorter sequences.")
        else:
            lines.append(f"Smallest that fits in {budget}: {best.label} — device {_gib(best.total.device)} GiB, "
                         f"host {_gib(best.total.host)} GiB, nvme {_gib(best.total.nvme)} GiB per rank.")
        if machine.disk is None and any(e.offload_optimizer == "nvme" for e in estimates):
            lines.append("The nvme configurations need --disk (free space of the nvme path on one node) to fit.")
        lines.append("")
    notes = dict.fromkeys(note for e in estimates for note in e.notes)
    lines.append("Notes:")
    lines += [f"- {note}" for note in notes]
    lines.append("- not included: CUDA context and allocator fragmentation (keep a few GiB spare)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
