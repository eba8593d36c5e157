"""The public S3Utils API that tools build on: checksum provenance, ranged reads, uploads with progress, the writer's
stream surface and its commit-or-abort rule, and the plugin's refusal of arguments it would ignore."""

from __future__ import annotations

import concurrent.futures
import gc
import io
import os
import pickle
import re
import sys
import types
from typing import Any, ClassVar

import pytest
from fault_proxy import Fault, FaultRule

import connector
import s3_utils
from s3_checkpoint_io import S3CheckpointIO
from s3_utils import (
    CHECKSUM_SIDECAR_SUFFIX,
    RecordedChecksum,
    RetryPolicy,
    S3ClientSettings,
    S3Utils,
    _ChecksumRecords,
    checksum_of,
    forget_s3fs_instances,
    fresh_s3fs_instances,
    invalidate_fsspec_cache,
    validate_checksum_algorithm,
)

MiB = 1024 * 1024
FAST = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.05)


def open_uploads(s3_client, bucket: str) -> list[str]:
    return [u["Key"] for u in s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def keys(s3_client, bucket: str) -> list[str]:
    return sorted(obj["Key"] for obj in s3_client.list_objects_v2(Bucket=bucket).get("Contents", []))


# ---- checksum provenance --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [100, 12 * MiB], ids=["single-put", "multipart"])
def test_recorded_checksum_names_what_a_download_is_verified_against(bucket: str, size: int) -> None:
    utils = S3Utils()
    url = f"s3://{bucket}/obj"
    data = os.urandom(size)
    utils.upload_file_stream_to_s3(io.BytesIO(data), url, chunk_size_MB=5)
    info = utils.head_object(url)
    recorded = utils.recorded_checksum(info)
    assert isinstance(recorded, RecordedChecksum)
    assert recorded.source in s3_utils.CHECKSUM_SOURCES
    assert recorded.algorithm == validate_checksum_algorithm("auto")
    assert str(recorded) == f"{recorded.algorithm} {recorded.value} ({recorded.source})"
    with utils.download_to_memory(url, chunk_size_MB=5) as downloaded:
        assert downloaded.read_all() == data
        verified = downloaded.verified_against
    assert verified is not None and verified.algorithm == recorded.algorithm
    algorithm = s3_utils.ChecksumAlgorithm.named(verified.algorithm)
    assert verified.value == algorithm.encode(checksum_of(algorithm, data))  # the record matches the bytes
    # the download verified against the record recorded_checksum names, or (a store that reports a checksum it never
    # checked, as moto does for multipart uploads) against the sidecar this package wrote for that store
    assert verified == recorded or (recorded.source, verified.source) == ("s3", "sidecar")


def test_a_sidecar_record_is_reported_and_verified(s3_client, bucket: str) -> None:
    """An object whose store keeps no checksum: the sidecar this package wrote is the record (source "sidecar")."""
    utils = S3Utils()
    data = b"recorded beside the object"
    s3_client.put_object(Bucket=bucket, Key="side", Body=data)
    info = utils.head_object(f"s3://{bucket}/side")
    bare = s3_utils.S3ObjectInfo(info.bucket, info.key, info.size, info.etag)  # as if the store reported no checksum
    algorithm = s3_utils.ChecksumAlgorithm.named("CRC32")
    value = algorithm.encode(algorithm.update(data, 0))
    record = {"algorithm": "CRC32", "checksum": value, "size": info.size, "etag": info.etag}
    _ChecksumRecords(utils).write_sidecar(bucket, "side", record)
    assert utils.recorded_checksum(bare) == RecordedChecksum("CRC32", value, "sidecar")
    assert "side" + CHECKSUM_SIDECAR_SUFFIX in keys(s3_client, bucket)


def test_no_record_and_unverified_downloads_say_so(s3_client, bucket: str) -> None:
    utils = S3Utils()
    s3_client.put_object(Bucket=bucket, Key="raw", Body=b"abc")
    bare = s3_utils.S3ObjectInfo(bucket, "raw", 3, utils.head_object(f"s3://{bucket}/raw").etag)
    assert utils.recorded_checksum(bare) is None
    with utils.download_to_memory(f"s3://{bucket}/raw", verify=False) as downloaded:
        assert downloaded.read_all() == b"abc"
        assert downloaded.verified_against is None


# ---- ranged reads ---------------------------------------------------------------------------------------------------


def test_read_range_into_fills_a_buffer_and_stops_at_the_end(bucket: str) -> None:
    utils = S3Utils()
    url = f"s3://{bucket}/ranges"
    data = os.urandom(3 * MiB + 17)
    utils.upload_file_stream_to_s3(io.BytesIO(data), url, chunk_size_MB=5)
    target = bytearray(1000)
    assert utils.read_range_into(url, 12345, target) == 1000
    assert bytes(target) == data[12345:13345]
    tail = memoryview(bytearray(100))
    assert utils.read_range_into(url, len(data) - 40, tail) == 40  # the object ends first
    assert bytes(tail[:40]) == data[-40:]
    assert utils.read_range_into(url, len(data), bytearray(10)) == 0
    assert utils.read_range_into(url, len(data) + 5, bytearray(10)) == 0
    assert utils.read_range_into(url, 0, bytearray(0)) == 0
    with pytest.raises(ValueError, match="start"):
        utils.read_range_into(url, -1, bytearray(10))
    with pytest.raises(FileNotFoundError, match="ranges-missing"):
        utils.read_range_into(f"{url}-missing", 0, bytearray(10))


def test_read_range_into_a_list_of_buffers_fills_them_in_order_with_one_get(bucket: str) -> None:
    utils = S3Utils()
    url = f"s3://{bucket}/scatter"
    data = os.urandom(2 * MiB + 5)
    utils.upload_file_stream_to_s3(io.BytesIO(data), url)
    small, empty, large, last = bytearray(7), bytearray(0), bytearray(MiB + 3), memoryview(bytearray(300))
    gets: list[Any] = []
    utils.client.meta.events.register("before-send.s3.GetObject", lambda request, **_: gets.append(request.headers))
    assert utils.read_range_into(url, 100, [small, empty, large, last]) == 7 + MiB + 3 + 300
    assert bytes(small) == data[100:107]
    assert bytes(large) == data[107 : 107 + MiB + 3]
    assert bytes(last) == data[107 + MiB + 3 : 107 + MiB + 303]
    assert len(gets) == 1 and gets[0]["Range"] == f"bytes=100-{100 + 7 + MiB + 3 + 300 - 1}".encode()
    first, rest = bytearray(10), bytearray(100)
    assert utils.read_range_into(url, len(data) - 50, [first, rest]) == 50  # the object ends in the second buffer
    assert bytes(first) == data[-50:-40] and bytes(rest[:40]) == data[-40:]
    assert utils.read_range_into(url, 0, [bytearray(0), bytearray(0)]) == 0


def test_read_range_into_refuses_a_replaced_object(bucket: str) -> None:
    utils = S3Utils()
    url = f"s3://{bucket}/etag"
    utils.upload_file_stream_to_s3(io.BytesIO(b"first version"), url)
    etag = utils.head_object(url).etag
    target = bytearray(5)
    assert utils.read_range_into(url, 0, target, etag=etag) == 5 and target == b"first"
    utils.upload_file_stream_to_s3(io.BytesIO(b"second version"), url)
    botocore_exceptions = pytest.importorskip("botocore.exceptions")
    with pytest.raises(botocore_exceptions.ClientError, match=r"PreconditionFailed|412") as caught:
        utils.read_range_into(url, 0, target, etag=etag)
    assert any(url in note for note in caught.value.__notes__)


def test_read_range_into_retries_a_cut_response(s3_client, bucket: str, fault_proxy) -> None:
    data = os.urandom(2 * MiB)
    s3_client.put_object(Bucket=bucket, Key="cut", Body=data)
    fault_proxy.add_rule(FaultRule(Fault.reset_mid_response(after_bytes=1000), method="GET", times=1))
    utils = S3Utils(S3ClientSettings(endpoint_url=fault_proxy.endpoint_url), FAST)
    target = bytearray(MiB)
    assert utils.read_range_into(f"s3://{bucket}/cut", MiB, target) == MiB
    assert bytes(target) == data[MiB:]
    assert utils.retries == 1

    fault_proxy.add_rule(FaultRule(Fault.reset_mid_response(after_bytes=5000), method="GET", times=1))
    pieces = [bytearray(1000), bytearray(MiB), bytearray(MiB - 1000)]  # the cut falls in the second buffer
    assert utils.read_range_into(f"s3://{bucket}/cut", 0, pieces) == 2 * MiB
    assert b"".join(pieces) == data  # the retry refilled every buffer from the first
    assert utils.retries == 2


def test_read_ranges_into_reads_many_ranges_in_parallel(bucket: str) -> None:
    utils = S3Utils()
    url = f"s3://{bucket}/many"
    data = os.urandom(2 * MiB)
    utils.upload_file_stream_to_s3(io.BytesIO(data), url)
    starts = [0, 7, 100_000, MiB, 2 * MiB - 3]
    buffers = [bytearray(4096) for _ in starts]
    counts = utils.read_ranges_into(url, zip(starts, buffers, strict=True), max_concurrency=3)
    assert counts == [4096, 4096, 4096, 4096, 3]
    for start, buffer, count in zip(starts, buffers, counts, strict=True):
        assert bytes(buffer[:count]) == data[start : start + count]
    with pytest.raises(FileNotFoundError):
        utils.read_ranges_into(f"{url}-missing", [(0, bytearray(1)), (1, bytearray(1))])


# ---- uploads --------------------------------------------------------------------------------------------------------


def test_upload_file_reports_progress_and_returns_what_it_wrote(tmp_path, bucket: str) -> None:
    utils = S3Utils()
    path = tmp_path / "model.ckpt"
    data = os.urandom(11 * MiB + 3)
    path.write_bytes(data)
    seen: list[int] = []
    info = utils.upload_file(path, f"s3://{bucket}/up/model.ckpt", chunk_size_MB=5, progress=seen.append)
    assert sum(seen) == len(data) and len(seen) == 3
    assert (info.url, info.size) == (f"s3://{bucket}/up/model.ckpt", len(data))
    head = utils.head_object(info.url)
    assert head.etag == info.etag
    recorded = utils.recorded_checksum(head)
    assert recorded is not None
    assert info.checksums == {f"Checksum{recorded.algorithm}": info.checksums[f"Checksum{recorded.algorithm}"]}
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert utils.upload_file(empty, f"s3://{bucket}/up/empty").size == 0


# ---- the writer -----------------------------------------------------------------------------------------------------


def test_writer_tells_its_position_and_names_its_url(s3_client, bucket: str) -> None:
    url = f"s3://{bucket}/told"
    writer = S3Utils().open_writer(url, chunk_size_MB=5, max_concurrency=2)
    assert writer.tell() == 0 and writer.state == "open"
    writer.write(b"x" * 3)
    writer.write(memoryview(os.urandom(6 * MiB)))
    assert writer.tell() == 6 * MiB + 3
    assert url in repr(writer) and "open" in repr(writer)
    writer.close()
    assert writer.state == "committed" and writer.closed and "committed" in repr(writer)
    writer.close()  # ending twice is harmless
    writer.abort()  # and cannot undo a commit
    assert s3_client.head_object(Bucket=bucket, Key="told")["ContentLength"] == 6 * MiB + 3
    with pytest.raises(ValueError, match=url):
        writer.write(b"more")


@pytest.mark.parametrize("size", [10, 7 * MiB], ids=["single-put", "multipart"])
def test_an_abandoned_writer_never_commits(s3_client, bucket: str, size: int) -> None:
    writer = S3Utils().open_writer(f"s3://{bucket}/abandoned", chunk_size_MB=5, max_concurrency=2)
    writer.write(os.urandom(size))
    concurrent.futures.wait(writer._parts)  # an upload thread in flight still holds the writer
    del writer
    gc.collect()
    assert keys(s3_client, bucket) == []
    assert open_uploads(s3_client, bucket) == []


def test_a_failed_commit_aborts(s3_client, bucket: str, fault_proxy) -> None:
    utils = S3Utils(S3ClientSettings(endpoint_url=fault_proxy.endpoint_url), RetryPolicy(max_attempts=1))
    fault_proxy.add_rule(FaultRule(Fault.status(500, "InternalError"), method="POST", query="uploadId="))
    writer = utils.open_writer(f"s3://{bucket}/failed", chunk_size_MB=5)
    writer.write(os.urandom(6 * MiB))
    with pytest.raises(Exception, match="InternalError"):
        writer.close()
    assert writer.state == "aborted" and writer.closed
    fault_proxy.clear_rules()
    assert keys(s3_client, bucket) == []
    assert open_uploads(s3_client, bucket) == []


# ---- small public helpers -------------------------------------------------------------------------------------------


def test_validate_checksum_algorithm() -> None:
    assert validate_checksum_algorithm("crc32") == "CRC32"
    assert validate_checksum_algorithm(None) == validate_checksum_algorithm("auto")
    assert validate_checksum_algorithm("auto") in {"CRC32C", "CRC32"}
    with pytest.raises(ValueError, match="MD5"):
        validate_checksum_algorithm("MD5")


class _RecordingFilesystem:
    def __init__(self) -> None:
        self.invalidated: list[str] = []

    def invalidate_cache(self, path: str) -> None:
        self.invalidated.append(path)


def test_fsspec_cache_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both helpers act on live s3fs state only, and only where s3fs is imported."""
    monkeypatch.delitem(sys.modules, "s3fs", raising=False)
    invalidate_fsspec_cache("s3://b/k")  # no s3fs: nothing to do, no import
    forget_s3fs_instances()
    assert "s3fs" not in sys.modules
    filesystem = _RecordingFilesystem()
    cleared: list[bool] = []

    class FakeS3FileSystem:
        _cache: ClassVar[dict[str, _RecordingFilesystem]] = {"token": filesystem}

        @classmethod
        def clear_instance_cache(cls) -> None:
            cleared.append(True)

    monkeypatch.setitem(sys.modules, "s3fs", types.SimpleNamespace(S3FileSystem=FakeS3FileSystem))
    invalidate_fsspec_cache("s3://bucket/dir/x.ckpt")
    assert filesystem.invalidated == ["bucket/dir/x.ckpt"]
    forget_s3fs_instances()
    assert cleared == [True]


def test_fresh_s3fs_instances_forgets_before_and_after_even_on_error(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []

    class FakeS3FileSystem:
        @classmethod
        def clear_instance_cache(cls) -> None:
            events.append("cleared")

    monkeypatch.setitem(sys.modules, "s3fs", types.SimpleNamespace(S3FileSystem=FakeS3FileSystem))
    with pytest.raises(RuntimeError, match="inside"):
        with fresh_s3fs_instances():
            events.append("inside")
            raise RuntimeError("inside")
    assert events == ["cleared", "inside", "cleared"]


# ---- one way to build the client: every class refuses arguments another would override ----------------------------

_PAYER = {"RequestPayer": "requester"}
_BUDGETED = S3ClientSettings(max_requests_per_second=100)
_OPTIONS = S3ClientSettings(request_options=s3_utils.S3RequestOptions(StorageClass="STANDARD_IA"))
CONFLICTS = [
    ({"endpoint_url": "http://127.0.0.1:1", "client_settings": S3ClientSettings()}, "endpoint_url", "client_settings"),
    ({"region_name": "eu-west-1", "client_settings": S3ClientSettings()}, "region_name", "client_settings"),
    ({"request_options": _PAYER, "client_settings": _OPTIONS}, "request_options", "client_settings"),
    ({"max_requests_per_second": 5, "client_settings": _BUDGETED}, "max_requests_per_second", "client_settings"),
    ({"endpoint_url": "http://127.0.0.1:1", "s3_utils": S3Utils()}, "endpoint_url", "s3_utils"),
    ({"region_name": "eu-west-1", "s3_utils": S3Utils()}, "region_name", "s3_utils"),
    ({"client_settings": S3ClientSettings(), "s3_utils": S3Utils()}, "client_settings", "s3_utils"),
    ({"retry_policy": RetryPolicy(), "s3_utils": S3Utils()}, "retry_policy", "s3_utils"),
    ({"request_options": {"StorageClass": "STANDARD"}, "s3_utils": S3Utils()}, "request_options", "s3_utils"),
    ({"max_requests_per_second": 5, "s3_utils": S3Utils()}, "max_requests_per_second", "s3_utils"),
]
"""Arguments together with one that would silently override them: (arguments, the overridden one, the winner)."""


def _client_builders() -> dict[str, Any]:
    import s3_dcp

    return {
        "S3Utils.from_arguments": S3Utils.from_arguments,
        "S3CheckpointIO": lambda **kwargs: S3CheckpointIO("s3://bucket/run", **kwargs),
        "S3StorageWriter": lambda **kwargs: s3_dcp.S3StorageWriter("s3://bucket/run", **kwargs),
        "S3StorageReader": lambda **kwargs: s3_dcp.S3StorageReader("s3://bucket/run", **kwargs),
    }


@pytest.mark.parametrize("builder", ["S3Utils.from_arguments", "S3CheckpointIO", "S3StorageWriter", "S3StorageReader"])
@pytest.mark.parametrize(("kwargs", "ignored", "winner"), CONFLICTS)
def test_every_client_builder_refuses_arguments_another_would_override(
    builder: str, kwargs: dict, ignored: str, winner: str
) -> None:
    """The plugin, the DCP writer and reader (which once ignored these silently) and `S3Utils.from_arguments` itself
    build their client one way and refuse the same combinations, naming both arguments."""
    message = rf"^{re.escape(builder)}: {ignored} would be ignored because {winner} is given"
    with pytest.raises(ValueError, match=message):
        _client_builders()[builder](**kwargs)


def test_from_arguments_builds_the_settings_it_is_given() -> None:
    utils = S3Utils(S3ClientSettings(endpoint_url="http://127.0.0.1:1"))
    assert S3Utils.from_arguments(s3_utils=utils, max_pool_connections=99, user_agent_extra="x") is utils
    built = S3Utils.from_arguments(
        endpoint_url="http://127.0.0.1:2",
        region_name="eu-west-1",
        retry_policy=FAST,
        request_options={"StorageClass": "STANDARD_IA"},
        max_requests_per_second={"write": 10, "read": 20},
        max_pool_connections=60,
        user_agent_extra="lightning/2.5",
    )
    settings = built.settings
    assert (settings.endpoint_url, settings.region_name) == ("http://127.0.0.1:2", "eu-west-1")
    assert built.retry_policy == FAST
    assert settings.request_options == s3_utils.S3RequestOptions(StorageClass="STANDARD_IA")
    assert settings.max_requests_per_second == s3_utils.RequestRates(write=10, read=20)
    assert settings.max_pool_connections == 64 and settings.user_agent_extra == "lightning/2.5"
    given = S3ClientSettings(endpoint_url="http://127.0.0.1:3", user_agent_extra="job/7", max_pool_connections=5)
    extended = S3Utils.from_arguments(
        client_settings=given,
        request_options={"RequestPayer": "requester"},
        max_pool_connections=60,
        user_agent_extra="lightning/2.5",
    ).settings
    assert (extended.endpoint_url, extended.max_pool_connections) == ("http://127.0.0.1:3", 5)  # the settings decide
    assert extended.user_agent_extra == "job/7 lightning/2.5" and extended.request_options is not None
    with pytest.raises(ValueError, match="Unknown S3 request option"):
        S3Utils.from_arguments(request_options={"StorageClas": "STANDARD"})
    with pytest.raises(TypeError, match=r"retry_policy must be an s3_utils\.RetryPolicy"):
        S3Utils.from_arguments(retry_policy={"max_attempts": 3})  # type: ignore[arg-type]


def test_s3_utils_pickles_as_settings_and_retry_policy_and_works_after(bucket: str) -> None:
    """What ``ddp_spawn`` and DCP's process executor do to every class that holds one: the live client stays behind,
    the copy builds its own from the same settings and retry policy, and reaches the same objects."""
    utils = S3Utils(S3ClientSettings(user_agent_extra="pickled"), FAST)
    url = f"s3://{bucket}/pickled/object"
    utils.upload_file_stream_to_s3(io.BytesIO(b"travels"), url)
    assert utils.client is not None and utils.retries == 0
    state = pickle.dumps(utils)
    assert b"botocore" not in state
    copy = pickle.loads(state)
    assert type(copy) is S3Utils and copy is not utils
    assert copy.settings == utils.settings and copy.retry_policy == FAST
    assert copy.client is not None  # built anew on first use, from the same settings
    with copy.download_to_memory(url) as downloaded:
        assert downloaded.read_all() == b"travels"
    assert copy.s3_path_exists(f"s3://{bucket}/pickled", match_directory=True)


def test_checkpoint_io_accepts_each_way_of_configuring_the_client() -> None:
    settings = S3ClientSettings(endpoint_url="http://127.0.0.1:1", region_name="eu-west-1")
    assert S3CheckpointIO(client_settings=settings, retry_policy=FAST).s3.settings.endpoint_url == settings.endpoint_url
    assert S3CheckpointIO(endpoint_url="http://127.0.0.1:2", region_name="x", retry_policy=FAST).s3.retry_policy == FAST
    utils = S3Utils(settings)
    assert S3CheckpointIO(s3_utils=utils).s3 is utils


def test_config_endpoint_goes_into_explicit_client_settings() -> None:
    """build_s3_checkpointing passes the config's endpoint and region inside the settings, not beside them."""
    config = {
        "s3_checkpointing": {"endpoint_url": "http://127.0.0.1:3", "region_name": "eu-west-1"},
        "exp_manager": {"checkpoint_callback_params": {"dirpath": "s3://bucket/run"}},
    }
    pytest.importorskip("lightning")
    parts = connector.build_s3_checkpointing(config, client_settings=S3ClientSettings(max_pool_connections=7))
    settings = parts.checkpoint_io.s3.settings
    assert (settings.endpoint_url, settings.region_name, settings.max_pool_connections) == (
        "http://127.0.0.1:3",
        "eu-west-1",
        7,
    )
    contradicting = S3ClientSettings(endpoint_url="http://127.0.0.1:4")
    with pytest.raises(ValueError, match="contradicts"):
        connector.build_s3_checkpointing(config, client_settings=contradicting)


# ---- checkpoint-name rules ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "is_directory", "kind", "step"),
    [
        ("gpt--step=100-last.ckpt", False, "last", 100),
        ("last-v2.ckpt", False, "last", None),
        ("gpt--step=9-end.ckpt", False, "end", 9),
        ("gpt--val=1.0-step=12.ckpt", False, None, 12),
        ("mystep=3-last.ckpt", False, "last", None),
        ("model.txt", False, None, None),
        ("gpt--step=5-last", True, "last", 5),
        ("gpt--step=5-end", True, "end", 5),
        ("gpt--step=5", True, None, 5),
    ],
)
def test_checkpoint_name_rules(name: str, is_directory: bool, kind: str | None, step: int | None) -> None:
    assert connector.classify_checkpoint_name(name, is_directory) == kind
    assert connector.checkpoint_step(name) == step
    assert bool(connector.STEP_PATTERN.search(name)) == (step is not None)
    if not is_directory:
        assert (kind == "last") == bool(connector.LAST_FILE_PATTERN.search(name))
        assert (kind == "end") == name.endswith(connector.END_FILE_SUFFIX)


def test_one_settings_object_reaches_every_class(bucket: str, s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An endpoint given only in an `S3ClientSettings` (the environment names one where nothing listens) is the one
    the client of each class uses, handed over as ``s3_utils=`` or as ``client_settings=``: the plugin saves and
    loads through it; DCP's writer and reader and the Lightning strategy build on it (docs/s3.md)."""
    torch = pytest.importorskip("torch")
    import s3_dcp

    settings = S3ClientSettings(endpoint_url=s3_server.endpoint_url)
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # what a class that ignored the settings would reach
    for given in ({"s3_utils": S3Utils(settings)}, {"client_settings": settings}):
        plugin = S3CheckpointIO(**given)
        url = f"s3://{bucket}/{next(iter(given))}/m.ckpt"
        plugin.save_checkpoint({"w": torch.arange(3.0)}, url)
        assert torch.equal(plugin.load_checkpoint(url)["w"], torch.arange(3.0))
        plugin.teardown()
        built = [
            s3_dcp.S3StorageWriter(f"s3://{bucket}/dcp", **given),
            s3_dcp.S3StorageReader(f"s3://{bucket}/dcp", **given),
            s3_dcp.S3ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1, **given),
        ]
        for made in built:
            assert made.s3.client.meta.endpoint_url == s3_server.endpoint_url, made
        if "s3_utils" in given:
            assert all(made.s3 is given["s3_utils"] for made in [plugin, *built])
