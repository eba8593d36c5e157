"""`S3CheckpointIO.records`: one `TransferRecord` per finished save and load, with the numbers the object has."""

from __future__ import annotations

import io
import pickle
import threading
from pathlib import Path

import pytest
import torch

from s3_checkpoint_io import S3CheckpointIO, TransferRecord


def checkpoint(seed: int) -> dict:
    return {"state_dict": {"w": torch.randn(64 * 1024, generator=torch.Generator().manual_seed(seed))}, "step": seed}


@pytest.mark.parametrize("async_checkpointing", [False, True], ids=["sync", "async"])
def test_saves_and_loads_leave_records_that_match_the_objects(
    async_checkpointing: bool, bucket: str, s3_client
) -> None:
    plugin = S3CheckpointIO(f"s3://{bucket}/ckpt", chunk_size_MB=5, async_checkpointing=async_checkpointing)
    urls = [f"s3://{bucket}/ckpt/step={step}.ckpt" for step in (1, 2)]
    for step, url in enumerate(urls, 1):
        plugin.save_checkpoint(checkpoint(step), url)
    plugin.wait_for_pending_saves()
    loaded = plugin.load_checkpoint(urls[1])
    plugin.teardown()
    assert torch.equal(loaded["state_dict"]["w"], checkpoint(2)["state_dict"]["w"])

    saves = [record for record in plugin.records if record.kind == "save"]
    loads = [record for record in plugin.records if record.kind == "load"]
    assert sorted(record.url for record in saves) == urls and [record.url for record in loads] == [urls[1]]
    for record in saves:
        head = s3_client.head_object(Bucket=bucket, Key=record.url.split("/", 3)[3], ChecksumMode="ENABLED")
        assert record.size == head["ContentLength"] > 256 * 1024
        algorithm, value = record.checksum.split(" ")
        assert algorithm in {"CRC32C", "CRC32", "CRC64NVME"} and value
        assert 0 < record.blocked_seconds and 0 < record.seconds
        if not async_checkpointing:
            assert record.blocked_seconds >= record.seconds  # the caller waited for the whole save
    (saved,) = [record for record in saves if record.url == urls[1]]
    assert loads[0].size == saved.size
    assert loads[0].checksum == saved.checksum  # the load was verified against what the save recorded
    assert loads[0].blocked_seconds == loads[0].seconds > 0
    with pytest.raises(AttributeError):
        loads[0].size = 0  # type: ignore[misc]  # frozen: a record is a fact


def test_a_load_of_an_object_nobody_recorded_a_checksum_for_has_none(bucket: str, s3_server) -> None:
    """Another tool wrote the checkpoint without a checksum: the load checks its size only, and its record says so."""
    client = s3_server.client(request_checksum_calculation="when_required")
    buffer = io.BytesIO()
    torch.save(checkpoint(3), buffer)
    client.put_object(Bucket=bucket, Key="foreign.ckpt", Body=buffer.getvalue())
    head = client.head_object(Bucket=bucket, Key="foreign.ckpt", ChecksumMode="ENABLED")
    if any(name.startswith("Checksum") and name != "ChecksumType" for name in head):
        pytest.skip(f"{s3_server.name} records a checksum for every object by itself")
    plugin = S3CheckpointIO(f"s3://{bucket}")
    loaded = plugin.load_checkpoint(f"s3://{bucket}/foreign.ckpt")
    assert loaded["step"] == 3
    (record,) = plugin.records
    assert (record.kind, record.size, record.checksum) == ("load", len(buffer.getvalue()), None)


def test_async_record_says_how_long_the_caller_was_blocked(bucket: str) -> None:
    """The save is held in the background for 0.5 s: the record keeps the caller's blocked time (the snapshot)."""
    plugin = S3CheckpointIO(f"s3://{bucket}/ckpt", chunk_size_MB=5, async_checkpointing=True)
    gate = threading.Event()
    save_now = plugin._save_now

    def held(*args, **kwargs):
        gate.wait(10)
        return save_now(*args, **kwargs)

    plugin._save_now = held  # type: ignore[method-assign]
    plugin.save_checkpoint(checkpoint(1), f"s3://{bucket}/ckpt/held.ckpt")
    blocked = plugin.last_save_blocked_s
    assert list(plugin.records) == []  # not finished yet: no record
    threading.Timer(0.5, gate.set).start()
    plugin.teardown()
    (record,) = plugin.records
    assert record.blocked_seconds == blocked
    assert record.kind == "save" and record.seconds > 0
    assert record.blocked_seconds < 0.5  # the caller was back before the held save even started


def test_local_paths_are_recorded_and_failed_saves_are_not(tmp_path: Path, bucket: str) -> None:
    plugin = S3CheckpointIO(str(tmp_path))
    path = str(tmp_path / "a.ckpt")
    plugin.save_checkpoint(checkpoint(1), path)
    plugin.load_checkpoint(path)
    assert [(r.kind, r.url, r.size, r.checksum) for r in plugin.records] == [
        ("save", path, Path(path).stat().st_size, None),
        ("load", path, Path(path).stat().st_size, None),
    ]
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):  # a lambda cannot be pickled
        plugin.save_checkpoint({**checkpoint(2), "hook": lambda: 0}, f"s3://{bucket}/failed.ckpt")
    assert len(plugin.records) == 2


def test_records_are_bounded_and_do_not_travel_with_a_pickled_plugin(tmp_path: Path) -> None:
    plugin = S3CheckpointIO(str(tmp_path))
    for index in range(1005):
        plugin.records.append(TransferRecord("save", f"x{index}", 1, 0.0, None, 0.0))
    assert len(plugin.records) == 1000 and plugin.records[0].url == "x5"
    copy = pickle.loads(pickle.dumps(plugin))
    assert list(copy.records) == [] and copy.records.maxlen == 1000
