"""One rank of a multi-node run (started by torchrun or with the variables srun sets; see test_multinode.py):
the same tiny fit under DDP, then under ZeRO with shard groups of one node (and, with ``ZERO_HIERARCHICAL`` set,
hierarchical stage 3), on ``devices=2, num_nodes=2``. Each rank
writes what it saw to ``OUT/<label>_rank<r>.pt``: the final weights, the nodes the strategy knew of, and the bytes
it sent per link."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

import lightning.pytorch as pl
import torch
from helpers.models import SEQ, VOCAB, TiedLM, lm_loss
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from zero_strategy import ZeroStrategy


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TiedLM(width=32, n_blocks=2)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return lm_loss(self.net, batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        tokens = torch.randint(0, VOCAB, (32, SEQ), generator=torch.Generator().manual_seed(5))
        return DataLoader(TensorDataset(tokens), batch_size=4, shuffle=False)


class Observe(pl.Callback):
    """What the strategy knew at the end of training (its engine is released by teardown)."""

    def __init__(self) -> None:
        self.seen: dict = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen = {"env": type(trainer.strategy.cluster_environment).__name__, "num_nodes": trainer.num_nodes}
        if isinstance(trainer.strategy, ZeroStrategy):
            engine = trainer.strategy.engine
            topology = engine.comm_log.topology
            replicas = engine.place.replica_count
            self.seen.update(nodes=topology.num_nodes if topology else 1, links=dict(engine.comm_log.bytes_by_link),
                             shard_world=engine.place.world_size, replicas=replicas,
                             param_group=engine.comms.secondary.size if engine.comms.secondary else None)


def fit(label: str, strategy: pl.strategies.Strategy, out: Path) -> None:
    model, observe = Tiny(), Observe()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[observe],
    )
    trainer.fit(model)
    seen = observe.seen
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"state": state, "initial": initial, **seen}, out / f"{label}_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    timeout = timedelta(seconds=60)
    fit("ddp", DDPStrategy(process_group_backend="gloo", timeout=timeout), out_dir)
    fit("zero", ZeroStrategy(stage=int(os.environ.get("ZERO_STAGE", "3")), shard_group_size="node",
                             process_group_timeout_s=60), out_dir)
    if os.environ.get("ZERO_HIERARCHICAL"):  # hierarchical stage 3: a secondary parameter copy per node
        fit("hierarchical", ZeroStrategy(stage=3, hierarchical_params="node", process_group_timeout_s=60), out_dir)
