"""Set-up memory of a model bigger than it needs to be on any one rank: peak resident memory per rank while a
meta-built GPT is sharded at stage 3 (``record_construction`` + replay), and while the same model's weights are
loaded from one ``.safetensors`` file (``pretrained=``), beside the bound the README states.

    python -m benchmarks.bench_setup_memory --layers 18 --worlds 2,4

Bound per rank: 4Ψ/N bytes + 2 × the largest unit + 64 MiB above the pre-model baseline (Ψ parameters, N ranks,
fp32). Each (world, source) runs in a fresh interpreter whose ranks fix glibc's mmap threshold, warm up libtorch,
take the baseline and reset ``VmHWM`` (as ``benchmarks/bench_largest.py`` does). The pretrained run also checks
that every rank's loaded slices are bit-equal to the file's element ranges.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_largest import FAMILY
from benchmarks.bench_model import BenchGPT, ModelShape, parameter_count, warm_up_kernels
from zero_strategy.process_memory import reset_peak, status_bytes

MiB = 2**20


def shape_for(layers: int) -> ModelShape:
    member = FAMILY.member(layers)
    return ModelShape(vocab_size=member.vocab, max_seq=member.max_seq, width=member.width, n_layer=layers,
                      n_head=layers, batch=1, seq=16)  # fmt: skip


def rank_worker(rank: int, world: int, layers: int, weights_file: str | None) -> dict[str, Any]:
    """Shard the model at stage 3 (from its recorded construction, or from ``weights_file``) and report the
    set-up peak above the baseline."""
    from safetensors import safe_open

    from zero_strategy.config import ZeroConfig
    from zero_strategy.core.engine.engine import ZeroEngine
    from zero_strategy.core.init import record_construction
    from zero_strategy.initial_values import initial_values

    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD: freed multi-page buffers leave the heap
    torch.set_num_threads(1)
    warm_up_kernels()
    baseline = reset_peak()
    torch.manual_seed(0)
    with record_construction() as recording:
        model = BenchGPT(shape_for(layers))
    config = ZeroConfig(stage=3, pretrained=weights_file)
    with initial_values(model, recording, config, torch.device("cpu")) as values:
        engine = ZeroEngine(model, [], config, initial_values=values)
    peak = status_bytes("VmHWM") - baseline
    largest_unit = max(flat.layout.padded_numel * flat.shard.element_size() for flat in engine.flat_params)
    psi = sum(flat.layout.numel for flat in engine.flat_params)
    mismatched = []
    if weights_file is not None:  # every loaded slice equals the file's element range, bit for bit
        with safe_open(weights_file, framework="pt") as source:
            for flat in engine.flat_params:
                for piece in flat.layout.overlaps(engine.place.rank):
                    expected = source.get_slice(piece.name)[:].reshape(-1)
                    expected = expected[piece.param_start : piece.param_start + piece.numel]
                    got = flat.shard[piece.shard_start : piece.shard_start + piece.numel]
                    if not torch.equal(got, expected):
                        mismatched.append(piece.name)
    engine.release(full=False)
    return {"peak": peak, "psi": psi, "largest_unit": largest_unit, "mismatched": mismatched}


def run_fresh(world: int, layers: int, weights_file: str | None) -> list[dict[str, Any]]:
    code = ("import json, sys; from zero_strategy.testing import run_ranks; from benchmarks import bench_setup_memory"
            " as b; w = sys.argv[3] if sys.argv[3] != '-' else None; print(json.dumps(run_ranks(b.rank_worker, "
            "int(sys.argv[1]), int(sys.argv[2]), w, timeout_s=1200, pg_timeout_s=300)))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, str(world), str(layers), weights_file or "-"],
                          capture_output=True, text=True, timeout=1300, cwd=Path(__file__).parents[1])  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def write_weights(layers: int, folder: str) -> str:
    """The model's weights as one safetensors file (built eagerly here, in the parent process)."""
    from safetensors.torch import save_file

    torch.manual_seed(1)
    model = BenchGPT(shape_for(layers))
    path = str(Path(folder) / "gpt.safetensors")
    tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    tensors.pop("head.weight", None)  # tied to the token embedding: safetensors refuses shared storage
    save_file(tensors, path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=18, help="GPT depth (width = 64 x layers); 18: ~296 M")
    parser.add_argument("--worlds", default="2,4")
    args = parser.parse_args(argv)
    with torch.device("meta"):
        psi = parameter_count(BenchGPT(shape_for(args.layers)))
    print(f"GPT with {args.layers} layers: {psi / 1e6:.1f} M parameters", flush=True)
    print("| ranks | source | peak MiB per rank (max) | bound MiB | within | slices equal the file |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        weights = write_weights(args.layers, folder)
        for world in (int(w) for w in args.worlds.split(",")):
            for source, path in (("configure_model (meta + replay)", None), ("pretrained= .safetensors", weights)):
                ranks = run_fresh(world, args.layers, path)
                peak = max(r["peak"] for r in ranks)
                bound = 4 * ranks[0]["psi"] // world + 2 * ranks[0]["largest_unit"] + 64 * MiB
                equal = "—" if path is None else ("yes" if not any(r["mismatched"] for r in ranks) else "NO")
                print(f"| {world} | {source} | {peak / MiB:,.0f} | {bound / MiB:,.0f} | "
                      f"{'yes' if peak <= bound else 'NO'} | {equal} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
