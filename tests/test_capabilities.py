"""What a store and bucket honours (`s3_utils.store_capabilities`): probed once per process on a temporary key that
is removed, the same record used by every protection that rests on it, and shown by ``s3-checkpoint-io doctor``."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fault_proxy import FaultProxy
from s3_servers import S3Endpoint

from s3_utils import CAPABILITIES, S3ClientSettings, S3Utils, store_capabilities

KNOWN = {  # what the local servers honour (docs/s3.md's table): moto ignores If-Match on CompleteMultipartUpload
    "moto": {"conditional_put": True, "conditional_complete": False, "conditional_delete": True},
    "seaweedfs": {"conditional_put": True, "conditional_complete": True, "conditional_delete": True},
}


def everything_in(s3_client: Any, bucket: str) -> tuple[list[str], list[str]]:
    keys = [item["Key"] for item in s3_client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    uploads = [item["Key"] for item in s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
    return keys, uploads


def test_probes_find_what_the_store_honours_and_leave_nothing_behind(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    s3_client.put_object(Bucket=bucket, Key="run/last.ckpt", Body=b"theirs")
    with caplog.at_level(logging.DEBUG, logger="s3_utils"):
        record = store_capabilities(S3Utils(), bucket, CAPABILITIES, prefix="run/")
    for name, value in KNOWN.get(s3_server.name, {}).items():
        assert getattr(record, name) is value, (name, record)
    assert all(getattr(record, name) is not None for name in CAPABILITIES), record
    assert record.multipart_checksum in ("FULL_OBJECT", "COMPOSITE", "none")
    assert everything_in(s3_client, bucket) == (["run/last.ckpt"], [])  # the probe's key and uploads are gone
    assert s3_client.get_object(Bucket=bucket, Key="run/last.ckpt")["Body"].read() == b"theirs"
    logged = [r.getMessage() for r in caplog.records if f"(bucket {bucket}): conditional_put: yes" in r.getMessage()]
    assert len(logged) == 1 and "conditional_delete: yes" in logged[0], caplog.text


def test_the_record_is_probed_once_per_process(s3_server: S3Endpoint, bucket: str, fault_proxy: FaultProxy) -> None:
    utils = S3Utils(settings=S3ClientSettings(endpoint_url=fault_proxy.endpoint_url))
    first = store_capabilities(utils, bucket, CAPABILITIES)
    sent = fault_proxy.count()
    assert sent > 0
    again = store_capabilities(S3Utils(settings=S3ClientSettings(endpoint_url=fault_proxy.endpoint_url)),
                               bucket, CAPABILITIES)
    assert again is first and fault_proxy.count() == sent  # cached: no request


@pytest.mark.parametrize("mode", ["ignore", "refuse"])
def test_a_store_without_conditions_is_recorded_as_such(
    mode: str, s3_server: S3Endpoint, bucket: str, s3_client: Any
) -> None:
    credentials = (s3_server.access_key, s3_server.secret_key)
    with FaultProxy(s3_server.endpoint_url, conditional_writes=mode, credentials=credentials) as proxy:
        utils = S3Utils(settings=S3ClientSettings(endpoint_url=proxy.endpoint_url))
        record = store_capabilities(utils, bucket, ("conditional_put", "conditional_complete"))
    assert record.conditional_put is False and record.conditional_complete is False
    assert everything_in(s3_client, bucket) == ([], [])


def test_doctor_prints_the_record_and_leaves_nothing(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import s3_checkpoint_cli

    assert s3_checkpoint_cli.main(["doctor", f"s3://{bucket}/runs/gpt"]) == 0
    out = capsys.readouterr().out
    assert f"bucket {bucket}:" in out
    for name in CAPABILITIES:
        assert f"  {name}: " in out
    assert "conditional_delete: yes  (fencing, rm and gc" in out or s3_server.name not in KNOWN
    assert everything_in(s3_client, bucket) == ([], [])


def test_a_fenced_multipart_commit_without_conditional_completes_warns_once_naming_the_store(
    s3_server: S3Endpoint, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    import torch

    from s3_checkpoint_io import S3CheckpointIO

    plugin = S3CheckpointIO(chunk_size_MB=5)
    store_capabilities(plugin.s3, bucket, ["conditional_complete"], "run/")  # as `doctor` does; saves never probe it
    big = {"w": torch.zeros(6 * 2**20 // 4)}  # two parts: a multipart commit
    with caplog.at_level(logging.WARNING, logger="s3_utils"):
        plugin.save_checkpoint(big, f"s3://{bucket}/run/a.ckpt")
        plugin.save_checkpoint(big, f"s3://{bucket}/run/b.ckpt")
    warned = [r.getMessage() for r in caplog.records if "on CompleteMultipartUpload" in r.getMessage()]
    honoured = store_capabilities(plugin.s3, bucket).conditional_complete
    assert len(warned) == (0 if honoured else 1), warned
    if warned:
        assert s3_server.endpoint_url in warned[0] and bucket in warned[0]


@pytest.mark.parametrize(
    ("endpoint", "aws"),
    [
        (None, True),  # boto3's default endpoint for the region
        ("https://s3.us-west-2.amazonaws.com", True),
        ("https://s3.cn-north-1.amazonaws.com.cn", True),  # the China partition
        ("https://s3.us-east-1.amazonaws.com:443/", True),  # a port and a trailing slash
        ("https://minio.example.internal:9000", False),
        ("https://amazonaws.com.example.org", False),  # the name appears, the host is not AWS's
    ],
)
def test_the_record_names_aws_s3_for_every_aws_endpoint(
    endpoint: str | None, aws: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record (the debug log, ``doctor``, the warnings) names AWS S3 for its endpoints in every partition, with
    or without a port; another store by its endpoint. Nothing is probed, nothing is sent."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):  # the suite's server, where a fixture set it
        monkeypatch.delenv(name, raising=False)
    utils = S3Utils(S3ClientSettings(endpoint_url=endpoint, region_name="us-east-1"))
    record = store_capabilities(utils, f"bucket-{abs(hash(endpoint)) % 10**6}")
    assert (record.store == "AWS S3") is aws, record.store
    assert aws or record.store == endpoint
