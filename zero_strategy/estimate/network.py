"""Bytes per optimizer step per link (inside a node / across nodes) and the communication time they cost, for flat
ZeRO, hybrid sharding (``shard_group_size``) and hierarchical stage 3 (``hierarchical_params``), before any run.

The model is the engine's point-to-point plan, counted for rank 0 of a layout of ``nodes × per_node`` ranks placed
node by node (see core/plan/topology.py): an exchange of a B-byte buffer over a group of n ranks sends B/n to
every other member (all-gather, reduce-scatter); the replica all-reduce of a slice S over R replicas sends
2·S/R to each of the R-1 others. Per step: stages 1/2 gather Ψ and reduce Ψ once (stage 2: once per micro-step);
stage 3 gathers twice per micro-step (forward and backward: an upper bound, the engine keeps the root and last unit
whole between them) and reduces once per micro-step; with replicas the fp32 gradient slice accumulated over the
step is then all-reduced over them once. Hierarchical stage 3 (``hierarchical_params``, see core/flat/secondary.py)
gathers once per step from the whole world and every other time (2m - 1 times, the same upper bound) inside its
group of K ranks.
Time = intra bytes / intra bandwidth + inter bytes / inter bandwidth (no overlap with compute).
"""

from __future__ import annotations

from dataclasses import dataclass

from zero_strategy.core.plan.topology import INTER_NODE, INTRA_NODE, Topology, resolve_shard_group_size


@dataclass(frozen=True, slots=True)
class TrafficEstimate:
    """What one rank sends per optimizer step."""

    layout: str  # "flat", "hybrid K=..." or "hierarchical K=..."
    intra_bytes: float
    inter_bytes: float
    seconds: float


def _sends(topology: Topology, members: list[int], per_peer: float) -> dict[str, float]:
    """Rank ``members[0]`` sends ``per_peer`` bytes to each other member: the bytes per link."""
    out = {INTRA_NODE: 0.0, INTER_NODE: 0.0}
    for peer in members[1:]:
        out[topology.link(members[0], peer)] += per_peer
    return out


def estimate_traffic(
    param_count: float,
    stage: int,
    topology: Topology,
    shard_group_size: int | str | None,
    bandwidth_gbps: tuple[float, float],
    dtype_bytes: tuple[int, int] = (4, 4),
    accumulation: int = 1,
    hierarchical_params: int | str | None = None,
) -> TrafficEstimate:
    """Rank 0's bytes per link per step. ``bandwidth_gbps``: (inside a node, across nodes) in Gbit/s per rank;
    ``dtype_bytes``: (gathered parameters, reduced gradients) bytes per element; ``hierarchical_params`` (stage 3,
    flat): the secondary group of hierarchical stage 3."""
    world = topology.world_size
    k = resolve_shard_group_size(shard_group_size, topology)
    secondary = resolve_shard_group_size(hierarchical_params, topology, "hierarchical_params")
    hierarchical = hierarchical_params is not None and stage == 3 and k == world and secondary < world
    gather, reduce = param_count * dtype_bytes[0], param_count * dtype_bytes[1]
    gathers = 2 * accumulation if stage == 3 else 1
    reductions = 1 if stage == 1 else accumulation
    links = {INTRA_NODE: 0.0, INTER_NODE: 0.0}

    def add(members: list[int], per_peer: float) -> None:
        for link, sent in _sends(topology, members, per_peer).items():
            links[link] += sent

    if hierarchical:  # one world gather per step; the others from the secondary copies of the group
        add(list(range(world)), (gather + reductions * reduce) / world)
        add(list(range(secondary)), (gathers - 1) * gather / secondary)
    else:
        add(list(range(k)), (gathers * gather + reductions * reduce) / k)
    replicas = world // k
    if replicas > 1:
        slice_bytes = -(-param_count * 4 // k)  # the accumulated fp32 slice, once per step
        add(list(range(0, world, k)), 2 * slice_bytes / replicas)
    intra_gbps, inter_gbps = bandwidth_gbps
    seconds = links[INTRA_NODE] * 8 / (intra_gbps * 1e9) + links[INTER_NODE] * 8 / (inter_gbps * 1e9)
    label = f"hierarchical K={secondary}" if hierarchical else "flat" if replicas == 1 else f"hybrid K={k}"
    return TrafficEstimate(label, links[INTRA_NODE], links[INTER_NODE], seconds)


def format_traffic(estimates: list[TrafficEstimate], stage: int) -> str:
    lines = [f"stage {stage}, per rank per optimizer step:", "layout               intra GiB  inter GiB  comm s"]
    for e in estimates:
        lines.append(f"{e.layout:<20} {e.intra_bytes / 2**30:>9.3f}  {e.inter_bytes / 2**30:>9.3f}  {e.seconds:>6.3f}")
    return "\n".join(lines)
