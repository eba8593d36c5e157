"""`S3CheckpointIO`: a Lightning checkpoint plugin that streams ``torch.save`` to S3 and loads it back in parallel.

It has the name, arguments and defaults of NeMo's ``nemo.utils.callbacks.s3_checkpoint_io.S3CheckpointIO``. The
module holds the torch side of checkpointing; everything that talks to S3 is in `s3_utils`, fencing in `s3_fencing`:

* saving: ``torch.save`` writes into an `s3_utils.S3MultipartWriter` (a multipart upload that commits only when
  complete); local paths are saved atomically beside their target, as Lightning's ``TorchCheckpointIO`` would;
* loading: the object is downloaded and verified into an in-memory file that ``torch.load(mmap=True)`` maps, so the
  tensors use the downloaded pages; bytes that are not a torch checkpoint raise `NotACheckpointError`;
* async saves: tensors are snapshotted to host memory (`snapshot_to_host`), uploaded in the background, and a
  removal waits until every save issued before it is durable; background failures are raised at the next call;
* fencing: saves and removals in an ``s3://`` directory go through an `s3_fencing.DirectoryFence`, so a stale run
  (an older job still writing where a newer one took over) gets `CheckpointDirectoryTakenError` and changes nothing;
* collective loads (`collective_resume`, `S3CheckpointIO.collective_load`): every rank loading one checkpoint
  shares one download per node or job, through the optional sibling `s3_node_sharing` (without it: one per rank);
* `register_with_lightning`: the class is a ``CheckpointIO`` of every installed Lightning family (``lightning`` and
  ``pytorch_lightning``), so both Trainers accept it; torch and Lightning are imported on first use.

docs/lightning.md lists the guarantees; docs/nemo.md what NeMo's version got wrong.
"""

from __future__ import annotations

import contextlib
import copy
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
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

if __package__:
    from . import s3_dirpath_utils as _urls
    from . import s3_fencing as _fencing
    from . import s3_utils as _s3
else:  # installed (or copied) as top-level modules
    import s3_dirpath_utils as _urls
    import s3_fencing as _fencing
    import s3_utils as _s3

__all__ = [
    "LOAD_SHARING_MODES",
    "CheckpointDirectoryTakenError",
    "NotACheckpointError",
    "S3CheckpointIO",
    "SharedLoadError",
    "TransferRecord",
    "buffer_address",
    "collective_resume",
    "lightning_user_agent",
    "register_with_lightning",
    "s3_checkpoint_io_of",
    "snapshot_to_host",
    "torch_save_without_zip_crc32",
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
    return _s3.import_optional_dependency("torch", "checkpoint serialisation")


def register_with_lightning(cls: type) -> list[str]:
    """Register `cls` as a virtual subclass of ``CheckpointIO`` in every installed Lightning family.

    ``lightning.pytorch`` and ``pytorch_lightning`` each have their own ``CheckpointIO`` class and each Trainer rejects
    the other's plugins; registering with both ABCs lets one plugin class serve either Trainer. Returns the modules
    registered with; raises MissingOptionalDependencyError if neither family is installed.
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
        _s3.import_optional_dependency("lightning", "the Lightning CheckpointIO plugin")
    return found


def lightning_user_agent() -> str | None:
    """``(lightning; 2.6.6)`` for each Lightning family the program has imported, as s3torchconnector reports it in
    its User-Agent; None without Lightning. Clients built for Lightning (this plugin, s3_dcp's strategies) add it."""
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

    `seconds` is the whole transfer (serialise and upload, or download, verify and ``torch.load``); `blocked_seconds`
    is how long the caller waited for it: the same for loads and sync saves, the snapshot and back-pressure for async
    saves. `checksum` is the full-object checksum of an S3 object as ``"<ALGORITHM> <base64>"`` (e.g.
    ``"CRC32C 3Jz0Jg=="``): the one a save recorded, the one a load was verified against
    (`DownloadedObject.verified_against`), so a load's record equals the record of the save it read; None for local
    files and for objects with no recorded checksum (another tool wrote them: only their size was checked).
    """

    kind: str  # "save" or "load"
    url: str  # s3:// URL or local path
    size: int  # bytes
    seconds: float
    checksum: str | None
    blocked_seconds: float


@dataclass(eq=False)
class _PendingSave:
    """A background save. `settled` is set once its outcome is recorded and the removals waiting on it are done:
    waiting on the Future alone would race with that bookkeeping (done-callbacks run after waiters wake)."""

    path: str
    future: Future[TransferRecord | None] | None = None
    settled: threading.Event = field(default_factory=threading.Event)
    failed: bool = False
    blocked_s: float = 0.0


@dataclass(eq=False)
class _DeferredRemoval:
    path: str
    waits_for: list[_PendingSave]


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
        endpoint_url, region_name, client_settings, retry_policy: how to reach S3 (see `s3_utils.S3ClientSettings`).
        s3_utils: a ready `S3Utils` to use instead of building one from the settings above.
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
        max_requests_per_second: a budget of S3 requests per second for the whole job, split across its processes
            by world size: one number for writes and reads each, or ``{"write": 3000, "read": 5000}`` (see
            `s3_utils.RequestRates`). None (default): no budget; the process's request pacer still slows down from
            the first SlowDown on.

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
        if not (math.isfinite(chunk_size_MB) and chunk_size_MB * _s3.MB >= _s3.MIN_PART_SIZE):
            raise ValueError(f"chunk_size_MB must be a number >= 5 (S3's minimum part size), got {chunk_size_MB}")
        _s3.validate_checksum_algorithm(checksum_algorithm)
        for name, value in [
            ("max_read_concurrency", max_read_concurrency),
            ("max_write_concurrency", max_write_concurrency),
            ("max_saves_in_flight", max_saves_in_flight),
        ]:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if load_sharing not in LOAD_SHARING_MODES:
            raise ValueError(f"load_sharing must be one of {LOAD_SHARING_MODES}, got {load_sharing!r}")
        self.load_sharing = load_sharing
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
        for live in ("_lock", "_executor", "_pending", "_deferred", "_errors", "records", "_fence_override"):
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
        executor = self._get_executor()
        pending = _PendingSave(path)
        with self._lock:
            self._pending.append(pending)
            pending.future = executor.submit(self._save_now, snapshot, path)
        self.last_save_blocked_s = pending.blocked_s = time.perf_counter() - started
        pending.future.add_done_callback(lambda _, pending=pending: self._on_save_done(pending))
        logger.debug("Queued async save of %s (blocked %.3f s)", path, self.last_save_blocked_s)

    def _save_now(self, checkpoint: dict[str, Any], path: str) -> TransferRecord:
        """Save and return its record (the caller adds the time it was blocked and keeps it)."""
        torch = _torch()
        started = time.perf_counter()
        checksum = None
        if _urls.is_s3_url(path):
            fence = self.fence_for(path)
            with self.s3.open_writer(
                path, self.chunk_size_MB, self.max_write_concurrency, self.checksum_algorithm, fence=fence
            ) as writer:
                try:  # the writer's CRC covers every byte; the checkpoint's own tensors go without a copy
                    torch_save_without_zip_crc32(checkpoint, _BorrowingStream(writer, checkpoint))
                except Exception as exc:
                    # torch.save turns a failed write into its own RuntimeError without the URL: raise the S3 error
                    if writer.error is not None and writer.error is not exc:
                        raise writer.error from None
                    raise
            size = writer.info.size if writer.info else 0
            if writer.info and writer.info.checksums:
                checksum = " ".join(f"{k.removeprefix('Checksum')} {v}" for k, v in writer.info.checksums.items())
            _s3.invalidate_fsspec_cache(path)
            self._remove_conflicting_last_checkpoints(path, fence)
        else:
            _atomic_local_save(torch, checkpoint, path)
            size = os.path.getsize(path)
        elapsed = time.perf_counter() - started
        logger.info("Saved %s (%.1f MiB) in %.2f s", path, size / _s3.MB, elapsed)
        return TransferRecord("save", path, size, elapsed, checksum, elapsed)

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
        self._wait_for_saves_of(path)
        torch = _torch()
        load_kwargs: dict[str, Any] = {"map_location": map_location}
        if weights_only is not None:
            load_kwargs["weights_only"] = weights_only
        started = time.perf_counter()
        armed = _take_collective(self)
        if not _urls.is_s3_url(path):
            if not os.path.exists(path):
                raise FileNotFoundError(f"Checkpoint file not found: {path}")
            checkpoint = torch.load(path, **load_kwargs)
            elapsed = time.perf_counter() - started
            self._record(TransferRecord("load", path, os.path.getsize(path), elapsed, None, elapsed))
            return checkpoint
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
            self._record(TransferRecord("load", path, shared.size, elapsed, None, elapsed))
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
        self._record(TransferRecord("load", path, downloaded.size, elapsed, checksum, elapsed))
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
        with self._lock:
            waits_for = list(self._pending)  # every save not yet settled, including one that has just failed
            if waits_for:
                self._deferred.append(_DeferredRemoval(path, waits_for))
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
        if _urls.is_s3_url(path):
            self.s3.remove_object(path, fence=self.fence_for(path))
            _s3.invalidate_fsspec_cache(path)
        elif os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
        logger.debug("Removed checkpoint %s", path)

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
                    pending.failed = True
                    exc.add_note(f"raised by the background save of {pending.path}")
                    logger.error("Background save of %s failed: %r", pending.path, exc)
                    self._errors.append(exc)
                ready = [d for d in self._deferred if not any(p in self._pending for p in d.waits_for)]
                self._deferred = [d for d in self._deferred if d not in ready]
            for removal in ready:
                if any(p.failed for p in removal.waits_for):
                    logger.warning("Not removing %s: a save issued before its removal failed", removal.path)
                    continue
                try:
                    self._remove_now(removal.path)
                except Exception as error:
                    error.add_note(f"raised by the deferred removal of {removal.path}")
                    with self._lock:
                        self._errors.append(error)
        finally:
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
        """Block until every background save (and the removals waiting on them) finished; raise the first failure."""
        self._wait_for_saves_of(None)

    def teardown(self) -> None:
        """Wait for all background saves, shut the worker down, and raise if any save or removal failed."""
        try:
            self.wait_for_pending_saves()
        finally:
            with self._lock:
                executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)


# --------------------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------------------


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
    that function is plain ``torch.save``, and s3_dcp does not reuse archive framing, which assumes no CRCs)."""
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


class SharedLoadError(RuntimeError):
    """The rank that downloads a shared checkpoint for this rank failed, died or took too long; the message names
    the URL and the cause."""


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
    sharing = _s3.node_sharing()
    return None if sharing is None else sharing.download_shared(io, url, armed.node_rank)
