"""Retries against real injected faults: a fault-injecting proxy between the client and the S3 server."""

from __future__ import annotations

import io
import os
import time

import pytest
import torch
from botocore.exceptions import ClientError, ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError, SSLError
from fault_proxy import Fault, FaultRule

from s3_checkpoint_io import S3CheckpointIO
from s3_pacing import is_retriable_error
from s3_utils import (
    ChecksumMismatchError,
    RetryPolicy,
    S3ClientSettings,
    S3Utils,
    is_throttling_error,
)

MiB = 1024 * 1024
FAST = RetryPolicy(max_attempts=5, initial_backoff_s=0.01, max_backoff_s=0.05)


@pytest.fixture
def utils(fault_proxy) -> S3Utils:
    settings = S3ClientSettings(endpoint_url=fault_proxy.endpoint_url, read_timeout_s=2, connect_timeout_s=2)
    return S3Utils(settings, FAST)


def upload(utils: S3Utils, url: str, data: bytes) -> None:
    with utils.open_writer(url, chunk_size_MB=5, max_concurrency=2) as writer:
        writer.write(data)


def open_uploads(s3_client, bucket: str) -> list[str]:
    return [u["Key"] for u in s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def test_slow_down_on_parts_is_retried_until_success(utils, fault_proxy, bucket: str) -> None:
    rule = fault_proxy.add_rule(FaultRule(Fault.slow_down(), method="PUT", query="partNumber=", times=3))
    data = os.urandom(12 * MiB)
    upload(utils, f"s3://{bucket}/a.bin", data)
    assert rule.fired == 3
    assert utils.retries == 3
    assert fault_proxy.count(method="PUT", query_contains="partNumber=", faulted=True) == 3
    assert utils.download_s3_file_to_stream(f"s3://{bucket}/a.bin", chunk_size_MB=5).read() == data


def test_access_denied_fails_at_once_with_the_original_error(utils, fault_proxy, s3_client, bucket) -> None:
    fault_proxy.add_rule(
        FaultRule(Fault.status(403, "AccessDenied", "Access Denied"), method="PUT", query="partNumber=")
    )
    with pytest.raises(ClientError) as raised:
        upload(utils, f"s3://{bucket}/denied.bin", os.urandom(5 * MiB))  # exactly one part
    assert raised.value.response["Error"]["Code"] == "AccessDenied"
    assert any(f"s3://{bucket}/denied.bin" in note for note in raised.value.__notes__)
    assert utils.retries == 0
    assert fault_proxy.count(method="PUT", query_contains="partNumber=", faulted=True) == 1
    assert open_uploads(s3_client, bucket) == []


def test_exhausted_retries_raise_the_original_error_not_retry_error(utils, fault_proxy, bucket: str) -> None:
    fault_proxy.add_rule(FaultRule(Fault.status(500, "InternalError"), method="HEAD"))
    with pytest.raises(ClientError) as raised:
        utils.head_object(f"s3://{bucket}/k")
    assert raised.value.response["Error"]["Code"] in {"InternalError", "500"}
    assert fault_proxy.count(method="HEAD") == FAST.max_attempts
    assert utils.retries == FAST.max_attempts - 1
    assert "max retries" not in str(raised.value)  # botocore's "(reached max retries: 0)": this layer retried
    (note,) = raised.value.__notes__
    assert f"gave up after {FAST.max_attempts} attempts over " in note and "the last answer 500" in note


def test_throttling_without_any_success_fails_after_max_elapsed_s(fault_proxy, bucket: str) -> None:
    """A throttled request does not count attempts, but with no success at all it gives up after max_elapsed_s,
    saying how many attempts over how many seconds, the last code and its request id."""
    policy = RetryPolicy(max_attempts=2, max_elapsed_s=1.5, initial_backoff_s=0.01, max_backoff_s=0.05)
    utils = S3Utils(S3ClientSettings(endpoint_url=fault_proxy.endpoint_url), policy)
    fault_proxy.add_rule(FaultRule(Fault.slow_down(), method="GET", query="list-type=2"))
    assert utils.client is not None
    started = time.monotonic()
    with pytest.raises(ClientError) as raised:
        utils.list_objects(f"s3://{bucket}/x")
    elapsed = time.monotonic() - started
    assert raised.value.response["Error"]["Code"] == "SlowDown"
    assert 1.5 <= elapsed < 10
    attempts = fault_proxy.count(method="GET", query_contains="list-type=2")
    assert attempts > policy.max_attempts  # throttling answers did not use up attempts
    assert "max retries" not in str(raised.value)
    (note,) = raised.value.__notes__
    request_id = raised.value.response["ResponseMetadata"]["RequestId"]
    assert f"gave up after {attempts} attempts over " in note and "the last answer SlowDown" in note
    assert f"request id {request_id}" in note and f"s3://{bucket}/x" in note
    assert utils.pacer(f"s3://{bucket}").reads.active and not utils.pacer(f"s3://{bucket}").writes.active


def test_total_time_bounds_the_retries(fault_proxy, bucket: str) -> None:
    policy = RetryPolicy(max_attempts=1000, max_elapsed_s=1.0, initial_backoff_s=0.05, max_backoff_s=0.2)
    utils = S3Utils(S3ClientSettings(endpoint_url=fault_proxy.endpoint_url), policy)
    fault_proxy.add_rule(FaultRule(Fault.status(500, "InternalError"), method="GET"))
    assert utils.client is not None  # built before the clock starts: creating a client is not a retry
    started = time.monotonic()
    with pytest.raises(ClientError, match="InternalError"):
        utils.list_objects(f"s3://{bucket}/x")
    assert time.monotonic() - started < 3.0
    assert 2 <= fault_proxy.count(method="GET") < 100


@pytest.mark.parametrize(
    ("operation", "make_rule"),  # factories: a rule counts what it fired, so each test run needs a fresh one
    [
        ("list", lambda: FaultRule(Fault.status(500, "InternalError"), method="GET", query="list-type=2", times=2)),
        ("head", lambda: FaultRule(Fault.slow_down(), method="HEAD", times=2)),
        ("delete", lambda: FaultRule(Fault.slow_down(), method="POST", query="delete", times=2)),
        ("put", lambda: FaultRule(Fault.reset_before_response(), method="PUT", times=2)),
        ("get", lambda: FaultRule(Fault.reset_mid_response(after_bytes=100), method="GET", query_regex="^$", times=2)),
    ],
)
def test_every_kind_of_call_is_retried(utils, fault_proxy, s3_client, bucket: str, operation: str, make_rule) -> None:
    s3_client.put_object(Bucket=bucket, Key="dir/k", Body=b"v" * 1000)
    rule = fault_proxy.add_rule(make_rule())
    url = f"s3://{bucket}/dir/k"
    calls = {
        "list": lambda: [o.key for o in utils.list_objects(f"s3://{bucket}/dir")] == ["dir/k"],
        "head": lambda: utils.head_object(url).size == 1000,
        "delete": lambda: utils.remove_object(url) is None and not utils.s3_path_exists(url),
        "put": lambda: utils.upload_file_stream_to_s3(io.BytesIO(b"new"), url) is None,
        "get": lambda: utils.download_s3_file_to_stream(url).read() == b"v" * 1000,
    }
    assert calls[operation]()
    assert rule.fired == 2
    assert utils.retries == 2


def test_stalled_response_times_out_and_is_retried(utils, fault_proxy, s3_client, bucket: str) -> None:
    s3_client.put_object(Bucket=bucket, Key="k", Body=b"payload")
    rule = fault_proxy.add_rule(FaultRule(Fault.stall(5), method="GET", times=1))
    assert utils.download_s3_file_to_stream(f"s3://{bucket}/k").read() == b"payload"
    assert rule.fired == 1
    assert utils.retries == 1


def test_truncated_range_is_retried(utils, fault_proxy, bucket: str) -> None:
    data = os.urandom(11 * MiB)
    upload(utils, f"s3://{bucket}/t.bin", data)
    rule = fault_proxy.add_rule(FaultRule(Fault.truncate_body(4096), method="GET", path_regex=r"t\.bin$", times=2))
    assert utils.download_s3_file_to_stream(f"s3://{bucket}/t.bin", chunk_size_MB=5).read() == data
    assert rule.fired == 2


def test_corrupted_download_is_never_returned(utils, fault_proxy, bucket: str) -> None:
    data = os.urandom(11 * MiB)
    upload(utils, f"s3://{bucket}/c.bin", data)
    fault_proxy.add_rule(FaultRule(Fault.corrupt_body(offset=777), method="GET", path_regex=r"c\.bin$", times=1))
    with pytest.raises(ChecksumMismatchError, match=f"s3://{bucket}/c.bin"):
        utils.download_s3_file_to_stream(f"s3://{bucket}/c.bin", chunk_size_MB=5)


def test_async_upload_failure_keeps_the_previous_checkpoint(fault_proxy, s3_client, bucket: str) -> None:
    plugin = S3CheckpointIO(
        f"s3://{bucket}/ckpts",
        chunk_size_MB=5,
        async_checkpointing=True,
        endpoint_url=fault_proxy.endpoint_url,
        retry_policy=FAST,
    )
    older = {"w": torch.randn(3 * MiB)}
    plugin.save_checkpoint(older, f"s3://{bucket}/ckpts/step-1.ckpt")
    plugin.wait_for_pending_saves()
    fault_proxy.add_rule(FaultRule(Fault.status(500, "InternalError"), method="PUT", path_regex=r"step-2\.ckpt$"))
    plugin.save_checkpoint({"w": torch.randn(3 * MiB)}, f"s3://{bucket}/ckpts/step-2.ckpt")
    plugin.remove_checkpoint(f"s3://{bucket}/ckpts/step-1.ckpt")  # ModelCheckpoint's clean-up of the older one
    with pytest.raises(ClientError, match="InternalError"):
        plugin.teardown()
    keys = sorted(o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket).get("Contents", []))
    assert [k for k in keys if k.endswith(".ckpt")] == ["ckpts/step-1.ckpt"]
    assert open_uploads(s3_client, bucket) == []
    assert torch.equal(plugin.load_checkpoint(f"s3://{bucket}/ckpts/step-1.ckpt")["w"], older["w"])


def client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op")


@pytest.mark.parametrize(
    ("error", "retriable"),
    [
        (client_error("SlowDown", 503), True),
        (client_error("ServiceUnavailable", 503), True),
        (client_error("InternalError", 500), True),
        (client_error("RequestTimeout", 400), True),
        (client_error("Throttling", 400), True),
        (client_error("TooManyRequestsException", 429), True),
        (client_error("503", 503), True),
        (client_error("AccessDenied", 403), False),
        (client_error("NoSuchBucket", 404), False),
        (client_error("NoSuchKey", 404), False),
        (client_error("InvalidRequest", 400), False),
        (client_error("ExpiredToken", 400), False),
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), True),
        (ConnectTimeoutError(endpoint_url="http://127.0.0.1:1"), True),
        (ReadTimeoutError(endpoint_url="http://127.0.0.1:1"), True),
        (ConnectionResetError(), True),
        (SSLError(endpoint_url="https://x", error="bad certificate"), False),
        (ValueError("bug"), False),
    ],
)
def test_retriable_classification(error: BaseException, retriable: bool) -> None:
    assert is_retriable_error(error) is retriable


@pytest.mark.parametrize(
    ("error", "throttling"),
    [
        (client_error("SlowDown", 503), True),
        (client_error("503", 503), True),  # a throttled HEAD: no body, no code
        (client_error("ServiceUnavailable", 503), True),
        (client_error("TooManyRequestsException", 429), True),
        (client_error("Throttling", 400), True),
        (client_error("InternalError", 500), False),
        (client_error("RequestTimeout", 400), False),
        (client_error("AccessDenied", 403), False),
        (ConnectionResetError(), False),
    ],
)
def test_throttling_answers_are_a_subset_of_the_retriable_ones(error: BaseException, throttling: bool) -> None:
    assert is_throttling_error(error) is throttling
    assert not throttling or is_retriable_error(error)
