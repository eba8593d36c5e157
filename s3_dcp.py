"""Sharded checkpoints on S3: ``torch.distributed.checkpoint`` (DCP) storage and Lightning's sharded strategies.

`S3StorageWriter` and `S3StorageReader` plug into ``dcp.save`` / ``dcp.async_save`` / ``dcp.load``::

    dcp.save(state, storage_writer=S3StorageWriter("s3://bucket/run/step-100"))
    dcp.load(state, storage_reader=S3StorageReader("s3://bucket/run/step-100"))

The checkpoint keeps DCP's standard layout (``__{rank}_{n}.distcp`` files and a pickled ``.metadata``), so torch's
own ``FileSystemReader`` loads it once the prefix is copied to a local directory. On top of that:

* every shard streams into a checksummed multipart upload and appears only when complete; a failed save aborts its
  uploads, leaving no partial object and no open multipart upload;
* every ``.distcp`` file ends with a nonce drawn for it, after its last item (``s3ckpt-nonce``, 32 random hex digits
  and a newline: bytes no DCP read touches, as items are read by the offsets and lengths in ``.metadata``), so no two
  saves leave the same bytes, nor the same ETag, at one key: a stale run's ETag condition never holds on a newer run's
  file (docs/fencing.md);
* ``.metadata`` is the commit marker, one PUT by the coordinator once every rank reported its files durable (no
  copy + delete "rename"); an overwrite deletes the old ``.metadata`` first, so a half-replaced checkpoint never
  looks complete;
* fencing: the coordinator's run owns the checkpoint directory (`s3_fencing.DirectoryFence`), checked by every rank
  before its files complete and by the coordinator before ``.metadata``: a stale run's save fails with
  `s3_fencing.CheckpointDirectoryTakenError`, overwriting and committing nothing;
* per-item checksums, recorded beside ``.metadata`` (before it), let partial and resharded loads verify every byte;
* loads use parallel ranged GETs, adjacent items coalesced, by the read path the reader is given (`ReadPath`, the
  reference, or a faster subclass; `FastReads` by default); ``.metadata`` is unpickled with an allow-list, so a
  prefix someone else can write cannot run code on the ranks that load it.

Importing this module never fails for a missing extra: without torch the classes are still defined, and building one
raises the ImportError naming the install line. Lightning is imported only by `sharded_strategy_class` and the
strategy names.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import dataclasses
import functools
import inspect
import io
import json
import logging
import math
import os
import pickle
import struct
import sys
import threading
import traceback
import uuid
import zipfile
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

if __package__:
    from . import s3_checkpoint_io as _ckpt_io
    from . import s3_dirpath_utils as _urls
    from . import s3_fencing as _fencing
    from . import s3_pacing as _pacing
    from . import s3_prefix_spreading as _spread
    from . import s3_process as _process
    from . import s3_utils as _s3
else:  # installed (or copied) as top-level modules
    import s3_checkpoint_io as _ckpt_io
    import s3_dirpath_utils as _urls
    import s3_fencing as _fencing
    import s3_pacing as _pacing
    import s3_prefix_spreading as _spread
    import s3_process as _process
    import s3_utils as _s3

# ---- torch, imported once: every DCP name this module uses (the private ones are pinned by tests/test_dcp.py) -------
try:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import (
        LoadItemType,
        LoadPlan,
        LoadPlanner,
        ReadItem,
        SavePlan,
        SavePlanner,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )
    from torch.distributed.checkpoint.staging import BlockingAsyncStager
    from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError as exc:
    _DCP_IMPORT_ERROR: ImportError | None = exc

    class _NeedsDCP:
        """Stands in for DCP's base classes without torch: the module imports, building a class raises."""

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            _require_dcp()

    class StorageWriter(_NeedsDCP): ...  # type: ignore[no-redef]

    class BlockingAsyncStager(_NeedsDCP): ...  # type: ignore[no-redef]

    class StorageReader(_NeedsDCP): ...  # type: ignore[no-redef]

    class DefaultSavePlanner(_NeedsDCP): ...  # type: ignore[no-redef]

    class DefaultLoadPlanner(_NeedsDCP): ...  # type: ignore[no-redef]

else:
    _DCP_IMPORT_ERROR = None

__all__ = [
    "CheckpointIncompleteError",
    "CheckpointWriteError",
    "DirectReads",
    "DirectScatterReads",
    "FastReads",
    "ReadPath",
    "S3FSDPStrategy",
    "S3LoadPlanner",
    "S3ModelParallelStrategy",
    "S3SavePlanner",
    "S3ShardedStrategyMixin",
    "S3StorageReader",
    "S3StorageWriter",
    "ScatterReads",
    "SpanReads",
    "UnsafeCheckpointMetadataError",
    "WindowReads",
    "sharded_strategy_class",
]

logger = logging.getLogger(__name__)

METADATA_NAME = ".metadata"  # package-internal (docs/api.md)
"""DCP's commit marker, at the root of the checkpoint prefix (``__{rank}.metadata`` per rank without collectives)."""
DCP_SHARD_SUFFIX = ".distcp"  # package-internal (docs/api.md)
ITEM_CHECKSUMS_NAME = ".s3ckpt-items.json"  # package-internal (docs/api.md)
"""Per-item checksums recorded by `S3StorageWriter`, written just before ``.metadata``
(``__{rank}.s3ckpt-items.json`` without collectives). DCP itself never reads it."""
DEFAULT_DCP_MAX_WRITE_CONCURRENCY = 4
"""Part uploads in flight per rank. Lower than a single-process save's default: in a sharded save every rank of a
node uploads at the same time, so the node has ranks x this many parts in flight (benchmarks/README.md)."""
DEFAULT_COALESCE_GAP_MB = 4.0
"""Items of one file closer than this are fetched by one ranged GET (the bytes between are read and dropped)."""
_ITEM_RECORD_VERSION = 1
"""The item-checksum record's format. Additions that older readers can ignore (such as ``"tensors"``) keep it."""


def metadata_name(rank: int | None = None) -> str:
    """``.metadata``, or ``__{rank}.metadata`` for a save made with ``use_collectives=False``."""
    return METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"


def item_checksums_name(rank: int | None = None) -> str:
    """The item-checksum record that goes with `metadata_name(rank)`. Package-internal (docs/api.md)."""
    return ITEM_CHECKSUMS_NAME if rank is None else f"__{rank}{ITEM_CHECKSUMS_NAME}"


class CheckpointIncompleteError(FileNotFoundError):
    """The prefix holds no ``.metadata``: the checkpoint was never completed (or never existed)."""


class CheckpointWriteError(OSError):
    """A shard could not be uploaded; its upload was aborted and the checkpoint was not committed."""


class UnsafeCheckpointMetadataError(pickle.UnpicklingError):
    """``.metadata`` references something other than DCP's metadata types; it was refused without running it."""


def _require_dcp() -> None:
    """Raise the ImportError naming the install line when torch or ``torch.distributed.checkpoint`` is missing."""
    if _DCP_IMPORT_ERROR is not None:
        _process.import_optional_dependency("torch.distributed.checkpoint", "distributed checkpoints")
        raise _DCP_IMPORT_ERROR


def _join(base: str, name: str) -> str:
    return _spread.join(base, name)  # a name may lead to a spread directory beside the checkpoint's (../)


def _tier_config(value: Any) -> Any:
    """The `s3_memory_tier.MemoryTier` a ``memory_tier=`` means (None: off); ImportError naming a file a fork lacks."""
    return None if value is None or value is False else _dcp_tier().config(value)


def _dcp_tier() -> Any:  # the memory tier's DCP side, a sibling module imported on first use (it imports the tier)
    return _process.require_sibling("s3_dcp_tier", __package__, "memory_tier", "s3_dcp.py", needs=("s3_memory_tier",),
                                    otherwise=", or leave memory_tier unset")  # fmt: skip


def _checkpoint_url(path: str | os.PathLike[str]) -> str:
    url = _urls.normalize_s3_url(path).rstrip("/")
    bucket, key = _urls.parse_s3_url(url)
    if not key:
        raise ValueError(f"{url}: a DCP checkpoint needs a key prefix inside the bucket, e.g. s3://{bucket}/ckpt")
    return url


# --------------------------------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------------------------------

_FILESYSTEM_WRITER_OPTIONS: dict[str, tuple[Any, str]] = {
    # torch FileSystemWriter's argument: (the one value it has here, or ... for any; why)
    "sync_files": (..., "an S3 object is durable once its upload completes, with nothing to fsync"),
    "per_thread_copy_ahead": (..., "each tensor is copied to host as its item is written, with no queue to size"),
    "single_file_per_rank": (True, "each rank writes one object per thread (thread_count), never one per tensor"),
    "serialization_format": ("torch_save", "its objects are torch_save .distcp files (no safetensors)"),
    "_extensions": (None, "it has no stream transforms (extensions)"),
}


def _check_filesystem_writer_options(options: dict[str, Any]) -> None:
    """Refuse by name (ValueError, with the reason) a torch ``FileSystemWriter`` argument whose value has no meaning
    on S3; any other unknown keyword is a TypeError naming it, as Python's own."""
    for name, value in options.items():
        if name not in _FILESYSTEM_WRITER_OPTIONS:
            raise TypeError(f"S3StorageWriter got an unexpected keyword argument {name!r}")
        only, why = _FILESYSTEM_WRITER_OPTIONS[name]
        if only is not ... and getattr(value, "value", value) != only:
            raise ValueError(f"S3StorageWriter does not support {name}={value!r}: {why}")


@dataclass(frozen=True)
class _FilePrefix:
    """The save plan's storage data: the file-name prefix of one rank (``__{rank}_``), and the coordinator's hold on
    the directory, which the rank checks before its files complete (None: fencing off)."""

    prefix: str
    fence: _fencing.FenceToken | None = None
    tier: Any = None  # with a memory tier: the coordinator's `s3_dcp_tier.TierPlan` of this save


def _file_trailer() -> bytes:
    """What follows a file's last item: a nonce drawn per file, so that two saves of the same tensors at one name
    (a straggler and its relaunch) differ in bytes and ETag, and the stale one's ``If-Match`` fails."""
    return b"s3ckpt-nonce " + os.urandom(16).hex().encode() + b"\n"


@dataclass(frozen=True)
class _ObjectRecord:
    size: int
    etag: str
    checksum: str  # base64 of the full-object checksum
    trailer: tuple[int, int, int] | None = None  # (offset, length, checksum) of the nonce after the last item


@dataclass(frozen=True)
class _ItemRecord:
    """A WriteResult's storage data: DCP's ``_StorageInfo`` (for ``.metadata``), plus the item's checksum and its
    file's identity (for the item-checksum record); `finish` on the coordinator splits them."""

    info: Any  # torch.distributed.checkpoint.filesystem._StorageInfo
    checksum: int
    algorithm: str
    obj: _ObjectRecord
    tensor: list[Any] | None = None  # `_TensorSpan.record()` when the item's tensor bytes were located while written


@dataclass(frozen=True)
class _TensorSpan:
    """Where a tensor item's own bytes lie in its item (the ``torch.save`` `write` whose buffer is the tensor's
    memory), recorded in the item-checksum record (``"tensors"``) with their own checksum: a load reads them straight
    into the target, or decodes a buffered item, without fetching or parsing the item's zip framing."""

    start: int  # from the item's first byte
    nbytes: int
    dtype: str  # "float32": torch's dtype name without "torch."
    shape: tuple[int, ...]

    def record(self, checksum: int) -> list[Any]:
        """``[start, nbytes, checksum, dtype, shape]``: the JSON form, under the item's offset."""
        return [self.start, self.nbytes, checksum, self.dtype, list(self.shape)]


class _SaveCancelledError(RuntimeError):
    """Another file of the same rank failed; this one stops too (its upload is aborted)."""


class _ItemStream(io.RawIOBase):
    """The stream ``torch.save`` writes an item into: forwards to the multipart writer, counting the offset; items are
    checksum boundaries, so their checksums come from the upload's own (one checksum pass per byte)."""

    def __init__(self, raw: _s3.S3MultipartWriter, cancelled: threading.Event) -> None:
        super().__init__()
        self._raw = raw
        self._cancelled = cancelled
        self._position = 0
        self._item_start = 0
        self._expected: Any = None  # the contiguous tensor the current item stores, when its span is wanted
        self._borrow = False  # whether that tensor is the caller's own memory (sent without a copy, `write_borrowed`)
        self.tensor_span: _TensorSpan | None = None  # of the last item, set by `write` when its tensor bytes pass
        self.error: BaseException | None = None

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def begin_item(self, tensor: Any = None, borrow: bool = False) -> None:
        """Start an item; with `tensor` (contiguous, its storage exactly its bytes) find the write of its bytes and
        mark checksum boundaries around it (`tensor_span`). `borrow`: that write's whole parts are uploaded from the
        tensor's memory (`S3MultipartWriter.write_borrowed`), only for the caller's own, unchanging tensors."""
        self._raw.mark_checksum_boundary()
        self._item_start = self._position
        self._expected = tensor
        self._borrow = borrow
        self.tensor_span = None

    def end_item(self) -> tuple[int, int]:
        """``(offset, length)`` of the bytes written since `begin_item`."""
        self._raw.mark_checksum_boundary()
        self._expected = None
        return self._item_start, self._position - self._item_start

    def write(self, data: Any) -> int:
        try:
            if self._cancelled.is_set():
                raise _SaveCancelledError(f"save of {self._raw.url} stopped: another file of this rank failed")
            tensor = self._expected
            if tensor is not None and self.tensor_span is None and self._carries(tensor, data):
                self._raw.mark_checksum_boundary()
                start = self._position - self._item_start
                written = self._raw.write_borrowed(data, tensor) if self._borrow else self._raw.write(data)
                self._raw.mark_checksum_boundary()
                dtype = str(tensor.dtype).removeprefix("torch.")
                self.tensor_span = _TensorSpan(start, written, dtype, tuple(tensor.shape))
            else:
                written = self._raw.write(data)
            self._position += written
            return written
        except BaseException as exc:
            self.error = self._raw.error or exc  # torch.save replaces it with a RuntimeError of its own
            raise

    @staticmethod
    def _carries(tensor: Any, data: Any) -> bool:
        """Whether `data` is the tensor's own memory, all of it (torch.save hands its storage to `write` as is)."""
        nbytes = tensor.numel() * tensor.element_size()
        return memoryview(data).nbytes == nbytes and _ckpt_io.buffer_address(data) == tensor.data_ptr()

    def flush(self) -> None:  # the multipart writer uploads full parts by itself
        pass

    def close(self) -> None:  # closing the item must not complete the object; `_write_file` does
        pass


@dataclass(frozen=True)
class _Framing:
    """The bytes ``torch.save`` (without zip CRCs) writes around a plain tensor's storage bytes: the same for every
    tensor of one dtype, shape, strides and storage size, whatever its values (tests pin this)."""

    head: bytes
    tail: bytes


class _FramingRecorder(io.RawIOBase):
    """Passes ``torch.save``'s writes on to `stream` and keeps copies of those around the one write that is the
    tensor's own memory (`_ItemStream._carries`): the `_Framing` of its kind, if that write came exactly once."""

    def __init__(self, stream: _ItemStream, tensor: Any) -> None:
        super().__init__()
        self._stream = stream
        self._tensor = tensor
        self._head: list[bytes] = []
        self._tail: list[bytes] | None = None
        self._ambiguous = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if _ItemStream._carries(self._tensor, data):
            self._ambiguous = self._ambiguous or self._tail is not None
            self._tail = []
        else:
            (self._head if self._tail is None else self._tail).append(bytes(data))
        return self._stream.write(data)

    def framing(self) -> _Framing | None:
        if self._tail is None or self._ambiguous:
            return None
        return _Framing(b"".join(self._head), b"".join(self._tail))


def _framing_key(tensor: Any) -> tuple[Any, ...] | None:
    """What a tensor's `_Framing` depends on, for a plain contiguous CPU tensor that is its whole storage and that
    ``torch.save`` stores as such (no subclass, attributes, autograd, conjugate or negative bit); else None."""
    if (
        type(tensor) is not torch.Tensor
        or tensor.layout != torch.strided
        or tensor.device.type != "cpu"
        or tensor.requires_grad
        or tensor.is_quantized
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor.__dict__
        or tensor.storage_offset()
        or not tensor.is_contiguous()
    ):
        return None
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes or tensor.untyped_storage().nbytes() != nbytes:
        return None
    return tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), nbytes


def _in_state_dict(planner: Any, item: Any, data: Any) -> bool:
    """Whether `data` (what the planner resolved for `item`) is the memory of a CPU tensor (or DTensor's local shard)
    in the caller's state dict, unchanged until the save returns: only such memory is lent to the upload; a tensor a
    planner made (maybe a reused buffer) is copied, as with planners without DefaultSavePlanner's ``lookup_object``."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None or data.device.type != "cpu":
        return False
    try:
        value = lookup(item.index)
    except Exception:
        return False
    if hasattr(value, "to_local"):  # a DTensor: its local shard is what was resolved
        value = value.to_local()
    return isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.data_ptr() == data.data_ptr()


def _save_tensor(tensor: Any, stream: _ItemStream, framings: dict[tuple[Any, ...], _Framing]) -> None:
    """`s3_checkpoint_io.torch_save_without_zip_crc32` of one tensor item into `stream`, byte for byte. A tensor like
    one already saved into this file (same dtype, shape, strides: repeated layers, biases, norms) reuses that save's
    framing around its own bytes, skipping most of a small item's save time (the fast path ``framing_reuse``)."""
    reuse = _ckpt_io.zip_writer_without_crc32() and _s3.fast_path("framing_reuse")
    key = _framing_key(tensor) if reuse else None
    framing = framings.get(key) if key is not None else None
    if framing is not None:
        stream.write(framing.head)
        stream.write(tensor_bytes_view(tensor))
        stream.write(framing.tail)
        return
    if key is None:
        _ckpt_io.torch_save_without_zip_crc32(tensor, stream)
        return
    recorder = _FramingRecorder(stream, tensor)
    _ckpt_io.torch_save_without_zip_crc32(tensor, recorder)
    found = recorder.framing()
    if found is not None:
        framings[key] = found


def _item_nbytes(item: Any) -> int:
    size = 1
    for dim in item.tensor_data.size:
        size *= dim
    return size * item.tensor_data.properties.dtype.itemsize


_SMALL_ITEM_BYTES = 64 * 1024
"""A file holds its byte items first, then its tensors under this size, then the others (each in plan order): what
every rank reads of another rank's file (values DCP stored once for all ranks: optimizer steps, scalars, objects)
then lies together at its start, one short GET away, instead of between large shards (where a load read 35 GETs
and 74 MiB of one 460 MiB file for 230 KiB of such items: benchmarks/README.md)."""


def _is_large(item: Any) -> bool:
    return _item_nbytes(item) >= _SMALL_ITEM_BYTES


def _split_items(bins: int, items: list[Any], byte_io: Any) -> list[list[Any]]:
    """Items per file: byte items round-robin, tensors largest first onto the least-filled file (as DCP does)."""
    if bins == 1:
        return [list(items)]
    buckets: list[list[Any]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    blobs = [item for item in items if item.type == byte_io]
    tensors = sorted((item for item in items if item.type != byte_io), key=_item_nbytes, reverse=True)
    for n, item in enumerate(blobs):
        buckets[n % bins].append(item)
    for item in tensors:
        target = sizes.index(min(sizes))
        buckets[target].append(item)
        sizes[target] += _item_nbytes(item)
    return buckets


class _CheckpointPrefix:
    """What `S3StorageWriter` and `S3StorageReader` share: one checkpoint's ``s3://`` prefix as DCP's id for it."""

    path: str
    memory_tier: Any = None  # an `s3_memory_tier.MemoryTier`: files go through the node's memory (s3_dcp_tier)

    def _tier(self) -> Any:
        return _dcp_tier().tier_of(self.memory_tier, self.s3, getattr(self, "checksum_algorithm", "auto"))

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint's ``s3://`` URL (DCP logs it and stores it in ``StorageMeta``)."""
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True for ``s3://bucket/prefix`` URLs (str or path-like)."""
        try:
            _checkpoint_url(checkpoint_id)
        except (ValueError, TypeError):
            return False
        return True


class S3StorageWriter(_CheckpointPrefix, StorageWriter, BlockingAsyncStager):
    """A ``torch.distributed.checkpoint`` StorageWriter for ``s3://`` checkpoints (see the module docstring).

    Args:
        path: ``s3://bucket/prefix`` of the checkpoint; ``dcp.save(checkpoint_id=...)`` replaces it.
        chunk_size_MB: multipart part size, in MiB.
        max_write_concurrency: parallel part uploads per file (`DEFAULT_DCP_MAX_WRITE_CONCURRENCY`).
        thread_count: files per rank, written concurrently (``__{rank}_0.distcp`` ...), as in torch's writer.
        checksum_algorithm: ``"auto"`` (CRC32C with awscrt, else CRC32), ``"CRC32C"``, ``"CRC64NVME"`` or ``"CRC32"``.
        endpoint_url, region_name, client_settings, retry_policy, s3_utils: how to reach S3 (as `S3CheckpointIO`).
        overwrite: with False, a save to a prefix that holds a checkpoint fails before anything is written.
        cache_staged_state_dict: ``async_save`` only: keep the staged host copy for the next save (torch's option).
        request_options: encryption, storage class, tags, bucket owner, requester pays (`s3_utils.S3RequestOptions`
            or a mapping); max_requests_per_second: the job's S3 request budget. Neither with `s3_utils`.
        filesystem_writer_options: torch's other ``FileSystemWriter`` arguments, accepted where S3 gives them their
            meaning, else refused by name with the reason (`_FILESYSTEM_WRITER_OPTIONS`).
        prefix_spreading: shards over this many key prefixes beside the checkpoint, ``"auto"`` (once the run was
            throttled) or an `s3_prefix_spreading.PrefixSpreading`; None: one prefix (docs/scale.md).
        memory_tier: save into the node's memory, S3 behind (`s3_memory_tier.MemoryTier`, a mapping of its fields, a
            path or True); every rank calls `finish_drains` at the end (docs/tiers.md). With `prefix_spreading` the
            files land in memory under their spread URLs, and the layout record reaches S3 before any of them.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        chunk_size_MB: float = _s3.DEFAULT_CHUNK_SIZE_MB,
        max_write_concurrency: int = DEFAULT_DCP_MAX_WRITE_CONCURRENCY,
        thread_count: int = 1,
        checksum_algorithm: str = "auto",
        endpoint_url: str | None = None,
        region_name: str | None = None,
        client_settings: _s3.S3ClientSettings | None = None,
        retry_policy: _s3.RetryPolicy | None = None,
        s3_utils: _s3.S3Utils | None = None,
        overwrite: bool = True,
        cache_staged_state_dict: bool = False,
        request_options: _s3.S3RequestOptions | dict[str, Any] | None = None,
        fencing: bool = True,
        max_requests_per_second: float | dict[str, float] | _s3.RequestRates | None = None,
        prefix_spreading: int | str | _spread.PrefixSpreading | None = None,
        memory_tier: Any = None,
        **filesystem_writer_options: Any,
    ) -> None:
        _check_filesystem_writer_options(filesystem_writer_options)
        self.prefix_spreading = _spread.PrefixSpreading.from_value(prefix_spreading)
        _s3.check_transfer_sizes(chunk_size_MB, max_write_concurrency=max_write_concurrency)
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"thread_count must be an int >= 1, got {thread_count!r}")
        _s3.validate_checksum_algorithm(checksum_algorithm)
        self.s3 = _s3.S3Utils.from_arguments(
            s3_utils=s3_utils,
            client_settings=client_settings,
            endpoint_url=endpoint_url,
            region_name=region_name,
            retry_policy=retry_policy,
            request_options=request_options,
            max_requests_per_second=max_requests_per_second,
            max_pool_connections=thread_count * max_write_concurrency,
            caller="S3StorageWriter",
        )
        super().__init__()
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self.path = _checkpoint_url(path)
        self.chunk_size_MB = chunk_size_MB
        self.max_write_concurrency = max_write_concurrency
        self.thread_count = thread_count
        self.checksum_algorithm = checksum_algorithm
        self.overwrite = overwrite
        self.save_id = str(uuid.uuid4())
        self.rank: int | None = None
        self.is_coordinator = False
        self.use_collectives = True
        self.fencing = bool(fencing)
        self._run = _fencing.current_run()  # pickled along: DCP's process executor saves as this run
        self._replacing = False
        self._layout = _spread.SaveLayout()
        self.memory_tier, self._tier_plan = _tier_config(memory_tier), None

    def __getstate__(self) -> dict[str, Any]:
        """Settings travel (``async_save`` with the process executor pickles the writer; `S3Utils` pickles as its
        settings and retry policy); the staged state dict does not."""
        return {**self.__dict__, "state_dict_cache": None}

    # ---- StorageWriter --------------------------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = _checkpoint_url(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_FilePrefix(f"__{self.rank}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Once before any rank writes (coordinator; every rank without collectives): take the directory over for
        this run, refuse an existing checkpoint with ``overwrite=False`` or retire its ``.metadata`` (incomplete until
        the new one lands), and give every rank its file prefix and the hold to check."""
        with self._coordinator_alone():
            return self._prepare_global_plan(plans)

    def _prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        tiered = self.memory_tier is not None  # S3 comes behind: nothing read or written there now
        fence = self._fence() if not tiered else None
        token = fence.token(self.path) if fence is not None else None
        if not tiered or not self.overwrite:
            self._retire_existing_checkpoint(fence)
        own = self._metadata_rank()  # saving without collectives, this rank plans for itself alone
        layout = self._layout = _spread.SaveLayout.plan(
            self.s3, self.path, self.prefix_spreading, self._replacing, look=not tiered
        )
        tier = self._tier_plan = self._tier().plan(layout.directories) if tiered else None
        if not tiered and (record := layout.record()) is not None:  # before any shard: gc and rm find every object
            self._put(_spread.LAYOUT_NAME, record, fence)  # (the tier's drains write it before their first file)
        prefixes = [plan.storage_data or _FilePrefix(f"__{i}_") for i, plan in enumerate(plans)]
        return [
            dataclasses.replace(plan, storage_data=dataclasses.replace(
                prefix,
                prefix=layout.file_prefix(self.path, prefix.prefix, i if own is None else own),
                fence=token,
                tier=tier,
            ))
            if isinstance(prefix, _FilePrefix)
            else plan
            for i, (plan, prefix) in enumerate(zip(plans, prefixes, strict=True))
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        """Stream this rank's items into ``thread_count`` files, concurrently; every file is complete and durable when
        the returned future is set. On failure no file of this rank appears and the error is raised."""
        prefix: _FilePrefix = plan.storage_data
        self._tier_plan = prefix.tier if self.memory_tier is not None else None  # every rank: the save's directories
        buckets = _split_items(self.thread_count, plan.items, WriteItemType.BYTE_IO)
        files = [(f"{prefix.prefix}{n}{DCP_SHARD_SUFFIX}", bucket) for n, bucket in enumerate(buckets)]
        if self.prefix_spreading is not None:  # a budget's share of a spread prefix: over the ranks that send there
            _spread.pace_spread_prefixes(self.s3, [_join(self.path, prefix.prefix)], self.prefix_spreading.prefixes)
        # checked right before each file's commit (not once per save: a rank stopped after one check must not commit
        # its other files on it), each commit carrying the coordinator's ETag conditions
        fence = _fencing.DirectoryFence.following(self.s3, prefix.fence) if prefix.fence is not None else None
        cancelled = threading.Event()
        results: list[Any] = []
        if len(files) == 1:
            results = self._write_file(files[0][0], files[0][1], planner, cancelled, fence)
        else:
            with ThreadPoolExecutor(len(files), thread_name_prefix="s3ckpt-dcp-file") as pool:
                futures = [
                    pool.submit(self._write_file, name, items, planner, cancelled, fence) for name, items in files
                ]
                errors = []
                for future in futures:
                    try:
                        results += future.result()
                    except BaseException as exc:
                        cancelled.set()
                        errors.append(exc)
            if errors:
                raise next((e for e in errors if not isinstance(e, _SaveCancelledError)), errors[0])
        if self.memory_tier is not None:  # committed in memory; drained behind if this save drains
            self._tier().files_written(self.path, prefix.tier, self)
        done = torch.futures.Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit: record the item checksums, then write ``.metadata`` with one PUT. DCP calls this on the
        coordinator only after every rank's `write_data` succeeded, i.e. once all files are durable."""
        storage_data: dict[Any, Any] = {}
        files: dict[str, dict[str, Any]] = {}
        for result in (r for rank_results in results for r in rank_results):
            record = result.storage_data
            if not isinstance(record, _ItemRecord):  # a planner that writes storage data of its own
                storage_data[result.index] = record
                continue
            storage_data[result.index] = record.info
            entry = files.setdefault(
                record.info.relative_path,
                {**dataclasses.asdict(record.obj), "algorithm": record.algorithm, "items": {}},
            )
            entry["items"][str(record.info.offset)] = [record.info.length, record.checksum]
            if record.tensor is not None:
                entry["byteorder"] = sys.byteorder  # of the tensor bytes: torch.save writes them as they are in memory
                entry.setdefault("tensors", {})[str(record.info.offset)] = record.tensor
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = storage_data
        metadata.storage_meta = self.storage_meta()
        rank = self._metadata_rank()
        record = {"version": _ITEM_RECORD_VERSION, "save_id": self.save_id, "files": files}
        fence = self._fence()  # checked before the record, before .metadata and before each removal
        with self._coordinator_alone():  # every rank's files are written
            self._put(item_checksums_name(rank), json.dumps(record, sort_keys=True).encode(), fence)
            self._put(metadata_name(rank), pickle.dumps(metadata), fence)
            if self.memory_tier is not None:
                self._tier().committed(self.path, metadata_name(rank), files, self._tier_plan, self)
            if self._replacing and rank is None:  # only the coordinator of a collective save knows every file
                self._remove_stale_shards(set(files), fence)
            if fence is not None:
                fence.remove_stale_objects()  # what a stale run committed here since it took over (docs/fencing.md)
        self._replacing = False
        _s3.invalidate_fsspec_cache(self.path)  # Lightning's ModelCheckpoint asks s3fs what exists
        logger.info("Committed DCP checkpoint %s (%d files)", _join(self.path, metadata_name(rank)), len(files))

    def finish_drains(self, drain_last: bool = True) -> None:
        """Memory tier, every rank at the end of a run: drain the last save if it did not (a run that ends normally
        leaves its last checkpoint on S3), wait for this process's drains, raise the first failure."""
        if self.memory_tier is not None:
            self._tier().finish_drains(self, drain_last)

    # ---- internals ------------------------------------------------------------------------------------------------

    def _open(self, url: str, chunk_size_MB: float, concurrency: int, fence: Any) -> Any:
        if self.memory_tier is not None:  # the node's memory tier, else an S3 multipart upload
            return self._tier().open_file(url, self.path, metadata_name(self._metadata_rank()), self.checksum_algorithm,
                                          self._tier_plan)  # fmt: skip
        return self.s3.open_writer(url, chunk_size_MB, concurrency, self.checksum_algorithm, fence=fence)

    def _metadata_rank(self) -> int | None:
        return self.rank if not self.use_collectives and self.rank is not None else None

    def _coordinator_alone(self) -> contextlib.AbstractContextManager[None]:
        """With collectives the coordinator plans and commits while every other rank waits for it: what it sends then
        keeps no share of a budget (`s3_pacing.sending_alone`). Without, every rank plans and commits for itself."""
        return _pacing.sending_alone() if self._metadata_rank() is None else contextlib.nullcontext()

    def _fence(self) -> _fencing.DirectoryFence | None:
        """This run's fence on the checkpoint directory, on the coordinator (the others follow the token in their
        plan); None with fencing off or on any other rank."""
        if not (self.fencing and self.is_coordinator):
            return None
        return _fencing.DirectoryFence(self.s3, _urls.s3_url_parent(self.path), self._run)

    def _retire_existing_checkpoint(self, fence: _fencing.DirectoryFence | None = None) -> None:
        rank = self._metadata_rank()
        # Without collectives a global .metadata of an earlier save would still be what dcp.load reads first.
        names = [metadata_name(rank)] + ([METADATA_NAME] if rank is not None else [])
        existing = [name for name in names if self.s3.s3_path_exists(_join(self.path, name))]
        if not existing:
            return
        if not self.overwrite:
            raise FileExistsError(  # torch's writers' words first (its tests match on them), then ours
                f"Checkpoint already exists at {self.path} ({_join(self.path, existing[0])}) and overwrite=False: "
                "nothing was written. Save to another path, remove that checkpoint first, or pass overwrite=True."
            )
        logger.warning("Overwriting the DCP checkpoint at %s: its %s is removed first", self.path, ", ".join(existing))
        checked = fence.once() if fence is not None else None
        for name in existing:
            self.s3.remove_object(_join(self.path, name), fence=checked)
            record = item_checksums_name(None if name == METADATA_NAME else rank)
            self.s3.remove_object(_join(self.path, record), fence=checked)
        self._replacing = True
        _s3.invalidate_fsspec_cache(self.path)

    def _remove_stale_shards(self, kept: set[str], fence: Any = None) -> None:
        """After replacing a checkpoint saved by more ranks or threads: delete its shards the new one does not use."""
        directories = self._layout.stale_shard_directories()
        stale = _spread.unused_shards(self.s3, self.path, kept, DCP_SHARD_SUFFIX, directories)
        for url in stale:
            self.s3.remove_object(url, fence=fence)  # and the checksum record this package may keep beside it
        if self._layout.previous and not self._layout.directories:  # a spread checkpoint replaced by an unspread one
            self.s3.remove_object(_join(self.path, _spread.LAYOUT_NAME), fence=fence)
        if stale:
            logger.info(
                "Removed %d shard(s) of the replaced checkpoint at %s that the new one does not use",
                len(stale),
                self.path,
            )

    def _put(self, name: str, body: bytes, fence: Any = None) -> None:
        with self._open(_join(self.path, name), max(self.chunk_size_MB, len(body) / _s3.MB + 1), 1, fence) as writer:
            writer.write(body)

    def _upload_error(self, url: str, cause: BaseException) -> CheckpointWriteError:
        """An error that names the shard in its message: DCP sends failures to the coordinator pickled, and botocore's
        errors lose the notes that name the URL on the way."""
        detail = "".join(traceback.format_exception_only(cause)).strip().replace("\n", "; ")
        return CheckpointWriteError(
            f"Could not upload {url} ({detail}). Its upload was aborted and no .metadata was written: the checkpoint "
            f"at {self.path} is incomplete and will not be loaded. Check the store and save again."
        )

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner, cancelled: threading.Event, fence: Any = None
    ) -> list[Any]:
        url = _join(self.path, name)
        algorithm = _s3.ChecksumAlgorithm.named(self.checksum_algorithm)
        raw = self._open(url, self.chunk_size_MB, self.max_write_concurrency, fence)
        stream = _ItemStream(raw, cancelled)
        ordered = [i for i in items if i.type == WriteItemType.BYTE_IO]  # then small tensors: `_SMALL_ITEM_BYTES`
        ordered += sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=_is_large)
        written: list[tuple[Any, int, int, _TensorSpan | None]] = []
        framings: dict[tuple[Any, ...], _Framing] = {}
        try:
            for item in ordered:
                with torch.no_grad():  # a DTensor's to_local() is then its local tensor, without autograd's apply
                    data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    stream.begin_item()
                    stream.write(data.getbuffer())
                else:
                    tensor = data.detach().cpu()
                    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                        tensor = tensor.clone()  # a view: save its elements only, not the storage behind it
                    nbytes = tensor.numel() * tensor.element_size()
                    own = tensor.data_ptr() == data.data_ptr() and _in_state_dict(planner, item, data)
                    stream.begin_item(tensor if tensor.is_contiguous() and nbytes else None, borrow=own)
                    _save_tensor(tensor, stream, framings)
                written.append((item, *stream.end_item(), stream.tensor_span))
            stream.begin_item()
            stream.write(_file_trailer())
            trailer_at, trailer_length = stream.end_item()
        except BaseException as exc:
            raw.abort()
            cancelled.set()
            if stream.error is None or isinstance(stream.error, _SaveCancelledError):
                raise  # the planner or the caller failed, not the upload
            raise self._upload_error(url, stream.error) from exc
        try:
            raw.close()  # completes the upload (once the fence allows it): the file is durable from here on
        except BaseException as exc:
            cancelled.set()
            if isinstance(exc, _fencing.CheckpointDirectoryTakenError):
                raise  # its message says what happened and what to do; the upload was aborted
            raise self._upload_error(url, exc) from exc
        info = raw.info
        assert info is not None
        trailer = (trailer_at, trailer_length, raw.checksum_of(trailer_at, trailer_at + trailer_length))
        obj = _ObjectRecord(info.size, info.etag, next(iter(info.checksums.values()), ""), trailer)
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=length,
                storage_data=_ItemRecord(
                    _StorageInfo(name, offset, length),
                    raw.checksum_of(offset, offset + length),  # from the upload's own pass: none of our own
                    algorithm.name,
                    obj,
                    None
                    if span is None
                    else span.record(raw.checksum_of(offset + span.start, offset + span.start + span.nbytes)),
                ),
            )
            for item, offset, length, span in written
        ]


# --------------------------------------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------------------------------------


_SAFE_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    # megatron-core's own writer keeps every rank's save plan in .metadata (``Metadata.all_local_plans``): plain data
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "bytearray", "complex", "object"},
    "copyreg": {"_reconstructor"},
}
"""What DCP's ``.metadata`` (torch's writers', `S3StorageWriter`'s) references besides torch's dtypes, layouts and
memory formats; never tensors, whose storages would need an unrestricted ``torch.load``."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, stream: Any, url: str) -> None:
        super().__init__(stream)
        self._url = url

    def find_class(self, module: str, name: str) -> Any:
        if name in _SAFE_METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and "." not in name:
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise UnsafeCheckpointMetadataError(
            f"Refusing to load {self._url}: its pickle references {module}.{name}, which is not one of DCP's metadata "
            "types (torch's writers and S3StorageWriter never put it there). Nothing in it was run. Do not load this "
            "checkpoint unless you know who wrote it and why."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointMetadataError(f"Refusing to load {self._url}: its pickle uses persistent ids")


def load_metadata_bytes(data: bytes, url: str) -> Metadata:
    """Unpickle DCP ``.metadata`` bytes with the allow-list; anything else raises `UnsafeCheckpointMetadataError`.
    Package-internal (docs/api.md)."""
    _require_dcp()
    metadata = _MetadataUnpickler(io.BytesIO(data), url).load()
    if type(metadata) is not Metadata:
        raise UnsafeCheckpointMetadataError(
            f"{url} is not DCP metadata: it holds a {type(metadata).__name__}, not a Metadata object"
        )
    return metadata


class _ViewReader(_s3.SeekableReader):
    """A seekable read-only stream over one item's bytes in memory (``zipfile`` and ``torch.load`` read it in place);
    ``read`` returns bytes, as both readers need."""

    def __init__(self, view: memoryview, length: int | None = None) -> None:
        super().__init__(len(view) if length is None else length)
        self._view = view

    def fill_at(self, out: memoryview, start: int) -> None:
        out[:] = self._view[start : start + len(out)]


@dataclass(frozen=True)
class _TensorLayout:
    """Where a ``torch.save``'d tensor's bytes lie in its item, and what they are (a tensor on the meta device)."""

    start: int
    nbytes: int
    meta: Any


def zip_record_data_start(stream: io.RawIOBase, record: zipfile.ZipInfo) -> int | None:
    """Where a stored (uncompressed) zip record's bytes start in `stream`, after its local header; None if no local
    header is there. ``torch.save`` writes each storage as such a record (convert and the reader locate tensors so).
    Package-internal (docs/api.md)."""
    stream.seek(record.header_offset)
    header = stream.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        return None
    name_length, extra_length = struct.unpack_from("<HH", header, 26)
    return record.header_offset + 30 + name_length + extra_length


def _tensor_layout(stream: io.RawIOBase) -> _TensorLayout | None:
    """The layout of one ``torch.save``'d tensor from its archive's framing alone, or None when the item is not one
    uncompressed storage in this machine's byte order (``torch.load`` then reads it). Records are read by offset:
    ``zipfile`` would fail archives written without zip CRCs (the item checksum covers their bytes)."""
    try:
        with zipfile.ZipFile(stream) as archive:
            records = archive.infolist()
        storages = [r for r in records if r.filename.count("/") == 2 and r.filename.split("/")[1] == "data"]
        order = [r for r in records if r.filename.endswith("/byteorder")]
        if len(storages) != 1 or storages[0].compress_type != zipfile.ZIP_STORED:
            return None
        if order:
            order_start = zip_record_data_start(stream, order[0])
            if order_start is None or order[0].compress_type != zipfile.ZIP_STORED:
                return None
            stream.seek(order_start)
            if stream.read(order[0].file_size) != sys.byteorder.encode():
                return None
        record = storages[0]
        start = zip_record_data_start(stream, record)
        if start is None:
            return None
        stream.seek(0)
        meta = torch.load(stream, map_location="meta", weights_only=True)
    except Exception:  # whatever this is, torch.load on the whole item reports it properly
        return None
    if type(meta) is not torch.Tensor or meta.untyped_storage().nbytes() != record.file_size:
        return None
    return _TensorLayout(start, record.file_size, meta)


def _decode_tensor(data: memoryview) -> torch.Tensor:
    """The tensor stored in one item, as a view of `data` where its layout allows (no copy), else ``torch.load``."""
    layout = _tensor_layout(_ViewReader(data))
    if layout is not None and layout.nbytes and layout.start + layout.nbytes <= len(data):
        meta = layout.meta
        raw = torch.frombuffer(data, dtype=torch.uint8, count=layout.nbytes, offset=layout.start)
        if raw.data_ptr() % meta.element_size() == 0:
            return raw.view(meta.dtype).as_strided(meta.size(), meta.stride(), meta.storage_offset())
    return torch.load(_ViewReader(data), map_location="cpu", weights_only=True)


@dataclass(frozen=True)
class _RecordedSpan:
    """A well-formed tensor span record (`_TensorSpan.record()`) that describes the chunk ``.metadata`` says its item
    stores: where the tensor's bytes lie in the item, their checksum, dtype and shape."""

    start: int
    nbytes: int
    checksum: int
    dtype: Any
    shape: tuple[int, ...]

    @classmethod
    def parsed(cls, record: Any, item_length: int) -> _RecordedSpan | None:
        """The span `record` describes, or None when it is malformed (a dtype by another name than torch's own
        included), lies outside its item of `item_length` bytes, or its byte count is not its shape's."""
        try:
            start, nbytes, checksum, dtype_name, shape = record
            dtype = getattr(torch, dtype_name)
            valid = (
                isinstance(dtype, torch.dtype)
                and str(dtype) == f"torch.{dtype_name}"
                and isinstance(start, int)
                and isinstance(checksum, int)
                and 0 < nbytes <= item_length - start
                and start >= 0
                and nbytes == math.prod(shape) * dtype.itemsize
            )
        except (TypeError, ValueError, AttributeError):
            return None
        return cls(start, nbytes, checksum, dtype, tuple(shape)) if valid else None

    @classmethod
    def checked(cls, record: Any, item_length: int, stored: tuple[Any, Any] | None) -> _RecordedSpan | None:
        """`parsed`, when it also agrees with the sizes and dtype ``.metadata`` records for the chunk stored there
        (`stored`; None when unknown, and then so is the span)."""
        span = cls.parsed(record, item_length) if stored is not None else None
        return span if span is not None and (span.shape, span.dtype) == (tuple(stored[0]), stored[1]) else None

    def fills(self, target: torch.Tensor, request: ReadItem) -> bool:
        """Whether `request` reads the whole stored tensor into the whole of `target`, a contiguous CPU tensor of the
        same dtype and shape: then its bytes can be copied (or read) as they are."""
        return (
            not any(request.storage_offsets)
            and tuple(request.lengths) == self.shape
            and tuple(target.shape) == self.shape
            and target.dtype == self.dtype
            and target.device.type == "cpu"
            and target.is_contiguous()
        )


@dataclass(frozen=True)
class _SpanBytes:
    """A stored tensor's bytes inside a verified item buffer, with the dtype and shape its record gives."""

    data: memoryview
    span: _RecordedSpan

    def fills(self, target: torch.Tensor, request: ReadItem) -> bool:
        return self.span.fills(target, request)

    def tensor(self) -> torch.Tensor:
        """The bytes as a tensor (a view of the buffer where its elements are aligned, else a copy)."""
        raw = torch.frombuffer(self.data, dtype=torch.uint8)
        if raw.data_ptr() % self.span.dtype.itemsize:
            raw = raw.clone()  # torch views need aligned elements; items are packed without padding
        return raw.view(self.span.dtype).reshape(self.span.shape)


@dataclass
class OneLoad:
    """What one load has read and asked already (`one_load`): a record's verified bytes by URL, and whether a prefix
    (ending in ``/``) holds objects (s3_mcore's directory checks). Package-internal (docs/api.md)."""

    records: dict[str, bytes] = dataclasses.field(default_factory=dict)
    directories: dict[str, bool] = dataclasses.field(default_factory=dict)


_ONE_LOAD: contextvars.ContextVar[OneLoad | None] = contextvars.ContextVar("s3ckpt_one_load", default=None)


@contextlib.contextmanager
def one_load() -> Iterator[OneLoad]:
    """Within it (in this thread), `read_record` reads each URL once: megatron-core's load opens the checkpoint's
    ``metadata.json``, ``.metadata`` and item record twice each, on every rank at once. A load reads a committed
    checkpoint, which does not change under it. Nested: the outermost load's. Package-internal (docs/api.md)."""
    outer = _ONE_LOAD.get()
    if outer is not None:
        yield outer
        return
    token = _ONE_LOAD.set(OneLoad())
    try:
        yield _ONE_LOAD.get()  # type: ignore[misc]
    finally:
        _ONE_LOAD.reset(token)


def current_load() -> OneLoad | None:
    """The `one_load` this thread is in, or None. Package-internal (docs/api.md)."""
    return _ONE_LOAD.get()


def read_record(s3: Any, url: str, chunk_size_MB: float = _s3.DEFAULT_CHUNK_SIZE_MB,
                concurrency: int = _s3.DEFAULT_MAX_READ_CONCURRENCY) -> bytes:  # fmt: skip
    """A small object every rank reads (``.metadata``, the item record, megatron-core's ``metadata.json``), verified;
    once per `one_load`. Fast path (``one_get_records``): one GET, no HEAD first, half a download's requests (at
    thousands of ranks, all in one second under one prefix); else (over a chunk, no recorded checksum, a mismatch)
    `S3Utils.download_to_memory`, the reference path, which says what is wrong. Package-internal (docs/api.md)."""
    load = _ONE_LOAD.get()
    if load is not None and url in load.records:
        return load.records[url]
    if not _s3.fast_path("one_get_records") or (data := _read_in_one_get(s3, url, chunk_size_MB)) is None:
        with s3.download_to_memory(url, chunk_size_MB, concurrency) as downloaded:
            data = downloaded.read_all()
    if load is not None:
        load.records[url] = data
    return data


def _read_in_one_get(s3: Any, url: str, chunk_size_MB: float) -> bytes | None:
    """`url`'s bytes from one whole-object GET if they match the checksum recorded with it; None: take the reference
    path (FileNotFoundError for a missing object, as there)."""
    bucket, key = _urls.parse_s3_url(url)
    checksum_error = _process.import_optional_dependency("botocore.exceptions", "S3 access").FlexibleChecksumError

    def attempt() -> tuple[dict[str, Any], bytes | None]:
        response = s3.client.get_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        with contextlib.closing(response["Body"]) as body:
            if response["ContentLength"] > chunk_size_MB * _s3.MB:
                return response, None  # parallel ranged GETs serve it faster
            try:
                data = body.read()
            except checksum_error:  # botocore checked the store's checksum: the reference path says more
                return response, None
        if len(data) != response["ContentLength"]:
            raise _pacing.TransientTransferError(f"got {len(data)} of {response['ContentLength']} bytes of {url}")
        return response, data

    response, data = s3.with_retries(attempt, "get_object", url, bucket=bucket)
    info = _s3.S3ObjectInfo.of_response(bucket, key, response)
    if data is None or (recorded := s3.recorded_checksum(info)) is None:
        return None
    algorithm = _s3.ChecksumAlgorithm.named(recorded.algorithm)
    return data if algorithm.encode(_s3.checksum_of(algorithm, data)) == recorded.value else None


def _unzeroed_buffer(nbytes: int) -> Any:
    """A writable byte buffer of `nbytes` whose memory is not zeroed first (a ``bytearray`` would be: one more pass
    over every buffered byte, on the consuming thread, before the GETs overwrite them all)."""
    return torch.empty(nbytes, dtype=torch.uint8).numpy()


_SCATTER_SKIP_BUFFER = 256 * 1024
"""Bytes between a scattered group's items (no request needs them) are read through one buffer of at most this
size, reused."""


def _scatter(group: _Group, chunk: int) -> bool:
    """Lay out where one GET of `group` puts each byte (`group.views`, from `_segments`). False (one buffer instead)
    when it needs more than one GET or its items overlap."""
    segments = _segments(group) if group.end - group.start <= chunk else None
    if segments is None:
        return False
    group.views = [view for view, _ in segments]
    return True


def _segments(group: _Group) -> list[tuple[memoryview, Any]] | None:
    """Where `group`'s bytes go, in order: a filled item's framing into small buffers and its tensor bytes into its
    target, other items into their own buffers (`_lay_out`), gaps into a reused skip buffer; with whose bytes each
    view holds ((item index, part index); None: a gap). None where items overlap."""
    segments: list[tuple[memoryview, Any]] = []
    skip = None
    position = group.start
    for index, item in enumerate(group.items):
        if item.offset < position:
            return None
        while position < item.offset:
            wanted = min(_SCATTER_SKIP_BUFFER, item.offset - position)
            if skip is None or len(skip) < wanted:  # grown for a wider gap: never many small reads through it
                skip = memoryview(bytearray(wanted))
            segments.append((skip[:wanted], None))
            position += wanted
        segments += [(part, (index, n)) for n, part in enumerate(_lay_out(item))]
        position = item.offset + item.length
    return segments


def _lay_out(item: _Item) -> list[memoryview]:
    """Where a scattered GET puts `item`'s bytes (`_Item.parts`): a filled item's framing into two small buffers and
    its tensor bytes into its target; any other item into a buffer of its own."""
    if item.fill is not None:
        head, tail = item.fill.start, item.length - item.fill.start - item.fill.nbytes
        item.parts = [memoryview(bytearray(head)), tensor_bytes_view(item.target), memoryview(bytearray(tail))]
    else:
        item.parts = [memoryview(_unzeroed_buffer(item.length))]
    return item.parts


def _windows(group: _Group, chunk: int) -> list[tuple[int, list[memoryview], list[Any]]]:
    """Cut `group`'s bytes, laid out by `_segments`, at every `chunk` bytes from its start: per GET its start, the
    views it fills in order, and whose bytes each view holds ((item index, part index); None: a gap). An item may
    span several GETs."""
    segments = _segments(group)
    assert segments is not None, "a window group's items never overlap (`WindowReads.plan_file`)"
    windows: list[tuple[int, list[memoryview], list[Any]]] = []
    start, views, owners = group.start, [], []
    filled = 0
    for view, owner in segments:
        while len(view):
            piece = view[: chunk - filled]
            views.append(piece)
            owners.append(owner)
            filled += len(piece)
            view = view[len(piece) :]
            if filled == chunk:
                windows.append((start, views, owners))
                start, views, owners, filled = start + chunk, [], [], 0
    if views:
        windows.append((start, views, owners))
    return windows


def tensor_bytes_view(tensor: Any) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview of its own memory (no copy): socket reads land
    in the tensor itself, and uploads read from it. The caller keeps the tensor alive while the view is used.
    Package-internal (docs/api.md)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


@dataclass
class _Item:
    """One stored item a rank needs, with the read requests it serves."""

    offset: int
    length: int
    requests: list[Any]
    checksum: int | None = None  # recorded at save time, None when the file is verified as a whole
    pieces: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (piece index, checksum) in order
    target: Any = None  # the planner's tensor, resolved once when the item may be read straight into it
    span: Any = None  # where the writer saw its tensor's bytes (`_TensorSpan.record()`), if it recorded that
    fill: _RecordedSpan | None = None  # set when its group's GET puts the span's bytes straight into `target`
    parts: list[memoryview] = dataclasses.field(default_factory=list)  # where a scattered GET puts its bytes


@dataclass
class _DirectRead:
    """One item whose tensor bytes are read straight into its target, where its recorded span says they lie."""

    relative_path: str
    url: str
    item: _Item
    etag: str | None
    span: _RecordedSpan
    futures: list[Future[int]] = dataclasses.field(default_factory=list)


@dataclass
class _Group:
    """Bytes [start, end) of one file, fetched by one or more ranged GETs into one buffer."""

    relative_path: str
    url: str
    start: int
    end: int
    items: list[_Item]
    etag: str | None
    whole_object: _s3.S3ObjectInfo | None = None  # set when the file is read whole and checked against this record
    expected: tuple[Any, str] | None = None
    file_record: dict[str, Any] | None = None  # the writer's record of the whole file (ours only)
    buffer: Any = None  # `_unzeroed_buffer` while its bytes are fetched and loaded
    views: list[memoryview] | None = None  # instead of `buffer`: where its one GET puts each byte (`_scatter`)
    windows: list[Any] | None = None  # instead: its GETs, cut at every chunk (`WindowReads`; laid out when submitted)
    buffered: int | None = None  # the bytes it holds in buffers while in flight, where not all (`WindowReads`)
    futures: list[Future[list[int]]] = dataclasses.field(default_factory=list)


class S3StorageReader(_CheckpointPrefix, StorageReader):
    """A ``torch.distributed.checkpoint`` StorageReader for ``s3://`` checkpoints (see the module docstring), written
    by `S3StorageWriter` or by torch's own writers (uploaded as files).

    Args:
        path: ``s3://bucket/prefix`` of the checkpoint; ``dcp.load(checkpoint_id=...)`` replaces it.
        chunk_size_MB: the largest ranged GET, in MiB; bigger items are fetched as several ranges in parallel.
        max_read_concurrency: parallel ranged GETs per rank.
        coalesce_gap_MB: items of one file closer than this are fetched by one GET.
        direct_read_min_MB: tensor items at least this large are read straight into a whole, contiguous CPU target
            of the stored dtype and shape with ranged GETs of their own; default: none (`WindowReads`: each file in
            GETs of one chunk, each scattered into the items it covers, a tensor with a recorded span straight into
            its target; one chunk where ``window_reads`` is switched off). At 4 MiB a GPT-style state's 2-9 MiB
            tensors each took GETs of their own: 2-3x the requests of reading the same bytes in chunks, and 1.3-1.5x
            the load's client CPU (benchmarks/realistic.md).
        read_path: how items reach their targets (`ReadPath` and its subclasses); default: `default_read_path()`.
        memory_tier: read each file from the node's verified memory copy or a replica it holds, else S3 (as the writer).
        endpoint_url, region_name, client_settings, retry_policy, s3_utils: how to reach S3 (as `S3CheckpointIO`).
        request_options: bucket owner, requester pays; max_requests_per_second: the job's budget. Not with `s3_utils`.
    """

    def __getstate__(self) -> dict[str, Any]:
        """Settings travel (`S3Utils` pickles as its settings and retry policy); what a load read does not."""
        return {**self.__dict__, "storage_data": None, "_records": None, "_file_progress": None, "tier_sources": {}}

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        chunk_size_MB: float = _s3.DEFAULT_CHUNK_SIZE_MB,
        max_read_concurrency: int = _s3.DEFAULT_MAX_READ_CONCURRENCY,
        coalesce_gap_MB: float = DEFAULT_COALESCE_GAP_MB,
        direct_read_min_MB: float | None = None,
        read_path: ReadPath | None = None,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        client_settings: _s3.S3ClientSettings | None = None,
        retry_policy: _s3.RetryPolicy | None = None,
        s3_utils: _s3.S3Utils | None = None,
        request_options: _s3.S3RequestOptions | dict[str, Any] | None = None,
        max_requests_per_second: float | dict[str, float] | _s3.RequestRates | None = None,
        memory_tier: Any = None,
    ) -> None:
        _s3.check_transfer_sizes(chunk_size_MB, max_read_concurrency=max_read_concurrency)
        if read_path is not None and not isinstance(read_path, ReadPath):
            raise TypeError(f"read_path must be a ReadPath (s3_dcp.ReadPath or a subclass), got {read_path!r}")
        if not coalesce_gap_MB >= 0:
            raise ValueError(f"coalesce_gap_MB must be >= 0, got {coalesce_gap_MB!r}")
        if direct_read_min_MB is not None and not direct_read_min_MB >= 0:
            raise ValueError(f"direct_read_min_MB must be >= 0, got {direct_read_min_MB!r}")
        self.s3 = _s3.S3Utils.from_arguments(
            s3_utils=s3_utils,
            client_settings=client_settings,
            endpoint_url=endpoint_url,
            region_name=region_name,
            retry_policy=retry_policy,
            request_options=request_options,
            max_requests_per_second=max_requests_per_second,
            max_pool_connections=max_read_concurrency,
            caller="S3StorageReader",
        )
        super().__init__()
        self.path = _checkpoint_url(path)
        self.chunk_size_MB = chunk_size_MB
        self.max_read_concurrency = max_read_concurrency
        self.coalesce_gap_MB = coalesce_gap_MB
        self.direct_read_min_MB = direct_read_min_MB
        self.read_path = read_path if read_path is not None else default_read_path()
        self.load_id = str(uuid.uuid4())
        self.rank: int | None = None
        self.use_collectives = True
        self.storage_data: dict[Any, Any] | None = None
        self._records: dict[str, Any] | None = None
        self._metadata_rank: int | None = None
        self._save_id: str | None = None
        self.memory_tier, self.tier_sources = _tier_config(memory_tier), {}  # url: (path, tier) or None (S3)

    # ---- StorageReader --------------------------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data, self._records, self.tier_sources = None, None, {}
        if checkpoint_id:
            self.path = _checkpoint_url(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Download and verify ``.metadata`` (``__{rank}.metadata`` when DCP passes a rank) and unpickle it with the
        allow-list."""
        rank = kwargs.get("rank")
        url = _join(self.path, metadata_name(rank))
        try:
            data = self._read_whole(url)
        except FileNotFoundError as exc:
            raise self._incomplete(url) from exc
        metadata = load_metadata_bytes(data, url)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        self._save_id = metadata.storage_meta.save_id
        metadata.storage_meta.load_id = self.load_id
        self._metadata_rank = rank
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        if self.storage_data is None:
            raise ValueError(f"{_join(self.path, METADATA_NAME)} has no storage data: not a DCP checkpoint")
        files = {getattr(info, "relative_path", "") for info in self.storage_data.values()}
        _spread.pace_spread_prefixes(self.s3, [_join(self.path, name) for name in files if name])

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        """Fetch the items of `plan` with parallel ranged GETs, verify them, and hand them to the planner: large
        tensors straight into their targets, the rest through buffers of coalesced ranges."""
        with torch.no_grad():  # targets are written in place; a DTensor's to_local() then skips autograd's apply
            self._read_plan(plan, planner)
        done_future = torch.futures.Future()
        done_future.set_result(None)
        return done_future

    def _read_plan(self, plan: Any, planner: LoadPlanner) -> None:
        self._file_progress: dict[str, list[Any]] = {}  # file: [reads not yet verified, (offset, length, crc)...]
        groups, direct = self._plan_groups(plan.items, planner)
        chunk = int(self.chunk_size_MB * _s3.MB)
        budget = (self.max_read_concurrency + 1) * chunk
        pending: deque[_Group] = deque()
        in_flight = 0
        with ThreadPoolExecutor(self.max_read_concurrency, thread_name_prefix="s3ckpt-dcp-get") as pool:
            try:
                for read in direct:  # planned by DirectReads
                    self.read_path.submit_direct(self, pool, read, chunk)  # type: ignore[attr-defined]
                for group in groups:
                    while pending and in_flight + _buffered(group) > budget:
                        done = pending.popleft()
                        in_flight -= _buffered(done)
                        self._consume(done, planner)
                    self._submit(pool, group, chunk)
                    pending.append(group)
                    in_flight += _buffered(group)
                while pending:
                    self._consume(pending.popleft(), planner)
                for read in direct:
                    self.read_path.consume_direct(self, read, planner, chunk)  # type: ignore[attr-defined]
            except BaseException:
                for unit in [*pending, *direct]:
                    for future in unit.futures:
                        future.cancel()
                raise

    # ---- planning -------------------------------------------------------------------------------------------------

    def _item_records(self) -> dict[str, Any] | None:
        """The item checksums `S3StorageWriter` recorded for this checkpoint (None for checkpoints from other
        writers); refused if they belong to another save than ``.metadata``."""
        if self._records is not None:
            return self._records or None
        url = _join(self.path, item_checksums_name(self._metadata_rank))
        try:
            record = json.loads(self._read_whole(url))
        except FileNotFoundError:
            self._records = {}
            return None
        except ValueError as exc:
            raise _s3.ChecksumMismatchError(f"{url} is malformed ({exc}): cannot verify the checkpoint") from exc
        if not isinstance(record, dict) or record.get("save_id") != self._save_id:
            raise _s3.ChecksumMismatchError(
                f"{url} belongs to another save than {_join(self.path, metadata_name(self._metadata_rank))} "
                f"(save id {record.get('save_id') if isinstance(record, dict) else None!r}, expected "
                f"{self._save_id!r}): the checkpoint was modified after it was written; do not use it"
            )
        self._records = record.get("files", {})
        return self._records

    def use_item_records(self, records: dict[str, Any]) -> None:
        """Check the items read against `records` instead of the checkpoint's own item record: per file name, what
        ``.s3ckpt-items.json`` holds under ``files`` (``algorithm``, ``checksum``, ``etag``, ``size``, ``items``:
        offset -> [length, checksum]). For a checkpoint of another writer whose files the caller checked whole and
        checksummed item by item (`s3_checkpoint_convert` does); a file missing here is read unverified, with a
        warning. Holds until `reset`."""
        self._records = dict(records)

    def _plan_groups(self, requests: Iterable[Any], planner: LoadPlanner) -> tuple[list[_Group], list[_DirectRead]]:
        """Group the requests by item and file: coalesced buffered groups, and the items to read into targets."""
        assert self.storage_data is not None
        per_file: dict[str, dict[tuple[int, int], _Item]] = {}
        for request in requests:
            info = self.storage_data[request.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise NotImplementedError(
                    f"{_join(self.path, info.relative_path)} was written with stream transforms "
                    f"{list(info.transform_descriptors)}; S3StorageReader reads untransformed checkpoints only"
                )
            items = per_file.setdefault(info.relative_path, {})
            key = (info.offset, info.length)
            items.setdefault(key, _Item(info.offset, info.length, [])).requests.append(request)
        records = self._item_records() if per_file else None
        gap = int(self.coalesce_gap_MB * _s3.MB)
        limit = max(int(self.chunk_size_MB * _s3.MB), 1)
        groups: list[_Group] = []
        direct: list[_DirectRead] = []
        for relative_path, by_range in per_file.items():
            url = _join(self.path, relative_path)
            items = sorted(by_range.values(), key=lambda item: item.offset)
            record = records.get(relative_path) if records else None
            if record is None:
                groups += self._foreign_file_groups(url, relative_path, items, gap, limit)
                continue
            for item in items:
                recorded = record["items"].get(str(item.offset))
                if recorded is None or recorded[0] != item.length:
                    raise _s3.ChecksumMismatchError(
                        f"{url}: no checksum was recorded for bytes {item.offset}-{item.offset + item.length} "
                        "that .metadata points to: the checkpoint is inconsistent; do not use it"
                    )
                item.checksum = int(recorded[1])
                item.span = self.read_path.item_span(record, item)
            etag = record["etag"] or None
            file_groups, file_direct = self.read_path.plan_file(self, relative_path, items, etag, planner)
            for group in file_groups:
                group.file_record = record
            self._file_progress[relative_path] = [len(file_groups) + len(file_direct), []]
            groups += file_groups
            direct += file_direct
        return groups, direct

    def _coalesce(
        self, url: str, relative_path: str, items: list[_Item], gap: int, limit: int, etag: str | None
    ) -> list[_Group]:
        groups: list[_Group] = []
        for item in items:
            last = groups[-1] if groups else None
            end = item.offset + item.length
            if last is not None and item.offset - last.end <= gap and max(end, last.end) - last.start <= limit:
                last.items.append(item)
                last.end = max(last.end, end)
            else:
                groups.append(_Group(relative_path, url, item.offset, end, [item], etag))
        return groups

    def _foreign_file_groups(
        self, url: str, relative_path: str, items: list[_Item], gap: int, limit: int
    ) -> list[_Group]:
        """A file without item checksums (written by another writer): read it whole and check its full-object
        checksum when one is recorded; otherwise read what is needed, unverified, with a warning."""
        info = self.s3.head_object(url)
        recorded = self.s3.recorded_checksum(info)
        expected = None if recorded is None else (_s3.ChecksumAlgorithm.named(recorded.algorithm), recorded.value)
        if expected is None:
            logger.warning("%s has no recorded checksum (written by another tool?): loading it unverified", url)
            return self._coalesce(url, relative_path, items, gap, limit, info.etag or None)
        return [_Group(relative_path, url, 0, info.size, items, info.etag or None, info, expected)]

    # ---- fetching -------------------------------------------------------------------------------------------------

    def _local(self, url: str) -> Any:  # memory tier: (path, tier) of the node's verified copy or replica; None: S3
        return None if self.memory_tier is None else _dcp_tier().cached_source(self._tier(), self.tier_sources, url)

    def _read_whole(self, url: str) -> bytes:
        """A record every rank reads (``.metadata``, the item record), verified: from this node's memory tier, else
        `read_record`."""
        if (local := self._local(url)) is not None:
            return local[0].read_bytes()
        return read_record(self.s3, url, self.chunk_size_MB, self.max_read_concurrency)

    def _accept_item(self, url: str, relative_path: str, item: _Item, algorithm: Any, actual: int) -> None:
        """Check an item's bytes against its recorded checksum and count them toward its file's whole-file check
        (files without a record, another writer's, load unverified with a warning)."""
        if algorithm is None or item.checksum is None:
            return
        if actual != item.checksum:
            raise _s3.ChecksumMismatchError(
                f"{url} is corrupt: bytes {item.offset}-{item.offset + item.length} (item "
                f"{item.requests[0].storage_index.fqn}) have {algorithm.name} {actual:#x}, but {item.checksum:#x} was "
                "recorded when the checkpoint was written. Do not use it; use an older checkpoint."
            )
        self._file_progress[relative_path][1].append((item.offset, item.length, actual))

    def _fetch_into(self, url: str, start: int, view: memoryview, etag: str | None, algorithm: Any) -> int:
        """Read bytes [start, start + len(view)) of `url` into `view`; their checksum (0 without `algorithm`)."""
        self._get_range(url, start, [view], etag)
        return _s3.checksum_of(algorithm, view)

    def _get_range(self, url: str, start: int, views: list[memoryview], etag: str | None) -> None:
        """Fill `views` in order with the bytes of `url` from `start` on, in one ranged GET."""
        length, local = sum(len(view) for view in views), self._local(url)
        read = self.s3.read_range_into if local is None else functools.partial(_dcp_tier().read_into, local[0])
        try:
            filled = read(url, start, views, etag=etag) if length else 0
        except Exception as exc:
            if _pacing.error_code(exc) in {"PreconditionFailed", "412"}:
                raise _s3.ChecksumMismatchError(
                    f"{url} was replaced after the checkpoint was written (its ETag is no longer {etag}): do not use "
                    "this checkpoint"
                ) from exc
            raise
        if filled != length:
            raise _s3.ChecksumMismatchError(
                f"{url} ends at byte {start + filled}, but the checkpoint's metadata needs bytes up to "
                f"{start + length}: the shard was truncated or replaced; do not use this checkpoint"
            )

    def _submit(self, pool: ThreadPoolExecutor, group: _Group, chunk: int) -> None:
        if group.whole_object is None and self.read_path.submit_scattered(self, pool, group, chunk):
            return
        group.buffer = _unzeroed_buffer(group.end - group.start)
        pieces = [(s, min(s + chunk, group.end)) for s in range(group.start, group.end, chunk)] or [(group.start,) * 2]
        if group.whole_object is not None:
            segments = [[(s - group.start, e - group.start)] for s, e in pieces]
        else:  # the parts of each item inside each piece, so that item checksums come from the fetching threads
            segments = []
            for index, (s, e) in enumerate(pieces):
                inside = []
                for item in group.items:
                    lo, hi = max(s, item.offset), min(e, item.offset + item.length)
                    if lo < hi or (item.length == 0 and s <= item.offset <= e and not item.pieces):
                        inside.append((lo - group.start, hi - group.start))
                        item.pieces.append((index, len(inside) - 1))
                segments.append(inside)
        algorithm = group.expected[0] if group.expected else _algorithm_of(self._records, group.relative_path)
        for (start, end), wanted in zip(pieces, segments, strict=True):
            group.futures.append(pool.submit(self._fetch, group, start, end, wanted, algorithm))

    def _fetch(self, group: _Group, start: int, end: int, segments: list[tuple[int, int]], algorithm: Any) -> list[int]:
        assert group.buffer is not None
        self._fetch_into(
            group.url, start, memoryview(group.buffer)[start - group.start : end - group.start], group.etag, None
        )
        whole = memoryview(group.buffer)
        return [_s3.checksum_of(algorithm, whole[lo:hi]) for lo, hi in segments]

    def _consume(self, group: _Group, planner: LoadPlanner) -> None:
        """Wait for a group's bytes, verify them, and load its items into the planner's tensors."""
        if group.views is not None or group.windows is not None:  # laid out by ScatterReads or WindowReads
            self.read_path.consume_scattered(self, group, planner)  # type: ignore[attr-defined]
            return
        piece_checksums = [future.result() for future in group.futures]
        assert group.buffer is not None
        chunk = int(self.chunk_size_MB * _s3.MB)
        if group.whole_object is not None:
            algorithm, expected = group.expected  # type: ignore[misc]
            total = 0
            for index, (checksums, start) in enumerate(
                zip(piece_checksums, range(group.start, group.end, chunk), strict=False)
            ):
                length = min(chunk, group.end - start)
                total = checksums[0] if index == 0 else algorithm.combine(total, checksums[0], length)
            if algorithm.encode(total) != expected:
                raise _s3.ChecksumMismatchError(
                    f"{group.url} is corrupt: its {algorithm.name} is {algorithm.encode(total)}, but {expected} was "
                    "recorded when it was written. Do not use it; restore it from another copy or use an older one."
                )
        elif (algorithm := _algorithm_of(self._records, group.relative_path)) is not None:
            for item in group.items:
                actual = 0
                for n, (piece, segment) in enumerate(item.pieces):
                    value = piece_checksums[piece][segment]
                    if n == 0:
                        actual = value
                    else:
                        start = max(group.start + piece * chunk, item.offset)
                        length = min(group.start + (piece + 1) * chunk, item.offset + item.length) - start
                        actual = algorithm.combine(actual, value, length)
                self._accept_item(group.url, group.relative_path, item, algorithm, actual)
            self._check_whole_file(group, algorithm)
        view = memoryview(group.buffer)
        for item in group.items:
            data = view[item.offset - group.start : item.offset - group.start + item.length]
            self._load_item(data, item, planner, group)
        group.buffer = None

    def _check_whole_file(self, group: _Group, algorithm: Any) -> None:
        """Once every group of a file is verified item by item: if together they covered the whole file, its bytes
        must also match the full-object checksum recorded at save time (S3 verified that one on upload)."""
        progress = self._file_progress[group.relative_path]
        progress[0] -= 1
        record = group.file_record
        if progress[0] or record is None or not record.get("checksum"):
            return
        pieces = sorted(progress[1])
        position, total = 0, 0
        for offset, length, checksum in pieces:
            if offset != position:
                return  # only part of the file was read: the item checksums cover it
            total = algorithm.combine(total, checksum, length)
            position += length
        trailer = record.get("trailer")  # the nonce after the last item: recorded, never read
        if isinstance(trailer, list) and [type(v) for v in trailer] == [int] * 3 and trailer[0] == position:
            total = algorithm.combine(total, trailer[2], max(trailer[1], 0))
            position += max(trailer[1], 0)
        if position != record["size"]:
            return
        if algorithm.encode(total) != record["checksum"]:
            raise _s3.ChecksumMismatchError(
                f"{group.url} is corrupt or was replaced: its {algorithm.name} is {algorithm.encode(total)}, but "
                f"{record['checksum']} was recorded when the checkpoint was written. Do not use it."
            )

    def _load_item(self, data: memoryview, item: _Item, planner: LoadPlanner, group: _Group) -> None:
        tensor = span = None
        for request in item.requests:
            if request.type == LoadItemType.BYTE_IO:
                planner.load_bytes(request, io.BytesIO(data))
                continue
            if span is None and tensor is None and item.span is not None:
                span = self.read_path.span_bytes(self, data, item, group, _stored_chunk(planner, request))
            target = item.target if item.target is not None else planner.resolve_tensor(request).detach()
            if span is not None and span.fills(target, request):
                tensor_bytes_view(target)[:] = span.data  # the whole stored tensor into the whole target: one copy
                planner.commit_tensor(request, target)
                continue
            if tensor is None:
                tensor = span.tensor() if span is not None else _decode_tensor(data)
            piece = narrow_tensor_by_index(tensor, request.storage_offsets, request.lengths)
            if target.size() != piece.size():
                raise ValueError(
                    f"{_join(self.path, self.storage_data[request.storage_index].relative_path)}: item "  # type: ignore[index]
                    f"{request.storage_index.fqn} has shape {tuple(piece.size())}, the target {tuple(target.size())}"
                )
            target.copy_(piece)
            planner.commit_tensor(request, target)

    def _incomplete(self, url: str) -> CheckpointIncompleteError:
        try:
            present = self.s3.s3_path_exists(self.path, match_directory=True)
        except Exception:  # the error about .metadata is the one to report
            present = True
        if present:
            return CheckpointIncompleteError(
                f"The DCP checkpoint at {self.path} is incomplete: it has no {url.rsplit('/', 1)[-1]} (the commit "
                "marker written last), so its save never finished. Load an older checkpoint or save it again."
            )
        return CheckpointIncompleteError(
            f"No DCP checkpoint at {self.path}: {url} does not exist and nothing is stored under the prefix"
        )


# --------------------------------------------------------------------------------------------------------------------
# Read paths: how `S3StorageReader` gets an item's bytes into its target (chosen by its ``read_path`` argument)
# --------------------------------------------------------------------------------------------------------------------
# `ReadPath` is the reference path and the interface: each file's items are fetched by coalesced ranged GETs into one
# buffer, verified against their recorded checksums, and decoded from it. Each fast path is a subclass that overrides
# its own hooks; `FastReads` combines those kept (benchmarks/README.md gives each one's measured gain), and
# tests/test_fast_paths.py checks each against the reference, tensor for tensor.


class ReadPath:
    """The reference read path (buffered: coalesced GETs into one buffer per group, each item decoded from it), and
    the hooks a faster path overrides. Stateless: one instance may serve many readers."""

    def item_span(self, record: dict[str, Any], item: _Item) -> Any:
        """The tensor span the writer recorded for `item` (`_TensorSpan.record()`), if this path uses spans."""
        return None

    def direct_read(
        self, reader: S3StorageReader, relative_path: str, url: str, item: _Item, etag: str | None, planner: LoadPlanner
    ) -> _DirectRead | None:
        """A plan to read `item` with GETs of its own straight into its target, or None (it is buffered)."""
        return None

    def plan_fill(self, item: _Item, planner: LoadPlanner) -> None:
        """Mark a buffered item whose GET may put its tensor's bytes straight into its target (`_Item.fill`)."""

    def submit_scattered(self, reader: S3StorageReader, pool: ThreadPoolExecutor, group: _Group, chunk: int) -> bool:
        """Start one GET that scatters `group`'s bytes into its items' own buffers and targets; False: not done."""
        return False

    def plan_file(
        self, reader: S3StorageReader, relative_path: str, items: list[_Item], etag: str | None, planner: LoadPlanner
    ) -> tuple[list[_Group], list[_DirectRead]]:
        """How one recorded file's needed `items` (sorted, their checksums and spans set) are read: the items read
        straight into their targets, and groups of coalesced items (a chunk at most, closer than the reader's gap)."""
        url, gap, limit = _join(reader.path, relative_path), int(reader.coalesce_gap_MB * _s3.MB), _chunk(reader)
        into_target = [self.direct_read(reader, relative_path, url, item, etag, planner) for item in items]
        buffered = [item for item, read in zip(items, into_target, strict=True) if read is None]
        for item in buffered:
            self.plan_fill(item, planner)
        return reader._coalesce(url, relative_path, buffered, gap, limit, etag), [r for r in into_target if r]

    def span_bytes(
        self, reader: S3StorageReader, data: memoryview, item: _Item, group: _Group, stored: tuple[Any, Any] | None
    ) -> _SpanBytes | None:
        """A buffered tensor item's bytes located through its recorded span, or None (decoded from its archive)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class SpanReads(ReadPath):
    """Tensors located through the spans `S3StorageWriter` recorded (on this machine's byte order) instead of decoding
    their archives; the checksums before, inside and after a span must combine to the item's."""

    def item_span(self, record: dict[str, Any], item: _Item) -> Any:
        return _tensor_spans(record).get(str(item.offset)) if record.get("byteorder") == sys.byteorder else None

    def span_bytes(
        self, reader: S3StorageReader, data: memoryview, item: _Item, group: _Group, stored: tuple[Any, Any] | None
    ) -> _SpanBytes | None:
        span = _RecordedSpan.checked(item.span, len(data), stored)
        if span is None:  # the record does not describe the chunk .metadata says is stored there
            return None
        algorithm = _algorithm_of(reader._records, group.relative_path)
        require_span_in_item(
            group.url, algorithm, data, item.offset, item.checksum, span.start, span.nbytes, span.checksum
        )
        return _SpanBytes(data[span.start : span.start + span.nbytes], span)


class ScatterReads(SpanReads):
    """`SpanReads`, plus: one GET of a group of small items scatters each recorded tensor's bytes straight into its
    target, the framing and the other items into small buffers (`_scatter`); no group buffer, no copy."""

    def plan_fill(self, item: _Item, planner: LoadPlanner) -> None:
        if item.span is None or len(item.requests) != 1 or item.requests[0].type != LoadItemType.TENSOR:
            return
        request = item.requests[0]
        span = _RecordedSpan.checked(item.span, item.length, _stored_chunk(planner, request))
        if span is None:
            return
        if item.target is None:
            item.target = planner.resolve_tensor(request).detach()
        if span.fills(item.target, request):
            item.fill = span

    def submit_scattered(self, reader: S3StorageReader, pool: ThreadPoolExecutor, group: _Group, chunk: int) -> bool:
        if not _scatter(group, chunk):
            return False
        algorithm = _algorithm_of(reader._records, group.relative_path)
        group.futures.append(pool.submit(self._fetch_scattered, reader, group, algorithm))
        return True

    @staticmethod
    def _fetch_scattered(reader: S3StorageReader, group: _Group, algorithm: Any) -> list[tuple[int, int | None]]:
        """One GET of a scattered group; each item's checksum, and its span's where it was filled."""
        assert group.views is not None
        reader._get_range(group.url, group.start, group.views, group.etag)
        if algorithm is None:  # a file nobody recorded checksums for: nothing to check
            return [(0, None)] * len(group.items)
        checksums: list[tuple[int, int | None]] = []
        for item in group.items:
            if item.fill is None:
                checksums.append((_s3.checksum_of(algorithm, item.parts[0]), None))
                continue
            head, tensor, tail = (_s3.checksum_of(algorithm, part) for part in item.parts)
            whole = algorithm.combine(algorithm.combine(head, tensor, item.fill.nbytes), tail, len(item.parts[2]))
            checksums.append((whole, tensor))
        return checksums

    def consume_scattered(self, reader: S3StorageReader, group: _Group, planner: LoadPlanner) -> None:
        """Verify a scattered group's items (each whole, and each filled tensor against its span's checksum), then
        commit the filled targets and load the other items from their buffers."""
        algorithm = _algorithm_of(reader._records, group.relative_path)
        checksums = self.scattered_checksums(group, algorithm)
        for item, (actual, tensor) in zip(group.items, checksums, strict=True):
            reader._accept_item(group.url, group.relative_path, item, algorithm, actual)
            if item.fill is not None and algorithm is not None and tensor != item.fill.checksum:
                raise _span_record_modified(group.url, item.offset + item.fill.start, item.fill.nbytes)
        if algorithm is not None:  # a file with our record (the others have no item checksums to combine)
            reader._check_whole_file(group, algorithm)
        for item in group.items:
            if item.fill is None:
                reader._load_item(item.parts[0], item, planner, group)
            else:
                planner.commit_tensor(item.requests[0], item.target)
        group.views = group.windows = None

    def scattered_checksums(self, group: _Group, algorithm: Any) -> list[tuple[int, int | None]]:
        """Per item of a fetched scattered group: its checksum, and its tensor's where it was filled."""
        (checksums,) = [future.result() for future in group.futures]
        return checksums


class WindowReads(ScatterReads):
    """`ScatterReads` over whole files: the needed items of a file, in runs closer than ``coalesce_gap_MB``, are read
    by GETs of one chunk each from the run's start (the last one shorter), each scattered into every item it covers,
    tensors straight into their targets (`_windows`). A load sends about as many GETs as its bytes need, where groups
    of whole items and tensors read on their own end short of a chunk. An item split across GETs is checked by
    combining the checksums of its pieces. Items of at least ``direct_read_min_MB``, if given, are read on their own
    where the path has `DirectReads` (`FastReads`)."""

    def direct_read_default_MB(self, reader: S3StorageReader) -> float:
        return math.inf

    def plan_file(
        self, reader: S3StorageReader, relative_path: str, items: list[_Item], etag: str | None, planner: LoadPlanner
    ) -> tuple[list[_Group], list[_DirectRead]]:
        url, gap, chunk = _join(reader.path, relative_path), int(reader.coalesce_gap_MB * _s3.MB), _chunk(reader)
        into_target = [self.direct_read(reader, relative_path, url, item, etag, planner) for item in items]
        groups: list[_Group] = []
        for item, read in zip(items, into_target, strict=True):
            if read is not None:
                continue
            self.plan_fill(item, planner)
            last = groups[-1] if groups else None
            held = item.length - (item.fill.nbytes if item.fill is not None else 0)  # buffered, not in a target
            if last is not None and last.end <= item.offset <= last.end + gap and last.buffered + held <= chunk:  # type: ignore[operator]
                last.items.append(item)
                last.end, last.buffered = item.offset + item.length, last.buffered + held  # type: ignore[operator]
            else:
                groups.append(_Group(relative_path, url, item.offset, item.offset + item.length, [item], etag))
                groups[-1].windows, groups[-1].buffered = [], held
        return groups, [read for read in into_target if read is not None]

    def submit_scattered(self, reader: S3StorageReader, pool: ThreadPoolExecutor, group: _Group, chunk: int) -> bool:
        if group.windows is None:
            return super().submit_scattered(reader, pool, group, chunk)
        group.windows = _windows(group, chunk)
        algorithm = _algorithm_of(reader._records, group.relative_path)
        for window in group.windows:
            group.futures.append(pool.submit(self._fetch_window, reader, group, window, algorithm))
        return True

    @staticmethod
    def _fetch_window(reader: S3StorageReader, group: _Group, window: Any, algorithm: Any) -> list[int]:
        """One GET of a window; the checksum of each view it filled that holds an item's bytes."""
        start, views, owners = window
        reader._get_range(group.url, start, views, group.etag)
        return [_s3.checksum_of(algorithm, v) for v, owner in zip(views, owners, strict=True) if owner is not None]

    def scattered_checksums(self, group: _Group, algorithm: Any) -> list[tuple[int, int | None]]:
        if group.windows is None:
            return super().scattered_checksums(group, algorithm)
        pieces: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        for (_, views, owners), future in zip(group.windows, group.futures, strict=True):
            owned = [(view, owner) for view, owner in zip(views, owners, strict=True) if owner is not None]
            for (view, owner), checksum in zip(owned, future.result(), strict=True):
                pieces[owner].append((checksum, len(view)))
        if algorithm is None:  # a file nobody recorded checksums for: nothing to check
            return [(0, None)] * len(group.items)
        checksums: list[tuple[int, int | None]] = []
        for index, item in enumerate(group.items):
            parts = [(_s3.combine_checksums(algorithm, pieces[index, n]), len(p)) for n, p in enumerate(item.parts)]
            tensor = parts[1][0] if item.fill is not None else None
            checksums.append((_s3.combine_checksums(algorithm, parts), tensor))
        return checksums


class DirectReads(SpanReads):
    """`SpanReads`, plus: a large tensor item (``direct_read_min_MB``) whose recorded span describes its whole,
    contiguous CPU target is read with parallel ranged GETs of its own straight into the target, checked against the
    span's recorded checksum. Items without a span (older checkpoints, another byte order) are buffered."""

    def direct_read(
        self, reader: S3StorageReader, relative_path: str, url: str, item: _Item, etag: str | None, planner: LoadPlanner
    ) -> _DirectRead | None:
        least = reader.direct_read_min_MB
        least = self.direct_read_default_MB(reader) if least is None else least
        if item.span is None or len(item.requests) != 1 or item.length < max(least * _s3.MB, 1):
            return None
        request = item.requests[0]
        if request.type != LoadItemType.TENSOR or any(request.storage_offsets):
            return None
        target = item.target = planner.resolve_tensor(request).detach()
        if target.device.type != "cpu" or not target.is_contiguous() or not target.numel():
            return None
        span = _span_for_target(item, target)
        return None if span is None else _DirectRead(relative_path, url, item, etag, span)

    def direct_read_default_MB(self, reader: S3StorageReader) -> float:
        """``direct_read_min_MB`` when the reader was given none: one chunk."""
        return reader.chunk_size_MB

    def submit_direct(self, reader: S3StorageReader, pool: ThreadPoolExecutor, read: _DirectRead, chunk: int) -> None:
        view = tensor_bytes_view(read.item.target)
        start = read.item.offset + read.span.start
        algorithm = _algorithm_of(reader._records, read.relative_path)
        for offset in range(0, len(view), chunk):
            piece = view[offset : offset + chunk]
            read.futures.append(pool.submit(reader._fetch_into, read.url, start + offset, piece, read.etag, algorithm))

    def consume_direct(self, reader: S3StorageReader, read: _DirectRead, planner: LoadPlanner, chunk: int) -> None:
        """Wait for an item's tensor bytes, check them against the checksum recorded for its span, and commit the
        target. The item's framing was not read, so its file's whole-file check is skipped (the reads cover it)."""
        algorithm = _algorithm_of(reader._records, read.relative_path)
        nbytes = read.span.nbytes
        pieces = [(future.result(), min(chunk, nbytes - n * chunk)) for n, future in enumerate(read.futures)]
        actual = _s3.combine_checksums(algorithm, pieces)
        if actual != read.span.checksum:
            start = read.item.offset + read.span.start
            raise _s3.ChecksumMismatchError(
                f"{read.url} is corrupt: bytes {start}-{start + nbytes} (the tensor of item "
                f"{read.item.requests[0].storage_index.fqn}) have {algorithm.name} {actual:#x}, but "
                f"{read.span.checksum:#x} was recorded when the checkpoint was written. Do not use it; use an older "
                "checkpoint."
            )
        reader._file_progress[read.relative_path][0] -= 1
        planner.commit_tensor(read.item.requests[0], read.item.target)


class DirectScatterReads(DirectReads, ScatterReads):
    """`DirectReads` and `ScatterReads` (the default before `WindowReads`)."""


class FastReads(WindowReads, DirectScatterReads):
    """Every kept fast path (the default): `WindowReads`, with `DirectReads` for items of at least
    ``direct_read_min_MB`` where the reader is given one."""


def default_read_path() -> ReadPath:
    """`FastReads`, unless ``S3CKPT_REFERENCE_PATHS`` (`s3_utils.REFERENCE_PATHS_ENV`, a switch for tests and
    benchmarks) names read paths to leave out: then the reference `ReadPath` plus whichever of them remain (without
    ``span_reads``, none: the others need the spans; ``window_reads`` needs ``scatter_reads``)."""
    if not _s3.fast_path("span_reads"):
        return ReadPath()
    direct, scatter, window = (_s3.fast_path(name) for name in ("direct_reads", "scatter_reads", "window_reads"))
    if not scatter:
        return DirectReads() if direct else SpanReads()
    if window:
        return FastReads() if direct else WindowReads()
    return DirectScatterReads() if direct else ScatterReads()


def _chunk(reader: S3StorageReader) -> int:
    return max(int(reader.chunk_size_MB * _s3.MB), 1)


def _buffered(group: _Group) -> int:
    """The bytes `group` holds in buffers while in flight (counted against the reader's read-ahead budget)."""
    return group.end - group.start if group.buffered is None else group.buffered


def _stored_chunk(planner: LoadPlanner, request: Any) -> tuple[tuple[int, ...], Any] | None:
    """The sizes and dtype ``.metadata`` records for the stored chunk a read request reads from (None where the
    planner does not expose the metadata, as DCP's default load planner does)."""
    index = request.storage_index
    tensor_md = getattr(getattr(planner, "metadata", None), "state_dict_metadata", {}).get(index.fqn)
    chunks = getattr(tensor_md, "chunks", None)
    if not chunks:
        return None
    hint = index.index
    if hint is not None and 0 <= hint < len(chunks) and tuple(chunks[hint].offsets) == tuple(index.offset):
        chunk = chunks[hint]
    else:
        chunk = next((c for c in chunks if tuple(c.offsets) == tuple(index.offset)), None)
    return None if chunk is None else (tuple(chunk.sizes), tensor_md.properties.dtype)


def _tensor_spans(record: dict[str, Any]) -> dict[str, Any]:
    """A file record's tensor spans by item offset (none when it has no well-formed ``"tensors"``)."""
    spans = record.get("tensors")
    return spans if isinstance(spans, dict) else {}


def _span_for_target(item: _Item, target: Any) -> _RecordedSpan | None:
    """`item`'s recorded span (`_plan_groups` sets it for this machine's byte order) if it describes exactly `target`
    inside the item; else None, and the item is buffered and decoded."""
    span = _RecordedSpan.parsed(item.span, item.length)  # its byte count is its shape's, or it is None
    return span if span is not None and (span.dtype, span.shape) == (target.dtype, tuple(target.shape)) else None


def _algorithm_of(records: dict[str, Any] | None, relative_path: str) -> _s3.ChecksumAlgorithm | None:
    if records and relative_path in records:
        return _s3.ChecksumAlgorithm.named(records[relative_path]["algorithm"])
    return None


# --------------------------------------------------------------------------------------------------------------------
# Planners: each DTensor's chunk computed arithmetically
# --------------------------------------------------------------------------------------------------------------------
#
# torch 2.13's default planners place each DTensor's local shard with ``compute_local_shape_and_global_offset``,
# which builds an int64 index of its positions (8 bytes per row: 32 MiB for a 1-D shard of 4M elements) at every save
# and load (benchmarks/README.md). `S3SavePlanner` and `S3LoadPlanner` compute the same sizes and offsets with integer
# arithmetic for ``Shard(d)`` and ``Replicate()`` over any mesh and leave the rest (``_StridedShard``, ``Partial``,
# subclasses, ranks outside the mesh) to torch; the plans and ``.metadata`` are identical (tests/test_dcp_planner.py).


def _shard_chunk(
    global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple[Any, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The local shard's sizes and global offsets of a tensor of `global_shape` placed by `placements` on a mesh of
    `mesh_shape`, at mesh `coordinate`, as torch's ``compute_local_shape_and_global_offset`` gives them, or None for
    a placement other than ``Shard``/``Replicate``. Mesh dimensions split left to right as ``torch.chunk`` does
    (chunks of ceil(n / k), the last ones short or empty; an empty shard's offset is the global size there)."""
    if not len(mesh_shape) == len(coordinate) == len(placements) or any(type(n) is not int for n in global_shape):
        return None  # symbolic sizes (tracing) are torch's business
    sizes = list(global_shape)
    offsets = [0] * len(sizes)
    for placement, count, rank in zip(placements, mesh_shape, coordinate, strict=True):
        kind = type(placement)
        if kind is Replicate:
            continue
        if kind is not Shard or type(count) is not int or type(rank) is not int or not 0 <= rank < count:
            return None
        dim = placement.dim
        if type(dim) is not int or not 0 <= dim < len(sizes):
            return None
        full = -(-sizes[dim] // count)
        start = full * rank
        size = max(0, min(sizes[dim], start + full) - start)
        offsets[dim] = offsets[dim] + start if size else global_shape[dim]
        sizes[dim] = size
    return tuple(sizes), tuple(offsets)


class _PlannedDTensor:
    """Stands in for a DTensor while torch's planning code runs: answers ``__create_write_items__``,
    ``__create_chunk_list__`` and ``size()`` with `_shard_chunk`'s chunk, and records that it was asked."""

    __slots__ = ("asked", "dtensor", "local", "offsets", "sizes")

    def __init__(self, dtensor: Any, local: Any, sizes: tuple[int, ...], offsets: tuple[int, ...]) -> None:
        self.dtensor = dtensor
        self.local = local
        self.sizes = torch.Size(sizes)
        self.offsets = torch.Size(offsets)
        self.asked = False

    def size(self, *dim: int) -> Any:
        return self.dtensor.size(*dim)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        """What torch's ``_create_write_items_for_dtensor`` builds, field for field."""
        self.asked = True
        return [
            WriteItem(
                index=MetadataIndex(fqn, self.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=self.offsets, sizes=self.sizes),
                    properties=TensorProperties.create_from_tensor(self.local),
                    size=self.dtensor.size(),
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[Any]:
        """What torch's ``_create_chunk_from_dtensor`` builds."""
        self.asked = True
        return [ChunkStorageMetadata(offsets=self.offsets, sizes=self.sizes)]


def _stand_in(value: Any) -> _PlannedDTensor | None:
    """A `_PlannedDTensor` for `value` if it is a DTensor whose chunk `_shard_chunk` computes, else None."""
    if not isinstance(value, DTensor):
        return None
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # not on this rank's mesh: torch's planners skip it
        return None
    local = value.to_local()
    if type(local) not in (torch.Tensor, torch.nn.Parameter):  # a subclass (fake, simulated ranks, own hooks)
        return None
    chunk = _shard_chunk(tuple(value.shape), tuple(mesh.shape), tuple(coordinate), tuple(value.placements))
    if chunk is None or chunk[0] != tuple(local.shape):  # a local tensor that disagrees: torch records what it says
        return None
    return _PlannedDTensor(value, local, chunk[0], chunk[1])


class _ArithmeticChunksPlanner:
    """What `S3SavePlanner` and `S3LoadPlanner` share: torch's own ``create_local_plan`` runs with each eligible
    DTensor replaced by a `_PlannedDTensor`; everything else stays torch's code. If torch did not ask a stand-in it
    should have (a torch that plans DTensors another way) or failed, it plans again on the real state dict."""

    state_dict: dict[str, Any]

    def _plan_with_stand_ins(self, make_plan: Callable[[], Any], must_ask: Callable[[str], bool]) -> Any:
        original = self.state_dict
        stand_ins = {fqn: s for fqn, value in original.items() if (s := _stand_in(value)) is not None}
        if not stand_ins:
            return make_plan()
        replaced = {**original, **stand_ins}  # same keys, same order
        self.state_dict = replaced
        plan = None
        try:
            plan = make_plan()
        except Exception:  # torch's own run below raises its own error, if any
            logger.debug("planning with computed DTensor chunks failed; planning with torch's code", exc_info=True)
        finally:
            if self.state_dict is replaced:  # torch's code may have swapped in a state dict of its own: keep that
                self.state_dict = original
        unasked = [fqn for fqn, s in stand_ins.items() if not s.asked and must_ask(fqn)]
        if plan is not None and not unasked:
            return plan
        if unasked:
            logger.warning(
                "torch's planner did not ask %d DTensor(s) (%s) for their chunks; planning with torch's own code",
                len(unasked),
                ", ".join(unasked[:3]),
            )
        return make_plan()


class S3SavePlanner(_ArithmeticChunksPlanner, DefaultSavePlanner):
    """torch's ``DefaultSavePlanner`` (same arguments, plans and ``.metadata``) computing each DTensor's chunk with
    integer arithmetic instead of torch's per-row index tensor; `S3ShardedStrategyMixin`'s default, or yours::

        dcp.save(state, storage_writer=S3StorageWriter(url), planner=S3SavePlanner())
    """

    def create_local_plan(self) -> SavePlan:
        return self._plan_with_stand_ins(super().create_local_plan, lambda fqn: True)  # type: ignore[misc]


class S3LoadPlanner(_ArithmeticChunksPlanner, DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner`` (same arguments and plans) computing each DTensor's chunk arithmetically;
    `S3ShardedStrategyMixin`'s default, or yours::

        dcp.load(state, storage_reader=S3StorageReader(url), planner=S3LoadPlanner())
    """

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata if self.metadata is not None else {}

        def must_ask(fqn: str) -> bool:  # torch skips keys the checkpoint lacks, and reads byte items as bytes
            return isinstance(saved.get(fqn), TensorStorageMetadata)

        with torch.no_grad():  # a DTensor's to_local() is then its local tensor, without autograd's apply
            return self._plan_with_stand_ins(super().create_local_plan, must_ask)  # type: ignore[misc]


# --------------------------------------------------------------------------------------------------------------------
# Lightning's sharded strategies
# --------------------------------------------------------------------------------------------------------------------

LIGHTNING_META_NAME = "meta.pt"  # package-internal (docs/api.md)
"""The file Lightning's sharded strategies write beside the DCP files: the checkpoint minus model and optimizer
states (loops, callbacks, hyper-parameters)."""
_FABRIC_OF = {"lightning.pytorch": "lightning.fabric", "pytorch_lightning": "lightning_fabric"}
_STRATEGY_SUFFIX = {"lightning.pytorch": "", "pytorch_lightning": "PL"}
_STRATEGY_BASES = {"model_parallel": "ModelParallelStrategy", "fsdp": "FSDPStrategy"}
_STRATEGY_NAMES = {"model_parallel": "S3ModelParallelStrategy", "fsdp": "S3FSDPStrategy"}


class S3ShardedStrategyMixin:
    """Makes a Lightning sharded strategy (``ModelParallelStrategy``, ``FSDPStrategy``) save, load and remove
    checkpoints at ``s3://`` paths (Lightning 2.4-2.6 would write the local ``s3:/bucket/x``); local paths go to
    Lightning's own code. Sharded checkpoints are DCP checkpoints (`S3StorageWriter`, `S3StorageReader`): a prefix
    ``<path>/`` holding ``__{rank}_{n}.distcp``, ``meta.pt`` (first, by rank 0) and ``.metadata`` (last: complete once
    it exists). Full checkpoints are one object, written by `S3CheckpointIO` on rank 0. Removal deletes the object at
    the path and everything under ``<path>/``. With ``fencing=True`` (the default) saves and removals are refused with
    `s3_fencing.CheckpointDirectoryTakenError`, on every rank, once a newer run took the checkpoint directory over.

    Extra keyword arguments (all optional): chunk_size_MB, max_read_concurrency, max_write_concurrency, thread_count,
    checksum_algorithm, s3_utils or client_settings (how to reach S3: docs/s3.md#one-settings-object-for-every-class),
    endpoint_url, region_name, retry_policy, request_options, fencing, max_requests_per_second (as `S3CheckpointIO`),
    prefix_spreading (as `S3StorageWriter`), s3_planners (default True: DCP saves and loads plan with
    `S3SavePlanner` / `S3LoadPlanner`; False: torch's default planners), and memory_tier (as `S3StorageWriter`:
    sharded saves land in the node's memory and drain to S3 behind, ``.metadata`` last; ``meta.pt`` still goes to S3
    first; in a job of several nodes each save's files also go to the next node (replication, started by the strategy);
    a load first has every rank agree where it reads each file (memory, a replica, S3), or fails on every rank naming
    the URL where some rank cannot load it; teardown finishes the drains on every rank, so a run that ends normally
    leaves its last checkpoint on S3; removal also drops the checkpoint's memory copies on each node. docs/tiers.md).
    """

    lightning_base: type
    _s3_kind: str
    _S3_OPTIONS: ClassVar[dict[str, Any]] = {
        "chunk_size_MB": _s3.DEFAULT_CHUNK_SIZE_MB,
        "max_read_concurrency": _s3.DEFAULT_MAX_READ_CONCURRENCY,
        "max_write_concurrency": DEFAULT_DCP_MAX_WRITE_CONCURRENCY,
        "thread_count": 1,
        "checksum_algorithm": "auto",
        "endpoint_url": None,
        "region_name": None,
        "s3_utils": None,
        "client_settings": None,
        "retry_policy": None,
        "request_options": None,
        "fencing": True,
        "max_requests_per_second": None,
        "prefix_spreading": None,
        "s3_planners": True,
        "memory_tier": None,
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        options = {name: kwargs.pop(name, default) for name, default in self._S3_OPTIONS.items()}
        _s3.check_transfer_sizes(
            options["chunk_size_MB"], max_write_concurrency=options["max_write_concurrency"],
            max_read_concurrency=options["max_read_concurrency"],
        )  # fmt: skip
        _s3.validate_checksum_algorithm(options["checksum_algorithm"])
        _spread.PrefixSpreading.from_value(options["prefix_spreading"])  # refused here, not at the first save
        options["memory_tier"] = _tier_config(options["memory_tier"])  # a MemoryTier or None; refused here too
        self.s3 = _s3.S3Utils.from_arguments(
            s3_utils=options.pop("s3_utils"),
            client_settings=options["client_settings"],
            endpoint_url=options["endpoint_url"],
            region_name=options["region_name"],
            retry_policy=options["retry_policy"],
            request_options=options["request_options"],
            max_requests_per_second=options["max_requests_per_second"],
            max_pool_connections=max(
                options["max_read_concurrency"], options["thread_count"] * options["max_write_concurrency"]
            ),
            user_agent_extra=_ckpt_io.lightning_user_agent(),
            caller=type(self).__name__,
        )
        """How this strategy reaches S3: its `S3CheckpointIO`, `S3StorageWriter` and `S3StorageReader` share it."""
        options["max_requests_per_second"] = self.s3.settings.max_requests_per_second
        super().__init__(*args, **kwargs)
        self.s3_options = options
        self._s3_io: _ckpt_io.S3CheckpointIO | None = None
        self._tier_writer: S3StorageWriter | None = None  # memory tier: the last save's writer (its drains finish)

    # ---- helpers --------------------------------------------------------------------------------------------------

    @property
    def s3_checkpoint_io(self) -> _ckpt_io.S3CheckpointIO:
        """The `S3CheckpointIO` that writes full checkpoints and ``meta.pt`` (built on first use)."""
        if self._s3_io is None:
            o = self.s3_options
            self._s3_io = _ckpt_io.S3CheckpointIO(
                chunk_size_MB=o["chunk_size_MB"],
                max_read_concurrency=o["max_read_concurrency"],
                max_write_concurrency=o["max_write_concurrency"],
                checksum_algorithm=o["checksum_algorithm"],
                s3_utils=self.s3,
                fencing=o["fencing"],
            )
        return self._s3_io

    def s3_storage_writer(self, path: str) -> S3StorageWriter:
        o = self.s3_options
        writer = S3StorageWriter(
            path,
            chunk_size_MB=o["chunk_size_MB"],
            max_write_concurrency=o["max_write_concurrency"],
            thread_count=o["thread_count"],
            checksum_algorithm=o["checksum_algorithm"],
            s3_utils=self.s3,
            fencing=o["fencing"],
            prefix_spreading=o["prefix_spreading"],
            memory_tier=o["memory_tier"],
        )
        if o["memory_tier"] is not None:
            self._tier_writer = writer
        return writer

    def s3_storage_reader(self, path: str) -> S3StorageReader:
        o = self.s3_options
        return S3StorageReader(
            path, chunk_size_MB=o["chunk_size_MB"], max_read_concurrency=o["max_read_concurrency"], s3_utils=self.s3,
            memory_tier=o["memory_tier"],
        )  # fmt: skip

    def _dcp_planner(self, direction: str) -> S3SavePlanner | S3LoadPlanner | None:
        """`S3SavePlanner()` / `S3LoadPlanner()` (``direction`` "save" / "load"), or None (torch's default) with
        ``s3_planners=False``."""
        if not self.s3_options["s3_planners"]:
            return None
        return S3SavePlanner() if direction == "save" else S3LoadPlanner()

    def _saves_sharded(self) -> bool:
        if self._s3_kind == "fsdp":
            return getattr(self, "_state_dict_type", "sharded") == "sharded"
        return bool(getattr(self, "_save_distributed_checkpoint", True))

    @property
    def memory_tier(self) -> Any:
        """The `s3_memory_tier.MemoryTier` of the sharded saves and loads (``memory_tier=``), or None."""
        return self.s3_options["memory_tier"]

    def _is_s3_sharded_checkpoint(self, url: str) -> bool:
        """Whether `url` is a complete DCP checkpoint: its ``.metadata`` in rank 0's memory tier (or where the ranks
        agreed to read it) or on S3 (rank 0 asks, every rank gets the answer)."""
        found = None
        if self.is_global_zero:  # type: ignore[attr-defined]
            tier = self._node_tier()
            metadata = _join(url, METADATA_NAME)
            found = (tier is not None and _dcp_tier().holds(tier, metadata)) or self.s3.s3_path_exists(metadata)
        return bool(self.broadcast(found))  # type: ignore[attr-defined]

    # ---- save / load / remove -------------------------------------------------------------------------------------

    def setup_environment(self) -> None:
        """Memory tier: once the process group is up, every rank adopts rank 0's run (docs/runs.md), so the node's
        tier takes the job's ranks for one launch, not for stragglers of each other; then, in a job of several nodes,
        replication to the next node starts (`s3_dcp_tier.replicate_by_default`)."""
        super().setup_environment()  # type: ignore[misc]
        if self.s3_options["memory_tier"] is not None:
            _fencing.adopt_run(self.broadcast(_fencing.current_run()))  # type: ignore[attr-defined]
            _dcp_tier().replicate_by_default(self, local_rank=self.local_rank)  # type: ignore[attr-defined]

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if not _urls.is_s3_url(filepath):
            return super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported: pass the S3 "
                "options to the strategy's constructor"
            )
        url = _checkpoint_url(self.broadcast(_urls.normalize_s3_url(filepath)))  # type: ignore[attr-defined]
        io = self.s3_checkpoint_io
        if not self._saves_sharded():

            def save_full() -> None:
                sharded = url + "/"  # a sharded checkpoint of the same name
                _spread.remove_checkpoint(self.s3, sharded, fence=io.fence_for(url))
                io.save_checkpoint(checkpoint, url)

            self._on_rank_zero(save_full, f"saving {url}")
            return None
        model_key = "model" if self._s3_kind == "fsdp" else "state_dict"
        converted = {model_key: checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{n}": state for n, state in enumerate(checkpoint.pop("optimizer_states", []))})

        def save_meta() -> None:
            fence = io.fence_for(url)  # the directory holding the checkpoint, checked once for all of this
            checked = fence.once() if fence is not None else None
            with io.using_fence(checked):
                self.s3.remove_object(url, fence=checked)  # a full checkpoint of the same name
                self.s3.remove_object(_join(url, METADATA_NAME), fence=checked)  # an older one is now incomplete
                io.save_checkpoint(checkpoint, _join(url, LIGHTNING_META_NAME))
                io.wait_for_pending_saves()

        self._on_rank_zero(save_meta, f"saving {_join(url, LIGHTNING_META_NAME)}")
        dcp.save(converted, storage_writer=self.s3_storage_writer(url), planner=self._dcp_planner("save"))
        return None

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if not _urls.is_s3_url(checkpoint_path):
            return self._lightning_load_checkpoint(checkpoint_path, weights_only)
        url = _checkpoint_url(self.broadcast(_urls.normalize_s3_url(checkpoint_path)))  # type: ignore[attr-defined]
        tiered = self.s3_options["memory_tier"] is not None
        if not (tiered and _dcp_tier().agree_to_load(self, url)):  # every rank: where it reads each file
            if not self._is_s3_sharded_checkpoint(url):
                return self._load_full_s3_checkpoint(url, weights_only)
            if tiered:  # rank 0's node holds its .metadata, but some rank reaches a file in no tier
                raise FileNotFoundError(
                    f"{url}: not every rank can load this checkpoint from any tier (its node's memory, a replica, "
                    "S3): some of its files are only in another node's memory and their drain to S3 did not finish. "
                    "Resume from one on S3, or keep replication on (a job of several nodes starts it)"
                )
        if self._s3_kind == "fsdp":
            self._load_sharded_fsdp1(url)
        else:
            self._load_sharded_dtensor(url)
        return self.s3_checkpoint_io.load_checkpoint(_join(url, LIGHTNING_META_NAME), weights_only=weights_only)

    def remove_checkpoint(self, filepath: Any) -> None:
        if not _urls.is_s3_url(filepath):
            return super().remove_checkpoint(filepath)  # type: ignore[misc]
        tier = self._node_tier()
        if tier is not None and getattr(self, "local_rank", 0) == 0:  # each node's memory copies; due drains skip them
            _dcp_tier().drop_checkpoint(tier, _checkpoint_url(filepath))
        if self.is_global_zero:  # type: ignore[attr-defined]
            url = _checkpoint_url(filepath)
            self.s3_checkpoint_io.wait_for_pending_saves()
            _spread.remove_checkpoint(self.s3, url, fence=self.s3_checkpoint_io.fence_for(url))  # and spread files
            _s3.invalidate_fsspec_cache(url)
        return None

    def teardown(self) -> None:
        """Memory tier: every rank finishes its drains first (the last save reaches S3; a drain's failure is raised)."""
        writer, self._tier_writer = self._tier_writer, None
        try:
            if writer is not None:
                writer.finish_drains()
        finally:
            try:
                if self._s3_io is not None:
                    self._s3_io.teardown()
            finally:
                super().teardown()  # type: ignore[misc]

    # ---- internals ------------------------------------------------------------------------------------------------

    def _node_tier(self) -> Any:  # memory tier: this process's `s3_dcp_tier.DcpTier`; None: no tier
        memory_tier = self.s3_options["memory_tier"]
        return None if memory_tier is None else _dcp_tier().tier_of(memory_tier, self.s3)

    def _on_rank_zero(self, work: Callable[[], None], what: str) -> None:
        """Run `work` on global rank 0 while the other ranks wait, then raise on every rank if it failed (a refused,
        stale run's `CheckpointDirectoryTakenError` as itself), instead of the others waiting for a rank that left."""
        error: Exception | None = None
        if self.is_global_zero:  # type: ignore[attr-defined]
            try:
                work()
            except Exception as exc:
                error = exc
        shared = error if isinstance(error, _fencing.CheckpointDirectoryTakenError) else repr(error) if error else None
        shared = self.broadcast(shared)  # type: ignore[attr-defined]
        if error is not None:
            raise error
        if isinstance(shared, BaseException):
            raise shared
        if shared is not None:
            raise RuntimeError(f"Global rank 0 failed while {what}: {shared}")

    def _load_sharded_dtensor(self, url: str) -> None:
        """ModelParallelStrategy (FSDP2 / DTensor): what Lightning's ``_load_checkpoint`` does, reading from S3."""
        helpers = _process.import_optional_dependency(
            "torch.distributed.checkpoint.state_dict", "distributed checkpoints"
        )
        module = self.model  # type: ignore[attr-defined]
        strict = self.lightning_module.strict_loading  # type: ignore[attr-defined]
        module_state = {"state_dict": helpers.get_model_state_dict(module)}
        dcp.load(module_state, storage_reader=self.s3_storage_reader(url), planner=self._dcp_planner("load"))
        module.load_state_dict(module_state["state_dict"], strict=strict)
        options = helpers.StateDictOptions(cpu_offload=True)
        for index, optimizer in enumerate(self.optimizers):  # type: ignore[attr-defined]
            key = f"optimizer_{index}"
            optimizer_state = {key: helpers.get_optimizer_state_dict(module, optimizer)}
            dcp.load(optimizer_state, storage_reader=self.s3_storage_reader(url), planner=self._dcp_planner("load"))
            helpers.set_optimizer_state_dict(module, optimizer, optim_state_dict=optimizer_state[key], options=options)

    def _load_sharded_fsdp1(self, url: str) -> None:
        """FSDPStrategy (FSDP1): what Lightning's ``FSDPStrategy.load_checkpoint`` does, reading from S3."""
        optimizer_helpers = _process.import_optional_dependency(
            "torch.distributed.checkpoint.optimizer", "distributed checkpoints"
        )
        fsdp = _process.import_optional_dependency("torch.distributed.fsdp", "FSDP checkpoints")
        fabric_fsdp = _process.import_optional_dependency(f"{_FABRIC_OF[self._s3_family]}.strategies.fsdp", "FSDP")
        module = self.model  # type: ignore[attr-defined]
        with fabric_fsdp._get_sharded_state_dict_context(module):
            module_state = {"model": module.state_dict()}
            reader, planner = self.s3_storage_reader(url), self._dcp_planner("load")
            dcp.load(module_state, storage_reader=reader, planner=planner)
            module.load_state_dict(module_state["model"], strict=self.lightning_module.strict_loading)  # type: ignore[attr-defined]
            for index, optimizer in enumerate(self.optimizers):  # type: ignore[attr-defined]
                key = f"optimizer_{index}"
                state = optimizer_helpers.load_sharded_optimizer_state_dict(
                    model_state_dict=module_state["model"],
                    optimizer_key=key,
                    storage_reader=self.s3_storage_reader(url),
                )
                flattened = fsdp.FullyShardedDataParallel.optim_state_dict_to_load(
                    optim_state_dict=state[key], model=module, optim=optimizer
                )
                optimizer.load_state_dict(flattened)

    def _lightning_load_checkpoint(self, path: Any, weights_only: bool | None) -> dict[str, Any]:
        """Lightning's own ``load_checkpoint`` of the strategy. Lightning 2.4's takes no ``weights_only`` (it loads
        with torch's default), so it is passed only where the signature has it."""
        load = super().load_checkpoint  # type: ignore[misc]
        if "weights_only" in inspect.signature(load).parameters:
            return load(path, weights_only=weights_only)
        return load(path)

    def _load_full_s3_checkpoint(self, url: str, weights_only: bool | None) -> dict[str, Any]:
        """A consolidated checkpoint: every rank downloads the object (verified) and Lightning's full-checkpoint code
        restores it from memory, without broadcasting its path (each rank's in-memory file has its own)."""
        utils = self.s3
        o = self.s3_options
        with utils.download_to_memory(url, o["chunk_size_MB"], o["max_read_concurrency"]) as downloaded:
            self.broadcast = _no_broadcast  # type: ignore[method-assign]
            try:
                return self._lightning_load_checkpoint(downloaded.path, weights_only)
            finally:
                del self.broadcast

    _s3_family: str


def _no_broadcast(obj: Any, src: int = 0) -> Any:
    return obj


def sharded_strategy_class(kind: str = "model_parallel", family: str | None = None) -> type:
    """`S3ModelParallelStrategy` (`kind` ``"model_parallel"``) or `S3FSDPStrategy` (``"fsdp"``) for a Lightning family
    (``"lightning.pytorch"`` or ``"pytorch_lightning"``; default: ``lightning.pytorch`` if installed). Cached."""
    if kind not in _STRATEGY_BASES:
        raise ValueError(f"kind must be one of {sorted(_STRATEGY_BASES)}, got {kind!r}")
    return _build_strategy_class(kind, _ckpt_io.lightning_family(family, "the S3 sharded strategies"))


@functools.cache
def _build_strategy_class(kind: str, family: str) -> type:
    strategies = _process.import_optional_dependency(f"{family}.strategies", f"{family} support")
    base = getattr(strategies, _STRATEGY_BASES[kind])
    name = _STRATEGY_NAMES[kind] + _STRATEGY_SUFFIX[family]
    doc = f"Lightning's ``{base.__name__}`` ({family}) for ``s3://`` checkpoints. {S3ShardedStrategyMixin.__doc__}"
    namespace = {
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": doc,
        "lightning_base": base,
        "_s3_kind": kind,
        "_s3_family": family,
    }
    return type(name, (S3ShardedStrategyMixin, base), namespace)


S3ModelParallelStrategy: type
"""`sharded_strategy_class("model_parallel")`; ``S3ModelParallelStrategyPL`` for ``pytorch_lightning``."""
S3FSDPStrategy: type
"""`sharded_strategy_class("fsdp")`; ``S3FSDPStrategyPL`` for ``pytorch_lightning``."""


def __getattr__(name: str) -> Any:
    """PEP 562, for the Lightning strategies only: each is `S3ShardedStrategyMixin` on the base class of the Lightning
    family that is installed, so it exists once Lightning is imported (importing this module never imports it)."""
    for kind, base_name in _STRATEGY_NAMES.items():
        if name == base_name:
            return sharded_strategy_class(kind)
        if name == base_name + _STRATEGY_SUFFIX["pytorch_lightning"]:
            return sharded_strategy_class(kind, "pytorch_lightning")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------------------------------
# A recorded tensor span checked against its verified item (the reader)
# --------------------------------------------------------------------------------------------------------------------


def require_span_in_item(
    url: str, algorithm: Any, item: memoryview, offset: int, checksum: Any, start: int, nbytes: int, recorded: int
) -> None:
    """Raise unless a recorded tensor span agrees with its verified item (at `offset`): the checksums before and after
    the span, combined with the span's, must give the item's `checksum` (no second pass over the tensor bytes).
    Package-internal (docs/api.md)."""
    combined = algorithm.combine(_s3.checksum_of(algorithm, item[:start]), recorded, nbytes)
    after = item[start + nbytes :]
    combined = algorithm.combine(combined, _s3.checksum_of(algorithm, after), len(after))
    if combined != checksum:
        raise _span_record_modified(url, offset + start, nbytes)


def _span_record_modified(url: str, start: int, nbytes: int) -> _s3.ChecksumMismatchError:
    """The error for a verified item whose recorded tensor span (bytes `start`.. of the file) disagrees with it."""
    return _s3.ChecksumMismatchError(
        f"{url}: the recorded checksum of the tensor bytes {start}-{start + nbytes} does not match their item's: the "
        "checkpoint's item record was modified after it was written. Do not use it."
    )
