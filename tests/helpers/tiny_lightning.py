"""The tiny LightningModule the Lightning tests train, in one place: small, deterministic, and it records the state
training (re)started from, so a test can tell a real restore from a fresh start. Also the clean exit the
multi-rank Lightning workers need (`close_process_group`)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from s3_checkpoint_demo import build_trainer as tiny_trainer

__all__ = [
    "FAMILIES",
    "TOP_K_CHECKPOINT",
    "close_process_group",
    "lightning_family",
    "tiny_module_class",
    "tiny_trainer",
]

FAMILIES = ["lightning.pytorch", "pytorch_lightning"]
"""Both import names Lightning ships under; the Lightning tests run once with each that is installed."""


TOP_K_CHECKPOINT: dict[str, Any] = {
    "filename": "tiny-{step}",
    "monitor": "gstep",
    "mode": "max",
    "save_top_k": 2,
    "save_last": True,
    "every_n_train_steps": 2,
}
"""The ModelCheckpoint the Lightning tests save with: the two highest steps and last.ckpt, every 2 steps.
`tiny_trainer` (the demo's `build_trainer`) builds their quiet single-process CPU Trainers."""


def close_process_group() -> None:
    """Lightning leaves the process group open; a gloo group still alive at interpreter exit can abort the process
    ("terminate called without an active exception") after all its work is done, failing the rank's exit status.
    The ranks meet in a barrier first, then rank 0, which hosts the rendezvous store, closes its group last: only
    after every other rank has closed its own (each leaves a mark in a private directory of this launch). A rank 0
    that tears its group down and exits while a peer is still closing (or finishing its collectives) leaves that
    peer's gloo threads talking to a closed socket, which aborts the peer the same way."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    closed = Path(tempfile.gettempdir(), f"s3ckpt-test-closed-{os.environ.get('MASTER_PORT', 'none')}")
    if rank == 0:  # a fresh one: no mark left by an earlier launch on the same port counts
        shutil.rmtree(closed, ignore_errors=True)
        closed.mkdir(mode=0o700)
    dist.barrier()
    if rank != 0:
        dist.destroy_process_group()
        (closed / f"rank{rank}").touch()
        return
    deadline = time.monotonic() + 60.0
    while len(list(closed.iterdir())) < world_size - 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    dist.destroy_process_group()
    shutil.rmtree(closed, ignore_errors=True)


def lightning_family(name: str) -> Any:
    """The Lightning family `name`, or skip the test where it is not installed."""
    return pytest.importorskip(name)


def tiny_module_class(
    pl: Any,
    *,
    features: int = 4,
    outputs: int = 1,
    seed: int = 0,
    optimizer: str = "adam",
    samples: int = 64,
    data_seed: int = 1,
) -> type:
    """A LightningModule class for the Lightning family `pl` (``lightning.pytorch`` or ``pytorch_lightning``).

    It logs ``gstep`` (the global step, for ``monitor="gstep"``), trains on `samples` fixed random rows in batches of
    4, and sets ``started_at`` when training starts: the global step, the checkpoint it resumed from, and clones of
    its weights and optimizer state.
    """

    class TinyModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.layer = torch.nn.Linear(features, outputs)
            self.started_at: dict[str, Any] | None = None

        def training_step(self, batch, batch_idx):
            self.log("gstep", float(self.global_step))
            return self.layer(batch[0]).pow(2).mean()

        def on_train_start(self) -> None:
            optimizer_state = self.trainer.optimizers[0].state_dict()["state"]
            self.started_at = {
                "global_step": self.global_step,
                "ckpt_path": self.trainer.ckpt_path,
                "weights": {name: tensor.clone() for name, tensor in self.state_dict().items()},
                "optimizer_state": {
                    index: {name: _clone(value) for name, value in state.items()}
                    for index, state in optimizer_state.items()
                },
            }

        def configure_optimizers(self):
            if optimizer == "sgd":
                return torch.optim.SGD(self.parameters(), lr=0.1)
            return torch.optim.Adam(self.parameters(), lr=0.01)

        def train_dataloader(self):
            rows = torch.randn(samples, features, generator=torch.Generator().manual_seed(data_seed))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=4)

    return TinyModule


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
