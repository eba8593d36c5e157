"""Prefix spreading: a DCP checkpoint's shards over several key prefixes, so that S3 serves a large save from several
partitions.

S3 serves at least 3,500 writes and 5,500 reads per second per partitioned prefix. It partitions a bucket by key
range and splits a busy range gradually (minutes), answering ``503 SlowDown`` meanwhile. A DCP save at thousands of
ranks writes thousands of shards under one new prefix (``run/step-N/``) within seconds; a range split for one step
helps the next only if the next step's keys fall into the same ranges. Spreading therefore puts its varying segment
*before* the part of the key that changes from checkpoint to checkpoint::

    s3://b/run/step-200/.metadata                        the commit marker and the records: where they always are
    s3://b/run/step-200/.s3ckpt-layout.json              this layout, written before any shard
    s3://b/run/s3ckpt-spread-03/step-200/__3_0.distcp    rank 3's shard (rank % prefixes = 3)

Every save of the run reuses the same ``run/s3ckpt-spread-XX/`` ranges, so what S3 split for one save serves the
next. s3torchconnector's prefix strategies (``RoundRobinPrefixStrategy``, ``BinaryPrefixStrategy``,
``HexPrefixStrategy``) put theirs after the checkpoint's own path instead, where each new checkpoint starts
unpartitioned again.

Nothing needs configuring to read, list, verify, convert or remove a spread checkpoint:

* each shard's relative path in ``.metadata`` (and in the item-checksum record) is ``../s3ckpt-spread-03/step-200/
  __3_0.distcp``: `join` resolves it (`s3_dcp.S3StorageReader`, ``convert``, ``verify``), and torch's own
  ``FileSystemReader`` resolves it too in a local copy of the run directory;
* the layout record (`LAYOUT_NAME`) names the spread directories, written before any shard (by the memory tier's
  drain, `ensure_layout`, before the first shard reaches S3), removed last, so ``ls``,
  ``rm``, ``gc`` and overwriting saves find every object of a checkpoint, also of one whose save never committed
  (`checkpoint_objects`, `remove_checkpoint`); the segment's fixed start
  (``s3_dirpath_utils.SPREAD_SEGMENT_PREFIX``) keeps listings from mistaking a spread directory for a checkpoint of
  its own (`in_spread_directory`);
* the request pacer paces the requests to each spread directory apart from the rest of the bucket and from the other
  spread directories (``s3_dirpath_utils.spread_prefix``, `s3_utils.request_pacer`), as S3 serves each from a
  partition of its own: one prefix's ``SlowDown`` does not slow the others.

The default is one prefix with unchanged keys and no layout record. Single-file checkpoints write one object per save
(per rank), far below a partition's rate: spreading is for DCP (`s3_dcp.S3StorageWriter`'s ``prefix_spreading``).
benchmarks/README.md shows at what scale it pays (docs/scale.md). Needs no torch.
"""

from __future__ import annotations

import json
import logging
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

if __package__:
    from . import s3_dirpath_utils as _urls
    from . import s3_utils as _s3
else:  # installed (or copied) as top-level modules
    import s3_dirpath_utils as _urls
    import s3_utils as _s3

__all__ = ["PrefixSpreading"]

logger = logging.getLogger(__name__)
__version__ = _urls.__version__

LAYOUT_NAME = ".s3ckpt-layout.json"  # Package-internal (docs/api.md)
"""A spread checkpoint's layout record, beside its ``.metadata``: ``{"version": 1, "directories": [...]}``, each
directory relative to the checkpoint (``../s3ckpt-spread-03/step-200/``). Package-internal (docs/api.md)."""
_LAYOUT_VERSION = 1
DEFAULT_AUTO_PREFIXES = 16
"""Prefixes of ``prefix_spreading="auto"`` once throttling was seen."""


# --------------------------------------------------------------------------------------------------------------------
# The strategy: which prefix a rank's files go to
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefixSpreading:
    """Spread a DCP save's shards over `prefixes` key prefixes, rank ``r`` to prefix ``r % prefixes`` (override
    `index_of` for another assignment, e.g. by node).

    With `after_throttles`, a save spreads only once this process's write pacer for the checkpoint's own prefix (the
    bucket's pacer, not a spread prefix's: `s3_utils.S3Utils.pacer`) has seen that many throttling answers
    (``503 SlowDown``) since the process started (``prefix_spreading="auto"``: 16 prefixes after the first); from
    then on every save of the run spreads. The decision is the coordinator's (rank 0), from what
    its own process saw (not the whole job's count: that is not built), and every rank follows its plan.
    """

    prefixes: int = DEFAULT_AUTO_PREFIXES
    after_throttles: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prefixes, int) or self.prefixes < 1:
            raise ValueError(f"prefix spreading needs prefixes >= 1, got {self.prefixes!r}")
        if self.after_throttles is not None and (not isinstance(self.after_throttles, int) or self.after_throttles < 1):
            raise ValueError(f"after_throttles must be None or an int >= 1, got {self.after_throttles!r}")

    @classmethod
    def from_value(cls, value: int | str | PrefixSpreading | None) -> PrefixSpreading | None:
        """`S3StorageWriter`'s ``prefix_spreading``: None or 1 (one prefix, the default), a number of prefixes,
        ``"auto"`` (16 once the run was throttled), or a `PrefixSpreading`."""
        if value is None or isinstance(value, PrefixSpreading):
            return value
        if value == "auto":
            return cls(DEFAULT_AUTO_PREFIXES, after_throttles=1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"prefix_spreading must be None, an int >= 1, 'auto' or a PrefixSpreading, got {value!r}")
        return None if value == 1 else cls(value)

    def index_of(self, rank: int) -> int:
        """The prefix (0 .. prefixes - 1) of `rank`'s files."""
        return rank % self.prefixes

    def segment(self, index: int) -> str:
        """The key segment of prefix `index`: ``s3ckpt-spread-`` and its index in hex, 2 digits (more beyond 256
        prefixes), so that a later save with another count up to 256 reuses the same names, and S3's ranges."""
        width = max(2, len(f"{self.prefixes - 1:x}"))
        return f"{_urls.SPREAD_SEGMENT_PREFIX}{index:0{width}x}"

    def applies(self, s3: _s3.S3Utils, url: str) -> bool:
        """Whether a save to `url` spreads now (always, without `after_throttles`)."""
        if self.after_throttles is None:
            return True
        seen = s3.pacer(url).writes.throttles
        if seen >= self.after_throttles:
            logger.info("Spreading the DCP save to %s over %d prefixes: %d throttling answers seen", url, self.prefixes,
                        seen)
            return True
        return False


def _directory(checkpoint_url: str, segment: str) -> str:
    """``../<segment>/<checkpoint's name>/``: a spread directory relative to the checkpoint."""
    return f"../{segment}/{_urls.s3_url_name(checkpoint_url)}/"


# --------------------------------------------------------------------------------------------------------------------
# Keys: relative paths that may leave the checkpoint's directory for its spread directories
# --------------------------------------------------------------------------------------------------------------------


def join(base: str, relative: str) -> str:
    """The URL of `relative` (a DCP relative path: ``__0_0.distcp`` or ``../s3ckpt-spread-00/step-2/__0_0.distcp``;
    a spread directory ``../s3ckpt-spread-00/step-2/`` gives its URL without the ``/``) under the checkpoint URL
    `base`. ``..`` goes up one key segment, at most to the directory holding `base` (where the spread directories
    are): ValueError naming the URL beyond that (a crafted ``.metadata`` reads nothing else).
    Package-internal (docs/api.md)."""
    base = base.rstrip("/")
    if not relative.startswith("../"):
        return base + "/" + relative
    bucket, key = _urls.parse_s3_url(base)
    parent = key.rpartition("/")[0]
    resolved = posixpath.normpath(posixpath.join("/", key, relative)).lstrip("/")
    if not (resolved.startswith(parent + "/") if parent else resolved):
        raise ValueError(f"{base}: the relative path {relative!r} leads outside the directory holding the checkpoint")
    return _urls.build_s3_url(bucket, resolved)


# --------------------------------------------------------------------------------------------------------------------
# The layout record and a checkpoint's objects
# --------------------------------------------------------------------------------------------------------------------


def read_layout(s3: _s3.S3Utils, checkpoint_url: str) -> list[str]:
    """The spread directories (relative, ``../s3ckpt-spread-03/step-200/``) the checkpoint's layout record names;
    empty without one (one prefix). ValueError naming the record when it is not one. Package-internal (docs/api.md)."""
    url = join(checkpoint_url, LAYOUT_NAME)
    try:
        with s3.download_to_memory(url) as downloaded:
            record = json.loads(downloaded.read_all())
    except FileNotFoundError:
        return []
    directories = record.get("directories") if isinstance(record, dict) else None
    if not isinstance(directories, list) or not all(isinstance(d, str) and d.startswith("../") for d in directories):
        raise ValueError(f"{url} is not a layout record (no list of ../ directories): remove it or restore it")
    for directory in directories:
        join(checkpoint_url, directory)  # refuses a directory outside the run's
    return directories


def _layout_record(directories: Iterable[str]) -> bytes:
    return json.dumps({"version": _LAYOUT_VERSION, "directories": sorted(set(directories))}).encode()


def checkpoint_objects(
    s3: _s3.S3Utils, checkpoint_url: str, directories: Iterable[str] | None = None, *, include_sidecars: bool = False
) -> list[tuple[str, _s3.S3ObjectInfo]]:
    """``(relative path, object)`` of every object of the checkpoint: those under its own prefix (any depth), then
    those at the top level of each spread directory (`directories`, or those its layout record names), named as its
    ``.metadata`` names them (``../s3ckpt-spread-03/step-200/__3_0.distcp``). Package-internal (docs/api.md)."""
    base = checkpoint_url.rstrip("/")
    found = [(info.url[len(base) + 1 :], info) for info in s3.list_objects(base, include_sidecars=include_sidecars)]
    for directory in read_layout(s3, base) if directories is None else directories:
        url = join(base, directory)
        for info in s3.list_objects(url, include_sidecars=include_sidecars):
            name = info.url[len(url) + 1 :]
            if "/" not in name:
                found.append((directory + name, info))
    return found


def unused_shards(s3: _s3.S3Utils, checkpoint_url: str, kept: Iterable[str], suffix: str,
                  directories: Iterable[str] | None = None) -> list[str]:  # fmt: skip
    """The URLs of a replaced checkpoint's shards its successor does not use: the objects ending in `suffix` at the
    top level of the checkpoint or of a spread directory (`checkpoint_objects`) whose relative path (as ``.metadata``
    names it) is not among `kept`. Package-internal (docs/api.md)."""
    kept = set(kept)
    return [obj.url for name, obj in checkpoint_objects(s3, checkpoint_url, directories)
            if ("/" not in name or name.startswith("../")) and name.endswith(suffix) and name not in kept]  # fmt: skip


def ensure_layout(s3: _s3.S3Utils, checkpoint_url: str, directories: Iterable[str], *, fence: Any = None) -> None:
    """Make the layout record on S3 name every one of `directories` (a spread save's, each relative as in the
    record) before a file of the save goes into one of them: nothing when the record names them already, else the
    record of these and those it named (an earlier checkpoint's at the same URL), with `fence` (as `S3Utils.open_writer`
    takes it). Every rank of a save passes the same `directories`, so ranks that do this at once write the same
    record. The memory tier's drains and its files that go to S3 directly call this (`s3_dcp_tier`).
    Package-internal (docs/api.md)."""
    wanted = set(directories)
    if not wanted:
        return
    named = set(read_layout(s3, checkpoint_url))
    if wanted <= named:
        return
    for directory in wanted:
        join(checkpoint_url, directory)  # refuses a directory outside the run's
    body = _layout_record(wanted | named)
    with s3.open_writer(join(checkpoint_url, LAYOUT_NAME), max(_s3.DEFAULT_CHUNK_SIZE_MB, 1), 1, fence=fence) as out:
        out.write(body)


def belongs_to(url: str, checkpoint_url: str) -> bool:
    """Whether the object `url` is a file of the checkpoint at `checkpoint_url`: under its prefix, or at the top level
    of one of its spread directories (``run/s3ckpt-spread-03/step-200/__3_0.distcp`` of ``run/step-200``).
    Package-internal (docs/api.md)."""
    base = checkpoint_url.rstrip("/")
    if url.startswith(base + "/"):
        return True
    parent = base.rpartition("/")[0] + "/"
    if not url.startswith(parent):
        return False
    relative = url[len(parent) :]
    return relative.count("/") == 2 and in_spread_directory(relative) and owner_of(relative) == base[len(parent) :]


def in_spread_directory(relative: str) -> bool:
    """Whether a key relative to a listed directory lies in a spread directory (a segment ``s3ckpt-spread-XX``):
    it belongs to the checkpoint whose layout record names it, not to a checkpoint of its own.
    Package-internal (docs/api.md)."""
    return _urls.spread_prefix(relative) != ""


def owner_of(relative: str) -> str:
    """The checkpoint folder a key (or folder, ending in ``/``) in a spread directory belongs to, relative to the same
    listing: ``run/s3ckpt-spread-03/step-200/__3_0.distcp`` -> ``run/step-200``. Package-internal (docs/api.md)."""
    prefix = _urls.spread_prefix(relative)  # "run/s3ckpt-spread-03/"
    outside = prefix[: prefix.rstrip("/").rfind("/") + 1]  # "run/"
    return posixpath.dirname(outside + relative[len(prefix) :])


def pace_spread_prefixes(s3: _s3.S3Utils, urls: Iterable[str], prefixes: int | None = None) -> None:
    """Tell the request pacers of the spread prefixes among `urls` (files of one checkpoint) that each is one of
    `prefixes` (default: as many as `urls` reach), sent to by that share of the job's processes: a budget
    (``max_requests_per_second``) is per prefix, and each process's share of it is over the processes that send
    there (`s3_utils.RequestPacer.spread_over`). Package-internal (docs/api.md)."""
    spread = {_urls.spread_prefix(_urls.parse_s3_url(url)[1]): url for url in urls}
    spread.pop("", None)
    for url in spread.values():
        s3.pacer(url).spread_over(prefixes or len(spread))


def remove_checkpoint(s3: _s3.S3Utils, checkpoint_url: str, *, fence: Any = None) -> int:
    """Delete a DCP checkpoint with its records, wherever its layout put its objects: first everything in its spread
    directories, then everything at and under `checkpoint_url` (the layout record among them, so that an interrupted
    removal can be run again). `fence` as in `S3Utils.remove_objects_with_prefix`. How many keys.
    Package-internal (docs/api.md)."""
    base = checkpoint_url.rstrip("/")
    removed = 0
    for directory in read_layout(s3, base):
        removed += s3.remove_objects_with_prefix(join(base, directory) + "/", fence=fence)
    return removed + s3.remove_objects_with_prefix(checkpoint_url, fence=fence)


# --------------------------------------------------------------------------------------------------------------------
# One save's layout (the writer's side)
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveLayout:
    """Where one DCP save puts its files: its spread directories (none: one prefix), and those an earlier checkpoint
    at the same URL used (`previous`), whose shards the save removes once it committed if it does not reuse them.
    Package-internal (docs/api.md)."""

    spreading: PrefixSpreading | None = None
    directories: tuple[str, ...] = ()
    previous: tuple[str, ...] = ()

    @classmethod
    def plan(
        cls, s3: _s3.S3Utils, url: str, spreading: PrefixSpreading | None, replacing: bool, *, look: bool = True
    ) -> SaveLayout:
        """The layout of a save to `url`: every directory of `spreading` (ranks without collectives plan alone, and
        each writes the same record). The earlier checkpoint's directories are read when the save spreads or
        replaces a checkpoint: a default save to a new URL reads nothing. With `look` False nothing is read (the
        memory tier's saves: `ensure_layout` merges the earlier record when the save reaches S3)."""
        previous = tuple(read_layout(s3, url)) if look and (spreading is not None or replacing) else ()
        if spreading is None or not spreading.applies(s3, url):
            return cls(None, (), previous)
        return cls(spreading, tuple(_directory(url, spreading.segment(i)) for i in range(spreading.prefixes)), previous)

    def record(self) -> bytes | None:
        """The layout record to write before any shard (None: write none): this save's directories and the earlier
        checkpoint's, so that a save that never commits leaves nothing `gc` cannot find."""
        return _layout_record(self.directories + self.previous) if self.directories else None

    def file_prefix(self, url: str, prefix: str, rank: int) -> str:
        """Rank `rank`'s file-name prefix (``__3_``), in its spread directory when the save spreads."""
        if self.spreading is None:
            return prefix
        return _directory(url, self.spreading.segment(self.spreading.index_of(rank))) + prefix

    def stale_shard_directories(self) -> tuple[str, ...]:
        """Directories (besides the checkpoint's own) that may hold shards of the checkpoint this save replaced."""
        return tuple(sorted(set(self.directories + self.previous)))
