"""S3Utils against a real S3-compatible server over HTTP (moto and SeaweedFS)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import threading
import tracemalloc
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from fault_proxy import Fault, FaultRule

import s3_utils
from s3_utils import (
    _CHECKSUMS,
    _STAGING_BYTES,
    CHECKSUM_SIDECAR_SUFFIX,
    DownloadedObject,
    RetryPolicy,
    S3ClientSettings,
    S3MultipartWriter,
    S3Utils,
    _BufferReader,
    _PartBuffers,
    get_s3_client,
    release_part_buffers,
)

MiB = 1024 * 1024
BOTH_BUCKET_KINDS = pytest.mark.parametrize("bucket", ["general_purpose", "directory"], indirect=True)
"""Run a test on a general purpose bucket and on a directory bucket behind the directory-bucket proxy."""


class _WriterSpy:
    """Test instrumentation kept out of the writer: the most part buffers each writer held at once (read after every
    `_take_buffer`) and the parts each sent straight from the caller's memory (`_send_borrowed_part` calls)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.most_buffers: dict[int, int] = {}
        self.borrowed_parts: dict[int, int] = {}
        take, send_borrowed = S3MultipartWriter._take_buffer, S3MultipartWriter._send_borrowed_part
        spy = self

        def take_buffer(writer: S3MultipartWriter) -> bytearray:
            buffer = take(writer)
            spy.most_buffers[id(writer)] = max(spy.most_buffers.get(id(writer), 0), writer._buffers_made)
            return buffer

        def send_borrowed_part(writer: S3MultipartWriter, *args: object, **kwargs: object) -> None:
            send_borrowed(writer, *args, **kwargs)
            spy.borrowed_parts[id(writer)] = spy.borrowed_parts.get(id(writer), 0) + 1

        monkeypatch.setattr(S3MultipartWriter, "_take_buffer", take_buffer)
        monkeypatch.setattr(S3MultipartWriter, "_send_borrowed_part", send_borrowed_part)


def put(s3_client, bucket: str, key: str, body: bytes = b"x") -> None:
    s3_client.put_object(Bucket=bucket, Key=key, Body=body)


def keys(s3_client, bucket: str) -> list[str]:
    return sorted(obj["Key"] for obj in s3_client.list_objects_v2(Bucket=bucket).get("Contents", []))


def open_uploads(s3_client, bucket: str) -> list[str]:
    return [u["Key"] for u in s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


@BOTH_BUCKET_KINDS
class TestDirectorySemantics:
    def test_exists_respects_the_slash_boundary(self, s3_client, bucket: str) -> None:
        put(s3_client, bucket, "ckpt_old/a.ckpt")
        assert not S3Utils.s3_path_exists(f"s3://{bucket}/ckpt", match_directory=True)
        put(s3_client, bucket, "ckpt/a.ckpt")
        assert S3Utils.s3_path_exists(f"s3://{bucket}/ckpt", match_directory=True)
        assert S3Utils.s3_path_exists(f"s3://{bucket}/ckpt/", match_directory=True)

    def test_exists_without_match_directory_needs_the_exact_object(self, s3_client, bucket: str) -> None:
        put(s3_client, bucket, "ckpt/a.ckpt")
        assert S3Utils.s3_path_exists(f"s3://{bucket}/ckpt/a.ckpt")
        assert not S3Utils.s3_path_exists(f"s3://{bucket}/ckpt/a.ck")
        assert not S3Utils.s3_path_exists(f"s3://{bucket}/ckpt")

    def test_exists_for_bucket_root_and_missing_bucket(self, bucket: str) -> None:
        assert S3Utils.s3_path_exists(f"s3://{bucket}")
        assert not S3Utils.s3_path_exists(f"s3://{bucket}", match_directory=True)  # empty bucket
        assert not S3Utils.s3_path_exists("s3://no-such-bucket-s3ckpt/x", match_directory=True)
        assert not S3Utils.s3_path_exists("s3://no-such-bucket-s3ckpt")

    def test_remove_objects_with_prefix_stays_inside_the_directory(self, s3_client, bucket: str) -> None:
        for key in ["ckpt", "ckpt/a.ckpt", "ckpt/sub/b.ckpt", "ckpt_old/c.ckpt", "ckpt2"]:
            put(s3_client, bucket, key)
        S3Utils.remove_objects_with_prefix(f"s3://{bucket}/ckpt")
        assert keys(s3_client, bucket) == ["ckpt2", "ckpt_old/c.ckpt"]

    def test_find_files_with_suffix_returns_full_keys_or_urls(self, s3_client, bucket: str) -> None:
        for key in ["run/a-last.ckpt", "run/b.ckpt", "run/sub/c-last.ckpt", "run2/d-last.ckpt"]:
            put(s3_client, bucket, key)
        base = f"s3://{bucket}/run"
        assert sorted(S3Utils.find_files_with_suffix(base, "last.ckpt")) == ["run/a-last.ckpt", "run/sub/c-last.ckpt"]
        assert sorted(S3Utils.find_files_with_suffix(base, return_key_only=False)) == [
            f"s3://{bucket}/run/a-last.ckpt",
            f"s3://{bucket}/run/b.ckpt",
            f"s3://{bucket}/run/sub/c-last.ckpt",
        ]

    def test_listing_follows_every_page(self, s3_client, bucket: str) -> None:
        for index in range(23):
            put(s3_client, bucket, f"many/{index:03d}")
        utils = S3Utils(list_page_size=5)
        listed = utils.list_objects(f"s3://{bucket}/many")
        assert [obj.key for obj in listed] == [f"many/{index:03d}" for index in range(23)]
        assert all(obj.size == 1 for obj in listed)

    def test_remove_object_is_fine_when_missing_and_refuses_a_bucket(self, bucket: str) -> None:
        S3Utils.remove_object(f"s3://{bucket}/never-existed")
        with pytest.raises(IsADirectoryError, match=bucket):
            S3Utils.remove_object(f"s3://{bucket}")


@BOTH_BUCKET_KINDS
class TestTransfers:
    @pytest.mark.parametrize("size", [0, 1, 5 * MiB - 1, 5 * MiB, 12 * MiB + 7])
    def test_stream_round_trip(self, bucket: str, size: int) -> None:
        data = os.urandom(size)
        url = f"s3://{bucket}/data/blob.bin"
        S3Utils.upload_file_stream_to_s3(io.BytesIO(data), url, chunk_size_MB=5, max_concurrency=3)
        assert S3Utils.download_s3_file_to_stream(url, chunk_size_MB=5, max_concurrency=3).read() == data

    def test_stream_upload_starts_from_the_beginning_of_a_seekable_stream(self, bucket: str) -> None:
        stream = io.BytesIO(b"0123456789")
        stream.seek(7)
        url = f"s3://{bucket}/rewound"
        S3Utils.upload_file_stream_to_s3(stream, url)
        assert S3Utils.download_s3_file_to_stream(url).read() == b"0123456789"

    def test_file_round_trip_and_remove_file(self, bucket: str, tmp_path) -> None:
        source = tmp_path / "source.bin"
        data = os.urandom(11 * MiB)
        source.write_bytes(data)
        url = f"s3://{bucket}/files/source.bin"
        S3Utils.upload_file(source, url, chunk_size_MB=5, remove_file=True)
        assert not source.exists()
        target = tmp_path / "out" / "target.bin"
        target.parent.mkdir()
        S3Utils.download_s3_file_to_path(url, target, chunk_size_MB=5)
        assert target.read_bytes() == data
        assert [p.name for p in target.parent.iterdir()] == ["target.bin"]  # no partial file left

    def test_empty_file_uploads(self, bucket: str, tmp_path) -> None:
        source = tmp_path / "empty"
        source.write_bytes(b"")
        S3Utils.upload_file(source, f"s3://{bucket}/empty")
        assert S3Utils.head_object(f"s3://{bucket}/empty").size == 0

    def test_missing_object_is_file_not_found_with_the_url(self, bucket: str, tmp_path) -> None:
        url = f"s3://{bucket}/missing.ckpt"
        with pytest.raises(FileNotFoundError, match=url):
            S3Utils.download_s3_file_to_stream(url)
        with pytest.raises(FileNotFoundError, match=url):
            S3Utils.download_s3_file_to_path(url, tmp_path / "x")
        assert not (tmp_path / "x").exists()

    def test_writer_parts_are_uploaded_while_writing(self, s3_client, bucket: str) -> None:
        url = f"s3://{bucket}/streamed"
        writer = S3Utils().open_writer(url, chunk_size_MB=5, max_concurrency=2)
        writer.write(os.urandom(11 * MiB))  # two full parts are queued; the rest stays buffered
        assert open_uploads(s3_client, bucket) == ["streamed"]
        assert keys(s3_client, bucket) == []  # nothing visible before close()
        writer.close()
        assert open_uploads(s3_client, bucket) == []
        assert S3Utils.head_object(url).size == 11 * MiB

    def test_writer_left_through_an_exception_leaves_nothing(self, s3_client, bucket: str) -> None:
        url = f"s3://{bucket}/k.ckpt"
        put(s3_client, bucket, "k.ckpt", b"older object")
        with pytest.raises(RuntimeError, match="serialisation failed"):
            with S3Utils().open_writer(url, chunk_size_MB=5) as writer:
                writer.write(os.urandom(12 * MiB))
                raise RuntimeError("serialisation failed")
        assert open_uploads(s3_client, bucket) == []
        assert s3_client.get_object(Bucket=bucket, Key="k.ckpt")["Body"].read() == b"older object"

    def test_checksum_is_stored_by_the_store_or_beside_the_object(self, s3_client, bucket: str) -> None:
        url = f"s3://{bucket}/ck/big.bin"
        with S3Utils().open_writer(url, chunk_size_MB=5) as writer:
            writer.write(os.urandom(6 * MiB))
        assert writer.info is not None
        expected = writer.info.checksums["ChecksumCRC32C"]
        head = s3_client.head_object(Bucket=bucket, Key="ck/big.bin", ChecksumMode="ENABLED")
        sidecar = "ck/big.bin" + CHECKSUM_SIDECAR_SUFFIX
        if head.get("ChecksumCRC32C") == expected:
            assert sidecar not in keys(s3_client, bucket)  # the store keeps it: no extra object
        else:
            assert sidecar in keys(s3_client, bucket)


class TestClient:
    def test_endpoint_comes_from_argument_then_environment(self, monkeypatch) -> None:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:1")
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:2")
        assert S3ClientSettings().resolved().endpoint_url == "http://127.0.0.1:1"
        assert S3ClientSettings(endpoint_url="http://127.0.0.1:3").resolved().endpoint_url == "http://127.0.0.1:3"
        monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
        assert S3ClientSettings().resolved().endpoint_url == "http://127.0.0.1:2"
        assert S3ClientSettings().resolved().addressing_style == "path"
        monkeypatch.delenv("AWS_ENDPOINT_URL")
        assert S3ClientSettings().resolved().endpoint_url is None
        assert S3ClientSettings().resolved().addressing_style is None

    def test_one_client_per_settings_shared_by_threads(self, s3_server) -> None:
        settings = S3ClientSettings(endpoint_url=s3_server.endpoint_url, max_pool_connections=17)
        clients: list[object] = []
        threads = [threading.Thread(target=lambda: clients.append(get_s3_client(settings))) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len({id(client) for client in clients}) == 1
        client = clients[0]
        assert client.meta.endpoint_url == s3_server.endpoint_url
        assert client.meta.config.max_pool_connections == 17
        assert get_s3_client(S3ClientSettings(endpoint_url=s3_server.endpoint_url)) is not client

    def test_a_changed_proxy_environment_gets_its_own_client(self, s3_server, monkeypatch) -> None:
        """A client keeps the proxies of the moment it was built: a cached one must not outlive a change of them."""
        from botocore.exceptions import ProxyConnectionError

        for name in ("HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        settings = S3ClientSettings(endpoint_url=s3_server.endpoint_url, user_agent_extra=f"proxy-{uuid.uuid4().hex}")
        direct = get_s3_client(settings)
        monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
        proxied = get_s3_client(settings)
        assert proxied is not direct
        with pytest.raises(ProxyConnectionError):
            proxied.list_buckets()
        direct.list_buckets()
        monkeypatch.delenv("HTTP_PROXY")
        assert get_s3_client(settings) is direct

    def test_class_level_calls_use_the_environment_endpoint(self, s3_server, bucket: str) -> None:
        assert S3Utils().client.meta.endpoint_url == s3_server.endpoint_url
        assert S3Utils.s3_path_exists(f"s3://{bucket}")


@BOTH_BUCKET_KINDS
class TestRequestsSent:
    """What goes over the wire, counted by the proxy between the client and the server."""

    @pytest.fixture
    def utils(self, fault_proxy) -> S3Utils:
        return S3Utils(S3ClientSettings(endpoint_url=fault_proxy.endpoint_url))

    def test_small_object_is_one_put(self, utils: S3Utils, fault_proxy, bucket: str) -> None:
        with utils.open_writer(f"s3://{bucket}/small", chunk_size_MB=5) as writer:
            writer.write(b"x" * (5 * MiB - 1))
        assert fault_proxy.count(method="PUT") == 1
        assert fault_proxy.count(method="POST", query_contains="uploads") == 0

    def test_large_object_is_a_multipart_upload(self, utils: S3Utils, fault_proxy, bucket: str) -> None:
        with utils.open_writer(f"s3://{bucket}/large", chunk_size_MB=5, max_concurrency=2) as writer:
            for _ in range(4):
                writer.write(os.urandom(3 * MiB))
        assert fault_proxy.count(method="POST", query_contains="uploads") == 1  # create
        assert fault_proxy.count(method="PUT", query_contains="partNumber=") == 3  # 5 + 5 + 2 MiB
        assert fault_proxy.count(method="POST", query_contains="uploadId=") == 1  # complete

    def test_load_uses_parallel_ranged_gets(self, utils: S3Utils, fault_proxy, bucket: str) -> None:
        data = os.urandom(16 * MiB)
        utils.upload_file_stream_to_s3(io.BytesIO(data), f"s3://{bucket}/ranged", chunk_size_MB=5)
        fault_proxy.clear()
        with utils.download_to_memory(f"s3://{bucket}/ranged", chunk_size_MB=5, max_concurrency=4) as downloaded:
            assert downloaded.read_all() == data
        assert fault_proxy.count(method="GET", path_regex="/ranged$") == 4  # ceil(16 / 5) ranges


@BOTH_BUCKET_KINDS
@pytest.mark.parametrize("algorithm", ["CRC32", "CRC32C", "CRC64NVME"])
def test_every_checksum_algorithm_round_trips(bucket: str, algorithm: str) -> None:
    url = f"s3://{bucket}/alg/{algorithm}"
    data = os.urandom(7 * MiB)
    with S3Utils().open_writer(url, chunk_size_MB=5, checksum_algorithm=algorithm) as writer:
        writer.write(data)
    assert f"Checksum{algorithm}" in writer.info.checksums
    with S3Utils().download_to_memory(url, chunk_size_MB=5) as downloaded:
        assert downloaded.read_all() == data


def test_unknown_checksum_algorithm_is_rejected(bucket: str) -> None:
    with pytest.raises(ValueError, match="MD5"):
        S3Utils().open_writer(f"s3://{bucket}/x", checksum_algorithm="MD5")


@BOTH_BUCKET_KINDS
def test_download_progress_counts_every_byte_once(s3_client, bucket: str, fault_proxy) -> None:
    data = os.urandom(12 * MiB)
    s3_client.put_object(Bucket=bucket, Key="p.bin", Body=data)
    reset = Fault.reset_mid_response(after_bytes=1000)
    fault_proxy.add_rule(FaultRule(reset, method="GET", path_regex=r"/p\.bin$", times=1))  # not CreateSession
    utils = S3Utils(S3ClientSettings(endpoint_url=fault_proxy.endpoint_url), RetryPolicy(initial_backoff_s=0.01))
    seen: list[int] = []
    with utils.download_to_memory(f"s3://{bucket}/p.bin", chunk_size_MB=5, progress=seen.append) as downloaded:
        assert downloaded.read_all() == data
    assert sorted(seen) == [2 * MiB, 5 * MiB, 5 * MiB]
    assert utils.retries == 1


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


@contextlib.contextmanager
def part_upload_headers(utils: S3Utils) -> Iterator[list[dict[str, str]]]:
    """The headers of every UploadPart request `utils` sends inside the block, as botocore hands them to the socket."""
    seen: list[dict[str, str]] = []

    def capture(request, **_) -> None:
        seen.append({name.lower(): _text(value) for name, value in request.headers.items()})

    utils.client.meta.events.register("before-send.s3.UploadPart", capture)
    try:
        yield seen
    finally:
        utils.client.meta.events.unregister("before-send.s3.UploadPart", capture)


class TestPartUploadsOnTheWire:
    """Headers of the part uploads as botocore hands them to the socket, against the real server."""

    @staticmethod
    def upload_and_capture(settings: S3ClientSettings, url: str, data: bytes) -> list[dict[str, str]]:
        utils = S3Utils(settings)
        with part_upload_headers(utils) as seen, utils.open_writer(url, chunk_size_MB=5, max_concurrency=2) as writer:
            writer.write(data)
        assert S3Utils(settings).download_to_memory(url, chunk_size_MB=5).read_all() == data
        return seen

    def test_parts_carry_a_crc_and_are_not_sha256_signed_by_default(self, s3_server, bucket: str) -> None:
        data = os.urandom(11 * MiB)
        settings = S3ClientSettings(endpoint_url=s3_server.endpoint_url, user_agent_extra="wire-unsigned")
        seen = self.upload_and_capture(settings, f"s3://{bucket}/wire/unsigned", data)
        assert len(seen) == 3
        assert {headers["x-amz-content-sha256"] for headers in seen} == {"UNSIGNED-PAYLOAD"}
        assert all(headers.get("x-amz-checksum-crc32c") for headers in seen)

    def test_sign_payloads_signs_every_part(self, s3_server, bucket: str) -> None:
        data = os.urandom(11 * MiB)
        settings = S3ClientSettings(endpoint_url=s3_server.endpoint_url, sign_payloads=True)
        seen = self.upload_and_capture(settings, f"s3://{bucket}/wire/signed", data)
        parts = [data[: 5 * MiB], data[5 * MiB : 10 * MiB], data[10 * MiB :]]
        assert sorted(headers["x-amz-content-sha256"] for headers in seen) == sorted(
            hashlib.sha256(part).hexdigest() for part in parts
        )


def test_writer_copies_written_bytes_once(bucket: str) -> None:
    """Each written byte is copied into a part buffer and nowhere else: a write allocates no temporary of its size."""
    chunk, tail = memoryview(os.urandom(4 * MiB)), bytearray(os.urandom(MiB // 2))
    with S3Utils().open_writer(f"s3://{bucket}/copies", chunk_size_MB=5, max_concurrency=1) as writer:
        writer.write(b"x")  # the first part buffer exists from here on
        tracemalloc.start()
        try:
            writer.write(chunk)
            writer.write(tail)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < MiB // 4, f"a write allocated {peak} bytes"


def test_writes_across_part_boundaries_upload_the_same_bytes(bucket: str) -> None:
    """Writes of odd sizes, large and small, straddling 5 MiB part boundaries: the object is the bytes written."""
    data = os.urandom(13 * MiB + 3)
    url = f"s3://{bucket}/gil-free"
    sizes = [1, 3 * MiB + 1, 17, 4 * MiB - 5, MiB, 2, 5 * MiB + 11]
    sizes.append(len(data) - sum(sizes))
    utils = S3Utils()
    with utils.open_writer(url, chunk_size_MB=5, max_concurrency=2) as writer:
        offset = 0
        for size in sizes:
            writer.write(memoryview(data)[offset : offset + size].toreadonly())
            offset += size
    with utils.download_to_memory(url, chunk_size_MB=5) as downloaded:
        assert downloaded.read_all() == data


def test_part_body_reader_hands_out_views_of_the_part() -> None:
    part = bytearray(os.urandom(100))
    reader = _BufferReader(memoryview(part))
    first = reader.read(30)
    assert isinstance(first, memoryview) and first.obj is part and bytes(first) == part[:30]
    assert reader.tell() == 30
    target = bytearray(50)
    assert reader.readinto(target) == 50 and target == part[30:80]
    assert bytes(reader.read()) == part[80:] and reader.read(10) == b""
    reader.seek(0)
    assert bytes(reader.read(-1)) == part
    reader.seek(-10, io.SEEK_END)
    assert bytes(reader.read(None)) == part[90:]


def test_a_part_body_of_segments_reads_and_checksums_as_the_joined_bytes() -> None:
    """A part body made of its buffer's bytes and lent views (`write_borrowed`): read block by block, one segment at
    a time and never joined, and checksummed piece by piece across segment edges, it is the joined bytes."""
    data = os.urandom(1000)
    segments = [memoryview(data)[:10], memoryview(bytearray(data[10:600])), memoryview(data)[600:]]
    reader = _BufferReader(list(segments), 1 << 62)
    blocks = []
    while block := reader.read(64):
        blocks.append(block)
    assert [len(block) for block in blocks] == [10, 590, 400] and b"".join(map(bytes, blocks)) == data
    reader.seek(5)
    target = bytearray(700)
    assert reader.readinto(target) == 700 and target == data[5:705] and reader.tell() == 705
    assert reader.seek(0, io.SEEK_END) == 1000
    algorithm = _CHECKSUMS["CRC32"]
    cuts = [3, 10, 250, 600, 999]
    assert s3_utils._piece_checksums(algorithm, segments, cuts) == s3_utils._piece_checksums(
        algorithm, memoryview(data), cuts
    )


@pytest.mark.skipif(not hasattr(os, "pwrite"), reason="pwrite is what the writers take turns on")
def test_download_threads_take_turns_writing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Range threads write one at a time (a writer waiting inside the kernel for the file's lock would spin on a CPU
    the store needs), each range lands where it belongs, and a short write is resumed where it stopped."""
    real_pwrite, active, most_active, guard = os.pwrite, [0], [0], threading.Lock()

    def slow_short_pwrite(fd: int, data, offset: int) -> int:
        with guard:
            active[0] += 1
            most_active[0] = max(most_active[0], active[0])
        try:
            threading.Event().wait(0.002)  # long enough for every other writer to arrive
            return real_pwrite(fd, memoryview(data)[: 40 * 1024], offset)  # at most 40 KiB per call
        finally:
            with guard:
                active[0] -= 1

    monkeypatch.setattr(os, "pwrite", slow_short_pwrite)
    ranges = [os.urandom(100 * 1024) for _ in range(6)]
    with DownloadedObject(sum(map(len, ranges))) as target:
        threads = [
            threading.Thread(target=target.write_at, args=(n * 100 * 1024, data)) for n, data in enumerate(ranges)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert target.read_all() == b"".join(ranges)
    assert most_active[0] == 1


def test_part_size_doubles_so_objects_can_outgrow_ten_thousand_parts(
    s3_server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 allows 10,000 parts; a streamed object's size is unknown up front, so the writer grows its part size."""
    settings = S3ClientSettings(endpoint_url=s3_server.endpoint_url, user_agent_extra="grow-parts")
    utils = S3Utils(settings)
    spy = _WriterSpy(monkeypatch)
    data = os.urandom(33 * MiB)
    url = f"s3://{bucket}/grown"
    with part_upload_headers(utils) as seen:
        writer = utils.open_writer(url, chunk_size_MB=5, max_concurrency=2)
        writer.parts_per_size = 2
        assert [writer.part_size_of(n) // MiB for n in (1, 2, 3, 4, 5, 7)] == [5, 5, 10, 10, 20, 40]
        with writer:
            for start in range(0, len(data), 3 * MiB):
                writer.write(data[start : start + 3 * MiB])
    sizes = [int(headers["content-length"]) for headers in seen]
    assert sorted(sizes) == sorted([5 * MiB, 5 * MiB, 10 * MiB, 10 * MiB, 3 * MiB])
    assert spy.most_buffers[id(writer)] <= 3  # max_concurrency + 1 buffers alive at any time
    with utils.download_to_memory(url) as downloaded:  # verifies the combined full-object checksum
        assert downloaded.read_all() == data


def test_held_writes_send_whole_parts_from_the_callers_memory_and_copy_only_the_edges(
    s3_server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`write_borrowed` uploads every part that lines up with the object's part grid straight from the caller's bytes
    (no part buffer), copies the bytes before the first boundary and after the last, keeps checksum boundaries
    exact, and the object is byte for byte what plain writes give."""
    utils = S3Utils(S3ClientSettings(endpoint_url=s3_server.endpoint_url, user_agent_extra="held-writes"))
    spy = _WriterSpy(monkeypatch)
    head, held, tail = os.urandom(1000), bytearray(os.urandom(23 * MiB)), os.urandom(777)
    url = f"s3://{bucket}/held"
    with part_upload_headers(utils) as seen:
        writer = utils.open_writer(url, chunk_size_MB=5, max_concurrency=2)
        with writer:
            writer.write(head)
            writer.mark_checksum_boundary()
            assert writer.write_borrowed(memoryview(held).toreadonly(), held) == len(held)
            writer.mark_checksum_boundary()
            writer.write(tail)
    assert spy.borrowed_parts[id(writer)] == 3  # 5 MiB parts 2-4; the rest lent to parts 1 and 5
    assert writer._buffers_made <= 2 and spy.most_buffers[id(writer)] <= 2
    assert sorted(int(headers["content-length"]) for headers in seen) == [
        1000 + 23 * MiB + 777 - 4 * 5 * MiB,
        *[5 * MiB] * 4,
    ]
    algorithm = writer._algorithm
    assert writer.checksum_of(1000, 1000 + len(held)) == algorithm.update(bytes(held), 0)
    with utils.download_to_memory(url) as downloaded:  # verifies the combined full-object checksum
        assert downloaded.read_all() == head + bytes(held) + tail


def test_borrowed_writes_as_large_as_a_part_off_the_part_grid_are_not_copied(
    s3_server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensors as large as a part, each after a few bytes of framing (so none lines up with the part grid): their
    bytes are lent to the parts they fall in, not copied into part buffers. The object and the
    checksum of each tensor's span are what plain writes give."""
    utils = S3Utils(S3ClientSettings(endpoint_url=s3_server.endpoint_url, user_agent_extra="lent-writes"))
    tensors = [bytearray(os.urandom(5 * MiB)) for _ in range(4)]
    copied: list[int] = []
    real_copy = s3_utils._copy_into
    spy = lambda target, offset, source: copied.append(len(source)) or real_copy(target, offset, source)  # noqa: E731
    monkeypatch.setattr(s3_utils, "_copy_into", spy)
    url = f"s3://{bucket}/lent"
    expected, spans = b"", []
    writer = utils.open_writer(url, chunk_size_MB=5, max_concurrency=2)
    with writer:
        for n, tensor in enumerate(tensors):
            frame = bytes([n]) * 64
            writer.write(frame)
            writer.mark_checksum_boundary()
            spans.append((len(expected) + 64, len(expected) + 64 + len(tensor)))
            writer.write_borrowed(tensor, tensor)
            writer.mark_checksum_boundary()
            expected += frame + bytes(tensor)
    # only the framing and the few bytes of a tensor past a part's end (under `_LEND_MIN`) went through part buffers
    assert sum(copied) < 4 * 1024 and max(copied) < s3_utils._LEND_MIN
    for (start, end), tensor in zip(spans, tensors, strict=True):
        assert writer.checksum_of(start, end) == writer._algorithm.update(bytes(tensor), 0)
    with utils.download_to_memory(url) as downloaded:  # verifies the combined full-object checksum
        assert downloaded.read_all() == expected


def test_held_writes_keep_at_most_max_concurrency_plus_one_parts_queued(
    s3_server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    utils = S3Utils(S3ClientSettings(endpoint_url=s3_server.endpoint_url, user_agent_extra="held-bound"))
    spy = _WriterSpy(monkeypatch)
    held = bytearray(os.urandom(40 * MiB))
    writer = utils.open_writer(f"s3://{bucket}/held-bound", chunk_size_MB=5, max_concurrency=2)
    unfinished: list[int] = []
    real_send, real_upload = writer._send_part, writer._upload_part

    def counting_send(*args: object, **kwargs: object) -> None:
        real_send(*args, **kwargs)
        unfinished.append(sum(not future.done() for future in writer._parts))

    def slow_upload(*args: object, **kwargs: object) -> object:
        threading.Event().wait(0.05)
        return real_upload(*args, **kwargs)

    monkeypatch.setattr(writer, "_send_part", counting_send)
    monkeypatch.setattr(writer, "_upload_part", slow_upload)
    with writer:
        writer.write_borrowed(held, held)
    assert spy.borrowed_parts[id(writer)] == 8 and len(unfinished) == 8
    assert max(unfinished) == 3  # max_concurrency + 1: the bound binds, and is kept
    with utils.download_to_memory(f"s3://{bucket}/held-bound") as downloaded:
        assert downloaded.read_all() == bytes(held)


def test_a_failed_held_part_aborts_the_upload_and_no_thread_reads_the_bytes_after(
    fault_proxy, s3_client, bucket: str
) -> None:
    fault_proxy.add_rule(
        FaultRule(Fault.status(500, "InternalError"), method="PUT", query="partNumber=", after_requests=1)
    )
    utils = S3Utils(
        S3ClientSettings(endpoint_url=fault_proxy.endpoint_url, user_agent_extra="held-fail"),
        RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.02),
    )
    held = bytearray(os.urandom(30 * MiB))
    url = f"s3://{bucket}/held-fail"
    writer = utils.open_writer(url, chunk_size_MB=5, max_concurrency=2)
    with pytest.raises(Exception) as caught:
        with writer:
            writer.write_borrowed(held, held)
    assert "InternalError" in str(caught.value)  # as for copied parts (the plugins' errors add the URL)
    assert writer.state == "aborted" and open_uploads(s3_client, bucket) == []
    assert all(future.done() for future in writer._parts)  # nothing queued or running reads `held` any more
    assert "held-fail" not in keys(s3_client, bucket)


def test_ranged_reads_stream_through_a_small_staging_buffer(s3_server, fault_proxy, bucket: str) -> None:
    """A load streams each range through one small per-thread staging buffer (no range-sized temporaries), and a
    range read to its end hands its connection back for the next request. Both checks need SeaweedFS: moto's server
    runs in this process (its allocations would count) and closes every connection."""
    utils = S3Utils(S3ClientSettings(endpoint_url=fault_proxy.endpoint_url, user_agent_extra="direct-reads"))
    data = os.urandom(20 * MiB)
    url = f"s3://{bucket}/direct"
    utils.upload_file_stream_to_s3(io.BytesIO(data), url, chunk_size_MB=5)
    before = fault_proxy.connections_accepted
    for _ in range(3):
        tracemalloc.start()
        try:
            downloaded = utils.download_to_memory(url, chunk_size_MB=5, max_concurrency=1)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        with downloaded:
            assert downloaded.read_all() == data
        if s3_server.name != "moto":
            assert peak < _STAGING_BYTES + MiB, f"four 5 MiB range reads allocated {peak} bytes"
    if s3_server.name != "moto":  # moto's server closes every connection after one response
        assert fault_proxy.connections_accepted - before <= 1  # 3 HEADs + 12 GETs over one kept-alive connection


# ---- directory buckets: what the directory-bucket proxy enforces, and that S3Utils copes ---------------------------

DIRECTORY = pytest.mark.parametrize("bucket", ["directory"], indirect=True)


@DIRECTORY
def test_proxy_refuses_undelimited_prefixes_like_s3_express(s3_client, bucket: str, directory_bucket_proxy) -> None:
    """The premise of the directory tests: a prefix that does not end in '/' is refused, as S3 Express does."""
    put(s3_client, bucket, "ckpt/model--step=10-last.ckpt")
    with pytest.raises(Exception, match="InvalidRequest") as info:
        s3_client.list_objects_v2(Bucket=bucket, Prefix="ckpt/model--step=10-")
    assert "does not end in a delimiter" in str(info.value)
    assert directory_bucket_proxy.count(query_contains="list-type=2", faulted=True) == 1


@DIRECTORY
def test_key_prefix_listing_lists_the_directory_and_filters_names(
    s3_client, bucket: str, directory_bucket_proxy
) -> None:
    for key in ["ckpt/m--step=10-a.ckpt", "ckpt/m--step=10-b.ckpt", "ckpt/m--step=11-a.ckpt", "ckpt/sub/x", "top"]:
        put(s3_client, bucket, key)
    directory_bucket_proxy.clear()
    listed = S3Utils().list_objects_with_key_prefix(f"s3://{bucket}/ckpt/m--step=10-")
    assert [info.key for info in listed] == ["ckpt/m--step=10-a.ckpt", "ckpt/m--step=10-b.ckpt"]
    assert [info.key for info in S3Utils().list_objects_with_key_prefix(f"s3://{bucket}/to")] == ["top"]
    assert directory_bucket_proxy.count(query_contains="list-type=2") == 2
    assert directory_bucket_proxy.count(faulted=True) == 0  # no listing was refused


@DIRECTORY
def test_etags_are_opaque_and_conditional_reads_still_work(s3_client, bucket: str) -> None:
    data = os.urandom(11 * MiB)
    url = f"s3://{bucket}/etag/blob"
    S3Utils.upload_file_stream_to_s3(io.BytesIO(data), url, chunk_size_MB=5)
    info = S3Utils.head_object(url)
    assert info.etag.strip('"') != hashlib.md5(data).hexdigest()
    assert not all(char in "0123456789abcdef" for char in info.etag.strip('"'))  # not an MD5 digest at all
    assert [obj.etag for obj in S3Utils.list_objects(f"s3://{bucket}/etag")] == [info.etag]  # one ETag per object
    with S3Utils().download_to_memory(url, chunk_size_MB=5) as downloaded:  # every range carries If-Match
        assert downloaded.read_all() == data


@DIRECTORY
def test_in_progress_uploads_are_not_objects(s3_client, bucket: str, directory_bucket_proxy) -> None:
    writer = S3Utils().open_writer(f"s3://{bucket}/run/sub/big.ckpt", chunk_size_MB=5, max_concurrency=1)
    try:
        writer.write(os.urandom(6 * MiB))  # one part sent: the multipart upload is open
        assert directory_bucket_proxy.open_uploads == [(bucket, "run/sub/big.ckpt")]
        listed = s3_client.list_objects_v2(Bucket=bucket, Prefix="run/", Delimiter="/")
        assert [p["Prefix"] for p in listed.get("CommonPrefixes", [])] == ["run/sub/"]  # what S3 Express reports
        assert not S3Utils.s3_path_exists(f"s3://{bucket}/run", match_directory=True)
        assert S3Utils.list_objects(f"s3://{bucket}/run") == []
        assert S3Utils.find_files_with_suffix(f"s3://{bucket}", ".ckpt") == []
    finally:
        writer.close()
    assert directory_bucket_proxy.open_uploads == []
    assert S3Utils.s3_path_exists(f"s3://{bucket}/run", match_directory=True)


@DIRECTORY
def test_listings_come_back_shuffled_and_are_sorted_here(s3_client, bucket: str) -> None:
    names = [f"many/{index:03d}" for index in range(40)]
    for name in names:
        put(s3_client, bucket, name)
    raw = [obj["Key"] for obj in s3_client.list_objects_v2(Bucket=bucket, Prefix="many/")["Contents"]]
    assert sorted(raw) == names and raw != names  # the premise: the store's order is not the key order
    assert [info.key for info in S3Utils.list_objects(f"s3://{bucket}/many")] == names


# ---- part buffers and checksum boundaries (one checksum pass per byte, no fresh pages per save) ----------------------


class _MadeBuffers:
    """Every part buffer the writer module makes from here on, seen from outside it (weak references: what the
    process keeps is what is still alive)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.made: list[weakref.ref[Any]] = []
        make = s3_utils._new_part_buffer

        def make_and_note(size: int) -> Any:
            buffer = make(size)
            self.made.append(weakref.ref(buffer))
            return buffer

        monkeypatch.setattr(s3_utils, "_new_part_buffer", make_and_note)

    def kept(self) -> int:
        """Bytes of the buffers made so far that are still alive (a dropped buffer goes at once: no cycle holds it,
        and a full collection in a long-lived test process takes seconds)."""
        return sum(len(buffer) for buffer in (ref() for ref in self.made) if buffer is not None)


def test_part_buffers_are_reused_across_saves_within_the_memory_bound(
    s3_server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second save takes its part buffers from the first one's (no new allocation), each writer holds at most
    max_concurrency + 1, and what the process keeps between saves is no more than writers held at once."""
    utils = S3Utils(S3ClientSettings(endpoint_url=s3_server.endpoint_url, user_agent_extra="buffer-reuse"))
    spy = _WriterSpy(monkeypatch)
    release_part_buffers()
    made = _MadeBuffers(monkeypatch)
    first: list[Any] = []  # the first save's buffers, held here so that no address is reused meanwhile
    fresh: list[bool] = []  # for each buffer the second save took: not one of the first save's
    peaks: list[int] = []  # the most buffers each save's writer held at once
    take = _PartBuffers.take

    def take_and_note(pool: _PartBuffers, size: int) -> Any:
        buffer = take(pool, size)
        if len(peaks) == 0:
            first.append(buffer)
        elif len(peaks) == 1:
            fresh.append(not any(buffer is old for old in first))
        return buffer

    monkeypatch.setattr(_PartBuffers, "take", take_and_note)
    data = os.urandom(23 * MiB)
    for n in range(2):
        writer = utils.open_writer(f"s3://{bucket}/reuse-{n}", chunk_size_MB=5, max_concurrency=2)
        with writer:
            for start in range(0, len(data), 3 * MiB):
                writer.write(data[start : start + 3 * MiB])
        peaks.append(spy.most_buffers[id(writer)])
    assert 1 <= len(first) <= 3 and max(peaks) <= 3  # max_concurrency + 1
    assert fresh and not any(fresh)  # the second save allocated nothing
    assert len(made.made) == len(first)
    first.clear()
    assert 5 * MiB <= made.kept() <= 3 * 5 * MiB  # kept: no more than writers held
    with utils.download_to_memory(f"s3://{bucket}/reuse-1") as downloaded:  # reused buffers carry no stale bytes
        assert downloaded.read_all() == data

    # another part size: the kept buffers of the old size go before a new one is allocated
    with utils.open_writer(f"s3://{bucket}/other-size", chunk_size_MB=6, max_concurrency=1) as writer:
        writer.write(data[: 13 * MiB])
    assert made.kept() <= 2 * 6 * MiB
    release_part_buffers()
    assert made.kept() == 0


def test_failed_upload_keeps_no_more_than_its_buffers_and_release_frees_them(
    s3_server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed upload gives its buffers back to the process's free list or drops them: the process keeps no more
    than the writer held (max_concurrency + 1 parts), and `release_part_buffers` frees all of it."""
    utils = S3Utils(S3ClientSettings(endpoint_url=s3_server.endpoint_url), RetryPolicy(max_attempts=1))
    release_part_buffers()
    made = _MadeBuffers(monkeypatch)
    with pytest.raises(RuntimeError, match="stop"), utils.open_writer(
        f"s3://{bucket}/x", chunk_size_MB=5, max_concurrency=1
    ) as writer:
        writer.write(os.urandom(12 * MiB))
        raise RuntimeError("stop")
    del writer
    assert 0 < made.kept() <= 2 * 5 * MiB
    release_part_buffers()
    assert made.kept() == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_process_writes_its_own_copy_of_a_part_buffer() -> None:
    """Part buffers are private to a process, as a ``bytearray`` is: megatron-core forks its async saves, and a
    child filling a buffer it inherited must not change the parent's (nor the parent the child's)."""
    buffer = s3_utils._new_part_buffer(MiB)
    buffer[:4] = b"mine"
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        seen = bytes(buffer[:4])
        buffer[:4] = b"kids"
        os.write(write_end, seen)
        os._exit(0)
    os.close(write_end)
    seen_by_child = os.read(read_end, 4)
    os.close(read_end)
    assert os.waitpid(child, 0)[1] == 0
    assert seen_by_child == b"mine" and bytes(buffer[:4]) == b"mine"


@pytest.mark.parametrize("cut_sizes", [[0, 1, 5 * MiB - 1, 5 * MiB + 2, 3, 0, 7 * MiB], [100, 200], [12 * MiB]])
def test_checksums_of_marked_spans_equal_direct_ones(bucket: str, cut_sizes: list[int]) -> None:
    """Spans between marked boundaries (items crossing part boundaries, empty items, items ending on a part
    boundary) get the checksum a separate pass over their bytes would give; small objects (one PUT) too."""
    algorithm = _CHECKSUMS["CRC32C"]
    spans, data, position = [], bytearray(), 0
    with S3Utils().open_writer(f"s3://{bucket}/spans", chunk_size_MB=5, max_concurrency=2) as writer:
        for size in cut_sizes:
            piece = os.urandom(size)
            writer.mark_checksum_boundary()
            writer.write(piece)
            writer.mark_checksum_boundary()
            spans.append((position, position + size))
            data += piece
            position += size
    for start, end in spans:
        assert writer.checksum_of(start, end) == algorithm.update(bytes(data[start:end]), 0), (start, end)
    assert algorithm.encode(writer.checksum_of(0, len(data))) == writer.info.checksums["ChecksumCRC32C"]
    with pytest.raises(ValueError, match="not a checksum boundary"):
        writer.checksum_of(1 + spans[-1][0], spans[-1][1]) if cut_sizes[-1] > 1 else writer.checksum_of(0, 1)
