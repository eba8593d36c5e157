"""Look after checkpoint buckets from Python: what the ``s3-checkpoint-io`` operator commands do, as functions.

The command line (`s3_checkpoint_cli`) parses arguments and prints; the rules it applies live here, so a script or a
scheduler can apply the same ones without parsing text output:

* `list_checkpoints` / `CheckpointEntry` (``ls``): the checkpoints under a prefix, one entry per single-file
  checkpoint or per sharded (DCP) checkpoint, named and ordered by resume discovery's rules
  (`connector.checkpoint_step`, `connector.classify_checkpoint_name`);
* `plan_pruning` / `prune_checkpoints` / `remove_checkpoint` (``rm --keep-last N``): keep the N newest top-k
  checkpoints, never a ``last``, an ``end``, a step-less one or a DCP checkpoint whose save has not committed;
* `find_garbage` / `remove_incomplete_checkpoint` (``gc``): the multipart uploads and DCP saves killed jobs left,
  older than a threshold by the store's clock;
* `verify_checkpoint` (``verify`` of a DCP checkpoint): every object downloaded and checked against the checksums
  recorded when it was written. A single-file checkpoint is verified by any download
  (`s3_utils.S3Utils.download_to_memory` says which recorded checksum it matched).

This module is optional: the core (``s3_dirpath_utils``, ``s3_utils``, ``s3_checkpoint_io``, ``connector``) never
imports it. It needs ``s3_dcp`` only where a DCP checkpoint is met (its file names, its item-checksum record) and
imports it then; where ``s3_dcp.py`` is absent that raises `connector.DCPSupportMissingError` naming what to copy.
Nothing here needs torch.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import os
import re
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

if __package__:
    from . import connector as _connector
    from . import s3_dirpath_utils as _urls
    from . import s3_fencing as _fencing
    from . import s3_prefix_spreading as _spread
    from . import s3_process as _process
    from . import s3_utils as _s3
else:  # installed (or copied) as top-level modules
    import connector as _connector
    import s3_dirpath_utils as _urls
    import s3_fencing as _fencing
    import s3_prefix_spreading as _spread
    import s3_process as _process
    import s3_utils as _s3

__all__ = [
    "CheckpointEntry",
    "CheckpointVerification",
    "Garbage",
    "IncompleteCheckpoint",
    "Pruning",
    "VerifiedFile",
    "find_garbage",
    "list_checkpoints",
    "plan_pruning",
    "prune_checkpoints",
    "remove_checkpoint",
    "remove_incomplete_checkpoint",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)


def _s3_dcp(purpose: str) -> types.ModuleType:
    """`s3_dcp` from beside this module, imported now (the first time a DCP checkpoint is met), or
    `connector.DCPSupportMissingError` naming what is missing where it is absent. One that is there but fails to
    import raises as usual."""
    module = _process.import_sibling("s3_dcp", __package__)
    if module is None:
        here = os.path.dirname(os.path.abspath(__file__))
        raise _connector.DCPSupportMissingError(
            f"{purpose} needs s3_dcp.py (the DCP file names and item-checksum records), which is not beside "
            f"s3_checkpoint_admin.py in {here}: install s3-checkpoint-io, or copy s3_dcp.py from it there."
        )
    return module


def _utils(s3_utils: _s3.S3Utils | None) -> _s3.S3Utils:
    return s3_utils if s3_utils is not None else _s3.S3Utils()


# --------------------------------------------------------------------------------------------------------------------
# Checkpoints in a bucket (ls)
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointEntry:
    """One checkpoint as the operator commands see it: a single object, or a whole DCP checkpoint prefix."""

    url: str
    name: str
    """Its key relative to the listed prefix."""
    size: int
    """Bytes: the object's, or the sum of every object under a DCP checkpoint's prefix."""
    last_modified: datetime.datetime | None
    """The object's modification time, or the newest under a DCP checkpoint's prefix (by the store's clock)."""
    step: int | None
    """The N of the last ``step=N`` in its name, or None."""
    kind: str
    """``"last"``, ``"end"``, ``"top-k"``, or ``"other"`` (not a ``*.ckpt``: listed with ``all_objects``)."""
    shards: int | None = None
    """A DCP checkpoint's ``.distcp`` file count; None for a single-object checkpoint."""
    complete: bool = True
    """False for a DCP checkpoint without ``.metadata`` (its save never finished, or is still running)."""
    tiers: tuple[str, ...] = ("s3",)
    """Where it is: ``"s3"``, and with ``memory_tier=`` this node's ``"memory"`` and peers' ``"replica"`` copies."""

    @property
    def is_dcp(self) -> bool:
        """Whether this is a sharded (DCP) checkpoint: a prefix, not one object."""
        return self.shards is not None

    @classmethod
    def from_info(cls, info: _s3.S3ObjectInfo, name: str) -> CheckpointEntry:
        """The entry of a single object listed as `name`."""
        step, kind = classify_checkpoint(name)
        return cls(info.url, name, info.size, info.last_modified, step, kind)

    @classmethod
    def from_dcp(cls, url: str, name: str, objects: list[_s3.S3ObjectInfo], top_level: set[str]) -> CheckpointEntry:
        """One entry for the DCP checkpoint at `url`: the objects under its prefix, `top_level` their names there."""
        shard_suffix = _s3_dcp(f"Listing the DCP checkpoint {url}").DCP_SHARD_SUFFIX
        base = name.rpartition("/")[2]
        modified = max((o.last_modified for o in objects if o.last_modified is not None), default=None)
        return cls(
            url,
            name,
            sum(o.size for o in objects),
            modified,
            _connector.checkpoint_step(base),
            _connector.classify_checkpoint_name(base, True) or "top-k",
            shards=sum(1 for n in top_level if n.endswith(shard_suffix)),
            complete=_connector.distributed_checkpoint_problem(top_level) is None,
        )

    def as_json(self) -> dict[str, Any]:
        """The entry as ``ls --json`` prints it (format ``"file"`` or ``"dcp"``, times in UTC ISO 8601)."""
        modified = self.last_modified.astimezone(datetime.timezone.utc).isoformat() if self.last_modified else None
        return {
            "url": self.url,
            "step": self.step,
            "size": self.size,
            "last_modified": modified,
            "kind": self.kind,
            "format": "dcp" if self.is_dcp else "file",
            "shards": self.shards,
            "complete": self.complete,
            "tiers": list(self.tiers),
        }


def classify_checkpoint(name: str) -> tuple[int | None, str]:
    """``(step, kind)`` of a checkpoint from its file name: the number in the last ``step=N`` (None if there is
    none), and ``"end"`` (``*end.ckpt``), ``"last"`` (``*last.ckpt``, ``*last-vN.ckpt``) or ``"top-k"``: resume
    discovery's own rules (`connector.checkpoint_step`, `connector.classify_checkpoint_name`), so what ``ls`` calls
    last or end is what a job resumes from or stops at; ``"other"`` for names not ending in ``.ckpt``.
    Package-internal (docs/api.md)."""
    base = name.rpartition("/")[2]
    step = _connector.checkpoint_step(base)
    if not base.endswith(_connector.CHECKPOINT_SUFFIX):
        return step, "other"
    return step, _connector.classify_checkpoint_name(base) or "top-k"


def _display_key(entry: CheckpointEntry) -> tuple[int, int, datetime.datetime]:
    """``ls`` order: stepped checkpoints by step, then those without a step (e.g. ``last.ckpt``), each by time."""
    modified = entry.last_modified or datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
    return (0, entry.step, modified) if entry.step is not None else (1, 0, modified)


def _ancestors(name: str) -> list[str]:
    """``a/b/c`` -> ``["a", "a/b"]``: the folders holding a relative key, outermost first."""
    parts = name.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def list_checkpoints(
    url: str, *, recursive: bool = False, all_objects: bool = False, s3_utils: _s3.S3Utils | None = None,
    memory_tier: Any = None,
) -> list[CheckpointEntry]:
    """The checkpoints under the S3 "directory" `url` in ``ls`` order, from one listing; with `memory_tier` (a
    `s3_memory_tier.MemoryTier` naming its ``job``, or a mapping of its fields) also this node's memory tier: each
    entry's `tiers` say where it is, and checkpoints held only in memory or as a replica are listed too.

    The ``*.ckpt`` objects directly under it (`recursive`: at any depth; `all_objects`: every object, kind
    ``"other"`` for the rest) and each DCP checkpoint (a sub-prefix whose top level looks like one, complete or not)
    as one entry; if `url` itself is a DCP checkpoint, it is the only entry. Empty when there is none (see
    `checkpoint_entry` for a URL naming one object). FileNotFoundError for a missing bucket.
    """
    s3 = _utils(s3_utils)
    bucket, prefix = _urls.s3_dir_prefix(url)
    objects = s3.list_objects(url)
    top = {info.key[len(prefix) :] for info in objects if "/" not in info.key[len(prefix) :]}
    directory = _urls.s3_url_parent(url) if _connector.looks_like_distributed_checkpoint(top) else url
    listed = [(info.key[len(prefix) :], info) for info in _without_stale_objects(s3, directory, objects)]
    top_levels: dict[str, set[str]] = {}  # folder (relative) -> names directly in it
    for name, _ in listed:
        folder, _, base = name.rpartition("/")
        top_levels.setdefault(folder, set()).add(base)
    if _connector.looks_like_distributed_checkpoint(top_levels.get("", ())):
        dcp_url = _urls.build_s3_url(bucket, prefix.rstrip("/"))
        objects = [info for _, info in listed]
        if _spread.LAYOUT_NAME in top_levels[""]:  # and the files in its spread directories
            spread = [(n, i) for n, i in _spread.checkpoint_objects(s3, dcp_url) if n.startswith("../")]
            objects += [info for _, info in spread]
            top_levels[""] |= {n.rpartition("/")[2] for n, _ in spread}
        return [CheckpointEntry.from_dcp(dcp_url, _urls.s3_url_name(dcp_url), objects, top_levels[""])]
    folders = {
        folder
        for folder, names in top_levels.items()
        if folder and (recursive or "/" not in folder) and _connector.looks_like_distributed_checkpoint(names)
        and not _spread.in_spread_directory(folder + "/")
    }
    grouped: dict[str, list[_s3.S3ObjectInfo]] = {}
    entries = []
    for name, info in listed:
        if _spread.in_spread_directory(name):  # counted with the checkpoint it belongs to, if that is listed
            owner = _spread.owner_of(name)
            if owner in folders:
                grouped.setdefault(owner, []).append(info)
                top_levels[owner].add(name.rpartition("/")[2])
            continue
        owner = next((f for f in _ancestors(name) if f in folders), None)
        if owner is not None:
            grouped.setdefault(owner, []).append(info)
            continue
        if not name or name.endswith("/") or (not recursive and "/" in name):
            continue
        if all_objects or name.endswith(_connector.CHECKPOINT_SUFFIX):
            entries.append(CheckpointEntry.from_info(info, name))
    for folder, objects in grouped.items():
        entries.append(
            CheckpointEntry.from_dcp(
                f"{_urls.build_s3_url(bucket, prefix)}{folder}", folder, objects, top_levels[folder]
            )
        )
    if memory_tier is not None:
        entries = _with_memory_tier(entries, url, memory_tier, recursive)
    return sorted(entries, key=_display_key)


def _without_stale_objects(
    s3: _s3.S3Utils, directory: str, objects: list[_s3.S3ObjectInfo]
) -> list[_s3.S3ObjectInfo]:
    """`objects` (listed in the checkpoint `directory`) but those a stale run committed after the directory's owner
    took it over (`s3_fencing.stale_objects`; one GET of the owner record)."""
    stale = {info.key for info in _fencing.stale_objects(s3, directory, objects)}
    return [info for info in objects if info.key not in stale]


def _with_memory_tier(entries: list[CheckpointEntry], url: str, config: Any, recursive: bool) -> list[CheckpointEntry]:
    """`entries` with the tiers this node's memory tier adds, and its checkpoints that S3 does not have."""
    where = "s3_checkpoint_admin.py"
    tier_module = _process.require_sibling("s3_memory_tier", __package__, "listing a memory tier", where)
    config = tier_module.MemoryTier.from_value(config)
    if not config.job:
        raise ValueError("listing a memory tier needs its job (MemoryTier(job=...), ls --job): the tier is per job")
    held = tier_module.NodeTier(config, _fencing.current_run()).tiers_under(url)
    result = []
    for entry in entries:
        extra = held.pop(entry.url, {}).get("tiers", [])
        result.append(dataclasses.replace(entry, tiers=(*entry.tiers, *extra)))
    prefix = _urls.normalize_s3_url(url).rstrip("/") + "/"
    for held_url, found in held.items():
        name = held_url[len(prefix) :]
        if recursive or "/" not in name:
            step, kind = classify_checkpoint(name)
            modified = datetime.datetime.fromtimestamp(found["committed"], datetime.timezone.utc)
            tiers = tuple(found["tiers"])
            result.append(CheckpointEntry(held_url, name, found["size"], modified, step, kind, tiers=tiers))
    return result


def checkpoint_entry(url: str, *, s3_utils: _s3.S3Utils | None = None) -> CheckpointEntry | None:
    """The object at exactly `url` as an entry (one HEAD), or None when the URL names no object (or a prefix).
    Package-internal (docs/api.md)."""
    _, key = _urls.parse_s3_url(url)
    if not key or key.endswith("/"):
        return None
    try:
        info = _utils(s3_utils).head_object(url)
    except FileNotFoundError:
        return None
    return CheckpointEntry.from_info(info, _urls.s3_url_name(url))


# --------------------------------------------------------------------------------------------------------------------
# Pruning (rm --keep-last N)
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pruning:
    """What ``rm --keep-last N`` does to a prefix's checkpoints (`plan_pruning`): nothing outside `delete` goes."""

    delete: tuple[CheckpointEntry, ...]
    """The top-k checkpoints beyond the N newest, oldest first."""
    keep: tuple[CheckpointEntry, ...]
    """The N newest top-k checkpoints (by step, then time), newest first."""
    protected: tuple[tuple[CheckpointEntry, str], ...]
    """Checkpoints the rule never deletes nor counts, each with why: ``last`` (resume starts there), ``end`` (it marks
    a finished run), no ``step=`` in the name, or a DCP checkpoint without ``.metadata`` (its save may still run)."""


def _age_key(entry: CheckpointEntry) -> tuple[int, datetime.datetime]:
    """Sort key "older first": by step, then modification time (only entries that have a step are ranked)."""
    modified = entry.last_modified or datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
    return (entry.step if entry.step is not None else -1, modified)


def _why_protected(entry: CheckpointEntry) -> str | None:
    if entry.kind == "end":
        return "an end checkpoint"
    if entry.kind != "top-k":
        return f"a {entry.kind} checkpoint"
    if not entry.complete:
        return "no .metadata: its save may still be running"
    if entry.step is None:
        return "no step= in its name"
    return None


def plan_pruning(entries: Iterable[CheckpointEntry], keep_last: int) -> Pruning:
    """Which of `entries` (from `list_checkpoints`, not recursive) ``rm --keep-last`` deletes: the complete top-k
    checkpoints with a step beyond the `keep_last` highest steps (ties: the newest stays). Changes nothing."""
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0, got {keep_last}")
    entries = list(entries)
    protected = tuple((entry, reason) for entry in entries if (reason := _why_protected(entry)) is not None)
    ranked = sorted((e for e in entries if _why_protected(e) is None), key=_age_key, reverse=True)
    return Pruning(tuple(sorted(ranked[keep_last:], key=_age_key)), tuple(ranked[:keep_last]), protected)


def remove_checkpoint(entry: CheckpointEntry, *, s3_utils: _s3.S3Utils | None = None) -> None:
    """Delete one checkpoint with its checksum records: the object, or a DCP checkpoint's whole ``/``-bounded prefix
    (``x.ckpt/...``, never ``x.ckpt_old/...``)."""
    s3 = _utils(s3_utils)
    if entry.is_dcp:
        _spread.remove_checkpoint(s3, entry.url)  # its spread directories too
    else:
        s3.remove_object(entry.url)


def prune_checkpoints(
    url: str, keep_last: int, *, dry_run: bool = False, s3_utils: _s3.S3Utils | None = None
) -> Pruning:
    """Apply ``rm --keep-last`` to the checkpoints directly under `url` (`plan_pruning`), oldest first; with
    `dry_run` delete nothing. Returns the plan. FileNotFoundError when there is no checkpoint under `url`."""
    s3 = _utils(s3_utils)
    entries = list_checkpoints(url, s3_utils=s3)
    if not entries:
        raise FileNotFoundError(f"no checkpoints (*{_connector.CHECKPOINT_SUFFIX}) under {url}")
    pruning = plan_pruning(entries, keep_last)
    for entry in pruning.delete if not dry_run else ():
        remove_checkpoint(entry, s3_utils=s3)
        logger.info("Deleted %s (beyond the %d newest top-k checkpoints)", entry.url, keep_last)
    return pruning


# --------------------------------------------------------------------------------------------------------------------
# Garbage a killed job leaves: open multipart uploads, DCP checkpoints that never got .metadata (gc)
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IncompleteCheckpoint:
    """A DCP checkpoint directory on S3 whose save never committed (no ``.metadata``, see
    `connector.distributed_checkpoint_problem`)."""

    url: str
    newest: datetime.datetime
    """The newest modification (by the store's clock) of anything under it, uploads in progress inside included."""
    files: tuple[_s3.S3ObjectInfo, ...]
    """The files its save wrote at its top level (shards, per-rank metadata and item records, Lightning's meta.pt,
    their checksum records): what `remove_incomplete_checkpoint` deletes."""
    kept: tuple[str, ...] = ()
    """Any other object under it (another tool's files, a run's owner record): never deleted."""

    @property
    def size(self) -> int:
        """Bytes of its `files` (what removing it frees)."""
        return sum(info.size for info in self.files)


@dataclass(frozen=True)
class Garbage:
    """What `find_garbage` found under a prefix, older than the threshold by the store's clock."""

    url: str
    older_than: datetime.timedelta
    store_time: datetime.datetime
    """The store's clock when the search began; every age is measured against it."""
    uploads: list[_s3.MultipartUploadInfo]
    """Multipart uploads initiated before ``store_time - older_than``, with their parts counted."""
    checkpoints: list[IncompleteCheckpoint]
    """Incomplete DCP checkpoints whose newest object is older than the threshold (if they were asked for)."""
    younger: int = 0
    """Uploads and incomplete checkpoints left alone because they are younger (a save may still be running)."""
    stale: list[_s3.S3ObjectInfo] = dataclasses.field(default_factory=list)
    """Objects a stale run committed after the directory's owner took it over (`s3_fencing.stale_objects`), of any
    age: no reader counts them; remove them with `S3Utils.remove_listed` (conditioned on their listed ETags)."""

    def age(self, item: _s3.MultipartUploadInfo | IncompleteCheckpoint) -> datetime.timedelta:
        """How old an upload (since initiated) or an incomplete checkpoint (since its newest object) is."""
        when = item.initiated if isinstance(item, _s3.MultipartUploadInfo) else item.newest
        return self.store_time - when


def find_garbage(
    dirpath: str | os.PathLike[str],
    older_than: datetime.timedelta,
    *,
    incomplete_checkpoints: bool = False,
    s3_utils: _s3.S3Utils | None = None,
) -> Garbage:
    """The multipart uploads in progress under the S3 "directory" `dirpath` (any depth; ``s3://b/run`` never sees
    ``s3://b/run_old/...``) initiated more than `older_than` ago, and, with `incomplete_checkpoints`, the DCP
    checkpoints under it without ``.metadata`` whose newest object (or upload in progress inside) is older than that;
    and, at any age, the objects a stale run committed there after the directory's owner took it over.

    Ages are measured by the store's clock (`S3Utils.store_time`), taken before listing, so neither a skewed local
    clock nor a slow listing can make a running save's upload look old. An upload without an initiation time is
    never old. Nothing is changed: abort with `S3Utils.abort_multipart_upload`, remove with
    `remove_incomplete_checkpoint`. FileNotFoundError if the bucket does not exist.
    """
    if older_than <= datetime.timedelta(0):
        raise ValueError(f"older_than must be positive, got {older_than}: a running save's uploads are younger")
    url = _urls.normalize_s3_url(dirpath)
    bucket, _ = _urls.s3_dir_prefix(url)
    s3 = _utils(s3_utils)
    try:
        now = s3.store_time(url)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"No such bucket: {_urls.build_s3_url(bucket)} (looking under {url})") from exc
    cutoff = now - older_than
    uploads = s3.list_multipart_uploads(url)
    old = [u for u in uploads if u.initiated is not None and u.initiated < cutoff]
    checkpoints = _incomplete_checkpoints(s3, url, uploads, now) if incomplete_checkpoints else []
    old_checkpoints = [checkpoint for checkpoint in checkpoints if checkpoint.newest < cutoff]
    younger = len(uploads) - len(old) + len(checkpoints) - len(old_checkpoints)
    stale = _fencing.stale_objects(s3, url, s3.list_objects(url))
    return Garbage(url, older_than, now, s3.count_upload_parts(old), old_checkpoints, younger, stale)


@functools.cache
def _dcp_file_pattern(s3_dcp: types.ModuleType) -> re.Pattern[str]:
    """A file a DCP save writes at the top of its directory (shards, commit markers, item records, Lightning's
    meta.pt), or the checksum record beside one: s3_dcp's own file names."""
    metadata, items = re.escape(s3_dcp.METADATA_NAME), re.escape(s3_dcp.ITEM_CHECKSUMS_NAME)
    shard, meta = re.escape(s3_dcp.DCP_SHARD_SUFFIX), re.escape(s3_dcp.LIGHTNING_META_NAME)
    sidecar, layout = re.escape(_s3.CHECKSUM_SIDECAR_SUFFIX), re.escape(_spread.LAYOUT_NAME)
    return re.compile(rf"(?:__\d+_\d+{shard}|(?:__\d+)?(?:{metadata}|{items})|{meta}|{layout})(?:{sidecar})?")


def _incomplete_checkpoints(
    s3: _s3.S3Utils, url: str, uploads: list[_s3.MultipartUploadInfo], now: datetime.datetime
) -> list[IncompleteCheckpoint]:
    """Every DCP checkpoint under `url` (the prefix itself included, any depth) without its ``.metadata``."""
    bucket, prefix = _urls.s3_dir_prefix(url)
    objects = s3.list_objects(url, include_sidecars=True)
    top_levels: dict[str, set[str]] = {}  # folder relative to the prefix ("": the prefix itself) -> names in it
    for info in objects:
        folder, _, name = info.key[len(prefix) :].rpartition("/")
        top_levels.setdefault(folder, set()).add(name)
    found = []
    for folder, names in sorted(top_levels.items()):
        if _connector.distributed_checkpoint_problem(names) is None:
            continue
        if _spread.in_spread_directory(folder + "/") and _spread.owner_of(folder + "/") in top_levels:
            continue  # a spread directory whose checkpoint is there: its files are that checkpoint's
        inside = prefix + folder + "/" if folder else prefix
        checkpoint_url = _urls.build_s3_url(bucket, inside.rstrip("/"))
        dcp_file = _dcp_file_pattern(_s3_dcp(f"Finding what the incomplete DCP save at {checkpoint_url} wrote"))
        below = [info for info in objects if info.key.startswith(inside)]
        times = [info.last_modified for info in below] + [u.initiated for u in uploads if u.key.startswith(inside)]
        files = tuple(info for info in below if dcp_file.fullmatch(info.key[len(inside) :]))  # top level: no "/"
        if _spread.LAYOUT_NAME in names:  # its spread directories' files first, the layout record last
            directories = _spread.read_layout(s3, checkpoint_url)
            spread = tuple(i for n, i in _spread.checkpoint_objects(s3, checkpoint_url, directories,
                                                                      include_sidecars=True)
                           if n.startswith("../") and dcp_file.fullmatch(n.rpartition("/")[2]))
            times += [info.last_modified for info in spread] + [  # and the uploads of a save still running there
                u.initiated for d in directories for u in s3.list_multipart_uploads(_spread.join(checkpoint_url, d))]
            files = spread + tuple(sorted(files, key=lambda info: info.key.endswith(_spread.LAYOUT_NAME)))
        found.append(
            IncompleteCheckpoint(
                checkpoint_url,
                max((t for t in times if t is not None), default=now),
                files,
                tuple(info.url for info in below if info not in files),
            )
        )
    return found


def remove_incomplete_checkpoint(checkpoint: IncompleteCheckpoint, *, s3_utils: _s3.S3Utils | None = None) -> bool:
    """Delete the files of an incomplete DCP checkpoint (`IncompleteCheckpoint.files`; other objects stay), after
    listing it again: False, deleting nothing, if it got its ``.metadata`` or anything under it changed since
    `find_garbage` saw it (a save started there again)."""
    s3 = _utils(s3_utils)
    _, prefix = _urls.s3_dir_prefix(checkpoint.url)
    objects = s3.list_objects(checkpoint.url, include_sidecars=True)
    names = {info.key[len(prefix) :] for info in objects if "/" not in info.key[len(prefix) :]}
    changed = any(info.url not in checkpoint.kept and info not in checkpoint.files for info in objects) or any(
        upload.initiated is None or upload.initiated > checkpoint.newest
        for upload in s3.list_multipart_uploads(checkpoint.url)
    )
    if _connector.distributed_checkpoint_problem(names) is None or changed:
        logger.warning("Not removing %s: it changed since it was found incomplete", checkpoint.url)
        return False
    s3.remove_objects(info.url for info in checkpoint.files)
    return True


# --------------------------------------------------------------------------------------------------------------------
# Verifying a DCP checkpoint in place (verify): every file whole, every recorded item
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerifiedFile:
    """One object of a DCP checkpoint as `verify_checkpoint` checked it."""

    url: str
    size: int
    checksum: _s3.RecordedChecksum | None
    """The full-object checksum the bytes matched; None when none was recorded (only the size was checked)."""
    items: int
    """Items checked against the item checksums `s3_dcp.S3StorageWriter` recorded (0 for files without a record)."""


@dataclass
class CheckpointVerification:
    """What `verify_checkpoint` found: `problems` is empty when every file and item matched what was recorded."""

    url: str
    complete: bool
    """Whether the checkpoint's ``.metadata`` (or each rank's ``__{rank}.metadata``) exists."""
    files: list[VerifiedFile] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    """One line per failure, each naming the object's URL."""

    @property
    def ok(self) -> bool:
        """Complete, and every file and item matched."""
        return self.complete and not self.problems


def _join(base: str, name: str) -> str:
    return _spread.join(base, name)


def resume_after_failures(
    url: str, failed_urls: set[str], *, s3_utils: _s3.S3Utils | None = None
) -> tuple[list[str], str | None]:
    """What resume does in the directory `url` when the checkpoints `failed_urls` do not verify: the ones it skips,
    newest first (`connector.find_resume_checkpoints` order), and the one it starts from (None when none is left).
    Nothing is deleted: resume only skips them (docs/crash-safety.md). Package-internal (docs/api.md)."""
    order = _connector.find_resume_checkpoints(
        url, resume_past_end=True, resume_ignore_no_checkpoint=True, s3_utils=s3_utils
    )
    failed = {failed_url.rstrip("/") for failed_url in failed_urls}
    skipped: list[str] = []
    for candidate in order:
        if candidate.rstrip("/") not in failed:
            return skipped, candidate
        skipped.append(candidate)
    return skipped, None


def verify_checkpoint(
    path: str | os.PathLike[str], s3_utils: _s3.S3Utils | None = None, *, progress: Callable[[int], None] | None = None
) -> CheckpointVerification:
    """Download every object under the DCP checkpoint prefix `path` and check it: the full-object checksum recorded
    at upload (`S3Utils.download_to_memory`), and, for files `s3_dcp.S3StorageWriter` wrote, the ETag and every
    item's checksum in the item record (a shard replaced after the save has another ETag), and each recorded tensor
    span against its item (loads trust those spans). Files the record names but that are gone are problems too.
    Needs no torch: ``.metadata`` is checked as a file, never unpickled here. `progress` is called with byte counts
    as downloads arrive. Raises FileNotFoundError for a missing bucket, `connector.DCPSupportMissingError` where
    ``s3_dcp.py`` is absent."""
    url = _urls.normalize_s3_url(path).rstrip("/")
    bucket, key = _urls.parse_s3_url(url)
    if not key:
        raise ValueError(f"{url}: a DCP checkpoint needs a key prefix inside the bucket, e.g. s3://{bucket}/ckpt")
    s3_dcp = _s3_dcp(f"Verifying the DCP checkpoint {url}")
    s3 = _utils(s3_utils)
    metadata = s3_dcp.METADATA_NAME
    pairs = _spread.checkpoint_objects(s3, url)  # relative paths as recorded, spread directories' too
    fresh = {info.key for info in _without_stale_objects(s3, _urls.s3_url_parent(url), [i for _, i in pairs])}
    objects = {relative: info for relative, info in pairs if info.key in fresh}  # but a stale run's (its owner)
    ranks: list[int | None] = [None] if metadata in objects else []
    ranks += sorted(
        int(name[2 : -len(metadata)])
        for name in objects
        if name.startswith("__") and name.endswith(metadata) and name[2 : -len(metadata)].isdigit()
    )
    report = CheckpointVerification(url, complete=bool(ranks))
    if not ranks:
        report.problems.append(f"{_join(url, metadata)} does not exist: the save never finished (incomplete)")
    records: dict[str, dict[str, Any]] = {}
    for rank in ranks if metadata not in objects else [None]:
        record_name = s3_dcp.item_checksums_name(rank)
        if record_name not in objects:
            continue  # written by another tool: whole-file checksums only
        try:
            with s3.download_to_memory(_join(url, record_name)) as downloaded:
                record = json.loads(downloaded.read_all())
            records.update(record.get("files", {}))
        except (_s3.ChecksumMismatchError, ValueError, AttributeError) as exc:
            report.problems.append(f"{_join(url, record_name)} is unreadable or corrupt: {exc}")
    for relative in sorted(set(records) - set(objects)):
        report.problems.append(f"{_join(url, relative)} is missing: the checkpoint records it but it is gone")
    for relative, info in sorted(objects.items()):
        file_url = info.url
        record = records.get(relative)
        if record and record.get("etag") and record["etag"].strip('"') != info.etag.strip('"'):
            report.problems.append(f"{file_url} was replaced after the checkpoint was saved (ETag {info.etag})")
            continue
        try:
            with s3.download_to_memory(file_url, progress=progress) as downloaded:
                items = _verify_items(s3_dcp, file_url, downloaded, record)
                report.files.append(VerifiedFile(file_url, downloaded.size, downloaded.verified_against, items))
        except FileNotFoundError:
            report.problems.append(f"{file_url} was deleted while verifying")
        except _s3.ChecksumMismatchError as exc:
            report.problems.append(str(exc))
    return report


# The item record's layout (written by s3_dcp.S3StorageWriter, version 1): {"algorithm": name, "etag": ...,
# "items": {offset: [length, checksum]}, "tensors": {offset: [start, nbytes, checksum, dtype, shape]}}, where a
# tensor span's start is relative to its item and its checksum is that of the tensor bytes alone.


def _verify_items(
    s3_dcp: types.ModuleType, url: str, downloaded: _s3.DownloadedObject, record: dict[str, Any] | None
) -> int:
    """Check every item (and recorded tensor span) of a downloaded file against its record; the number checked."""
    if not record:
        return 0
    algorithm = _s3.ChecksumAlgorithm.named(record["algorithm"])
    items = record.get("items", {})
    spans = record.get("tensors")
    spans = spans if isinstance(spans, dict) else {}  # not a mapping: loads ignore it too
    with downloaded.view() as view:
        for offset_text, (length, expected) in sorted(items.items(), key=lambda item: int(item[0])):
            offset = int(offset_text)
            if offset + length > len(view):
                raise _s3.ChecksumMismatchError(f"{url} is truncated: an item at bytes {offset}-{offset + length}")
            actual = _s3.checksum_of(algorithm, view[offset : offset + length])
            if actual != expected:
                raise _s3.ChecksumMismatchError(
                    f"{url} is corrupt: bytes {offset}-{offset + length} have {algorithm.name} {actual:#x}, but "
                    f"{expected:#x} was recorded when the checkpoint was written. Do not use it."
                )
            if offset_text in spans:
                item = view[offset : offset + length]
                _check_span_record(s3_dcp, url, algorithm, item, offset, expected, spans[offset_text])
    return len(items)


def _check_span_record(
    s3_dcp: types.ModuleType, url: str, algorithm: Any, item: memoryview, offset: int, checksum: int, span: Any
) -> None:
    """A recorded tensor span (which loads trust instead of the item's framing) must be well formed and agree with its
    item's verified `checksum`: the checksums of the bytes before and after the span, combined with the span's
    recorded one, must give the item's (`s3_dcp.require_span_in_item`: the reader's own check)."""
    try:
        start, nbytes, recorded = int(span[0]), int(span[1]), int(span[2])
        if not 0 <= start <= len(item) - nbytes:
            raise ValueError("outside its item")
    except (TypeError, ValueError, IndexError) as exc:
        raise _s3.ChecksumMismatchError(
            f"{url}: the tensor record of the item at byte {offset} is malformed ({exc}). Do not use the checkpoint."
        ) from exc
    s3_dcp.require_span_in_item(url, algorithm, item, offset, checksum, start, nbytes, recorded)
