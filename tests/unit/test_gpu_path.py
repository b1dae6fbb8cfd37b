"""The GPU path's device-independent logic, checked on CPU (issue 14).

Every collective tensor must reach torch.distributed on the process group's device (the one helper
``collectives.collective_device`` says which); here that helper is made to answer ``meta``, a device no data of the
test lives on, and the fake torch.distributed records where each tensor it is handed lives. RNG capture/restore
runs against a mocked torch.cuda that sees 8 devices or 1. Nothing here needs a GPU.
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from zero_strategy.checkpoint.base import rng
from zero_strategy.checkpoint.sharded import load as ckpt_load
from zero_strategy.core.comm import backend, control, group, native
from zero_strategy.core.comm.engine_comms import watch_applies
from zero_strategy.core.comm.group import Group
from zero_strategy.core.comm.log import CommunicationLog
from zero_strategy.core.comm.native import NativeComm
from zero_strategy.core.comm.watch import WatchState
from zero_strategy.core.comm.watched import WatchedComm
from zero_strategy.core.comm.work import Work
from zero_strategy.core.engine import gradients, unused

META = torch.device("meta")


class _Stop(Exception):
    """Raised by the fake collective once it recorded its argument (a meta tensor cannot be copied back)."""


def _group(device: torch.device, size: int = 2) -> Group:
    return Group(None, 0, size, tuple(range(size)), device)


@pytest.fixture
def seen_devices(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """The group's device is ``meta``; the fake all_reduce/broadcast record their tensor's device and stop."""
    devices: list[torch.device] = []

    def fake(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        devices.append(tensor.device)
        raise _Stop

    monkeypatch.setattr(native.dist, "all_reduce", fake)
    monkeypatch.setattr(native.dist, "broadcast", fake)
    return devices


def _comm() -> NativeComm:
    return NativeComm(_group(META), CommunicationLog())


def _pieces(with_grads: bool) -> list[nn.Parameter]:
    piece = nn.Parameter(torch.ones(4))
    if with_grads:
        piece.grad = torch.full((4,), 2.0)  # on the CPU: offloaded masters, an NCCL group
    return [piece]


@pytest.mark.parametrize("with_grads", [True, False], ids=["cpu_grads", "rank_without_grads"])
@pytest.mark.parametrize(
    "call",
    [
        lambda pieces, c: gradients.global_grad_norm(pieces, c, 2.0),
        lambda pieces, c: gradients.global_grad_norm(pieces, c, float("inf")),
        lambda pieces, c: gradients.find_overflow(pieces, c),
    ],
    ids=["norm_l2", "norm_inf", "overflow"],
)
def test_scalar_collectives_run_on_the_group_device(
    seen_devices: list[torch.device], call: Any, with_grads: bool
) -> None:
    with pytest.raises(_Stop):
        call(_pieces(with_grads), _comm())
    assert seen_devices == [META]


def _flat_seeing(*seen: bool) -> Any:
    return SimpleNamespace(grads=SimpleNamespace(seen=list(seen), note_local_use=lambda: None))


def test_used_parameter_bitmap_broadcasts_and_gather_check_run_on_the_group_device(
    seen_devices: list[torch.device],
) -> None:
    comm = _comm()
    with pytest.raises(_Stop):
        unused.agree_on_used([_flat_seeing(True, False)], comm)
    with pytest.raises(_Stop):
        comm.broadcast(torch.zeros(3), 0, "buffers")
    watched = object.__new__(WatchedComm)  # its thread and store are not what is under test
    watched.group, watched.log, watched._inner = comm.group, comm.log, comm
    watched.watch = SimpleNamespace(state=WatchState.RUNNING, take_fingerprint=lambda: 7,  # type: ignore[assignment]
                                    call=lambda label, exchange: exchange())
    with pytest.raises(_Stop):
        watched.verify_step()
    assert seen_devices == [META, META, META]


@pytest.mark.parametrize(
    ("backend_name", "expected"),
    [("nccl", torch.device("cuda", 2)), ("gloo", torch.device("cpu")), ("cpu:gloo,cuda:nccl", torch.device("cpu"))],
)
def test_the_group_device_follows_the_backend(
    monkeypatch: pytest.MonkeyPatch, backend_name: str, expected: torch.device
) -> None:
    """NCCL: this rank's current CUDA device (set by the launcher or Lightning), whatever the data's device."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend_name)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert group.collective_device(None) == expected


def test_no_gather_watch_on_a_gpu_group() -> None:
    """The watch waits in a thread of its own (the wrong CUDA stream there) and reads a flag back every step."""
    assert watch_applies(reshards=True, host_shared=False, group=_group(torch.device("cpu")))
    assert not watch_applies(reshards=True, host_shared=False, group=_group(torch.device("cuda", 0)))
    assert not watch_applies(reshards=True, host_shared=True, group=_group(torch.device("cpu")))
    assert not watch_applies(reshards=False, host_shared=False, group=_group(torch.device("cpu")))


def test_flat_buffers_on_the_wrong_device_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    comm = NativeComm(_group(torch.device("cuda", 0)), CommunicationLog())
    with pytest.raises(RuntimeError, match="needs cuda:0"):
        comm.all_gather(torch.zeros(4), torch.zeros(2), "unit")


def test_barrier_names_this_ranks_device_on_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(torch.distributed, "barrier", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(control, "distributed", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(control, "collective_device", lambda handle: torch.device("cuda", 3))
    control.barrier(None)  # the adapters' barrier
    backend.BackendComm.barrier(NativeComm(_group(torch.device("cuda", 3)), CommunicationLog()), "step")
    assert calls == [{"group": None, "device_ids": [3]}] * 2


def test_all_used_bitmap_is_not_read_back() -> None:
    """Every parameter used here: the agreed bitmap is all ones whatever the peers sent, so it is not read back
    (a read is a host synchronisation on a GPU); with an unused parameter it is."""

    class NoRead(torch.Tensor):
        def tolist(self) -> Any:  # type: ignore[override]
            raise AssertionError("the agreed bitmap was read back")

    comm = SimpleNamespace(group=_group(torch.device("cpu")),
                           all_reduce=lambda tensor, op, label: Work.done(tensor.as_subclass(NoRead)))
    unused.agree_on_used([_flat_seeing(True, True)], comm)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="read back"):
        unused.agree_on_used([_flat_seeing(True, False)], comm)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------------- RNG
def _marker(device: int) -> torch.Tensor:
    """A stand-in generator state that says which device it came from."""
    return torch.tensor([device], dtype=torch.uint8)


class _FakeCuda:
    """torch.cuda as a process sees it: ``count`` devices, the current one ``current``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int, current: int) -> None:
        self.set_calls: list[tuple[int, int]] = []  # (state marker, device)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": _marker(int(device)))
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [_marker(i) for i in range(count)])
        monkeypatch.setattr(torch.cuda, "set_rng_state", self._set)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", self._refuse_all)

    def _set(self, state: torch.Tensor, device: Any = "cuda") -> None:
        self.set_calls.append((int(state[0]), int(device)))

    @staticmethod
    def _refuse_all(states: Any) -> None:
        raise AssertionError(f"set_rng_state_all touched {len(states)} devices, not only this rank's")


def _restore(tensors: dict[str, torch.Tensor], plain: str) -> None:
    rng.restore_rng(tensors, plain)


def test_rng_saves_only_this_ranks_cuda_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeCuda(monkeypatch, count=8, current=3)
    tensors, _ = rng.capture_rng()
    cuda = {name: int(t[0]) for name, t in tensors.items() if name.startswith("rng/cuda")}
    assert cuda == {"rng/cuda": 3}


def test_rng_from_eight_visible_gpus_restores_on_a_rank_seeing_one(monkeypatch: pytest.MonkeyPatch) -> None:
    saver = _FakeCuda(monkeypatch, count=8, current=5)
    tensors, plain = rng.capture_rng()
    torch_cpu = torch.get_rng_state()
    loader = _FakeCuda(monkeypatch, count=1, current=0)  # one GPU per SLURM task
    _restore(tensors, plain)
    assert loader.set_calls == [(5, 0)] and saver.set_calls == []
    assert torch.equal(torch.get_rng_state(), torch_cpu)
    # a checkpoint of the former format (every visible device) gives this rank its own device's entry only
    legacy = {"rng/torch_cpu": torch_cpu} | {f"rng/cuda_{i}": torch.tensor([i], dtype=torch.uint8) for i in range(8)}
    _restore(legacy, plain)
    assert loader.set_calls == [(5, 0), (0, 0)]


def test_rng_saved_on_gpu_restores_on_cpu_ranks_and_the_reverse(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeCuda(monkeypatch, count=2, current=1)
    on_gpu, plain = rng.capture_rng()
    assert [name for name in on_gpu if name.startswith("rng/cuda")] == ["rng/cuda"]
    cpu_only = _FakeCuda(monkeypatch, count=0, current=0)
    _restore(on_gpu, plain)  # no GPU here: the CUDA state is not applied, and nothing fails
    on_cpu, plain = rng.capture_rng()
    assert not any(name.startswith("rng/cuda") for name in on_cpu) and cpu_only.set_calls == []
    gpu = _FakeCuda(monkeypatch, count=1, current=0)
    _restore(on_cpu, plain)  # saved without a GPU: the GPU's generator is left as it is
    assert gpu.set_calls == []


# --------------------------------------------------------------------------------------------- step counters
@pytest.mark.parametrize(
    ("options", "where"),
    [({}, "cpu"), ({"capturable": True}, "meta"), ({"fused": True}, "meta")],
    ids=["plain", "capturable", "fused"],
)
def test_loaded_step_counter_stays_on_cpu_unless_capturable_or_fused(options: dict[str, bool], where: str) -> None:
    """Pieces on an accelerator (``meta`` stands for it): torch keeps Adam's ``step`` on the CPU unless the group
    is capturable or fused; on the device a plain Adam reads it back every step."""
    piece = nn.Parameter(torch.empty(4, device="meta"))
    optimizer = torch.optim.Adam([piece])
    optimizer.param_groups[0].update(options)  # the constructor refuses fused=True for a meta parameter
    state: dict[str, object] = {"step": torch.tensor(7.0), "exp_avg": torch.empty(4, device="meta")}
    ckpt_load._place_step_counters(optimizer, piece, state)
    step = state["step"]
    assert isinstance(step, torch.Tensor) and step.device.type == where and step.dtype == torch.float32


# ---------------------------------------------------------------------------------------- streams on the CPU
def test_cpu_engine_uses_no_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the side streams are no-ops: nothing of torch.cuda is touched by a stage-3 step, and the
    profiler's device timing is never switched on."""
    from zero_strategy.config import ZeroConfig
    from zero_strategy.core.comm.streams import CollectiveStreams
    from zero_strategy.core.engine.engine import ZeroEngine

    def no_cuda(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch.cuda used on a CPU run")

    monkeypatch.setattr(torch.cuda, "Stream", no_cuda)
    monkeypatch.setattr(torch.cuda, "Event", no_cuda)
    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=3, min_unit_numel=1))
    assert engine.comms.streams is None
    assert CollectiveStreams(torch.device("cpu")).run("gather", lambda: None) is None
    before = [p.detach().clone() for p in engine.master_params(optimizer)]
    model(torch.randn(4, 8)).sum().backward()
    engine.optimizer_step(optimizer)
    assert any(not torch.equal(b, p) for b, p in zip(before, engine.master_params(optimizer), strict=True))


def test_a_stream_wait_orders_the_current_stream_then_lets_its_buffers_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """A side-stream collective holds every buffer it touched until the compute stream waited for its event (the
    caching allocator may reuse a block only after that point)."""
    from zero_strategy.core.comm.streams import StreamReady

    waited: list[object] = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(wait_event=waited.append))
    buffer = torch.zeros(3)
    alive = weakref.ref(buffer)
    result = torch.ones(2)
    ready = StreamReady("gathered", torch.device("cuda", 0), (buffer,), None, result)
    del buffer
    gc.collect()
    assert alive() is not None and waited == []
    assert ready.wait() is result
    gc.collect()
    assert waited == ["gathered"] and alive() is None


def test_device_waits_are_added_to_blocked_seconds_when_settled() -> None:
    class Event:
        def __init__(self, ms: float) -> None:
            self.ms, self.synced = ms, False

        def synchronize(self) -> None:
            self.synced = True

        def elapsed_time(self, end: Event) -> float:
            return end.ms - self.ms

    log = CommunicationLog()
    assert log.stream_timer("all_gather") is None  # off unless the profiler asks
    log.device_timing = True
    timer = log.stream_timer("all_gather")
    assert timer is not None
    end = Event(250.0)
    timer(Event(0.0), end)
    assert log.seconds_by_kind.get("all_gather", 0.0) == 0.0  # nothing read in the hot path
    log.settle_device_times()
    assert end.synced and log.seconds_by_kind["all_gather"] == pytest.approx(0.25)
