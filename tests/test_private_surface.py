"""Every private name of another library this package relies on, pinned (run in every CI environment).

When one of them moves, the package does not crash: it quietly takes a slower or less exact path (a download copies
twice, ``ckpt_path="last"`` lists on every rank, s3fs answers from a stale cache). These tests make the move loud.
Each test says where the package relies on the name.
"""

from __future__ import annotations

import collections
import http.client
import importlib
import inspect
import io
import os
import pickle
import sys
import zipfile
from typing import Any

import pytest
import torch
from tiny_lightning import FAMILIES, lightning_family

import connector
import s3_checkpoint_io
import s3_pacing
import s3_utils
from s3_utils import S3ClientSettings, S3Utils

MiB = 1024 * 1024


# ---- botocore and urllib3: the direct socket path of downloads (s3_utils._socket_reader) ---------------------------


def test_a_response_body_exposes_the_socket_response_under_urllib3(s3_client, bucket: str) -> None:
    s3_client.put_object(Bucket=bucket, Key="body", Body=b"x" * 100)
    body = S3Utils().client.get_object(Bucket=bucket, Key="body")["Body"]
    try:
        raw = body._raw_stream  # botocore StreamingBody -> urllib3 HTTPResponse
        assert isinstance(raw._fp, http.client.HTTPResponse)  # urllib3 -> http.client
        assert callable(raw.release_conn)
        assert raw._fp.readinto(bytearray(100)) == 100
        assert raw._fp.isclosed()  # read to its end: what decides that the connection goes back to the pool
    finally:
        body.close()


def test_real_downloads_take_the_direct_socket_path(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    utils = S3Utils()
    url = f"s3://{bucket}/direct"
    data = os.urandom(11 * MiB)
    utils.upload_file_stream_to_s3(io.BytesIO(data), url, chunk_size_MB=5)
    reads: list[bool] = []  # per response body: read straight from http.client's response (True) or not
    real = s3_utils._socket_reader

    def socket_reader(body: Any) -> Any:
        readinto, finish = real(body)
        reads.append(isinstance(getattr(readinto, "__self__", None), http.client.HTTPResponse))
        return readinto, finish

    monkeypatch.setattr(s3_utils, "_socket_reader", socket_reader)
    with utils.download_to_memory(url, chunk_size_MB=5) as downloaded:
        assert downloaded.read_all() == data
    target = bytearray(1000)
    assert utils.read_range_into(url, 5, target) == 1000 and bytes(target) == data[5:1005]
    assert reads == [True] * (3 + 1), "a body was read through the slow public path"  # three ranges, one ranged read


# ---- botocore: the region redirector's context key (s3_utils._no_region_redirects) ---------------------------------


def test_the_redirect_context_is_marked_before_every_call(s3_server, bucket: str) -> None:
    client = S3Utils(S3ClientSettings(endpoint_url=s3_server.endpoint_url, user_agent_extra="redirect-pin")).client
    seen: list[Any] = []
    client.meta.events.register("before-call.s3", lambda params, **_: seen.append(params["context"].get("s3_redirect")))
    client.head_bucket(Bucket=bucket)
    assert seen and isinstance(seen[-1], dict), "botocore no longer puts 's3_redirect' in the request context"
    assert seen[-1]["redirected"] is True  # set by _no_region_redirects, registered before this handler


def test_the_redirector_honours_the_redirected_flag() -> None:
    botocore_utils = pytest.importorskip("botocore.utils")
    redirector_class = botocore_utils.S3RegionRedirectorv2
    client = S3Utils(S3ClientSettings(endpoint_url="http://127.0.0.1:9", region_name="us-east-1")).client
    operation = client.meta.service_model.operation_model("HeadObject")
    request = {"context": {"s3_redirect": {"redirected": True, "bucket": "b", "params": {"Bucket": "b"}}}}
    response = (None, {"Error": {"Code": "PermanentRedirect"}, "ResponseMetadata": {"HTTPHeaders": {}}})
    assert redirector_class(None, client).redirect_from_error(request, response, operation) is None
    source = inspect.getsource(redirector_class.redirect_from_error)
    assert "'s3_redirect'" in source and "'redirected'" in source


def test_botocore_retry_codes_are_all_retried_here() -> None:
    standard = pytest.importorskip("botocore.retries.standard")
    special = pytest.importorskip("botocore.retries.special")
    dynamodb_only = {"ProvisionedThroughputExceededException", "TransactionInProgressException"}
    not_s3 = dynamodb_only | {"LimitExceededException"}
    codes = set(standard.ThrottledRetryableChecker._THROTTLED_ERROR_CODES)
    codes |= set(standard.TransientRetryableChecker._TRANSIENT_ERROR_CODES)
    assert "IDPCommunicationError" in inspect.getsource(special.RetryIDPCommunicationError)
    assert codes - not_s3 <= s3_pacing.RETRIABLE_ERROR_CODES
    assert set(standard.TransientRetryableChecker._TRANSIENT_STATUS_CODES) <= s3_pacing.RETRIABLE_HTTP_STATUSES


# ---- s3fs: its instance cache and listings cache (s3_utils.invalidate_fsspec_cache, forget_s3fs_instances) ---------


def test_s3fs_instances_are_cached_where_the_helpers_look(s3_server, s3_client, bucket: str) -> None:
    s3fs = pytest.importorskip("s3fs")
    s3_utils.forget_s3fs_instances()
    assert not s3fs.S3FileSystem._cache
    fs = s3fs.S3FileSystem(
        key=s3_server.access_key,
        secret=s3_server.secret_key,
        client_kwargs={"endpoint_url": s3_server.endpoint_url, "region_name": s3_server.region},
    )
    assert fs in s3fs.S3FileSystem._cache.values()
    s3_client.put_object(Bucket=bucket, Key="dir/a.ckpt", Body=b"a")
    assert fs.ls(f"{bucket}/dir") == [f"{bucket}/dir/a.ckpt"]  # now cached
    s3_client.put_object(Bucket=bucket, Key="dir/b.ckpt", Body=b"b")
    assert not fs.exists(f"{bucket}/dir/b.ckpt"), "s3fs no longer answers from its listings cache (fine, but look)"
    s3_utils.invalidate_fsspec_cache(f"s3://{bucket}/dir/b.ckpt")
    assert fs.exists(f"{bucket}/dir/b.ckpt")
    s3_utils.forget_s3fs_instances()
    assert not s3fs.S3FileSystem._cache


# ---- torch: the archive writer that S3 saves build without zip CRC32s (s3_checkpoint_io.torch_save_without_zip_crc32)


def test_torch_save_pieces_for_archives_without_zip_crc32() -> None:
    """``torch._C.PyTorchFileWriter(stream, compute_crc32, alignment)`` and ``torch.serialization._save(obj, zip_file,
    pickle_module, pickle_protocol, _disable_byteorder_record)``, as ``torch.save`` itself calls them: without them
    S3 saves quietly fall back to ``torch.save`` and its CRC32 pass. The archive is torch.save's, record for record,
    except for the CRC fields."""
    assert tuple(inspect.signature(torch.serialization._save).parameters) == s3_checkpoint_io._TORCH_SAVE_PARAMETERS
    assert inspect.signature(torch.serialization._get_storage_alignment).parameters == {}
    assert s3_checkpoint_io.zip_writer_without_crc32()
    value = {"w": torch.randn(300, 7), "b": torch.arange(5, dtype=torch.int16), "meta": {"step": 3}}
    ours, theirs = io.BytesIO(), io.BytesIO()
    s3_checkpoint_io.torch_save_without_zip_crc32(value, ours)
    torch.save(value, theirs)
    with zipfile.ZipFile(ours) as mine, zipfile.ZipFile(theirs) as reference:
        layout = [(r.filename, r.header_offset, r.file_size, r.compress_type) for r in mine.infolist()]
        assert layout == [(r.filename, r.header_offset, r.file_size, r.compress_type) for r in reference.infolist()]
        assert {r.CRC for r in mine.infolist()} == {0} and reference.testzip() is None
    loaded = torch.load(io.BytesIO(ours.getvalue()), weights_only=True)
    assert torch.equal(loaded["w"], value["w"]) and torch.equal(loaded["b"], value["b"])
    assert loaded["meta"] == {"step": 3}


# ---- CPython and ctypes: the buffer protocol that finds a write's address (s3_checkpoint_io.buffer_address) --------


def test_py_buffer_layout_gives_the_exporters_address() -> None:
    """``Py_buffer`` as `_py_buffer_api` declares it: `buffer_address` gives the address the exporter gives, for a
    writable bytearray and for read-only bytes (torch hands `write` read-only views), and None for what is not one
    block. If the layout were wrong, borrowed parts would quietly never be recognised."""
    import ctypes

    target = bytearray(b"-" * 64)
    address = ctypes.addressof(ctypes.c_char.from_buffer(target))
    assert s3_checkpoint_io.buffer_address(memoryview(target)[8:]) == address + 8
    data = b"abcdef"
    assert ctypes.string_at(s3_checkpoint_io.buffer_address(memoryview(data).toreadonly()), 6) == data
    assert s3_checkpoint_io.buffer_address(memoryview(bytearray(20))[::2]) is None  # not one block


def test_torch_writes_each_storage_in_one_write_call() -> None:
    """torch's archive writer hands `write` a tensor's bytes in one read-only view per storage, so a large tensor's
    bytes reach `S3MultipartWriter.write_borrowed` in one piece, to be lent or borrowed whole."""

    class Recorder(io.RawIOBase):
        def __init__(self) -> None:
            self.sizes: list[tuple[int, bool]] = []

        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:
            view = memoryview(data)
            self.sizes.append((view.nbytes, view.readonly))
            return view.nbytes

    recorder = Recorder()
    s3_checkpoint_io.torch_save_without_zip_crc32({"w": torch.zeros(MiB), "b": torch.ones(3)}, recorder)
    assert (4 * MiB, True) in recorder.sizes
    assert sum(size for size, _ in recorder.sizes if size >= MiB) == 4 * MiB


def test_torch_hands_write_each_storages_own_memory() -> None:
    """The view torch's archive writer gives `write` for a CPU storage is that storage's memory itself (no copy):
    what lets s3_dcp record where a tensor's bytes lie and both plugins upload whole parts from it without a copy
    (`S3MultipartWriter.write_borrowed`). If torch copied first, the address check would send every byte through part
    buffers again, correct but slower; this test says so first."""
    tensor = torch.arange(3 * MiB, dtype=torch.float32)
    seen: list[tuple[int, int | None]] = []

    class Recorder(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:
            seen.append((memoryview(data).nbytes, s3_checkpoint_io.buffer_address(data)))
            return memoryview(data).nbytes

    s3_checkpoint_io.torch_save_without_zip_crc32({"t": tensor}, Recorder())
    assert (tensor.numel() * 4, tensor.data_ptr()) in seen
    assert s3_checkpoint_io.buffer_address(memoryview(b"abc")[1:]) is not None
    assert s3_checkpoint_io.buffer_address(memoryview(bytearray(8))[::2]) is None  # not one block


def test_torch_archive_framing_without_zip_crcs_does_not_depend_on_the_values() -> None:
    """Without zip CRCs, what torch's archive writer puts around a tensor's storage bytes (record headers, the
    pickle, the serialization id) is the same for every tensor of one dtype, shape and strides: what lets s3_dcp
    write a file's later tensors of a kind with the first one's framing (`s3_dcp._save_tensor`). If torch put
    anything value-dependent there, that reuse would write wrong archives; this test says so first."""
    assert s3_checkpoint_io.zip_writer_without_crc32()

    def framing(tensor: Any) -> tuple[bytes, bytes]:
        archive = io.BytesIO()
        s3_checkpoint_io.torch_save_without_zip_crc32(tensor, archive)
        data, payload = archive.getvalue(), tensor.numpy().tobytes()
        start = data.index(payload)
        return data[:start], data[start + len(payload) :]

    generator = torch.Generator().manual_seed(3)
    for shape in ((1000,), (7, 33)):
        first, second = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
        assert framing(first) == framing(second)
    assert framing(torch.randn(1000, generator=generator)) != framing(torch.randn(1001, generator=generator))


# ---- torch: the checkpoint format checks of S3CheckpointIO.load_checkpoint ------------------------------------------


def test_torch_zip_magic_and_weights_only_message(tmp_path) -> None:
    zip_path, legacy_path = tmp_path / "new.pt", tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, zip_path)
    torch.save({"w": torch.ones(2)}, legacy_path, _use_new_zipfile_serialization=False)
    magic = s3_checkpoint_io._TORCH_ZIP_MAGIC
    assert zip_path.read_bytes().startswith(magic) and not legacy_path.read_bytes().startswith(magic)
    with open(zip_path, "rb") as stream:
        assert torch.serialization._is_zipfile(stream)  # the rule _is_torch_zip copies
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"w": pickle.loads(pickle.dumps(_Unsafe()))}, unsafe)
    with pytest.raises(pickle.UnpicklingError) as refused:
        torch.load(unsafe, weights_only=True)
    assert s3_checkpoint_io._WEIGHTS_ONLY_REFUSAL in str(refused.value).lower()


class _Unsafe:
    """A class weights_only=True refuses to unpickle."""


# ---- torch: DCP's default planners and DTensor chunks (s3_dcp.S3SavePlanner, S3LoadPlanner) -----------------------


class _ChunkStandIn:
    """Answers the hooks torch's default planners ask of a DTensor, as s3_dcp._PlannedDTensor does."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def size(self) -> torch.Size:
        return torch.Size([4])

    def __create_write_items__(self, fqn: str, obj: object) -> list[object]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        self.asked.append("write items")
        chunk = ChunkStorageMetadata(offsets=torch.Size([2]), sizes=torch.Size([2]))
        data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=torch.float32), size=torch.Size([4]))
        return [WriteItem(index=MetadataIndex(fqn, torch.Size([2])), type=WriteItemType.SHARD, tensor_data=data)]

    def __create_chunk_list__(self) -> list[object]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        self.asked.append("chunks")
        return [ChunkStorageMetadata(offsets=torch.Size([2]), sizes=torch.Size([2]))]


def test_default_planners_ask_their_state_dicts_values_for_dtensor_chunks() -> None:
    """S3SavePlanner / S3LoadPlanner put a stand-in for each DTensor into ``planner.state_dict`` (where
    ``set_up_planner`` keeps the flattened state) while torch's ``create_local_plan`` runs, and torch's code asks it
    ``__create_write_items__`` / ``__create_chunk_list__`` and ``size()``. Without this the planners notice the
    stand-in was not asked and plan with torch's own code (correct, without the saving)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    saver = DefaultSavePlanner()
    saver.set_up_planner({"w": torch.ones(4)}, None, True)
    assert set(saver.state_dict) == {"w"}
    stand_in = _ChunkStandIn()
    saver.state_dict = {"w": stand_in}
    plan = saver.create_local_plan()
    assert stand_in.asked == ["write items"] and [i.index.offset for i in plan.items] == [torch.Size([2])]

    chunks = [ChunkStorageMetadata(offsets=torch.Size([o]), sizes=torch.Size([2])) for o in (0, 2)]
    properties = TensorProperties(dtype=torch.float32)
    stored = TensorStorageMetadata(properties=properties, size=torch.Size([4]), chunks=chunks)
    loader = DefaultLoadPlanner()
    loader.set_up_planner({"w": torch.zeros(4)}, Metadata(state_dict_metadata={"w": stored}), True)
    stand_in = _ChunkStandIn()
    loader.state_dict = {"w": stand_in}
    plan = loader.create_local_plan()
    assert stand_in.asked == ["chunks"]
    assert [(i.storage_index.offset, i.dest_offsets, i.lengths) for i in plan.items] == [
        (torch.Size([2]), torch.Size([0]), torch.Size([2]))
    ]


def test_dtensor_chunks_come_from_torchs_index_building_function() -> None:
    """The function the planners avoid, and the plain-data form tests/test_dcp_planner.py checks `_shard_chunk`
    against: ``_compute_local_shape_and_global_offset(global_shape, mesh_shape, coordinate, placements)``. If DCP's
    helpers stop calling the public-named wrapper, the planners save nothing any more and can go."""
    from torch.distributed.checkpoint import planner_helpers
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    for helper in (planner_helpers._create_write_items_for_dtensor, planner_helpers._create_chunk_from_dtensor):
        assert "compute_local_shape_and_global_offset(" in inspect.getsource(helper)
    assert hasattr(DTensor, "__create_write_items__") and hasattr(DTensor, "__create_chunk_list__")
    assert _compute_local_shape_and_global_offset((7,), (2,), [1], [Shard(0)]) == ((3,), (4,))
    assert _compute_local_shape_and_global_offset((1, 3), (2,), [1], [Shard(0)]) == ((0, 3), (1, 0))


# ---- torch: writing a torch.save archive record by record, reading one lazily (s3_checkpoint_convert) -------------


class _AppendOnly(io.RawIOBase):
    """A stream that can only be appended to, as an upload is: no seek, no tell."""

    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.data += data
        return len(memoryview(data))

    def seek(self, *args: Any) -> int:
        raise AssertionError("the archive writer must only append")

    def tell(self) -> int:
        raise AssertionError("the archive writer must only append")


def test_the_archive_writer_streams_records_that_torch_load_reads() -> None:
    """_write_torch: torch._C.PyTorchFileWriter over an append-only stream, one record per storage, written after a
    pickle of torch.save's shape (persistent ids, _rebuild_tensor_v2); storage slices are views."""
    tensor = torch.arange(12, dtype=torch.float32)
    storage = tensor.untyped_storage()[8:24]  # bytes 8-24: elements 2..5, a view, not a copy
    assert storage.data_ptr() == tensor.data_ptr() + 8
    stream = _AppendOnly()
    archive = torch._C.PyTorchFileWriter(
        stream, torch.serialization.get_crc32_options(), torch.serialization._get_storage_alignment()
    )
    storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[torch.float32])
    pickled = io.BytesIO()

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return ("storage", storage_type, "0", "cpu", 4) if obj == "pending" else None

    rebuild = torch._utils._rebuild_tensor_v2
    Pickler(pickled, protocol=torch.serialization.DEFAULT_PROTOCOL).dump(
        {"w": _Reduced(rebuild, ("pending", 0, (2, 2), (2, 1), False, collections.OrderedDict()))}
    )
    archive.write_record("data.pkl", pickled.getvalue(), len(pickled.getvalue()))
    archive.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    archive.write_record("data/0", storage, storage.nbytes())
    archive.write_end_of_file()
    loaded = torch.load(io.BytesIO(bytes(stream.data)), weights_only=True)
    assert torch.equal(loaded["w"], torch.tensor([[2.0, 3.0], [4.0, 5.0]]))


class _Reduced:
    def __init__(self, function: Any, args: tuple[Any, ...]) -> None:
        self.function, self.args = function, args

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.function, self.args


def test_a_meta_load_reads_no_tensor_bytes_and_records_where_each_storage_lies() -> None:
    """_TorchFileSource: torch.load(map_location="meta") gives each storage `_checkpoint_offset`, the position of its
    bytes in the file, without reading them; DCP's set_element builds the nested dict from a flattened path."""
    import torch.distributed.checkpoint._traverse as traverse

    buffer = io.BytesIO()
    torch.save({"a": torch.full((1000,), 7.0), "b": torch.arange(3)}, buffer)
    data = buffer.getvalue()
    meta = torch.load(io.BytesIO(data), map_location="meta", weights_only=True)
    for key, expected in (("a", torch.full((1000,), 7.0)), ("b", torch.arange(3))):
        offset = meta[key].untyped_storage()._checkpoint_offset
        assert meta[key].device.type == "meta"
        stored = torch.frombuffer(bytearray(data[offset : offset + expected.nbytes]), dtype=expected.dtype)
        assert torch.equal(stored, expected)
    state: dict[str, Any] = {}
    traverse.set_element(state, ("x", "y", 1), 5)
    assert state == {"x": {"y": [None, 5]}}


# ---- Lightning (both families): the names connector.py overrides or reads -------------------------------------------


@pytest.fixture(params=FAMILIES)
def pl(request: pytest.FixtureRequest) -> Any:
    return lightning_family(request.param)


def _family(pl: Any) -> str:
    return pl.__name__


def test_checkpoint_connector_names(pl: Any) -> None:
    module = importlib.import_module(f"{_family(pl)}.trainer.connectors.checkpoint_connector")
    base = module._CheckpointConnector  # subclassed by NeMoCheckpointConnector
    parameters = list(inspect.signature(base._parse_ckpt_path).parameters)
    assert parameters[:5] == ["self", "state_fn", "ckpt_path", "model_provided", "model_connected"], parameters
    assert "checkpoint_path" in inspect.signature(base.resume_start).parameters
    source = inspect.getsource(module)
    assert "self._parse_ckpt_path(" in source  # Lightning still routes ckpt_path through the overridden hook
    assert "._find_last_checkpoints(" in source  # and asks ModelCheckpoint for the "last" candidates this way


def test_trainer_connector_and_strategy_attributes(pl: Any) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    base = importlib.import_module(f"{_family(pl)}.trainer.connectors.checkpoint_connector")._CheckpointConnector
    current = trainer._checkpoint_connector
    assert isinstance(current, base)
    assert {"_ckpt_path", "_user_managed"} <= set(vars(current))  # install_checkpoint_connector copies vars()
    trainer.ckpt_path = "s3://bucket/run/last.ckpt"
    assert (current._ckpt_path, current._user_managed) == ("s3://bucket/run/last.ckpt", True)
    assert hasattr(trainer.strategy, "_checkpoint_io")  # read without creating Lightning's default plugin
    installed = connector.install_checkpoint_connector(trainer)
    assert trainer._checkpoint_connector is installed and installed._ckpt_path == "s3://bucket/run/last.ckpt"


def test_model_checkpoint_hooks(pl: Any) -> None:
    model_checkpoint = pl.callbacks.ModelCheckpoint
    source = inspect.getsource(importlib.import_module(model_checkpoint.__module__))
    for hook, arguments, called_from_model_checkpoint in [
        ("_find_last_checkpoints", ["self", "trainer"], False),  # called by the connector (test above)
        ("_ModelCheckpoint__warn_if_dir_not_empty", ["self", "dirpath"], True),
        ("_save_checkpoint", ["self", "trainer", "filepath"], True),
        ("_remove_checkpoint", ["self", "trainer", "filepath"], True),
        ("_should_remove_checkpoint", ["self", "trainer", "previous", "current"], True),  # kept_from_removal
        ("file_exists", ["self", "filepath", "trainer"], True),
    ]:
        function = getattr(model_checkpoint, hook, None)
        assert function is not None, f"{model_checkpoint.__module__}.ModelCheckpoint has no {hook} any more"
        assert list(inspect.signature(function).parameters)[: len(arguments)] == arguments, hook
        called = hook.replace("_ModelCheckpoint", "")  # a mangled name is called as self.__name inside the class
        assert not called_from_model_checkpoint or f"self.{called}(" in source, (
            f"ModelCheckpoint no longer calls {hook}"
        )
    for attribute in ("best_k_models", "kth_best_model_path", "kth_value", "best_model_path", "best_model_score"):
        assert hasattr(model_checkpoint(), attribute), attribute
    assert isinstance(model_checkpoint.CHECKPOINT_NAME_LAST, str) and model_checkpoint.FILE_EXTENSION == ".ckpt"
    assert pl.callbacks.OnExceptionCheckpoint.__name__ == "OnExceptionCheckpoint"  # matched by name in connector


def test_callback_state_keys(pl: Any) -> None:
    """S3ModelCheckpoint's ``state_key`` is ModelCheckpoint's; its ``_legacy_state_key`` (Lightning's fallback key on
    load) is the ``S3ModelCheckpoint{...}`` key earlier versions wrote, so their checkpoints keep the callback state."""
    source = inspect.getsource(importlib.import_module(f"{_family(pl)}.trainer.call"))
    assert "callback_states.get(callback.state_key, callback_states.get(callback._legacy_state_key))" in source
    assert "def _generate_state_key" in inspect.getsource(pl.callbacks.Callback)  # the class name leads the key
    assert pl.callbacks.ModelCheckpoint(monitor="x").state_key.startswith("ModelCheckpoint{")


def test_checkpoint_io_bases_and_the_async_wrapper(pl: Any) -> None:
    plugin = s3_checkpoint_io.S3CheckpointIO("s3://bucket/run", chunk_size_MB=5)
    registered = s3_checkpoint_io.register_with_lightning(type(plugin))
    assert set(registered) <= set(s3_checkpoint_io._LIGHTNING_CHECKPOINT_IO_BASES) and registered
    assert isinstance(plugin, pl.plugins.io.CheckpointIO)
    wrapped = pl.plugins.io.AsyncCheckpointIO(plugin)
    assert wrapped.checkpoint_io is plugin  # connector._s3_utils_of_trainer unwraps it this way
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, plugins=[wrapped])
    assert connector._s3_utils_of_trainer(trainer) is plugin.s3


def test_no_released_lightning_needs_the_removed_checkpoint_io_attributes(pl: Any) -> None:
    """``requires_cpu_collectives``, ``requires_state_on_load`` and ``_restore_after_setup`` were set for a Lightning
    that never shipped them; if an installed Lightning reads one, this fails and they must come back."""
    root = os.path.dirname(importlib.import_module(_family(pl).split(".")[0]).__file__ or "")
    names = ("requires_cpu_collectives", "requires_state_on_load", "_restore_after_setup")
    readers = []
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as source:
                    text = source.read()
                readers += [f"{name}: {attribute}" for attribute in names if attribute in text]
    assert not readers, readers


def test_nemo_topk_hook_when_nemo_is_installed() -> None:
    nemo_checkpoint = pytest.importorskip("nemo.utils.callbacks.nemo_model_checkpoint")
    assert hasattr(nemo_checkpoint.NeMoModelCheckpoint, "_remove_invalid_entries_from_topk")


# ---- megatron-core: what its own save strategy is, where the routing catches it (s3_mcore) --------------------------


@pytest.fixture(scope="module")
def megatron_strategies() -> Any:
    from mcore_stub import megatron_core_installed, stand_in_for_triton_leaf

    if not megatron_core_installed():
        pytest.skip("megatron-core is not installed")
    stand_in_for_triton_leaf()
    return importlib.import_module("megatron.core.dist_checkpointing.strategies.torch")


def test_megatron_cores_save_strategy_arguments(megatron_strategies: Any) -> None:
    """S3SaveShardedStrategyMixin takes exactly these (a new one must be honoured or refused there), and reads the
    attributes megatron-core's ``__init__`` stores them in (``cached_metadata`` as ``use_cached_ckpt_structure``)."""
    import s3_mcore

    base = megatron_strategies.TorchDistSaveShardedStrategy
    params = inspect.signature(base.__init__).parameters
    ours = list(inspect.signature(s3_mcore.S3SaveShardedStrategyMixin.__init__).parameters)
    assert list(params) == ours[:-1] and ours[-1] == "writer_options"
    stock = base(separation_hint="x.", cached_metadata=True, cpu_shm_mode=True, thread_count=3)
    assert (stock.separation_hint, stock.use_cached_ckpt_structure, stock.cpu_shm_mode) == ("x.", True, True)
    assert (stock.thread_count, stock.keep_only_main_replica) == (3, True)


def test_every_save_of_megatron_cores_strategy_goes_through_its_save_methods(megatron_strategies: Any) -> None:
    """s3_mcore's routing catches megatron-core's own strategy at ``TorchDistSaveShardedStrategy.save`` /
    ``async_save``: ``dist_checkpointing.save`` builds that class for a missing or unknown strategy (its default,
    ``('torch_dist', 1)``), calls ``save`` or ``async_save(sd, dir, async_strategy)``, and the fully-parallel wrapper
    calls its base strategy's; the last guard is the local writer's constructor, whose first argument is the path."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import filesystem_async, fully_parallel

    base = megatron_strategies.TorchDistSaveShardedStrategy
    assert list(inspect.signature(base.save).parameters) == ["self", "sharded_state_dict", "checkpoint_dir"]
    assert list(inspect.signature(base.async_save).parameters)[:4] == [
        "self", "sharded_state_dict", "checkpoint_dir", "async_strategy"
    ]
    source = inspect.getsource(serialization.save)
    assert "sharded_strategy = TorchDistSaveShardedStrategy()" in source
    assert "sharded_strategy.save(sharded_state_dict, checkpoint_dir)" in source
    assert "sharded_strategy.async_save(sharded_state_dict, checkpoint_dir, async_strategy)" in source
    assert type(serialization.get_default_save_sharded_strategy()) is base
    wrapper = inspect.getsource(fully_parallel.FullyParallelSaveStrategyWrapper)
    assert "self.base_strategy.save(sharded_state_dict, checkpoint_dir)" in wrapper
    assert "self.base_strategy.async_save(sharded_state_dict, checkpoint_dir, async_strategy)" in wrapper
    writer_init = inspect.signature(filesystem_async.FileSystemWriterAsync.__init__).parameters
    assert list(writer_init)[:2] == ["self", "path"]
    assert megatron_strategies._import_mcore_async()["FileSystemWriterAsync"] is filesystem_async.FileSystemWriterAsync
