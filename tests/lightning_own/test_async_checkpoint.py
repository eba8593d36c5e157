# Vendored from Lightning-AI/pytorch-lightning 2.6.5 (commit be98784a1a03581b7051a355ae1084fd352d7cea),
# tests/tests_pytorch/plugins/test_async_checkpoint.py; Apache License 2.0, Copyright The Lightning AI team.
# Adapted to run against s3-checkpoint-io on s3:// (tests/README.md, "Lightning's own tests"); every edit is
# marked "# s3:".
# s3: `tmp_path` is an s3://bucket/tmp prefix (lightning_own/conftest.py), Trainer adds an S3CheckpointIO
# (sync or async) and ModelCheckpoint is S3ModelCheckpoint (lightning_own/s3_adapt.py).
# Licensed under the Apache License, Version 2.0: http://www.apache.org/licenses/LICENSE-2.0
import pytest
import torch

from lightning_own.s3_adapt import make_checkpoint_io, torch_load  # s3: our plugin; reading what reached S3

# s3: `_CaptureCheckpointIO` (a base plugin keeping the object it was handed) is gone: the plugin under test is
# S3CheckpointIO, itself async in the async mode, and what it saved is read back from S3.


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_async_checkpoint_should_snapshot_values_before_mutation(tmp_path):  # s3: tmp_path for the URL
    async_io = make_checkpoint_io()  # s3: S3CheckpointIO (async in the async mode), not AsyncCheckpointIO(base)

    # a tensor that we will mutate after scheduling the save
    t = torch.tensor([0.0])
    ckpt = {"w": t}

    # schedule async save
    async_io.save_checkpoint(ckpt, path=tmp_path / "w.ckpt")  # s3: a real URL, not "unused"

    # mutate immediately afterward to mimic training thread stepping params
    t.add_(1.0)

    # ensure background thread finished
    async_io.teardown()

    saved = torch_load(tmp_path / "w.ckpt", weights_only=True)  # s3: what reached S3, not `base.saved`
    assert saved is not None, "Async save did not run"  # s3: saved, not base.saved

    # EXPECTATION: AsyncCheckpointIO should have captured value 0.0 (pre-mutation)
    # CURRENT BEHAVIOR (bug): it captures 1.0 because the dict holds references
    assert torch.allclose(saved["w"], torch.tensor([0.0])), (  # s3: saved, not base.saved
        "AsyncCheckpointIO must snapshot the checkpoint (clone tensors) on the main thread "
        "to avoid races with parameter mutation; got mutated value instead"
    )
