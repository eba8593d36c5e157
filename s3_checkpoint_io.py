"""`S3CheckpointIO`: a Lightning checkpoint plugin that streams ``torch.save`` to S3 and loads it back in parallel.

It has the name, arguments and defaults of NeMo's ``nemo.utils.callbacks.s3_checkpoint_io.S3CheckpointIO``. The
module holds the torch side of checkpointing; everything that talks to S3 is in `s3_utils`, fencing in `s3_fencing`:

* saving: ``torch.save`` writes into an `s3_utils.S3MultipartWriter` (a multipart upload that commits only when
  complete); local paths are saved atomically beside their target, as Lightning's ``TorchCheckpointIO`` would;
* loading: the object is downloaded and verified into an in-memory file that ``torch.load(mmap=True)`` maps, so the
  tensors use the downloaded pages; bytes that are not a torch checkpoint raise `NotACheckpointError`;
* async saves: tensors are snapshotted to host memory (`snapshot_to_host`), uploaded in the background, and a
  removal waits until every save issued before it is durable; background failures are raised at the next call; a
  load in this process of a URL whose save is in flight (by any instance) waits for it (`wait_for_pending_save`),
  and `pending_operation` tells ModelCheckpoint's name versioning about saves not yet visible on S3;
* fencing: saves and removals in an ``s3://`` directory go through an `s3_fencing.DirectoryFence`, so a stale run
  (an older job still writing where a newer one took over) gets `CheckpointDirectoryTakenError` and changes nothing;
* collective loads (`collective_resume`, `S3CheckpointIO.collective_load`): every rank loading one checkpoint
  shares one download per node or job, through the optional sibling `s3_node_sharing` (without it: one per rank);
  a resume skips a checkpoint that does not verify or load for the next newest (`load_newest_usable`);
* errors keep Lightning's wording: a missing checkpoint is ``FileNotFoundError("Checkpoint file not found: <url>")``,
  one S3 refuses to read a ``PermissionError``, with S3's detail (status, request id) as notes;
* memory tier (``memory_tier=``): saves land in the node's tmpfs and drain to S3 in the background, loads read
  the memory copy when it verifies, through the optional sibling `s3_memory_tier` (docs/tiers.md); resume discovery
  (`memory_tier_entries`) and name versioning (`S3CheckpointIO.holds_in_memory`) see what is only in memory;
* `register_with_lightning`: the class is a ``CheckpointIO`` of every installed Lightning family (``lightning`` and
  ``pytorch_lightning``), so both Trainers accept it; torch and Lightning are imported on first use.

docs/lightning.md lists the guarantees; docs/nemo.md what NeMo's version got wrong.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import inspect
import io
import logging
import math
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
import traceback
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

if __package__:
    from . import s3_dirpath_utils as _urls
    from . import s3_fencing as _fencing
    from . import s3_pacing as _pacing
    from . import s3_process as _process
    from . import s3_utils as _s3
else:  # installed (or copied) as top-level modules
    import s3_dirpath_utils as _urls
    import s3_fencing as _fencing
    import s3_pacing as _pacing
    import s3_process as _process
    import s3_utils as _s3

__all__ = [
    "CheckpointDirectoryTakenError",
    "NotACheckpointError",
    "S3CheckpointIO",
    "SharedLoadError",
    "TransferRecord",
    "ResumeFailedError",
    "buffer_address",
    "is_unusable_checkpoint_error",
    "load_newest_usable",
    "pending_operation",
    "s3_checkpoint_io_of",
    "torch_save_without_zip_crc32",
    "wait_for_pending_save",
]
__version__ = _s3.__version__

logger = logging.getLogger(__name__)

CheckpointDirectoryTakenError = _fencing.CheckpointDirectoryTakenError

_LIGHTNING_CHECKPOINT_IO_BASES = (
    "lightning.fabric.plugins.io.checkpoint_io",
    "lightning_fabric.plugins.io.checkpoint_io",
)
_RECORDS_KEPT = 1000
_registration_lock = threading.Lock()
_registered: set[tuple[str, type]] = set()


def _torch() -> Any:
    return _process.import_optional_dependency("torch", "checkpoint serialisation")


MEMORY_TIER_MODULE = "s3_memory_tier"  # the optional sibling module behind ``memory_tier=``


@functools.cache
def _memory_tier_module() -> types.ModuleType | None:
    """`s3_memory_tier` from beside this module, imported on first need, or None where a fork copied only the core."""
    return _process.import_sibling(MEMORY_TIER_MODULE, __package__)


def register_with_lightning(cls: type) -> list[str]:
    """Register `cls` as a virtual subclass of ``CheckpointIO`` in every installed Lightning family.

    ``lightning.pytorch`` and ``pytorch_lightning`` each have their own ``CheckpointIO`` class and each Trainer rejects
    the other's plugins; registering with both ABCs lets one plugin class serve either Trainer. Returns the modules
    registered with; raises MissingOptionalDependencyError if neither family is installed.
    Package-internal (docs/api.md).
    """
    with _registration_lock:
        found = []
        for module_name in _LIGHTNING_CHECKPOINT_IO_BASES:
            try:
                module = __import__(module_name, fromlist=["CheckpointIO"])
            except ImportError:
                continue
            if (module_name, cls) not in _registered:
                module.CheckpointIO.register(cls)
                _registered.add((module_name, cls))
            found.append(module_name)
    if not found:
        _process.import_optional_dependency("lightning", "the Lightning CheckpointIO plugin")
    return found


LIGHTNING_FAMILIES = ("lightning.pytorch", "pytorch_lightning")  # package-internal (docs/api.md)
"""The two import names Lightning ships under; each has its own classes, and each Trainer rejects the other's."""


def lightning_family(family: str | None = None, what: str = "Lightning support") -> str:
    """`family` checked against `LIGHTNING_FAMILIES`, or for None the first one installed (``lightning.pytorch``
    first); MissingOptionalDependencyError naming the install line (for `what`) if neither is.
    Package-internal (docs/api.md)."""
    if family is not None:
        if family not in LIGHTNING_FAMILIES:
            raise ValueError(f"family must be one of {LIGHTNING_FAMILIES}, got {family!r}")
        return family
    for name in LIGHTNING_FAMILIES:
        with contextlib.suppress(ImportError):
            __import__(name)
            return name
    _process.import_optional_dependency("lightning", what)
    raise AssertionError("unreachable")  # pragma: no cover


def lightning_user_agent() -> str | None:
    """``(lightning; 2.6.6)`` for each Lightning family the program has imported, as s3torchconnector reports it in
    its User-Agent; None without Lightning. Clients built for Lightning (this plugin, s3_dcp's strategies) add it.
    Package-internal (docs/api.md)."""
    comments = []
    for family in ("lightning", "pytorch_lightning"):
        version = getattr(sys.modules.get(family), "__version__", None)
        if version:
            comments.append(f"({family}; {version})")
    return " ".join(comments) or None


class NotACheckpointError(pickle.UnpicklingError):
    """The object's bytes were downloaded and verified, but ``torch.load`` cannot read them as a checkpoint."""


@dataclass(frozen=True)
class TransferRecord:
    """One finished save or load of `S3CheckpointIO`, kept in `S3CheckpointIO.records` (for logs and reports).

    `tier` says where the bytes went or came from: ``"memory"`` (the node's memory tier), ``"s3"``, or None (a
    local path). `seconds` is the whole transfer (serialise and upload, or download, verify and ``torch.load``);
    `blocked_seconds` is how long the caller waited for it: the same for loads and sync saves, the snapshot and
    back-pressure for async saves. `checksum` is the full-object checksum of an S3 object as
    ``"<ALGORITHM> <base64>"`` (e.g. ``"CRC32C 3Jz0Jg=="``): the one a save recorded, the one a load was verified
    against (`DownloadedObject.verified_against`), so a load's record equals the record of the save it read; None
    for local files and for objects with no recorded checksum (another tool wrote them: only their size was checked).
    """

    kind: str  # "save" or "load"
    url: str  # s3:// URL or local path
    size: int  # bytes
    seconds: float
    checksum: str | None
    blocked_seconds: float
    tier: str | None = None


@dataclass(eq=False)
class _PendingSave:
    """A background save. `settled` is set once its outcome is recorded and the removals waiting on it are done:
    waiting on the Future alone would race with that bookkeeping (done-callbacks run after waiters wake)."""

    path: str
    future: Future[TransferRecord | None] | None = None
    settled: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    blocked_s: float = 0.0

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclass(eq=False)
class _DeferredRemoval:
    path: str
    waits_for: list[_PendingSave]


# ---- what this process has queued, by URL, across every S3CheckpointIO ------------------------------------------
# An async save returns before its object exists, and a removal may be deferred: a reader in this process (another
# plugin instance, a new Trainer, ModelCheckpoint's "does this name exist?") asks here first. Only this module's own
# `_PendingSave` / `_DeferredRemoval` objects are ever registered; each leaves when it settles.

_queued_lock = threading.Lock()
_queued: dict[str, list[_PendingSave | _DeferredRemoval]] = {}


def _queue(operation: _PendingSave | _DeferredRemoval) -> None:
    with _queued_lock:
        _queued.setdefault(operation.path, []).append(operation)


def _unqueue(operation: _PendingSave | _DeferredRemoval) -> None:
    with _queued_lock:
        queued = _queued.get(operation.path, [])
        if operation in queued:
            queued.remove(operation)
        if not queued:
            _queued.pop(operation.path, None)


def pending_operation(path: str | os.PathLike[str]) -> str | None:
    """What this process last queued for `path` and has not finished, by any `S3CheckpointIO`: ``"save"`` (an async
    save still uploading: the object will exist), ``"remove"`` (a deferred removal: it will not), else None."""
    with _queued_lock:
        queued = _queued.get(_urls.as_path_or_s3_url(path))
        last = queued[-1] if queued else None
    if last is None:
        return None
    return "save" if isinstance(last, _PendingSave) else "remove"


def wait_for_pending_save(path: str | os.PathLike[str], timeout: float | None = None) -> None:
    """Block until the async saves of `path` that this process has in flight (by any `S3CheckpointIO`) settle, and
    raise the failure of the last one, if it failed (its own plugin also raises it at its next call). A load of
    `path` calls this first, so a save made in this process is there for the load (`S3CheckpointIO.load_checkpoint`).
    TimeoutError if they do not settle within `timeout` seconds."""
    path = _urls.as_path_or_s3_url(path)
    with _queued_lock:
        saves = [op for op in _queued.get(path, []) if isinstance(op, _PendingSave)]
    deadline = None if timeout is None else time.monotonic() + timeout
    for pending in saves:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not pending.settled.wait(left):
            raise TimeoutError(f"The async save of {path} in this process did not finish within {timeout} s")
    if saves and saves[-1].error is not None:
        raise saves[-1].error


class S3CheckpointIO:
    """Lightning ``CheckpointIO`` for ``s3://`` (and local) paths. See the module docstring for the guarantees.

    Args:
        dirpath: where checkpoints go (``s3://bucket/prefix`` or a local directory); informational, as in NeMo.
        chunk_size_MB: multipart part size (doubled after every 1,000 parts) and ranged-read size, in MiB. 16 by
            default; NeMo's default was 64, which measured slower and holds 4x the memory (benchmarks/README.md).
        max_read_concurrency: parallel ranged GETs per load.
        max_write_concurrency: parallel part uploads per save.
        async_checkpointing: upload in a background thread after snapshotting the tensors to host memory.
        max_saves_in_flight: async only: at most this many saves run at once; a further save waits for the oldest.
        checksum_algorithm: ``"auto"`` (CRC32C with awscrt, else CRC32), ``"CRC32C"``, ``"CRC64NVME"`` or ``"CRC32"``.
        s3_utils: how to reach S3, one object for every class (docs/s3.md#one-settings-object-for-every-class).
        endpoint_url, region_name, client_settings, retry_policy: NeMo's loose arguments, instead of `s3_utils`
            (see `s3_utils.S3ClientSettings`).
        request_options: server-side encryption, storage class, tags, expected bucket owner, requester pays, as an
            `s3_utils.S3RequestOptions` or a mapping of its fields (S3's parameter names, e.g.
            ``{"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "alias/ckpt"}``); checked here, added to every
            request (see `S3RequestOptions`).
        load_sharing: who downloads when every rank loads the same checkpoint together (Lightning's resume through
            the connector, or `collective_load`): ``"node"`` (default) one rank per node, the others map its pages;
            ``"job"`` global rank 0 only, the bytes travel over the process group; ``"rank"`` every rank. A load
            on one rank alone always downloads on that rank. "node" and "job" need s3_node_sharing.py beside this
            module (without it every rank downloads, and a job says so in one warning).
        fencing: one run owns an ``s3://`` checkpoint directory (a checkpoint's parent): the run's first save there
            takes it over, and a save or removal of a run that another (newer) run took it over from raises
            `CheckpointDirectoryTakenError` and changes nothing. One small request (a HEAD) per save and removal.
            False: no owner record, no check (docs/fencing.md).
        max_requests_per_second: a budget of S3 requests per second for the whole job, per prefix (as S3's rates
            are), split across its processes by world size: one number for writes and reads each, or
            ``{"write": 3000, "read": 5000}`` (see `s3_utils.RequestRates`). None (default): no budget; the
            process's request pacer still slows down from the first SlowDown on.
        memory_tier: keep checkpoints first in the node's memory (a tmpfs): a save of an ``s3://`` URL returns once
            the checkpoint is committed there, and a background drain uploads it (every Nth, and the last one at
            `teardown`) from the memory copy; loads read a memory copy that verifies. A path (the tmpfs directory),
            a mapping of `s3_memory_tier.MemoryTier` fields, a `MemoryTier`, or True (``/dev/shm``). Needs
            s3_memory_tier.py beside this module (docs/tiers.md).

    Arguments that would be ignored raise ValueError (`s3_utils.S3Utils.from_arguments` builds the client):
    `endpoint_url` / `region_name` together with `client_settings` (put them in the settings), and any other client
    argument together with `s3_utils` (which has its own settings and retry policy).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        chunk_size_MB: float = _s3.DEFAULT_CHUNK_SIZE_MB,
        max_read_concurrency: int = _s3.DEFAULT_MAX_READ_CONCURRENCY,
        max_write_concurrency: int = _s3.DEFAULT_MAX_WRITE_CONCURRENCY,
        async_checkpointing: bool = False,
        *,
        max_saves_in_flight: int = 1,
        checksum_algorithm: str = "auto",
        endpoint_url: str | None = None,
        region_name: str | None = None,
        client_settings: _s3.S3ClientSettings | None = None,
        retry_policy: _s3.RetryPolicy | None = None,
        s3_utils: _s3.S3Utils | None = None,
        request_options: _s3.S3RequestOptions | Mapping[str, Any] | None = None,
        load_sharing: str = "node",
        fencing: bool = True,
        max_requests_per_second: float | Mapping[str, float] | _s3.RequestRates | None = None,
        memory_tier: Any = None,
    ) -> None:
        lightning_agent = lightning_user_agent()  # before registering, which imports every installed family
        s3 = _s3.S3Utils.from_arguments(  # refuses arguments another would override, and bad options, first
            s3_utils=s3_utils,
            client_settings=client_settings,
            endpoint_url=endpoint_url,
            region_name=region_name,
            retry_policy=retry_policy,
            request_options=request_options,
            max_requests_per_second=max_requests_per_second,
            max_pool_connections=max(max_read_concurrency, max_write_concurrency * max_saves_in_flight),
            user_agent_extra=lightning_agent,
            caller="S3CheckpointIO",
        )
        _torch()
        register_with_lightning(type(self))
        _s3.check_transfer_sizes(
            chunk_size_MB, max_read_concurrency=max_read_concurrency, max_write_concurrency=max_write_concurrency,
            max_saves_in_flight=max_saves_in_flight,
        )  # fmt: skip
        _s3.validate_checksum_algorithm(checksum_algorithm)
        if load_sharing not in LOAD_SHARING_MODES:
            raise ValueError(f"load_sharing must be one of {LOAD_SHARING_MODES}, got {load_sharing!r}")
        self.load_sharing = load_sharing
        self.memory_tier = _memory_tier_config(memory_tier)
        """The `s3_memory_tier.MemoryTier` configuration, or None (no memory tier)."""
        self.fencing = bool(fencing)
        self._run: _fencing.CheckpointRun | None = None  # `run`, fixed at the first fenced operation or pickling
        self._fence_override: _fencing.DirectoryFence | None = None  # set by `using_fence`
        self._collective: _CollectiveLoad | None = None
        self.dirpath = _urls.as_path_or_s3_url(dirpath) if dirpath is not None else None
        self.chunk_size_MB = chunk_size_MB
        self.max_read_concurrency = max_read_concurrency
        self.max_write_concurrency = max_write_concurrency
        self.max_saves_in_flight = max_saves_in_flight
        self.checksum_algorithm = checksum_algorithm
        self._async_checkpointing = async_checkpointing
        self.s3 = s3
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: deque[_PendingSave] = deque()
        self._deferred: list[_DeferredRemoval] = []
        self._errors: list[BaseException] = []
        self.last_save_blocked_s = 0.0
        """How long the last `save_checkpoint` call kept the caller waiting (snapshot plus back-pressure)."""
        self.records: deque[TransferRecord] = deque(maxlen=_RECORDS_KEPT)
        """The latest finished saves and loads, oldest first (at most 1,000; failed transfers leave none)."""
        self._init_tier_state()

    @property
    def async_checkpointing(self) -> bool:
        return self._async_checkpointing

    @property
    def run(self) -> _fencing.CheckpointRun:
        """The run this plugin saves and removes as (`s3_fencing.CheckpointRun`): this process's run (`current_run`)
        when it first needs one, kept from then on and pickled along: a spawned copy of this plugin is the same run."""
        if self._run is None:
            self._run = _fencing.current_run()
        return self._run

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (``ddp_spawn`` and other launchers pickle the Trainer): settings travel, live state does not.

        Raises if background saves are still pending, since they could not follow the copy.
        """
        with self._lock:
            if self._pending or self._deferred:
                raise RuntimeError("cannot pickle S3CheckpointIO while background saves are pending; call teardown()")
        state = self.__dict__.copy()
        for live in ("_lock", "_executor", "_pending", "_deferred", "_errors", "records", "_fence_override", "_tier",
                     "_replication", "_agreement"):
            del state[live]
        state["_run"] = self.run  # a spawned copy of this plugin is the same run
        return state  # `S3Utils` pickles as its settings and retry policy

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._executor = None
        self._pending = deque()
        self._deferred = []
        self._errors = []
        self.records = deque(maxlen=_RECORDS_KEPT)
        self._fence_override = None
        self._init_tier_state()

    # ---- save -----------------------------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save `checkpoint` to `path` (``s3://...`` or local). Async mode returns once the tensors are copied."""
        if storage_options is not None:
            raise TypeError(
                "S3CheckpointIO.save_checkpoint does not take storage_options; configure it in the constructor"
            )
        started = time.perf_counter()
        path = _urls.as_path_or_s3_url(path)
        self._raise_background_errors()
        if self.memory_tier is not None and _urls.is_s3_url(path) and self._save_to_tier(checkpoint, path, started):
            return
        if not self._async_checkpointing:
            record = self._save_now(checkpoint, path)
            self.last_save_blocked_s = time.perf_counter() - started
            self._record(record, self.last_save_blocked_s)
            return
        snapshot = snapshot_to_host(checkpoint)
        with self._lock:
            oldest = self._pending[0] if len(self._pending) >= self.max_saves_in_flight else None
        if oldest is not None:
            oldest.settled.wait()  # its error, if any, is recorded by then and raised below
            self._raise_background_errors()
        self.last_save_blocked_s = time.perf_counter() - started
        self._submit(path, self._save_now, snapshot, path, blocked_s=self.last_save_blocked_s)
        logger.debug("Queued async save of %s (blocked %.3f s)", path, self.last_save_blocked_s)

    def _submit(self, path: str, work: Any, *args: Any, blocked_s: float = 0.0, removals: Iterable[str] = ()) -> None:
        """Run ``work(*args)`` (returning a `TransferRecord`) in the background as a pending save of `path`;
        `removals` wait for it (and are dropped if it fails)."""
        executor = self._get_executor()
        pending = _PendingSave(path, blocked_s=blocked_s)
        with self._lock:
            # A removal of this path deferred earlier would delete this save's object if it ran after it: the new
            # save replaces the object anyway, and if it fails the old one stays, so the removal is dropped.
            superseded = [removal for removal in self._deferred if removal.path == path]
            self._deferred = [removal for removal in self._deferred if removal.path != path]
            self._pending.append(pending)
            _queue(pending)
            for removal in removals:
                deferred = _DeferredRemoval(removal, [pending])
                self._deferred.append(deferred)
                _queue(deferred)
            pending.future = executor.submit(work, *args)
        for removal in superseded:
            _unqueue(removal)
        pending.future.add_done_callback(lambda _, pending=pending: self._on_save_done(pending))

    def _save_now(self, checkpoint: dict[str, Any], path: str) -> TransferRecord:
        """Save and return its record (the caller adds the time it was blocked and keeps it)."""
        torch = _torch()
        started = time.perf_counter()
        checksum, tier = None, None
        if _urls.is_s3_url(path):  # the writer's CRC covers every byte; the checkpoint's own tensors go without a copy
            size, checksum = self._upload(
                path, lambda writer: torch_save_without_zip_crc32(checkpoint, _BorrowingStream(writer, checkpoint))
            )
            tier = "s3"
        else:
            _atomic_local_save(torch, checkpoint, path)
            size = os.path.getsize(path)
        elapsed = time.perf_counter() - started
        logger.info("Saved %s (%.1f MiB) in %.2f s", path, size / _s3.MB, elapsed)
        return TransferRecord("save", path, size, elapsed, checksum, elapsed, tier)

    def _upload(self, path: str, write_body: Any) -> tuple[int, str | None]:
        """Upload the object `path` with ``write_body(writer)`` through this plugin's fenced writer; its size and
        checksum (``"<ALGORITHM> <base64>"``). A failure aborts the upload, naming the URL."""
        fence = self.fence_for(path)
        with self.s3.open_writer(
            path, self.chunk_size_MB, self.max_write_concurrency, self.checksum_algorithm, fence=fence
        ) as writer:
            try:
                write_body(writer)
            except Exception as exc:
                # torch.save turns a failed write into its own RuntimeError without the URL: raise the S3 error
                if writer.error is not None and writer.error is not exc:
                    raise writer.error from None
                raise
        size = writer.info.size if writer.info else 0
        checksum = None
        if writer.info and writer.info.checksums:
            checksum = " ".join(f"{k.removeprefix('Checksum')} {v}" for k, v in writer.info.checksums.items())
        _s3.invalidate_fsspec_cache(path)
        self._remove_conflicting_last_checkpoints(path, fence)
        if fence is not None:
            fence.remove_stale_objects()  # what a stale run committed here since this run took over (docs/fencing.md)
        return size, checksum

    def _record(self, record: TransferRecord, blocked_s: float | None = None) -> None:
        """Keep `record` (with the caller's blocked time, if given)."""
        if blocked_s is not None:
            record = replace(record, blocked_seconds=blocked_s)
        with self._lock:
            self.records.append(record)

    def _remove_conflicting_last_checkpoints(self, path: str, fence: Any = None) -> None:
        """Keep one ``...step=N-...last.ckpt`` per step: once `path` is durable, remove its older siblings.

        NeMo did this *before* uploading, so a failed upload lost both; here it runs only after success.
        """
        if not path.endswith("last.ckpt"):
            return
        prefix = self.s3.parse_prefix_with_step(path)
        if prefix == path:
            return
        for obj in self.s3.list_objects_with_key_prefix(prefix):
            if obj.url != path and obj.key.endswith("last.ckpt"):
                logger.info("Removing %s: superseded by %s for the same step", obj.url, path)
                self.s3.remove_object(obj.url, fence=fence)

    # ---- load -----------------------------------------------------------------------------------------------------

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """Load a checkpoint; `map_location` and `weights_only` mean what they mean to ``torch.load`` (None: torch's
        default, which is the safe ``weights_only=True``). Accepts and ignores Lightning's newer ``state=`` keyword."""
        unexpected = set(kwargs) - {"state"}
        if unexpected:
            raise TypeError(f"load_checkpoint() got unexpected keyword arguments {sorted(unexpected)}")
        path = _urls.as_path_or_s3_url(path)
        self._raise_background_errors()
        tiered = self.memory_tier is not None and _urls.is_s3_url(path)
        if not tiered:  # a tier's committed copy is read as it is: its drain to S3, maybe queued, is not waited for
            self._wait_for_saves_of(path)
            wait_for_pending_save(path)  # a save of this URL by another plugin instance in this process
        torch = _torch()
        load_kwargs: dict[str, Any] = {"map_location": map_location}
        if weights_only is not None:
            load_kwargs["weights_only"] = weights_only
        started = time.perf_counter()
        armed = _take_collective(self)
        if tiered:
            loaded = self._load_from_tier(path, armed, load_kwargs, started)
            if loaded is not None:
                return loaded[0]
            self._wait_for_saves_of(path)  # from S3: after its drain
            wait_for_pending_save(path)
        if not _urls.is_s3_url(path):
            if not os.path.exists(path):
                raise FileNotFoundError(f"Checkpoint file not found: {path}")
            checkpoint = torch.load(path, **load_kwargs)
            elapsed = time.perf_counter() - started
            self._record(TransferRecord("load", path, os.path.getsize(path), elapsed, None, elapsed))
            return checkpoint
        try:
            return self._load_s3(torch, path, armed, load_kwargs, started)
        except (FileNotFoundError, PermissionError) as exc:
            raise _as_lightning_load_error(path, exc) from exc
        except Exception as exc:
            if _pacing.error_code(exc) not in _ACCESS_DENIED_CODES:
                raise
            raise _as_lightning_load_error(path, exc) from exc

    def _load_s3(
        self, torch: Any, path: str, armed: _CollectiveLoad | None, load_kwargs: dict[str, Any], started: float
    ) -> dict[str, Any]:
        shared = None if armed is None else _download_shared(self, path, armed)
        if shared is not None:
            with shared:
                is_zip = os.pread(shared.fd, len(_TORCH_ZIP_MAGIC), 0) == _TORCH_ZIP_MAGIC
                checkpoint = _torch_load_checkpoint(torch, path, shared.path, shared.size, is_zip, load_kwargs)
            elapsed = time.perf_counter() - started
            logger.info(
                "Loaded %s (%.1f MiB, %s, node of %d ranks) in %.2f s",
                path,
                shared.size / _s3.MB,
                shared.source,
                shared.node_ranks,
                elapsed,
            )
            self._record(TransferRecord("load", path, shared.size, elapsed, None, elapsed, "s3"))
            return checkpoint
        with self.s3.download_to_memory(path, self.chunk_size_MB, self.max_read_concurrency) as downloaded:
            downloaded_s = time.perf_counter() - started
            verified = downloaded.verified_against
            checkpoint = _torch_load_checkpoint(
                torch, path, downloaded.path, downloaded.size, _is_torch_zip(downloaded), load_kwargs
            )
        elapsed = time.perf_counter() - started
        logger.info(
            "Loaded %s (%.1f MiB) in %.2f s (download %.2f s)", path, downloaded.size / _s3.MB, elapsed, downloaded_s
        )
        checksum = f"{verified.algorithm} {verified.value}" if verified else None
        self._record(TransferRecord("load", path, downloaded.size, elapsed, checksum, elapsed, "s3"))
        return checkpoint

    def collective_load(self, *, node_rank: int | None = None) -> contextlib.AbstractContextManager[None]:
        """Within this block the next `load_checkpoint` of an ``s3://`` URL (on this thread) is a collective call:
        every rank of the default ``torch.distributed`` process group must make it, with the same URL, and it is
        shared as `load_sharing` says. `node_rank`: this rank's node (default: the launcher's environment, else the
        host). Lightning's resume enters this through `collective_resume`; call it yourself to share other loads."""
        return _collective_load_context(self, node_rank)

    # ---- remove ---------------------------------------------------------------------------------------------------

    def remove_checkpoint(self, path: Any) -> None:
        """Remove a checkpoint. In async mode the removal waits until every save issued before it is durable, and is
        dropped if one of them failed: the newest good checkpoint is never deleted before its successor exists."""
        path = _urls.as_path_or_s3_url(path)
        self._raise_background_errors()
        if self.memory_tier is not None and _urls.is_s3_url(path):
            self._remove_with_tier(path)
            return
        with self._lock:
            waits_for = list(self._pending)  # every save not yet settled, including one that has just failed
            if waits_for:
                removal = _DeferredRemoval(path, waits_for)
                self._deferred.append(removal)
                _queue(removal)
                logger.debug("Deferred removal of %s until %d pending save(s) finish", path, len(waits_for))
                return
        self._remove_now(path)

    def fence_for(self, path: str) -> _fencing.DirectoryFence | None:
        """The fence this plugin's saves and removals at `path` check: this run's `s3_fencing.DirectoryFence` on the
        directory holding `path`, or the one a `using_fence` block set (None: fencing off)."""
        if self._fence_override is not None:
            return self._fence_override
        if not self.fencing:
            return None
        return _fencing.DirectoryFence(self.s3, _urls.s3_url_parent(path), self.run)

    @contextlib.contextmanager
    def using_fence(self, fence: _fencing.DirectoryFence | None) -> Iterator[None]:
        """Within the block, every save and removal of this plugin checks `fence` (e.g. a `DirectoryFence.once()`,
        checked once for several requests) instead of its own per-path fence. None changes nothing.

        s3_dcp's sharded strategies use it so that ``meta.pt`` and the removals before it cost one ownership check.
        Not for concurrent use: the fence applies to the whole plugin until the block ends.
        """
        previous, self._fence_override = self._fence_override, fence
        try:
            yield
        finally:
            self._fence_override = previous

    def _remove_now(self, path: str) -> None:
        if self._tier is not None and _urls.is_s3_url(path):
            self._tier.remove(path)
        if _urls.is_s3_url(path):
            self.s3.remove_object(path, fence=self.fence_for(path))
            _s3.invalidate_fsspec_cache(path)
        elif os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
        logger.debug("Removed checkpoint %s", path)

    # ---- memory tier (s3_memory_tier) ------------------------------------------------------------------------------

    def _init_tier_state(self) -> None:
        self._tier: Any = None  # the `s3_memory_tier.NodeTier`, opened on first use
        self._tier_saves = 0
        self._last_drain = -math.inf
        self._held_removals: list[str] = []  # S3 removals waiting for a newer checkpoint to be on S3
        self._replication: Any = None  # the `s3_memory_tier.TierReplication`, once `start_replication` ran
        self._agreement: Any = None  # the `s3_memory_tier.TierAgreement` of the last `agree_resume`
        if self.memory_tier is not None:
            _tiered_plugins.add(self)

    def node_tier(self) -> Any:
        """This node's `s3_memory_tier.NodeTier` for this job, opened on first use (this run claims it: a straggler
        of an older launch is refused). On global rank 0, drains a kill cut short are resumed then."""
        if self.memory_tier is None:
            raise ValueError("this S3CheckpointIO has no memory tier (memory_tier=None)")
        if self._tier is None:
            module = _memory_tier_module()
            assert module is not None  # checked when memory_tier was given
            tier = module.NodeTier(self.memory_tier, self.run, self.checksum_algorithm)
            tier.claim()
            self._tier = tier
            if _process.global_rank() == 0:
                for copy in tier.removed_while_draining():
                    tier.remove(copy.url, copy)
                for copy in reversed(tier.pending_drains()):  # newest first: the newest checkpoint is durable soonest
                    logger.warning("memory tier: finishing the drain of %s to S3 a previous process began", copy.url)
                    self._submit(copy.url, self._drain_now, copy)
        return self._tier

    def holds_in_memory(self, path: Any) -> bool:
        """Whether this node's memory tier holds a committed copy of the s3:// `path`: a checkpoint that exists
        although S3 may never have had it (its drain not due), so ModelCheckpoint's "does this name exist?"
        (connector) does not hand its name out again. False without a memory tier, or one that cannot be read (said
        loudly: S3 answers alone)."""
        if self.memory_tier is None or not _urls.is_s3_url(path):
            return False
        url = _urls.normalize_s3_url(path)
        try:
            return self.node_tier().copy_of(url) is not None
        except (OSError, ValueError) as exc:
            logger.warning("Not looking for %s in the memory tier %s: %s", url, self.memory_tier.root, exc)
            return False

    def _save_to_tier(self, checkpoint: dict[str, Any], path: str, started: float) -> bool:
        """Save into the memory tier and queue its drain when due; False when the tier has no room (one warning:
        the caller saves to S3 directly)."""
        tier = self.node_tier()
        module = _memory_tier_module()
        step = checkpoint.get("global_step") if isinstance(checkpoint, dict) else None
        try:
            copy = tier.save(checkpoint, path, step, torch_save_without_zip_crc32)
        except module.TierFullError as exc:
            tier.warn_full_once(path, exc)
            self._wait_for_saves_of(path)  # a drain of the older copy still reads it
            tier.remove(path)  # this save goes to S3: no older copy of its URL may stay in memory for a load to read
            return False
        self.last_save_blocked_s = time.perf_counter() - started
        self._record(TransferRecord("save", path, copy.size, self.last_save_blocked_s, copy.checksum,
                                    self.last_save_blocked_s, "memory"))
        with self._lock:  # saved again: an earlier removal of this URL no longer applies
            self._held_removals = [removal for removal in self._held_removals if removal != path]
        self._tier_saves += 1
        tier.unpin()  # a resume's copies stayed until this newer checkpoint was in memory
        config = self.memory_tier
        timer = config.drain_minutes is not None and time.monotonic() - self._last_drain >= config.drain_minutes * 60
        with self._lock:  # a drain of an older save of this URL waits or runs: this copy replaces what it uploads
            draining = any(pending.path == path for pending in self._pending)
        if (self._tier_saves - 1) % config.drain_every == 0 or timer or draining:  # queued, never waited for: S3
            self._drain(copy)  # slower than the saves fills the tier until a save finds no room and goes to S3 itself
        if self._replication is not None and self._replication.peer is not None:
            self._replication.send(copy)  # prunes the tier again once the copy counts on the peer
        tier.prune_soon()  # at most `keep` copies, also while the peer lags or does not answer (bounded memory)
        return True

    def start_replication(self, group: Any = None, *, bind_host: str | None = None, local_rank: int = 0) -> None:
        """Replicate this node's memory tier to the next node (a ring over the job's nodes): collective, every rank
        of `group` (default: the default process group) calls it once; the node's first rank (`local_rank` 0)
        serves its peers' replicas on `bind_host`, the node's address on the job's network (default:
        ``S3CKPT_REPLICA_HOST``, else this host's address on its route to ``MASTER_ADDR``). Every save into the
        tier is then sent in the background, verified on arrival; needs s3_tier_replication.py beside this module.
        """
        module = _memory_tier_module()
        self._replication = module.TierReplication(self.node_tier(), group, bind_host=bind_host, local_rank=local_rank)

    def _drain(self, copy: Any) -> None:
        """Queue the upload of a memory copy to S3; the S3 removals held so far wait for it."""
        copy = self._tier.set_drain(copy, "pending")
        self._last_drain = time.monotonic()
        with self._lock:
            removals, self._held_removals = self._held_removals, []
        self._submit(copy.url, self._drain_now, copy, removals=removals)

    def _drain_now(self, copy: Any) -> TransferRecord:
        """Upload a memory copy to S3 from its pages (checked against its commit record first); mark it drained. A
        URL saved again since this drain was queued uploads its newest copy (the one its record vouches for); that
        save queued a drain of its own too, and the copy stays pending (kept in memory) until the last one ran."""
        started = time.perf_counter()
        copy = self._tier.copy_of(copy.url) or copy
        size, checksum = self._upload(copy.url, lambda writer: self._tier.upload(copy, writer))
        with self._lock:
            waiting = sum(pending.path == copy.url for pending in self._pending) > 1  # this drain is one of them
        if not waiting:
            self._tier.set_drain(copy, "done")
        self._tier.prune()
        elapsed = time.perf_counter() - started
        logger.info("Drained %s (%.1f MiB) from the memory tier to S3 in %.2f s", copy.url, size / _s3.MB, elapsed)
        return TransferRecord("save", copy.url, size, elapsed, checksum, 0.0, "s3")

    def _drain_newest(self) -> None:
        """At teardown of a process that saved into the tier: drain the newest memory copy if it never was (the last
        checkpoint of the run; the node's other ranks, which share the tier, leave it to the saver)."""
        copies = self._tier.copies() if self._tier_saves else []
        if copies and copies[-1].drain is None:
            self._drain(copies[-1])

    def _remove_held(self) -> None:
        """At teardown, after the drains: the held S3 removals run if the newest memory copy is on S3."""
        with self._lock:
            removals, self._held_removals = self._held_removals, []
        copies = self._tier.copies()
        if removals and not (copies and copies[-1].drain == "done"):
            logger.warning("Not removing %s from S3: no newer checkpoint reached S3", removals)
            return
        for removal in removals:
            self._remove_now(removal)

    def _remove_with_tier(self, path: str) -> None:
        """A removal with a memory tier: the memory copy goes now (after its drain, if one is running); the S3 object
        only once a newer checkpoint is on S3 (the next drain), so S3 never loses its newest durable checkpoint."""
        with self._lock:
            draining = any(pending.path == path for pending in self._pending)
            self._held_removals.append(path)
        if not draining:
            self.node_tier().remove(path)
        elif (copy := self.node_tier().copy_of(path)) is not None and copy.drain == "pending":
            self._tier.mark_removed(copy)  # killed before the drain ends: the relaunch drops it, uploads nothing

    def _load_from_tier(
        self, path: str, armed: _CollectiveLoad | None, load_kwargs: dict[str, Any], started: float
    ) -> tuple[Any] | None:
        """Load `path` from the memory copy if it verifies (a copy that does not is skipped, loudly); None: load from
        S3. In a collective load every rank uses memory only if every rank has a verified copy (else all go to S3
        together, as the shared download needs)."""
        copy, tier = None, "memory"
        try:  # the tier the ranks agreed on for `path` (`agree_resume`), else this node's memory copy
            copy, tier = _memory_tier_module().copy_to_load(self.node_tier(), self._agreement, path)
        except (OSError, _s3.ChecksumMismatchError) as exc:
            logger.error("%s: skipped, loading %s from S3 instead", exc, path)
        if armed is not None and not all(_all_ranks(copy is not None)):
            return None
        if copy is None:
            return None
        checkpoint = _torch_load_checkpoint(_torch(), path, str(copy.path), copy.size, True, load_kwargs)
        elapsed = time.perf_counter() - started
        logger.info("Loaded %s (%.1f MiB) from the %s tier in %.2f s", path, copy.size / _s3.MB, tier, elapsed)
        self._record(TransferRecord("load", path, copy.size, elapsed, copy.checksum, elapsed, tier))
        return (checkpoint,)

    def agree_resume(
        self, directory: str, step_of: Callable[[str], int | None] | None = None, *, list_s3: bool = True
    ) -> Any:
        """Collective: every rank agrees on the newest step it can load from some tier of the s3:// `directory` of
        its part (`s3_memory_tier.agree_on_resume`; `step_of(name)`: an S3 object's step; `list_s3` False where
        another rank lists the same directory). Loads and resume discovery follow the returned agreement."""
        module = _memory_tier_module()
        listing = (lambda: self.s3.list_objects(directory)) if list_s3 else list
        self._agreement = module.agree_on_resume(self.node_tier(), self._replication, directory, listing, step_of)
        return self._agreement

    # ---- background bookkeeping -----------------------------------------------------------------------------------

    def _get_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:  # created lazily: teardown shuts it down and fit() may run again
                self._executor = ThreadPoolExecutor(self.max_saves_in_flight, thread_name_prefix="s3ckpt-save")
            return self._executor

    def _on_save_done(self, pending: _PendingSave) -> None:
        """Record a finished save, then run the removals that were waiting for it (or drop them if it failed)."""
        try:
            assert pending.future is not None
            exc = pending.future.exception() if not pending.future.cancelled() else CancelledError()
            if exc is None:
                self._record(pending.future.result(), pending.blocked_s)
            with self._lock:
                self._pending.remove(pending)
                if exc is not None:
                    pending.error = exc
                    exc.add_note(f"raised by the background save of {pending.path}")
                    logger.error("Background save of %s failed: %r", pending.path, exc)
                    self._errors.append(exc)
                ready = [d for d in self._deferred if not any(p in self._pending for p in d.waits_for)]
                self._deferred = [d for d in self._deferred if d not in ready]
            for removal in ready:
                try:
                    if any(p.failed for p in removal.waits_for):
                        logger.warning("Not removing %s: a save issued before its removal failed", removal.path)
                        continue
                    self._remove_now(removal.path)
                except Exception as error:
                    error.add_note(f"raised by the deferred removal of {removal.path}")
                    with self._lock:
                        self._errors.append(error)
                finally:
                    _unqueue(removal)
        finally:
            _unqueue(pending)
            pending.settled.set()

    def _raise_background_errors(self) -> None:
        with self._lock:
            if not self._errors:
                return
            first, *others = self._errors
            self._errors = []
        for other in others:
            logger.error("Another background checkpoint operation also failed: %r", other)
        raise first

    def _wait_for_saves_of(self, path: str | None) -> None:
        """Block until the background saves of `path` (all of them for None) and the removals waiting on them have
        finished; raise the first background failure."""
        with self._lock:
            saves = [pending for pending in self._pending if path is None or pending.path == path]
        for pending in saves:
            pending.settled.wait()
        self._raise_background_errors()

    def wait_for_pending_saves(self) -> None:
        """Block until every background save (and the removals waiting on them) finished, and every replication to
        a peer node (failed ones are logged: the next save replicates again); raise the first failure of a save."""
        self._wait_for_saves_of(None)
        if self._replication is not None:
            self._replication.wait()
        if self._tier is not None:
            self._tier.wait_pruned()

    def teardown(self) -> None:
        """Wait for all background saves, shut the worker down, and raise if any save or removal failed. With a
        memory tier, the newest checkpoint in memory is drained to S3 first (the last of a run that ends normally)."""
        try:
            if self._tier is not None:
                self._drain_newest()
            self.wait_for_pending_saves()
            if self._tier is not None:
                self._remove_held()
            if self._replication is not None:
                replication, self._replication = self._replication, None
                replication.close()
        finally:
            with self._lock:
                executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)


# --------------------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------------------


_tiered_plugins: weakref.WeakSet[S3CheckpointIO] = weakref.WeakSet()


def _memory_tier_config(value: Any) -> Any:
    """The `s3_memory_tier.MemoryTier` a ``memory_tier=`` argument means (None: off); ImportError without the module."""
    if value is None or value is False:
        return None
    module = _process.require_sibling(MEMORY_TIER_MODULE, __package__, "memory_tier", "s3_checkpoint_io.py",
                                      otherwise=", or leave memory_tier unset")  # fmt: skip
    return module.MemoryTier.from_value(value)


def memory_tier_entries(directory: str) -> list[tuple[str, float]]:
    """``(path relative to the s3:// `directory`, commit time)`` of the checkpoints below it in the memory tiers of
    this process's `S3CheckpointIO` plugins: resume discovery (connector) adds them to the S3 listing's entries.
    Package-internal (docs/api.md)."""
    entries: list[tuple[str, float]] = []
    for plugin in list(_tiered_plugins):
        try:  # after `agree_resume`: what every rank can load, as all agreed
            entries.extend(plugin.node_tier().entries_under(directory, plugin._agreement))
        except (OSError, ValueError) as exc:  # a tier that cannot be read: resume from S3 alone, said loudly
            logger.warning("Resume discovery leaves out the memory tier %s: %s", plugin.memory_tier.root, exc)
    return entries


def _all_ranks(value: Any) -> list[Any]:
    """`value` of every rank of the default process group, in rank order (only this one's outside a group)."""
    dist = _torch().distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


class _PyBufferAPI(NamedTuple):
    """CPython's buffer protocol through ctypes: ``get(obj, byref(view), flags)`` and ``release(byref(view))``."""

    view: type  # a ctypes Structure with Py_buffer's layout
    get: Any
    release: Any


@functools.cache
def _py_buffer_api() -> _PyBufferAPI | None:
    """``PyObject_GetBuffer`` / ``PyBuffer_Release`` through ctypes (read-only buffers too), or None off CPython."""
    try:
        import ctypes

        get_buffer, release = ctypes.pythonapi.PyObject_GetBuffer, ctypes.pythonapi.PyBuffer_Release
    except (ImportError, AttributeError, OSError):  # no _ctypes, or not CPython
        return None

    class PyBuffer(ctypes.Structure):
        _fields_ = [
            *(("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t)),
            *(("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int)),
            *(("format", ctypes.c_void_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p)),
            *(("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)),
        ]

    get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(PyBuffer), ctypes.c_int]
    get_buffer.restype = ctypes.c_int
    release.argtypes = [ctypes.POINTER(PyBuffer)]
    release.restype = None
    return _PyBufferAPI(PyBuffer, get_buffer, release)


def buffer_address(data: Any) -> int | None:
    """The address of the first byte of the contiguous buffer `data` (read-only too), or None where it cannot be had."""
    api = _py_buffer_api()
    if api is None:
        return None
    import ctypes

    view = api.view()
    try:  # ctypes raises the exporter's error (BufferError) for a failed call through pythonapi
        api.get(data, ctypes.byref(view), 0)  # PyBUF_SIMPLE: one contiguous block of bytes
    except (BufferError, TypeError):
        return None
    try:
        return int(view.buf or 0)
    finally:
        api.release(ctypes.byref(view))


class _BorrowingStream(io.RawIOBase):
    """The stream ``torch.save`` writes a checkpoint into, in front of an `S3MultipartWriter`: a write that carries
    one of the checkpoint's own CPU tensor storages, whole (``torch.save`` hands each storage's memory to ``write``
    as it is), goes through `S3MultipartWriter.write_borrowed`, so its whole parts are uploaded without a copy into
    part buffers (the fast path ``borrowed_parts``); any other write (pickle records, copies torch makes of GPU
    tensors) is copied as usual.

    Safe because `_save_now` returns only once the upload is complete or aborted: a synchronous save holds its
    caller until then, and an async save writes its private snapshot."""

    _min_borrowed = 1 << 20  # smaller writes are copied: no whole part can come of them, and asking costs a ctypes call

    def __init__(self, writer: _s3.S3MultipartWriter, checkpoint: Any) -> None:
        super().__init__()
        self._writer = writer
        self._storages = _cpu_storages(checkpoint)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        nbytes = memoryview(data).nbytes
        if nbytes >= self._min_borrowed:
            storage = self._storages.get(buffer_address(data) or 0)
            if storage is not None and storage.nbytes() == nbytes:
                return self._writer.write_borrowed(data, storage)
        return self._writer.write(data)

    def flush(self) -> None:  # the writer uploads full parts by itself
        pass


def _cpu_storages(obj: Any) -> dict[int, Any]:
    """The untyped storages of the CPU tensors in a checkpoint's containers (dicts, lists, tuples), by address."""
    torch = _torch()
    found: dict[int, Any] = {}
    pending = [obj]
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            if value.device.type == "cpu" and value.layout == torch.strided:
                try:
                    storage = value.untyped_storage()
                except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage: copied as usual
                    continue
                if storage.data_ptr():
                    found[storage.data_ptr()] = storage
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return found


def snapshot_to_host(obj: Any) -> Any:
    """A copy of a checkpoint whose tensors are fresh host-memory copies and whose containers are new, so training
    may mutate the originals while the copy is uploaded (no mixed-step checkpoints)."""
    torch = _torch()

    def copy_of(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", copy=True)
        if isinstance(value, dict):
            result = copy.copy(value)  # keeps the dict type (OrderedDict, defaultdict...)
            for key, item in value.items():
                result[key] = copy_of(item)
            return result
        if isinstance(value, list):
            return [copy_of(item) for item in value]
        if isinstance(value, tuple):
            items = [copy_of(item) for item in value]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        return value

    return copy_of(obj)


_TORCH_SAVE_PARAMETERS = ("obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record")
"""``torch.serialization._save``'s parameters, the ones `torch_save_without_zip_crc32` passes (torch 2.4 to 2.13)."""


@functools.cache
def zip_writer_without_crc32() -> bool:
    """Whether this torch has the private pieces `torch_save_without_zip_crc32` builds on, as it expects them (else
    that function is plain ``torch.save``, and s3_dcp does not reuse archive framing, which assumes no CRCs).
    Package-internal (docs/api.md)."""
    torch = _torch()
    serialization = torch.serialization
    try:
        parameters = tuple(inspect.signature(serialization._save).parameters)
        torch._C.PyTorchFileWriter(io.BytesIO(), False, serialization._get_storage_alignment())
    except (AttributeError, TypeError, ValueError):
        return False
    return parameters == _TORCH_SAVE_PARAMETERS


def torch_save_without_zip_crc32(obj: Any, stream: Any) -> None:
    """``torch.save(obj, stream)`` into a torch zip archive whose records carry no CRC32, for streams this package
    checksums itself (the S3 writer's full-object CRC, s3_dcp's per-item CRC).

    torch computes a CRC32 over every byte it saves, about a quarter of a save's client CPU, and nothing in torch
    checks it on load. ``torch.serialization.set_crc32_options(False)`` would skip it, but it sets a process-wide flag
    that every other thread's ``torch.save`` reads at that moment. This builds torch's own archive writer with
    ``compute_crc32=False`` instead (the constructor and ``torch.serialization._save`` that ``torch.save`` itself
    uses), so only this archive is affected. The archive is otherwise the same: ``torch.load`` (``mmap`` and
    ``weights_only`` included) and DCP's ``FileSystemReader`` read it as usual; zip tools that check record CRCs
    (``unzip -t``, Python's ``zipfile`` reading a record) report them as wrong. Where this torch's private pieces
    differ (tests/test_private_surface.py pins them), it is plain ``torch.save``.
    """
    torch = _torch()
    if not zip_writer_without_crc32():
        torch.save(obj, stream)
        return
    serialization = torch.serialization
    archive = torch._C.PyTorchFileWriter(stream, False, serialization._get_storage_alignment())
    try:
        serialization._save(obj, archive, pickle, serialization.DEFAULT_PROTOCOL, False)
    except BaseException:
        # Finalise the archive now, as torch.save does on the way out: its destructor would otherwise write the end
        # of the archive later, into a stream that may be closed by then, and a C++ error there aborts the process.
        with contextlib.suppress(Exception):
            archive.write_end_of_file()
        raise
    archive.write_end_of_file()
    stream.flush()


def _atomic_local_save(torch: Any, checkpoint: dict[str, Any], path: str) -> None:
    """``torch.save`` to a temporary file beside `path`, then rename: readers never see a half-written file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".ckpt")
    try:
        with os.fdopen(fd, "wb") as stream:
            torch.save(checkpoint, stream)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise


_ACCESS_DENIED_CODES = frozenset({"AccessDenied", "403", "Forbidden"})


def _as_lightning_load_error(url: str, exc: BaseException) -> OSError:
    """The error Lightning's ``TorchCheckpointIO`` gives for a checkpoint that is missing (``FileNotFoundError:
    Checkpoint file not found: <path>``) or that may not be read (``PermissionError``, as ``open`` raises), with
    what S3 said (the URL, the operation, its status and request id) kept as notes."""
    if isinstance(exc, FileNotFoundError) or _pacing.error_code(exc) not in _ACCESS_DENIED_CODES | {"PermissionError"}:
        error: OSError = FileNotFoundError(f"Checkpoint file not found: {url}")
    else:
        error = PermissionError(errno.EACCES, "Permission denied (S3 refused to read the checkpoint)", url)
    notes = getattr(exc, "__notes__", [])
    ids = "" if any(url in note for note in notes) else _s3.response_ids(exc.__cause__ or exc)  # else noted already
    error.add_note(f"S3: {exc}{ids}")
    for note in notes:
        error.add_note(note)
    return error


_TORCH_ZIP_MAGIC = b"PK\x03\x04"
"""The first bytes of torch's zip checkpoint format (torch.serialization's ``_is_zipfile`` checks the same)."""
_WEIGHTS_ONLY_REFUSAL = "weights only load failed"
"""Lower-cased start of torch's message when ``weights_only=True`` refuses a checkpoint (its case varies)."""


def _is_torch_zip(downloaded: _s3.DownloadedObject) -> bool:
    with downloaded.view() as view:
        return bytes(view[: len(_TORCH_ZIP_MAGIC)]) == _TORCH_ZIP_MAGIC


def _torch_load_checkpoint(
    torch: Any, url: str, file_path: str, size: int, is_zip: bool, load_kwargs: dict[str, Any]
) -> Any:
    """``torch.load`` the downloaded checkpoint of `url`, mapping its pages where the format allows (torch maps only
    its zip format; the legacy format is read without mmap). Anything that is not a checkpoint raises
    `NotACheckpointError` naming `url`; a real checkpoint that ``weights_only=True`` refuses keeps torch's error."""
    try:
        return torch.load(file_path, mmap=is_zip, **load_kwargs)
    except Exception as exc:
        if isinstance(exc, pickle.UnpicklingError) and _WEIGHTS_ONLY_REFUSAL in str(exc).lower():
            exc.add_note(f"while loading {url}")
            raise
        raise NotACheckpointError(
            f"{url} ({size} bytes{', empty' if not size else ''}) is not a loadable torch checkpoint: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


# --------------------------------------------------------------------------------------------------------------------
# Resume never sticks: a checkpoint that does not verify or load is skipped (never deleted) for the next newest
# --------------------------------------------------------------------------------------------------------------------
# Else a broken newest checkpoint fails every relaunch until deleted by hand. Every rank tries the same one; all move
# on when any found it unusable (one all-gather per try). Other failures (network, fencing) are raised.


def is_unusable_checkpoint_error(exc: BaseException) -> bool:
    """Whether `exc`, raised loading a checkpoint, says the checkpoint itself is unusable: a checksum mismatch, a
    missing object or shard, a file or ``.metadata`` that does not unpickle or read, also inside DCP's
    ``CheckpointException``; not a ``weights_only`` refusal (a setting) nor a fenced-off run."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, CheckpointDirectoryTakenError):
            return False
        if isinstance(current, (_s3.ChecksumMismatchError, FileNotFoundError, EOFError)):
            return True
        if isinstance(current, pickle.UnpicklingError) and "weights_only" not in str(current).lower():
            return True
        if isinstance(current, AssertionError) and "metadata read failed" in str(current):
            return True  # dcp.load's planning step reports a .metadata that does not read as this text only
        for failure in (getattr(current, "failures", None) or {}).values():  # DCP's CheckpointException
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                pending.append(inner)
        if current.__cause__ is not None:
            pending.append(current.__cause__)
    return False


class ResumeFailedError(RuntimeError):
    """Another rank could not load the checkpoint every rank was resuming from; the message names it and the cause."""


def _describe_failure(exc: BaseException) -> str:
    """One line: the exception (for DCP's CheckpointException, each rank's failure inside it, without tracebacks)."""
    failures = getattr(exc, "failures", None) or {}
    if failures:
        inner = {rank: f[0] if isinstance(f, tuple) else f for rank, f in failures.items()}
        return "; ".join(f"rank {rank}: {_describe_failure(e)}" for rank, e in inner.items())[:2000]
    return "".join(traceback.format_exception_only(exc)).strip().replace("\n", "; ")[:2000]


def _gather_outcomes(outcome: tuple[str, str] | None) -> list[tuple[str, str] | None]:
    """Every rank's outcome of one try, in rank order (only this one outside a process group)."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return [outcome]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outcome)
    return gathered


def load_newest_usable(urls: Iterable[str], load: Any, *, fallback: bool = True) -> tuple[str, Any]:
    """``(url, load(url))`` for the first of `urls` (newest first) that loads on every rank, each one skipped logged
    and left in place. Collective: every rank passes the same `urls` and all move on when some rank found the
    checkpoint unusable (`is_unusable_checkpoint_error`); other failures are raised (`ResumeFailedError` on ranks
    whose load succeeded). `fallback=False`: the first URL only. None left: the last failure, noting those skipped."""
    urls = list(urls)
    if not urls:
        raise ValueError("load_newest_usable needs at least one checkpoint URL")
    if not fallback:
        urls = urls[:1]
    skipped: list[str] = []
    for index, url in enumerate(urls):
        result, error, outcome = None, None, None
        try:
            result = load(url)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            error = exc
            outcome = ("unusable" if is_unusable_checkpoint_error(exc) else "error", _describe_failure(exc))
        outcomes = _gather_outcomes(outcome)
        if all(o is None for o in outcomes):
            if skipped:
                logger.warning("Resumed from %s after skipping %d newer checkpoint(s): %s", url, len(skipped), skipped)
            return url, result
        failures = [(rank, o) for rank, o in enumerate(outcomes) if o is not None]
        unusable = [(rank, o) for rank, o in failures if o[0] == "unusable"]
        rank, (kind, reason) = (unusable or failures)[0]
        if kind == "unusable" and index + 1 < len(urls):
            logger.warning(
                "Not resuming from %s: it does not verify or load on rank %d (%s). It is left in place (not deleted); "
                "falling back to the next newest checkpoint, %s",
                url,
                rank,
                reason,
                urls[index + 1],
            )
            skipped.append(url)
            continue
        if error is None:
            error = ResumeFailedError(f"Global rank {rank} could not load {url}: {reason}")
        if skipped:
            error.add_note(f"resume skipped these newer checkpoints, which do not verify or load: {skipped}")
        if kind == "unusable" and not fallback:
            error.add_note("resume_fallback is off (strict): older checkpoints were not tried")
        raise error
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------------------------------------
# Collective loads: the hook of load sharing (s3_node_sharing)
# --------------------------------------------------------------------------------------------------------------------
#
# Lightning's resume_start loads the checkpoint on every rank: N ranks, N downloads of one object. Inside
# `S3CheckpointIO.collective_load` (the connector's resume enters it through `collective_resume`) a load of an s3://
# URL is a collective call, which `s3_node_sharing.download_shared` turns into one download per node
# (``load_sharing="node"``) or per job (``"job"``) that the node's ranks map (its block comment describes the
# protocol). Without s3_node_sharing, or with ``"rank"``, every rank downloads its own copy.

LOAD_SHARING_MODES = ("node", "job", "rank")
"""`S3CheckpointIO(load_sharing=...)`: who downloads on a collective load (see `s3_node_sharing.download_shared`)."""


SharedLoadError = _s3.SharedLoadError
"""`s3_utils.SharedLoadError`, under the name the plugin's users know: a shared load failed on the rank that
downloads for this one."""


@dataclass(frozen=True)
class _CollectiveLoad:
    """An armed collective load: the next `load_checkpoint` of an s3:// URL on `thread` is a collective call."""

    thread: int
    node_rank: int | None


def _collective_load_context(io: S3CheckpointIO, node_rank: int | None) -> contextlib.AbstractContextManager[None]:
    @contextlib.contextmanager
    def armed() -> Any:
        previous = io._collective
        io._collective = _CollectiveLoad(threading.get_ident(), node_rank)
        try:
            yield
        finally:
            io._collective = previous

    return armed()


def _take_collective(io: S3CheckpointIO) -> _CollectiveLoad | None:
    """The armed collective load for this thread, disarmed (one load per arming), or None."""
    armed = getattr(io, "_collective", None)
    if armed is None or armed.thread != threading.get_ident():
        return None
    io._collective = None
    return armed


def s3_checkpoint_io_of(strategy: Any) -> S3CheckpointIO | None:
    """The strategy's `S3CheckpointIO` (also inside Lightning's AsyncCheckpointIO and other wrappers), or None."""
    plugin = getattr(strategy, "_checkpoint_io", None)  # not the property: it would create a default plugin
    for _ in range(3):  # also inside Lightning's AsyncCheckpointIO and other wrappers
        if isinstance(plugin, S3CheckpointIO):
            return plugin
        plugin = getattr(plugin, "checkpoint_io", None)
    return None


@contextlib.contextmanager
def collective_resume(trainer: Any) -> Any:
    """Make the trainer's restore (``resume_start``, which every rank runs) share one download per node or job.

    Applies when the trainer's plugin is an `S3CheckpointIO`, the job has more than one rank and the strategy loads
    through Lightning's own ``Strategy.load_checkpoint`` (DDP and its relatives: every rank calls it with the same
    path); strategies with their own loading (FSDP, DeepSpeed, ModelParallel) keep theirs. The node of each rank is
    the strategy's ``node_rank`` (Lightning's cluster environment: torchrun, SLURM, ...). The connector's
    ``resume_start`` runs inside this.
    Package-internal (docs/api.md).
    """
    strategy = getattr(trainer, "strategy", None)
    plugin = s3_checkpoint_io_of(strategy)
    load = getattr(type(strategy), "load_checkpoint", None)
    loads_on_every_rank = getattr(load, "__qualname__", "") == "Strategy.load_checkpoint"
    if plugin is None or not loads_on_every_rank or getattr(trainer, "world_size", 1) <= 1:
        yield
        return
    with plugin.collective_load(node_rank=getattr(strategy, "node_rank", None)):
        yield


def _download_shared(io: S3CheckpointIO, url: str, armed: _CollectiveLoad) -> Any:
    """The checkpoint's bytes in a file its node's ranks share (`s3_node_sharing.SharedCheckpointFile`), or None
    where this rank downloads its own: ``load_sharing="rank"``, a single process, or no s3_node_sharing."""
    if io.load_sharing == "rank":
        return None
    dist = _torch().distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    sharing = _process.node_sharing()
    return None if sharing is None else sharing.download_shared(io, url, armed.node_rank)
