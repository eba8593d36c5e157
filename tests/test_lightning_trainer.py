"""Real Lightning Trainers checkpointing to the local S3 server through S3CheckpointIO, and resuming from it."""

from __future__ import annotations

import importlib

import pytest
import torch
from tiny_lightning import FAMILIES, TOP_K_CHECKPOINT, lightning_family, tiny_module_class, tiny_trainer

from s3_checkpoint_io import S3CheckpointIO

pytestmark = pytest.mark.lightning


def make_trainer(pl, plugin, dirpath: str, max_steps: int):
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=dirpath, **TOP_K_CHECKPOINT)
    trainer = tiny_trainer(pl, max_steps, plugins=[plugin], callbacks=[checkpoint])
    return trainer, checkpoint


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("async_checkpointing", [False, True], ids=["sync", "async"])
def test_fit_checkpoints_to_s3_and_resumes(family: str, async_checkpointing: bool, s3_client, bucket: str) -> None:
    pl = lightning_family(family)
    module_class = tiny_module_class(pl, features=8, outputs=2)
    dirpath = f"s3://{bucket}/run"
    plugin = S3CheckpointIO(dirpath, chunk_size_MB=5, async_checkpointing=async_checkpointing)

    first = module_class()
    trainer, _ = make_trainer(pl, plugin, dirpath, max_steps=6)
    trainer.fit(first)
    final_weights = {k: v.clone() for k, v in first.state_dict().items()}
    final_optimizer = trainer.optimizers[0].state_dict()["state"]

    keys = sorted(o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket).get("Contents", []))
    expected = ["run/last.ckpt", "run/tiny-step=4.ckpt", "run/tiny-step=6.ckpt"]
    assert [k for k in keys if k.endswith(".ckpt")] == expected
    assert not s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads")

    second = module_class()
    resume_plugin = S3CheckpointIO(dirpath, chunk_size_MB=5, async_checkpointing=async_checkpointing)
    resumed_trainer, _ = make_trainer(pl, resume_plugin, dirpath, max_steps=8)
    resumed_trainer.fit(second, ckpt_path=f"{dirpath}/last.ckpt")

    assert second.started_at is not None
    assert second.started_at["global_step"] == 6
    for name, tensor in final_weights.items():
        assert torch.equal(second.started_at["weights"][name], tensor), name
    for index, state in final_optimizer.items():
        for name, tensor in state.items():
            assert torch.equal(second.started_at["optimizer_state"][index][name], tensor), (index, name)
    assert resumed_trainer.global_step == 8


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_accepts_the_plugin_for_either_family(family: str) -> None:
    pl = lightning_family(family)
    base = importlib.import_module(
        family.replace("pytorch_lightning", "lightning_fabric").replace("lightning.pytorch", "lightning.fabric")
        + ".plugins.io.checkpoint_io"
    ).CheckpointIO
    plugin = S3CheckpointIO("s3://bucket/ckpts")
    assert isinstance(plugin, base)
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin], logger=False)
    assert trainer.strategy.checkpoint_io is plugin
