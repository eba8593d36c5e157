"""What production S3 users need: request options (encryption, storage class, tags, bucket owner, requester pays),
a User-Agent that names this package, errors that carry S3's request ids, retries of replies that cannot be parsed.

Against the real servers of the suite (moto, SeaweedFS); what each store does with each option is pinned in
`OPTION_BEHAVIOUR` and documented in docs/s3.md ("Production request options").
"""

from __future__ import annotations

import os
from typing import Any

import botocore.parsers
import pytest
import torch
from botocore.exceptions import ClientError
from fault_proxy import Fault, FaultRule

import connector
import s3_checkpoint_cli as cli
from s3_checkpoint_io import S3CheckpointIO
from s3_pacing import is_retriable_error
from s3_utils import RetryPolicy, S3ClientSettings, S3RequestOptions, S3Utils, __version__

MiB = 1024 * 1024
FAST = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05)
SIZES = pytest.mark.parametrize("size", [1000, 12 * MiB], ids=["single-put", "multipart"])
OWNER = "111122223333"


def _write(utils: S3Utils, url: str, size: int) -> bytes:
    data = os.urandom(size)
    with utils.open_writer(url, chunk_size_MB=5, max_concurrency=2) as writer:
        writer.write(data)
    return data


def _open_uploads(s3_client: Any, bucket: str) -> list[str]:
    return [u["Key"] for u in s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


# ---- the option object: allow-list and values, checked up front ---------------------------------------------------


def test_unknown_option_names_the_allowed_ones_and_the_s3_spelling() -> None:
    with pytest.raises(
        ValueError,
        match=r"Unknown S3 request option\(s\) 'server_side_encryption' \(did you mean "
        r"'ServerSideEncryption'\?\), 'ACL'; allowed: \['ServerSideEncryption'",
    ):
        S3RequestOptions.from_mapping({"server_side_encryption": "AES256", "ACL": "public-read"})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ServerSideEncryption": "aws:kmx"}, "ServerSideEncryption must be one of"),
        ({"SSEKMSKeyId": "alias/k"}, "SSEKMSKeyId needs ServerSideEncryption"),
        ({"ServerSideEncryption": "AES256", "BucketKeyEnabled": True}, "BucketKeyEnabled needs"),
        ({"ServerSideEncryption": "aws:kms", "BucketKeyEnabled": "yes"}, "BucketKeyEnabled must be true or false"),
        ({"StorageClass": "GLACIER"}, "need a restore before a load"),
        ({"StorageClass": "standard"}, "StorageClass must be one of"),
        ({"Tagging": "=x"}, "Tagging must be key=value pairs"),
        ({"ExpectedBucketOwner": "owner"}, "12-digit AWS account id"),
        ({"RequestPayer": "me"}, "RequestPayer must be 'requester'"),
    ],
)
def test_bad_values_are_refused_up_front(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        S3RequestOptions.from_mapping(options)


def test_tags_as_a_mapping_and_account_ids_as_ints_are_normalised() -> None:
    options = S3RequestOptions(Tagging={"run": "gpt 7b", "team": "a&b"})
    assert options.Tagging == "run=gpt+7b&team=a%26b"
    assert S3RequestOptions.from_mapping({}) is None
    # An account id left unquoted in YAML arrives as an int; one that lost a leading zero is refused.
    assert S3RequestOptions(ExpectedBucketOwner=111122223333).ExpectedBucketOwner == "111122223333"
    with pytest.raises(ValueError, match="quoted in YAML"):
        S3RequestOptions(ExpectedBucketOwner=11122223333)


def test_object_options_go_on_uploads_and_bucket_checks_on_every_operation() -> None:
    options = S3RequestOptions(
        ServerSideEncryption="AES256", StorageClass="STANDARD_IA", ExpectedBucketOwner=OWNER, RequestPayer="requester"
    )
    everything = {"ServerSideEncryption", "StorageClass", "ExpectedBucketOwner", "RequestPayer", "Bucket"}
    assert options.parameters("CreateMultipartUpload", everything) == {
        "ServerSideEncryption": "AES256",
        "StorageClass": "STANDARD_IA",
        "ExpectedBucketOwner": OWNER,
        "RequestPayer": "requester",
    }
    assert options.parameters("GetObject", everything) == {"ExpectedBucketOwner": OWNER, "RequestPayer": "requester"}
    assert options.parameters("ListObjectsV2", {"ExpectedBucketOwner", "Bucket"}) == {"ExpectedBucketOwner": OWNER}


def test_plugin_refuses_an_unknown_option_before_any_request() -> None:
    with pytest.raises(ValueError, match="Unknown S3 request option"):
        S3CheckpointIO("s3://bucket/run", request_options={"StorageClas": "STANDARD"})
    with pytest.raises(ValueError, match="request_options would be ignored because s3_utils is given"):
        S3CheckpointIO("s3://bucket/run", request_options={"StorageClass": "STANDARD"}, s3_utils=S3Utils())


def _config(request_options: dict[str, Any]) -> dict[str, Any]:
    return {
        "s3_checkpointing": {"chunk_size_MB": 16, "request_options": request_options},
        "exp_manager": {"checkpoint_callback_params": {"dirpath": "s3://bucket/run/checkpoints"}},
    }


@pytest.mark.lightning
def test_config_key_request_options_reaches_the_client() -> None:
    parts = connector.build_s3_checkpointing(_config({"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "alias/k"}))
    plugin = parts.checkpoint_io
    assert plugin.s3.settings.request_options == S3RequestOptions(ServerSideEncryption="aws:kms", SSEKMSKeyId="alias/k")
    with pytest.raises(ValueError, match="'Taging'"):
        connector.build_s3_checkpointing(_config({"Taging": "a=b"}))


def test_cli_refuses_a_bad_option_as_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["ls", "s3://bucket/run", "--expected-bucket-owner", "nobody"])
    assert code == cli.EXIT_USAGE
    assert "ExpectedBucketOwner must be a 12-digit AWS account id" in capsys.readouterr().err


def test_cli_cp_uploads_with_the_object_options(s3_server, s3_client, bucket: str, tmp_path, capsys) -> None:
    source = tmp_path / "model.ckpt"
    source.write_bytes(os.urandom(1000))
    url = f"s3://{bucket}/run/model.ckpt"
    flags = ["--sse", "AES256", "--storage-class", "STANDARD_IA", "--tagging", "team=nlp"]
    assert cli.main(["cp", str(source), url, "--no-progress", *flags, "--expected-bucket-owner", OWNER]) == 0
    head = s3_client.head_object(Bucket=bucket, Key="run/model.ckpt")
    assert (head["ServerSideEncryption"], head["StorageClass"]) == ("AES256", "STANDARD_IA")
    tags = s3_client.get_object_tagging(Bucket=bucket, Key="run/model.ckpt")["TagSet"]
    assert tags == [{"Key": "team", "Value": "nlp"}]
    capsys.readouterr()
    assert cli.main(["ls", f"s3://{bucket}/run", "--request-payer", "requester"]) == 0
    assert url in capsys.readouterr().out


def test_dcp_save_carries_the_object_options_on_every_object(s3_server, s3_client, bucket: str) -> None:
    import torch.distributed.checkpoint as dcp

    from s3_dcp import S3StorageReader, S3StorageWriter

    url = f"s3://{bucket}/run/step-1"
    options = {"ServerSideEncryption": "AES256", "StorageClass": "STANDARD_IA"}
    state = {"a": torch.arange(1000.0), "b": torch.ones(300)}
    dcp.save(state, storage_writer=S3StorageWriter(url, thread_count=2, request_options=options), no_dist=True)
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix="run/step-1/")["Contents"]]
    assert {k.rpartition("/")[2] for k in keys} >= {"__0_0.distcp", "__0_1.distcp", ".metadata", ".s3ckpt-items.json"}
    for key in keys:
        head = s3_client.head_object(Bucket=bucket, Key=key)
        assert (head.get("ServerSideEncryption"), head.get("StorageClass")) == ("AES256", "STANDARD_IA"), key
    loaded = {"a": torch.zeros(1000), "b": torch.zeros(300)}
    dcp.load(loaded, storage_reader=S3StorageReader(url, request_options={"RequestPayer": "requester"}), no_dist=True)
    assert all(torch.equal(loaded[name], state[name]) for name in state)
    with pytest.raises(ValueError, match="request_options would be ignored because s3_utils is given"):
        S3StorageWriter(url, request_options=options, s3_utils=S3Utils())
    with pytest.raises(ValueError, match="Unknown S3 request option"):
        S3StorageReader(url, request_options={"ACL": "private"})


# ---- what the stores do with each option ---------------------------------------------------------------------------

# "recorded": the object carries it (head_object / get_object_tagging); "refused": the upload fails (nothing left
# behind); "ignored": accepted, not recorded.
OPTION_BEHAVIOUR: dict[str, dict[str, str]] = {
    "AES256": {"moto": "recorded", "seaweedfs": "recorded"},
    "aws:kms": {"moto": "recorded", "seaweedfs": "refused"},  # SeaweedFS without a KMS: 500 InternalError
    "aws:kms:dsse": {"moto": "recorded", "seaweedfs": "ignored"},
    "StorageClass": {"moto": "recorded", "seaweedfs": "recorded"},
    "Tagging": {"moto": "recorded", "seaweedfs": "recorded"},
}
OPTION_CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (options, what head_object shows when recorded)
    "AES256": ({"ServerSideEncryption": "AES256"}, {"ServerSideEncryption": "AES256"}),
    "aws:kms": (
        {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "alias/ckpt"},
        {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "alias/ckpt"},
    ),
    "aws:kms:dsse": ({"ServerSideEncryption": "aws:kms:dsse"}, {"ServerSideEncryption": "aws:kms:dsse"}),
    "StorageClass": ({"StorageClass": "STANDARD_IA"}, {"StorageClass": "STANDARD_IA"}),
    "Tagging": ({"Tagging": "project=gpt&team=nlp"}, {}),
}


@SIZES
@pytest.mark.parametrize("option", list(OPTION_CASES))
def test_each_object_option_on_each_store(s3_server, s3_client, bucket: str, option: str, size: int) -> None:
    behaviour = OPTION_BEHAVIOUR[option].get(s3_server.name)
    if behaviour is None:
        pytest.skip(f"no recorded behaviour for {s3_server.name}")
    options, shown = OPTION_CASES[option]
    utils = S3Utils(S3ClientSettings(request_options=S3RequestOptions(**options)), FAST)
    url = f"s3://{bucket}/ckpt/{option}.bin"
    if behaviour == "refused":
        with pytest.raises(ClientError) as raised:
            _write(utils, url, size)
        assert any(url in note for note in raised.value.__notes__)
        assert s3_client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
        assert _open_uploads(s3_client, bucket) == []
        return
    data = _write(utils, url, size)
    assert utils.download_to_memory(url).read_all() == data
    head = s3_client.head_object(Bucket=bucket, Key=f"ckpt/{option}.bin")
    tags = s3_client.get_object_tagging(Bucket=bucket, Key=f"ckpt/{option}.bin")["TagSet"]
    if behaviour == "recorded":
        assert {name: head.get(name) for name in shown} == shown
        if option == "Tagging":
            assert sorted((t["Key"], t["Value"]) for t in tags) == [("project", "gpt"), ("team", "nlp")]
    else:
        assert "ServerSideEncryption" not in head and tags == []


# ---- bucket owner and requester pays: on every request -------------------------------------------------------------


def test_bucket_owner_and_request_payer_are_sent_on_every_request(s3_server, bucket: str) -> None:
    """Neither moto nor SeaweedFS checks these headers (both answer as if they were absent), so what is tested here
    is that every request carries them; AWS's refusal of a wrong owner is replayed by the proxy test below."""
    options = S3RequestOptions(ExpectedBucketOwner=OWNER, RequestPayer="requester")
    utils = S3Utils(S3ClientSettings(request_options=options), FAST)
    seen: list[tuple[str, dict[str, str]]] = []

    def capture(request: Any, event_name: str, **_: Any) -> None:
        headers = {
            name.lower(): value.decode() if isinstance(value, bytes) else value
            for name, value in request.headers.items()
        }
        seen.append((event_name.rsplit(".", 1)[-1], headers))

    utils.client.meta.events.register("before-send.s3", capture)
    try:
        url = f"s3://{bucket}/run/model.ckpt"
        _write(utils, url, 12 * MiB)
        _write(utils, f"s3://{bucket}/run/small.ckpt", 100)
        utils.download_to_memory(url).close()
        assert utils.s3_path_exists(f"s3://{bucket}/run", match_directory=True)
        utils.remove_objects_with_prefix(f"s3://{bucket}/run")
    finally:
        utils.client.meta.events.unregister("before-send.s3", capture)
    operations = {name for name, _ in seen}
    assert {
        "CreateMultipartUpload",
        "UploadPart",
        "CompleteMultipartUpload",
        "PutObject",
        "HeadObject",
        "GetObject",
        "ListObjectsV2",
        "DeleteObjects",
    } <= operations
    for name, headers in seen:
        assert headers.get("x-amz-expected-bucket-owner") == OWNER, name
        assert headers.get("x-amz-request-payer") == "requester", name


def test_wrong_bucket_owner_fails_at_once_naming_the_bucket(s3_server, fault_proxy, s3_client, bucket) -> None:
    """AWS answers a request whose ExpectedBucketOwner is not the bucket's owner with 403 AccessDenied; the local
    stores ignore the header, so the proxy gives that answer to the first request of the save."""
    fault_proxy.add_rule(FaultRule(Fault.status(403, "AccessDenied", "Access Denied"), method="POST", query="uploads"))
    options = S3RequestOptions(ExpectedBucketOwner=OWNER)
    utils = S3Utils(S3ClientSettings(endpoint_url=fault_proxy.endpoint_url, request_options=options), FAST)
    url = f"s3://{bucket}/run/model.ckpt"
    with pytest.raises(ClientError) as raised:
        _write(utils, url, 12 * MiB)
    note = next(note for note in raised.value.__notes__ if url in note)
    assert "HTTP 403" in note and f"account {OWNER} (ExpectedBucketOwner) owns the bucket" in note
    assert raised.value.response["ResponseMetadata"]["RequestId"] in note
    assert utils.retries == 0 and len(fault_proxy.requests) == 1
    assert s3_client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


# ---- errors and retries ---------------------------------------------------------------------------------------------


def test_store_errors_carry_status_and_request_id(s3_server, bucket: str) -> None:
    utils = S3Utils(retry_policy=FAST)
    url = f"s3://{bucket}/run/model.ckpt"
    _write(utils, url, 100)
    with pytest.raises(ClientError) as raised:  # a condition the object does not meet: 412 from either store
        utils.call("get_object", url, Bucket=bucket, Key="run/model.ckpt", IfMatch='"not-its-etag"')
    metadata = raised.value.response["ResponseMetadata"]
    note = next(note for note in raised.value.__notes__ if url in note)
    assert metadata["HTTPStatusCode"] == 412
    assert "HTTP 412" in note
    request_id = metadata.get("RequestId") or metadata["HTTPHeaders"].get("x-amz-request-id")
    assert request_id and f"request id {request_id}" in note
    host_id = metadata.get("HostId") or metadata["HTTPHeaders"].get("x-amz-id-2")
    assert (f"host id {host_id}" in note) if host_id else "host id" not in note


def test_a_reply_with_broken_xml_is_retried(s3_server, fault_proxy, bucket: str) -> None:
    """A 200 whose XML is garbled (first byte flipped, as a cut or throttled reply can be) is retried."""
    settings = S3ClientSettings(endpoint_url=fault_proxy.endpoint_url)
    utils = S3Utils(settings, FAST)
    _write(utils, f"s3://{bucket}/run/a.ckpt", 100)
    rule = fault_proxy.add_rule(FaultRule(Fault.corrupt_body(0), method="GET", query="list-type=2", times=2))
    assert [info.key for info in utils.list_objects(f"s3://{bucket}/run")] == ["run/a.ckpt"]
    assert rule.fired == 2 and utils.retries == 2

    # What botocore makes of it: recent releases turn an S3 200 that does not parse into a 500; older ones (the
    # botocore that aiobotocore pins can be a year behind) raise ResponseParserError. Both are retriable.
    fault_proxy.add_rule(FaultRule(Fault.corrupt_body(0), method="GET", query="list-type=2", times=1))
    once = S3Utils(settings, RetryPolicy(max_attempts=1))
    with pytest.raises((ClientError, botocore.parsers.ResponseParserError)) as raised:
        once.list_objects(f"s3://{bucket}/run")
    assert is_retriable_error(raised.value)
    assert any(f"s3://{bucket}/run" in note for note in raised.value.__notes__)


def test_response_parser_errors_are_retriable() -> None:
    """botocore raises this class for a body it cannot parse and says "Further retries may succeed"."""
    assert is_retriable_error(botocore.parsers.ResponseParserError("Unable to parse response, invalid XML received"))


# ---- user agent -----------------------------------------------------------------------------------------------------


@pytest.mark.lightning
def test_every_request_names_the_package_and_the_lightning_family(s3_server, fault_proxy, bucket: str) -> None:
    lightning = pytest.importorskip("lightning")
    pytest.importorskip("lightning.pytorch")  # the plugin reports the Lightning family the program imported
    plugin = S3CheckpointIO(f"s3://{bucket}/run", endpoint_url=fault_proxy.endpoint_url)
    url = f"s3://{bucket}/run/model.ckpt"
    plugin.save_checkpoint({"w": torch.ones(4)}, url)
    assert torch.equal(plugin.load_checkpoint(url)["w"], torch.ones(4))
    plugin.remove_checkpoint(url)
    plain = S3Utils(S3ClientSettings(endpoint_url=fault_proxy.endpoint_url))
    plugin_requests = len(fault_proxy.requests)
    assert not plain.s3_path_exists(url)

    agents = [request.user_agent for request in fault_proxy.requests]
    assert plugin_requests >= 3
    ours = f"s3-checkpoint-io/{__version__}"
    assert all(f"{ours} (lightning; {lightning.__version__})" in agent for agent in agents[:plugin_requests])
    assert all(ours in agent and "(lightning;" not in agent for agent in agents[plugin_requests:])
