"""What the processes of a job on one host share through /dev/shm: the request pacer's state and checkpoint loads.

An optional sibling of the core modules (README.md's fork table), in the
``s3_dcp`` pattern: the core imports it on first use (`s3_process.node_sharing`) and works without it, with a pacer
per process (as ``S3CKPT_PACER_SHARING=0``) and one download per rank (as ``load_sharing="rank"``), and one warning
when a job of more than one process runs without it. Copy this file beside the core ones for multi-node scale.

1. Files the host's processes share: `create_shared_file` (exclusive, mode 0600), `open_shared_file` (only such a
   file of this user) and `remove_unheld_shared_files` (what killed jobs left).
2. The host's shared pacer state: `SharedPacerFile`, one small mapped file per job, endpoint and bucket holding the
   lanes of `s3_pacing.RequestPacer` for all of the job's processes on the host (`shared_pacer_file`).
3. Load sharing: `download_shared`, one download per node (``load_sharing="node"``) or per job (``"job"``) of a
   checkpoint every rank loads at once, into a file the node's ranks map (`SharedCheckpointFile`).

Everything this module creates on the host is created exclusively (O_CREAT | O_EXCL | O_NOFOLLOW) with mode 0600:
readable by the job's user only.

Package-internal (docs/api.md): the core calls it; users reach it through ``load_sharing`` and the pacer.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import json
import logging
import math
import mmap
import os
import secrets
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

try:
    import fcntl
except ImportError:  # not on POSIX: nothing is shared (a pacer per process, a download per rank)
    fcntl = None  # type: ignore[assignment]

if __package__:
    from . import s3_pacing as _pacing
    from . import s3_process as _process
    from . import s3_utils as _s3
else:  # installed (or copied) as a top-level module
    import s3_pacing as _pacing
    import s3_process as _process
    import s3_utils as _s3

if TYPE_CHECKING:
    from s3_checkpoint_io import S3CheckpointIO

__all__: list[str] = []  # no public names: see docs/api.md
__version__ = _s3.__version__

logger = logging.getLogger(__name__)


def _torch() -> Any:
    return _process.import_optional_dependency("torch", "load sharing")


# --------------------------------------------------------------------------------------------------------------------
# Files the host's processes share (/dev/shm)
# --------------------------------------------------------------------------------------------------------------------


def create_shared_file(path: str) -> int:
    """Create `path` (a file other processes of this user on the host will open, in /dev/shm) for reading and
    writing, failing if anything (a file, a link) is there already: O_CREAT | O_EXCL | O_NOFOLLOW, mode 0600."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
    except OSError:
        os.close(fd)
        raise
    return fd


def open_shared_file(path: str, flags: int = os.O_RDONLY, identity: tuple[int, int] | None = None) -> int:
    """Open a file another process of this user made with `create_shared_file`, refusing a link (O_NOFOLLOW),
    anything but a regular file of this user with mode 0600 (fstat), and with `identity` (its
    ``(st_dev, st_ino)``) any other file; PermissionError names the path."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    found = os.fstat(fd)
    if (
        not stat.S_ISREG(found.st_mode)
        or found.st_uid != os.geteuid()
        or stat.S_IMODE(found.st_mode) != 0o600
        or (identity is not None and (found.st_dev, found.st_ino) != identity)
    ):
        os.close(fd)
        raise PermissionError(
            f"{path} is not a file this user's processes created (owner {found.st_uid}, mode "
            f"{stat.S_IMODE(found.st_mode):o}); remove it if it is stale"
        )
    return fd


def _lock(fd: int) -> None:
    """Take the pacer file's state lock: a POSIX record lock on its first byte (held by the process; its threads are
    kept apart by `SharedPacerFile`'s thread lock). The flock on the same file says who uses it."""
    fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0)


def _unlock(fd: int) -> None:
    fcntl.lockf(fd, fcntl.LOCK_UN, 1, 0)


def _identity(found: os.stat_result) -> tuple[int, int]:
    return found.st_dev, found.st_ino


def remove_unheld_shared_files(
    directory: str, prefix: str, keep: Callable[[os.stat_result], bool], *, record_lock: bool = False
) -> list[str]:
    """Unlink this user's regular files named `prefix`... in `directory` that no process uses and `keep` does not
    keep; returns their paths. Every user of such a file holds a flock on it (a shared one), so a file whose
    exclusive flock can be taken is one that killed processes, or processes that skipped their exit handlers, left.
    With `record_lock`, its POSIX record lock must be free too (held while a file is set up). Links, other users'
    files and a file replaced between the look and the open are left alone."""
    removed: list[str] = []
    if fcntl is None:
        return removed
    try:
        entries = [entry for entry in os.scandir(directory) if entry.name.startswith(prefix)]
    except OSError:
        return removed
    for entry in entries:
        try:
            seen = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(seen.st_mode) or seen.st_uid != os.geteuid() or keep(seen):
                continue
            fd = os.open(entry.path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if _identity(os.fstat(fd)) == _identity(seen):
                if record_lock:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while any process uses it
                os.unlink(entry.path)
                removed.append(entry.path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _path_identity(path: str) -> tuple[int, int] | None:
    try:
        return _identity(os.stat(path, follow_symlinks=False))
    except OSError:
        return None


# --------------------------------------------------------------------------------------------------------------------
# The host's shared pacer state
# --------------------------------------------------------------------------------------------------------------------
#
# Why: a per-process pacer learns from its own answers only (a rank of a large job sees few), and every process's
# first burst goes out unpaced even after its neighbours were told to slow down. The processes of one job on one host
# (the ranks of a node) therefore share one pacer state per endpoint and bucket: one token bucket per lane, whose
# rate every rank's answers adapt, and whose first throttling answer wakes pacing in all of them.
# How: a small file in `PACER_SHARED_DIR` (/dev/shm) per (user, job, endpoint, bucket), mmap'd, its state guarded
# by a POSIX record lock on its first byte plus a thread lock (a record lock belongs to the process, not a thread).
# It is created exclusively (`create_shared_file`: O_CREAT | O_EXCL | O_NOFOLLOW, mode 0600); another process opens
# it with O_NOFOLLOW and checks with fstat that it is a regular file of this user with mode 0600
# (`open_shared_file`); anything else (no /dev/shm, another owner, a link, a file that never gets initialised) is
# logged once and the process keeps a pacer of its own. The file lists the pids using it (dead ones are pruned every
# few seconds): their count is the lane's scale. Each user also holds a shared flock on the file: the last one to
# leave (at exit) unlinks it, and one that finds nobody holding it (every user was killed) resets it to dormant. The
# job is told apart by the launcher's environment (`s3_process.job_key`); a process outside any launcher keeps a pacer
# of its own. A job whose processes were killed or left through os._exit (multiprocessing children skip exit handlers)
# leaves its file (`SharedPacerFile.SIZE`, 1,744 bytes, per job, endpoint and bucket) until the next job of the
# same user on the host creates one: it removes every pacer file nobody holds (`_remove_unused_pacer_files`).

PACER_SHARED_DIR = "/dev/shm"
"""Where the shared pacer files live (a tmpfs every process of a host sees)."""
_PACER_FILE_PREFIX = "s3ckpt-pacer-"


class SharedPacerFile:
    """One host's pacer state for one (job, endpoint, bucket): a header (magic, version, the processes using it) and
    one block per lane, read and written under `locked`. Only a lane's ``active`` byte is read without the lock."""

    MAGIC = b"S3CKPAC1"
    VERSION = 1
    HEADER = struct.Struct("<8sII d")  # magic, version, pid count, when the pids were last checked
    PIDS = struct.Struct("<128i")
    LANE = struct.Struct("<B7x 7d 2Q 2I 64d")
    """active; rate, tokens, refilled_at, epoch, changed_at, streak, last_success; throttles, activations; the ring
    of send times (next index, count) and its 64 times."""
    HEADER_AT, PIDS_AT = 0, 32
    LANES_AT = PIDS_AT + PIDS.size
    SIZE = LANES_AT + 2 * LANE.size
    PRUNE_EVERY_S = 5.0

    def __init__(self, path: str, fd: int, mm: mmap.mmap) -> None:
        self.path, self._fd, self._mm = path, fd, mm
        self._thread_lock = threading.Lock()
        self.processes = 1
        """Processes using the file, as of the last `locked` section (the host lane's scale)."""
        self.closed = False

    @classmethod
    def path_for(cls, key: str) -> str:
        """The file of `key` (job, endpoint and bucket, or spread prefix) for this user."""
        digest = hashlib.sha256(key.encode()).hexdigest()[:24]
        return os.path.join(PACER_SHARED_DIR, f"{_PACER_FILE_PREFIX}{os.geteuid()}-{digest}")

    @classmethod
    def attach(cls, key: str) -> SharedPacerFile:
        """Create or open the file for `key` and register this process in it; raises OSError on anything unsafe."""
        if fcntl is None:
            raise OSError("no fcntl on this platform")
        if not os.path.isdir(PACER_SHARED_DIR):
            raise FileNotFoundError(f"{PACER_SHARED_DIR} is not a directory")
        path = cls.path_for(key)
        for _ in range(20):  # a file unlinked by its last user while we opened it: open the new one
            try:
                fd = create_shared_file(path)
                created = True
            except FileExistsError:
                fd = open_shared_file(path, os.O_RDWR)
                created = False
            try:
                shared = cls._open(path, fd, created)
            except BaseException:
                os.close(fd)
                raise
            if shared is not None:
                if created:  # a new job on this host: a good time to remove what killed or exited ones left
                    _remove_unused_pacer_files(skip=path)
                return shared
            os.close(fd)
        raise OSError(f"{path} kept being replaced while this process opened it")

    @classmethod
    def _open(cls, path: str, fd: int, created: bool) -> SharedPacerFile | None:
        if created:
            _lock(fd)
            os.ftruncate(fd, cls.SIZE)
        else:
            deadline = time.monotonic() + 2.0
            while True:  # the creator initialises the file under the lock, right after creating it
                _lock(fd)
                found = os.fstat(fd)
                if found.st_nlink == 0:
                    _unlock(fd)
                    return None  # its last user unlinked it: start over
                if found.st_size == cls.SIZE and os.pread(fd, len(cls.MAGIC), 0) == cls.MAGIC:
                    break
                _unlock(fd)
                if time.monotonic() > deadline:
                    raise OSError(f"{path} is not a pacer file of this version (size {found.st_size})")
                time.sleep(0.01)
        try:
            mm = mmap.mmap(fd, cls.SIZE)
            shared = cls(path, fd, mm)
            try:  # the flock says "in use"; the state lock (lockf) is another kind of lock on the same file
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                alone = True  # nobody uses it: new, or left by killed processes: start dormant
            except BlockingIOError:
                alone = False
            if alone:
                mm[:] = bytes(cls.SIZE)
                cls.HEADER.pack_into(mm, cls.HEADER_AT, cls.MAGIC, cls.VERSION, 0, 0.0)
            fcntl.flock(fd, fcntl.LOCK_SH)
            if not shared._register(os.getpid()):
                raise OSError(f"{path} has no room for another process")
        finally:
            _unlock(fd)
        return shared

    def _pids(self) -> list[int]:
        return list(self.PIDS.unpack_from(self._mm, self.PIDS_AT))

    def _register(self, pid: int) -> bool:
        pids = self._pids()
        if pid not in pids:
            if 0 not in pids:
                self._prune(pids)
            if 0 not in pids:
                return False
            pids[pids.index(0)] = pid
            self.PIDS.pack_into(self._mm, self.PIDS_AT, *pids)
        self._count(pids, time.monotonic())
        return True

    def _prune(self, pids: list[int]) -> None:
        for n, pid in enumerate(pids):
            if pid:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    pids[n] = 0
                except OSError:
                    pass  # alive, someone else's (cannot happen for a 0600 file; kept as alive)
        self.PIDS.pack_into(self._mm, self.PIDS_AT, *pids)

    def _count(self, pids: list[int], now: float) -> None:
        magic, version, _, _ = self.HEADER.unpack_from(self._mm, self.HEADER_AT)
        self.processes = max(1, sum(1 for pid in pids if pid))
        self.HEADER.pack_into(self._mm, self.HEADER_AT, magic, version, self.processes, now)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the state: this process's threads, then the host's processes; refresh the process count."""
        with self._thread_lock:
            _lock(self._fd)
            try:
                _, _, processes, checked = self.HEADER.unpack_from(self._mm, self.HEADER_AT)
                now = time.monotonic()
                if now - checked > self.PRUNE_EVERY_S:
                    pids = self._pids()
                    self._prune(pids)
                    self._count(pids, now)
                else:
                    self.processes = max(1, processes)
                yield
            finally:
                _unlock(self._fd)

    def active_flag(self, lane: int) -> tuple[mmap.mmap, int]:
        """The mapping and offset of the lane's ``active`` byte: a dormant lane's whole cost per request is reading
        it (no lock, no call)."""
        return self._mm, self.LANES_AT + lane * self.LANE.size

    def last_success(self, lane: int) -> float:
        """The host's last success through the lane (no lock: a stale value only delays giving up)."""
        (value,) = struct.unpack_from("<d", self._mm, self.LANES_AT + lane * self.LANE.size + 8 + 6 * 8)
        return value

    def load(self, lane: int) -> _pacing.PacerLaneState:
        """The lane's state (under `locked`)."""
        values = self.LANE.unpack_from(self._mm, self.LANES_AT + lane * self.LANE.size)
        count = values[11]  # values[10], the ring's next index, is unused: the ring is stored oldest first
        return _pacing.PacerLaneState(bool(values[0]), *values[1:10], sends=tuple(values[12 : 12 + count]))

    def store(self, lane: int, state: _pacing.PacerLaneState) -> None:
        """Write the lane's state (under `locked`): an infinite rate (dormant) is stored as 0, the newest 64 sends."""
        sends = state.sends[-64:]
        rate = state.rate if math.isfinite(state.rate) else 0.0
        self.LANE.pack_into(
            self._mm,
            self.LANES_AT + lane * self.LANE.size,
            state.active,
            rate,
            *state[2:10],
            0,
            len(sends),
            *sends,
            *[0.0] * (64 - len(sends)),
        )

    def close(self) -> None:
        """Leave: take this process out, and unlink the file if no other process uses it."""
        if self.closed or fcntl is None:
            return
        self.closed = True
        with self._thread_lock:
            try:
                _lock(self._fd)
                pids = self._pids()
                if os.getpid() in pids:
                    pids[pids.index(os.getpid())] = 0
                    self.PIDS.pack_into(self._mm, self.PIDS_AT, *pids)
                    self._count(pids, time.monotonic())
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pass  # others still use it
                else:
                    with contextlib.suppress(OSError):
                        if _identity(os.stat(self.path, follow_symlinks=False)) == _identity(os.fstat(self._fd)):
                            os.unlink(self.path)
            except (OSError, ValueError):
                pass
            finally:
                with contextlib.suppress(OSError, ValueError):
                    self._mm.close()
                with contextlib.suppress(OSError):
                    os.close(self._fd)  # releases both locks


def _remove_unused_pacer_files(skip: str) -> list[str]:
    """Unlink this user's pacer files in `PACER_SHARED_DIR` that no process uses: those of jobs whose processes were
    killed or left through ``os._exit`` (multiprocessing's children do), which skip the exit handler that removes
    them. `skip` and the files this process has open are left alone (closing another descriptor of one would drop
    this process's record lock on it)."""
    ours = {_identity(os.fstat(f._fd)) for f in _shared_pacer_files.values() if f is not None and not f.closed}
    removed = remove_unheld_shared_files(
        PACER_SHARED_DIR,
        _PACER_FILE_PREFIX,
        lambda seen: _identity(seen) in ours or _identity(seen) == _path_identity(skip),
        record_lock=True,  # not while someone sets it up
    )
    if removed:
        logger.info(
            "Removed %d unused S3 request pacer file(s) of finished jobs from %s", len(removed), PACER_SHARED_DIR
        )
    return removed


_shared_pacer_files: dict[tuple[int, str], SharedPacerFile | None] = {}
_shared_pacer_problems: set[str] = set()


def _shared_pacer_key(endpoint_url: str | None, bucket: str, partition: str = "") -> str | None:
    """The job's, endpoint's and bucket's key (a spread prefix's after a fourth line: a bucket name has no newline);
    the file's name is its hash (`SharedPacerFile.path_for`), whatever characters a key holds."""
    job = _process.job_key()
    if job is None:
        return None
    return f"{job}\n{endpoint_url or ''}\n{bucket}" + (f"\n{partition}" if partition else "")


def shared_pacer_file(endpoint_url: str | None, bucket: str, partition: str = "") -> SharedPacerFile | None:
    """This process's handle on its host's shared pacer state for the job, endpoint and bucket, or a spread prefix
    of the bucket (`partition`; what `s3_utils.request_pacer` gives its `RequestPacer`); None (with one log line per
    kind of problem) where there is no job or the file cannot be used safely. ``S3CKPT_PACER_SHARING=0`` is checked by
    the caller. Package-internal (docs/api.md)."""
    key = _shared_pacer_key(endpoint_url, bucket, partition)
    if key is None:
        return None
    cache_key = (os.getpid(), key)
    if cache_key in _shared_pacer_files:
        return _shared_pacer_files[cache_key]
    try:
        shared: SharedPacerFile | None = SharedPacerFile.attach(key)
    except (OSError, ValueError) as exc:
        shared = None
        problem = f"{type(exc).__name__}: {exc}"
        if problem not in _shared_pacer_problems:
            _shared_pacer_problems.add(problem)
            logger.warning(
                "S3 request pacing for s3://%s/%s: this process paces on its own, not with the other processes of "
                "the job on this host (%s); nothing to do unless S3 throttles this job",
                bucket,
                partition,
                problem,
            )
    _shared_pacer_files[cache_key] = shared
    return shared


@atexit.register
def _leave_shared_pacer_files() -> None:
    for (pid, _), shared in list(_shared_pacer_files.items()):
        if shared is not None and pid == os.getpid():
            shared.close()


# --------------------------------------------------------------------------------------------------------------------
# Load sharing: on a collective resume, one download per node (or per job) instead of one per rank
# --------------------------------------------------------------------------------------------------------------------
#
# Why: Lightning's resume_start loads the checkpoint on every rank, so N ranks made N full downloads of one object
# (about ranks x size / chunk GETs of one key, against S3's 5,500 GET/s per prefix) and held N copies per node.
#
# How (``load_sharing="node"``), when every rank of the default process group loads the same s3:// URL inside
# `S3CheckpointIO.collective_load` (the connector's resume_start enters it, see `collective_resume`):
#   1. three quick all-gathers (no download inside any collective): who is on which node (from the cluster
#      environment, else a host id), then the lowest rank of each node creates two files in /dev/shm (exclusively,
#      O_EXCL | O_NOFOLLOW, mode 0600: data and status), then the node's other ranks open them by name and check that
#      they are those very files (owner, mode, device and inode). Then the names are unlinked: from here on the files
#      live only as long as some rank holds them, so nothing is left in /dev/shm whatever happens later. If any of
#      this fails anywhere (no /dev/shm, ranks that are not really on one host) every rank falls back to its own
#      download, with a warning.
#   2. the node's downloader fetches the object as usual (parallel ranged GETs, checksum verified) into the data file
#      while holding an exclusive flock on it, writes the outcome into the status file, and releases the lock.
#   3. the other ranks of the node poll the status file (no collective, so a long download cannot hit the process
#      group's timeout). A status is the downloader's success or its error (raised on every rank of the node, naming
#      the URL and the cause); a lock they can take while no status was written means the downloader died; a wait
#      longer than the retry policy's budget plus the transfer at a slow rate gives up. All raise instead of hanging.
#   4. every rank torch.load(mmap=True)s the same pages: node RAM holds one copy.
# ``load_sharing="job"``: only global rank 0 downloads; the other nodes' downloaders receive the bytes from it over a
# gloo process group (64 MiB broadcasts, whatever the default backend: NCCL would need each chunk staged on the GPU)
# into their node's file, then steps 3-4 as above. ``"rank"``: every rank downloads (the behaviour without sharing).
# Stale files (a job killed in the milliseconds between creating and unlinking them) are removed by the next
# shared load on that host: files of this prefix, owned by this user, older than a minute, that no process holds.


SHARED_FILE_DIR = "/dev/shm"
_SHARED_FILE_PREFIX = "s3ckpt-load-"
_BROADCAST_CHUNK_BYTES = 64 * _s3.MB
_POLL_INTERVAL_S = 0.05
_STALE_AFTER_S = 60.0
_SLOWEST_TRANSFER_BYTES_PER_S = 10 * _s3.MB
_WAIT_SLACK_S = 30.0


def _describe(exc: BaseException) -> str:
    notes = "; ".join(getattr(exc, "__notes__", []))
    return f"{type(exc).__name__}: {exc}" + (f" ({notes})" if notes else "")


def _wait_budget_s(io: S3CheckpointIO, size: int) -> float:
    """How long a rank waits for its node's downloader: two S3 calls at the retry policy's limit (HEAD, then the
    ranges), each attempt up to the client's timeouts, plus the transfer at a slow rate."""
    settings = io.s3.settings
    per_call = io.s3.retry_policy.max_elapsed_s + settings.read_timeout_s + settings.connect_timeout_s
    return 2 * per_call + _WAIT_SLACK_S + size / _SLOWEST_TRANSFER_BYTES_PER_S


def _remove_stale_shared_files(directory: str, older_than_s: float = _STALE_AFTER_S) -> list[str]:
    """Unlink this user's shared-load files in `directory` that are older than `older_than_s` and that no process
    holds (every process of a live load keeps a lock on them); returns their paths."""
    now = time.time()
    removed = remove_unheld_shared_files(
        directory, _SHARED_FILE_PREFIX, lambda seen: now - seen.st_mtime < older_than_s
    )
    if removed:
        logger.info("Removed %d stale shared checkpoint file(s) of dead jobs from %s", len(removed), directory)
    return removed


@dataclass
class _NodeFiles:
    """This rank's handles on its node's shared files (their names are unlinked once every rank has opened them)."""

    data_fd: int = -1
    status_fd: int = -1
    names: tuple[str, ...] = ()

    def close(self) -> None:
        for fd in (self.data_fd, self.status_fd):
            if fd >= 0:
                os.close(fd)
        self.data_fd = self.status_fd = -1

    def unlink(self) -> None:
        for name in self.names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
        self.names = ()


def _ranks_by_node(node_keys: Iterable[str]) -> dict[str, list[int]]:
    nodes: dict[str, list[int]] = {}
    for rank, key in enumerate(node_keys):
        nodes.setdefault(key, []).append(rank)
    return nodes


def downloading_ranks(node_keys: Sequence[str], load_sharing: str) -> list[int]:
    """The ranks that download from S3 when every rank loads one checkpoint together, the node of rank i being
    `node_keys[i]`: every rank (``"rank"``), the lowest rank of each node (``"node"``), global rank 0 alone (``"job"``
    on more than one node; the other nodes receive the bytes over the process group). What `download_shared` does;
    benchmarks/s3_sim.py counts requests with it."""
    if load_sharing == "rank":
        return list(range(len(node_keys)))
    nodes = _ranks_by_node(node_keys)
    return [0] if load_sharing == "job" and len(nodes) > 1 else [ranks[0] for ranks in nodes.values()]


class _SharedLoad:
    """One collective load of `url` by every rank of the default process group (see the block comment)."""

    def __init__(self, io: S3CheckpointIO, url: str, node_rank: int | None) -> None:
        self.io, self.url, self.node_rank = io, url, node_rank
        self.dist = _torch().distributed
        self.rank = self.dist.get_rank()
        self.files = _NodeFiles()
        self.size: int | None = None
        self.head_error: Exception | None = None

    def _all_gather(self, value: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(gathered, value)
        return gathered

    # ---- step 1: agree on nodes and files (quick collectives) -----------------------------------------------------

    def setup(self) -> bool:
        """Agree who downloads and open the node's files; False (on every rank alike) to fall back to per-rank."""
        head_error = None
        if self.io.load_sharing == "job" and self.rank == 0:
            try:
                self.size = self.io.s3.head_object(self.url).size  # sizes the transfer group's timeout
            except Exception as exc:
                head_error = exc
        head_problem = None if head_error is None else _describe(head_error)
        identity = (_process.node_key(self.node_rank), secrets.token_hex(8), self.size, head_problem)
        identities = self._all_gather(identity)
        if head_error is not None:
            raise head_error
        if identities[0][3] is not None:
            problem = identities[0][3]
            raise _s3.SharedLoadError(
                f"Could not load {self.url}: global rank 0, which downloads it, failed: {problem}"
            )
        self.size = identities[0][2]
        nodes = _ranks_by_node(key for key, *_ in identities)
        self.node_ranks = nodes[identities[self.rank][0]]
        self.node_index = list(nodes).index(identities[self.rank][0])
        self.leader = self.node_ranks[0]
        self.leaders = [ranks[0] for ranks in nodes.values()]
        self.mode = "job" if self.io.load_sharing == "job" and len(nodes) > 1 else "node"
        if self.mode == "node" and all(len(ranks) == 1 for ranks in nodes.values()):
            return False  # one rank per node: nothing to share

        digest = hashlib.sha256(self.url.encode()).hexdigest()[:12]
        job_id = next((value for value in (_process.job_key() or "").split("|") if value), "")  # a readable label
        job = "".join(c for c in job_id if c.isalnum())
        base = os.path.join(SHARED_FILE_DIR, f"{_SHARED_FILE_PREFIX}{job[:24] or 'job'}-{identities[0][1]}")
        base += f"-node{self.node_index}-{digest}"
        created: Any = None
        if self.rank == self.leader:
            created = self._create_files(base)
        try:
            reports = self._all_gather(created)
            problems = [r for rank, r in enumerate(reports) if rank in self.leaders and isinstance(r, str)]
            opened: str | None = None
            if not problems and self.rank != self.leader:
                opened = self._open_files(base, reports[self.leader])
            outcomes = self._all_gather(opened)
        except BaseException:  # a collective failed (a rank died): whoever is left removes the node's names
            self.files.names = (base + ".status", base + ".data")
            self.files.unlink()
            self.files.close()
            raise
        self.files.unlink()  # every rank has the files open, or nobody will use them
        problems += [outcome for outcome in outcomes if outcome]
        if problems:
            self.files.close()
            logger.warning(
                "Loading %s with one download per rank: sharing it through %s failed (%s)",
                self.url,
                SHARED_FILE_DIR,
                problems[0],
            )
            return False
        return True

    def _create_files(self, base: str) -> Any:
        if self.size is None:  # node mode: this node's downloader asks (its failure is reported once sharing is set)
            try:
                self.size = self.io.s3.head_object(self.url).size
            except Exception as exc:
                self.head_error = exc
        if self.size is not None:
            shm = os.statvfs(SHARED_FILE_DIR) if os.path.isdir(SHARED_FILE_DIR) else None
            free = shm.f_bavail * shm.f_frsize if shm else 0
            if free < self.size:  # e.g. a container's default 64 MiB /dev/shm: a per-rank memfd still works
                return (
                    f"{SHARED_FILE_DIR} has {free / _s3.MB:.0f} MiB free on global rank {self.rank}'s node, "
                    f"{self.url} needs {self.size / _s3.MB:.0f} MiB (enlarge it, e.g. docker run --shm-size)"
                )
        _remove_stale_shared_files(SHARED_FILE_DIR)
        names = (base + ".status", base + ".data")
        try:
            self.files.status_fd = create_shared_file(names[0])
            self.files.names = names[:1]
            fcntl.flock(self.files.status_fd, fcntl.LOCK_SH)  # "in use" for `_remove_stale_shared_files`
            self.files.data_fd = create_shared_file(names[1])
            self.files.names = names
            fcntl.flock(self.files.data_fd, fcntl.LOCK_EX)  # released once the status is written: death shows
            found = [os.fstat(fd) for fd in (self.files.status_fd, self.files.data_fd)]
        except OSError as exc:
            self.files.unlink()
            self.files.close()
            return f"global rank {self.rank} could not create {names[0]}: {exc}"
        return [(st.st_dev, st.st_ino) for st in found]

    def _open_files(self, base: str, identities: list[tuple[int, int]]) -> str | None:
        try:
            self.files.status_fd = open_shared_file(base + ".status", identity=tuple(identities[0]))  # type: ignore[arg-type]
            self.files.data_fd = open_shared_file(base + ".data", identity=tuple(identities[1]))  # type: ignore[arg-type]
        except OSError as exc:
            self.files.close()
            return f"global rank {self.rank} could not open the file global rank {self.leader} created: {exc}"
        return None

    # ---- steps 2-4 ------------------------------------------------------------------------------------------------

    def fetch(self) -> SharedCheckpointFile:
        """Download, receive or wait for the checkpoint's bytes (steps 2-3); this rank's handle on the node's file."""
        group = None
        try:
            if self.mode == "job":
                timeout = datetime.timedelta(seconds=_wait_budget_s(self.io, self.size or 0))
                group = self.dist.new_group(ranks=self.leaders, timeout=timeout, backend="gloo")
            if self.rank == 0 or (self.mode == "node" and self.rank == self.leader):
                self._download(group)
                source = "downloaded"
            elif self.rank == self.leader:
                self._receive(group)
                source = "received from global rank 0"
            else:
                self._wait_for_leader()
                source = f"shared by global rank {self.leader}"
            data_fd, self.files.data_fd = self.files.data_fd, -1
        finally:
            self.files.close()
            if group is not None:
                self.dist.destroy_process_group(group)
        return SharedCheckpointFile(self.url, data_fd, os.fstat(data_fd).st_size, source, len(self.node_ranks))

    def _set_status(self, error: BaseException | None) -> None:
        """Tell the node's waiting ranks the outcome, then drop the lock whose release alone would mean "died"."""
        status = {"ok": True} if error is None else {"ok": False, "error": _describe(error)}
        payload = (json.dumps(status) + "\n").encode()
        os.pwrite(self.files.status_fd, payload, 0)
        fcntl.flock(self.files.data_fd, fcntl.LOCK_UN)

    def _download(self, group: Any) -> None:
        io = self.io
        try:
            if self.head_error is not None:
                raise self.head_error
            downloaded = io.s3.download_to_memory(
                self.url, io.chunk_size_MB, io.max_read_concurrency, into_fd=self.files.data_fd
            )
            downloaded.close()  # the pages stay in the node's file, which stays open
        except BaseException as exc:
            self._set_status(exc)
            if group is not None:
                self._broadcast_header(group, ("error", _describe(exc)))
            raise
        self._set_status(None)
        if group is not None:
            size = os.fstat(self.files.data_fd).st_size
            self._broadcast_header(group, ("ok", size))
            self._broadcast_bytes(group, size)

    def _broadcast_header(self, group: Any, header: Any) -> Any:
        message = [header]
        self.dist.broadcast_object_list(message, src=0, group=group)
        return message[0]

    def _broadcast_bytes(self, group: Any, size: int) -> None:
        """Send (rank 0) or receive (the other nodes' downloaders) the data file in bounded broadcasts, straight
        from and into the file's pages through a mapping of one chunk at a time (no staging copy)."""
        torch = _torch()
        for offset in range(0, size, _BROADCAST_CHUNK_BYTES):
            length = min(_BROADCAST_CHUNK_BYTES, size - offset)
            window = mmap.mmap(self.files.data_fd, length, offset=offset)
            try:
                chunk = torch.frombuffer(window, dtype=torch.uint8)
                self.dist.broadcast(chunk, src=0, group=group)
                del chunk
            finally:
                window.close()

    def _receive(self, group: Any) -> None:
        try:
            kind, detail = self._broadcast_header(group, None)
            if kind != "ok":
                raise _s3.SharedLoadError(
                    f"Could not load {self.url}: global rank 0, which downloads it, failed: {detail}"
                )
            os.ftruncate(self.files.data_fd, detail)
            self._broadcast_bytes(group, detail)
        except BaseException as exc:
            if not isinstance(exc, _s3.SharedLoadError):
                exc.add_note(f"while receiving {self.url} from global rank 0 (load_sharing='job')")
            self._set_status(exc)
            raise
        self._set_status(None)

    def _wait_for_leader(self) -> None:
        """Poll the status file until the node's downloader reports, dies, or makes no progress for its budget (a
        throttled download may take long, but the bytes it lands in the shared file show that it is moving)."""
        started, landed = time.monotonic(), -1
        while True:
            raw = os.pread(self.files.status_fd, 1 << 16, 0)
            if raw.endswith(b"\n"):
                status = json.loads(raw)
                if status["ok"]:
                    return
                raise _s3.SharedLoadError(
                    f"Could not load {self.url}: global rank {self.leader}, which downloads it for this node, "
                    f"failed: {status['error']}"
                )
            try:
                fcntl.flock(self.files.data_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pass
            else:  # the downloader's lock is gone: a status written just before counts, else it died
                fcntl.flock(self.files.data_fd, fcntl.LOCK_UN)
                if not os.pread(self.files.status_fd, 1, 0):
                    raise _s3.SharedLoadError(
                        f"Could not load {self.url}: global rank {self.leader}, which was downloading it for this "
                        "node, exited before finishing (killed?). Check that rank's log; restart the job."
                    )
                continue
            stat = os.fstat(self.files.data_fd)
            if stat.st_blocks > landed:
                started, landed = time.monotonic(), stat.st_blocks
            budget = _wait_budget_s(self.io, self.size or stat.st_size)
            if time.monotonic() - started > budget:
                raise _s3.SharedLoadError(
                    f"Could not load {self.url}: global rank {self.leader}, downloading it for this node, has made "
                    f"no progress for {budget:.0f} s (the retry policy's budget plus the transfer at "
                    f"{_SLOWEST_TRANSFER_BYTES_PER_S // _s3.MB} MiB/s); giving up"
                )
            time.sleep(_POLL_INTERVAL_S)


@dataclass
class SharedCheckpointFile:
    """A checkpoint's verified bytes in its node's shared file, open on this rank (the file's name is gone already):
    ``torch.load(mmap=True)`` of `path` maps the node's one copy. Close it (``with``) once loaded."""

    url: str
    fd: int
    size: int
    source: str
    """How this rank got the bytes: ``"downloaded"``, ``"received from global rank 0"`` or ``"shared by global rank
    N"``."""
    node_ranks: int
    """The ranks of this node that share the file."""

    @property
    def path(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SharedCheckpointFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def download_shared(io: S3CheckpointIO, url: str, node_rank: int | None = None) -> SharedCheckpointFile | None:
    """The checkpoint at `url`, downloaded once per node or job as ``io.load_sharing`` says (see the block comment
    above); None where every rank should download its own (``"rank"``, one rank per node, no usable /dev/shm: said
    in a warning). A collective call: every rank of the default process group makes it with the same URL.
    `node_rank`: this rank's node (default: `s3_process.node_key`). Raises `s3_utils.SharedLoadError` when
    the rank that downloads for this one fails, dies or takes too long. Package-internal (docs/api.md)."""
    if io.load_sharing == "rank" or fcntl is None:
        return None
    dist = _torch().distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    shared = _SharedLoad(io, url, node_rank)
    if not shared.setup():
        return None
    return shared.fetch()
