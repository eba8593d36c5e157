"""Bucket kinds beyond general purpose buckets: how requests are addressed (directory buckets and access point ARNs
are virtual-hosted only), the default checksum on directory buckets, and access point aliases and ARNs end to end
against the local servers through the proxy's access point mapping."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fault_proxy import FaultProxy

import connector
from s3_checkpoint_io import S3CheckpointIO
from s3_utils import ChecksumAlgorithm, S3ClientSettings, S3Utils

DIRECTORY = "ckpt--use1-az4--x-s3"
ARN = "arn:aws:s3:us-east-1:123456789012:accesspoint/my-ap"
ALIAS = "my-ap-hrzrlukc5m36ft7okagglf3gmwluquse1b-s3alias"


class _Sent(BaseException):
    """Raised by the capturing hook so that nothing leaves the process."""


@pytest.fixture
def offline_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "missing-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "missing-credentials"))


def first_request_host_and_path(utils: S3Utils, url: str) -> tuple[str, str]:
    """Host and path of the first request `utils.head_object(url)` sends (CreateSession for a directory bucket)."""
    seen: list[Any] = []

    def capture(request: Any, **_: Any) -> None:
        seen.append(request)
        raise _Sent

    utils.client.meta.events.register_first("before-send.s3", capture)
    try:
        with pytest.raises(_Sent):
            utils.head_object(url)
    finally:
        utils.client.meta.events.unregister("before-send.s3", capture)
    host = seen[0].headers["host"]
    host = host.decode() if isinstance(host, bytes) else host
    return host, seen[0].url.split(host, 1)[1]


# ---- addressing ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bucket", "host", "path"),
    [
        ("general-bkt", "s3.example.test:9000", "/general-bkt/k"),  # path style for a custom endpoint
        (ALIAS, "s3.example.test:9000", f"/{ALIAS}/k"),  # an alias is a bucket name: same as the others
        (DIRECTORY, f"{DIRECTORY}.s3.example.test:9000", "/?session"),  # virtual-hosted, CreateSession first
        (ARN, "my-ap-123456789012.s3.example.test:9000", "/k"),  # virtual-hosted: {name}-{account}
    ],
)
def test_directory_buckets_and_arns_are_virtual_hosted_even_with_a_path_style_endpoint(
    offline_credentials: None, bucket: str, host: str, path: str
) -> None:
    """Pins botocore's endpoint rules that this package relies on instead of a second client per style."""
    utils = S3Utils(S3ClientSettings(endpoint_url="http://s3.example.test:9000", user_agent_extra=uuid.uuid4().hex))
    assert utils.settings.addressing_style == "path" and utils.settings.path_style_by_default
    assert first_request_host_and_path(utils, f"s3://{bucket}/k") == (host, path)


@pytest.mark.parametrize(
    ("bucket", "host"),
    [
        (DIRECTORY, f"{DIRECTORY}.s3express-use1-az4.us-east-1.amazonaws.com"),
        (ARN, "my-ap-123456789012.s3-accesspoint.us-east-1.amazonaws.com"),
        (ALIAS, f"{ALIAS}.s3.amazonaws.com"),
    ],
)
def test_aws_endpoints_for_each_kind(offline_credentials: None, bucket: str, host: str) -> None:
    utils = S3Utils(S3ClientSettings(user_agent_extra=uuid.uuid4().hex))
    assert first_request_host_and_path(utils, f"s3://{bucket}/k")[0] == host


@pytest.mark.parametrize(("bucket", "what"), [(DIRECTORY, "directory bucket"), (ARN, "access point ARN")])
def test_explicit_path_style_refuses_virtual_hosted_only_buckets(offline_credentials: None, bucket: str, what: str):
    settings = S3ClientSettings(endpoint_url="http://s3.example.test:9000", addressing_style="path")
    utils = S3Utils(settings)
    assert not utils.settings.path_style_by_default
    with pytest.raises(ValueError, match="addressing_style='path'") as info:
        utils.head_object(f"s3://{bucket}/ckpt/last.ckpt")
    message = str(info.value)
    assert f"s3://{bucket}/ckpt/last.ckpt" in message and what in message and "Leave addressing_style unset" in message
    # Other buckets still go path style under the same explicit setting.
    assert first_request_host_and_path(utils, "s3://general-bkt/k") == ("s3.example.test:9000", "/general-bkt/k")


def test_default_checksum_is_one_directory_buckets_support() -> None:
    """AWS documents CRC32, CRC32C, SHA-1 and SHA-256 (and CRC64NVME since) for directory buckets; full-object
    checksums of multipart uploads are CRC-only. The default is CRC32C (CRC32 without awscrt): supported either way,
    and a store that still refuses full-object checksums gets the sidecar record instead (see the writer)."""
    assert ChecksumAlgorithm.named("auto").name in {"CRC32", "CRC32C"}
    assert ChecksumAlgorithm.named(None).name in {"CRC32", "CRC32C"}


# ---- access points end to end (the proxy maps the names to a real bucket and re-signs) ---------------------------


@pytest.fixture
def access_point_proxy(s3_server: Any, bucket: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """A proxy that serves `bucket` as the alias `ALIAS` and as the access point behind `ARN`. It is also this
    process's HTTP proxy, so that boto3 can reach ``my-ap-123456789012.127.0.0.1`` without DNS."""
    if not s3_server.endpoint_url.startswith("http://"):
        pytest.skip("FaultProxy forwards plain http:// endpoints only")
    mapping = {ALIAS: bucket, "my-ap-123456789012": bucket}
    credentials = (s3_server.access_key, s3_server.secret_key)
    with FaultProxy(s3_server.endpoint_url, access_points=mapping, credentials=credentials) as proxy:
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        for name in ("HTTP_PROXY", "http_proxy"):
            monkeypatch.setenv(name, proxy.endpoint_url)
        yield proxy


def small_checkpoint(seed: int) -> dict[str, Any]:
    return {"state_dict": {"w": torch.arange(1000, dtype=torch.float32) + seed}, "global_step": seed}


@pytest.mark.parametrize("base", [f"s3://{ALIAS}", f"s3://{ARN}"], ids=["alias", "arn"])
def test_checkpoints_through_an_access_point(
    base: str, access_point_proxy: FaultProxy, s3_client: Any, bucket: str
) -> None:
    dirpath = f"{base}/run"
    plugin = S3CheckpointIO(dirpath, chunk_size_MB=5, endpoint_url=access_point_proxy.endpoint_url)
    try:
        plugin.save_checkpoint(small_checkpoint(3), f"{dirpath}/tiny--step=3-last.ckpt")
        plugin.save_checkpoint({"big": torch.zeros(3 * 1024 * 1024)}, f"{dirpath}/big.ckpt")  # multipart
        plugin.save_checkpoint(small_checkpoint(5), f"{dirpath}/tiny--step=5-last.ckpt")
        loaded = plugin.load_checkpoint(f"{dirpath}/tiny--step=5-last.ckpt")
        assert torch.equal(loaded["state_dict"]["w"], small_checkpoint(5)["state_dict"]["w"])
        found = connector.find_resume_checkpoint(dirpath, s3_utils=plugin.s3)
        assert found == f"{dirpath}/tiny--step=5-last.ckpt"  # the URL keeps the alias / ARN
        plugin.remove_checkpoint(f"{dirpath}/big.ckpt")
    finally:
        plugin.teardown()
    stored = sorted(o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket).get("Contents", []))
    assert [key for key in stored if key.endswith(".ckpt")] == [
        "run/tiny--step=3-last.ckpt",
        "run/tiny--step=5-last.ckpt",
    ]
    assert access_point_proxy.count() > 0
    if base.endswith(ARN):
        assert all(r.path.startswith(f"/{bucket}") for r in access_point_proxy.requests)


def test_cli_lists_and_verifies_through_an_arn(
    access_point_proxy: FaultProxy, bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import s3_checkpoint_cli as cli

    plugin = S3CheckpointIO(f"s3://{ARN}/run", endpoint_url=access_point_proxy.endpoint_url)
    try:
        plugin.save_checkpoint(small_checkpoint(2), f"s3://{ARN}/run/tiny--step=2.ckpt")
    finally:
        plugin.teardown()
    capsys.readouterr()
    assert cli.main(["ls", f"s3://{ARN}/run", "--endpoint-url", access_point_proxy.endpoint_url]) == 0
    assert f"s3://{ARN}/run/tiny--step=2.ckpt" in capsys.readouterr().out
    assert cli.main(["verify", f"s3://{ARN}/run", "--endpoint-url", access_point_proxy.endpoint_url]) == 0
    assert "OK " in capsys.readouterr().out


# ---- the directory-bucket proxy's ETags (what the directory tests rely on) ----------------------------------------


@pytest.mark.parametrize("bucket", ["directory"], indirect=True)
def test_proxy_etags_are_per_object_and_conditions_are_translated(s3_client: Any, bucket: str) -> None:
    import hashlib

    botocore_exceptions = pytest.importorskip("botocore.exceptions")
    body = b"same bytes"
    first = s3_client.put_object(Bucket=bucket, Key="a", Body=body)["ETag"]
    second = s3_client.put_object(Bucket=bucket, Key="b", Body=body)["ETag"]
    assert first != second  # same content, two objects: two ETags (S3 Express ETags are not content digests)
    assert s3_client.head_object(Bucket=bucket, Key="a")["ETag"] == first
    assert s3_client.get_object(Bucket=bucket, Key="a", IfMatch=first)["Body"].read() == body
    with pytest.raises(botocore_exceptions.ClientError, match=r"304|Not Modified"):
        s3_client.get_object(Bucket=bucket, Key="a", IfNoneMatch=first)
    md5 = f'"{hashlib.md5(body).hexdigest()}"'
    with pytest.raises(botocore_exceptions.ClientError, match=r"PreconditionFailed|412"):
        s3_client.get_object(Bucket=bucket, Key="a", IfMatch=md5)  # the store's own ETag is not the client's
    rewritten = s3_client.put_object(Bucket=bucket, Key="a", Body=b"new bytes")["ETag"]
    assert rewritten not in (first, second)
    with pytest.raises(botocore_exceptions.ClientError, match=r"PreconditionFailed|412"):
        s3_client.get_object(Bucket=bucket, Key="a", IfMatch=first)  # replaced: the old ETag no longer matches
