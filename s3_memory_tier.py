"""A memory tier in front of S3: checkpoints land first in the node's tmpfs, S3 gets them behind.

An optional sibling of the core modules, switched on with ``S3CheckpointIO(memory_tier=...)`` (or the NeMo
``s3_checkpointing: memory_tier:`` key) and ``S3StorageWriter`` / ``S3StorageReader(memory_tier=...)``. Without this
file the core keeps its behaviour and a ``memory_tier`` argument raises ImportError saying the file is missing.
docs/tiers.md shows the user's side.

1. Configuration: `MemoryTier` (where, how many checkpoints, how often S3 gets one, an optional byte budget).
2. The node's tier of one job: `NodeTier`. A checkpoint of ``s3://bucket/key`` lands in
   ``<root>/s3ckpt-tier-<uid>/<job>/own/bucket/key``, the same layout as on S3, written into a temporary sibling and
   renamed into place, then committed by its *commit record* ``key.s3ckpt-tier.json`` (step, URL, the run that
   wrote it, and every file's size and checksum as `S3CheckpointIO`'s transfer records spell it, ``"CRC32C <b64>"``).
   A file without a commit record, or whose bytes do not match it, is not a checkpoint. Directories are created
   0700, files 0600, exclusively; the job's directory is the tier's scope: another job never looks into it.
3. Fencing across tiers: the job's directory records the newest launch that wrote into it (``launch.json``); a save
   of an older launch (a straggler) raises `s3_fencing.CheckpointDirectoryTakenError` and writes nothing.
4. Bounded memory: at most `MemoryTier.keep` committed checkpoints per node (each rank's parts counted apart, one
   waiting for its drain to S3 included); older ones are dropped once a newer one is committed.
5. Draining: `NodeTier.upload` streams a committed file into an `s3_utils.S3MultipartWriter` straight from the tier's
   pages (no copy by the training process), checking the bytes against the commit record before S3 commits them.
   The commit record says ``"drain": "pending"`` from the moment a drain is decided until S3 has the object, so a
   relaunch finishes a drain a kill cut short (`NodeTier.pending_drains`, newest first), unless the checkpoint's
   removal was asked for meanwhile (``"removed": true``, `NodeTier.mark_removed`: the relaunch drops it instead).

6. Replication (with the sibling `s3_tier_replication`): `TierReplication`, started collectively by
   `S3CheckpointIO.start_replication`, runs each node's replica server on ``<job>/replicas`` and sends every
   committed checkpoint (file and commit record, verified on arrival) to the next node on a ring in the background.

7. Resume: `agree_on_resume` (behind `S3CheckpointIO.agree_resume`) is one all_gather of what each rank can load
   (its node's verified copies, the verified replicas each node holds, S3's listing), then the newest step every rank
   can load and each rank's fastest tier for its part; `copy_to_load` reads it there (`fetch_replica`: a replaced
   node's part from its peer, verified against manifest and record, then committed as its own copy).

`S3CheckpointIO` drives all of it (when to drain, removals, loads): this module only knows files and records. DCP's
`S3StorageWriter` / `S3StorageReader` drive it through the sibling `s3_dcp_tier` (one copy per file, grouped into a
checkpoint by their records; its replicas counted per checkpoint, its resume decided with `gather_candidates` and
`decide`). Not built yet: the megatron-core path (docs/tiers.md).

Package-internal (docs/api.md) but for `MemoryTier`: users reach it through ``S3CheckpointIO(memory_tier=...)``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import hashlib
import io
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import stat
import threading
import time
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__:
    from . import s3_dirpath_utils as _urls
    from . import s3_fencing as _fencing
    from . import s3_process as _process
    from . import s3_utils as _s3
else:  # installed (or copied) as top-level modules
    import s3_dirpath_utils as _urls
    import s3_fencing as _fencing
    import s3_process as _process
    import s3_utils as _s3

__all__ = [
    "MemoryTier",
]

logger = logging.getLogger(__name__)

COMMIT_RECORD_SUFFIX = ".s3ckpt-tier.json"  # Package-internal (docs/api.md)
"""Beside each checkpoint in the tier: its commit record (without it, the file is not a checkpoint)."""
_LAUNCH_RECORD = "launch.json"
_LAUNCH_LOCK = ".launch.lock"
_FORMAT = 1
_SLACK_BYTES = 1 << 20  # what a torch.save adds to its tensors' bytes (pickle records, zip headers), at most


# --------------------------------------------------------------------------------------------------------------------
# 1. Configuration
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryTier:
    """Where and how a job keeps checkpoints in memory (``S3CheckpointIO(memory_tier=MemoryTier(...))``).

    Args:
        root: a tmpfs directory (``/dev/shm`` by default; a dedicated tmpfs keeps checkpoints from crowding out
            other shared memory). The tier lives in ``<root>/s3ckpt-tier-<uid>/<job>/``.
        keep: at most this many checkpoints in memory per node and saving rank, one waiting for its drain to S3
            included (older ones are dropped once a newer one is committed).
        drain_every: the first checkpoint, then every Nth, is also uploaded to S3 in the background (1: all).
        drain_minutes: also drain a checkpoint when this many minutes passed since the last drain (None: no timer).
        capacity_bytes: the most bytes this node's tier may hold (None: what the tmpfs has free).
        job: what scopes the tier (default: the launcher's job, ``slurm:<id>`` / ``torchrun:<id>``, as fencing
            uses it; outside any launcher the process, so a restart does not find the tier: give one here).
    """

    root: str = "/dev/shm"
    keep: int = 2
    drain_every: int = 1
    drain_minutes: float | None = None
    capacity_bytes: int | None = None
    job: str | None = None

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise ValueError(f"MemoryTier.keep must be >= 1, got {self.keep}")
        if self.drain_every < 1:
            raise ValueError(f"MemoryTier.drain_every must be >= 1, got {self.drain_every}")
        if self.drain_minutes is not None and not self.drain_minutes > 0:
            raise ValueError(f"MemoryTier.drain_minutes must be > 0 or None, got {self.drain_minutes}")
        if self.capacity_bytes is not None and self.capacity_bytes < 0:
            raise ValueError(f"MemoryTier.capacity_bytes must be >= 0 or None, got {self.capacity_bytes}")

    @classmethod
    def from_value(cls, value: Any) -> MemoryTier | None:
        """The configuration a ``memory_tier=`` argument means: None / False (off), True (defaults), a path (the
        root), a mapping of these fields (a config key), or a `MemoryTier`."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, (str, os.PathLike)):
            return cls(root=os.fspath(value))
        if isinstance(value, Mapping):
            known = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(set(value) - set(known))
            if unknown:
                raise ValueError(f"memory_tier: unknown key(s) {unknown}; known: {known}")
            return cls(**value)
        raise TypeError(f"memory_tier must be a path, mapping, MemoryTier, True or None, not {type(value).__name__}")


class TierFullError(OSError):
    """The tier has no room for a checkpoint (the caller saves to S3 directly). Package-internal (docs/api.md)."""


@dataclass(frozen=True)
class TierCopy:
    """A committed checkpoint in the tier: its file, the S3 URL it mirrors and its commit record; `verified`: the
    file's `file_identity` when its bytes were found to match the record (None: not checked). Package-internal
    (docs/api.md)."""

    url: str
    path: Path
    record: dict[str, Any]
    verified: tuple[int, ...] | None = None

    @property
    def size(self) -> int:
        return int(self.record["files"][self.path.name][0])

    @property
    def checksum(self) -> str:
        """``"<ALGORITHM> <base64>"``, as `S3CheckpointIO`'s transfer records spell it."""
        return str(self.record["files"][self.path.name][1])

    @property
    def drain(self) -> str | None:
        return self.record.get("drain")


# --------------------------------------------------------------------------------------------------------------------
# 2. Files: exclusive, private, committed by rename
# --------------------------------------------------------------------------------------------------------------------


def _private_directory(path: Path) -> None:
    """Create `path` (and missing parents) 0700, or accept it only if it is this user's directory, not a link,
    and no one else may enter it: what processes of a host share is created exclusively and privately."""
    missing = []
    current = path
    while not current.exists() and not current.is_symlink():
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
    found = os.lstat(path)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or stat.S_IMODE(found.st_mode) & 0o077:
        raise PermissionError(
            f"memory tier: {path} is not a private directory of this user (mode 0700, not a link); remove it or "
            "choose another MemoryTier.root"
        )


def _create_private_file(path: Path) -> int:
    """A new file, open for writing: O_CREAT | O_EXCL | O_NOFOLLOW, mode 0600 whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def _temporary_sibling(path: Path) -> Path:
    return path.with_name(f".tmp-{path.name}-{secrets.token_hex(4)}")


def _json_file_beside(path: Path, value: Any) -> Path:
    """`value` as JSON in a new private temporary sibling of `path` (for a rename into place)."""
    partial = _temporary_sibling(path)
    fd = _create_private_file(partial)
    try:
        with os.fdopen(fd, "wb") as stream:
            stream.write(json.dumps(value, sort_keys=True).encode())
    except BaseException:
        os.unlink(partial)
        raise
    return partial


def _write_json_atomically(path: Path, value: Any) -> None:
    partial = _json_file_beside(path, value)
    try:
        os.rename(partial, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, OSError):
        return None
    with os.fdopen(fd, "rb") as stream:
        try:
            value = json.loads(stream.read())
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


class _ChecksummingFile(io.RawIOBase):
    """A write-only stream into an fd that keeps the full-object checksum of what it wrote. A large write is
    checksummed on a helper thread while it is being written (both release the GIL), and waited for before the
    write returns: the caller's buffer is only read while the caller lends it."""

    _overlap_min = 4 << 20  # below, handing the buffer to the thread costs about what the checksum does

    def __init__(self, fd: int, algorithm: _s3.ChecksumAlgorithm) -> None:
        super().__init__()
        self._fd = fd
        self._algorithm = algorithm
        self.checksum = 0
        self.size = 0
        self.error: OSError | None = None  # what a write raised (torch.save reports it as its own RuntimeError)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        try:
            return self._write(data)
        except OSError as exc:
            self.error = exc
            raise

    def _write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        if total >= self._overlap_min:
            checksum = _helper_thread("checksum").submit(self._algorithm.update, view, self.checksum)
            self._write_all(view)
            self.checksum = checksum.result()
        else:
            self.checksum = self._algorithm.update(view, self.checksum)
            self._write_all(view)
        self.size += total
        return total

    def _write_all(self, view: memoryview) -> None:
        while view:
            view = view[os.write(self._fd, view) :]


_helpers_lock = threading.Lock()
_helpers: dict[str, concurrent.futures.ThreadPoolExecutor] = {}


def _helper_thread(purpose: str) -> concurrent.futures.ThreadPoolExecutor:
    """The process's helper thread for `purpose` (``"checksum"``: checksums that overlap a write; ``"prune"``:
    dropping old copies, whose pages take a while to free), created on first use."""
    with _helpers_lock:
        if purpose not in _helpers:
            _helpers[purpose] = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"s3ckpt-tier-{purpose}")
        return _helpers[purpose]


def _checksum_string(algorithm: _s3.ChecksumAlgorithm, value: int) -> str:
    return f"{algorithm.name} {algorithm.encode(value)}"


VERIFY_SEGMENT = 32 << 20
"""A file larger than this is checksummed in segments of this size on several cores at once (`file_checksum`)."""
_verify_lock = threading.Lock()
_verify_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _verify_threads() -> concurrent.futures.ThreadPoolExecutor:
    """The process's checksum threads for large files (one fewer than the cores, at most 7: the caller checksums a
    segment too), created on first use."""
    global _verify_pool
    with _verify_lock:
        if _verify_pool is None:
            workers = max(1, min((os.cpu_count() or 2) - 1, 7))
            _verify_pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="s3ckpt-tier-verify")
        return _verify_pool


def file_checksum(path: Path | str, algorithm_name: str, segment: int = VERIFY_SEGMENT) -> tuple[int, str]:
    """(size, ``"<ALGORITHM> <b64>"``) of a file, read through one map of its pages: the full-object checksum a
    commit record holds. Above `segment` bytes the segments are checksummed on the caller's and helper threads at
    once (the checksum releases the GIL) and combined, the same value as one pass over the file (a memory resume
    waits for this pass; on a node's many cores it takes a fraction of the time)."""
    algorithm = _s3.ChecksumAlgorithm.named(algorithm_name)
    with open(path, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        if not size:
            return 0, _checksum_string(algorithm, 0)
        with mmap.mmap(stream.fileno(), size, prot=mmap.PROT_READ) as mapped, memoryview(mapped) as view:
            if size <= segment:
                return size, _checksum_string(algorithm, _s3.checksum_of(algorithm, view))

            def part(start: int) -> int:
                with view[start : start + segment] as piece:
                    return _s3.checksum_of(algorithm, piece)

            starts = range(0, size, segment)
            helpers = [_verify_threads().submit(part, start) for start in starts[1:]]
            try:
                values = [part(0)]
            finally:  # the map stays open until every helper is done with it
                values += [future.result() for future in helpers]
        lengths = [min(segment, size - start) for start in starts]
        return size, _checksum_string(algorithm, _s3.combine_checksums(algorithm, zip(values, lengths, strict=True)))


def file_identity(path: Path | str) -> tuple[int, ...]:
    """What changes when a file's bytes may have: device, inode, size, modification and change times (ns). A copy
    checked against its record while its identity was this needs no second pass while it still is."""
    found = os.stat(path, follow_symlinks=False)
    return (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns)


def _tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in a checkpoint's containers (each storage once): what a torch.save writes, nearly."""
    import sys

    torch = sys.modules.get("torch")
    seen: dict[tuple[str, int], int] = {}
    pending = [obj]
    while pending:
        value = pending.pop()
        if torch is not None and isinstance(value, torch.Tensor):
            with contextlib.suppress(RuntimeError, NotImplementedError):
                storage = value.untyped_storage()
                seen[(str(value.device), storage.data_ptr())] = storage.nbytes()
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return sum(seen.values())


def _slug(text: str) -> str:
    """A directory name for `text`: readable, safe, and distinct (a short hash of the whole)."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:60]
    return f"{readable}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


# --------------------------------------------------------------------------------------------------------------------
# 3. One node's tier of one job
# --------------------------------------------------------------------------------------------------------------------


class NodeTier:
    """This node's memory tier for one job, as seen by one process (`S3CheckpointIO` keeps one).
    Package-internal (docs/api.md)."""

    def __init__(self, config: MemoryTier, run: _fencing.CheckpointRun, checksum_algorithm: str = "auto") -> None:
        self.config = config
        self.run = run
        self.algorithm = _s3.ChecksumAlgorithm.named(checksum_algorithm)
        job = config.job or run.job
        if not job:
            job = f"process {run.run_id}"
            logger.info(
                "memory tier: no launcher names this job, so the tier is this process's alone (a restart does not "
                "find it); set MemoryTier(job=...) to keep it across restarts"
            )
        self.job = job
        self.directory = Path(config.root) / f"s3ckpt-tier-{os.getuid()}" / _slug(job)
        self.own = self.directory / "own"
        self.replicas = self.directory / "replicas"
        self._lock = threading.Lock()
        for level in (self.directory.parent, self.directory):  # each level this user's alone, not only the last
            _private_directory(level)
        self._warned_full = False
        self._last_size: int | None = None  # the previous save's bytes: the next one's estimate (no walk)
        self._pruning: concurrent.futures.Future[list[str]] | None = None
        self._prune_lock = threading.Lock()  # `prune` and `pin` (a copy is pinned before a prune can drop it)
        self._pinned: frozenset[str] = frozenset()  # URLs a resume agreed to read here (`pin`): never pruned
        _private_directory(self.own)

    def __repr__(self) -> str:
        return f"<NodeTier {self.directory} for {self.run}>"

    # ---- where -------------------------------------------------------------------------------------------------

    def path_of(self, url: str) -> Path:
        """Where the checkpoint of `url` lives in this tier: ``own/<bucket>/<key>``."""
        bucket, key = _urls.parse_s3_url(_urls.normalize_s3_url(url))
        parts = [bucket, *key.split("/")]
        if not key or any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"memory tier: cannot keep {url} (an empty, '.' or '..' path segment)")
        return self.own.joinpath(*parts)

    @staticmethod
    def record_path(path: Path) -> Path:
        return path.with_name(path.name + COMMIT_RECORD_SUFFIX)

    # ---- fencing -------------------------------------------------------------------------------------------------

    def _launch_lock(self) -> contextlib.AbstractContextManager[None]:
        """The short lock around the launch record and each commit and removal (a few renames), which a straggler
        stopped inside it holds only for `s3_fencing.TAKEOVER_LOCK_WAIT_S` (`s3_fencing.takeover_lock`)."""
        return _fencing.takeover_lock(self.directory / _LAUNCH_LOCK, f"memory tier {self.directory} ({self.run})")

    def claim(self) -> None:
        """Record this run as the tier's newest writer, or raise `CheckpointDirectoryTakenError` if a newer launch
        of the job wrote here (this run is a straggler: it writes nothing)."""
        with self._launch_lock():
            owner = self._check_owner()
            if owner is None or owner.run_id != self.run.run_id:
                _write_json_atomically(self.directory / _LAUNCH_RECORD, dataclasses.asdict(self.run))
                self._remove_unfinished_writes()

    def _remove_unfinished_writes(self) -> None:
        """What killed processes of earlier launches left half-written in this node's own copies: temporary files
        (a kill inside a save) and data files without their commit record (a kill between a commit's renames). None
        of them is a checkpoint, and nothing else would ever free their memory. Called at a launch's first claim,
        under the launch lock: every process of this launch claims before it writes, so nothing here is its own."""
        removed, freed = 0, 0
        for path in sorted(self.own.rglob("*")):
            name = path.name
            unfinished = name.startswith(".tmp-") or (
                not name.endswith(COMMIT_RECORD_SUFFIX) and not self.record_path(path).exists()
            )
            with contextlib.suppress(FileNotFoundError):
                info = path.lstat()
                if unfinished and stat.S_ISREG(info.st_mode):
                    path.unlink()
                    removed, freed = removed + 1, freed + info.st_size
        if removed:
            logger.warning(
                "memory tier %s: removed %d unfinished file(s), %.1f MiB, that killed processes of an earlier launch "
                "left (none of them was a committed copy)", self.own, removed, freed / _s3.MB,
            )  # fmt: skip

    def _check_owner(self) -> _fencing.CheckpointRun | None:
        """The run the tier's launch record names (None: none); `CheckpointDirectoryTakenError` if it is a newer
        launch of the job than this run. Call it under `_launch_lock`: `claim`, and again right before each commit
        and removal (a straggler stopped after its claim changes nothing once it continues)."""
        found = _read_json(self.directory / _LAUNCH_RECORD)
        owner = None
        if found is not None:
            with contextlib.suppress(TypeError, ValueError):
                owner = _fencing.CheckpointRun(**{**found, "attempt": tuple(found.get("attempt", ()))})
        if owner is not None and owner.run_id != self.run.run_id and owner.is_newer_than(self.run):
            raise _fencing.CheckpointDirectoryTakenError(
                f"memory tier {self.directory}: {owner} is a newer launch of this job than {self.run}; this "
                "run is stale and writes nothing into the tier (docs/fencing.md)",
                str(self.directory),
                self.run,
                owner,
            )
        return owner

    # ---- save ----------------------------------------------------------------------------------------------------

    def free_bytes(self) -> int:
        """Room left for a new checkpoint: the tmpfs's free bytes, within `MemoryTier.capacity_bytes`."""
        found = os.statvfs(self.own)
        free = found.f_bavail * found.f_frsize
        if self.config.capacity_bytes is not None:
            free = min(free, self.config.capacity_bytes - sum(copy.size for copy in self.copies()))
        return max(free, 0)

    def save(self, checkpoint: Any, url: str, step: int | None, write: Any) -> TierCopy:
        """Write `checkpoint` for `url` with ``write(checkpoint, stream)`` and commit it; raise `TierFullError`
        (nothing left behind) when the tier lacks room, before writing or on ENOSPC. The previous save's drop of old
        copies (`prune_soon`) is waited for first: while this one is written the node holds `keep` + 1, no more."""
        self.claim()
        self.wait_pruned()
        needed = (self._last_size if self._last_size is not None else _tensor_bytes(checkpoint)) + _SLACK_BYTES
        free = self.free_bytes()
        if needed > free:
            raise TierFullError(errno.ENOSPC, f"memory tier {self.own}: {needed} bytes needed, {free} free")
        partial, stream = None, None
        try:  # from the first directory on: a full tmpfs (no room, no inode) is a fall-back, never a failed step
            partial, fd = self.temporary_file(url)
            with os.fdopen(fd, "wb", buffering=0) as raw:
                stream = _ChecksummingFile(raw.fileno(), self.algorithm)
                write(checkpoint, stream)
            if self.config.capacity_bytes is not None and stream.size > free:
                raise TierFullError(errno.ENOSPC, f"memory tier {self.own}: {stream.size} bytes over its capacity")
            copy = self.commit(partial, url, step, stream.size, _checksum_string(self.algorithm, stream.checksum))
            self._last_size = stream.size
        except BaseException as exc:
            if partial is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
            error = exc if isinstance(exc, OSError) else getattr(stream, "error", None)
            if isinstance(error, OSError) and not isinstance(error, TierFullError):
                if error.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise TierFullError(error.errno, f"memory tier {self.own}: {error.strerror}") from exc
            raise
        return copy

    def temporary_file(self, url: str) -> tuple[Path, int]:
        """A new private temporary file beside where the copy of `url` lives (its directories made), open for writing:
        ``(path, fd)``; `commit` makes it the copy."""
        path = self.path_of(url)
        _private_directory(path.parent)
        partial = _temporary_sibling(path)
        return partial, _create_private_file(partial)

    def commit(self, partial: Path, url: str, step: int | None, size: int, checksum: str, **extra: Any) -> TierCopy:
        """Make the written `temporary_file` the committed copy of `url` (`size` bytes, `checksum` spelt
        ``"<ALGORITHM> <b64>"``; `extra` fields go into the commit record): the record is written first into a
        sibling, then the old record goes, the file and the record are renamed into place."""
        path = self.path_of(url)
        record = {
            "format": _FORMAT,
            "url": url,
            "step": step,
            "rank": _process.global_rank(),  # the bound counts each saving rank's copies (`prune`)
            "run": dataclasses.asdict(self.run),
            "files": {path.name: [size, checksum]},
            "committed": time.time(),
            "sequence": time.time_ns(),
            "drain": None,
            **extra,
        }
        record_file = _json_file_beside(self.record_path(path), record)  # needs room: before any change
        try:
            with self._lock, self._launch_lock():  # the old record goes first: a kill between the renames ...
                self._check_owner()  # ... leaves no false commit; a straggler's late commit, none at all
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.record_path(path))
                os.rename(partial, path)
                os.rename(record_file, self.record_path(path))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(record_file)
            raise
        return TierCopy(url, path, record)

    def warn_full_once(self, url: str, error: BaseException) -> None:
        """One warning per tier that a save went to S3 directly for want of room (later ones are logged at INFO)."""
        log = logger.info if self._warned_full else logger.warning
        self._warned_full = True
        log("%s: no room in the memory tier (%s); this save goes to S3 directly, the step does not fail", url, error)

    # ---- what is there -------------------------------------------------------------------------------------------

    def copy_of(self, url: str) -> TierCopy | None:
        """The committed copy of `url` (unverified), or None."""
        path = self.path_of(url)
        record = _read_json(self.record_path(path))
        if record is None or record.get("format") != _FORMAT or path.name not in record.get("files", {}):
            return None
        if not path.is_file() or path.stat().st_size != record["files"][path.name][0]:
            return None
        return TierCopy(url, path, record)

    def is_committed(self, copy: TierCopy) -> bool:
        """Whether `copy` is still the committed copy of its URL (not dropped, nor replaced by a newer save of it)."""
        current = self.copy_of(copy.url)
        return current is not None and current.record.get("sequence") == copy.record.get("sequence")

    def verified_copy(self, url: str, trusted: TierCopy | None = None) -> TierCopy | None:
        """The committed copy of `url` if its bytes match its record; None if there is none; raises
        `s3_utils.ChecksumMismatchError` (naming the file and the URL) if they do not. `trusted`: this copy as it
        was verified a moment ago (`agree_on_resume`): while its file and record are unchanged (`file_identity`,
        size and checksum), its bytes are not read a second time."""
        copy = self.copy_of(url)
        if copy is None:
            return None
        identity = file_identity(copy.path)
        unchanged = trusted is not None and (trusted.verified, trusted.size, trusted.checksum) == (
            identity, copy.size, copy.checksum
        )  # fmt: skip
        if not unchanged:
            _verify_against_record(copy.path, copy.record, "memory tier copy")
        return dataclasses.replace(copy, verified=identity)

    def verified_replica(self, path: Path) -> TierCopy:
        """The peer's checkpoint whose replica this node holds at `path` (a file under `replicas`), checked against
        the commit record beside it; raises `s3_utils.ChecksumMismatchError` if it does not match (or has none)."""
        path = Path(path)
        record = _read_json(self.record_path(path))
        if not path.resolve().is_relative_to(self.replicas.resolve()) or record is None or "url" not in record:
            raise _s3.ChecksumMismatchError(f"memory tier: {path} is no replica with a record in {self.replicas}")
        _verify_against_record(path, record, "the replica")
        return TierCopy(record["url"], path, record)

    def copies(self) -> list[TierCopy]:
        """Every committed checkpoint of this node, oldest first."""
        found = []
        for record_path in self.own.rglob(f"*{COMMIT_RECORD_SUFFIX}"):
            record = _read_json(record_path)
            url = record.get("url") if record else None
            if isinstance(url, str):
                with contextlib.suppress(ValueError, OSError):
                    copy = self.copy_of(url)
                    if copy is not None:
                        found.append(copy)
        return sorted(found, key=lambda copy: copy.record.get("sequence", 0))

    def entries_under(self, directory: str, agreement: TierAgreement | None = None) -> list[tuple[str, float]]:
        """``(path relative to the s3:// `directory`, commit time)`` of the committed checkpoints below it, as
        resume discovery takes a listing's entries; with the ranks' `agreement` on `directory`, its entries."""
        if agreement is not None and agreement.covers(directory):
            return agreement.entries()
        prefix = _urls.normalize_s3_url(directory).rstrip("/") + "/"
        return [
            (copy.url[len(prefix) :], float(copy.record.get("committed", 0.0)))
            for copy in self.copies()
            if copy.url.startswith(prefix)
        ]

    def tiers_under(self, directory: str) -> dict[str, dict[str, Any]]:
        """The checkpoints below the s3:// `directory` this node holds: URL -> ``{"tiers": [...], "size": bytes,
        "committed": epoch seconds}``, tiers ``"memory"`` (its own, committed) and ``"replica"`` (a peer's replica
        that counts here). For ``ls``; reads records only (no checksums)."""
        prefix = _urls.normalize_s3_url(directory).rstrip("/") + "/"
        found: dict[str, dict[str, Any]] = {}

        def add(record: dict[str, Any], tier: str) -> None:
            url = record.get("url")
            if isinstance(url, str) and url.startswith(prefix):
                size = sum(int(entry[0]) for entry in record.get("files", {}).values())
                entry = found.setdefault(url, {"tiers": [], "size": size, "committed": record.get("committed", 0.0)})
                entry["tiers"].append(tier)

        for copy in self.copies():
            add(copy.record, "memory")
        if self.replicas.is_dir():
            suffix = _replication_module().MANIFEST_SUFFIX
            for manifest in sorted(self.replicas.glob(f"*/*{suffix}")):
                replica = manifest.with_name(manifest.name.removesuffix(suffix))
                for record_path in replica.glob(f"*{COMMIT_RECORD_SUFFIX}"):
                    record = _read_json(record_path)
                    if record is not None:
                        add(record, "replica")
        return found

    def pending_drains(self, files_of_checkpoints: bool = False) -> list[TierCopy]:
        """Committed checkpoints whose drain to S3 was decided and not finished (a kill cut it short), oldest first;
        with `files_of_checkpoints`, instead the files of multi-file checkpoints (DCP's, `s3_dcp_tier`), which drain
        in their own order."""
        pending = [copy for copy in self.copies() if copy.drain == "pending" and not copy.record.get("removed")]
        return [copy for copy in pending if bool(copy.record.get("checkpoint")) == files_of_checkpoints]

    def removed_while_draining(self) -> list[TierCopy]:
        """Copies whose removal was asked for while their drain ran (`mark_removed`) and whose drain never ended (a
        kill): a relaunch drops them (no upload: the checkpoint was removed)."""
        return [copy for copy in self.copies() if copy.drain == "pending" and copy.record.get("removed")]

    # ---- drain ---------------------------------------------------------------------------------------------------

    def set_drain(self, copy: TierCopy, state: str) -> TierCopy:
        """Record the drain state of `copy` (``"pending"``, ``"done"``) in its commit record, if it is still the
        committed copy (a newer save of the same URL keeps its own state)."""
        return self._update_record(copy, drain=state)

    def mark_removed(self, copy: TierCopy) -> TierCopy:
        """Record that the removal of `copy` was asked for while its drain runs: the drain still reads it, but a
        relaunch finds no drain to finish there (`pending_drains`) and drops it."""
        return self._update_record(copy, removed=True)

    def _update_record(self, copy: TierCopy, **fields: Any) -> TierCopy:
        with self._lock:
            current = self.copy_of(copy.url)
            if current is None or current.record.get("sequence") != copy.record.get("sequence"):
                return copy
            record = {**current.record, **fields}
            _write_json_atomically(self.record_path(copy.path), record)
        return TierCopy(copy.url, copy.path, record)

    @staticmethod
    def upload(copy: TierCopy, writer: _s3.S3MultipartWriter) -> None:
        """Stream the tier file of `copy` into `writer` from its mapped pages (no copy by this process), and raise
        `s3_utils.ChecksumMismatchError` before the writer commits if the bytes are not those the record vouches
        for (the caller's ``with writer`` then aborts the upload)."""
        algorithm = _s3.ChecksumAlgorithm.named(copy.checksum.split(" ", 1)[0])
        with open(copy.path, "rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            if size != copy.size:
                raise _s3.ChecksumMismatchError(
                    f"memory tier copy {copy.path} of {copy.url} has {size} bytes, its record {copy.size}"
                )
            if not size:
                return
            mapped = mmap.mmap(stream.fileno(), size, prot=mmap.PROT_READ)
            checksum = _checksum_string(algorithm, _s3.checksum_of(algorithm, mapped))
            if checksum != copy.checksum:
                mapped.close()
                raise _s3.ChecksumMismatchError(
                    f"memory tier copy {copy.path} of {copy.url} does not match its commit record ({checksum}, "
                    f"recorded {copy.checksum}): not uploaded"
                )
            writer.write_borrowed(memoryview(mapped), mapped)  # the map lives until the writer has sent its parts

    # ---- removal and the bound ---------------------------------------------------------------------------------

    def remove(self, url: str, copy: TierCopy | None = None) -> bool:
        """Drop the tier's copy of `url` (its record first: a kill in between leaves no false commit); False when
        there was none, or (logged) when a newer launch claimed the tier: a straggler drops nothing. `copy`: only
        while that is the committed copy of `url` (one a save of the URL committed meanwhile stays)."""
        path = self.path_of(url)
        with self._lock, self._launch_lock():
            try:
                self._check_owner()
            except _fencing.CheckpointDirectoryTakenError as exc:
                logger.warning("memory tier: not dropping %s: %s", path, exc)
                return False
            if copy is not None and not self.is_committed(copy):
                return False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.record_path(path))
            try:
                os.unlink(path)
            except FileNotFoundError:
                return False
        logger.debug("memory tier: dropped %s", path)
        return True

    def pin(self, urls: Iterable[str]) -> None:
        """Keep the copies of `urls` (replacing the URLs pinned before) until `unpin`, whatever `prune` would drop: a
        resume agreed to read them, and the drains a relaunch finishes prune the tier meanwhile. Waits for a prune
        that runs (one that started before could otherwise still drop a copy just pinned)."""
        with self._prune_lock:
            self._pinned = frozenset(urls)

    def unpin(self) -> None:
        """Let `prune` drop what `pin` kept (a newer checkpoint of this process is in the tier)."""
        with self._prune_lock:
            self._pinned = frozenset()

    def prune_soon(self) -> None:
        """`prune` on a helper thread, off the caller's path (`wait_pruned` waits for it; a failure is logged)."""
        self._pruning = _helper_thread("prune").submit(self.prune)

    def wait_pruned(self) -> None:
        """Wait for the last `prune_soon`."""
        pruning, self._pruning = self._pruning, None
        if pruning is not None:
            try:
                pruning.result()
            except OSError as exc:
                logger.warning("memory tier %s: dropping old checkpoints failed: %s", self.own, exc)

    def prune(self) -> list[str]:
        """Keep `MemoryTier.keep` checkpoints of each rank that saves on this node (the node's ranks share its
        tier: counting all their copies together would drop a rank's part of a step still held whole, and keep
        fewer than `keep` steps): its newest, those whose drain is pending (S3 has no copy yet), then the newest
        others up to `keep`. A checkpoint is a copy, or the files whose records name one ``"checkpoint"`` (a DCP
        checkpoint's, one per file), kept or dropped together. So `keep` bounds a node's copies while a drain runs
        too (only more drains pending at once than `keep` - 1 hold more). First, a multi-file checkpoint saved again
        at its URL (a newer ``"save"`` in a record naming the same ``"commit"``) loses the older save's files the
        newer one did not rewrite (another rank count or file naming): memory stays bounded, and no load meets a mix.
        Copies `pin` holds stay besides (a resume reads them). Returns the URLs dropped."""
        with self._prune_lock:
            return self._prune(self._pinned)

    def _prune(self, pinned: frozenset[str]) -> list[str]:
        copies, newest = self.copies(), {}  # oldest first; each multi-file checkpoint's newest save in the tier
        for copy in copies:
            commit = copy.record.get("commit")
            newest[commit] = max(newest.get(commit, 0), copy.record.get("save", 0))
        replaced = {copy.url: copy for copy in copies if copy.url not in pinned and copy.record.get("commit")
                    and copy.record.get("save", 0) < newest[copy.record["commit"]]}  # fmt: skip
        dropped = [url for url, copy in replaced.items() if self.remove(url, copy)]
        by_rank: dict[Any, dict[str, list[TierCopy]]] = {}
        for copy in (copy for copy in copies if copy.url not in replaced):
            checkpoint = copy.record.get("checkpoint") or copy.url
            by_rank.setdefault(copy.record.get("rank"), {}).setdefault(checkpoint, []).append(copy)
        for checkpoints in by_rank.values():  # a checkpoint ranks by its newest file
            ordered = sorted(checkpoints.items(), key=lambda item: item[1][-1].record.get("sequence", 0))
            kept = {ordered[-1][0]} | {key for key, files in ordered if any(c.drain == "pending" for c in files)}
            for key, _ in reversed(ordered):
                if len(kept) >= self.config.keep:
                    break
                kept.add(key)
            kept |= {key for key, files in ordered if any(copy.url in pinned for copy in files)}
            for key, files in ordered:
                if key not in kept:
                    dropped += [copy.url for copy in files if self.remove(copy.url, copy)]
        return dropped


# --------------------------------------------------------------------------------------------------------------------
# 6. Replication to the next node (s3_tier_replication)
# --------------------------------------------------------------------------------------------------------------------


def _replication_module() -> types.ModuleType:
    feature = "replicating the memory tier"
    return _process.require_sibling("s3_tier_replication", __package__, feature, "s3_memory_tier.py")


class TierReplication:
    """This rank's part of the job's replication: the node's replica server (on its first rank) and a background
    sender to the next node's. Collective to start (every rank of `group`); `send` never blocks the caller.
    Package-internal (docs/api.md)."""

    def __init__(self, tier: NodeTier, group: Any = None, *, bind_host: str | None = None, local_rank: int = 0) -> None:
        module = _replication_module()
        bind_host = module.job_network_host() if bind_host is None else bind_host
        self._module = module
        self.tier = tier
        self.node = _process.node_key()
        self.launch = tier.run.run_id if tier.run.job else None
        self.server = None
        if local_rank == 0:
            try:
                self.server = module.ReplicaServer(
                    tier.replicas, job=tier.job, launch=self.launch, bind_host=bind_host, keep=tier.config.keep
                )
            except (RuntimeError, OSError) as exc:  # e.g. a newer launch claimed the root: this process is a straggler
                # Every rank still joins the exchange below (one rank raising here would leave the others waiting in
                # it until the process group's timeout); this node then serves no replicas, said loudly.
                logger.error("memory tier: node %s serves no replicas, so its peer's checkpoints get no copy on "
                             "another node: %s", self.node, exc)
        addresses = module.exchange_addresses(group, server=self.server)
        nodes = list(addresses)
        if self.server is not None and nodes:  # `keep` replicas of each of the peer's ranks (as `NodeTier.prune`)
            self.server.keep = tier.config.keep * max(1, -(-_process.world_size() // len(nodes)))
        peer = module.peer_of(nodes.index(self.node), len(nodes)) if self.node in addresses else None
        self.peer = None if peer is None else addresses[nodes[peer]]
        if self.peer is None:
            logger.warning("memory tier: no other node to replicate to; a lost node loses what it held in memory")
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="s3ckpt-replicate")
        self._futures: list[concurrent.futures.Future[None]] = []
        self.replicated: list[str] = []  # URLs whose copy counts on the peer, oldest first

    @staticmethod
    def replica_name(url: str) -> str:
        """The replica's name on the peer for the checkpoint of `url`."""
        return _slug(url)

    @staticmethod
    def retention_group(record: Mapping[str, Any]) -> str | None:
        """What the peer's `keep` counts a replica in: one saving rank's files of one multi-file checkpoint (a DCP
        checkpoint's, whose records name it ``"checkpoint"``) count as one, as `NodeTier.prune` counts them; a
        single-file checkpoint counts by itself (None)."""
        checkpoint = record.get("checkpoint")
        return f"{checkpoint} rank {record.get('rank')}" if checkpoint else None

    def send(self, copy: TierCopy) -> None:
        """Queue the replication of `copy` (its file and commit record) to the peer node; the tier is pruned once
        it counts there."""
        if self.peer is not None:
            self._futures = [f for f in self._futures if not f.done()]
            self._futures.append(self._executor.submit(self._send, copy))

    def _send(self, copy: TierCopy) -> None:
        if not self.tier.is_committed(copy):
            logger.info("memory tier: %s left memory (or was saved again) before its replication: not sent", copy.url)
            return
        try:
            self.send_to(copy, self.peer)
        except OSError as exc:  # the next save replicates again; training goes on
            logger.warning("memory tier: %s was not replicated to %s:%d: %s", copy.url, *self.peer, exc)
            raise
        self.replicated.append(copy.url)
        self.tier.prune()

    def send_to(self, copy: TierCopy, address: tuple[str, int]) -> None:
        """Send `copy` (its file and commit record) to the replica server at `address` now, as this node's replica
        (a hand-over to a node that lacks it, or the ring's background send); raises
        `s3_tier_replication.ReplicationError`."""
        record = NodeTier.record_path(copy.path)
        manifest = {
            copy.path.name: (copy.size, copy.checksum),
            record.name: file_checksum(record, copy.checksum.split(" ")[0]),
        }
        self._module.send_directory(
            copy.path.parent, self.replica_name(copy.url), tuple(address), sender_node=self.node, job=self.tier.job,
            launch=self.launch, manifest=manifest, group=self.retention_group(copy.record),
        )  # fmt: skip

    def fetch_back(self, url: str) -> TierCopy | None:
        """This node's checkpoint file of `url` from the replica its peer holds (a replaced node's load without an
        agreement), committed as this node's copy once verified; None when the peer holds none. Raises
        `s3_tier_replication.ReplicationError` when the peer cannot be reached, `s3_utils.ChecksumMismatchError`
        when its replica does not verify."""
        if self.peer is None:
            return None
        source = ResumeSource(url, "replica", None, self.peer, self.node, self.replica_name(url))
        try:
            return fetch_replica(self.tier, source)
        except self._module.ReplicaRefusedError:
            return None

    def wait(self) -> None:
        """Block until every queued replication ended (failures were logged)."""
        for future in self._futures:
            with contextlib.suppress(OSError):
                future.result()
        self._futures = []

    def close(self) -> None:
        """Finish the queued replications, stop sending and stop this node's server."""
        self.wait()
        self._executor.shutdown(wait=True)
        if self.server is not None:
            self.server.close()


# --------------------------------------------------------------------------------------------------------------------
# 7. Resume: one collective decision over the tiers (own memory, a peer's replica, S3)
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResumeSource:
    """Where this rank reads the checkpoint of `url` outside S3: ``"memory"`` (its node's committed copy at `path`)
    or ``"replica"`` (a replica held on this node at `path`, or on another node's server `peer`, fetched as the
    replica `name` of `sender_node`). Package-internal (docs/api.md)."""

    url: str
    tier: str
    path: Path | None = None
    peer: tuple[str, int] | None = None
    sender_node: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class TierAgreement:
    """What every rank agreed on (`agree_on_resume`): the newest `step` complete and verified for every rank on some
    tier, this rank's `url` of it and its fastest `tier`, and every step every rank can load (newest first) with
    this rank's URL of each (`urls`; resume discovery takes its entries from there); `sources`: where this rank reads
    each URL outside S3 (a DCP checkpoint's: each of its files). Package-internal (docs/api.md)."""

    directory: str
    step: int | None
    url: str | None
    tier: str | None
    steps: list[int]
    urls: dict[int, str]
    committed: dict[str, float]
    sources: dict[str, ResumeSource]
    verified: dict[str, TierCopy] = dataclasses.field(default_factory=dict)
    """This node's copies as they were verified for the decision: the load of one does not read its bytes again
    while its file is unchanged (taken by the first load: a later one verifies again)."""

    def covers(self, directory: str) -> bool:
        return self.directory == _urls.normalize_s3_url(directory).rstrip("/")

    def entries(self) -> list[tuple[str, float]]:
        """``(path relative to the directory, commit time)`` of this rank's checkpoint of each step every rank can
        load, where this rank reads it from memory or a replica: what resume discovery adds to the S3 listing."""
        found = [url for url in self.urls.values() if url in self.sources]
        return [(url[len(self.directory) + 1 :], self.committed[url]) for url in found]


def _record_file(files: Mapping[str, Any]) -> str | None:
    return next((name for name in files if name.endswith(COMMIT_RECORD_SUFFIX)), None)


def _verify_against_record(path: Path, record: Mapping[str, Any], what: str) -> None:
    """Raise `s3_utils.ChecksumMismatchError` unless `path` has the size and checksum its commit record says."""
    size, checksum = record["files"][path.name]
    found = file_checksum(path, str(checksum).split(" ", 1)[0])
    if found != (int(size), checksum):
        raise _s3.ChecksumMismatchError(
            f"{what} {path} of {record.get('url')} does not match its commit record: {found[0]} bytes with "
            f"{found[1]}, recorded {size} bytes with {checksum}"
        )


def held_replicas(tier: NodeTier) -> list[tuple[str, int | None, float, str, str, Path, dict[str, Any]]]:
    """The peers' checkpoints whose replica this node holds and that verify against their commit records:
    ``(url, step, committed, sender_node, name, file, record)``; one that does not is skipped, said loudly.
    Package-internal (docs/api.md)."""
    if not tier.replicas.is_dir():
        return []
    module = _replication_module()
    found = []
    for manifest in sorted(tier.replicas.glob(f"*/*{module.MANIFEST_SUFFIX}")):
        try:
            info = module.ReplicaInfo.from_record(_read_json(manifest))
            record_name = _record_file(info.files)
            folder = manifest.parent / info.name
            record = _read_json(folder / record_name) if record_name else None
            if info.job != tier.job or record is None:
                continue
            path = folder / record_name.removesuffix(COMMIT_RECORD_SUFFIX)
            _verify_against_record(path, record, "the replica")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.error("memory tier: the replica %s is skipped for resume: %s", manifest, exc)
            continue
        found.append((record["url"], record.get("step"), float(record.get("committed", 0.0)), info.sender_node,
                      info.name, path, record))  # fmt: skip
    return found


def _my_candidates(
    tier: NodeTier,
    replication: TierReplication | None,
    directory: str,
    s3_steps: Mapping[str, int | None],
    held: list[tuple[str, int | None, float, str, str, Path, dict[str, Any]]],
    verified: dict[str, TierCopy],
) -> dict[str, Any]:
    """This rank's part of the collective: its node's verified copies (also put in `verified`) and held replicas,
    its S3 steps."""
    own = {}
    for copy in tier.copies():
        try:
            checked = tier.verified_copy(copy.url)
        except _s3.ChecksumMismatchError as exc:
            logger.error("%s: skipped for resume, the next tier is used", exc)
            continue
        if checked is None:  # removed meanwhile
            continue
        verified[copy.url] = checked
        own[copy.url] = [copy.record.get("step"), float(copy.record.get("committed", 0.0))]
    address = None if replication is None or replication.server is None else list(replication.server.address)
    held_urls = [[url, step, committed, sender, name] for url, step, committed, sender, name, *_ in held]
    return {"node": _process.node_key(), "address": address, "directory": directory, "own": own, "s3": dict(s3_steps),
            "held": held_urls}  # fmt: skip


def decide(gathered: list[dict[str, Any]], rank: int) -> tuple[list[int], dict[int, list[tuple[int, str, str]]]]:
    """Every rank's candidates (`agree_on_resume`'s all_gather) -> the steps every rank can load, newest first, and
    for `rank` each of those steps' ``(tier rank, url, tier)`` options, fastest first (0 memory, 1 a replica on this
    node, 2 one on another node, 3 S3). The same on every rank: it reads only what was gathered.
    Package-internal (docs/api.md)."""
    addresses = {entry["node"]: entry["address"] for entry in gathered if entry["address"]}
    s3 = {url: step for entry in gathered for url, step in entry["s3"].items()}
    steps_of = {url: step for entry in gathered for url, (step, _) in entry["own"].items()}
    steps_of.update({held[0]: held[1] for entry in gathered for held in entry["held"]})

    def options(entry: dict[str, Any]) -> dict[int, list[tuple[int, str, str]]]:
        prefix = _urls.normalize_s3_url(entry["directory"]).rstrip("/") + "/"
        found: dict[int, list[tuple[int, str, str]]] = {}

        def add(url: str, speed: int, tier: str) -> None:
            step = steps_of.get(url, s3.get(url))
            if url.startswith(prefix) and isinstance(step, int):
                found.setdefault(step, []).append((speed, url, tier))

        for url in entry["own"]:
            add(url, 0, "memory")
        for other in gathered:
            for url, _, _, _, _ in other["held"]:
                if other["node"] == entry["node"]:
                    add(url, 1, "replica")
                elif other["node"] in addresses:
                    add(url, 2, "replica")
        for url in s3:
            add(url, 3, "s3")
        return {step: sorted(set(found_options)) for step, found_options in found.items()}

    every = [options(entry) for entry in gathered]
    common = set(every[0]).intersection(*every[1:]) if every else set()
    mine = every[rank]
    return sorted(common, reverse=True), {step: mine[step] for step in common}


def gather_candidates(candidates: Any, directory: str, group: Any = None, tier: NodeTier | None = None
                      ) -> tuple[list[dict[str, Any]], int]:  # fmt: skip
    """The collective of a resume decision: one all_gather of each rank's ``candidates()`` (what it can load; a
    dict), then every rank's entries and this rank's index. `tier`: this rank's node tier, every copy of which is
    pinned first (nothing a rank offers leaves memory while the ranks decide; the caller pins what it loads after).
    A rank whose ``candidates()`` raises makes every rank raise (this rank its own error, the others a RuntimeError
    naming it and `directory`): no rank waits in a collective the others left. Outside a process group (or a group
    of one), this process's entry alone. Package-internal (docs/api.md)."""
    failure = None
    try:
        if tier is not None:
            tier.pin(copy.url for copy in tier.copies())
        mine = candidates()
    except Exception as exc:  # said to every rank through the collective, then raised here
        failure, mine = exc, {"error": f"{type(exc).__name__}: {exc}"}
    dist = _process.import_optional_dependency("torch.distributed", "agreeing on a resume step")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        rank = dist.get_rank(group)
    else:
        gathered, rank = [mine], 0
    if failure is not None:
        raise failure
    errors = [f"rank {index}: {entry['error']}" for index, entry in enumerate(gathered) if "error" in entry]
    if errors:
        raise RuntimeError(f"memory tier: no resume step agreed for {directory}: {'; '.join(errors)}")
    return gathered, rank


def agree_on_resume(
    tier: NodeTier,
    replication: TierReplication | None,
    directory: str,
    listing: Any,
    step_of: Any = None,
    group: Any = None,
) -> TierAgreement:
    """Collective (every rank of `group` calls it, each with its own `directory`, its part): one all_gather of each
    rank's candidates (steps it can load from its node's memory, a replica, S3: the objects ``listing()`` returns,
    whose names `step_of` maps to steps; without it only objects a tier record names count), then the newest step
    every rank can load, and this rank's fastest tier for it. A copy or replica that fails its checksum is left out,
    loudly. A rank that fails to list makes every rank raise (no rank waits in the collective). Outside a process
    group, this process alone decides. Package-internal (docs/api.md)."""
    directory = _urls.normalize_s3_url(directory).rstrip("/")
    node, held, verified = _process.node_key(), {}, {}

    def candidates() -> dict[str, Any]:
        s3_steps = {
            f"s3://{obj.bucket}/{obj.key}": step_of(obj.key.rsplit("/", 1)[-1]) if step_of is not None else None
            for obj in listing()
        }
        held.update({entry[0]: entry for entry in held_replicas(tier)})
        return _my_candidates(tier, replication, directory, s3_steps, list(held.values()), verified)

    gathered, rank = gather_candidates(candidates, directory, group, tier)
    mine = gathered[rank]
    steps, options = decide(gathered, rank)
    addresses = {entry["node"]: tuple(entry["address"]) for entry in gathered if entry["address"]}
    remote = {h[0]: (e["node"], h) for e in gathered if e["node"] != node and e["node"] in addresses
              for h in e["held"]}  # fmt: skip
    sources, urls, committed = {}, {}, {}
    for step in steps:
        speed, url, tier_name = options[step][0]
        urls[step] = url
        committed[url] = float(mine["own"].get(url, [None, 0.0])[1])
        if speed == 0:
            sources[url] = ResumeSource(url, "memory", tier.path_of(url))
        elif speed == 1:
            sources[url] = ResumeSource(url, "replica", held[url][5])
        elif speed == 2:
            node, entry = remote[url]
            sources[url] = ResumeSource(url, "replica", None, addresses[node], entry[3], entry[4])
    newest = steps[0] if steps else None
    url = urls.get(newest) if newest is not None else None
    tier.pin([url] if url in sources else [])  # the copy to load stays until this rank saves again (`unpin`)
    tier_name = None if url is None else (sources[url].tier if url in sources else "s3")
    if url is not None:
        logger.info("memory tier: every rank resumes step %s; this rank reads %s from %s", newest, url, tier_name)
    return TierAgreement(directory, newest, url, tier_name, steps, urls, committed, sources, verified)


def fetch_replica(tier: NodeTier, source: ResumeSource) -> TierCopy:
    """Fetch the replica `source` names from its node into this node's memory tier (a replaced node's resume):
    verified on arrival against its manifest, then against its commit record, then committed as this node's own
    copy. Raises `s3_tier_replication.ReplicationError` or `s3_utils.ChecksumMismatchError` (nothing left behind).
    Package-internal (docs/api.md)."""
    module = _replication_module()
    launch = tier.run.run_id if tier.run.job else None
    landing = tier.directory / f"fetched-{secrets.token_hex(4)}"
    try:
        module.fetch_directory(source.peer, sender_node=source.sender_node, name=source.name, dest=landing,
                               job=tier.job, launch=launch)  # fmt: skip
        record_path = next(landing.glob(f"*{COMMIT_RECORD_SUFFIX}"))
        record = _read_json(record_path)
        if record is None or record.get("url") != source.url:
            raise _s3.ChecksumMismatchError(f"the replica {source.name} of {source.url} has no matching record")
        fetched = landing / record_path.name.removesuffix(COMMIT_RECORD_SUFFIX)
        _verify_against_record(fetched, record, "the fetched replica")
        path = tier.path_of(source.url)
        _private_directory(path.parent)
        with tier._lock:  # this module's own class
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tier.record_path(path))
            os.rename(fetched, path)
            os.rename(record_path, tier.record_path(path))
    finally:
        shutil.rmtree(landing, ignore_errors=True)
    copy = tier.copy_of(source.url)
    if copy is None:
        raise _s3.ChecksumMismatchError(f"the replica of {source.url} fetched from {source.peer} did not commit")
    return copy


def copy_to_load(tier: NodeTier, agreement: TierAgreement | None, url: str) -> tuple[TierCopy | None, str]:
    """The verified copy a load of `url` reads and its tier name: where the ranks agreed to read it (`agreement`), a
    replica held here or fetched from another node (a replaced node), else this node's memory copy (None: none;
    verified once: by the agreement if it verified this very file, else here). Raises
    `s3_utils.ChecksumMismatchError` or `s3_tier_replication.ReplicationError` for one that does not verify.
    Package-internal (docs/api.md)."""
    source = agreement.sources.get(url) if agreement is not None else None
    if source is not None and source.tier == "replica" and source.peer is not None:
        return fetch_replica(tier, source), "replica"
    if source is not None and source.tier == "replica":
        return tier.verified_replica(source.path), "replica"
    trusted = agreement.verified.pop(url, None) if agreement is not None else None
    return tier.verified_copy(url, trusted), "memory"
