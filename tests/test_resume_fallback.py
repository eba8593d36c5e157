"""Resume never sticks on a checkpoint that does not verify or load.

Discovery gives the checkpoints newest first (`find_resume_checkpoints`); `load_newest_usable` skips the ones that
fail to verify or load, with a WARNING, and deletes nothing; ``fallback=False`` (``resume_fallback=False``) is strict.
Single-file checkpoints (checksum mismatch, truncated object) and DCP checkpoints (a missing shard, an unreadable
``.metadata``) alike; the CLI's ``verify`` says what resume would skip. Multi-rank agreement and load sharing are in
tests/test_soak.py.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import boto3
import botocore.config
import pytest
import torch
import torch.distributed.checkpoint as dcp

import s3_checkpoint_cli
import s3_dcp
from connector import (
    CheckpointNotFoundError,
    find_resume_checkpoint,
    find_resume_checkpoints,
    is_unusable_checkpoint_error,
    load_newest_usable,
)
from s3_checkpoint_io import NotACheckpointError, S3CheckpointIO
from s3_utils import CHECKSUM_SIDECAR_SUFFIX, ChecksumMismatchError, S3Utils


def state(step: int) -> dict[str, Any]:
    return {"step": step, "w": torch.arange(16, dtype=torch.float32) * step}


@pytest.fixture
def io(s3_server: Any) -> S3CheckpointIO:
    return S3CheckpointIO(chunk_size_MB=5, fencing=False)


def save_run(io: S3CheckpointIO, base: str, steps: list[int]) -> None:
    """What a job that keeps top-k step files and one ``-last`` file leaves: ``step=N.ckpt`` for each step and
    ``step=M-last.ckpt`` for the newest."""
    for step in steps:
        io.save_checkpoint(state(step), f"{base}/step={step}.ckpt")
    io.save_checkpoint(state(steps[-1]), f"{base}/step={steps[-1]}-last.ckpt")


def replace_bytes(client: Any, bucket: str, key: str, data: bytes) -> None:
    """Another writer replaces the object behind this package's back, sending no checksum (the store keeps none)."""
    config = botocore.config.Config(request_checksum_calculation="when_required", s3={"addressing_style": "path"})
    boto3.client("s3", config=config).put_object(Bucket=bucket, Key=key, Body=data)


def corrupt(client: Any, bucket: str, key: str) -> None:
    """Make the object's bytes disagree with its recorded checksum (bit rot, a bad copy): a download of it raises
    ChecksumMismatchError."""
    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    replace_bytes(client, bucket, key, body)
    etag = client.head_object(Bucket=bucket, Key=key)["ETag"]
    record = {"algorithm": "CRC32", "checksum": "AAAAAA==", "size": len(body), "etag": etag}
    client.put_object(Bucket=bucket, Key=key + CHECKSUM_SIDECAR_SUFFIX, Body=json.dumps(record).encode())


def test_discovery_orders_the_fallbacks_newest_first_and_chooses_as_before(io: S3CheckpointIO, bucket: str) -> None:
    base = f"s3://{bucket}/run"
    save_run(io, base, [1, 2, 3])
    order = find_resume_checkpoints(base, s3_utils=io.s3)
    assert order[0] == f"{base}/step=3-last.ckpt" == find_resume_checkpoint(base, s3_utils=io.s3)
    assert order[1:] == [f"{base}/step=3.ckpt", f"{base}/step=2.ckpt", f"{base}/step=1.ckpt"]
    assert find_resume_checkpoints(base, s3_utils=io.s3, fallbacks=False) == order[:1]
    io.remove_checkpoint(f"{base}/step=3-last.ckpt")  # top-k files alone are not resumed from, as before
    with pytest.raises(CheckpointNotFoundError):
        find_resume_checkpoints(base, s3_utils=io.s3)


@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_a_newest_checkpoint_that_does_not_verify_is_skipped_loudly_and_kept(
    io: S3CheckpointIO, bucket: str, s3_client: Any, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    base = f"s3://{bucket}/run"
    save_run(io, base, [1, 2])
    key = "run/step=2-last.ckpt"
    if damage == "corrupt":
        corrupt(s3_client, bucket, key)
    else:  # a truncated object that carries a checksum of its own: it verifies, but does not unpickle
        body = s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()
        S3Utils().remove_object(f"{base}/step=2-last.ckpt")
        s3_client.put_object(Bucket=bucket, Key=key, Body=body[: len(body) // 2], ChecksumAlgorithm="CRC32")
    order = find_resume_checkpoints(base, s3_utils=io.s3)
    with caplog.at_level(logging.WARNING, logger="connector"):
        url, checkpoint = load_newest_usable(order, io.load_checkpoint)
    assert url == f"{base}/step=2.ckpt"  # the same step, from its top-k file
    assert checkpoint["step"] == 2 and torch.equal(checkpoint["w"], state(2)["w"])
    warning = next(r for r in caplog.records if r.levelno == logging.WARNING and "Not resuming from" in r.message)
    assert f"{base}/step=2-last.ckpt" in warning.message and "not deleted" in warning.message
    assert io.s3.s3_path_exists(f"{base}/step=2-last.ckpt")  # never deleted
    expected = ChecksumMismatchError if damage == "corrupt" else NotACheckpointError
    with pytest.raises(expected):  # strict: today's behaviour
        load_newest_usable(order, io.load_checkpoint, fallback=False)


def test_when_nothing_loads_the_last_failure_is_raised_naming_what_was_skipped(
    io: S3CheckpointIO, bucket: str, s3_client: Any
) -> None:
    base = f"s3://{bucket}/run"
    save_run(io, base, [1])
    for key in ("run/step=1-last.ckpt", "run/step=1.ckpt"):
        corrupt(s3_client, bucket, key)
    with pytest.raises(ChecksumMismatchError) as raised:
        load_newest_usable(find_resume_checkpoints(base, s3_utils=io.s3), io.load_checkpoint)
    assert "step=1-last.ckpt" in "".join(raised.value.__notes__)


def test_other_failures_are_raised_not_skipped(io: S3CheckpointIO, bucket: str) -> None:
    calls = []

    def load(url: str) -> None:
        calls.append(url)
        raise PermissionError(f"{url}: access denied")

    with pytest.raises(PermissionError):
        load_newest_usable(["s3://b/new-last.ckpt", "s3://b/old.ckpt"], load)
    assert calls == ["s3://b/new-last.ckpt"]
    assert not is_unusable_checkpoint_error(PermissionError("x"))
    assert is_unusable_checkpoint_error(RuntimeError("wrapped").with_traceback(None)) is False
    wrapped = RuntimeError("load failed")
    wrapped.__cause__ = ChecksumMismatchError("s3://b/k is corrupt")
    assert is_unusable_checkpoint_error(wrapped)


def dcp_save(url: str, step: int) -> None:
    dcp.save(state(step), storage_writer=s3_dcp.S3StorageWriter(url), no_dist=True)


def dcp_load(url: str) -> dict[str, Any]:
    target = {"step": 0, "w": torch.zeros(16)}
    dcp.load(target, storage_reader=s3_dcp.S3StorageReader(url), no_dist=True)
    return target


@pytest.mark.parametrize("damage", ["missing shard", "unreadable metadata"])
def test_dcp_checkpoints_fall_back_alike(s3_server: Any, bucket: str, s3_client: Any, damage: str) -> None:
    base = f"s3://{bucket}/dcp"
    for step in (1, 2):
        dcp_save(f"{base}/step={step}.ckpt", step)
    dcp_save(f"{base}/step=2-last.ckpt", 2)
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix="dcp/step=2-last.ckpt/")["Contents"]
    if damage == "missing shard":
        shard = next(o["Key"] for o in listed if o["Key"].endswith(".distcp"))
        s3_client.delete_object(Bucket=bucket, Key=shard)
    else:
        replace_bytes(s3_client, bucket, "dcp/step=2-last.ckpt/.metadata", b"not a pickle")
    order = find_resume_checkpoints(base)
    assert order[:2] == [f"{base}/step=2-last.ckpt", f"{base}/step=2.ckpt"]
    url, loaded = load_newest_usable(order, dcp_load)
    assert url == f"{base}/step=2.ckpt" and torch.equal(loaded["w"], state(2)["w"])
    with pytest.raises(BaseException) as raised:  # DCP's CheckpointException is a BaseException
        load_newest_usable(order, dcp_load, fallback=False)
    assert is_unusable_checkpoint_error(raised.value)


def test_cli_verify_says_what_resume_skips(
    io: S3CheckpointIO, bucket: str, s3_client: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    base = f"s3://{bucket}/run"
    save_run(io, base, [1, 2])
    corrupt(s3_client, bucket, "run/step=2-last.ckpt")
    code = s3_checkpoint_cli.main(["verify", base])
    out = capsys.readouterr().out
    assert code == 1
    assert f"SKIPPED   {base}/step=2-last.ckpt" in out
    assert f"starts from {base}/step=2.ckpt" in out


@pytest.mark.lightning
@pytest.mark.parametrize("strict", [False, True], ids=["fallback", "strict"])
def test_a_lightning_resume_falls_back_unless_strict(
    s3_server: Any, bucket: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch, strict: bool
) -> None:
    """check_resume (NeMo-style config) picks the newest "-last", which does not load: fit resumes from the top-k
    checkpoint of the same step; with ``resume_fallback: false`` the fit fails as before."""
    from tiny_lightning import TOP_K_CHECKPOINT, lightning_family, tiny_module_class, tiny_trainer

    import connector

    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    pl = lightning_family("lightning.pytorch")
    dirpath = f"s3://{bucket}/exp/checkpoints"

    def config(**exp_manager: Any) -> dict[str, Any]:
        params = {**TOP_K_CHECKPOINT, "dirpath": dirpath, "filename": "tiny--{step}"}
        return {
            "s3_checkpointing": {"chunk_size_MB": 5, "max_write_concurrency": 2, "max_read_concurrency": 2},
            "exp_manager": {"checkpoint_callback_params": params, **exp_manager},
        }

    connector.configure_s3_checkpointing(trainer := tiny_trainer(pl, 6), config(resume_if_exists=False))
    trainer.fit(tiny_module_class(pl, optimizer="sgd")())
    key = "exp/checkpoints/tiny--step=6-last.ckpt"
    data = s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()
    replace_bytes(s3_client, bucket, key, data[: len(data) // 2])  # truncated by another tool: does not unpickle

    resumed = tiny_trainer(pl, 8)
    parts = connector.configure_s3_checkpointing(
        resumed, config(resume_if_exists=True, resume_fallback=not strict)
    )
    assert parts.resume_path == f"{dirpath}/tiny--step=6-last.ckpt"
    module = tiny_module_class(pl, optimizer="sgd")()
    if strict:
        with pytest.raises(NotACheckpointError):
            resumed.fit(module)
        return
    resumed.fit(module)
    assert module.started_at["global_step"] == 6
    assert resumed.ckpt_path == f"{dirpath}/tiny--step=6.ckpt"
