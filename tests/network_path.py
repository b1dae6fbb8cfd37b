"""The network-path pass: the stage-3 tests above the engine, run again on the path GPUs and several nodes take.

[Note: the two paths of stage 3]
On one host's CPU ranks ``collectives="auto"`` (the default) keeps each stage-3 unit's parameters once per host in
/dev/shm and reads them in place: nothing is freed, nothing is gathered. Every GPU and multi-node run frees the
parameters after each use and gathers them through the network (``"point_to_point"`` on gloo, ``"native"``: the
backend's own collectives, as NCCL's). The main pass runs the default; ``pytest --network-pass point_to_point`` (or
``native``) sets ``$ZERO_STRATEGY_COLLECTIVES`` — the default of ``ZeroConfig.collectives`` — before any test
starts, so every rank inherits it however it is launched (forked, spawned, or a script re-run by Lightning's popen
launcher), and keeps only the tests listed here. A test that pins ``collectives=`` keeps its pin: one that only
means something on one path says so that way (e.g. ``collectives="auto"`` where it measures shared memory).

``STAGE3`` lists the tests that run stage 3 on more than one rank at the Trainer, Fabric, litgpt, checkpoint
(zero and DCP), save-matrix, release, precision, offload, example and tool level with the default collectives;
each listed test also gets the ``stage3`` marker (``pytest -m stage3`` selects them in any pass). ``NATIVE`` is
the representative Trainer + Fabric + checkpoint subset run a third time on gloo's own collectives. The engine-level
tests (tests/distributed) choose their transports by parametrization and are not listed. With the default test
paths, an entry that matches no collected test is an error (a renamed test must not silently drop out).
"""

from __future__ import annotations

import os

import pytest

from zero_strategy.config import COLLECTIVES_ENV

PASSES = ("point_to_point", "native")

# Node-id prefixes (a file, a test, or a test with the start of its parameter id); a file where a module fixture
# runs the stage-3 fits is listed whole. Found by logging every multi-rank stage-3 engine built while tests/
# lightning, fabric, checkpoint, offload, precision, examples and tools ran. Not listed, because "auto" already
# takes the network path there or the test pins its transports: tests/lightning/test_multinode.py (two nodes),
# offloaded runs (tests/examples/test_finetune_example.py, tests/tools/test_bench_largest.py), and the tests that
# parametrize collectives themselves (test_checkpoint_hooks.py, test_lightning_patterns.py,
# test_outside_forward_trainer.py, test_fabric_outside_forward.py, test_fabric_activation_checkpointing.py,
# tests/tools/test_profiler.py, test_estimate.py, test_benchmark_smoke.py).
# Left out for time, each a memory measurement or a repeat of a listed fit: test_dcp_memory.py, test_setup_memory.py,
# offload/test_activation_checkpointing.py's memory test, test_offload.py's NVMe memory test and its [sgd] case,
# and test_train_example.py's sweep.
STAGE3: tuple[str, ...] = (
    # Trainer (every launcher), hooks, release, precision, sharded construction
    "tests/distributed/test_release.py",
    "tests/lightning/test_broadcast_buffers.py",
    "tests/lightning/test_compile_trainer.py",
    "tests/lightning/test_manual_optimization.py::test_manual_optimization_with_clipping_matches_ddp[3]",
    "tests/lightning/test_preemption.py",
    "tests/lightning/test_release_after_fit.py",
    "tests/lightning/test_save_after_fit.py",
    "tests/lightning/test_save_matrix.py",
    "tests/lightning/test_sharded_construction_trainer.py::test_pretrained_files_load_shard_by_shard",
    "tests/lightning/test_sharded_construction_trainer.py::test_seeded_configure_model_with_metrics_matches_ddp[2]",
    "tests/lightning/test_sharded_construction_trainer.py::test_seeded_configure_model_with_metrics_matches_ddp[4]",
    "tests/lightning/test_shared_optimizers_trainer.py::test_shared_layer_gan_matches_ddp_with_its_gradient_norms[3]",
    "tests/lightning/test_zero_popen_names.py",
    "tests/lightning/test_zero_trainer.py::test_fit_matches_ddp[zero3_spawn]",
    "tests/lightning/test_zero_trainer.py::test_zero3_fit_then_test_and_predict",
    "tests/precision/test_precision_parity.py",
    "tests/precision/test_precision_plugin.py::test_fp16_manual_clipping_unscales_once_before_the_step[3]",
    "tests/precision/test_precision_plugin.py::test_overflow_on_one_rank_equals_overflow_on_every_rank[3]",
    "tests/precision/test_precision_trainer.py",
    "tests/offload/test_activation_checkpointing.py::test_checkpointing_gives_identical_weights[3]",
    "tests/offload/test_offload.py::test_offload_is_exact_at_every_stage[adamw]",
    "tests/offload/test_offload.py::test_offloaded_runs_save_and_resume_exactly",
    # Fabric and litgpt
    "tests/fabric/test_fabric_checkpoint.py",
    "tests/fabric/test_fabric_litgpt.py",
    "tests/fabric/test_fabric_parity.py::test_every_stage_matches_fabric_ddp[2]",
    "tests/fabric/test_fabric_parity.py::test_every_stage_matches_fabric_ddp[4]",
    "tests/fabric/test_fabric_precision.py",
    "tests/fabric/test_fabric_readme.py",
    "tests/fabric/test_fabric_registry.py::test_the_fabric_command_line_runs_a_script_under_zero3",
    # checkpoints: this package's format, DCP, consolidation, interchange, pretrained reads
    "tests/checkpoint/test_ckpt_consolidate.py::test_tied_model_from_two_ranks",
    "tests/checkpoint/test_ckpt_crash.py",
    "tests/checkpoint/test_ckpt_damage.py::test_undamaged_copy_loads",
    "tests/checkpoint/test_ckpt_hierarchical.py",
    "tests/checkpoint/test_ckpt_hybrid.py",
    "tests/checkpoint/test_ckpt_lightning.py::test_consolidated_output_equals_trained_state_dict",
    "tests/checkpoint/test_ckpt_lightning.py::test_resume_from_last_is_bit_identical_with_dropout",
    "tests/checkpoint/test_ckpt_lightning.py::test_resume_on_another_world_size",
    "tests/checkpoint/test_ckpt_reshard_core.py",
    "tests/checkpoint/test_ckpt_shared_optimizers.py::test_both_optimizers_states_are_saved_and_are_the_reference",
    "tests/checkpoint/test_dcp_crash.py",
    "tests/checkpoint/test_dcp_export.py::test_chunks_are_the_ranks_slices",
    "tests/checkpoint/test_dcp_export.py::test_export_equals_consolidate_and_our_reader[3-",
    "tests/checkpoint/test_dcp_fsdp2.py::test_fsdp2_continues_from_our_export[3]",
    "tests/checkpoint/test_dcp_fsdp2.py::test_pretrained_from_an_fsdp2_checkpoint",
    "tests/checkpoint/test_dcp_fsdp2.py::test_zero3_resumes_an_fsdp2_checkpoint",
    "tests/checkpoint/test_dcp_import.py::test_our_dcp_checkpoint_resumes_on_another_layout[1-4]",
    "tests/checkpoint/test_dcp_lightning.py",
    "tests/checkpoint/test_dcp_online.py",
    "tests/checkpoint/test_hf_export.py::test_from_pretrained_loads_the_trained_model",
    "tests/checkpoint/test_pretrained.py::test_sharded_checkpoint_and_consolidated_outputs[sharded]",
    "tests/checkpoint/test_pretrained_reads.py",
    # the example scripts and tools
    "tests/examples/test_readme_example.py",
    "tests/examples/test_train_example.py::test_tiny_run_reports_perplexity[zero3]",
    "tests/tools/test_bench_layouts.py",
)

# gloo's own reduce_scatter_tensor / all_gather_into_tensor (fp32, fp16, bf16): a Trainer on each launcher, Fabric,
# both checkpoint formats with a resume, low precision, release and sharded construction
NATIVE: tuple[str, ...] = (
    "tests/distributed/test_release.py",
    "tests/lightning/test_zero_trainer.py::test_fit_matches_ddp[zero3_spawn]",
    "tests/lightning/test_zero_trainer.py::test_zero3_fit_then_test_and_predict",
    "tests/lightning/test_save_after_fit.py::test_popen_save_after_fit_resumes_like_ddp",
    "tests/lightning/test_release_after_fit.py",
    "tests/lightning/test_sharded_construction_trainer.py::test_seeded_configure_model_with_metrics_matches_ddp[2]",
    "tests/precision/test_precision_parity.py",
    "tests/fabric/test_fabric_checkpoint.py",
    "tests/fabric/test_fabric_parity.py::test_every_stage_matches_fabric_ddp[2]",
    "tests/fabric/test_fabric_precision.py",
    "tests/checkpoint/test_ckpt_lightning.py::test_resume_from_last_is_bit_identical_with_dropout",
    "tests/checkpoint/test_ckpt_lightning.py::test_resume_on_another_world_size",
    "tests/checkpoint/test_dcp_lightning.py",
    "tests/checkpoint/test_ckpt_hybrid.py::test_hybrid_checkpoint_resumes_on_any_layout",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--network-pass", choices=PASSES, default=None,
        help=f"run only the stage-3 tests of tests/network_path.py with ${COLLECTIVES_ENV} set to this transport "
             "(the path GPUs and several nodes take; see [Note: the two paths of stage 3] there)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "stage3: runs stage 3 on several ranks above the engine (tests/network_path.py)")
    transport = config.getoption("--network-pass")
    if transport is not None:
        # before any test, so that every rank of every launcher inherits it
        os.environ[COLLECTIVES_ENV] = transport


def _matches(nodeid: str, entries: tuple[str, ...]) -> bool:
    return any(nodeid.startswith(entry) for entry in entries)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _matches(item.nodeid, STAGE3):
            item.add_marker(pytest.mark.stage3)
    transport = config.getoption("--network-pass")
    if transport is None:
        return
    entries = STAGE3 if transport == "point_to_point" else NATIVE
    if config.args_source is pytest.Config.ArgsSource.TESTPATHS:
        stale = [entry for entry in entries if not any(item.nodeid.startswith(entry) for item in items)]
        if stale:
            raise pytest.UsageError(f"tests/network_path.py lists tests that no longer exist: {stale}; update it.")
    kept = [item for item in items if _matches(item.nodeid, entries)]
    dropped = [item for item in items if not _matches(item.nodeid, entries)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
