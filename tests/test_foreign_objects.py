"""Objects uploaded by other tools: boto3's own multipart upload (what ``aws s3 cp`` does) loads, through
S3CheckpointIO and the CLI, although some stores report a checksum for it that is not the object's; a typed
full-object checksum that does not match still fails."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_proxy import Fault, FaultProxy, FaultRule

import s3_checkpoint_cli as cli
from s3_checkpoint_io import S3CheckpointIO
from s3_utils import ChecksumMismatchError, S3ClientSettings, S3ObjectInfo, S3Utils, _ChecksumRecords

MiB = 1024 * 1024
CRC32_OF_PARTS = "IBFDMg=="  # any base64 CRC32: the rule looks at the type and the ETag, not the value


def info(etag: str, checksum_type: str | None, value: str = CRC32_OF_PARTS) -> S3ObjectInfo:
    return S3ObjectInfo(
        "bucket", "run/x.ckpt", 10, etag, checksums={"ChecksumCRC32": value}, checksum_type=checksum_type
    )


def test_untyped_checksum_of_a_multipart_object_is_not_the_objects(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="s3_utils"):
        assert _ChecksumRecords.native(info('"9b2cf535f27731c974343645a3985328-3"', None)) is None
    assert "s3://bucket/run/x.ckpt: the store's CRC32 IBFDMg== cannot be used" in caplog.text
    assert "without a ChecksumType for a multipart object" in caplog.text
    # Still used: the same checksum typed as the object's, an untyped one of a single PUT (no "-N" in the ETag).
    assert _ChecksumRecords.native(info('"9b2cf535f27731c974343645a3985328-3"', "FULL_OBJECT")).value == CRC32_OF_PARTS
    assert _ChecksumRecords.native(info('"9b2cf535f27731c974343645a3985328"', None)).source == "s3"
    # Never used: a composite checksum, typed or spelled "-N".
    assert _ChecksumRecords.native(info('"x-3"', "COMPOSITE")) is None
    assert _ChecksumRecords.native(info('"x-3"', None, CRC32_OF_PARTS + "-3")) is None


def upload_like_aws_cli(s3_server: Any, bucket: str, key: str, body: bytes) -> dict[str, Any]:
    """Upload with boto3's transfer manager, multipart from 5 MiB (as ``aws s3 cp`` does past its threshold); the
    HEAD the store then answers."""
    from boto3.s3.transfer import TransferConfig

    client = s3_server.client()
    config = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    client.upload_fileobj(io.BytesIO(body), bucket, key, Config=config)
    head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    assert head["ETag"].rstrip('"').endswith("-2"), head["ETag"]  # really a multipart object
    return head


def test_foreign_multipart_upload_loads_with_s3checkpointio_and_the_cli(
    bucket: str, s3_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = {"weight": torch.arange(1.3 * MiB, dtype=torch.float32), "step": 7}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    head = upload_like_aws_cli(s3_server, bucket, "run/foreign-step=7.ckpt", buffer.getvalue())
    url = f"s3://{bucket}/run/foreign-step=7.ckpt"

    plugin = S3CheckpointIO(f"s3://{bucket}/run", chunk_size_MB=5)
    try:
        loaded = plugin.load_checkpoint(url)
    finally:
        plugin.teardown()
    assert torch.equal(loaded["weight"], state["weight"]) and loaded["step"] == 7
    assert plugin.records[-1].checksum is None  # nothing usable was recorded: its size was checked
    # moto reports the CRC32 of the part CRCs, untyped and without "-2"; SeaweedFS types it COMPOSITE: neither counts.
    assert head.get("ChecksumType") in (None, "COMPOSITE") and "ChecksumCRC32" in head

    code, out, _ = cli.main(["verify", url]), *capsys.readouterr()
    assert code == cli.EXIT_VERIFY_FAILED
    assert "no checksum was recorded for it" in out and "is corrupt" not in out
    code, out, _ = cli.main(["verify", "--allow-unverified", url]), *capsys.readouterr()
    assert code == cli.EXIT_OK and "size only" in out
    code, out, err = cli.main(["cp", url, str(tmp_path)]), *capsys.readouterr()
    assert code == cli.EXIT_OK, err
    assert "no checksum recorded: size checked only" in out
    assert (tmp_path / "foreign-step=7.ckpt").read_bytes() == buffer.getvalue()


def test_multipart_object_with_a_typed_full_object_checksum_still_fails_on_a_mismatch(
    bucket: str, fault_proxy: FaultProxy, s3_client: Any
) -> None:
    url = f"s3://{bucket}/run/own.ckpt"
    with S3Utils().open_writer(url, 5) as writer:
        writer.write(bytes(range(256)) * (5 * MiB // 256 + 1))
    head = s3_client.head_object(Bucket=bucket, Key="run/own.ckpt", ChecksumMode="ENABLED")
    assert head["ETag"].rstrip('"').endswith("-2") and head.get("ChecksumType") == "FULL_OBJECT"
    fault_proxy.add_rule(FaultRule(Fault.corrupt_body(offset=3), method="GET", path_regex=r"/own\.ckpt$"))
    through_proxy = S3Utils(S3ClientSettings(endpoint_url=fault_proxy.endpoint_url))
    with pytest.raises(ChecksumMismatchError, match=rf"{url} is corrupt"):
        through_proxy.download_to_memory(url, chunk_size_MB=5)
