"""DCP checkpoints through the memory tier: ``S3StorageWriter(memory_tier=...)``, ``S3StorageReader(memory_tier=...)``.

An optional sibling of `s3_dcp` built on `s3_memory_tier` (a fork without either file gets an ImportError naming it
when it passes ``memory_tier``). docs/tiers.md shows the user's side. In parts:

1. Files: `TierFile`, what the writer streams a ``__{rank}_{n}.distcp`` file into instead of an S3 multipart upload
   (the same bytes and item checksums), committed in the node's tier as one copy per file with its commit record
   (`s3_memory_tier.NodeTier.commit`); the record names the checkpoint (``"checkpoint"``), so `NodeTier.prune`
   keeps or drops a checkpoint's files together. The coordinator's ``.metadata`` and item-checksum record are
   committed the same way, ``.metadata`` last: in memory as on S3, a checkpoint without it is not one.
2. The process's side of the tier: `DcpTier` (one per tier configuration and process): which saves drain (the first,
   then every `MemoryTier.drain_every`-th, or after `MemoryTier.drain_minutes`, decided by the coordinator when it
   plans the save and told to every rank in the plan), the background drains, and the relaunch's finishing of
   drains a kill cut short (`NodeTier.pending_drains`, on each node's first local rank).
3. Draining, without collectives: every rank uploads its own files from their memory pages (`NodeTier.upload`:
   checked against the commit record before S3 commits them), fenced by the coordinator's run. The coordinator
   first removes an older checkpoint's ``.metadata`` at the same prefix (the ranks wait for that before uploading,
   so a half-replaced checkpoint never looks complete), then watches S3 until every file the checkpoint lists is
   there with the recorded size and checksum, and only then uploads the item checksums and ``.metadata`` (then,
   where it replaced a checkpoint, removes the replaced one's shards the new one does not use). So ``.metadata``
   never reaches S3 before its files; a drain that fails or is killed leaves the checkpoint absent from S3 (its
   files orphaned, as a failed S3 save leaves them) until a relaunch finishes it. Watching S3 costs a HEAD per file
   once it is there and one per look while waiting (files are looked for in order), off the training path;
   piggybacking on the next save's plan would instead delay ``.metadata`` until a next save, which the last save of
   a run never has. With prefix spreading a save's files
   keep their spread URLs in memory (``run/s3ckpt-spread-03/step-200/``), their commit records name the save's spread
   directories (``"layout"``), and the layout record goes to S3 before any file goes into one of them
   (`s3_prefix_spreading.ensure_layout`): by each rank before its first file, by the coordinator before it waits.
   A process drains on two threads, its files on one, commits on the other (a commit waiting for other ranks never
   holds up this rank's uploads); a wait gives up after `DRAIN_WAIT_S`, and a drain whose memory copy a newer save
   of the same URL replaced is skipped.
4. Reads: `source_of` gives the reader, per file, where the ranks agreed it reads it (`agree_resume`), else this
   node's verified memory copy, a verified replica held here, or (replicating) this node's replica its peer holds,
   fetched into memory; else None (S3). A copy that fails its checksum is skipped with an error in the log. The
   reader's ``tier_sources`` says where each file came from.

5. Replication and the resume agreement: `start_replication` (the ring of `s3_memory_tier.TierReplication`; each
   file a save commits is sent as a replica of its own, in the retention group of its checkpoint and rank, so the
   peer keeps whole checkpoints) and `agree_resume` (`s3_memory_tier.gather_candidates` and `s3_memory_tier.decide`
   over checkpoints: one all_gather of the files each node reaches, then the newest step every rank can load).
   A checkpoint counts for a rank only when its node reaches every file of it: DCP's load may read another rank's
   file (an item that rank alone saved), and which ones only the load's plan knows. A file only in another node's
   memory is handed over to the node that lacks it (a barrier after the hand-overs, only when there are any), if the
   node holding it replicates; else the checkpoint does not count there (``.metadata`` only in node 0's memory, no
   replication: no other node can load it). Files that follow ``.metadata`` (megatron-core's ``metadata.json``,
   ``common.pt``) are replicated and counted as the checkpoint's others are; ``agree_resume(followers=...)`` names
   those a checkpoint must have to count at all (`s3_mcore.agree_resume` passes megatron-core's).
   `replicate_by_default` is what the Lightning sharded strategies and NeMo 2.x's checkpoint IO call by themselves
   (replication once, in a job of several nodes), and `agree_to_load` over the one checkpoint they are asked to load.

Every rank calls ``S3StorageWriter.finish_drains()`` at the end of a run: the last save drains if it did not, and the
drains' failures are raised there.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__:
    from . import s3_dirpath_utils as _urls
    from . import s3_fencing as _fencing
    from . import s3_memory_tier as _tier
    from . import s3_pacing as _pacing
    from . import s3_prefix_spreading as _spread
    from . import s3_process as _process
    from . import s3_utils as _s3
else:  # installed (or copied) as top-level modules
    import s3_dirpath_utils as _urls
    import s3_fencing as _fencing
    import s3_memory_tier as _tier
    import s3_pacing as _pacing
    import s3_prefix_spreading as _spread
    import s3_process as _process
    import s3_utils as _s3

__all__ = [
    "agree_resume",
    "start_replication",
]  # users reach the rest through S3StorageWriter / S3StorageReader(memory_tier=...)

logger = logging.getLogger(__name__)

ITEMS_SUFFIX = ".s3ckpt-items.json"  # s3_dcp.ITEM_CHECKSUMS_NAME: the item checksums a ``.metadata`` goes with
SHARD_SUFFIX = ".distcp"  # s3_dcp.DCP_SHARD_SUFFIX: a DCP shard's (what a replaced checkpoint's drain removes)
DRAIN_WAIT_S = 1800.0
"""How long the coordinator's drain waits for every listed file to be on S3 before it gives up (no ``.metadata``)."""
_POLL_S = (0.05, 1.0)  # first and longest pause between two looks at S3


def config(value: Any) -> _tier.MemoryTier | None:
    """The `s3_memory_tier.MemoryTier` a ``memory_tier=`` argument means (None: off). Package-internal (docs/api.md)."""
    return _tier.MemoryTier.from_value(value)


@dataclass(frozen=True)
class TierPlan:
    """What the coordinator tells every rank in its save plan: whether this save drains to S3, the run that
    holds the checkpoint directory (every rank's upload is fenced by it), the save's spread directories (prefix
    spreading; none: one prefix), which the layout record on S3 names before any file goes into one of them, and
    the save's place among the saves (`save`, growing; each file's commit record keeps it: once a newer save of a
    checkpoint URL is in a node's tier, `NodeTier.prune` drops the files of the older one it did not rewrite).
    Package-internal (docs/api.md)."""

    drain: bool
    run: _fencing.CheckpointRun
    directories: tuple[str, ...] = ()
    save: int = 0


# --------------------------------------------------------------------------------------------------------------------
# 1. Files
# --------------------------------------------------------------------------------------------------------------------


class TierFile:
    """A DCP file written into the node's tier: what `S3StorageWriter` writes into instead of an
    `s3_utils.S3MultipartWriter` (the same methods it uses), committed by `close` (`abort`: nothing left).

    When the tier has no room for a rank's file (the tmpfs or `MemoryTier.capacity_bytes`), that file goes to S3
    directly instead, what was written first (one warning per tier; fenced by this process's run): the save goes on,
    the tier's older copy of the URL goes (never read for this file), and the coordinator's drain finds the file on S3
    like a drained one. Not so for ``.metadata`` and its item
    checksums (tiny; on S3 they would commit the checkpoint before its files), nor while an older checkpoint's
    ``.metadata`` is at the prefix on S3 (its files would be overwritten under it): the save fails then.
    Package-internal (docs/api.md)."""

    def __init__(self, tier: DcpTier, url: str, checkpoint: str, commit: str, algorithm: str,
                 plan: TierPlan | None = None) -> None:  # fmt: skip
        self.url = url
        self._tier, self._checkpoint, self._commit = tier, checkpoint, commit
        self._directories = plan.directories if plan is not None else ()  # the save's spread directories
        self._save = plan.save if plan is not None else 0
        self._algorithm = _s3.ChecksumAlgorithm.named(algorithm)
        self._pieces: list[tuple[int, int, int]] = []  # (offset, length, checksum) between boundaries
        self._start = self._size = self._checksum = 0
        self._s3: _s3.S3MultipartWriter | None = None  # the fall-back, once the tier had no room
        self._partial: Path | None = None
        self.info: _s3.S3ObjectInfo | None = None
        self.copy: _tier.TierCopy | None = None
        self.error: BaseException | None = None
        try:
            self._room = tier.node.free_bytes()
            self._partial, self._fd = tier.node.temporary_file(url)
        except OSError as exc:
            self._fall_back(exc)

    def write(self, data: Any) -> int:
        try:
            view = memoryview(data).cast("B")
            total = len(view)
            self._checksum = self._algorithm.update(view, self._checksum)
            if self._s3 is None:
                view = self._write_to_tier(view)
            if self._s3 is not None and len(view):
                self._s3.write(view)
            self._size += total
            return total
        except BaseException as exc:
            self.error = exc
            raise

    def _write_to_tier(self, view: memoryview) -> memoryview:
        """Write `view` into the tier file; what is left of it once the file fell back to S3 (else nothing)."""
        try:
            if self._size + len(view) > self._room:
                raise OSError(errno.ENOSPC, f"no room in the memory tier {self._tier.node.own} for {self.url}")
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self._fall_back(exc)
        return view

    def _fall_back(self, error: OSError) -> None:
        """Send this file to S3 directly (see the class), what the tier file holds first; else raise `error`."""
        small = self.url == self._commit or self.url.endswith(ITEMS_SUFFIX)
        if error.errno not in (errno.ENOSPC, errno.EDQUOT) or small or self._tier.s3.s3_path_exists(self._commit):
            raise error
        self._tier.node.warn_full_once(self.url, error)
        self._tier.node.remove(self.url)  # an older save's copy of this URL: never read in place of this file
        fence = _fencing.DirectoryFence(self._tier.s3, _urls.s3_url_parent(self._checkpoint), self._tier.run)
        _spread.ensure_layout(self._tier.s3, self._checkpoint, self._directories, fence=fence)  # before the file
        self._s3 = self._tier.s3.open_writer(self.url, checksum_algorithm=self._algorithm.name, fence=fence)
        if self._partial is not None:
            os.close(self._fd)
            with open(self._partial, "rb") as written:
                while block := written.read(8 * _s3.MB):
                    self._s3.write(block)
            os.unlink(self._partial)
            self._partial = None

    def write_borrowed(self, data: Any, owner: object) -> int:
        return self.write(data)  # the copy into memory is the save

    def mark_checksum_boundary(self) -> None:
        if self._size > self._start:
            self._pieces.append((self._start, self._size - self._start, self._checksum))
            self._start, self._checksum = self._size, 0

    def checksum_of(self, start: int, end: int) -> int:
        """The checksum of bytes ``[start, end)``; both must be boundaries (as the S3 writer's)."""
        pieces = [piece for piece in self._pieces if start <= piece[0] < end]
        if start != end and (not pieces or pieces[0][0] != start or sum(p[1] for p in pieces) != end - start):
            raise ValueError(f"{self.url}: {start}-{end} is not between checksum boundaries")
        return _s3.combine_checksums(self._algorithm, [(checksum, length) for _, length, checksum in pieces])

    def close(self) -> None:
        """Commit the file in the tier (its commit record names its checkpoint), or on S3 after a fall-back."""
        self.mark_checksum_boundary()
        if self._s3 is not None:
            self._s3.close()  # completes the upload (aborted if that fails)
            self.info = self._s3.info
            return
        try:
            os.close(self._fd)
            total = _s3.combine_checksums(self._algorithm, [(checksum, length) for _, length, checksum in self._pieces])
            checksum = self._algorithm.encode(total)
            self.copy = self._tier.node.commit(
                self._partial, self.url, None, self._size, f"{self._algorithm.name} {checksum}",
                checkpoint=self._checkpoint, commit=self._commit, save=self._save,
                **({"layout": list(self._directories)} if self._directories else {}),
            )  # fmt: skip
        except BaseException:
            self.abort()
            raise
        bucket, key = _urls.parse_s3_url(self.url)
        self.info = _s3.S3ObjectInfo(bucket, key, self._size, "", checksums={self._algorithm.response_field: checksum})

    def __enter__(self) -> TierFile:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close() if exc_type is None else self.abort()

    def abort(self) -> None:
        if self._s3 is not None:
            self._s3.abort()
        if self._partial is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._partial)


# --------------------------------------------------------------------------------------------------------------------
# 2. The process's side of the tier
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class _LastSave:
    checkpoint: str
    run: _fencing.CheckpointRun
    files: list[_tier.TierCopy] = field(default_factory=list)
    commit: list[_tier.TierCopy] = field(default_factory=list)  # the coordinator's: item checksums, .metadata
    drained: bool = False


_registry_lock = threading.Lock()
_registry: dict[tuple[Any, ...], DcpTier] = {}


def tier_of(memory_tier: _tier.MemoryTier, s3: _s3.S3Utils, checksum_algorithm: str = "auto") -> DcpTier:
    """This process's `DcpTier` for `memory_tier`, opened (and claimed: a straggler of an older launch is refused)
    on first use; on a node's first local rank that also finishes the drains a killed process left pending.
    Package-internal (docs/api.md)."""
    key = (memory_tier, _fencing.current_run().run_id)
    with _registry_lock:
        found = _registry.get(key)
        if found is None:
            found = _registry[key] = DcpTier(memory_tier, s3, checksum_algorithm)
    return found


class DcpTier:
    """One process's DCP saves and drains through one node tier (`tier_of` keeps one per configuration).
    Package-internal (docs/api.md)."""

    def __init__(self, memory_tier: _tier.MemoryTier, s3: _s3.S3Utils, checksum_algorithm: str = "auto") -> None:
        self.config = memory_tier
        self.s3 = s3
        self.run = _fencing.current_run()
        self.node = _tier.NodeTier(memory_tier, self.run, checksum_algorithm)
        self.node.claim()
        self.saves = 0
        self._last_drain = -float("inf")
        self._last_save = 0  # `TierPlan.save` of the last save this process planned
        self._executors = {  # a commit waiting for other ranks' files never holds up this rank's own uploads
            kind: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"s3ckpt-dcp-drain-{kind}")
            for kind in ("files", "commits")
        }
        self._futures: list[concurrent.futures.Future[None]] = []
        self._last: _LastSave | None = None
        self._open: dict[str, list[TierFile]] = {}  # a save's files, from `open_file` to `files_written`
        self._sources_lock = threading.Lock()
        self._lock = threading.Lock()
        self.replication: _tier.TierReplication | None = None  # `start_replication`
        self.replication_decided = False  # `replicate_by_default` asked whether the job spans several nodes
        self.agreement: _tier.TierAgreement | None = None  # the last `agree_resume`: where a load reads each file
        self.peer_unreachable = False  # a fetch from the peer failed: this process asks it no more
        if os.environ.get("LOCAL_RANK", "0") == "0":
            self._finish_pending_drains()

    def plan(self, directories: tuple[str, ...] = ()) -> TierPlan:
        """The coordinator's decision for its next save (counted): drain it or not; `directories`: its spread
        directories (`s3_prefix_spreading.SaveLayout`)."""
        self.node.claim()
        self.saves += 1
        minutes = self.config.drain_minutes
        timer = minutes is not None and time.monotonic() - self._last_drain >= minutes * 60
        drain = (self.saves - 1) % self.config.drain_every == 0 or timer
        if drain:
            self._last_drain = time.monotonic()
        self._last_save = max(time.time_ns(), self._last_save + 1)  # grows, also across launches (the clock)
        return TierPlan(drain, self.run, tuple(directories), self._last_save)

    def open_file(self, url: str, checkpoint: str, commit_name: str, algorithm: str,
                  plan: TierPlan | None = None) -> TierFile:  # fmt: skip
        """A file of the checkpoint at `checkpoint` (committed by its ``.metadata``, `commit_name`) into the tier;
        `plan`: the save's (its commit record keeps the spread directories, for the drain, and the save's place)."""
        commit = _urls.join_s3_url(checkpoint, commit_name)
        self.node.claim()  # a straggler writes nothing
        file = TierFile(self, url, checkpoint, commit, algorithm, plan)
        if url != commit and not url.endswith(ITEMS_SUFFIX):
            with self._lock:
                self._open.setdefault(checkpoint, []).append(file)
        return file

    def files_written(self, checkpoint: str, plan: TierPlan, writer: Any) -> None:
        """After a rank's `write_data`: its files are committed in memory; drain them behind if the save drains."""
        with self._lock:  # a file that fell back to S3 has no copy: it is there already
            copies = [file.copy for file in self._open.pop(checkpoint, []) if file.copy is not None]
            self._last = _LastSave(checkpoint, plan.run, copies, drained=plan.drain)
        if plan.drain:
            self._drain_files(copies, plan.run, writer)
        self._replicate(copies)
        self.node.unpin()  # a resume's files stayed until this newer save was in memory
        for url, source in list(getattr(self.agreement, "sources", {}).items()):  # the resume read them from S3 ...
            if source.tier == "s3":  # ... a newer save may hold them in memory now
                del self.agreement.sources[url]
        self.node.prune_soon()

    def committed(self, checkpoint: str, name: str, files: dict[str, Any], plan: TierPlan, writer: Any) -> None:
        """After the coordinator committed the item checksums and ``.metadata`` (its `name`) in memory: drain them
        behind the files (`files`: the item-checksum record's) if the save drains."""
        names = [name.removesuffix(".metadata") + ITEMS_SUFFIX, name]
        commit = [self.node.copy_of(_urls.join_s3_url(checkpoint, name)) for name in names]
        if None in commit:
            raise FileNotFoundError(f"memory tier: the commit of {checkpoint} is not in {self.node.own}")
        with self._lock:
            if self._last is None or self._last.checkpoint != checkpoint:
                self._last = _LastSave(checkpoint, plan.run, drained=plan.drain)
            self._last.commit = commit
        if plan.drain:
            self._drain_commit(commit, files, plan.run, writer)
        self._replicate(commit)
        self.node.prune_soon()

    def follow_commit(self, url: str, checkpoint: str, commit_name: str, body: bytes, writer: Any) -> _tier.TierCopy:
        """A small file another layer writes beside the checkpoint at `checkpoint` once its ``.metadata``
        (`commit_name`) is committed in this node's tier (megatron-core's ``metadata.json`` and ``common.pt``, which its
        loads look for first): committed in the tier after ``.metadata``; on S3 it comes after ``.metadata`` too (in the
        order written), and goes before an older ``.metadata`` at the prefix does. It drains when the checkpoint does
        (at once if that was decided; with `finish_drains` if it is the last save), and is replicated as the
        checkpoint's other files are. Never falls back to S3 directly: there it would mark a checkpoint whose files
        are still in memory. Package-internal (docs/api.md)."""
        commit = _urls.join_s3_url(checkpoint, commit_name)
        self.node.claim()  # a straggler writes nothing
        metadata = self.node.copy_of(commit)
        if metadata is None:
            raise FileNotFoundError(f"memory tier: {url} follows {commit}, which is not in {self.node.own}")
        algorithm = self.node.algorithm
        partial, fd = self.node.temporary_file(url)
        try:
            with os.fdopen(fd, "wb", buffering=0) as stream:
                stream.write(body)
            checksum = f"{algorithm.name} {algorithm.encode(algorithm.update(memoryview(body), 0))}"
            copy = self.node.commit(partial, url, None, len(body), checksum, checkpoint=checkpoint, commit=commit,
                                    follows_commit=True, save=metadata.record.get("save", 0))  # fmt: skip
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
            raise
        with self._lock:
            last = self._last if self._last is not None and self._last.checkpoint == checkpoint else None
            if last is not None:
                last.commit = [c for c in last.commit if c.url != url] + [copy]
        if metadata.drain is not None or (last is not None and last.drained):  # its checkpoint's drain was decided
            group = self._commit_group(metadata)
            self._drain_commit(group, _listed_files(group), last.run if last is not None else self.run, writer)
        self._replicate([copy])  # the peer needs it too: a checkpoint counts for resume only with it
        return copy

    def _commit_group(self, metadata: _tier.TierCopy) -> list[_tier.TierCopy]:
        """The item checksums, ``.metadata`` and the files that follow it (oldest first), as this node's tier holds
        them for the checkpoint `metadata` commits."""
        items = self.node.copy_of(metadata.url.removesuffix(".metadata") + ITEMS_SUFFIX)
        directory = metadata.path.parent
        followers = []
        for record_path in directory.glob(f"*{_tier.COMMIT_RECORD_SUFFIX}"):
            name = record_path.name.removesuffix(_tier.COMMIT_RECORD_SUFFIX)
            copy = self.node.copy_of(_urls.join_s3_url(metadata.record["checkpoint"], name))
            if copy is not None and copy.record.get("follows_commit"):
                followers.append(copy)
        followers.sort(key=lambda copy: copy.record.get("sequence", 0))
        return [*([items] if items is not None else []), metadata, *followers]

    def finish_drains(self, writer: Any, drain_last: bool = True) -> None:
        """Every rank, at the end of a run: drain the last save if it did not drain (the last checkpoint of a run
        that ends normally reaches S3), then wait for every drain of this process; raise the first failure."""
        with self._lock:
            last = self._last
        if drain_last and last is not None and not last.drained:
            last.drained = True
            self._drain_files(last.files, last.run, writer)
            if last.commit:
                self._drain_commit(last.commit, _listed_files(last.commit), last.run, writer)
        if self.replication is not None:  # the last save reaches the peer too (failures were logged)
            self.replication.wait()
        with self._lock:
            futures, self._futures = self._futures, []
        errors = []
        for future in futures:
            try:
                future.result()
            except BaseException as exc:
                errors.append(exc)
        self.node.wait_pruned()
        if errors:
            raise errors[0]

    def start_replication(self, group: Any = None, *, bind_host: str | None = None, local_rank: int = 0) -> None:
        """Collective (`start_replication`): this node's replica server (on its first rank) and a sender to the next
        node; every save's files are sent from then on, the first rank's loads fetch from the peer."""
        if self.replication is not None:
            logger.warning("memory tier: replication of %s already runs; started once", self.node.directory)
            return
        self.replication = _tier.TierReplication(self.node, group, bind_host=bind_host, local_rank=local_rank)

    def _replicate(self, copies: list[_tier.TierCopy]) -> None:
        """Send a save's files committed in memory to the peer node, in the background (never waited for here)."""
        if self.replication is not None:
            with self._lock:  # `TierReplication.send` keeps a list: one caller at a time
                for copy in copies:
                    self.replication.send(copy)

    # ---- draining -------------------------------------------------------------------------------------------------

    def _submit(self, kind: str, work: Any, *args: Any) -> None:
        with self._lock:  # kept: failures, for `finish_drains` to raise
            self._futures = [future for future in self._futures if not future.done() or future.exception() is not None]
            self._futures.append(self._executors[kind].submit(work, *args))

    def _superseded(self, copy: _tier.TierCopy) -> bool:
        """Whether a newer save of the same URL replaced `copy` in memory (its own drain, if due, takes over)."""
        if self.node.is_committed(copy):
            return False
        logger.info("memory tier: %s was saved again (or dropped) before its drain; that drain is skipped", copy.url)
        return True

    def _drain_files(self, copies: list[_tier.TierCopy], run: _fencing.CheckpointRun, writer: Any) -> None:
        for copy in [self.node.set_drain(copy, "pending") for copy in copies]:
            self._submit("files", self._upload_file, copy, run, writer)

    def _drain_commit(self, commit: list[_tier.TierCopy], files: dict[str, Any], run: _fencing.CheckpointRun,
                      writer: Any) -> None:  # fmt: skip
        commit = [self.node.set_drain(copy, "pending") for copy in commit]
        self._submit("commits", self._upload_commit, commit, files, run, writer)

    def _fence(self, checkpoint: str, run: _fencing.CheckpointRun, writer: Any) -> Any:
        if not getattr(writer, "fencing", True):
            return None
        return _fencing.DirectoryFence(self.s3, _urls.s3_url_parent(checkpoint), run)

    def _upload(self, copy: _tier.TierCopy, fence: Any, writer: Any) -> None:
        chunk = getattr(writer, "chunk_size_MB", _s3.DEFAULT_CHUNK_SIZE_MB)
        concurrency = getattr(writer, "max_write_concurrency", 4)
        algorithm = copy.checksum.split(" ", 1)[0]
        with self.s3.open_writer(copy.url, chunk, concurrency, algorithm, fence=fence) as target:
            self.node.upload(copy, target)
        self.node.set_drain(copy, "done")

    def _on_s3(self, url: str, size: int, checksum: str) -> bool:
        """Whether S3 holds `url` with this size and recorded checksum (``"<ALGORITHM> <b64>"``)."""
        try:
            info = self.s3.head_object(url)
        except FileNotFoundError:
            return False
        recorded = self.s3.recorded_checksum(info)
        return info.size == size and recorded is not None and f"{recorded.algorithm} {recorded.value}" == checksum

    def _upload_file(self, copy: _tier.TierCopy, run: _fencing.CheckpointRun, writer: Any) -> None:
        """One rank's file: uploaded once no older checkpoint's ``.metadata`` is at its prefix (the coordinator removes
        that one first); nothing to do if S3 has it already (a drain the relaunch finishes)."""
        checkpoint, metadata = copy.record["checkpoint"], copy.record["commit"]
        if self._superseded(copy):
            return
        if self._on_s3(copy.url, copy.size, copy.checksum):
            self.node.set_drain(copy, "done")
            return
        older = f"the older {metadata} to be removed before {copy.url}"
        self._wait(lambda: not self.s3.s3_path_exists(metadata), older)
        fence = self._fence(checkpoint, run, writer)
        _spread.ensure_layout(self.s3, checkpoint, copy.record.get("layout", ()), fence=fence)  # before the file
        self._upload(copy, fence, writer)
        logger.info("memory tier: drained %s to S3", copy.url)
        self.node.prune()  # what waited for this drain may go

    def _upload_commit(self, commit: list[_tier.TierCopy], files: dict[str, Any], run: _fencing.CheckpointRun,
                       writer: Any) -> None:  # fmt: skip
        """The coordinator's: an older ``.metadata`` at the prefix goes first; once every listed file is on S3 as
        recorded, the item checksums, then ``.metadata`` (the commit) go up, from memory."""
        metadata = next(copy for copy in commit if copy.url == copy.record["commit"])
        followers = [copy for copy in commit if copy.record.get("follows_commit")]
        checkpoint = metadata.record["checkpoint"]
        fence = self._fence(checkpoint, run, writer)
        if self._on_s3(metadata.url, metadata.size, metadata.checksum):  # committed there: what follows it, if not yet
            for copy in followers:
                if not self._superseded(copy) and not self._on_s3(copy.url, copy.size, copy.checksum):
                    self._upload(copy, fence, writer)
            for copy in commit:
                self.node.set_drain(copy, "done")
            return
        replacing = self.s3.s3_path_exists(metadata.url)
        if replacing:
            logger.warning("memory tier: removing the older %s before draining its successor", metadata.url)
            declared = [_urls.join_s3_url(checkpoint, name) for name in getattr(writer, "commit_followers", ())]
            for url in dict.fromkeys([*declared, *(copy.url for copy in reversed(commit))]):  # followers first
                if url in declared and not self.s3.s3_path_exists(url):
                    continue
                self.s3.remove_object(url, fence=fence)
        _spread.ensure_layout(self.s3, checkpoint, metadata.record.get("layout", ()), fence=fence)
        wanted = {_spread.join(checkpoint, name): (entry["size"], f"{entry['algorithm']} {entry['checksum']}")
                  for name, entry in files.items()}  # fmt: skip

        def all_there() -> bool:
            if self._superseded(metadata):
                raise _SupersededError
            for url in list(wanted):  # in order, up to the first one missing: one HEAD per look while waiting
                if not self._on_s3(url, *wanted[url]):
                    return False
                del wanted[url]
            return True

        try:
            self._wait(all_there, f"every file of {checkpoint} to be on S3")
        except _SupersededError:
            return
        with _pacing.sending_alone():  # every file is on S3: no share of a budget to keep
            for copy in commit:  # the item checksums, then .metadata, then what follows it
                self._upload(copy, fence, writer)
        logger.info("memory tier: drained %s to S3 (committed by its .metadata)", checkpoint)
        if replacing:  # the replaced checkpoint's shards this one does not use go, as after an S3 save's overwrite
            for url in _spread.unused_shards(self.s3, checkpoint, files, SHARD_SUFFIX):
                self.s3.remove_object(url, fence=fence)
        self.node.prune()

    @staticmethod
    def _wait(condition: Any, what: str) -> None:
        pause, deadline = _POLL_S[0], time.monotonic() + DRAIN_WAIT_S
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"memory tier: gave up after {DRAIN_WAIT_S:.0f} s waiting for {what}; not drained")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_S[1])

    def _finish_pending_drains(self) -> None:
        """A relaunch: drains a killed process left pending go on (files, then the commits behind them)."""
        pending = self.node.pending_drains(files_of_checkpoints=True)
        commits: dict[str, str] = {}  # checkpoint -> the URL of its .metadata
        for copy in pending:
            if copy.url == copy.record.get("commit") or copy.url.endswith(ITEMS_SUFFIX) or _follows(copy):
                commits[copy.record["checkpoint"]] = copy.record["commit"]
            else:
                logger.warning("memory tier: finishing the drain of %s a previous process began", copy.url)
                self._submit("files", self._upload_file, copy, self.run, None)
        for checkpoint, commit_url in commits.items():  # what follows .metadata may be pending after it drained
            metadata = self.node.copy_of(commit_url)
            if metadata is None:
                continue
            commit = self._commit_group(metadata)
            logger.warning("memory tier: finishing the drain of %s a previous process began", checkpoint)
            self._submit("commits", self._upload_commit, commit, _listed_files(commit), self.run, None)


class _SupersededError(Exception):
    """A newer save of the same checkpoint URL replaced the one being drained."""


def _follows(copy: _tier.TierCopy) -> bool:
    """Whether `copy` is a file that follows its checkpoint's commit (`DcpTier.follow_commit`)."""
    return _follows_record(copy.record)


def _follows_record(record: dict[str, Any]) -> bool:
    return bool(record.get("follows_commit"))


def _listed_files(commit: list[_tier.TierCopy]) -> dict[str, Any]:
    """The files a checkpoint's item-checksum record (in the tier) lists: name -> its size, algorithm, checksum."""
    items = next((copy for copy in commit if copy.url.endswith(ITEMS_SUFFIX)), None)
    if items is None:
        return {}
    return json.loads(Path(items.path).read_bytes()).get("files", {})


# --------------------------------------------------------------------------------------------------------------------
# 4. Reads
# --------------------------------------------------------------------------------------------------------------------


def cached_source(tier: DcpTier, cache: dict[str, Any], url: str) -> tuple[Path, str] | None:
    """`source_of`, once per `url` and `cache` (a reader's), whichever thread asks first.
    Package-internal (docs/api.md)."""
    with tier._sources_lock:
        if url not in cache:
            cache[url] = source_of(tier, url)
        return cache[url]


def source_of(tier: DcpTier, url: str) -> tuple[Path, str] | None:
    """Where this node reads the DCP file `url` outside S3, fastest first: where the ranks agreed it reads it
    (`agree_resume`), this node's verified copy (``"memory"``), a verified replica held here, or, with replication
    started, this node's replica its peer holds (a replaced node; fetched, verified and made this node's copy):
    ``(path, tier)``; None: S3. A copy that does not verify is skipped, loudly. Package-internal (docs/api.md)."""
    agreement = tier.agreement
    if agreement is not None and getattr(agreement.sources.get(url), "tier", None) == "s3":
        return None  # this save's file went to S3 directly: a copy of its URL in a tier is not this save's
    if agreement is not None and url in agreement.sources:
        try:
            copy, name = _tier.copy_to_load(tier.node, agreement, url)
            if copy is not None:
                if agreement.sources[url].peer is not None:  # fetched: this node's copy now, not fetched again
                    agreement.sources[url] = _tier.ResumeSource(url, "memory", copy.path)
                return copy.path, name
        except (OSError, _s3.ChecksumMismatchError) as exc:
            logger.error("%s: skipped for %s, the next tier is used", exc, url)
    try:
        copy = tier.node.verified_copy(url)
        if copy is not None:
            return copy.path, "memory"
    except (OSError, _s3.ChecksumMismatchError) as exc:
        logger.error("%s: skipped, reading %s from S3 instead", exc, url)
    replicas = tier.node.replicas
    for record_path in replicas.glob(f"*/*/*{_tier.COMMIT_RECORD_SUFFIX}") if replicas.is_dir() else []:
        path = record_path.with_name(record_path.name.removesuffix(_tier.COMMIT_RECORD_SUFFIX))
        try:
            if json.loads(record_path.read_bytes()).get("url") == url:  # the record first: only that one is read
                return tier.node.verified_replica(path).path, "replica"
        except (OSError, ValueError, AttributeError, _s3.ChecksumMismatchError) as exc:
            logger.error("%s: skipped for %s", exc, url)
    return _fetched_back(tier, url)


def holds(tier: DcpTier, url: str) -> bool:
    """Whether this node's tier has a committed copy of `url`, or the ranks agreed where this rank reads it
    (`agree_resume`). Package-internal (docs/api.md)."""
    try:
        return tier.node.copy_of(url) is not None or url in getattr(tier.agreement, "sources", ())
    except ValueError:  # not a URL the tier can hold (a bucket alone)
        return False


def drop_checkpoint(tier: DcpTier, url: str) -> None:
    """Drop this node's memory copies of the checkpoint at `url` (the files below it and its spread files, which
    their records name it): a drain still due skips them (a drain skips a copy dropped from memory).
    Package-internal (docs/api.md)."""
    checkpoint = url.rstrip("/")
    for copy in tier.node.copies():
        if copy.url.startswith(checkpoint + "/") or copy.record.get("checkpoint", "").rstrip("/") == checkpoint:
            tier.node.remove(copy.url)


def _fetched_back(tier: DcpTier, url: str) -> tuple[Path, str] | None:
    """This node's file of `url` from the replica its peer holds (`TierReplication.fetch_back`); None: not there. A
    peer that cannot be reached is asked no more by this process (said once)."""
    replication = tier.replication
    if replication is None or tier.peer_unreachable:
        return None
    try:
        copy = replication.fetch_back(url)
    except _s3.ChecksumMismatchError as exc:
        logger.error("%s: skipped, reading %s from S3 instead", exc, url)
        return None
    except OSError as exc:
        tier.peer_unreachable = True
        logger.error("memory tier: the peer holding this node's replicas cannot be reached (%s); reading from S3", exc)
        return None
    return None if copy is None else (copy.path, "replica")


def read_into(path: Path, url: str, start: int, views: list[memoryview], etag: str | None = None) -> int:
    """Fill `views` in order from the file at `path` (the copy of `url`) from `start` on; how many bytes arrived (as
    `s3_utils.S3Utils.read_range_into`; `etag` is S3's, for which the tier has no use).
    Package-internal (docs/api.md)."""
    filled = 0
    with open(path, "rb", buffering=0) as stream:
        stream.seek(start)
        for view in views:
            while len(view):
                count = stream.readinto(view)
                if not count:
                    return filled
                filled += count
                view = view[count:]
    return filled


# --------------------------------------------------------------------------------------------------------------------
# 5. Replication and the resume agreement (the DCP side of `s3_memory_tier`'s)
# --------------------------------------------------------------------------------------------------------------------


def _storage_tier(storage: Any) -> DcpTier:
    """The `DcpTier` of an `S3StorageWriter` / `S3StorageReader` made with ``memory_tier=``."""
    memory_tier = getattr(storage, "memory_tier", None)
    if memory_tier is None or not hasattr(storage, "s3"):
        raise ValueError(f"{storage!r} is no S3StorageWriter / S3StorageReader with a memory_tier")
    return tier_of(memory_tier, storage.s3, getattr(storage, "checksum_algorithm", "auto"))


def start_replication(storage: Any, group: Any = None, *, bind_host: str | None = None, local_rank: int | None = None
                      ) -> None:  # fmt: skip
    """Replicate this node's DCP saves in memory to the next node (a ring over the job's nodes), as
    ``S3CheckpointIO.start_replication`` does for single files: collective, every rank of `group` (default: the
    default process group) calls it once, with a writer or reader made with the job's ``memory_tier`` (or another
    object with its ``memory_tier`` and ``s3``: a Lightning sharded strategy, `s3_mcore`'s routing); the node's first
    rank (`local_rank`, default ``LOCAL_RANK``) serves its peers' replicas on `bind_host`, the node's address on the
    job's network (default: ``S3CKPT_REPLICA_HOST``, else this host's address on its route to ``MASTER_ADDR``). Each
    file a save commits in memory is then sent in the background, verified on arrival; the peer keeps
    `MemoryTier.keep` checkpoints of each rank, all of a checkpoint's files together. A load of a file this node
    lacks fetches it from the peer's replica (a replaced node) before it goes to S3."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    _storage_tier(storage).start_replication(group, bind_host=bind_host, local_rank=local_rank)


def replicate_by_default(storage: Any, group: Any = None, *, local_rank: int | None = None) -> None:
    """What the Lightning sharded strategies and NeMo 2.x's checkpoint IO do by themselves with ``memory_tier``, so
    that a lost node loses no checkpoint in memory: `start_replication` (the default address), once per process and
    tier, where the process group spans more than one node (one all_gather of node identities, the first time).
    Collective: every rank of `group`; nothing outside a process group. Package-internal (docs/api.md)."""
    tier = _storage_tier(storage)
    dist = _process.import_optional_dependency("torch.distributed", "replicating the memory tier")
    if tier.replication is not None or tier.replication_decided or not (dist.is_available() and dist.is_initialized()):
        return
    tier.replication_decided = True
    nodes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(nodes, _process.node_key(), group=group)
    if len(set(nodes)) > 1:
        start_replication(storage, group, local_rank=local_rank)


def agree_resume(storage: Any, directory: str, step_of: Any = None, *, group: Any = None,
                 followers: tuple[str, ...] = ()) -> _tier.TierAgreement:  # fmt: skip
    """Collective, every rank of `group`: the newest DCP checkpoint under the s3:// `directory` (one per
    ``<directory>/<name>/``, `step_of(name)` its step; a name without one is left out) that every rank can load
    from some tier, as ``S3CheckpointIO.agree_resume`` for single files: one all_gather of what each node holds
    (its verified copies and replicas) and of which checkpoints are committed on S3 (listed by the group's first
    rank), then `s3_memory_tier.decide`. A checkpoint counts for a rank when it is on S3 (its ``.metadata``), or
    when every file its item-checksum record lists, that record and ``.metadata`` are each in the rank's node's
    memory, a replica held there, or a replica another node serves: ``.metadata``, the coordinator's, only in
    another node's memory (no replication) does not count. Never older than the newest on S3, never one some rank
    cannot load. `followers`: the names of files another layer writes after ``.metadata`` that a checkpoint must
    have to count (megatron-core's ``metadata.json``), on S3 as in the tiers; a file that followed ``.metadata``
    into a tier (`DcpTier.follow_commit`) counts like the checkpoint's other files wherever a node knows of it.
    Returns the `s3_memory_tier.TierAgreement` (``step``, ``url``: the checkpoint, ``tier``); the loads of this
    process follow it (each file from the tier agreed, a remote replica fetched into memory)."""
    tier = _storage_tier(storage)
    directory = _urls.normalize_s3_url(directory).rstrip("/")
    dist = _process.import_optional_dependency("torch.distributed", "agreeing on a resume step")
    lists_s3 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank(group) == 0
    verified: dict[str, _tier.TierCopy] = {}
    held_paths: dict[str, Path] = {}

    def candidates() -> dict[str, Any]:
        s3 = storage.s3 if lists_s3 else None
        return _candidates(tier, s3, directory, step_of, verified, held_paths, tuple(followers))

    gathered, rank = _tier.gather_candidates(candidates, directory, group, tier.node)
    steps, files, sources, hand_overs, any_hand_over = decide(gathered, rank, tier.node, held_paths)
    tier.node.pin(f for f in files if sources[f].tier != "s3")  # the files to load stay until the next save
    if any_hand_over:
        _hand_over(tier, hand_overs)
        dist.barrier(group=group)  # every hand-over is in place before any rank loads
    urls = {step: checkpoint for step, checkpoint in steps}
    newest = steps[0][0] if steps else None
    url = urls.get(newest) if newest is not None else None
    tiers = {sources[f].tier for f in files} - {"s3"}  # the fastest of this rank's tiers describes it
    tier_name = None if url is None else ("s3" if not tiers else "replica" if "replica" in tiers else "memory")
    if url is not None:
        logger.info("memory tier: every rank resumes DCP step %s; this rank reads %s from %s", newest, url, tier_name)
    committed = dict.fromkeys(urls.values(), 0.0)
    tier.agreement = _tier.TierAgreement(directory, newest, url, tier_name, list(urls), urls, committed, sources,
                                         verified)  # fmt: skip
    return tier.agreement


def agree_to_load(storage: Any, url: str, *, group: Any = None, followers: tuple[str, ...] = ()) -> bool:
    """`agree_resume` over the one DCP checkpoint at `url` (a load asked for it, not for the newest): True where every
    rank can load it whole from some tier (this process's loads then read each file where agreed), False where some
    rank cannot, or it is no DCP checkpoint. Collective. Package-internal (docs/api.md)."""
    url = _urls.normalize_s3_url(url).rstrip("/")
    step_of = {_urls.s3_url_name(url): 0}.get
    return agree_resume(storage, _urls.s3_url_parent(url), step_of, group=group, followers=followers).url is not None


def _checkpoint_of(record: dict[str, Any], url: str, prefix: str, step_of: Any) -> tuple[str, int] | None:
    """The DCP checkpoint directly under `prefix` whose file `url` is (its record names it), and its step; None."""
    checkpoint = record.get("checkpoint")
    if not isinstance(checkpoint, str) or not checkpoint.startswith(prefix) or not _spread.belongs_to(url, checkpoint):
        return None
    name = checkpoint[len(prefix) :]
    step = step_of(name) if step_of is not None and "/" not in name else None
    return (checkpoint, step) if isinstance(step, int) and not isinstance(step, bool) else None


def _candidates(tier: DcpTier, s3: Any, directory: str, step_of: Any, verified: dict[str, _tier.TierCopy],
                held_paths: dict[str, Path], required: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    """This rank's part of the collective: the DCP files below `directory` its node holds verified (own copies,
    also put in `verified`; replicas, their paths in `held_paths`), the file lists of the item-checksum records
    among them, the files each checkpoint needs after ``.metadata`` (the `required` names, those that followed it
    into a tier), the files those records name with an S3 ETag (``"direct"``: they went to S3 for want of room), and
    (with `s3`) the checkpoints whose ``.metadata`` and `required` files S3 has, and the objects of the others
    (``"loose"``: size and ETag)."""
    prefix = directory + "/"
    own, held, lists, steps, followers, direct = {}, [], {}, {}, {}, {}

    def note(url: str, record: dict[str, Any], path: Path) -> bool:
        found = _checkpoint_of(record, url, prefix, step_of)
        if found is None:
            return False
        steps[found[0]] = found[1]
        if _follows_record(record):
            followers.setdefault(found[0], set()).add(url)
        commit = record.get("commit")
        if isinstance(commit, str) and url == commit.removesuffix(".metadata") + ITEMS_SUFFIX:
            listed = json.loads(Path(path).read_bytes()).get("files", {})
            lists[found[0]] = [commit, [url] + [_spread.join(found[0], name) for name in listed]]
            direct.update({_spread.join(found[0], name): [entry["size"], entry["etag"]]  # went to S3 for want of room
                           for name, entry in listed.items() if entry.get("etag")})  # fmt: skip
        return True

    for copy in tier.node.copies():
        if _checkpoint_of(copy.record, copy.url, prefix, step_of) is None:
            continue
        try:
            checked = tier.node.verified_copy(copy.url)
        except _s3.ChecksumMismatchError as exc:
            logger.error("%s: skipped for resume, the next tier is used", exc)
            continue
        if checked is not None and note(copy.url, copy.record, copy.path):
            verified[copy.url] = checked
            own[copy.url] = 1
    for url, _, _, sender, name, path, record in _tier.held_replicas(tier.node):
        if note(url, record, path):
            held.append([url, sender, name, str(path)])
            held_paths[url] = path
    on_s3, names_on_s3, objects = {}, {}, {}
    for obj in s3.list_objects(directory) if s3 is not None else []:
        relative = f"s3://{obj.bucket}/{obj.key}"[len(prefix) :]
        name, _, file = relative.partition("/")
        names_on_s3.setdefault(name, set()).add(file)
        owner = _spread.owner_of(relative) if _spread.in_spread_directory(relative) else name
        objects.setdefault(prefix + owner, {})[prefix + relative] = [obj.size, obj.etag]
        step = step_of(name) if step_of is not None and file == ".metadata" else None
        if isinstance(step, int) and not isinstance(step, bool):
            on_s3[prefix + name] = step
    on_s3 = {url: step for url, step in on_s3.items() if set(required) <= names_on_s3[url[len(prefix) :]]}
    loose = {url: found for checkpoint, files in objects.items() if checkpoint not in on_s3  # not committed on S3
             for url, found in files.items()}  # fmt: skip
    for checkpoint in steps:
        followers.setdefault(checkpoint, set()).update(_urls.join_s3_url(checkpoint, name) for name in required)
    replication = tier.replication
    address = None if replication is None or replication.server is None else list(replication.server.address)
    return {"node": _process.node_key(), "address": address, "directory": directory, "own": sorted(own), "held": held,
            "lists": lists, "steps": steps, "s3": on_s3, "replicating": replication is not None, "direct": direct,
            "loose": loose,
            "followers": {checkpoint: sorted(urls) for checkpoint, urls in followers.items()}}  # fmt: skip


def _hand_over(tier: DcpTier, hand_overs: list[tuple[str, tuple[str, int]]]) -> None:
    """Send the files of the agreed checkpoint another node needs from this node's memory to that node's replica
    server (verified there). One that fails is said loudly: that node's load then reads the file from S3 or fails
    naming it; the collective goes on."""
    for url, address in hand_overs:
        try:
            copy = tier.node.copy_of(url)
            if copy is None:
                raise FileNotFoundError(f"{url} left this node's memory tier")
            if tier.replication is None:
                raise OSError("replication was not started in this process (start_replication)")
            tier.replication.send_to(copy, address)
            logger.info("memory tier: handed %s over to the node at %s:%d for its resume", url, *address)
        except OSError as exc:
            logger.error("memory tier: could not hand %s over to %s:%d for its resume: %s", url, *address, exc)


def decide(gathered: list[dict[str, Any]], rank: int, node: _tier.NodeTier, held_paths: dict[str, Path]) -> Any:
    """Every rank's DCP candidates -> ``[(step, checkpoint)]`` every rank can load (newest first), the files of the
    newest if this rank loads it outside S3 (else none), where it reads each of them, and the hand-overs this rank
    makes first (``(file url, address)``: a file of the newest in its node's memory that another node's ranks cannot
    reach otherwise) and whether any rank makes one. A checkpoint becomes one URL per rank for
    `s3_memory_tier.decide`: on S3 as listed, "in memory" for a rank whose node reaches each of its files (those its
    item-checksum record lists, that record, ``.metadata`` and the ``"followers"`` some node names for it): in its
    memory or a replica held there, a replica another node serves, (nodes with replication started) another node's
    memory, handed over, or S3 for a file that went there directly for want of room (listed with the size and ETag
    its record names: read from S3, tier ``"s3"``). The same on every rank. Package-internal (docs/api.md)."""
    addresses = {entry["node"]: tuple(entry["address"]) for entry in gathered if entry["address"]}
    at_node: dict[str, dict[str, Any]] = {}
    served: dict[str, tuple[str, str, str]] = {}  # file -> (serving node, sender node, replica name)
    handed: dict[str, str] = {}  # file -> a node with replication started that has it in memory
    for entry in gathered:
        here = at_node.setdefault(entry["node"], {})
        here.update(dict.fromkeys(entry["own"], "memory"))
        for url, sender, name, path in entry["held"]:
            here.setdefault(url, Path(path))
            if entry["node"] in addresses:
                served.setdefault(url, (entry["node"], sender, name))
        if entry["replicating"]:
            for url in entry["own"]:
                handed.setdefault(url, entry["node"])
    followers: dict[str, set[str]] = {}  # what follows .metadata, wherever a node knows of it
    for entry in gathered:
        for checkpoint, urls in entry.get("followers", {}).items():
            followers.setdefault(checkpoint, set()).update(urls)
    lists = {checkpoint: [commit, [*files, *sorted(followers.get(checkpoint, ()))]]
             for entry in gathered for checkpoint, (commit, files) in entry["lists"].items()}  # fmt: skip
    steps = {checkpoint: step for entry in gathered for checkpoint, step in entry["steps"].items()}
    s3 = {checkpoint: step for entry in gathered for checkpoint, step in entry["s3"].items()}
    loose = {url: found for entry in gathered for url, found in entry.get("loose", {}).items()}
    recorded = {url: found for entry in gathered for url, found in entry.get("direct", {}).items()}
    direct = {url for url, found in recorded.items() if loose.get(url) == found}  # on S3 as recorded: size, ETag
    wholes = []
    for entry in gathered:
        reach = at_node[entry["node"]].keys() | served.keys() | (handed.keys() if entry["node"] in addresses else set())
        reach = (reach - recorded.keys()) | direct  # a copy of such a URL in a tier is an older save's
        wholes.append({checkpoint: [commit, *files] for checkpoint, (commit, files) in lists.items()
                       if checkpoint in steps and {commit, *files} <= reach})  # fmt: skip
    converted = [
        {"node": entry["node"], "address": None, "directory": entry["directory"], "held": [], "s3": s3,
         "own": {checkpoint: [steps[checkpoint], 0.0] for checkpoint in whole}}
        for entry, whole in zip(gathered, wholes, strict=True)
    ]  # fmt: skip
    common, options = _tier.decide(converted, rank)
    agreed = [(step, options[step][0][1]) for step in common]
    if not agreed:
        return agreed, [], {}, [], False
    checkpoint = agreed[0][1]
    first_rank = {}
    for index, entry in enumerate(gathered):
        first_rank.setdefault(entry["node"], index)
    hand_overs, any_hand_over = [], False
    for target, index in first_rank.items():  # each node that loads the newest outside S3, once
        for url in wholes[index].get(checkpoint, []):
            if url not in at_node[target] and url not in served and url not in direct:
                any_hand_over = True
                if first_rank[handed[url]] == rank:
                    hand_overs.append((url, addresses[target]))
    mine, here = wholes[rank].get(checkpoint, []), at_node[gathered[rank]["node"]]
    sources = {}
    for url in mine if options[agreed[0][0]][0][0] == 0 else []:
        if url in direct:  # this save's file is on S3: a copy of its URL in a tier is an older save's
            sources[url] = _tier.ResumeSource(url, "s3")
        elif here.get(url) == "memory":
            sources[url] = _tier.ResumeSource(url, "memory", node.path_of(url))
        elif url in here:
            sources[url] = _tier.ResumeSource(url, "replica", held_paths.get(url, here[url]))
        elif url in served:
            holder, sender, name = served[url]
            sources[url] = _tier.ResumeSource(url, "replica", None, addresses[holder], sender, name)
        else:  # handed over to this node before the load
            path = node.replicas / handed[url] / _tier.TierReplication.replica_name(url) / url.rsplit("/", 1)[-1]
            sources[url] = _tier.ResumeSource(url, "replica", path)
    return agreed, (mine if sources else []), sources, hand_overs, any_hand_over
