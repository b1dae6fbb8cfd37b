"""A spawned rank copies every tensor of its module that lives in shared memory, keeping objects and ties."""

from __future__ import annotations

import torch
import torchmetrics
from torch import nn

from zero_strategy.lightning.private_tensors import make_module_tensors_private


class Holder(nn.Module):
    """Tensors in every place a module keeps them: registered, plain attributes, containers, a metric's states."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.register_buffer("running", torch.zeros(2))
        self.counter = torch.zeros(())
        self.same_counter = self.counter  # one tensor reached twice
        self.history = [torch.ones(2), "not a tensor"]
        self.by_name = {"a": torch.full((2,), 3.0)}
        self.pair = (torch.ones(1), 4)
        self.metric = torchmetrics.MeanMetric()
        self.left_private = torch.arange(3.0)


def shared_tensors(holder: Holder) -> list[torch.Tensor]:
    return [
        *holder.parameters(),
        *holder.buffers(),
        holder.counter,
        holder.history[0],
        holder.by_name["a"],
        holder.pair[0],
        holder.metric.mean_value,
        holder.metric.weight,
    ]


def test_shared_tensors_become_private_copies_with_the_same_values() -> None:
    holder = Holder()
    holder.metric.update(torch.tensor([1.0, 2.0]))
    for tensor in shared_tensors(holder):
        tensor.share_memory_()  # what torch.multiprocessing's pickling does to a spawned rank's tensors
    before = [tensor.clone() for tensor in shared_tensors(holder)]
    weight_object, private_object = holder.linear.weight, holder.left_private

    copied = make_module_tensors_private(holder)

    after = shared_tensors(holder)
    assert not any(tensor.is_shared() for tensor in after)
    for old, new in zip(before, after, strict=True):
        torch.testing.assert_close(new, old, rtol=0, atol=0)
    assert holder.linear.weight is weight_object  # the optimizer's Parameter object stays
    assert holder.same_counter is holder.counter  # a tie stays a tie
    assert holder.left_private is private_object  # a private tensor is not copied
    assert holder.history[1] == "not a tensor" and holder.pair[1] == 4
    assert copied == len(after)  # the tied counter once, nothing private
    holder.metric.update(torch.tensor([6.0]))  # the metric still works on its private states
    assert holder.metric.compute().item() == 3.0


def test_a_module_with_nothing_shared_is_left_as_it_is() -> None:
    holder = Holder()
    objects = [holder.counter, holder.history[0], holder.pair, holder.metric.mean_value]
    assert make_module_tensors_private(holder) == 0
    assert [holder.counter, holder.history[0], holder.pair, holder.metric.mean_value] == objects
