"""A copy of each node's in-memory checkpoint on another node: the memory tier's replicas.

An optional sibling of the core modules (standard library, `s3_utils` for checksums and this process's identity,
`s3_fencing` for the root's lock; torch.distributed only for `exchange_addresses`, imported on first use). The memory
tier (`s3_memory_tier`) calls it; nothing in the core needs it.

1. Names, manifests and launches: what a replica is called, the manifest it is verified against (relative path ->
   ``(size, "<ALGORITHM> <value>")``, the spelling of the package's checksum records) and the order of launches.
2. The wire: length-prefixed JSON messages, then raw file bytes streamed in `CHUNK` pieces (never a whole file in
   memory), every byte checksummed on arrival.
3. `ReplicaServer`: one per node (the node's first rank runs it), a daemon thread that receives replicas from peers
   into ``root/<sender_node>/<name>/``, answers which it holds, and sends them back (`fetch_directory`).
4. The client calls: `send_directory`, `fetch_directory`, `list_replicas`.
5. Topology: `peer_of` (a ring, so odd node counts work) and `exchange_addresses` (through the process group).

How a replica counts: it is written into a temporary sibling (``.incoming-...``, mode 0700, files 0600), every file
verified against the manifest (size and checksum), renamed into place, and only then its manifest written beside it
(``<name>.replica.json``): a replica counts once its manifest is there. A replica that fails verification never
counts (removed, logged, the sender told why); a transfer cut short is removed by the server, or, where the server
itself died, by the next one on that root. Replicas live in memory like the tier: they survive a process restart,
not a reboot.

Threat model (as torch's TCPStore and the process group's own transport): the job's network is trusted. Every
request carries the job and launch and an HMAC over the server's one-time nonce, keyed by ``S3CKPT_REPLICA_SECRET``
when the environment sets it (the same value on every node: then only holders of the secret can write or read
replicas) and else by the job's identity, which refuses other jobs and confused peers but is no secret. File bytes
are verified by checksums, not signed. Fencing: the server refuses a replica whose launch is older than the newest
launch it has seen for that sender, or than its own (a straggler of an older launch cannot overwrite a newer
launch's replicas); reads (fetch, list) need the job only. A node's replica root belongs to the newest launch that
started a server on it (a launch record in the root, written under a short lock): a newer launch's server takes the
root over from an older one's, even one whose process is stopped or hung, and the older server stores and drops
nothing from then on (checked under the same lock as each commit), while the replicas it received stay, readable to
the newer launch; a server of a launch older than the record's does not start. Two servers of one launch on one root
are refused (each would remove the other's transfers in flight). Launches are spelled as
`s3_fencing.LaunchIdentity.run_id` (``<job>#<attempt>``), ordered by the attempt; None (outside any launcher) has
nothing to fence.

Timeouts: every socket operation gives up after `timeout_s` without progress, so a dead or stopped peer costs at
most that long; the caller's thread is never held longer than its own send.

Package-internal (docs/api.md) but for its two errors: users reach it through `S3CheckpointIO.start_replication`.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import select
import shutil
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

try:
    import fcntl
except ImportError:  # not on POSIX: no lock against a second server on one root
    fcntl = None  # type: ignore[assignment]

if __package__:
    from . import s3_fencing as _fencing
    from . import s3_process as _process
    from . import s3_utils as _s3
else:  # installed (or copied) as top-level modules
    import s3_fencing as _fencing
    import s3_process as _process
    import s3_utils as _s3

__all__ = [
    "ReplicaRefusedError",
    "ReplicationError",
]
__version__ = _s3.__version__

logger = logging.getLogger(__name__)

CHUNK = 8 * _s3.MB  # the piece of a file in memory at once, on either side
DEFAULT_TIMEOUT_S = 60.0  # seconds without progress on a socket before a transfer fails
SECRET_ENV = "S3CKPT_REPLICA_SECRET"  # an optional shared secret, the same on every node of the job
HOST_ENV = "S3CKPT_REPLICA_HOST"  # the node's address its replica server listens on (`job_network_host`)
# package-internal (docs/api.md)
MANIFEST_SUFFIX = ".replica.json"  # ``root/<sender_node>/<name>.replica.json``: the replica counts once it is there
PROTOCOL = 1
_MAGIC = b"S3RP"
_FRAME = struct.Struct(">4sI")
_MAX_MESSAGE = 64 * _s3.MB  # a manifest of very many files still fits
_INCOMING = ".incoming-"  # temporaries; names may not start with a dot, so they never collide
_LOCK_NAME = ".s3ckpt-replicas.lock"  # the short lock around the launch record and each commit
_LAUNCH_RECORD = ".s3ckpt-replicas.launch.json"  # {"launch": ...}: the newest launch that claimed the root
_SERVER_LOCK = ".s3ckpt-replicas-{}.lock"  # held for its life by the one server of a launch (a digest of it)
_MAX_CONNECTIONS = 8

Manifest = Mapping[str, tuple[int, str]]
Address = tuple[str, int]


class ReplicationError(OSError):
    """A replica could not be sent, fetched or listed (the peer died, timed out, or is unreachable)."""


class ReplicaRefusedError(ReplicationError):
    """The peer refused: another job, an older launch, a replica that failed verification, or none held."""


# --------------------------------------------------------------------------------------------------------------------
# Names, manifests and launches
# --------------------------------------------------------------------------------------------------------------------


def _component(what: str, value: Any) -> str:
    """`value` if it is a usable single path component (no separators, not hidden: dots are ours), else ValueError."""
    if not isinstance(value, str) or not value or len(value) > 200 or "/" in value or "\0" in value:
        raise ValueError(f"{what} {value!r} is not a name of at most 200 characters without '/'")
    if value.startswith("."):
        raise ValueError(f"{what} {value!r} starts with a dot (reserved for the replica server's own files)")
    return value


def _relative(path: Any) -> str:
    """`path` if it is a relative POSIX path inside a checkpoint directory (no ``..``, no empty parts)."""
    parts = path.split("/") if isinstance(path, str) else None
    if not parts or "\0" in path or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"manifest path {path!r} is not a relative path inside the checkpoint directory")
    return path


def _group(value: Any) -> str | None:
    """`value` if it is a usable retention group (a string of at most 2000 characters, a checkpoint's URL say) or
    None, else ValueError."""
    if value is None or (isinstance(value, str) and 0 < len(value) <= 2000 and "\0" not in value):
        return value
    raise ValueError(f"retention group {value!r} is not a non-empty string of at most 2000 characters")


def _checksum_parts(text: Any) -> tuple[_s3.ChecksumAlgorithm, str]:
    """The algorithm and value of a checksum spelled ``"<ALGORITHM> <value>"`` (as the package's records)."""
    name, _, value = text.partition(" ") if isinstance(text, str) else ("", "", "")
    if not value:
        raise ValueError(f"checksum {text!r} is not spelled '<ALGORITHM> <base64 value>' (e.g. 'CRC32C AAAAAA==')")
    return _s3.ChecksumAlgorithm.named(name), value


def _checked_manifest(manifest: Any) -> dict[str, tuple[int, str]]:
    """The manifest as a plain dict in a fixed order, every entry checked; ValueError naming the first bad one."""
    if not isinstance(manifest, Mapping):
        raise ValueError(f"a manifest maps relative paths to (size, checksum), not {type(manifest).__name__}")
    checked: dict[str, tuple[int, str]] = {}
    for path in sorted(manifest):
        entry = manifest[path]
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise ValueError(f"manifest entry of {path!r} is not (size, checksum): {entry!r}")
        size, checksum = entry
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"manifest entry of {path!r} has no valid size: {size!r}")
        _checksum_parts(checksum)
        checked[_relative(path)] = (size, checksum)
    names = set(checked)
    clashes = [path for path in checked if any(parent in names for parent in _parents(path))]
    if clashes:
        raise ValueError(f"manifest path {clashes[0]!r} lies inside another listed file")
    return checked


def _parents(path: str) -> list[str]:
    return [str(parent) for parent in PurePosixPath(path).parents if str(parent) != "."]


def launch_attempt(launch: str | None) -> tuple[int, ...] | None:
    """The order of a launch spelled ``<job>#<attempt>`` (`s3_fencing.LaunchIdentity.run_id`, e.g. ``slurm:42#1.-1``):
    its attempt numbers, higher is later; None for None (outside any launcher). ValueError for another spelling."""
    if launch is None:
        return None
    job, hash_sign, attempt = launch.rpartition("#") if isinstance(launch, str) else ("", "", "")
    try:
        if not hash_sign or not job:
            raise ValueError
        return tuple(int(part) for part in attempt.split(".")) if attempt else ()
    except ValueError:
        raise ValueError(
            f"launch {launch!r} is not spelled '<job>#<attempt>' (s3_fencing.LaunchIdentity.run_id)"
        ) from None


def _older(launch: str | None, newest: str | None) -> bool:
    """Whether `launch` is older than `newest` (a known launch beats none; None against None is no order)."""
    if newest is None:
        return False
    if launch is None:
        return True
    return launch_attempt(launch) < launch_attempt(newest)  # type: ignore[operator]


@dataclass(frozen=True)
class ReplicaInfo:
    """One replica a server holds: whose, which checkpoint, from which job and launch, its files, and where.
    Package-internal (docs/api.md)."""

    sender_node: str
    name: str
    job: str
    launch: str | None
    files: dict[str, tuple[int, str]]  # the manifest it was verified against
    received: float  # epoch seconds when it counted
    path: str  # its directory on the server's host
    group: str | None = None  # what `keep` counts it with (one checkpoint's files: a DCP rank's); None: by itself

    @property
    def nbytes(self) -> int:
        return sum(size for size, _ in self.files.values())

    def record(self) -> dict[str, Any]:
        """The JSON form (the manifest beside the replica, and `list_replicas`' answer)."""
        return {
            "format": "s3ckpt-replica", "version": PROTOCOL, "sender_node": self.sender_node, "name": self.name,
            "job": self.job, "launch": self.launch, "received": self.received, "path": self.path,
            "files": {path: list(entry) for path, entry in self.files.items()}, "group": self.group,
        }  # fmt: skip

    @classmethod
    def from_record(cls, record: Any) -> ReplicaInfo:
        if not isinstance(record, dict) or record.get("format") != "s3ckpt-replica":
            raise ValueError("not a replica record")
        launch = record.get("launch")
        launch_attempt(launch)
        return cls(
            _component("sender node", record.get("sender_node")), _component("name", record.get("name")),
            str(record.get("job")), launch, _checked_manifest(record.get("files")),
            float(record.get("received", 0.0)), str(record.get("path", "")), _group(record.get("group")),
        )  # fmt: skip


# --------------------------------------------------------------------------------------------------------------------
# The wire
# --------------------------------------------------------------------------------------------------------------------
#
# A connection: the server sends a hello (protocol, nonce); the client one request (op, job, launch, names, manifest,
# mac); the server an answer ({"ok": true, ...} or {"ok": false, "error": ...}). For ``put`` the file bytes follow
# the server's first answer, in manifest order, and a second answer says whether the replica counts; for ``fetch``
# they follow the answer. A server that refuses mid-stream answers at once and reads on to the end (so the client
# sees the answer, not a reset); a client polls for such an answer between pieces and stops.


def _send_message(sock: socket.socket, message: Mapping[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_FRAME.pack(_MAGIC, len(data)) + data)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock`; ConnectionError if the peer closes first."""
    filled = 0
    while filled < len(view):
        count = sock.recv_into(view[filled:])
        if not count:
            raise ConnectionError(f"the peer closed the connection ({filled} of {len(view)} bytes received)")
        filled += count


def _recv_message(sock: socket.socket) -> dict[str, Any]:
    header = bytearray(_FRAME.size)
    _recv_into(sock, memoryview(header))
    magic, length = _FRAME.unpack(header)
    if magic != _MAGIC or length > _MAX_MESSAGE:
        raise ConnectionError("the peer does not speak the replica protocol (is the address a ReplicaServer's?)")
    data = bytearray(length)
    _recv_into(sock, memoryview(data))
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ConnectionError("the peer sent a malformed message")
    return message


def _secret_key(job: str) -> bytes:
    """The HMAC key: ``S3CKPT_REPLICA_SECRET`` if set, else derived from the job's identity (see the threat model)."""
    secret = os.environ.get(SECRET_ENV, "")
    if secret:
        return hashlib.sha256(b"s3ckpt-replica-secret\0" + secret.encode()).digest()
    return hashlib.sha256(b"s3ckpt-replica-job\0" + job.encode()).digest()


def _mac(job: str, nonce: str, request: Mapping[str, Any]) -> str:
    body = json.dumps({k: v for k, v in request.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(_secret_key(job), nonce.encode() + b"\0" + body.encode(), hashlib.sha256).hexdigest()


def _receive_files(
    sock: socket.socket, directory: Path, manifest: Mapping[str, tuple[int, str]], buffer: memoryview
) -> None:
    """Write the files of `manifest` from `sock` into `directory` (0700 folders, 0600 files), each checksummed as it
    arrives; ReplicaRefusedError for the first file that is corrupt (checksum unlike the manifest's) or that cannot
    be written here (no room: the message says so)."""
    for path, (size, checksum) in manifest.items():
        algorithm, expected = _checksum_parts(checksum)
        target = directory / path
        try:
            for parent in reversed(target.relative_to(directory).parents[:-1]):
                with contextlib.suppress(FileExistsError):
                    (directory / parent).mkdir(mode=0o700)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ReplicaRefusedError(f"cannot write {target}: {exc}") from exc
        value, left = 0, size
        try:
            while left:
                piece = buffer[: min(left, len(buffer))]
                _recv_into(sock, piece)
                value = algorithm.update(piece, value)
                try:
                    written = 0
                    while written < len(piece):
                        written += os.write(fd, piece[written:])
                except OSError as exc:
                    raise ReplicaRefusedError(f"cannot write {target}: {exc}") from exc
                left -= len(piece)
        finally:
            os.close(fd)
        actual = algorithm.encode(value)
        if actual != expected:
            raise ReplicaRefusedError(
                f"file {path!r} ({size} bytes) is corrupt: it arrived with {algorithm.name} {actual}, but the "
                f"manifest says {expected}"
            )


def _send_files(
    sock: socket.socket, directory: Path, manifest: Mapping[str, tuple[int, str]], answered: Callable[[], bool]
) -> None:
    """Stream the files of `manifest` from `directory` (sendfile: no copy through this process), stopping early once
    `answered` says the other side has answered (a refusal)."""
    for path, (size, _) in manifest.items():
        with open(directory / path, "rb") as stream:
            found = os.fstat(stream.fileno()).st_size
            if found != size:
                raise ReplicationError(f"{directory / path} has {found} bytes, but its manifest says {size}")
            offset = 0
            while offset < size:
                count = min(CHUNK, size - offset)
                sent = sock.sendfile(stream, offset, count)
                if sent != count:
                    raise ReplicationError(f"{directory / path} shrank while it was sent ({offset + sent} of {size})")
                offset += count
                if answered():
                    return


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def _remove(*paths: Path | None) -> None:
    """Remove folders moved aside (a replica dropped or replaced); None for none."""
    for path in paths:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)


def _make_private_directory(path: Path) -> None:
    """Create `path` (and parents) with mode 0700, or check that the existing one is a directory of this user."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    found = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or found.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a directory of this user: refusing to keep replicas there")
    if found.st_mode & 0o077:
        os.chmod(path, 0o700)


# --------------------------------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------------------------------


class ReplicaServer:
    """Receives peers' replicas into ``root/<sender_node>/<name>/`` and serves them back; one per node and root.

    A daemon thread accepts connections on `bind_host` (127.0.0.1 by default; on a cluster, the node's address on
    the job's network) and `port` (0: any free port); `address` is what peers connect to (`advertise_host` if
    the bound address is not reachable as such). `job` and `launch` are this process's (see the module's threat
    model). `keep`: at most that many replicas per sender, the newest, the one arriving included (with ``keep >= 2``
    the oldest is dropped as a new one starts to arrive; with 1, once the new one counts), where the replicas a
    sender put in one retention group (`send_directory`'s `group`: the files of one checkpoint) count as one, kept or
    dropped together; None keeps all (`drop` and `keep_latest` bound them by hand). `close` stops it; in-flight
    transfers fail and leave nothing that counts. A second server of the same launch on the same root raises
    RuntimeError, as does one of a launch older than the newest that claimed the root (a straggler's); a newer
    launch's server takes the root over (see the module's fencing), and the replicas received before stay.
    Package-internal (docs/api.md).
    """

    def __init__(
        self,
        root: Path,
        *,
        job: str,
        launch: str | None,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        keep: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not isinstance(job, str) or not job:
            raise ValueError("a ReplicaServer needs the job's identity (a non-empty string)")
        launch_attempt(launch)
        if keep is not None and keep < 1:
            raise ValueError(f"keep={keep}: keep at least one replica per sender, or None for all")
        self.root, self.job, self.launch = Path(root).absolute(), job, launch
        self.keep, self.timeout_s = keep, timeout_s
        self._lock = threading.Lock()
        self._arriving: collections.Counter[tuple[str, str]] = collections.Counter()  # (sender, group) transfers
        self._closed = threading.Event()
        self._connections: set[socket.socket] = set()
        self._slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
        self._newest: dict[str, str | None] = {}  # the newest launch seen per sender (from disk and requests)
        _make_private_directory(self.root)
        self._lock_fd = self._take_root()
        try:
            self._clean_root()
            family = socket.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM)[0][0]  # IPv4 or IPv6
            self._listener = socket.create_server((bind_host, port), family=family, backlog=_MAX_CONNECTIONS)
        except BaseException:
            os.close(self._lock_fd)
            raise
        host, bound_port = self._listener.getsockname()[:2]
        self.address: Address = (advertise_host or host, bound_port)
        self._listener.settimeout(0.5)  # how soon the accept loop notices `close`
        self._thread = threading.Thread(target=self._serve, name=f"s3ckpt-replicas-{bound_port}", daemon=True)
        self._thread.start()
        logger.debug("Replica server for job %s (launch %s) on %s:%d, root %s", job, launch, *self.address, root)

    def __enter__(self) -> ReplicaServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting, end transfers in flight (their temporaries are removed), release the root."""
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (else its 0.5 s timeout does)
        self._thread.join(timeout=5.0)
        self._listener.close()
        with self._lock:
            for connection in list(self._connections):
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + 10.0
        for _ in range(_MAX_CONNECTIONS):  # every handler has finished (each stops at its connection's shutdown)
            self._slots.acquire(timeout=max(0.0, deadline - time.monotonic()))
        os.close(self._lock_fd)

    # ---- what it holds --------------------------------------------------------------------------------------------

    def replicas(self, sender_node: str | None = None) -> list[ReplicaInfo]:
        """The replicas that count (of `sender_node`, or all), oldest first."""
        with self._lock:
            return self._replicas(sender_node)

    def drop(self, sender_node: str, name: str) -> bool:
        """Remove one replica (its manifest first, so it stops counting at once); whether there was one (False,
        logged, once a newer launch took the root over)."""
        with self._lock, self._root_locked():
            if self._refused_by_takeover("drop"):
                return False
            trash = self._retire(_component("sender node", sender_node), _component("name", name))
        _remove(trash)
        return trash is not None

    def keep_latest(self, sender_node: str, keep: int) -> list[str]:
        """Drop all but the `keep` newest replicas of `sender_node` (a retention group counts as one, ranked by its
        newest replica); the names dropped (none, logged, once a newer launch took the root over)."""
        with self._lock, self._root_locked():
            if self._refused_by_takeover("keep_latest"):
                return []
            dropped = self._keep_latest(_component("sender node", sender_node), keep)
        _remove(*dropped.values())
        return list(dropped)

    def _refused_by_takeover(self, what: str) -> bool:
        if taken_over := self._taken_over():
            logger.warning("Replica server %s: no %s: %s", self.root, what, taken_over)
        return bool(taken_over)

    def _replicas(self, sender_node: str | None) -> list[ReplicaInfo]:
        found = []
        senders = [self.root / sender_node] if sender_node else [p for p in self.root.iterdir() if p.is_dir()]
        for sender_dir in senders:
            if not sender_dir.is_dir() or sender_dir.name.startswith("."):
                continue
            for manifest in sender_dir.glob(f"*{MANIFEST_SUFFIX}"):
                info = self._read_manifest(manifest)
                if info is not None and info.job == self.job and (sender_dir / info.name).is_dir():
                    found.append(info)
        return sorted(found, key=lambda info: (info.received, info.sender_node, info.name))

    @staticmethod
    def _read_manifest(path: Path) -> ReplicaInfo | None:
        try:
            info = ReplicaInfo.from_record(json.loads(path.read_bytes()))
        except (OSError, ValueError) as exc:
            logger.warning("Ignoring the unreadable replica manifest %s: %s", path, exc)
            return None
        expected = f"{info.name}{MANIFEST_SUFFIX}"
        return info if path.name == expected and path.parent.name == info.sender_node else None

    def _retire(self, sender_node: str, name: str) -> Path | None:
        """Stop a replica counting (its manifest goes first) and move it aside; where it went (for `_remove`, outside
        the lock), None if there was none."""
        sender_dir = self.root / sender_node
        manifest, directory = sender_dir / f"{name}{MANIFEST_SUFFIX}", sender_dir / name
        counted = manifest.exists()
        manifest.unlink(missing_ok=True)
        if not directory.exists():
            return None
        trash = sender_dir / f"{_INCOMING}{name}-dropped-{secrets.token_hex(4)}"
        os.rename(directory, trash)
        return trash if counted else _remove(trash)

    def _make_room(self, arriving: tuple[str, str], launch: str | None) -> list[Path | None]:
        """Before a replica arrives (`arriving`: its sender and retention group, counted as arriving until
        `_receive` ends): with ``keep >= 2``, retire the oldest groups of the sender so that it holds at most `keep`,
        the groups arriving at once included, and the newest complete one stays while they arrive. With ``keep ==
        1`` the one held stays until its successor counts. What was retired, for `_remove`."""
        sender_node, key = arriving
        with self._lock:
            others = {k for (node, k), count in self._arriving.items() if node == sender_node and count and k != key}
            self._arriving[arriving] += 1
        with self._lock, self._root_locked():
            if self.keep is None or self.keep < 2 or _older(launch, self._newest.get(sender_node)):
                return []  # (a stale launch is refused at its commit: it replaces nothing)
            if self._taken_over():
                return []  # a newer launch's server owns the root: this one drops nothing (refused at its commit)
            found = self._replicas(sender_node)  # one scan of the manifests under the lock
            held = {info.group or f"name {info.name}" for info in found}
            if key in held:
                return []  # another file of a group held, or a replica of the same name sent again
            room = max(1, self.keep - 1 - len(others - held))
            return list(self._keep_latest(sender_node, room, found).values())

    def _keep_latest(
        self, sender_node: str, keep: int, found: list[ReplicaInfo] | None = None
    ) -> dict[str, Path | None]:
        """Retire all but the `keep` newest groups of `sender_node` (`found`: its replicas, scanned under the same
        hold of the root's lock, or None to scan them)."""
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least one replica")
        groups: dict[str, list[ReplicaInfo]] = {}
        for info in self._replicas(sender_node) if found is None else found:  # oldest first: by its newest
            groups.setdefault(info.group or f"name {info.name}", []).append(info)
        ordered = sorted(groups.values(), key=lambda held: (held[-1].received, held[-1].name))
        retired = [info for held in ordered[: max(0, len(ordered) - keep)] for info in held]
        return {info.name: self._retire(sender_node, info.name) for info in retired}

    # ---- start-up: one server per root; what a killed one left ----------------------------------------------------

    def _take_root(self) -> int:
        """Hold this launch's server lock (one server per launch and root) and claim the root for this launch;
        RuntimeError if another server of this launch holds it or a newer launch claimed the root."""
        digest = hashlib.sha256(json.dumps(self.launch).encode()).hexdigest()[:16]
        path = self.root / _SERVER_LOCK.format(digest)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    raise RuntimeError(
                        f"Another ReplicaServer of launch {self.launch!r} (this or another process) holds "
                        f"{self.root}: run one per node and root, or give this one its own root"
                    ) from None
            with self._root_locked():
                owner = self._owner()
                if self.launch is not None and owner is not None and _older(self.launch, owner):
                    raise RuntimeError(
                        f"launch {owner!r} of job {self.job!r} took {self.root} over: this server's launch "
                        f"{self.launch!r} is older (a straggler), so it serves no replicas"
                    )
                self._write_owner()
                for stale in self.root.glob(_SERVER_LOCK.format("*")):  # older launches' (no later one claimed)
                    if stale != path:
                        stale.unlink(missing_ok=True)  # a server still holding it keeps its (unlinked) lock
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _root_locked(self) -> contextlib.AbstractContextManager[None]:
        """The short lock around the launch record and each commit, which a straggler's server stopped inside it
        holds only for `s3_fencing.TAKEOVER_LOCK_WAIT_S` (`s3_fencing.takeover_lock`): a relaunch's server then
        starts and serves rather than give up on this node's replicas."""
        return _fencing.takeover_lock(self.root / _LOCK_NAME, f"replica root {self.root} (launch {self.launch})")

    def _owner(self) -> str | None:
        """The launch the root's launch record names (None: none, or outside any launcher)."""
        try:
            record = json.loads((self.root / _LAUNCH_RECORD).read_bytes())
            launch = record.get("launch") if isinstance(record, dict) else None
            launch_attempt(launch)
            return launch
        except (OSError, ValueError) as exc:
            if not isinstance(exc, FileNotFoundError):
                logger.warning("Ignoring the unreadable replica launch record in %s: %s", self.root, exc)
            return None

    def _write_owner(self) -> None:
        staged = self.root / f"{_LAUNCH_RECORD}-{secrets.token_hex(4)}"
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as stream:
            json.dump({"launch": self.launch, "job": self.job, "pid": os.getpid(), "claimed": time.time()}, stream)
        os.replace(staged, self.root / _LAUNCH_RECORD)

    def _taken_over(self) -> str | None:
        """Why this server may no longer store or drop anything (a newer launch claimed the root), else None; call
        it under `_root_locked` to act on it."""
        owner = self._owner() if (self.root / _LAUNCH_RECORD).exists() else self.launch
        if owner == self.launch:
            return None
        return f"launch {owner!r} took this node's replica root over; launch {self.launch!r} stores nothing here"

    def _clean_root(self) -> None:
        """Remove temporaries, replicas without a manifest and manifests without a replica; learn the launches."""
        for sender_dir in [p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")]:
            for entry in list(sender_dir.iterdir()):
                if entry.name.startswith(_INCOMING):
                    logger.info("Removing %s, left by an interrupted replica transfer", entry)
                    if entry.is_dir():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)
                elif entry.name.endswith(MANIFEST_SUFFIX):
                    info = self._read_manifest(entry)
                    if info is None or not (sender_dir / info.name).is_dir():
                        entry.unlink(missing_ok=True)
                    elif info.job == self.job:
                        self._seen(info.sender_node, info.launch)
                elif entry.is_dir() and not (sender_dir / f"{entry.name}{MANIFEST_SUFFIX}").exists():
                    logger.info("Removing %s: a replica that never counted (no manifest)", entry)
                    shutil.rmtree(entry, ignore_errors=True)

    def _seen(self, sender_node: str, launch: str | None) -> None:
        if sender_node not in self._newest or _older(self._newest[sender_node], launch):
            self._newest[sender_node] = launch

    # ---- connections ----------------------------------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._closed.is_set():
                    return
                logger.error("Replica server %s:%d cannot accept a connection: %s", *self.address, exc)
                time.sleep(0.5)  # out of file descriptors, say: try again rather than stop serving
                continue
            if not self._slots.acquire(blocking=False):
                threading.Thread(target=self._refuse_busy, args=(connection,), daemon=True).start()
                continue
            with self._lock:
                self._connections.add(connection)
            threading.Thread(target=self._handle, args=(connection,), name="s3ckpt-replica-in", daemon=True).start()

    def _refuse_busy(self, connection: socket.socket) -> None:
        with connection, contextlib.suppress(OSError):
            connection.settimeout(self.timeout_s)
            _send_message(connection, {"protocol": PROTOCOL, "nonce": ""})
            _recv_message(connection)
            _send_message(connection, {"ok": False, "error": f"busy ({_MAX_CONNECTIONS} transfers in flight)"})

    def _handle(self, connection: socket.socket) -> None:
        try:
            with connection:
                connection.settimeout(self.timeout_s)
                self._conversation(connection)
        except Exception as exc:  # a peer that died or misbehaves costs its own connection only
            logger.warning("Replica server %s:%d: a connection failed: %s", *self.address, exc)
        finally:
            with self._lock:
                self._connections.discard(connection)
            self._slots.release()

    def _conversation(self, connection: socket.socket) -> None:
        nonce = secrets.token_hex(16)
        _send_message(connection, {"protocol": PROTOCOL, "nonce": nonce})
        request = _recv_message(connection)
        try:
            op, sender_node, launch = self._admit(request, nonce)
        except (ReplicaRefusedError, ValueError) as exc:
            logger.warning("Replica server %s:%d refused a request: %s", *self.address, exc)
            _send_message(connection, {"ok": False, "error": str(exc)})
            return
        if op == "list":
            with self._lock:
                held = self._replicas(sender_node)
            _send_message(connection, {"ok": True, "replicas": [info.record() for info in held]})
        elif op == "fetch":
            self._serve_fetch(connection, sender_node, request.get("name"))
        else:
            self._receive(connection, request, sender_node, launch)

    def _admit(self, request: dict[str, Any], nonce: str) -> tuple[str, str, str | None]:
        """Check a request's protocol, job, signature and (for a put) launch; its op, sender node and launch."""
        if request.get("protocol") != PROTOCOL:
            raise ReplicaRefusedError(f"protocol {request.get('protocol')!r}, this server speaks {PROTOCOL}")
        if request.get("job") != self.job:
            raise ReplicaRefusedError(
                f"the request is of job {request.get('job')!r}, this server keeps replicas of job {self.job!r}"
            )
        if not hmac.compare_digest(str(request.get("mac", "")), _mac(self.job, nonce, request)):
            raise ReplicaRefusedError(f"authentication failed: is {SECRET_ENV} set alike on every node?")
        op, launch = request.get("op"), request.get("launch")
        launch_attempt(launch)
        if op not in ("put", "fetch", "list"):
            raise ReplicaRefusedError(f"unknown request {op!r}")
        sender = request.get("sender_node")
        sender_node = None if op == "list" and sender is None else _component("sender node", sender)
        if op == "put":
            taken_over = self._taken_over()  # before any byte arrives; `_commit` checks again under the root's lock
            if taken_over:
                raise ReplicaRefusedError(taken_over)
            with self._lock:
                newest = self._newest.get(sender_node, self.launch)  # type: ignore[arg-type]
                if _older(launch, newest) or _older(launch, self.launch):
                    raise ReplicaRefusedError(
                        f"launch {launch!r} of {sender_node} is older than launch {newest!r} seen here: "
                        "a straggler of an earlier launch may not replace a newer launch's replicas"
                    )
                self._seen(sender_node, launch)  # type: ignore[arg-type]
        return op, sender_node, launch  # type: ignore[return-value]

    def _receive(
        self, connection: socket.socket, request: dict[str, Any], sender_node: str, launch: str | None
    ) -> None:
        try:
            name = _component("name", request.get("name"))
            manifest = _checked_manifest(request.get("files"))
            group = _group(request.get("group"))
            total = sum(size for size, _ in manifest.values())
            room = shutil.disk_usage(self.root).free
            if total > room:
                raise ReplicaRefusedError(f"{self.root} has {room} bytes free, the replica needs {total}")
        except (ValueError, ReplicaRefusedError) as exc:
            _send_message(connection, {"ok": False, "error": str(exc)})
            return
        sender_dir = self.root / sender_node
        _make_private_directory(sender_dir)
        arriving = (sender_node, group or f"name {name}")
        temporary = sender_dir / f"{_INCOMING}{name}-{secrets.token_hex(4)}"
        temporary.mkdir(mode=0o700)
        started = time.perf_counter()
        try:
            _remove(*self._make_room(arriving, launch))
            _send_message(connection, {"ok": True})
            _receive_files(connection, temporary, manifest, memoryview(bytearray(min(CHUNK, max(total, 1)))))
            info, replaced = self._commit(temporary, sender_node, name, launch, manifest, group)
        except ReplicaRefusedError as exc:
            shutil.rmtree(temporary, ignore_errors=True)
            logger.error("Replica %s/%s refused: %s", sender_node, name, exc)
            self._refuse_and_drain(connection, str(exc))
            return
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
        finally:
            with self._lock:
                self._arriving[arriving] -= 1
        seconds = time.perf_counter() - started
        logger.info(
            "Replica %s/%s counts: %d files, %.1f MiB in %.2f s (%s)",
            *(sender_node, name, len(manifest), total / _s3.MB, seconds, info.path),
        )
        _send_message(connection, {"ok": True, "path": info.path})
        _remove(*replaced)  # after the answer: the sender does not wait for the clean-up

    def _commit(
        self, temporary: Path, sender_node: str, name: str, launch: str | None, manifest: dict[str, tuple[int, str]],
        group: str | None = None,
    ) -> tuple[ReplicaInfo, list[Path | None]]:
        """Rename the verified `temporary` into place and write its manifest beside it (then it counts); the replicas
        it replaced or that `keep` retired, moved aside for `_remove`."""
        if self._closed.is_set():
            raise ReplicationError("the replica server is closing")
        sender_dir = self.root / sender_node
        final = sender_dir / name
        info = ReplicaInfo(sender_node, name, self.job, launch, manifest, time.time(), str(final), group)
        with self._lock, self._root_locked():
            if _older(launch, self._newest.get(sender_node)):
                raise ReplicaRefusedError(f"launch {self._newest.get(sender_node)!r} of {sender_node} began meanwhile")
            taken_over = self._taken_over()
            if taken_over:
                raise ReplicaRefusedError(taken_over)
            replaced = [self._retire(sender_node, name)]
            os.rename(temporary, final)
            staged = sender_dir / f"{_INCOMING}{name}{MANIFEST_SUFFIX}-{secrets.token_hex(4)}"
            fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as stream:
                json.dump(info.record(), stream)
            os.replace(staged, sender_dir / f"{name}{MANIFEST_SUFFIX}")
            if self.keep is not None:
                replaced += self._keep_latest(sender_node, self.keep).values()
        return info, replaced

    def _refuse_and_drain(self, connection: socket.socket, error: str) -> None:
        """Answer a refusal mid-stream, then read what is still on its way (the sender stops at the answer)."""
        with contextlib.suppress(OSError):
            _send_message(connection, {"ok": False, "error": error})
            connection.shutdown(socket.SHUT_WR)
            sink = bytearray(CHUNK)
            while connection.recv_into(sink):
                pass

    def _serve_fetch(self, connection: socket.socket, sender_node: str, name: Any) -> None:
        with self._lock:
            held = {info.name: info for info in self._replicas(sender_node)}
        info = held.get(name) if isinstance(name, str) else None
        if info is None:
            error = f"no replica {name!r} of {sender_node} here (held: {sorted(held) or 'none'})"
            _send_message(connection, {"ok": False, "error": error})
            return
        _send_message(connection, {"ok": True, "replica": info.record()})
        _send_files(connection, Path(info.path), info.files, lambda: self._closed.is_set())


# --------------------------------------------------------------------------------------------------------------------
# The client calls
# --------------------------------------------------------------------------------------------------------------------


def _describe(peer: Address) -> str:
    return f"the replica server at {peer[0]}:{peer[1]}"


@contextlib.contextmanager
def _session(peer: Address, request: dict[str, Any], timeout_s: float, what: str) -> Any:
    """A connection to `peer` that has sent `request` (signed) and got its first answer; errors name the peer."""
    try:
        with socket.create_connection((peer[0], int(peer[1])), timeout=timeout_s) as sock:
            hello = _recv_message(sock)
            if hello.get("protocol") != PROTOCOL:
                raise ConnectionError(f"it speaks replica protocol {hello.get('protocol')!r}, this one {PROTOCOL}")
            request = {"protocol": PROTOCOL, **request}
            request["mac"] = _mac(request["job"], str(hello.get("nonce", "")), request)
            _send_message(sock, request)
            answer = _recv_message(sock)
            if not answer.get("ok"):
                raise ReplicaRefusedError(f"{_describe(peer)} refused {what}: {answer.get('error')}")
            yield sock, answer
    except ReplicationError:
        raise
    except OSError as exc:  # includes timeouts and resets: the peer died, stopped, or is unreachable
        raise ReplicationError(
            f"{what} with {_describe(peer)} failed: {type(exc).__name__}: {exc}. The peer may have died or be "
            f"unreachable (nothing waits longer than {timeout_s:g} s without progress); nothing partial counts there. "
            "Check that the peer's process is alive and its address reachable from this node."
        ) from exc


def _request(job: str, launch: str | None, op: str, sender_node: str | None, name: str | None) -> dict[str, Any]:
    if not isinstance(job, str) or not job:
        raise ValueError("the job's identity (a non-empty string) is needed to talk to a replica server")
    launch_attempt(launch)
    return {"op": op, "job": job, "launch": launch, "sender_node": sender_node, "name": name}


def send_directory(
    src: Path,
    name: str,
    peer: Address,
    *,
    sender_node: str,
    job: str,
    launch: str | None,
    manifest: Mapping[str, tuple[int, str]],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    group: str | None = None,
) -> None:
    """Replicate the files of `manifest` (relative path -> ``(size, "<ALGORITHM> <value>")``) under `src` to `peer`,
    as its replica `name` of `sender_node`; returns once the peer has verified it and it counts there. `group`: the
    retention group the peer's `keep` counts it in (the files of one checkpoint, sent one by one), None: by itself.

    Streams each file in pieces (bounded memory, sendfile). Raises ValueError for a bad name or manifest,
    ReplicaRefusedError when the peer refuses (another job, an older launch, bytes that do not match the manifest),
    ReplicationError when the peer dies, stalls for `timeout_s` or cannot be reached: then no replica counts there
    and the source is untouched. Call it from a background thread: it takes as long as the transfer."""
    src = Path(src)
    request = _request(job, launch, "put", _component("sender node", sender_node), _component("name", name))
    files = _checked_manifest(manifest)
    request["group"] = _group(group)
    for path, (size, _) in files.items():  # before any byte goes out: a wrong manifest is the caller's error
        try:
            found = os.stat(src / path).st_size
        except OSError as exc:
            raise ReplicationError(f"Cannot replicate {src}: {path} listed in its manifest: {exc}") from exc
        if found != size:
            raise ReplicationError(f"Cannot replicate {src}: {path} has {found} bytes, its manifest says {size}")
    request["files"] = {path: list(entry) for path, entry in files.items()}
    what = f"the replica {sender_node}/{name} of {src}"
    started = time.perf_counter()
    with _session(peer, request, timeout_s, what) as (sock, _):
        _send_files(sock, src, files, lambda: _readable(sock))
        answer = _recv_message(sock)
        if not answer.get("ok"):
            raise ReplicaRefusedError(
                f"{_describe(peer)} refused {what}: {answer.get('error')}. Nothing counts there; the next save "
                "replicates again (if it repeats, this node's memory copy or the network corrupts bytes)."
            )
    total = sum(size for size, _ in files.values())
    seconds = time.perf_counter() - started
    logger.debug("Replicated %s (%.1f MiB) to %s:%d in %.2f s", what, total / _s3.MB, *peer, seconds)


def fetch_directory(
    peer: Address,
    *,
    sender_node: str,
    name: str,
    dest: Path,
    job: str,
    launch: str | None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Path:
    """Copy the replica `name` of `sender_node` that `peer` holds into `dest` (which must not exist), verified
    against its manifest as on receipt, and renamed into place only then; returns `dest`.

    For a replaced node's resume. Raises ReplicaRefusedError when the peer holds no such replica (or refuses),
    ReplicationError when the transfer fails or the bytes do not match (nothing is left at `dest`).
    Package-internal (docs/api.md)."""
    dest = Path(dest)
    if dest.exists():
        raise FileExistsError(f"{dest} exists: fetch a replica into a new directory")
    request = _request(job, launch, "fetch", _component("sender node", sender_node), _component("name", name))
    temporary = dest.parent / f"{_INCOMING}{dest.name}-{secrets.token_hex(4)}"
    temporary.mkdir(mode=0o700)
    what = f"fetching the replica {sender_node}/{name}"
    try:
        with _session(peer, request, timeout_s, what) as (sock, answer):
            info = ReplicaInfo.from_record(answer.get("replica"))
            try:
                _receive_files(sock, temporary, info.files, memoryview(bytearray(CHUNK)))
            except ReplicaRefusedError as exc:  # here, not the peer: its copy is corrupt, or this side lacks room
                raise ReplicationError(f"{what} from {_describe(peer)} failed: {exc}") from exc
        os.rename(temporary, dest)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return dest


def list_replicas(
    peer: Address,
    *,
    job: str,
    launch: str | None,
    sender_node: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[ReplicaInfo]:
    """The replicas `peer` holds (of `sender_node`, or all) that count, oldest first (`ReplicaServer.replicas` for
    the node's own server, without the network)."""
    sender = None if sender_node is None else _component("sender node", sender_node)
    with _session(peer, _request(job, launch, "list", sender, None), timeout_s, "listing replicas") as (_, answer):
        return [ReplicaInfo.from_record(record) for record in answer.get("replicas") or []]


# --------------------------------------------------------------------------------------------------------------------
# Topology
# --------------------------------------------------------------------------------------------------------------------


def peer_of(node_index: int, node_count: int) -> int | None:
    """The node that holds node `node_index`'s replica: the next one on a ring, ``(i + 1) % n`` (any n >= 2, odd
    included: node i holds the replica of node i - 1). None for a single node, which has no peer.
    Package-internal (docs/api.md)."""
    if not 0 <= node_index < node_count:
        raise ValueError(f"node index {node_index} is not in 0..{node_count - 1}")
    return None if node_count == 1 else (node_index + 1) % node_count


def job_network_host(environ: Mapping[str, str] | None = None) -> str:
    """This node's address on the job's network, where its replica server listens and peers connect: `HOST_ENV` if
    set, else the local address of this host's route to the job's rendezvous host (``MASTER_ADDR``; a UDP socket's
    connect picks it, sending nothing), else 127.0.0.1 (one host). Package-internal (docs/api.md)."""
    environ = os.environ if environ is None else environ
    if environ.get(HOST_ENV, "").strip():
        return environ[HOST_ENV].strip()
    rendezvous = environ.get("MASTER_ADDR", "").strip()
    if rendezvous:
        try:
            family, _, _, _, address = socket.getaddrinfo(rendezvous, 9, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(address)
                return str(probe.getsockname()[0])
        except OSError as exc:
            logger.warning("memory tier: no route to MASTER_ADDR=%s (%s): replicas listen on 127.0.0.1; set %s to "
                           "this node's address on the job's network", rendezvous, exc, HOST_ENV)  # fmt: skip
    return "127.0.0.1"


def exchange_addresses(group: Any = None, *, server: ReplicaServer | None = None) -> dict[str, Address]:
    """Every node's replica server address, on every rank: a collective of the process group (`group`, default the
    default one) that every rank calls, passing its `server` where it runs one (the node's first rank; others None).

    Keys are `s3_process.node_key` labels, ordered by each node's lowest global rank, so ``list(result).index(key)``
    is a node's index for `peer_of`. A node where no rank serves is left out (with a warning).
    Package-internal (docs/api.md)."""
    dist = _process.import_optional_dependency("torch.distributed", "the replica address exchange")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("exchange_addresses needs an initialised torch.distributed process group")
    mine = (_process.node_key(), None if server is None else list(server.address))
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    nodes: dict[str, Address | None] = {}
    for key, address in gathered:
        if nodes.get(key) is None:
            nodes[key] = None if address is None else (str(address[0]), int(address[1]))
        elif address is not None:
            logger.warning("Node %s runs more than one replica server: using the first one's", key)
    missing = [key for key, address in nodes.items() if address is None]
    if missing:
        logger.warning("No replica server on %s: their checkpoints have no copy on another node", ", ".join(missing))
    return {key: address for key, address in nodes.items() if address is not None}
