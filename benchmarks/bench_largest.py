"""The largest model this machine trains: peak resident memory per rank of set-up and training, by method and size,
beside ``zero-estimate``'s prediction, and the largest model each method fits into the machine's RAM (and disk).

    python -m benchmarks.bench_largest --sizes 50m,150m --reps 1

One GPT family (``benchmarks/bench_model.py``'s model, width = 64 × layers, vocab 8192), AdamW, 2 gloo ranks on
CPUs, batch 1 × 16 tokens. Methods: ``ddp`` (eager build), ``fsdp2`` (``fully_shard`` per block and the root on a
meta-device model, then ``to_empty`` + ``reset_parameters``), ``zero3`` and ``zero3_offload_nvme`` (built under
``record_construction`` and materialized by the engine, nvme files under a temporary directory). DeepSpeed ZeRO-3
with ``zero.Init`` runs where DeepSpeed is installed (``DS_ACCELERATOR=cpu``), else it is listed as skipped.

[Note: what the benchmark measures]
Each (size, method) runs in a fresh interpreter (a forked child of a long-lived process would inherit its heap)
whose two ranks fix glibc's mmap threshold (freed buffers go back to the system, so RSS tracks live memory), run one
tiny warm-up step (libtorch's code pages), then take the pre-model RSS as the baseline and reset ``VmHWM``
(/proc/self/clear_refs). Set-up peak: ``VmHWM`` above the baseline from building the model to the end of the
method's set-up. Training peak: ``VmHWM`` reset after set-up, read after 2 steps, above the same baseline (so it
includes the model state resident from set-up). For nvme the mapped file pages are released after set-up (as
``load_pretrained`` and every gather do) and the files' allocated bytes are read after training. The larger of the
two ranks is reported.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.bench_model import BenchGPT, ModelShape, lm_loss, parameter_count, rank_batches, warm_up_kernels
from zero_strategy.estimate.fit import GPTFamily, Machine, Peaks, compare_peaks, largest_fitting
from zero_strategy.process_memory import reset_peak, status_bytes

FAMILY = GPTFamily(width_per_layer=64, vocab=8192, max_seq=128)
SIZES = {"tiny": 2, "50m": 10, "150m": 14, "400m": 20, "3b": 40}  # n_layer: 1.5 M, 54.6 M, 142.5 M, 404.2 M, 3.17 B
METHODS = ("ddp", "fsdp2", "zero3", "zero3_offload_nvme", "deepspeed_zero3")
PREDICTED = {"zero3": ("zero3", (3, "none", "none")), "zero3_offload_nvme": ("zero3", (3, "nvme", "nvme"))}
WORLD, BATCH, SEQ, STEPS, LR = 2, 1, 16, 2, 1e-3
GiB, MiB = 2**30, 2**20


def shape_of(size: str) -> ModelShape:
    layers = SIZES[size]
    member = FAMILY.member(layers)
    return ModelShape(vocab_size=member.vocab, max_seq=member.max_seq, width=member.width, n_layer=layers,
                      n_head=layers, batch=BATCH, seq=SEQ)  # fmt: skip


# --------------------------------------------------------------------------------------------- one rank's run
@dataclass(slots=True)
class Built:
    """A method set up on one rank: the module to call, the optimizer, its step, and (nvme) the engine."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[], None]
    engine: Any = None
    backward: Callable[[torch.Tensor], None] | None = None  # DeepSpeed's engine.backward; None: loss.backward()


def _build_ddp(shape: ModelShape, nvme_dir: str) -> Built:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(BenchGPT(shape), gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR)
    return Built(ddp, optimizer, optimizer.step)


def _build_fsdp2(shape: ModelShape, nvme_dir: str) -> Built:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = BenchGPT(shape)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")  # each rank's shards only
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    return Built(model, optimizer, optimizer.step)


def _build_zero(shape: ModelShape, nvme_dir: str, nvme: bool) -> Built:
    from zero_strategy.config import OffloadDevice, ZeroConfig
    from zero_strategy.core.engine.engine import ZeroEngine
    from zero_strategy.core.init import record_construction
    from zero_strategy.core.init.materialize import InitialValues

    with record_construction() as recording:
        model = BenchGPT(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    config = ZeroConfig(stage=3)
    if nvme:
        nvme_files = OffloadDevice.nvme
        config = ZeroConfig(stage=3, offload_optimizer=nvme_files, offload_param=nvme_files, nvme_path=nvme_dir)
    engine = ZeroEngine(model, [optimizer], config, initial_values=InitialValues(recording))
    return Built(model, optimizer, lambda: engine.optimizer_step(optimizer), engine)


def _build_deepspeed_zero3(shape: ModelShape, nvme_dir: str) -> Built:
    """DeepSpeed ZeRO-3 with the model built under ``zero.Init`` (each rank allocates only its partition), on the
    CPU accelerator and the gloo group ``run_ranks`` set up (see benchmarks/bench_deepspeed.py)."""
    from benchmarks.bench_deepspeed import _import_deepspeed, _set_launcher_environment, deepspeed_config

    _set_launcher_environment()
    deepspeed = _import_deepspeed()
    with torch.device("meta"):
        psi = parameter_count(BenchGPT(shape))
    config = deepspeed_config(3, BATCH, psi)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = BenchGPT(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, zero_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return Built(engine, zero_optimizer, engine.step, backward=engine.backward)


BUILDERS: dict[str, Callable[[ModelShape, str], Built]] = {
    "ddp": _build_ddp,
    "fsdp2": _build_fsdp2,
    "zero3": lambda shape, nvme_dir: _build_zero(shape, nvme_dir, False),
    "zero3_offload_nvme": lambda shape, nvme_dir: _build_zero(shape, nvme_dir, True),
    "deepspeed_zero3": _build_deepspeed_zero3,
}


def _allocated_bytes(folder: str) -> int:
    return sum(path.stat().st_blocks * 512 for path in Path(folder).rglob("*") if path.is_file())


def rank_worker(rank: int, world: int, method: str, size: str, nvme_dir: str, steps: int = STEPS) -> dict[str, Any]:
    """One method at one size on one rank (see [Note: what the benchmark measures])."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD: freed multi-page buffers leave the heap
    torch.set_num_threads(1)
    shape = shape_of(size)
    batches = rank_batches(shape, steps, BATCH, SEQ, rank, world)
    warm_up_kernels()
    baseline = reset_peak()
    torch.manual_seed(0)
    start = time.perf_counter()
    built = BUILDERS[method](shape, nvme_dir)
    setup = {"setup_peak": status_bytes("VmHWM") - baseline, "setup_s": time.perf_counter() - start}
    placement = getattr(built.engine, "placement", None)
    if placement is not None and placement.store is not None:
        placement.store.release_pages()
    reset_peak()
    times = []
    for tokens in batches:
        start = time.perf_counter()
        built.optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(built.model, tokens)
        built.backward(loss) if built.backward is not None else loss.backward()
        built.step()
        times.append(time.perf_counter() - start)
    result = {**setup, "train_peak": status_bytes("VmHWM") - baseline, "step_s": times[-1], "disk": 0}
    if placement is not None and placement.store is not None:  # this rank's files only (both share nvme_dir)
        result["disk"] = _allocated_bytes(str(placement.store.folder))
    if built.engine is not None:
        built.engine.release()
    return result


def run_fresh(method: str, size: str, timeout_s: float, steps: int = STEPS) -> list[dict[str, Any]]:
    """Both ranks of one (method, size) in a new interpreter; its nvme files in a temporary directory."""
    nvme_dir = tempfile.mkdtemp(prefix="bench-largest-")
    code = ("import json, sys; from zero_strategy.testing import run_ranks; from benchmarks import bench_largest as b; "
            "print(json.dumps(run_ranks(b.rank_worker, 2, *sys.argv[1:4], int(sys.argv[4]),"
            " timeout_s=float(sys.argv[-1]) - 10, pg_timeout_s=120)))")  # fmt: skip
    try:
        done = subprocess.run([sys.executable, "-c", code, method, size, nvme_dir, str(steps), str(timeout_s)],
                              capture_output=True, text=True, timeout=timeout_s + 30, cwd=Path(__file__).parents[1])
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output")
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


# ------------------------------------------------------------------------------------------- results and table
@dataclass(slots=True)
class Row:
    """One (size, method): the largest rank's figures over the repetitions, or why there are none."""

    size: str
    method: str
    params: int
    setup_peak: int = 0
    train_peak: int = 0
    disk: int = 0
    step_s: float = 0.0
    setup_s: float = 0.0
    skipped: str | None = None

    @property
    def peak(self) -> int:
        return max(self.setup_peak, self.train_peak)


def params_of(size: str) -> int:
    """Ψ of the size's model, built on the meta device (the tied output weight counted once)."""
    with torch.device("meta"):
        return parameter_count(BenchGPT(shape_of(size)))


def measure(sizes: Sequence[str], methods: Sequence[str], reps: int, timeout_s: float, steps: int = STEPS) -> list[Row]:
    rows = []
    for size in sizes:
        params = params_of(size)
        for method in methods:
            row = Row(size, method, params)
            if method == "deepspeed_zero3" and importlib.util.find_spec("deepspeed") is None:
                row.skipped = "DeepSpeed is not installed"
                rows.append(row)
                continue
            for _ in range(reps):
                try:
                    ranks = run_fresh(method, size, timeout_s, steps)
                except (RuntimeError, subprocess.TimeoutExpired) as error:
                    row.skipped = f"failed: {str(error)[:120]}"
                    break
                row.setup_peak = max(row.setup_peak, *(r["setup_peak"] for r in ranks))
                row.train_peak = max(row.train_peak, *(r["train_peak"] for r in ranks))
                row.disk = max(row.disk, *(r["disk"] for r in ranks))
                row.step_s = max(row.step_s, *(r["step_s"] for r in ranks))
                row.setup_s = max(row.setup_s, *(r["setup_s"] for r in ranks))
            print(_format_row(row, predict(row)), file=sys.stderr, flush=True)  # progress, one line per run
            rows.append(row)
    return rows


def predict(row: Row) -> Peaks | None:
    """The estimator's peaks for this row's method (None: the estimator models ZeRO only), from the model's real
    layout: built on the meta device and planned as the engine plans it."""
    if row.method not in PREDICTED:
        return None
    with torch.device("meta"):
        model = BenchGPT(shape_of(row.size))
    stage, opt, par = PREDICTED[row.method][1]
    from zero_strategy.estimate.memory import CONFIGURATIONS

    peaks = compare_peaks(model, world_size=WORLD, compute_device="cpu", meta_init=True)
    return peaks[CONFIGURATIONS.index((stage, opt, par))]


def _mib(nbytes: float) -> str:
    return f"{nbytes / MiB:,.0f}"


def _ratio(measured: int, predicted: int | None) -> str:
    return f"{measured / predicted:.2f}" if predicted else "—"


def _format_row(row: Row, peaks: Peaks | None) -> str:
    head = f"| {row.size:>5} | {row.params / 1e6:6.1f} M | {row.method:<19} |"
    if row.skipped:
        return head + f" skipped: {row.skipped} |"
    setup_p = peaks.setup.device + peaks.setup.host if peaks else None
    train_p = peaks.training_ram(compute_on_host=True) if peaks else None
    cells = [_mib(row.setup_peak), _mib(setup_p) if setup_p else "—", _ratio(row.setup_peak, setup_p),
             _mib(row.train_peak), _mib(train_p) if train_p else "—", _ratio(row.train_peak, train_p),
             _mib(row.disk) if row.disk else "—", _mib(peaks.training.nvme) if peaks and row.disk else "—",
             f"{row.step_s:.2f}"]  # fmt: skip
    return head + "".join(f" {cell:>8} |" for cell in cells)


HEADER = ("| size  | params   | method              | setup MiB | predicted | ratio | train MiB | predicted | ratio |"
          " disk MiB | predicted | s/step |")


def format_table(rows: Sequence[Row]) -> str:
    lines = [HEADER, "|" + "|".join("---" for _ in HEADER.split("|")[1:-1]) + "|"]
    return "\n".join(lines + [_format_row(row, predict(row)) for row in rows])


# ------------------------------------------------------------------------------------ fit and projection
def fit_bytes_per_param(points: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """Least-squares ``bytes = slope × params + intercept`` (one point: through the origin)."""
    if len(points) == 1:
        return points[0][1] / points[0][0], 0.0
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return slope, mean_y - slope * mean_x


def project(rows: Sequence[Row], ram: float, disk: float, headroom: float = 0.15) -> list[str]:
    """Per method: the fitted bytes per parameter of its peak (and of its files) and the largest parameter count
    whose WORLD ranks fit ``(1 - headroom)`` of the RAM (and of the disk)."""
    lines = [f"Projection for {ram / GiB:.0f} GiB RAM, {disk / GiB:.0f} GiB free disk, {WORLD} ranks, "
             f"{headroom:.0%} headroom (peak = max(set-up, training) per rank, fitted over the sizes measured):"]
    for method in dict.fromkeys(row.method for row in rows):
        done = [row for row in rows if row.method == method and not row.skipped]
        if not done:
            continue
        slope, intercept = fit_bytes_per_param([(row.params, row.peak) for row in done])
        largest = ((1 - headroom) * ram / WORLD - intercept) / slope
        text = f"- {method}: {slope:.2f} B/param + {intercept / MiB:.0f} MiB per rank -> {largest / 1e9:.2f} B params"
        if any(row.disk for row in done):
            disk_slope, disk_intercept = fit_bytes_per_param([(row.params, row.disk) for row in done])
            by_disk = ((1 - headroom) * disk / WORLD - disk_intercept) / disk_slope
            text += f"; files {disk_slope:.2f} B/param per rank -> disk allows {by_disk / 1e9:.2f} B"
            largest = min(largest, by_disk)
            text += f"; largest {largest / 1e9:.2f} B"
        lines.append(text)
    return lines


def estimator_projection(ram: float, disk: float) -> list[str]:
    """``zero-estimate --largest``'s answer for the same machine and family, for the ZeRO methods."""
    from zero_strategy.estimate.memory import CONFIGURATIONS

    results = largest_fitting(Machine(ram=ram, disk=disk, ranks_per_node=WORLD), world_size=WORLD, family=FAMILY)
    lines = ["Estimator (zero-estimate --largest --family gpt, same family, ram, disk and headroom):"]
    for method, (_, config) in PREDICTED.items():
        result = results[CONFIGURATIONS.index(config)]
        if result.peaks is None or result.shape is None:
            lines.append(f"- {method}: nothing fits")
            continue
        lines.append(f"- {method}: {result.shape.num_params / 1e9:.2f} B params ({result.shape.n_layer} layers, "
                     f"width {result.shape.width})")
    return lines


# ------------------------------------------------------------------------------------------------------ main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_largest", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="50m,150m", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--reps", type=int, default=1, help="repetitions (the largest figure is kept)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps per run (default {STEPS})")
    parser.add_argument("--ram", type=float, default=24.0, help="GiB of RAM to project for (default 24)")
    parser.add_argument("--disk", type=float, help="GiB of disk for nvme (default: free space of the temp dir)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--json", help="also write the measured rows to this file")
    parser.add_argument("--load", help="print the report from rows a previous --json wrote (no measuring)")
    args = parser.parse_args(argv)
    for name, known in (("sizes", SIZES), ("methods", METHODS)):
        unknown = [item for item in getattr(args, name).split(",") if item not in known]
        if unknown:
            parser.error(f"--{name}: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> str:
    args = parse_args(argv)
    if args.load:
        rows = [Row(**{**row, "params": params_of(row["size"])}) for row in json.loads(Path(args.load).read_text())]
    else:
        rows = measure(args.sizes.split(","), args.methods.split(","), args.reps, args.timeout, args.steps)
    if args.json:
        Path(args.json).write_text(json.dumps([{k: getattr(row, k) for k in Row.__slots__} for row in rows]))
    disk = (args.disk * GiB) if args.disk is not None else shutil.disk_usage(tempfile.gettempdir()).free
    report = "\n".join([
        f"Peak RSS per rank above the pre-model baseline (MiB), {WORLD} gloo ranks, AdamW, batch {BATCH} x {SEQ} "
        f"tokens, {args.steps} steps; predicted = zero-estimate (meta-built set-up; training = its total on CPU "
        "ranks).",
        "", format_table(rows), "", *project(rows, args.ram * GiB, disk),
        "", *estimator_projection(args.ram * GiB, disk),
    ])  # fmt: skip
    print(report)
    return report


if __name__ == "__main__":
    main()
