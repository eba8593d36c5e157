"""S3StorageWriter / S3StorageReader in one process (``no_dist``): layout, interop with torch's own file-system
writer and reader, verification, the ``.metadata`` allow-list, and failures injected at each step of DCP's storage
contract (adapted from torch's ``test_file_system_checkpoint_cpu.py`` and ``test_checkpoint.py``).

Multi-rank behaviour (FSDP2, resharding, async executors, per-rank faults) is in test_dcp_dist.py.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from fault_proxy import Fault, FaultRule  # noqa: E402
from read_counts import counting_reads  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

import s3_checkpoint_admin  # noqa: E402
import s3_checkpoint_io  # noqa: E402
import s3_dcp  # noqa: E402
import s3_utils  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FAST_RETRIES = s3_utils.RetryPolicy(max_attempts=3, max_elapsed_s=10, initial_backoff_s=0.01, max_backoff_s=0.05)


def _state(seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    big = torch.randn(600, 1000, generator=generator)  # 2.3 MiB
    return {
        "weights": {
            "big": big,
            "small": torch.arange(17, dtype=torch.int64) + seed,
            "half": torch.randn(33, 5, generator=generator).to(torch.bfloat16),
            "view": big[:3, :4],  # a view of a larger storage: only its elements are saved
            "flag": torch.tensor([True, False]),
        },
        "step": 7 + seed,
        "name": f"run-{seed}",
        "blob": io.BytesIO(b"opaque bytes %d" % seed),
    }


def _empty_like(state: dict[str, Any]) -> dict[str, Any]:
    def empty(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: empty(v) for k, v in value.items()}
        if isinstance(value, torch.Tensor):
            return torch.zeros_like(value)
        if isinstance(value, io.BytesIO):
            return io.BytesIO()
        return None

    return empty(state)


def _assert_same(loaded: Any, expected: Any, where: str = "") -> None:
    if isinstance(expected, dict):
        assert set(loaded) == set(expected), where
        for key in expected:
            _assert_same(loaded[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, torch.Tensor):
        assert loaded.dtype == expected.dtype and torch.equal(loaded, expected), where
    elif isinstance(expected, io.BytesIO):
        data = loaded.getvalue() if isinstance(loaded, io.BytesIO) else loaded
        assert data == expected.getvalue(), where
    else:
        assert loaded == expected, where


def _keys(client: Any, bucket: str, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix.rstrip("/") + "/")
    return sorted(obj["Key"][len(prefix.rstrip("/")) + 1 :] for page in pages for obj in page.get("Contents", []))


def _open_uploads(client: Any, bucket: str) -> list[str]:
    return [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def _writer(url: str, **kwargs: Any) -> Any:
    kwargs.setdefault("chunk_size_MB", 5)
    kwargs.setdefault("max_write_concurrency", 2)
    return s3_dcp.S3StorageWriter(url, **kwargs)


def _reader(url: str, **kwargs: Any) -> Any:
    kwargs.setdefault("chunk_size_MB", 5)
    kwargs.setdefault("max_read_concurrency", 4)
    return s3_dcp.S3StorageReader(url, **kwargs)


def _save(state: dict[str, Any], url: str, **kwargs: Any) -> Any:
    return dcp.save(state, storage_writer=_writer(url, **kwargs), no_dist=True)


def _load(state: dict[str, Any], url: str, **kwargs: Any) -> dict[str, int]:
    """Load `state` with `S3StorageReader`; what the reader did (`read_counts.counting_reads`)."""
    with counting_reads() as counts:
        dcp.load(state, storage_reader=_reader(url, **kwargs), no_dist=True)
    return counts


def _download_prefix(client: Any, bucket: str, prefix: str, directory: Path) -> None:
    for name in _keys(client, bucket, prefix):
        client.download_file(bucket, f"{prefix}/{name}", str(directory / name))


# --------------------------------------------------------------------------------------------------------------------
# Pins on the torch names s3_dcp relies on, and lazy imports
# --------------------------------------------------------------------------------------------------------------------


def test_private_torch_names_it_relies_on_are_still_there() -> None:
    """s3_dcp uses DCP's private ``_StorageInfo`` (so torch's FileSystemReader reads our metadata), its version
    constant, ``narrow_tensor_by_index`` and the ``torch.serialization._get_layout`` its pickles reference."""
    import dataclasses

    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.storage import WriteResult

    assert [f.name for f in dataclasses.fields(filesystem._StorageInfo)] == [
        "relative_path",
        "offset",
        "length",
        "transform_descriptors",
    ]
    assert filesystem.CURRENT_DCP_VERSION == "1.0.0"
    assert torch.equal(narrow_tensor_by_index(torch.arange(10), [2], [3]), torch.tensor([2, 3, 4]))
    assert torch.serialization._get_layout("torch.strided") is torch.strided
    # The item-checksum record travels inside WriteResult.storage_data, which DCP passes through untouched.
    assert "storage_data" in {f.name for f in dataclasses.fields(WriteResult)}


def test_importing_needs_no_torch_and_using_it_names_the_fix(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import s3_dcp\n"
        "for make in (lambda: s3_dcp.S3StorageWriter('s3://b/c'), lambda: s3_dcp.S3LoadPlanner()):\n"
        "    try:\n        make()\n    except ImportError as exc:\n        print('ERR', exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("ERR") == 2 and "pip install torch" in out.stdout


def test_validate_checkpoint_id() -> None:
    writer_cls, reader_cls = s3_dcp.S3StorageWriter, s3_dcp.S3StorageReader
    for cls in (writer_cls, reader_cls):
        assert cls.validate_checkpoint_id("s3://bucket/ckpt")
        assert not cls.validate_checkpoint_id("/local/dir")
        assert not cls.validate_checkpoint_id("s3://bucket")  # a checkpoint needs a prefix
        assert cls.validate_checkpoint_id(Path("s3://bucket/ckpt"))  # the '//' pathlib collapses is repaired
    with pytest.raises(ValueError, match="chunk_size_MB"):
        s3_dcp.S3StorageWriter("s3://bucket/ckpt", chunk_size_MB=1)
    with pytest.raises(ValueError, match="thread_count"):
        s3_dcp.S3StorageWriter("s3://bucket/ckpt", thread_count=0)
    with pytest.raises(ValueError, match="max_read_concurrency"):
        s3_dcp.S3StorageReader("s3://bucket/ckpt", max_read_concurrency=0)
    with pytest.raises(ValueError, match="direct_read_min_MB"):
        s3_dcp.S3StorageReader("s3://bucket/ckpt", direct_read_min_MB=-1)


# --------------------------------------------------------------------------------------------------------------------
# Round trips and interop
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bucket", ["general_purpose", "directory"], indirect=True)
@pytest.mark.parametrize("thread_count", [1, 2])
@pytest.mark.parametrize("direct_read_min_MB", [0, None], ids=["direct", "buffered"])
def test_round_trip_tensors_and_bytes_no_dist(
    bucket: str, s3_client: Any, tmp_path: Path, thread_count: int, direct_read_min_MB: float | None
) -> None:
    url = f"s3://{bucket}/ckpt"
    state = _state()
    _save(state, url, thread_count=thread_count)

    names = [n for n in _keys(s3_client, bucket, "ckpt") if not n.endswith(s3_utils.CHECKSUM_SIDECAR_SUFFIX)]
    shards = [f"__0_{n}.distcp" for n in range(thread_count)]
    assert names == sorted([".metadata", ".s3ckpt-items.json", *shards])
    assert _open_uploads(s3_client, bucket) == []

    loaded = _empty_like(state)
    counts = _load(loaded, url, direct_read_min_MB=direct_read_min_MB)
    _assert_same(loaded, state)
    assert counts["direct_items"] == (5 if direct_read_min_MB == 0 else 0)  # every tensor, or none

    # torch's own reader loads the same checkpoint once the prefix is copied to a local directory
    _download_prefix(s3_client, bucket, "ckpt", tmp_path)
    local = _empty_like(state)
    dcp.load(local, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    _assert_same(local, state)


def test_item_checksums_come_from_the_upload_pass_and_equal_direct_ones(
    bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    """Item checksums are combined from the checksums the upload computes (items crossing 5 MiB part boundaries,
    small ones between them) and equal a separate pass over each item's bytes; the items' archives skip torch's zip
    CRC32 (the item checksum covers every byte) and still load in torch's own FileSystemReader; a nonce, recorded with
    its checksum, follows the last item."""
    generator = torch.Generator().manual_seed(3)
    state = {
        "a": torch.randn(1_500_000, generator=generator),  # 5.7 MiB: crosses the first part boundary
        "b": torch.arange(10),
        "c": torch.randn(700, 1000, generator=generator),
        "d": torch.randn(3_000_000, generator=generator),  # 11.4 MiB: spans three parts
        "blob": io.BytesIO(os.urandom(1000)),
    }
    _save(state, f"s3://{bucket}/items")
    _download_prefix(s3_client, bucket, "items", tmp_path)
    record = json.loads((tmp_path / s3_dcp.ITEM_CHECKSUMS_NAME).read_text())["files"]["__0_0.distcp"]
    shard = (tmp_path / "__0_0.distcp").read_bytes()
    algorithm = s3_utils.ChecksumAlgorithm.named(record["algorithm"])
    assert len(record["items"]) == len(state)
    trailer_at, trailer_length, trailer_checksum = record["trailer"]  # what follows the last item: a nonce
    assert re.fullmatch(rb"s3ckpt-nonce [0-9a-f]{32}\n", shard[trailer_at:]) and trailer_length == 46
    assert trailer_checksum == algorithm.update(shard[trailer_at:], 0)
    for offset, (length, checksum) in record["items"].items():
        item = shard[int(offset) : int(offset) + length]
        assert checksum == algorithm.update(item, 0), offset
        with zipfile.ZipFile(io.BytesIO(item)) as archive:
            if any(entry.filename.endswith("/data/0") for entry in archive.infolist()):  # a tensor item
                assert {entry.CRC for entry in archive.infolist()} == {0}
            # (DCP's planner serialises the bytes item itself, with torch.save and its CRCs)
    local = _empty_like(state)
    dcp.load(local, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    _assert_same(local, state)
    loaded = _empty_like(state)
    counts = _load(loaded, f"s3://{bucket}/items", direct_read_min_MB=4)  # a and d direct, below one chunk
    _assert_same(loaded, state)
    assert counts["direct_items"] == 2  # where their recorded spans say, without zipfile's CRC check


def test_checkpoint_id_url_resets_the_writer_and_reader(bucket: str) -> None:
    writer = _writer(f"s3://{bucket}/placeholder")
    state = _state(1)
    dcp.save(state, storage_writer=writer, checkpoint_id=f"s3://{bucket}/by-id", no_dist=True)
    assert writer.checkpoint_id == f"s3://{bucket}/by-id"
    loaded = _empty_like(state)
    dcp.load(loaded, storage_reader=_reader(f"s3://{bucket}/other"), checkpoint_id=f"s3://{bucket}/by-id", no_dist=True)
    _assert_same(loaded, state)
    metadata = _reader(f"s3://{bucket}/by-id").read_metadata()
    assert metadata.storage_meta.checkpoint_id == f"s3://{bucket}/by-id"
    assert metadata.storage_meta.save_id == writer.save_id


def test_a_checkpoint_uploaded_without_any_checksum_loads_unverified_with_a_warning(
    bucket: str, s3_client: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another tool's upload with no checksum at all (none stored by S3, no record beside it): the shard is read in
    coalesced ranges, small and large items alike, and loaded with a warning naming it."""
    boto3 = pytest.importorskip("boto3")
    config = pytest.importorskip("botocore.config").Config(request_checksum_calculation="when_required")
    state = {"large": torch.randn(1_600_000), "small": torch.arange(10), "extra": {"step": 7}}  # 6.1 MiB, 80 B
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    plain = boto3.client("s3", endpoint_url=s3_client.meta.endpoint_url, config=config)
    for path in tmp_path.iterdir():
        plain.put_object(Bucket=bucket, Key=f"plain/{path.name}", Body=path.read_bytes())
    url = f"s3://{bucket}/plain"
    for options in ({"chunk_size_MB": 16}, {"chunk_size_MB": 5}):  # one GET, or two: the large item spans both
        loaded = {"large": torch.zeros(1_600_000), "small": torch.zeros(10, dtype=torch.int64), "extra": {"step": 0}}
        with caplog.at_level("WARNING", logger="s3_dcp"):
            _load(loaded, url, **options)
        _assert_same(loaded, state)
        assert f"{url}/__0_0.distcp has no recorded checksum" in caplog.text


@pytest.mark.parametrize("thread_count", [1, 2])
def test_loads_a_checkpoint_torch_wrote_and_that_was_uploaded(bucket: str, tmp_path: Path, thread_count: int) -> None:
    state = _state(2)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path), thread_count=thread_count), no_dist=True)
    utils = s3_utils.S3Utils()
    for path in tmp_path.iterdir():
        utils.upload_file(path, f"s3://{bucket}/from-torch/{path.name}")

    loaded = _empty_like(state)
    _load(loaded, f"s3://{bucket}/from-torch")
    _assert_same(loaded, state)

    # a partial load of a foreign file still verifies the whole file it reads
    partial = {"weights": {"small": torch.zeros(17, dtype=torch.int64)}}
    dcp.load(partial, storage_reader=_reader(f"s3://{bucket}/from-torch"), no_dist=True)
    assert torch.equal(partial["weights"]["small"], state["weights"]["small"])


def test_partial_load_coalesces_adjacent_items(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {f"t{n:02d}": torch.full((1000,), float(n)) for n in range(40)}  # ~4 KiB each, one file
    _save(state, f"s3://{bucket}/many")
    buffers: list[int] = []
    real_buffer = s3_dcp._unzeroed_buffer
    monkeypatch.setattr(s3_dcp, "_unzeroed_buffer", lambda nbytes: buffers.append(nbytes) or real_buffer(nbytes))
    everything = {key: torch.zeros(1000) for key in state}
    addresses = {key: tensor.data_ptr() for key, tensor in everything.items()}
    counts = _load(everything, f"s3://{bucket}/many")
    _assert_same(everything, state)
    assert counts["requests"] == 1  # 40 adjacent items, one ranged GET
    # the writer recorded where each tensor's bytes lie: the GET puts them straight into the targets, no buffer
    assert counts["recorded_spans"] == 40 and buffers == []
    assert {key: tensor.data_ptr() for key, tensor in everything.items()} == addresses

    apart = {key: torch.zeros(1000) for key in ("t03", "t05")}  # t04 between them is read past, not loaded
    counts = _load(apart, f"s3://{bucket}/many")
    assert torch.equal(apart["t03"], state["t03"]) and torch.equal(apart["t05"], state["t05"])
    assert counts["requests"] == 1 and counts["bytes"] > 12_000 and buffers == []

    _strip_tensor_spans(f"s3://{bucket}/many")  # an earlier writer's checkpoint: each item into a buffer, decoded
    everything = {key: torch.zeros(1000) for key in state}
    counts = _load(everything, f"s3://{bucket}/many")
    _assert_same(everything, state)
    assert counts["requests"] == 1 and counts["recorded_spans"] == 0 and len(buffers) == 40

    some = {key: torch.zeros(1000) for key in ("t03", "t30")}
    counts = _load(some, f"s3://{bucket}/many", coalesce_gap_MB=0)
    assert torch.equal(some["t03"], state["t03"]) and torch.equal(some["t30"], state["t30"])
    assert counts["requests"] == 2
    assert counts["bytes"] < 20_000  # only what the two items occupy


def test_a_scattered_read_skips_gaps_in_few_large_reads_whatever_the_first_gap() -> None:
    """Bytes between a group's items go through one reused skip buffer: a narrow first gap must not size it, or a
    wide gap after it would become hundreds of thousands of tiny reads."""
    skip = s3_dcp._SCATTER_SKIP_BUFFER
    items = [s3_dcp._Item(offset=8, length=10, requests=[]), s3_dcp._Item(offset=18 + 8 * skip, length=10, requests=[])]
    group = s3_dcp._Group("__0_0.distcp", "s3://b/ckpt/__0_0.distcp", 0, items[-1].offset + 10, items, None)
    assert s3_dcp._scatter(group, chunk=16 * skip)
    assert group.views is not None
    assert sum(len(view) for view in group.views) == group.end - group.start
    assert [len(view) for view in group.views] == [8, 10] + [skip] * 8 + [10]


def test_large_item_is_fetched_as_parallel_ranges_straight_into_its_target(bucket: str) -> None:
    state = {"huge": torch.randn(3 * 1024 * 1024)}  # 12 MiB
    _save(state, f"s3://{bucket}/huge")
    loaded = {"huge": torch.zeros(3 * 1024 * 1024)}
    address = loaded["huge"].data_ptr()
    counts = _load(loaded, f"s3://{bucket}/huge", chunk_size_MB=5, direct_read_min_MB=5)
    assert torch.equal(loaded["huge"], state["huge"]) and loaded["huge"].data_ptr() == address
    assert counts["direct_items"] == counts["recorded_spans"] == 1
    assert counts["requests"] == 3  # 3 ranges of <= 5 MiB: the writer recorded where the tensor's bytes lie
    assert counts["bytes"] == 12 * 2**20  # the tensor's bytes once, nothing else

    # a checkpoint without that record (an earlier version of this writer): the item is buffered and decoded
    _strip_tensor_spans(f"s3://{bucket}/huge")
    loaded = {"huge": torch.zeros(3 * 1024 * 1024)}
    counts = _load(loaded, f"s3://{bucket}/huge", chunk_size_MB=5)
    assert torch.equal(loaded["huge"], state["huge"])
    assert counts["direct_items"] == 0 and counts["recorded_spans"] == 0
    assert counts["requests"] == 3 and 12 * 2**20 < counts["bytes"] < 12 * 2**20 + 8192  # the whole item, once

    buffered = {"huge": torch.zeros(3 * 1024 * 1024)}
    counts = _load(buffered, f"s3://{bucket}/huge", chunk_size_MB=5, direct_read_min_MB=64)
    assert torch.equal(buffered["huge"], state["huge"])
    assert counts["direct_items"] == 0 and counts["requests"] == 3


def test_a_file_is_read_in_gets_of_one_chunk_each_an_item_split_across_them(bucket: str) -> None:
    """By default a file's needed bytes are read in GETs of one chunk each from its first item (the last shorter),
    each scattered into every item it covers: as many requests as the bytes need. The 12 MiB item spans three of
    them and lands in its own target whole."""
    state = {"a": torch.randn(1000), "huge": torch.randn(3 * 1024 * 1024), "b": torch.randn(300, 7)}
    _save(state, f"s3://{bucket}/windows")
    loaded = _empty_like(state)
    address = loaded["huge"].data_ptr()
    counts = _load(loaded, f"s3://{bucket}/windows", chunk_size_MB=5)
    _assert_same(loaded, state)
    assert loaded["huge"].data_ptr() == address
    assert counts["direct_items"] == 0 and counts["recorded_spans"] == 3
    assert 12 * 2**20 < counts["bytes"] < 12 * 2**20 + 64 * 1024  # every item once, their framing included
    assert counts["requests"] == -(-counts["bytes"] // (5 * 2**20)) == 3


def test_byte_items_and_small_tensors_lie_together_at_the_start_of_a_file(bucket: str) -> None:
    """A file holds its byte items, then its tensors under 64 KiB, then the large ones: a load of the small ones
    alone (what a rank reads of another rank's file: values DCP stored once for all, such as optimizer steps) is one
    short GET, though in plan order they lie between tensors wider than the coalescing gap."""
    generator = torch.Generator().manual_seed(3)
    state: dict[str, Any] = {"epoch": 7}
    for n in range(4):
        state[f"w{n}"] = torch.randn(1536, 1024, generator=generator)  # 6 MiB
        state[f"step{n}"] = torch.tensor(float(n))
    _save(state, f"s3://{bucket}/small-first")
    small: dict[str, Any] = {"epoch": 0, **{f"step{n}": torch.zeros(()) for n in range(4)}}
    counts = _load(small, f"s3://{bucket}/small-first")
    assert small["epoch"] == 7 and all(torch.equal(small[f"step{n}"], state[f"step{n}"]) for n in range(4))
    assert counts["requests"] == 1 and counts["bytes"] < 64 * 1024
    everything = _empty_like(state)
    _load(everything, f"s3://{bucket}/small-first")
    tensors = [key for key in state if key != "epoch"]
    _assert_same({key: everything[key] for key in tensors}, {key: state[key] for key in tensors})


def test_one_corrupted_byte_of_an_item_split_across_gets_is_detected(bucket: str, fault_proxy: Any) -> None:
    """A byte flipped in transit in the second GET of a file, inside the 12 MiB item the first GET began: the
    checksums of the item's pieces combine to another than the recorded one, and the error names the file."""
    url = f"s3://{bucket}/ckpt"
    state = {"a": torch.randn(1000), "huge": torch.randn(3 * 1024 * 1024), "b": torch.randn(300, 7)}
    _save(state, url)
    second = {"after_requests": 1, "times": 1}  # of GETs sent one at a time, in order (max_read_concurrency=1)
    fault_proxy.add_rule(FaultRule(Fault.corrupt_body(100), method="GET", path_regex=r"__0_0\.distcp$", **second))
    settings = s3_utils.S3ClientSettings(endpoint_url=fault_proxy.endpoint_url)
    reader = _reader(url, client_settings=settings, retry_policy=FAST_RETRIES, max_read_concurrency=1)
    with pytest.raises(CheckpointException) as caught:
        dcp.load(_empty_like(state), storage_reader=reader, no_dist=True)
    failure = _failure(caught)
    assert isinstance(failure, s3_utils.ChecksumMismatchError)
    assert f"{url}/__0_0.distcp is corrupt" in str(failure) and "item huge" in str(failure)
    metadata = reader.storage_data
    (huge,) = [info for index, info in metadata.items() if index.fqn == "huge"]
    assert huge.offset < 5 * 2**20 + 100 < huge.offset + huge.length  # the corrupted byte lies in the split item


def _item_record(url: str) -> dict[str, Any]:
    with s3_utils.S3Utils().download_to_memory(f"{url}/{s3_dcp.ITEM_CHECKSUMS_NAME}") as downloaded:
        return json.loads(downloaded.read_all())


def _put_item_record(url: str, record: dict[str, Any]) -> None:
    with s3_utils.S3Utils().open_writer(f"{url}/{s3_dcp.ITEM_CHECKSUMS_NAME}") as writer:
        writer.write(json.dumps(record).encode())


def _strip_tensor_spans(url: str) -> None:
    record = _item_record(url)
    for entry in record["files"].values():
        entry.pop("tensors", None)
    _put_item_record(url, record)


def test_writer_records_where_each_contiguous_tensor_lies_from_the_upload_pass(
    bucket: str, s3_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The span of a tensor's own bytes in its item is the `write` that carried the tensor's memory; its checksum is
    combined from the upload's pass like the item's. Non-contiguous and bytes items get no span. Loads use the
    spans for direct reads and to decode buffered items."""
    generator = torch.Generator().manual_seed(5)
    square = torch.randn(768, 768, generator=generator)
    state = {
        "flat": torch.randn(1_500_000, generator=generator),  # 5.7 MiB: its bytes cross a 5 MiB part boundary
        "rows": torch.randn(600, 1000, generator=generator).to(torch.bfloat16),
        "small": torch.randn(1000, generator=generator),  # read through a shared buffer
        "transposed": square.t(),  # its storage is its bytes, but in another order than its contiguous form
        "blob": io.BytesIO(os.urandom(2 << 20)),
    }
    _save(state, f"s3://{bucket}/spans")
    _download_prefix(s3_client, bucket, "spans", tmp_path)
    record = json.loads((tmp_path / s3_dcp.ITEM_CHECKSUMS_NAME).read_text())["files"]["__0_0.distcp"]
    shard = (tmp_path / "__0_0.distcp").read_bytes()
    algorithm = s3_utils.ChecksumAlgorithm.named(record["algorithm"])
    assert record["byteorder"] == sys.byteorder
    metadata = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    offsets = {index.fqn: info.offset for index, info in metadata.storage_data.items()}
    assert sorted(record["tensors"]) == sorted(str(offsets[name]) for name in ("flat", "rows", "small"))
    for name in ("flat", "rows", "small"):
        start, nbytes, checksum, dtype, shape = record["tensors"][str(offsets[name])]
        tensor = state[name]
        assert (dtype, shape) == (str(tensor.dtype).removeprefix("torch."), list(tensor.shape))
        data = shard[offsets[name] + start : offsets[name] + start + nbytes]
        assert data == bytes(tensor.view(torch.uint8).reshape(-1).numpy())
        assert checksum == algorithm.update(data, 0)
    local = _empty_like(state)
    dcp.load(local, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    _assert_same(local, state)
    loaded = _empty_like(state)
    counts = _load(loaded, f"s3://{bucket}/spans", direct_read_min_MB=0)
    _assert_same(loaded, state)
    assert counts["recorded_spans"] == 3 and counts["direct_items"] == 3  # and "transposed" decoded
    decoded: list[Any] = []
    real_tensor = s3_dcp._SpanBytes.tensor
    monkeypatch.setattr(s3_dcp._SpanBytes, "tensor", lambda span: decoded.append(span) or real_tensor(span))
    loaded = _empty_like(state)
    counts = _load(loaded, f"s3://{bucket}/spans")  # all three scattered straight into their targets
    _assert_same(loaded, state)
    assert counts["recorded_spans"] == 3 and counts["direct_items"] == 0
    assert decoded == []  # whole tensors into whole targets of their dtype: their bytes copied as they are
    converted = {"rows": torch.zeros(600, 1000), "small": torch.zeros(1000, dtype=torch.float64)}
    _load(converted, f"s3://{bucket}/spans")  # other dtypes: decoded from the span, then converted on copy
    assert len(decoded) == 2
    assert torch.equal(converted["rows"], state["rows"].float()) and torch.equal(
        converted["small"], state["small"].double()
    )


def test_tensors_of_a_kind_already_saved_get_its_framing_byte_for_byte(
    bucket: str, s3_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file's second, third... tensor of the same dtype, shape and strides is written as torch's archive framing
    (taken from the first) around its own bytes, without running torch.save again: each item's bytes are exactly
    what torch's writer (without zip CRCs) produces for that tensor, and torch's readers load them."""
    generator = torch.Generator().manual_seed(11)
    state = {f"bias{n}": torch.randn(3000, generator=generator) for n in range(5)}
    state |= {f"norm{n}": torch.randn(64, 8, generator=generator).to(torch.bfloat16) for n in range(3)}
    state |= {f"flipped{n}": torch.randn(16, 16, generator=generator).t() for n in range(2)}  # not contiguous
    state["other"] = torch.randn(3001, generator=generator)
    saves: list[Any] = []
    real_save = s3_checkpoint_io.torch_save_without_zip_crc32
    spy = lambda obj, stream: saves.append(obj) or real_save(obj, stream)  # noqa: E731
    monkeypatch.setattr(s3_checkpoint_io, "torch_save_without_zip_crc32", spy)
    _save(state, f"s3://{bucket}/kinds")
    # torch.save ran for the first tensor of each kind (bias, norm, other) and for every non-contiguous one
    assert len(saves) == 3 + 2
    _download_prefix(s3_client, bucket, "kinds", tmp_path)
    shard = (tmp_path / "__0_0.distcp").read_bytes()
    metadata = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    for index, info in metadata.storage_data.items():
        expected = io.BytesIO()
        real_save(state[index.fqn].contiguous() if index.fqn.startswith("flipped") else state[index.fqn], expected)
        item = shard[info.offset : info.offset + info.length]
        if index.fqn.startswith("flipped"):
            assert torch.equal(torch.load(io.BytesIO(item), weights_only=True), state[index.fqn])
        else:
            assert item == expected.getvalue(), index.fqn
    local = _empty_like(state)
    dcp.load(local, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    _assert_same(local, state)
    loaded = _empty_like(state)
    _load(loaded, f"s3://{bucket}/kinds")
    _assert_same(loaded, state)


def test_the_state_dicts_own_cpu_tensors_are_uploaded_without_a_copy(
    bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, s3_client: Any
) -> None:
    """A DCP save sends whole parts of a large CPU tensor straight from the state dict's memory; a tensor the writer
    must copy first (a view of a larger storage, cloned) is never held past its write. torch's reader loads it."""
    owners: list[Any] = []
    real = s3_utils.S3MultipartWriter.write_borrowed

    def write_borrowed(writer: Any, data: Any, owner: Any) -> int:
        owners.append(owner)
        return real(writer, data, owner)

    monkeypatch.setattr(s3_utils.S3MultipartWriter, "write_borrowed", write_borrowed)
    generator = torch.Generator().manual_seed(8)
    big = torch.randn(4 * 1024 * 1024, generator=generator)  # 16 MiB
    wide = torch.randn(2048, 1024, generator=generator)
    state = {"big": big, "half": wide[:1024]}  # a view of half a storage: cloned before it is saved
    _save(state, f"s3://{bucket}/held")
    assert [owner.data_ptr() for owner in owners] == [big.data_ptr()]
    loaded = _empty_like(state)
    _load(loaded, f"s3://{bucket}/held")
    _assert_same(loaded, state)
    _download_prefix(s3_client, bucket, "held", tmp_path)
    local = _empty_like(state)
    dcp.load(local, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    _assert_same(local, state)


def test_a_tensor_span_record_that_does_not_fit_its_target_or_bytes_is_not_trusted(bucket: str) -> None:
    """A span whose dtype, shape or place does not describe the target is ignored (the item is decoded instead); a
    span whose checksum does not match the bytes fails the load, naming the shard, and `verify_checkpoint` finds a
    span record that disagrees with its item."""
    url = f"s3://{bucket}/tampered"
    state = {"w": torch.randn(1200, 1000, generator=torch.Generator().manual_seed(6))}  # 4.6 MiB, read direct at 4
    _save(state, url)
    genuine = _item_record(url)
    entry = genuine["files"]["__0_0.distcp"]
    (offset, span), *_ = entry["tensors"].items()
    for wrong in (
        [*span[:3], "float64", span[4]],
        [*span[:4], [1000, 1200]],
        [span[0], span[1] - 4, *span[2:]],
        span[:3],
    ):
        _put_item_record(url, {**genuine, "files": {"__0_0.distcp": {**entry, "tensors": {offset: wrong}}}})
        loaded = {"w": torch.zeros(1200, 1000)}
        counts = _load(loaded, url, direct_read_min_MB=4)
        assert torch.equal(loaded["w"], state["w"]) and counts["recorded_spans"] == 0, wrong
        assert counts["direct_items"] == 0, wrong
        buffered = {"w": torch.zeros(1200, 1000)}
        counts = _load(buffered, url, direct_read_min_MB=64)  # decoded from its framing instead
        assert torch.equal(buffered["w"], state["w"]) and counts["recorded_spans"] == 0, wrong

    for bad in ([*span[:2], span[2] ^ 1, *span[3:]], [span[0] + 4, *span[1:]]):  # another checksum, other bytes
        _put_item_record(url, {**genuine, "files": {"__0_0.distcp": {**entry, "tensors": {offset: bad}}}})
        with pytest.raises(CheckpointException) as caught:
            _load({"w": torch.zeros(1200, 1000)}, url, direct_read_min_MB=4)
        failure = caught.value.failures[0][0]
        assert isinstance(failure, s3_utils.ChecksumMismatchError)
        assert f"{url}/__0_0.distcp" in str(failure) and "tensor of item w" in str(failure)
        with pytest.raises(CheckpointException) as caught:
            _load({"w": torch.zeros(1200, 1000)}, url, direct_read_min_MB=64)
        failure = caught.value.failures[0][0]
        assert isinstance(failure, s3_utils.ChecksumMismatchError) and f"{url}/__0_0.distcp" in str(failure)
        assert "item record was modified" in str(failure)
        report = s3_checkpoint_admin.verify_checkpoint(url)
        assert any("tensor bytes" in problem and "__0_0.distcp" in problem for problem in report.problems), bad

    _put_item_record(url, {**genuine, "files": {"__0_0.distcp": {**entry, "tensors": [span]}}})  # not a mapping
    loaded = {"w": torch.zeros(1200, 1000)}
    counts = _load(loaded, url, direct_read_min_MB=4)
    assert torch.equal(loaded["w"], state["w"]) and counts["recorded_spans"] == 0
    assert s3_checkpoint_admin.verify_checkpoint(url).problems == []

    _put_item_record(url, genuine)
    assert s3_checkpoint_admin.verify_checkpoint(url).problems == []


def test_items_whose_bytes_do_not_match_their_target_take_the_buffered_path(bucket: str) -> None:
    """Straight-into-target reads are only for a whole, contiguous target of the stored dtype and shape whose stored
    tensor is laid out the same way; everything else is decoded and copied (and converted) as DCP's own reader does."""
    generator = torch.Generator().manual_seed(3)
    square = torch.randn(512, 512, generator=generator)
    state = {
        "transposed": square.t(),  # saved with its strides: the stored bytes are in the other order
        "wide": torch.randn(256, 1024, generator=generator),
        "converted": torch.randn(1024, 256, generator=generator),
        "plain": torch.randn(1024, 256, generator=generator),
        "empty": torch.zeros(0, 3),
    }
    _save(state, f"s3://{bucket}/mixed")
    holder = torch.zeros(1024, 256)
    loaded = {
        "transposed": torch.zeros(512, 512),
        "wide": holder.t(),  # a non-contiguous target: never written byte for byte
        "converted": torch.zeros(1024, 256, dtype=torch.float64),  # another dtype: converted on copy
        "plain": torch.zeros(1024, 256),
        "empty": torch.ones(0, 3),
    }
    counts = _load(loaded, f"s3://{bucket}/mixed", direct_read_min_MB=0)
    assert torch.equal(loaded["transposed"], state["transposed"])
    assert torch.equal(holder.t(), state["wide"])
    assert torch.equal(loaded["converted"], state["converted"].double())
    assert torch.equal(loaded["plain"], state["plain"]) and loaded["empty"].shape == (0, 3)
    assert counts["direct_items"] == 1  # only "plain"


@pytest.mark.parametrize(
    "value",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        torch.tensor([True, False, True]),
        torch.randn(7, 3).to(torch.bfloat16),
        torch.zeros(0, 4),
        torch.tensor(3.5),
    ],
    ids=["float32", "transposed", "bool", "bfloat16", "empty", "scalar"],
)
def test_decoding_an_item_in_place_equals_torch_load(value: Any) -> None:
    """Pins the ``torch.save`` archive layout the reader relies on: one uncompressed storage record, found through
    zipfile and ``torch.load(map_location="meta")`` from the framing alone."""
    stream = io.BytesIO()
    torch.save(value, stream)
    data = memoryview(bytearray(stream.getvalue()))
    decoded = s3_dcp._decode_tensor(data)
    expected = torch.load(io.BytesIO(stream.getvalue()), weights_only=True)
    assert decoded.dtype == expected.dtype and decoded.shape == expected.shape and torch.equal(decoded, expected)
    layout = s3_dcp._tensor_layout(s3_dcp._ViewReader(data))
    assert layout is not None and layout.nbytes == value.untyped_storage().nbytes()
    if layout.nbytes:
        assert data[layout.start : layout.start + layout.nbytes] == bytes(value.untyped_storage())
        assert layout.meta.stride() == value.stride() and layout.meta.shape == value.shape


def test_overwrite_replaces_the_previous_checkpoint(bucket: str) -> None:
    url = f"s3://{bucket}/ckpt"
    _save(_state(0), url)
    new = _state(3)
    _save(new, url)
    loaded = _empty_like(new)
    _load(loaded, url)
    _assert_same(loaded, new)


def test_overwrite_with_fewer_files_removes_the_stale_shards(bucket: str, s3_client: Any) -> None:
    url = f"s3://{bucket}/ckpt"
    _save(_state(0), url, thread_count=3)
    assert "__0_2.distcp" in _keys(s3_client, bucket, "ckpt")
    _save(_state(5), url, thread_count=1)
    shards = [n for n in _keys(s3_client, bucket, "ckpt") if ".distcp" in n]
    assert [n for n in shards if n.endswith(".distcp")] == ["__0_0.distcp"]
    assert all(n.startswith("__0_0.distcp") for n in shards)  # their checksum records went with them
    loaded = _empty_like(_state(5))
    _load(loaded, url)
    _assert_same(loaded, _state(5))


def test_overwrite_false_refuses_before_anything_is_written(bucket: str, s3_client: Any) -> None:
    url = f"s3://{bucket}/ckpt"
    _save(_state(0), url)
    before = {o["Key"]: o["ETag"] for o in s3_client.list_objects_v2(Bucket=bucket)["Contents"]}
    with pytest.raises(CheckpointException) as caught:
        _save(_state(1), url, overwrite=False)
    failure = caught.value.failures[0][0]
    assert isinstance(failure, FileExistsError)
    assert str(failure).startswith("Checkpoint already exists")  # torch's writers' words: its test_overwrite matches
    assert url in str(failure) and "overwrite=False" in str(failure)
    after = {o["Key"]: o["ETag"] for o in s3_client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert after == before and _open_uploads(s3_client, bucket) == []
    loaded = _empty_like(_state(0))
    _load(loaded, url)
    _assert_same(loaded, _state(0))
    _save(_state(1), f"s3://{bucket}/fresh", overwrite=False)  # a new prefix is fine


def test_filesystem_writers_arguments_are_honoured_or_refused_by_name(bucket: str) -> None:
    """torch's FileSystemWriter arguments (torch 2.13) are each accepted, or refused by name with the reason: never
    Python's bare "unexpected keyword argument" for one of them."""
    import inspect

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    url = f"s3://{bucket}/ckpt"
    torchs = set(inspect.signature(FileSystemWriter.__init__).parameters) - {"self", "path"}
    accepted = {
        "single_file_per_rank": True,
        "sync_files": False,
        "thread_count": 2,
        "per_thread_copy_ahead": 1 << 20,
        "cache_staged_state_dict": True,
        "overwrite": False,
        "_extensions": None,
        "serialization_format": SerializationFormat.TORCH_SAVE,
    }
    assert torchs <= set(accepted), f"torch's FileSystemWriter has new arguments: {torchs - set(accepted)}"
    writer = s3_dcp.S3StorageWriter(url, **accepted)
    assert (writer.thread_count, writer.overwrite) == (2, False)
    refused = {
        "single_file_per_rank": False,
        "serialization_format": SerializationFormat.SAFETENSORS,
        "_extensions": [object()],
    }
    for name, value in refused.items():
        with pytest.raises(ValueError, match=rf"does not support {name}=.*: ") as raised:
            s3_dcp.S3StorageWriter(url, **{name: value})
        assert "unexpected keyword" not in str(raised.value)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        s3_dcp.S3StorageWriter(url, bogus=1)
    _save(_state(0), url, sync_files=False, single_file_per_rank=True)  # they also work through a real save
    loaded = _empty_like(_state(0))
    _load(loaded, url)
    _assert_same(loaded, _state(0))


def test_writer_pickles_without_live_clients(bucket: str) -> None:
    writer = _writer(f"s3://{bucket}/pickled", thread_count=2)
    _ = writer.s3.client  # a live client exists now
    state = pickle.dumps(writer)
    assert b"botocore" not in state
    copy = pickle.loads(state)
    assert copy.s3 is not writer.s3 and copy.s3.settings == writer.s3.settings
    dcp.save(_state(4), storage_writer=copy, no_dist=True)
    loaded = _empty_like(_state(4))
    reader = pickle.loads(pickle.dumps(_reader(f"s3://{bucket}/pickled")))
    dcp.load(loaded, storage_reader=reader, no_dist=True)
    _assert_same(loaded, _state(4))


# --------------------------------------------------------------------------------------------------------------------
# Incomplete checkpoints and hostile metadata
# --------------------------------------------------------------------------------------------------------------------


def test_prefix_without_metadata_is_an_incomplete_checkpoint(bucket: str, s3_client: Any) -> None:
    url = f"s3://{bucket}/ckpt"
    _save(_state(), url)
    s3_client.delete_object(Bucket=bucket, Key="ckpt/.metadata")
    with pytest.raises(s3_dcp.CheckpointIncompleteError, match="incomplete") as caught:
        _reader(url).read_metadata()
    assert isinstance(caught.value, FileNotFoundError) and url in str(caught.value)
    with pytest.raises(CheckpointException, match="incomplete"):
        dcp.load(_empty_like(_state()), storage_reader=_reader(url), no_dist=True)

    with pytest.raises(s3_dcp.CheckpointIncompleteError, match="No DCP checkpoint"):
        _reader(f"s3://{bucket}/nothing-here").read_metadata()


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.mkdir, (str(self.marker),))


def test_metadata_that_would_run_code_is_refused_and_does_not_run(bucket: str, tmp_path: Path) -> None:
    url = f"s3://{bucket}/ckpt"
    _save(_state(), url)
    utils = s3_utils.S3Utils()
    genuine = _reader(url).read_metadata()

    marker = tmp_path / "pwned"
    genuine.planner_data = {"innocent": [1, 2, _RunsCode(marker)]}  # hidden deep inside real metadata
    for payload in (pickle.dumps(_RunsCode(marker)), pickle.dumps(genuine)):
        with utils.open_writer(f"{url}/.metadata") as writer:
            writer.write(payload)
        with pytest.raises(s3_dcp.UnsafeCheckpointMetadataError) as caught:
            _reader(url).read_metadata()
        assert f"{url}/.metadata" in str(caught.value) and "mkdir" in str(caught.value)
        with pytest.raises(CheckpointException, match="Refusing to load"):
            dcp.load(_empty_like(_state()), storage_reader=_reader(url), no_dist=True)
        assert not marker.exists()
    # the same bytes, loaded the way torch's FileSystemReader does (plain pickle), would have run the code
    pickle.loads(pickle.dumps(_RunsCode(marker)))
    assert marker.exists()


def test_allow_list_accepts_what_torch_writers_produce(tmp_path: Path) -> None:
    """Metadata of torch's FileSystemWriter (PosixPath checkpoint ids, dtypes, layouts, memory formats, sizes) and of
    a save with every tensor property DCP records."""
    state = {
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "grad": torch.randn(3, requires_grad=True),
        "dtypes": {str(d): torch.zeros(2, dtype=d) for d in (torch.float16, torch.int8, torch.complex64, torch.bool)},
        "extra": {"tuple": (1, "a"), "none": None, "float": 1.5},
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    raw = (tmp_path / ".metadata").read_bytes()
    metadata = s3_dcp.load_metadata_bytes(raw, "s3://bucket/x/.metadata")
    assert metadata.state_dict_metadata.keys() == pickle.loads(raw).state_dict_metadata.keys()
    assert metadata == pickle.loads(raw)


# --------------------------------------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------------------------------------


def _failure(caught: pytest.ExceptionInfo[CheckpointException]) -> BaseException:
    (exc, _trace), *_ = caught.value.failures.values()
    return exc


@pytest.mark.parametrize(
    ("direct_read_min_MB", "offset"),
    [(None, 5000), (0, 5000), (0, 100)],
    ids=["buffered", "direct-tensor-bytes", "direct-framing"],
)
def test_corrupted_shard_in_transit_raises_checksum_mismatch(
    bucket: str, fault_proxy: Any, direct_read_min_MB: float | None, offset: int
) -> None:
    url = f"s3://{bucket}/ckpt"
    state = _state()
    _save(state, url)
    fault_proxy.add_rule(FaultRule(Fault.corrupt_body(offset=offset), method="GET", path_regex=r"__0_0\.distcp$"))
    settings = s3_utils.S3ClientSettings(endpoint_url=fault_proxy.endpoint_url)
    loaded = _empty_like(state)
    reader = _reader(url, client_settings=settings, retry_policy=FAST_RETRIES, direct_read_min_MB=direct_read_min_MB)
    with pytest.raises(CheckpointException) as caught:
        dcp.load(loaded, storage_reader=reader, no_dist=True)
    failure = _failure(caught)
    assert isinstance(failure, s3_utils.ChecksumMismatchError)
    assert f"{url}/__0_0.distcp" in str(failure) and "corrupt" in str(failure)


def _record_requests(proxy: Any) -> list[tuple[str, str]]:
    """(method, file name) of each request to a checkpoint's records (``.metadata``, the item record)."""
    return [
        (r.method, r.path.rsplit("/", 1)[-1])
        for r in proxy.requests
        if r.path.endswith((".metadata", s3_dcp.ITEM_CHECKSUMS_NAME))
    ]


@pytest.mark.parametrize("reference", [False, True], ids=["one-get", "reference"])
def test_the_records_every_rank_reads_take_one_get_each(
    reference: bool, bucket: str, fault_proxy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At thousands of ranks every rank reads ``.metadata`` and the item record in the same second: one GET each,
    no HEAD first (the reference path, a download, sends a HEAD and then the GET)."""
    monkeypatch.setenv(s3_utils.REFERENCE_PATHS_ENV, "one_get_records" if reference else "")
    url, state = f"s3://{bucket}/ckpt", _state()
    _save(state, url)
    loaded = _empty_like(state)
    settings = s3_utils.S3ClientSettings(endpoint_url=fault_proxy.endpoint_url)
    dcp.load(loaded, storage_reader=_reader(url, client_settings=settings), no_dist=True)
    _assert_same(loaded, state)
    records = _record_requests(fault_proxy)
    names = (".metadata", s3_dcp.ITEM_CHECKSUMS_NAME)
    if reference:
        assert sorted(records) == sorted([*(("GET", n) for n in names), *(("HEAD", n) for n in names)])
    else:
        assert sorted(records) == sorted(("GET", n) for n in names)


def test_loads_inside_one_load_read_each_record_once(bucket: str, fault_proxy: Any) -> None:
    """Two loads of one checkpoint (megatron-core's load makes two: its common state, then the tensors) read
    ``.metadata`` and the item record once inside `s3_dcp.one_load`, nested or not, and again outside it."""
    url, state = f"s3://{bucket}/ckpt", _state()
    _save(state, url)
    settings = s3_utils.S3ClientSettings(endpoint_url=fault_proxy.endpoint_url)

    def load_twice() -> None:
        for _ in range(2):
            loaded = _empty_like(state)
            dcp.load(loaded, storage_reader=_reader(url, client_settings=settings), no_dist=True)
            _assert_same(loaded, state)

    names = sorted([".metadata", s3_dcp.ITEM_CHECKSUMS_NAME])
    with s3_dcp.one_load() as outer:
        load_twice()
        with s3_dcp.one_load() as inner:
            load_twice()
    assert inner is outer and s3_dcp.current_load() is None
    got = sorted(name for method, name in _record_requests(fault_proxy) if method == "GET")  # the reference path
    assert got == names  # (S3CKPT_REFERENCE_PATHS) sends a HEAD before each GET
    fault_proxy.clear()
    load_twice()
    assert sorted(name for method, name in _record_requests(fault_proxy) if method == "GET") == sorted(names * 2)


@pytest.mark.parametrize("fault", ["corrupt", "too-large"])
def test_a_record_read_in_one_get_falls_back_to_the_reference_path(
    fault: str, bucket: str, fault_proxy: Any, s3_client: Any
) -> None:
    """A record whose one GET does not match its recorded checksum is read again by a verified download, which
    names the URL and what is wrong; one larger than a chunk is read by parallel ranged GETs instead."""
    url = f"s3://{bucket}/ckpt"
    settings = s3_utils.S3ClientSettings(endpoint_url=fault_proxy.endpoint_url)
    if fault == "corrupt":
        _save(_state(), url)
        fault_proxy.add_rule(FaultRule(Fault.corrupt_body(offset=10), method="GET", path_regex=r"\.metadata$"))
        with pytest.raises(CheckpointException) as caught:
            dcp.load(_empty_like(_state()), storage_reader=_reader(url, client_settings=settings), no_dist=True)
        assert f"{url}/.metadata is corrupt" in str(_failure(caught))  # torch then tried a rank's own metadata
        sent = [method for method, name in _record_requests(fault_proxy) if name == ".metadata"]
        assert sent == ["GET", "HEAD", "GET"]  # the one GET, then the reference path's download
        return
    payload = bytes(range(256)) * (6 * 1024 * 4)  # 6 MiB: more than the reader's 5 MiB chunk
    s3_client.put_object(Bucket=bucket, Key="ckpt/.metadata", Body=payload)
    reader = _reader(url, client_settings=settings)
    assert reader._read_whole(f"{url}/.metadata") == payload
    methods = [r.method for r in fault_proxy.requests if r.path.endswith(".metadata")]
    assert methods[:2] == ["GET", "HEAD"] and methods.count("GET") == 3  # 2 ranges of 5 MiB after the first answer


def test_corrupted_foreign_file_in_transit_raises_checksum_mismatch(
    bucket: str, fault_proxy: Any, tmp_path: Path
) -> None:
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    utils = s3_utils.S3Utils()
    for path in tmp_path.iterdir():
        utils.upload_file(path, f"s3://{bucket}/torch/{path.name}")
    fault_proxy.add_rule(FaultRule(Fault.corrupt_body(offset=100), method="GET", path_regex=r"__0_0\.distcp$"))
    settings = s3_utils.S3ClientSettings(endpoint_url=fault_proxy.endpoint_url)
    reader = _reader(f"s3://{bucket}/torch", client_settings=settings, retry_policy=FAST_RETRIES)
    with pytest.raises(CheckpointException) as caught:
        dcp.load(_empty_like(_state()), storage_reader=reader, no_dist=True)
    assert isinstance(_failure(caught), s3_utils.ChecksumMismatchError)
    assert f"s3://{bucket}/torch/__0_0.distcp" in str(_failure(caught))


def test_shard_replaced_after_save_is_refused(bucket: str, s3_client: Any) -> None:
    url = f"s3://{bucket}/ckpt"
    _save(_state(), url)
    body = s3_client.get_object(Bucket=bucket, Key="ckpt/__0_0.distcp")["Body"].read()
    tampered = body[:100] + bytes([body[100] ^ 0xFF]) + body[101:]
    s3_client.put_object(Bucket=bucket, Key="ckpt/__0_0.distcp", Body=tampered)
    with pytest.raises(CheckpointException) as caught:
        _load(_empty_like(_state()), url)
    assert isinstance(_failure(caught), s3_utils.ChecksumMismatchError)
    assert f"{url}/__0_0.distcp" in str(_failure(caught))


def test_a_whole_file_read_is_also_checked_against_its_full_object_checksum(bucket: str, s3_client: Any) -> None:
    """The items of a file are checked one by one; a rank that reads the whole file checks the file's checksum (the
    one S3 verified on upload) too. Altering only that record shows the second check is made."""
    import json

    url = f"s3://{bucket}/ckpt"
    state = _state()
    _save(state, url)
    key = "ckpt/.s3ckpt-items.json"
    record = json.loads(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert set(record["files"]) == {"__0_0.distcp"}
    entry = record["files"]["__0_0.distcp"]
    trailer_at, trailer_length, _ = entry["trailer"]  # the file's nonce, after its last item
    assert trailer_at == sum(length for length, _ in entry["items"].values()) == entry["size"] - trailer_length
    entry["checksum"] = "AAAAAA=="
    s3_client.put_object(Bucket=bucket, Key=key, Body=json.dumps(record).encode())

    with pytest.raises(CheckpointException) as caught:
        _load(_empty_like(state), url)
    assert isinstance(_failure(caught), s3_utils.ChecksumMismatchError)
    assert f"{url}/__0_0.distcp" in str(_failure(caught)) and "AAAAAA==" in str(_failure(caught))
    partial = {"weights": {"small": torch.zeros(17, dtype=torch.int64)}}  # part of the file: item checksums only
    _load(partial, url)
    assert torch.equal(partial["weights"]["small"], state["weights"]["small"])


def test_transient_part_failures_are_retried(bucket: str, fault_proxy: Any) -> None:
    fault_proxy.add_rule(FaultRule(Fault.status(500), method="PUT", query="partNumber=", times=2))
    fault_proxy.add_rule(FaultRule(Fault.reset_mid_response(), method="GET", path_regex=r"distcp$", times=1))
    settings = s3_utils.S3ClientSettings(endpoint_url=fault_proxy.endpoint_url)
    state = {"big": torch.randn(4 * 1024 * 1024)}  # 16 MiB: parts of 5 MiB
    url = f"s3://{bucket}/retried"
    dcp.save(state, storage_writer=_writer(url, client_settings=settings, retry_policy=FAST_RETRIES), no_dist=True)
    loaded = {"big": torch.zeros(4 * 1024 * 1024)}
    dcp.load(loaded, storage_reader=_reader(url, client_settings=settings, retry_policy=FAST_RETRIES), no_dist=True)
    assert torch.equal(loaded["big"], state["big"])
    assert fault_proxy.count(faulted=True) == 3


# --------------------------------------------------------------------------------------------------------------------
# Failures at each step of the storage contract (torch's FaultyStorageWriter/Reader, adapted)
# --------------------------------------------------------------------------------------------------------------------

_WRITER_STEPS = ["reset", "set_up_storage_writer", "prepare_local_plan", "prepare_global_plan", "write_data", "finish"]
_READER_STEPS = ["reset", "read_metadata", "set_up_storage_reader", "prepare_local_plan", "prepare_global_plan"]
_READER_STEPS += ["read_data"]


class _InjectedError(RuntimeError):
    pass


def _faulty(cls: type, step: str) -> Any:
    def fail(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise _InjectedError(f"injected failure in {step}")

    return type(f"Faulty{cls.__name__}", (cls,), {step: fail})


@pytest.mark.parametrize("step", _WRITER_STEPS)
def test_save_fails_cleanly_at_each_contract_step(bucket: str, s3_client: Any, step: str) -> None:
    previous = f"s3://{bucket}/previous"
    _save(_state(0), previous)
    before = _keys(s3_client, bucket, "previous")
    writer = _faulty(s3_dcp.S3StorageWriter, step)(f"s3://{bucket}/failing", chunk_size_MB=5)
    with pytest.raises((CheckpointException, _InjectedError)) as caught:
        dcp.save(_state(1), storage_writer=writer, checkpoint_id=f"s3://{bucket}/failing", no_dist=True)
    if isinstance(caught.value, CheckpointException):
        assert isinstance(_failure(caught), _InjectedError)
    assert ".metadata" not in _keys(s3_client, bucket, "failing")
    assert _open_uploads(s3_client, bucket) == []
    assert _keys(s3_client, bucket, "previous") == before
    loaded = _empty_like(_state(0))
    _load(loaded, previous)
    _assert_same(loaded, _state(0))


def test_failure_while_a_shard_streams_aborts_its_upload(bucket: str, s3_client: Any) -> None:
    """The planner fails on the second tensor while the first one's parts are uploading."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class FailingPlanner(DefaultSavePlanner):
        calls = 0

        def resolve_data(self, write_item: Any) -> Any:
            FailingPlanner.calls += 1
            if FailingPlanner.calls == 2:
                raise _InjectedError("the second tensor cannot be staged")
            return super().resolve_data(write_item)

    state = {"a": torch.randn(3 * 1024 * 1024), "b": torch.randn(10)}  # 12 MiB first: two parts sent already
    with pytest.raises(CheckpointException) as caught:
        dcp.save(state, storage_writer=_writer(f"s3://{bucket}/torn"), planner=FailingPlanner(), no_dist=True)
    assert isinstance(_failure(caught), _InjectedError)
    assert _keys(s3_client, bucket, "torn") == [] and _open_uploads(s3_client, bucket) == []


@pytest.mark.parametrize("step", _READER_STEPS)
def test_load_fails_cleanly_at_each_contract_step(bucket: str, step: str) -> None:
    url = f"s3://{bucket}/ckpt"
    _save(_state(0), url)
    reader = _faulty(s3_dcp.S3StorageReader, step)(url, chunk_size_MB=5)
    with warnings.catch_warnings(), pytest.raises((CheckpointException, _InjectedError)) as caught:
        warnings.simplefilter("ignore")
        dcp.load(_empty_like(_state(0)), storage_reader=reader, checkpoint_id=url, no_dist=True)
    message = str(caught.value)
    assert "injected failure" in message


def test_server_restart_within_the_retry_budget_save_completes(s3_server: Any, bucket: str, fault_proxy: Any) -> None:
    """SeaweedFS is killed (SIGKILL) while a shard's parts upload and comes back on the same port: retries carry the
    save through, and the checkpoint loads bit-identical."""
    import threading
    import time

    from s3_servers import seaweedfs_process

    try:
        server = seaweedfs_process(s3_server)
    except KeyError:
        pytest.skip("only the SeaweedFS harness can kill and restart its server")
    patient = s3_utils.RetryPolicy(max_attempts=30, max_elapsed_s=90, initial_backoff_s=0.2, max_backoff_s=1.0)
    settings = s3_utils.S3ClientSettings(endpoint_url=fault_proxy.endpoint_url, connect_timeout_s=2, read_timeout_s=10)
    state = {f"layer{n}": torch.randn(1024 * 1024, generator=torch.Generator().manual_seed(n)) for n in range(12)}
    url = f"s3://{bucket}/restarted"
    outcome: dict[str, Any] = {}

    def save() -> None:
        try:
            writer = _writer(url, client_settings=settings, retry_policy=patient, max_write_concurrency=1)
            outcome["writer"] = writer
            dcp.save(state, storage_writer=writer, no_dist=True)
            outcome["ok"] = True
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=save)
    thread.start()
    deadline = time.monotonic() + 60
    while fault_proxy.count(method="PUT") < 2 and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.01)
    assert thread.is_alive(), f"the save ended before the server could be killed: {outcome}"
    server.kill()
    time.sleep(1.0)
    server.restart()
    thread.join(timeout=120)
    assert outcome.get("ok"), outcome.get("error")
    assert outcome["writer"].s3.retries > 0  # the outage was seen and ridden out
    loaded = {key: torch.zeros_like(value) for key, value in state.items()}
    _load(loaded, url)
    assert all(torch.equal(loaded[key], state[key]) for key in state)


def test_works_copied_into_a_package_folder(tmp_path: Path) -> None:
    """NeMo forks copy the core modules into a package folder: s3_dcp imports its siblings from there."""
    import shutil

    repo = Path(s3_dcp.__file__).resolve().parent
    package = tmp_path / "nemo_fork" / "utils"
    package.mkdir(parents=True)
    (tmp_path / "nemo_fork" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    core = ("s3_dirpath_utils", "s3_process", "s3_pacing", "s3_utils", "s3_fencing", "s3_checkpoint_io")
    for module in (*core, "s3_prefix_spreading", "s3_dcp"):
        shutil.copy(repo / f"{module}.py", package / f"{module}.py")
    code = (
        "import sys\n"
        f"sys.path = [p for p in sys.path if p not in ('', {str(repo)!r})]\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from nemo_fork.utils.s3_dcp import S3StorageWriter, S3StorageReader, S3ModelParallelStrategy\n"
        "assert 's3_utils' not in sys.modules and 's3_dcp' not in sys.modules, 'imported the top-level copies'\n"
        "writer = S3StorageWriter('s3://bucket/ckpt')\n"
        "assert type(writer.s3).__module__ == 'nemo_fork.utils.s3_utils'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
