"""Convert checkpoints between ``torch.distributed.checkpoint`` (DCP, sharded) and single files, streamed.

::

    convert_checkpoint("s3://bucket/run/step-1000", "s3://bucket/export/model.safetensors", only="model")
    convert_checkpoint("s3://bucket/run/step-1000", "s3://bucket/export/full.pt")   # or .pth / .ckpt
    convert_checkpoint("s3://bucket/run/last.ckpt", "s3://bucket/run/last-dcp")      # one torch file -> DCP

Sources and destinations are ``s3://`` URLs or local paths, in any combination; S3 to S3 touches no local disk.

* **DCP -> one file.** The destination's suffix picks the format: ``.safetensors`` (tensors only, under their DCP
  keys, i.e. the state dict's keys joined with ``.``; dtypes kept, bfloat16 included; non-tensor entries are
  skipped and reported) or ``.pt`` / ``.pth`` / ``.ckpt`` (the nested dict ``torch.save`` writes; after
  ``torch.load`` equal to what torch's ``format_utils.dcp_to_torch_save`` makes of the same checkpoint).
* **One torch file -> DCP** (e.g. a Lightning ``.ckpt``): what torch's ``torch_save_to_dcp`` makes, written by
  `s3_dcp.S3StorageWriter` (or torch's ``FileSystemWriter`` for a local directory), loadable with ``dcp.load``.

Streaming, with bounded memory. Both formats' layouts are known before any tensor is read: a safetensors header
(offsets, dtypes, shapes) and a torch archive's pickle come from DCP's ``.metadata`` alone. Tensors are then
assembled one batch at a time (a batch holds at most the largest tensor, or one chunk of small ones) from their
shards by `s3_dcp.S3StorageReader` (ranged GETs, large shards read straight into the assembled tensor, every item
verified against its recorded checksum), written to the destination (`s3_utils.S3MultipartWriter`, or a local
file) and dropped. Peak memory: the writer's part buffers, the reader's GETs in flight and one batch, whatever
the checkpoint's size (plus, for a tensor split other than by rows, e.g. tensor-parallel column shards, its
largest shard: such shards are decoded from a buffer before being copied into place). The torch format is written
record by record through torch's own zip writer (``torch._C.PyTorchFileWriter``, which only appends), after a
pickle whose storages are referenced before they are read. The reverse reads a torch file lazily: its pickle is
loaded on the meta device (``torch.load(map_location="meta")`` reads no tensor bytes) and each storage is read
when the DCP writer asks for it.

Verification: every byte read is checked. DCP items against the checksums `S3StorageWriter` recorded
(``.s3ckpt-items.json``); a checkpoint without them (torch's own writers) is read whole once, file by file, against
the store's full-object checksum, and its items are then checked against checksums taken in that pass (every GET
pinned to the file's ETag); files with no recorded checksum at all are read unverified and reported. A torch file's
storages against the CRC-32 torch's zip writer recorded for each of them. The result appears only when complete:
an interrupted conversion aborts its multipart upload (or removes its partial file) and leaves the destination as
it was. `ConversionReport.verification` says what was checked.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import functools
import io
import json
import logging
import os
import pickle
import shutil
import struct
import sys
import time
import uuid
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

if __package__:
    from . import s3_dcp as _dcp
    from . import s3_dirpath_utils as _urls
    from . import s3_fencing as _fencing
    from . import s3_process as _process
    from . import s3_utils as _s3
else:  # installed (or copied) as top-level modules
    import s3_dcp as _dcp
    import s3_dirpath_utils as _urls
    import s3_fencing as _fencing
    import s3_process as _process
    import s3_utils as _s3

__all__ = [
    "SAFETENSORS_SUFFIX",
    "TORCH_SUFFIXES",
    "ConversionReport",
    "convert_checkpoint",
]

logger = logging.getLogger(__name__)

SAFETENSORS_SUFFIX = ".safetensors"
TORCH_SUFFIXES = (".pt", ".pth", ".ckpt")
"""Destination suffixes that make a DCP checkpoint into one ``torch.save`` file."""

_SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "complex64": "C64",
}
"""torch dtype name -> safetensors dtype, as the safetensors package spells them."""
_READ_AHEAD = 1 << 20
"""Reads of a torch file's framing (zip directory, pickle) fetch at least this much."""


@dataclass(frozen=True)
class ConversionReport:
    """What `convert_checkpoint` wrote and checked."""

    source: str
    destination: str
    format: str
    """``"safetensors"``, ``"torch"`` or ``"dcp"``."""
    tensors: int
    tensor_bytes: int
    size: int
    """Bytes written at the destination (the file; for ``"dcp"`` every object of the checkpoint)."""
    skipped: tuple[str, ...]
    """Entries of the source not written: non-tensor entries, which safetensors cannot hold."""
    verification: str
    """What every byte read was checked against, in words."""
    seconds: float
    checksum: str | None = None
    """The destination's full-object checksum (``"CRC32C <base64>"``) for a single ``s3://`` object."""


@dataclass(frozen=True)
class _Options:
    chunk: int
    chunk_size_MB: float
    read_concurrency: int
    write_concurrency: int
    checksum_algorithm: str
    weights_only: bool
    progress: Callable[[int], None] | None


def _torch() -> Any:
    return _process.import_optional_dependency("torch", "checkpoint conversion")


def _is_s3(location: str) -> bool:
    return _urls.is_s3_url(location)


def _location(path: str | os.PathLike[str]) -> str:
    if _urls.is_s3_url(path):  # a pathlib.Path holding s3://b/k too
        return _urls.normalize_s3_url(path).rstrip("/")
    return os.path.abspath(os.fspath(path))


def _join(location: str, name: str) -> str:
    return location.rstrip("/") + "/" + name if _is_s3(location) else os.path.join(location, name)


def convert_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    only: str | None = None,
    overwrite: bool = False,
    weights_only: bool = True,
    s3_utils: _s3.S3Utils | None = None,
    chunk_size_MB: float = _s3.DEFAULT_CHUNK_SIZE_MB,
    max_read_concurrency: int = _s3.DEFAULT_MAX_READ_CONCURRENCY,
    max_write_concurrency: int = _s3.DEFAULT_MAX_WRITE_CONCURRENCY,
    checksum_algorithm: str = "auto",
    progress: Callable[[int], None] | None = None,
) -> ConversionReport:
    """Convert the checkpoint at `src` into `dst` (see the module docstring for formats and guarantees).

    Args:
        src: a DCP checkpoint (``s3://`` prefix or local directory holding ``.metadata``), or one ``torch.save`` file
            (an ``s3://`` object or a local file).
        dst: for a DCP source, a file whose suffix is ``.safetensors``, ``.pt``, ``.pth`` or ``.ckpt``; for a torch
            file, the prefix (or directory) of the DCP checkpoint to write.
        only: keep only the entries under this key prefix (``"model"`` keeps ``model.*``); DCP sources only.
        overwrite: replace an existing `dst`; without it an existing one fails before anything is read.
        weights_only: unpickle the source's non-tensor entries (DCP bytes items, a torch file's pickle) with torch's
            safe ``weights_only`` loader; False runs arbitrary pickled code: only for sources you trust.
            safetensors output never unpickles anything.
        s3_utils: how to reach S3 (default: an `S3Utils` built from the environment).
        chunk_size_MB, max_read_concurrency, max_write_concurrency: ranged GET / multipart part size, GETs in
            flight, parts in flight (memory: about ``(max_write_concurrency + 1) x chunk`` for the writer,
            ``(max_read_concurrency + 1) x chunk`` for the reader, plus one batch of tensors).
        checksum_algorithm: the destination's checksum (``"auto"``, ``"CRC32C"``, ``"CRC64NVME"``, ``"CRC32"``).
        progress: called with the byte count of each tensor once it is written.

    Raises:
        FileNotFoundError: no checkpoint at `src` (`s3_dcp.CheckpointIncompleteError` for a DCP prefix without
            ``.metadata``).
        FileExistsError: `dst` exists and `overwrite` is False.
        ValueError: an unsupported destination suffix, `only` matching nothing, a dtype safetensors cannot hold,
            or a pickle ``weights_only`` refuses.
        s3_utils.ChecksumMismatchError: bytes that do not match what was recorded; nothing is written.
    """
    _s3.check_transfer_sizes(
        chunk_size_MB, max_read_concurrency=max_read_concurrency, max_write_concurrency=max_write_concurrency
    )
    _s3.validate_checksum_algorithm(checksum_algorithm)
    source, destination = _location(src), _location(dst)
    if source == destination:
        raise ValueError(f"SRC and DST are the same ({source}): write the conversion somewhere else")
    options = _Options(
        int(chunk_size_MB * _s3.MB),
        chunk_size_MB,
        max_read_concurrency,
        max_write_concurrency,
        checksum_algorithm,
        weights_only,
        progress,
    )
    s3 = _s3.S3Utils.from_arguments(s3_utils=s3_utils, caller="convert")
    started = time.monotonic()
    kind = _source_kind(source, s3)
    if kind == "dcp":
        fmt = _file_format(destination, source)
        _refuse_existing_file(destination, s3, overwrite)
        report = _dcp_to_file(source, destination, fmt, s3, options, only, overwrite)
    else:
        if only is not None:
            raise ValueError(f"--only applies to DCP sources; {source} is a single torch file")
        if destination.endswith(SAFETENSORS_SUFFIX):
            raise ValueError(
                f"{source} is a single torch file: convert writes it as a DCP checkpoint, not as {destination}. "
                "Give DST as the prefix (or directory) of the DCP checkpoint to create."
            )
        _refuse_existing_dcp(destination, s3, overwrite)
        report = _torch_file_to_dcp(source, destination, s3, options, overwrite)
    report = dataclasses.replace(report, seconds=time.monotonic() - started)
    logger.info(
        "Converted %s to %s (%s, %d tensors, %d bytes) in %.2f s",
        source,
        destination,
        report.format,
        report.tensors,
        report.size,
        report.seconds,
    )
    return report


# --------------------------------------------------------------------------------------------------------------------
# What the source and the destination are
# --------------------------------------------------------------------------------------------------------------------


def _source_kind(source: str, s3: _s3.S3Utils) -> str:
    """``"dcp"`` for a checkpoint holding ``.metadata``, ``"file"`` for one object / file; else a clear error."""
    metadata = _join(source, _dcp.METADATA_NAME)
    if _is_s3(source):
        if s3.s3_path_exists(metadata):
            return _refuse_stale(source, metadata, s3, "dcp")
        if _urls.parse_s3_url(source)[1] and s3.s3_path_exists(source):
            return _refuse_stale(source, source, s3, "file")
        present = s3.s3_path_exists(source, match_directory=True)
    else:
        if os.path.isfile(metadata):
            return "dcp"
        if os.path.isfile(source):
            return "file"
        present = os.path.isdir(source) and bool(os.listdir(source))
    if present:
        raise _dcp.CheckpointIncompleteError(
            f"The DCP checkpoint at {source} is incomplete: it has no {_dcp.METADATA_NAME} (the commit marker written "
            "last), so its save never finished (or it was saved with use_collectives=False, whose per-rank metadata "
            "convert does not merge). Convert a complete checkpoint."
        )
    raise FileNotFoundError(
        f"No checkpoint at {source}: neither a DCP checkpoint ({metadata}) nor a torch file. Check the path."
    )


def _refuse_stale(source: str, committed: str, s3: _s3.S3Utils, kind: str) -> str:
    """`kind`, unless `committed` (the file, or the DCP checkpoint's ``.metadata``) is a stale run's: committed by a
    run older than the owner of the checkpoint's directory after the owner took it over (docs/fencing.md)."""
    directory = _urls.s3_url_parent(source.rstrip("/"))
    if owner := _fencing.directory_owner(s3, directory):
        if _fencing.stale_objects(s3, directory, [s3.head_object(committed)], owner=owner):
            raise FileNotFoundError(
                f"No checkpoint at {source}: it was committed by a stale run after {owner.run} took the directory "
                f"{directory} over, so no resume, ls or verify counts it (the owner's next save, or s3-checkpoint-io "
                f"gc, removes it). Convert a checkpoint that s3-checkpoint-io ls {directory} lists.")
    return kind


def _file_format(destination: str, source: str) -> str:
    if destination.endswith(SAFETENSORS_SUFFIX):
        return "safetensors"
    if destination.endswith(TORCH_SUFFIXES):
        return "torch"
    raise ValueError(
        f"{source} is a DCP checkpoint, so DST names the file to write: {destination} must end in "
        f"{SAFETENSORS_SUFFIX} or {' / '.join(TORCH_SUFFIXES)}"
    )


def _exists_message(what: str) -> str:
    return f"{what} already exists: nothing was written. Pass overwrite=True (--overwrite) to replace it."


def _refuse_existing_file(destination: str, s3: _s3.S3Utils, overwrite: bool) -> None:
    if _is_s3(destination):
        if not _urls.parse_s3_url(destination)[1]:
            raise ValueError(f"DST {destination} names a bucket: give the key of the file to write")
        exists = s3.s3_path_exists(destination)
    else:
        if os.path.isdir(destination):
            raise IsADirectoryError(f"DST {destination} is a directory: give the path of the file to write")
        if not os.path.isdir(os.path.dirname(destination)):
            raise FileNotFoundError(f"DST's directory {os.path.dirname(destination)} does not exist")
        exists = os.path.exists(destination)
    if exists and not overwrite:
        raise FileExistsError(_exists_message(destination))


def _refuse_existing_dcp(destination: str, s3: _s3.S3Utils, overwrite: bool) -> None:
    """Refuse a DCP checkpoint at `destination` (unless `overwrite`), and always a file there or a prefix holding
    other things: convert replaces checkpoints, not whatever else a path holds."""
    metadata = _join(destination, _dcp.METADATA_NAME)
    if _is_s3(destination):
        if not _urls.parse_s3_url(destination)[1]:
            raise ValueError(f"DST {destination} names a bucket: give the prefix of the DCP checkpoint to write")
        exists = s3.s3_path_exists(metadata)
        is_file = not exists and s3.s3_path_exists(destination)
        other = not exists and s3.s3_path_exists(destination, match_directory=True)
    else:
        exists = os.path.isfile(metadata)
        is_file = os.path.isfile(destination)
        other = not exists and os.path.isdir(destination) and bool(os.listdir(destination))
    if is_file:
        raise FileExistsError(f"{destination} is a file, not a DCP checkpoint: choose another DST")
    if other:
        raise FileExistsError(f"{destination} holds other things but no DCP checkpoint: choose another DST")
    if exists and not overwrite:
        raise FileExistsError(_exists_message(f"A DCP checkpoint at {destination} ({metadata})"))


# --------------------------------------------------------------------------------------------------------------------
# Reading a DCP checkpoint: metadata, verification, tensors assembled from their shards
# --------------------------------------------------------------------------------------------------------------------


class _Collector:
    """The part of DCP's ``LoadPlanner`` a storage reader's ``read_data`` calls: it hands out the slices of the
    tensors being assembled and keeps the raw bytes of bytes items (unpickled later, or never)."""

    def __init__(self, targets: dict[str, Any]) -> None:
        self.targets = targets
        self.blobs: dict[str, bytes] = {}

    def resolve_tensor(self, read_item: Any) -> Any:
        tensor = self.targets[read_item.dest_index.fqn]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            tensor = tensor.narrow(dim, offset, length)
        return tensor

    def commit_tensor(self, read_item: Any, tensor: Any) -> None:
        pass

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.blobs[read_item.dest_index.fqn] = value.read()


class _DcpSource:
    """A complete DCP checkpoint: its metadata, and its entries read batch by batch through the storage reader
    (`s3_dcp.S3StorageReader` for ``s3://``, torch's ``FileSystemReader`` for a directory)."""

    def __init__(self, location: str, s3: _s3.S3Utils, options: _Options) -> None:
        self.location = location
        self._s3 = s3
        self._options = options
        if _is_s3(location):
            self.reader = _dcp.S3StorageReader(
                location,
                s3_utils=s3,
                chunk_size_MB=options.chunk_size_MB,
                max_read_concurrency=options.read_concurrency,
            )
            self.metadata = self.reader.read_metadata()
        else:
            fs = _process.import_optional_dependency("torch.distributed.checkpoint", "checkpoint conversion")
            path = os.path.join(location, _dcp.METADATA_NAME)
            with open(path, "rb") as stream:
                self.metadata = _dcp.load_metadata_bytes(stream.read(), path)
            self.reader = fs.FileSystemReader(location)
        self.reader.set_up_storage_reader(self.metadata, True)
        self.verification = ""

    def tensor_metadata(self, fqn: str) -> Any | None:
        """The entry's ``TensorStorageMetadata``, or None for a bytes item."""
        md = self.metadata.state_dict_metadata[fqn]
        return md if hasattr(md, "chunks") else None

    def nbytes(self, fqn: str) -> int:
        md = self.tensor_metadata(fqn)
        if md is None:
            return 0
        count = 1
        for dim in md.size:
            count *= dim
        return count * md.properties.dtype.itemsize

    def files_of(self, fqns: Iterable[str]) -> dict[str, list[tuple[int, int]]]:
        """The shard files the entries `fqns` live in, with every (offset, length) of an item in them."""
        wanted = set(fqns)
        files: dict[str, set[tuple[int, int]]] = {}
        for index, info in self.reader.storage_data.items():
            if index.fqn in wanted:
                files.setdefault(info.relative_path, set()).add((info.offset, info.length))
        return {name: sorted(items) for name, items in files.items()}

    # ---- verification ---------------------------------------------------------------------------------------------

    def set_up_verification(self, fqns: list[str]) -> None:
        """Decide (and where needed, do first) what the items read are checked against; sets `verification`."""
        files = self.files_of(fqns)
        record_path = _join(self.location, _dcp.ITEM_CHECKSUMS_NAME)
        if _is_s3(self.location):
            if self._s3.s3_path_exists(record_path):
                self.verification = (
                    f"every item read ({sum(map(len, files.values()))} in {len(files)} shard file(s)) against the "
                    f"checksums S3StorageWriter recorded ({_dcp.ITEM_CHECKSUMS_NAME}), each GET pinned to the "
                    "shard's ETag"
                )
                return
            self._adopt_whole_file_checksums(files)
            return
        if not os.path.isfile(record_path):
            self.verification = (
                f"nothing: {self.location} records no checksums (torch's FileSystemWriter writes none), so "
                f"{len(files)} shard file(s) were read unverified"
            )
            logger.warning("%s records no checksums: converting it unverified", self.location)
            return
        with open(record_path, "rb") as stream:
            record = json.load(stream)
        save_id = getattr(getattr(self.metadata, "storage_meta", None), "save_id", None)
        if not isinstance(record, dict) or record.get("save_id") != save_id:
            raise _s3.ChecksumMismatchError(
                f"{record_path} belongs to another save than {_join(self.location, _dcp.METADATA_NAME)}: the "
                "checkpoint was modified after it was written; do not use it"
            )
        for name, items in files.items():
            entry = record.get("files", {}).get(name)
            if entry is None:
                raise _s3.ChecksumMismatchError(f"{record_path} records nothing for {name}: do not use it")
            path = os.path.join(self.location, name)
            algorithm = _s3.ChecksumAlgorithm.named(entry["algorithm"])
            with open(path, "rb") as stream:
                size = os.fstat(stream.fileno()).st_size
                whole, found = _scan(
                    path, functools.partial(_pread_into, stream), size, items, algorithm, self._options.chunk
                )
            _compare_items(path, entry.get("items", {}), found, algorithm)
            if entry.get("checksum") and size == entry.get("size") and algorithm.encode(whole) != entry["checksum"]:
                raise _s3.ChecksumMismatchError(
                    f"{path} is corrupt: its {algorithm.name} is {algorithm.encode(whole)}, but {entry['checksum']} "
                    "was recorded when it was written"
                )
        self.verification = (
            f"every item ({sum(map(len, files.values()))} in {len(files)} shard file(s)) against "
            f"{_dcp.ITEM_CHECKSUMS_NAME}, checked in a pass over the files before they were converted"
        )

    def _adopt_whole_file_checksums(self, files: dict[str, list[tuple[int, int]]]) -> None:
        """A checkpoint without item checksums (torch's own writers, uploaded): read each shard file once, in
        ranged GETs, check it against the full-object checksum the store (or this package's sidecar) recorded, and
        take every item's checksum on the way; the reader then checks each item it reads against those, with every
        GET pinned to the ETag of the bytes that matched. Files with no recorded checksum are read unverified."""
        records: dict[str, Any] = {}
        unverified = []
        for name, items in sorted(files.items()):
            url = _join(self.location, name)
            info = self._s3.head_object(url)
            recorded = self._s3.recorded_checksum(info)
            if recorded is None:
                unverified.append(url)
                continue
            algorithm = _s3.ChecksumAlgorithm.named(recorded.algorithm)
            whole, found = _scan(
                url,
                functools.partial(self._read_window, url, info.etag),
                info.size,
                items,
                algorithm,
                self._options.chunk * self._options.read_concurrency,
            )
            if algorithm.encode(whole) != recorded.value:
                raise _s3.ChecksumMismatchError(
                    f"{url} is corrupt: its {algorithm.name} is {algorithm.encode(whole)}, but {recorded} was recorded "
                    "when it was uploaded. Do not use it; restore it from another copy or use an older checkpoint."
                )
            records[name] = {
                "algorithm": algorithm.name,
                "checksum": recorded.value,
                "etag": info.etag,
                "size": info.size,
                "items": {str(offset): [length, found[offset]] for offset, length in items},
            }
        # The reader checks items against the records of `S3StorageWriter`; these are the same, taken from bytes that
        # matched the store's checksum (it reads files missing here unverified, with a warning).
        self.reader.use_item_records(records)
        parts = []
        if records:
            parts.append(
                f"{len(records)} shard file(s) without item checksums (written by another tool) read whole first and "
                "checked against their full-object checksums; every item then read against checksums taken in that "
                "pass, each GET pinned to the same ETag"
            )
        if unverified:
            parts.append(
                f"{len(unverified)} file(s) with no recorded checksum read unverified: {', '.join(unverified)}"
            )
        self.verification = "; ".join(parts)

    def _read_window(self, url: str, etag: str, start: int, view: memoryview) -> int:
        """Bytes [start, start + len(view)) of `url` into `view`, one chunk per ranged GET, in parallel."""
        chunk = self._options.chunk
        ranges = [(start + offset, view[offset : offset + chunk]) for offset in range(0, len(view), chunk)]
        counts = self._s3.read_ranges_into(
            url, ranges, etag=etag or None, max_concurrency=self._options.read_concurrency
        )
        return sum(counts)

    # ---- reading --------------------------------------------------------------------------------------------------

    def read(self, fqns: list[str], arena: Any = None) -> dict[str, Any]:
        """The entries `fqns`: tensors assembled from all their chunks (in `arena`, a uint8 tensor large enough for
        all of them at 64-byte aligned offsets, when given), bytes items as their raw bytes."""
        torch = _torch()
        metadata_mod = _process.import_optional_dependency("torch.distributed.checkpoint.metadata", "conversion")
        planner_mod = _process.import_optional_dependency("torch.distributed.checkpoint.planner", "conversion")
        helpers = _process.import_optional_dependency("torch.distributed.checkpoint.planner_helpers", "conversion")
        targets: dict[str, Any] = {}
        items: list[Any] = []
        used = 0
        for fqn in fqns:
            md = self.tensor_metadata(fqn)
            if md is None:
                index = metadata_mod.MetadataIndex(fqn)
                zero = torch.Size((0,))
                items.append(planner_mod.ReadItem(planner_mod.LoadItemType.BYTE_IO, index, zero, index, zero, zero))
                continue
            dtype, nbytes = md.properties.dtype, self.nbytes(fqn)
            if arena is None:
                targets[fqn] = torch.empty(md.size, dtype=dtype)
            else:
                targets[fqn] = arena[used : used + nbytes].view(dtype).view(md.size)
                used += _aligned(nbytes)
            whole = metadata_mod.ChunkStorageMetadata(torch.Size([0] * len(md.size)), md.size)
            reads = helpers.create_read_items_for_chunk_list(fqn, md, [whole])
            covered = sum(_numel(read.lengths) for read in reads)
            if covered != targets[fqn].numel():
                raise ValueError(
                    f"{_join(self.location, _dcp.METADATA_NAME)}: the chunks of {fqn} cover {covered} of its "
                    f"{targets[fqn].numel()} elements: the checkpoint's metadata is inconsistent"
                )
            items += reads
        collector = _Collector(targets)
        if items:
            self.reader.read_data(planner_mod.LoadPlan(items), collector).wait()
        return {**targets, **collector.blobs}

    def assembled(self, fqns: list[str]) -> Iterator[tuple[str, Any]]:
        """`read` in batches of at most the largest tensor (or one chunk), yielding the entries in order. Every
        batch is assembled in the same buffer, allocated once: a tensor yielded is valid until the next one is asked
        for (allocating and freeing a tensor-sized block per batch makes the C allocator keep memory it no longer
        uses, so RSS would creep above the bound)."""
        torch = _torch()
        sizes = {fqn: _aligned(self.nbytes(fqn)) for fqn in fqns}
        budget = max([_aligned(self._options.chunk), *sizes.values()])
        arena = torch.empty(min(budget, sum(sizes.values())), dtype=torch.uint8)
        batch: list[str] = []
        used = 0
        for fqn in [*fqns, None]:
            nbytes = sizes[fqn] if fqn is not None else 0
            if batch and (fqn is None or used + nbytes > budget):
                values = self.read(batch, arena)
                for name in batch:
                    yield name, values.pop(name)
                batch, used = [], 0
            if fqn is not None:
                batch.append(fqn)
                used += nbytes


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def _numel(sizes: Iterable[int]) -> int:
    count = 1
    for size in sizes:
        count *= size
    return count


def _pread_into(stream: Any, start: int, view: memoryview) -> int:
    stream.seek(start)
    filled = 0
    while filled < len(view):
        count = stream.readinto(view[filled:])
        if not count:
            break
        filled += count
    return filled


def _scan(
    url: str,
    read_into: Callable[[int, memoryview], int],
    size: int,
    items: list[tuple[int, int]],
    algorithm: Any,
    window: int,
) -> tuple[int, dict[int, int]]:
    """Read the file `url` once, `window` bytes at a time (memory: one window), and return its checksum and the
    checksum of every (offset, length) item in it."""
    for offset, length in items:
        if offset + length > size:
            raise _s3.ChecksumMismatchError(
                f"{url} is {size} bytes, but the checkpoint's metadata has an item at bytes "
                f"{offset}-{offset + length}: the shard was truncated or replaced; do not use this checkpoint"
            )
    buffer = bytearray(min(window, size))
    found = {offset: 0 for offset, _ in items}
    ordered = sorted(items)
    whole, first = 0, 0
    for start in range(0, size, window):
        view = memoryview(buffer)[: min(window, size - start)]
        if read_into(start, view) != len(view):
            raise _s3.ChecksumMismatchError(f"{url} ended before byte {start + len(view)} while it was being verified")
        value = algorithm.update(view, 0)
        whole = value if start == 0 else algorithm.combine(whole, value, len(view))
        end = start + len(view)
        while first < len(ordered) and sum(ordered[first]) <= start:
            first += 1
        for offset, length in ordered[first:]:
            if offset >= end:
                break
            lo, hi = max(offset, start), min(offset + length, end)
            if hi > lo:
                part = algorithm.update(view[lo - start : hi - start], 0)
                found[offset] = part if lo == offset else algorithm.combine(found[offset], part, hi - lo)
    return whole, found


def _compare_items(path: str, recorded: dict[str, Any], found: dict[int, int], algorithm: Any) -> None:
    for offset, actual in found.items():
        expected = recorded.get(str(offset))
        if expected is None or int(expected[1]) != actual:
            raise _s3.ChecksumMismatchError(
                f"{path} is corrupt: the item at byte {offset} has {algorithm.name} {actual:#x}, but "
                f"{'nothing' if expected is None else hex(int(expected[1]))} was recorded when the checkpoint was "
                "written. Do not use it; use an older checkpoint."
            )


# --------------------------------------------------------------------------------------------------------------------
# Writing one file: a sink that is published only when complete
# --------------------------------------------------------------------------------------------------------------------


class _Sink(io.RawIOBase):
    """Where a conversion writes: forwards to an `S3MultipartWriter` or a local file. Once the conversion failed,
    writes are dropped: torch's zip writer, destroyed later, still writes its end-of-file record, and an exception
    from that destructor would end the process."""

    def __init__(self, target: Any) -> None:
        super().__init__()
        self._target = target
        self.size = 0
        self.failed = False
        self.info: _s3.S3ObjectInfo | None = None
        """Set once an ``s3://`` destination is complete: what was written (its checksum)."""

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.size

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.failed:
            return len(view)
        try:
            self._target.write(view)
        except BaseException:
            self.failed = True
            raise
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def _output_file(destination: str, s3: _s3.S3Utils, options: _Options, overwrite: bool) -> Iterator[_Sink]:
    """A sink for `destination` that appears only if the block completes: a multipart upload completed at the end
    (aborted otherwise), or a temporary file in the same directory moved into place (removed otherwise)."""
    if _is_s3(destination):
        writer = s3.open_writer(
            destination, options.chunk_size_MB, options.write_concurrency, options.checksum_algorithm
        )
        sink = _Sink(writer)
        try:
            yield sink
        except BaseException:
            sink.failed = True
            writer.abort()
            raise
        sink.failed = True  # nothing after this point belongs to the object
        writer.close()
        sink.info = writer.info
        return
    partial = _partial_name(destination)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as stream:
            sink = _Sink(stream)
            try:
                yield sink
            except BaseException:
                sink.failed = True
                raise
            sink.failed = True
            stream.flush()
            os.fsync(stream.fileno())
        if overwrite:
            os.replace(partial, destination)
        else:
            try:
                os.link(partial, destination)  # fails if someone created it meanwhile: never clobbered
            except FileExistsError:
                raise FileExistsError(_exists_message(destination)) from None
            os.unlink(partial)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)


def _partial_name(destination: str) -> str:
    """A new name beside `destination` for the result while it is written (dot-prefixed: listings skip it)."""
    directory, name = os.path.split(destination)
    return os.path.join(directory, f".{name}.s3ckpt-partial-{uuid.uuid4().hex[:12]}")


def _tensor_view(tensor: Any) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return _dcp.tensor_bytes_view(tensor) if tensor.numel() else memoryview(b"")


# --------------------------------------------------------------------------------------------------------------------
# DCP -> safetensors / torch file
# --------------------------------------------------------------------------------------------------------------------


def _selected(source: _DcpSource, only: str | None) -> list[str]:
    names = list(source.metadata.state_dict_metadata)
    if only is None:
        return names
    prefix = only.strip(".")
    chosen = [name for name in names if name == prefix or name.startswith(prefix + ".")]
    if not chosen:
        tops = sorted({name.split(".", 1)[0] for name in names})
        raise ValueError(
            f"No entry of {source.location} is under {only!r}; its top-level keys are: {', '.join(tops[:20])}"
        )
    return chosen


def _dcp_to_file(
    source_location: str,
    destination: str,
    fmt: str,
    s3: _s3.S3Utils,
    options: _Options,
    only: str | None,
    overwrite: bool,
) -> ConversionReport:
    source = _DcpSource(source_location, s3, options)
    fqns = _selected(source, only)
    tensors = [fqn for fqn in fqns if source.tensor_metadata(fqn) is not None]
    skipped: tuple[str, ...] = ()
    if fmt == "safetensors":
        skipped = tuple(fqn for fqn in fqns if source.tensor_metadata(fqn) is None)
        _check_safetensors_dtypes(source, tensors)
        fqns = tensors
    source.set_up_verification(fqns)
    with _output_file(destination, s3, options, overwrite) as sink:
        if fmt == "safetensors":
            _write_safetensors(source, tensors, sink, options)
        else:
            _write_torch(source, fqns, sink, options)
    if skipped:
        logger.warning(
            "%d non-tensor entries of %s are not in %s (safetensors holds tensors only): %s",
            len(skipped),
            source_location,
            destination,
            ", ".join(skipped),
        )
    checksum = None
    if sink.info is not None and sink.info.checksums:
        name, value = next(iter(sink.info.checksums.items()))
        checksum = f"{name.removeprefix('Checksum')} {value}"
    return ConversionReport(
        source=source_location,
        destination=destination,
        format=fmt,
        tensors=len(tensors),
        tensor_bytes=sum(source.nbytes(fqn) for fqn in tensors),
        size=sink.size,
        skipped=skipped,
        verification=source.verification,
        seconds=0.0,
        checksum=checksum,
    )


def _check_safetensors_dtypes(source: _DcpSource, tensors: list[str]) -> None:
    refused = []
    for fqn in tensors:
        dtype = source.tensor_metadata(fqn).properties.dtype
        if str(dtype).removeprefix("torch.") not in _SAFETENSORS_DTYPES:
            refused.append(f"{fqn} ({dtype})")
    if refused:
        raise ValueError(
            f"safetensors has no dtype for {', '.join(refused[:10])}: convert to a .pt file instead, or select "
            "other entries with --only"
        )


def _write_safetensors(source: _DcpSource, tensors: list[str], sink: _Sink, options: _Options) -> None:
    """The header (every tensor's dtype, shape and offsets) from the metadata, then each tensor's bytes as it is
    assembled. Largest element size first, then by name, as the safetensors package orders them: every tensor
    stays aligned to its element size when the file is mapped."""
    dtype_of = {fqn: source.tensor_metadata(fqn).properties.dtype for fqn in tensors}
    ordered = sorted(tensors, key=lambda fqn: (-dtype_of[fqn].itemsize, fqn))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for fqn in ordered:
        md = source.tensor_metadata(fqn)
        nbytes = source.nbytes(fqn)
        header[fqn] = {
            "dtype": _SAFETENSORS_DTYPES[str(md.properties.dtype).removeprefix("torch.")],
            "shape": list(md.size),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    sink.write(struct.pack("<Q", len(encoded)))
    sink.write(encoded)
    for _, tensor in source.assembled(ordered):
        sink.write(_tensor_view(tensor))
        if options.progress is not None:
            options.progress(tensor.numel() * tensor.element_size())


class _PendingStorage:
    """A storage in the pickle that is not read yet: its record is written once the tensor is assembled."""

    def __init__(self, fqn: str, dtype: Any, numel: int) -> None:
        self.fqn, self.dtype, self.numel = fqn, dtype, numel


class _PendingTensor:
    """Pickles as ``torch.save`` pickles a contiguous CPU tensor, with its storage still to come."""

    def __init__(self, storage: _PendingStorage, size: tuple[int, ...]) -> None:
        self.storage, self.size = storage, size

    def __reduce_ex__(self, protocol: Any) -> Any:
        torch = _torch()
        stride, step = [], 1
        for dim in reversed(self.size):
            stride.insert(0, step)
            step *= dim
        return (
            torch._utils._rebuild_tensor_v2,
            (self.storage, 0, self.size, tuple(stride), False, collections.OrderedDict()),
        )


def _torch_pickler(stream: io.BytesIO, records: list[tuple[str, Any]]) -> pickle.Pickler:
    """torch.save's pickler: storages become persistent ids ``("storage", type, key, location, numel)``, keyed in
    the order they are met (torch.load relies on that order)."""
    torch = _torch()
    storage_types = torch.storage._dtype_to_storage_type_map()
    keys: dict[int, str] = {}

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, _PendingStorage):
                identity, dtype, numel = id(obj), obj.dtype, obj.numel
                storage: Any = obj
            elif isinstance(obj, torch.storage.TypedStorage):  # a tensor inside a non-tensor entry, already loaded
                identity, dtype, numel = obj._untyped_storage._cdata, obj.dtype, obj._size()
                storage = obj._untyped_storage
            elif torch.is_storage(obj):
                identity, dtype, numel = obj._cdata, torch.uint8, obj.nbytes()
                storage = obj
            else:
                return None
            if identity not in keys:
                keys[identity] = str(len(keys))
                records.append((keys[identity], storage))
            if isinstance(obj, _PendingStorage) or isinstance(obj, torch.storage.TypedStorage):
                storage_type = getattr(torch, storage_types[dtype])
            else:
                storage_type = torch.UntypedStorage
            return ("storage", storage_type, keys[identity], "cpu", numel)

    return Pickler(stream, protocol=torch.serialization.DEFAULT_PROTOCOL)


def _write_torch(source: _DcpSource, fqns: list[str], sink: _Sink, options: _Options) -> None:
    """A ``torch.save`` archive of the nested state dict: ``data.pkl`` first (tensors as storages still to come,
    non-tensor entries unpickled), then each storage record as its tensor is assembled, in key order."""
    torch = _torch()
    traverse = _process.import_optional_dependency("torch.distributed.checkpoint._traverse", "checkpoint conversion")
    tensor_fqns = [fqn for fqn in fqns if source.tensor_metadata(fqn) is not None]
    blobs = source.read([fqn for fqn in fqns if source.tensor_metadata(fqn) is None])
    planner_data = source.metadata.planner_data or {}
    state: dict[str, Any] = {}
    for fqn in fqns:
        md = source.tensor_metadata(fqn)
        if md is None:
            try:
                value = torch.load(io.BytesIO(blobs.pop(fqn)), weights_only=options.weights_only)
            except pickle.UnpicklingError as exc:
                raise ValueError(
                    f"{source.location}: entry {fqn} cannot be loaded with weights_only=True ({exc}). If you trust "
                    "this checkpoint, convert with weights_only=False (--no-weights-only)."
                ) from None
        else:
            value = _PendingTensor(_PendingStorage(fqn, md.properties.dtype, _numel(md.size)), tuple(md.size))
        path = planner_data.get(fqn)
        if path is not None:
            traverse.set_element(state, path, value)
        else:
            state[fqn] = value
    buffer = io.BytesIO()
    records: list[tuple[str, Any]] = []
    _torch_pickler(buffer, records).dump(state)
    del state
    pickled = buffer.getvalue()
    archive = torch._C.PyTorchFileWriter(
        sink, torch.serialization.get_crc32_options(), torch.serialization._get_storage_alignment()
    )
    archive.write_record("data.pkl", pickled, len(pickled))
    archive.write_record(".format_version", "1", 1)
    alignment = str(torch.serialization._get_storage_alignment())
    archive.write_record(".storage_alignment", alignment, len(alignment))
    archive.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    pending = [storage.fqn for _, storage in records if isinstance(storage, _PendingStorage)]
    if sorted(pending) != sorted(tensor_fqns):
        raise AssertionError("every tensor entry must be pickled exactly once")
    tensors = source.assembled(pending)
    for key, storage in records:
        if isinstance(storage, _PendingStorage):
            fqn, tensor = next(tensors)
            assert fqn == storage.fqn
            start = tensor.storage_offset() * tensor.element_size()
            data = tensor.untyped_storage()[start : start + tensor.numel() * tensor.element_size()]  # a view
        else:
            data = storage
        archive.write_record(f"data/{key}", data, data.nbytes())
        if options.progress is not None and isinstance(storage, _PendingStorage):
            options.progress(data.nbytes())
        del data
    archive.write_end_of_file()


# --------------------------------------------------------------------------------------------------------------------
# One torch file -> DCP
# --------------------------------------------------------------------------------------------------------------------


class _RangedS3File(_s3.SeekableReader):
    """A read-only, seekable view of one S3 object for ``zipfile`` and torch's archive reader, which read only the
    framing and the pickle: small reads, served from a read-ahead buffer; every GET pinned to the ETag."""

    def __init__(self, s3: _s3.S3Utils, url: str, size: int, etag: str) -> None:
        super().__init__(size)
        self._s3, self.url, self.size, self.etag = s3, url, size, etag
        self._cached_at = 0
        self._cached = b""

    def fill_at(self, out: memoryview, start: int) -> None:
        end = start + len(out)
        if not (self._cached_at <= start and end <= self._cached_at + len(self._cached)):
            length = min(max(len(out), _READ_AHEAD), self.size - start)
            buffer = bytearray(length)
            if self._s3.read_range_into(self.url, start, buffer, etag=self.etag or None) != length:
                raise _s3.ChecksumMismatchError(f"{self.url} ended before byte {start + length}: was it replaced?")
            self._cached_at, self._cached = start, bytes(buffer)
        out[:] = self._cached[start - self._cached_at : end - self._cached_at]


def _record_bytes(archive: zipfile.ZipFile, stream: Any, record: zipfile.ZipInfo) -> bytes:
    """A small record's bytes, CRC-32 checked by zipfile where the archive records one. A CRC-32 of 0 on a stored
    record means the archive was saved without them (``compute_crc32=False``, as this package's S3 saves write:
    the object's own checksum covers it), which zipfile's reader would refuse: that record is read by its offset."""
    if record.CRC or record.compress_type != zipfile.ZIP_STORED:
        return archive.read(record)
    start = _dcp.zip_record_data_start(stream, record)
    if start is None:
        raise zipfile.BadZipFile(f"no local header for {record.filename}")
    stream.seek(start)
    data = stream.read(record.file_size)
    if len(data) != record.file_size:
        raise zipfile.BadZipFile(f"{record.filename} is cut short")
    return data


class _TorchFileSource:
    """One ``torch.save`` zip archive, loaded lazily: its pickle on the meta device (no tensor bytes read), each
    storage read when asked for and checked against the CRC-32 recorded for its record."""

    def __init__(self, location: str, s3: _s3.S3Utils, options: _Options) -> None:
        torch = _torch()
        self.location = location
        self._s3 = s3
        self._options = options
        if _is_s3(location):
            info = s3.head_object(location)
            self._etag: str | None = info.etag or None
            self._file: Any = _RangedS3File(s3, location, info.size, info.etag)
        else:
            self._etag = None
            self._file = open(location, "rb")  # closed by close()
        try:
            with zipfile.ZipFile(self._file) as archive:
                records = archive.infolist()
                pickles = [r for r in records if r.filename.endswith("/data.pkl") and r.filename.count("/") == 1]
                if len(pickles) != 1:
                    raise zipfile.BadZipFile("no data.pkl record")
                _record_bytes(archive, self._file, pickles[0])  # its CRC-32 checked, where one was recorded
                order = [r for r in records if r.filename.endswith("/byteorder") and r.filename.count("/") == 1]
                saved_order = _record_bytes(archive, self._file, order[0]).decode() if order else sys.byteorder
                if saved_order != sys.byteorder:
                    raise ValueError(f"{location} was saved on a {saved_order}-endian machine")
        except zipfile.BadZipFile as exc:
            self.close()
            if "CRC" in str(exc):
                raise _s3.ChecksumMismatchError(f"{location} is corrupt: {exc}") from None
            raise ValueError(
                f"{location} is not a torch.save zip archive ({exc}): convert reads the format torch.save writes by "
                "default (files saved with _use_new_zipfile_serialization=False are not supported; load and save "
                "them again)"
            ) from None
        self._records = sorted((r.header_offset, r) for r in records)
        self._file.seek(0)
        try:
            self.state = torch.load(self._file, map_location="meta", weights_only=options.weights_only)
        except pickle.UnpicklingError as exc:
            self.close()
            raise ValueError(
                f"{location} cannot be loaded with weights_only=True ({str(exc).splitlines()[0]}). If you trust this "
                "file, convert with weights_only=False (--no-weights-only)."
            ) from None
        self._buffer: Any = None
        self._cached_at: int | None = None
        self.tensors = 0
        self.tensor_bytes = 0
        self.verified = 0
        self.unverified = 0

    def close(self) -> None:
        self._file.close()

    def _record_at(self, offset: int, nbytes: int) -> zipfile.ZipInfo:
        position = bisect.bisect_right(self._records, offset, key=lambda entry: entry[0]) - 1
        record = self._records[position][1] if position >= 0 else None
        if (
            record is None
            or "/data/" not in record.filename
            or record.compress_type != zipfile.ZIP_STORED
            or record.file_size != nbytes
            or not 30 + len(record.filename.encode()) <= offset - record.header_offset <= 30 + 2 * 65535
        ):
            raise ValueError(f"{self.location}: no stored record holds the storage at byte {offset}: not a torch file?")
        return record

    def _storage(self, offset: int, nbytes: int, reuse: bool) -> Any:
        """The storage whose bytes start at `offset`, read and checked against its record's CRC-32. With `reuse`, in
        the buffer every such storage is read into (valid until the next one is asked for), else in memory of its
        own."""
        torch = _torch()
        if not nbytes:  # torch.load's computed offset of an empty record may be the next record's: nothing to read
            return torch.UntypedStorage(0)
        if reuse and self._cached_at == offset:
            return self._buffer.untyped_storage()[:nbytes]
        record = self._record_at(offset, nbytes)
        if not reuse:
            data = torch.empty(nbytes, dtype=torch.uint8)
        else:
            # The DCP writer is done with a tensor once it asks for the next one (it writes one item at a time), so
            # every storage it writes can use the same memory: one allocation, instead of one per storage, which
            # the C allocator would partly keep (RSS would creep above the bound).
            self._cached_at = None
            if self._buffer is None or self._buffer.numel() < nbytes:
                self._buffer = None
                self._buffer = torch.empty(nbytes, dtype=torch.uint8)
            data = self._buffer[:nbytes]
        view = _tensor_view(data)
        chunk = self._options.chunk
        if isinstance(self._file, _RangedS3File):
            ranges = [(offset + start, view[start : start + chunk]) for start in range(0, nbytes, chunk)]
            filled = sum(
                self._s3.read_ranges_into(
                    self.location, ranges, etag=self._etag, max_concurrency=self._options.read_concurrency
                )
            )
        else:
            filled = _pread_into(self._file, offset, view)
        if filled != nbytes:
            raise _s3.ChecksumMismatchError(f"{self.location} ended inside its record {record.filename}")
        if record.CRC:
            actual = zlib.crc32(view)
            if actual != record.CRC:
                raise _s3.ChecksumMismatchError(
                    f"{self.location} is corrupt: its record {record.filename} has CRC-32 {actual:#010x}, but "
                    f"{record.CRC:#010x} was recorded when it was saved. Do not use it."
                )
            self.verified += 1
        else:
            self.unverified += 1
        if reuse:
            self._cached_at = offset  # the next tensor may view the same storage
        return data.untyped_storage()[:nbytes]  # exactly the record's bytes: the writers then copy nothing

    def materialize(self, meta: Any, reuse: bool = True) -> Any:
        """The tensor `meta` (loaded on the meta device) with its bytes read from the file (see `_storage`)."""
        torch = _torch()
        storage = meta.untyped_storage()
        data = self._storage(storage._checkpoint_offset, storage.nbytes(), reuse)
        tensor = torch.empty(0, dtype=meta.dtype).set_(data, meta.storage_offset(), meta.size(), meta.stride())
        self.tensors += 1
        self.tensor_bytes += tensor.numel() * tensor.element_size()
        if self._options.progress is not None:
            self._options.progress(tensor.numel() * tensor.element_size())
        return tensor

    def materialize_within(self, value: Any) -> Any:
        """`value` (a non-tensor entry) with any meta tensor inside it (e.g. in a tuple, which DCP does not
        traverse) replaced by the real one."""
        torch = _torch()
        found: list[Any] = []

        class Finder(pickle.Pickler):
            def persistent_id(self, obj: Any) -> Any:
                if isinstance(obj, torch.Tensor) and obj.device.type == "meta":
                    found.append(obj)
                    return len(found) - 1
                return None

        buffer = io.BytesIO()
        Finder(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
        if not found:
            return value
        real = [self.materialize(tensor, reuse=False) for tensor in found]  # all alive until pickled together

        class Filler(pickle.Unpickler):
            def persistent_load(self, pid: Any) -> Any:
                return real[pid]

        buffer.seek(0)
        return Filler(buffer).load()


def _materializing_planner(source: _TorchFileSource) -> Any:
    """DCP's default save planner, handing the writer each tensor's real bytes only when it writes that tensor."""
    default_planner = _process.import_optional_dependency("torch.distributed.checkpoint.default_planner", "conversion")
    planner_mod = _process.import_optional_dependency("torch.distributed.checkpoint.planner", "conversion")

    class MaterializingSavePlanner(default_planner.DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            value = self.lookup_object(write_item.index)
            if write_item.type == planner_mod.WriteItemType.BYTE_IO:
                value = source.materialize_within(value)
            else:
                value = source.materialize(value)
            return self.transform_object(write_item, value)

    return MaterializingSavePlanner()


def _torch_file_to_dcp(
    source_location: str, destination: str, s3: _s3.S3Utils, options: _Options, overwrite: bool
) -> ConversionReport:
    dcp = _process.import_optional_dependency("torch.distributed.checkpoint", "checkpoint conversion")
    api = _process.import_optional_dependency("torch.distributed.checkpoint.api", "checkpoint conversion")
    source = _TorchFileSource(source_location, s3, options)
    try:
        if not isinstance(source.state, dict):
            raise ValueError(
                f"{source_location} holds a {type(source.state).__name__}, not a dict: a DCP checkpoint is a state dict"
            )
        planner = _materializing_planner(source)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            try:
                if _is_s3(destination):
                    writer = _dcp.S3StorageWriter(  # one file, written one item at a time (see _storage)
                        destination,
                        s3_utils=s3,
                        chunk_size_MB=options.chunk_size_MB,
                        max_write_concurrency=options.write_concurrency,
                        checksum_algorithm=options.checksum_algorithm,
                        overwrite=overwrite,
                        fencing=False,  # a tool, not a run: it must not take a training run's directory over
                    )
                    dcp.save(source.state, storage_writer=writer, planner=planner, no_dist=True)
                    size = sum(info.size for info in s3.list_objects(destination))
                else:
                    size = _save_local_dcp(dcp, source.state, planner, destination, overwrite)
            except api.CheckpointException as exc:
                causes = [failure[0] if isinstance(failure, tuple) else failure for failure in exc.failures.values()]
                cause = next((c for c in causes if isinstance(c, BaseException)), None)
                if cause is None:
                    raise
                raise cause from exc
    finally:
        source.close()
    verification = f"{source.verified} storage record(s) against the CRC-32 the torch file records for each"
    if source.unverified:
        verification += f"; {source.unverified} without one (saved with CRC-32 off) read unverified"
    return ConversionReport(
        source=source_location,
        destination=destination,
        format="dcp",
        tensors=source.tensors,
        tensor_bytes=source.tensor_bytes,
        size=size,
        skipped=(),
        verification=verification,
        seconds=0.0,
    )


def _save_local_dcp(dcp: Any, state: dict[str, Any], planner: Any, destination: str, overwrite: bool) -> int:
    """torch's FileSystemWriter into a new sibling directory, moved into place once complete; a checkpoint it
    replaces stays whole until then."""
    parent = os.path.dirname(destination)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"DST's directory {parent} does not exist")
    partial = _partial_name(destination)
    os.mkdir(partial, 0o777)  # the umask applies, as for any new directory
    try:
        # One thread and no copy-ahead: the writer takes one tensor at a time (see _TorchFileSource._storage).
        writer = dcp.FileSystemWriter(partial, thread_count=1, per_thread_copy_ahead=0)
        dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
        size = sum(os.path.getsize(os.path.join(partial, entry)) for entry in os.listdir(partial))
        if os.path.isdir(destination) and not os.listdir(destination):
            os.rmdir(destination)
        if os.path.exists(destination):
            if not overwrite:
                raise FileExistsError(_exists_message(destination))
            retired = partial + "-replaced"
            os.rename(destination, retired)
            os.rename(partial, destination)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(partial, destination)
        return size
    finally:
        shutil.rmtree(partial, ignore_errors=True)
