# Two entry points, both from a fresh clone:
#   make train   set up the environment and run the main job (GPT on the bundled corpus, zero3, 2 CPU ranks)
#   make test    set up the environment and run lint, type checks and the test suite (then make test-network)
#   make gpu-check   on a CUDA machine: the CUDA test tier, then a ZeRO/DDP/FSDP2 benchmark (report: gpu_report.md)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# litgpt, a real Fabric client (tests/fabric/test_fabric_litgpt.py), installed without its dependencies: it pins
# older ones than ours (huggingface-hub<1.4, hence an older transformers), and what the test imports needs none else
LITGPT_VERSION := 0.5.13

.PHONY: setup train test test-network mutation-check lint gpu-check
setup: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml constraints.txt Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	$(BIN)/pip install -q --no-deps litgpt==$(LITGPT_VERSION)
	touch $@

train: setup
	$(BIN)/python examples/train.py

lint: setup
	$(BIN)/ruff check zero_strategy tests examples benchmarks
	$(BIN)/mypy zero_strategy examples benchmarks

# A test whose spawned rank died by a signal at process exit *after* writing its finished marker (a rare gloo
# shutdown abort) is retried once; a rank that dies while working, any other failure, and a second such exit fail
# the run (see [Note: which rank deaths are retried] in tests/conftest.py).
test: lint
	$(BIN)/python -m pytest -q --reruns 1 --only-rerun RankExitedAfterFinishing
	$(MAKE) --no-print-directory test-network
	$(MAKE) --no-print-directory mutation-check

# The second pass: the stage-3 tests above the engine again on the network path GPUs and several nodes take
# (parameters freed and gathered: point-to-point, then a subset on gloo's own collectives), not one host's shared
# memory; which tests, and how every rank gets the switch: [Note: the two paths of stage 3] in tests/network_path.py
test-network: setup
	$(BIN)/python -m pytest -q --reruns 1 --only-rerun RankExitedAfterFinishing --network-pass point_to_point
	$(BIN)/python -m pytest -q --reruns 1 --only-rerun RankExitedAfterFinishing --network-pass native

# Faults planted one at a time in a scratch copy of the library; each must make one of its tests fail (the table of
# faults and the tests that kill them: tests/mutation/faults.py; --only NAME runs one)
mutation-check: setup
	$(BIN)/python -m tests.mutation.check

# The GPU path on a CUDA machine (sized for ~8 min on one H200, setup included; not yet timed on one): fail at
# once without a GPU, run the CUDA tier (tests marked `cuda`, torchrun workers), then benchmarks/gpu_check.py on
# every visible GPU. Its report is gpu_report.md. GPUS=1 limits the benchmark to one GPU.
GPUS ?= $(shell $(BIN)/python -c "import torch; print(max(1, torch.cuda.device_count()))" 2>/dev/null || echo 1)
gpu-check: setup
	@$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make gpu-check: no CUDA GPU visible (torch.cuda.is_available() is False' + ('; this torch is a CPU build: install a CUDA build of torch 2.13' if torch.version.cuda is None else '') + '). Run it on a GPU machine.')"
	$(BIN)/python -m pytest -q -m cuda tests/cuda
	$(BIN)/python -m torch.distributed.run --standalone --nproc_per_node=$(GPUS) benchmarks/gpu_check.py --device cuda --report gpu_report.md
