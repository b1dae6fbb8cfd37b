"""``zero-estimate --plot``: a stacked-bar chart of the estimates. matplotlib is imported only when a chart is asked
for (it is not a dependency of the package)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zero_strategy.estimate.memory import MemoryEstimate

GiB = 2**30


def require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("zero-estimate --plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only, no display needed
    return matplotlib


def plot_estimates(estimates: Sequence[MemoryEstimate], path: str, device_memory: float | None = None) -> None:
    """Stacked bars of device GiB per configuration (one colour per category), host+nvme bars beside them."""
    require_matplotlib()
    import matplotlib.pyplot as plt

    labels = [e.label for e in estimates]
    positions = range(len(estimates))
    figure, (device_axis, host_axis) = plt.subplots(1, 2, figsize=(14, 5.5), sharey=False)
    for axis, place in ((device_axis, "device"), (host_axis, "host")):
        bottom = [0.0] * len(estimates)
        for name in estimates[0].categories:
            values = [getattr(e.categories[name], place) / GiB for e in estimates]
            axis.bar(positions, values, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        if place == "host":
            values = [e.total.nvme / GiB for e in estimates]
            axis.bar(positions, values, bottom=bottom, label="nvme files", hatch="//", color="lightgrey")
        axis.set_xticks(list(positions), labels, rotation=45, ha="right")
        axis.set_ylabel("GiB per rank")
        axis.set_title(f"{place} memory" + (" (+ nvme files)" if place == "host" else ""))
    if device_memory is not None:
        device_axis.axhline(device_memory / GiB, color="black", linestyle="--", label="device memory")
    device_axis.legend()
    first = estimates[0]
    figure.suptitle(f"{first.num_params / 1e9:.3g}B parameters, {first.world_size} ranks, {first.precision}, "
                    f"{first.optimizer}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
