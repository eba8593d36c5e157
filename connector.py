"""Resume from S3 at thousands of ranks: rank-0 discovery, broadcast, an S3-aware ``ModelCheckpoint``, one-call wiring.

If every rank lists the bucket to find the checkpoint, a large job throttles S3 before its first step; NeMo's design
(global rank 0 finds it, then broadcasts) regressed, and Lightning's ``ckpt_path="last"`` lists on every rank and
drops the ``s3://`` prefix (#18261). This module restores the design with NeMo's names and meaning: discovery by
rules independent of listing order (`find_resume_checkpoint`, `check_resume`: on S3 only rank 0 lists), skipping a
checkpoint that does not load for the next newest (`load_newest_usable`), `NeMoCheckpointConnector` (every rank loads
rank 0's choice), `S3ModelCheckpoint` and `configure_s3_checkpointing` (all of it from a NeMo-style config).

Lightning's two families reject each other's classes, and neither is imported here: `checkpoint_connector_class` and
`s3_model_checkpoint_class` build the subclasses on first use; ``NeMoCheckpointConnector`` / ``S3ModelCheckpoint``
(PEP 562) are the default family's, ``...PL`` ``pytorch_lightning``'s. The behaviour lives in the plain mixins
`BroadcastResumeConnectorMixin` and `S3ModelCheckpointMixin`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import math
import os
import re
import time
import types
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

if __package__:
    from . import s3_checkpoint_io as _ckpt_io
    from . import s3_dirpath_utils as _urls
    from . import s3_fencing as _fencing
    from . import s3_process as _process
    from . import s3_utils as _s3
else:  # installed (or copied) as top-level modules
    import s3_checkpoint_io as _ckpt_io
    import s3_dirpath_utils as _urls
    import s3_fencing as _fencing
    import s3_process as _process
    import s3_utils as _s3


@functools.cache
def _s3_dcp() -> types.ModuleType | None:
    """`s3_dcp` from beside this module, imported on first need, or None where a fork copied only the core files."""
    return _process.import_sibling("s3_dcp", __package__)


__all__ = [
    "CHECKPOINT_SUFFIX",
    "END_FILE_SUFFIX",
    "LAST_DIRECTORY_PATTERN",
    "LAST_FILE_PATTERN",
    "STEP_PATTERN",
    "BroadcastResumeConnectorMixin",
    "CheckpointAlreadyCompletedError",
    "CheckpointNotFoundError",
    "DCPSupportMissingError",
    "NeMoCheckpointConnector",
    "NotFoundError",
    "ResumeCandidate",
    "ResumeFailedError",
    "S3Checkpointing",
    "S3ModelCheckpoint",
    "S3ModelCheckpointMixin",
    "build_s3_checkpointing",
    "check_resume",
    "checkpoint_connector_class",
    "checkpoint_step",
    "classify_checkpoint_name",
    "configure_s3_checkpointing",
    "find_resume_checkpoint",
    "find_resume_checkpoints",
    "install_checkpoint_connector",
    "is_global_rank_zero",
    "is_unusable_checkpoint_error",
    "list_resume_candidates",
    "load_newest_usable",
    "s3_model_checkpoint_class",
    "select_resume_candidate",
    "uninject_model_parallel_rank",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------------


class CheckpointNotFoundError(FileNotFoundError):
    """Resuming was requested but there is nothing to resume from (NeMo raised its ``NotFoundError`` here)."""


NotFoundError = CheckpointNotFoundError
"""NeMo's name for the same error (``nemo.utils.exceptions.NotFoundError``)."""


class CheckpointAlreadyCompletedError(ValueError):
    """The newest checkpoint is an ``*end.ckpt``: the previous run finished (NeMo raised ``ValueError`` here)."""


class DCPSupportMissingError(ImportError):
    """A DCP checkpoint on S3 needs ``s3_dcp.py``, not beside this module (a fork that copied only the core files)."""


def _require_dcp_support(url: str) -> None:
    if _urls.is_s3_url(url) and _s3_dcp() is None:
        here = os.path.dirname(os.path.abspath(__file__))
        raise DCPSupportMissingError(
            f"{url} is a sharded (torch.distributed.checkpoint) checkpoint, and loading it from S3 needs s3_dcp.py, "
            f"which is not beside connector.py in {here}: copy s3_dcp.py from s3-checkpoint-io there (with a "
            "sharded strategy from it), or resume from a single-file checkpoint."
        )


# --------------------------------------------------------------------------------------------------------------------
# Which rank am I (before the process group exists)?
# --------------------------------------------------------------------------------------------------------------------

global_rank = _process.global_rank
"""`s3_process.global_rank` under NeMo's name: torch.distributed's rank, else the launcher's (before a group)."""


def is_global_rank_zero(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is global rank 0 (see `global_rank`)."""
    return global_rank(environ) == 0


# --------------------------------------------------------------------------------------------------------------------
# Resume checkpoint selection (no Lightning, no torch)
# --------------------------------------------------------------------------------------------------------------------

# NeMo's model-parallel shard folders (``nemo/utils/model_utils.py::inject_model_parallel_rank``):
# mp_rank_XX[_fsdp_shard_YYYYY], tp_rank_XX_pp_rank_YYY, and fsdp_shard_YYYYY without model parallelism.
_RANK_FOLDER = re.compile(
    r"(?:mp_rank_(?P<mp>\d+)|tp_rank_(?P<tp>\d+)_pp_rank_(?P<pp>\d+))(?:_fsdp_shard_(?P<fsdp>\d+))?"
    r"|fsdp_shard_(?P<fsdp_only>\d+)"
)
# Checkpoint names (NeMo's ``*last.ckpt`` / ``*end.ckpt`` globs), public so that tools apply discovery's rules.
CHECKPOINT_SUFFIX = ".ckpt"
STEP_PATTERN = re.compile(r"(?<![A-Za-z0-9_])step=(\d+)")
"""``step=N`` in a checkpoint name (not ``mystep=N``); the last one counts."""
LAST_FILE_PATTERN = re.compile(r"last(?:-v\d+)?\.ckpt$")
"""NeMo's ``*last.ckpt``, plus Lightning's versioned ``*last-v1.ckpt``."""
LAST_DIRECTORY_PATTERN = re.compile(r"last(?:-v\d+)?$")
"""Distributed (directory) checkpoints: NeMo's ``*last``."""
END_FILE_SUFFIX = "end.ckpt"
"""NeMo's ``*end.ckpt``: the run finished (``*end`` for a directory)."""
_UNFINISHED_SUFFIX = "-unfinished"  # NeMo's unfinished-checkpoint marker (NeMoModelCheckpoint)


def uninject_model_parallel_rank(path: str | os.PathLike[str]) -> str:
    """`path` without its model-parallel shard folder (``.../mp_rank_00/x.ckpt`` -> ``.../x.ckpt``); unlike NeMo's,
    only a real shard folder, and an ``s3://`` URL stays intact."""
    text = _urls.normalize_s3_url(path) if _urls.is_s3_url(path) else os.fspath(path)
    head, sep, name = text.rpartition("/")
    if not sep:
        return text
    parent, sep2, folder = head.rpartition("/")
    if sep2 and _RANK_FOLDER.fullmatch(folder):
        return f"{parent}/{name}"
    return text


def _shard_index(folder: str) -> tuple[str, tuple[int, ...]]:
    """(layout, indices) of a shard folder: layout tells which kind of grid the indices belong to."""
    match = _RANK_FOLDER.fullmatch(folder)
    assert match is not None
    groups = match.groupdict()
    if groups["fsdp_only"] is not None:
        return "fsdp", (int(groups["fsdp_only"]),)
    fsdp = () if groups["fsdp"] is None else (int(groups["fsdp"]),)
    if groups["mp"] is not None:
        return ("mp+fsdp" if fsdp else "mp"), (int(groups["mp"]), *fsdp)
    return ("tp_pp+fsdp" if fsdp else "tp_pp"), (int(groups["tp"]), int(groups["pp"]), *fsdp)


def _shard_problem(shards: Iterable[str]) -> str | None:
    """Why a checkpoint's shard folders are not a full grid (one layout, each index 0 to the largest), or None."""
    shards = sorted(shards)
    if shards == [""]:
        return None
    if "" in shards:
        return "it exists both as a single file and as model-parallel shards"
    layouts = {_shard_index(folder) for folder in shards}
    if len({layout for layout, _ in layouts}) > 1:
        return f"its shard folders mix layouts ({', '.join(shards)})"
    indices = {index for _, index in layouts}
    expected = math.prod(max(index[dim] for index in indices) + 1 for dim in range(len(next(iter(indices)))))
    if len(indices) != expected:
        return f"only {len(indices)} of its {expected} model-parallel shards exist ({', '.join(shards)})"
    return None


@dataclass(frozen=True)
class ResumeCandidate:
    """One checkpoint that resuming could start from, as found in a checkpoint directory."""

    name: str
    """File (or directory) name, e.g. ``gpt--step=100-last.ckpt``."""
    url: str
    """What to pass to Lightning: ``s3://bucket/dir/<name>`` or ``<dir>/<name>``, without any shard folder."""
    kind: str
    """``"last"``, ``"end"`` (the run finished), or ``"step"`` (a top-k ``step=N`` checkpoint: a fallback only)."""
    step: int | None
    """The ``step=N`` in the name, if any."""
    modified: float
    """Newest modification time of its parts (POSIX seconds)."""
    shards: tuple[str, ...] = ("",)
    """Model-parallel shard folders holding it (``("",)`` for a single file)."""
    is_directory: bool = False
    """A distributed (directory) checkpoint."""
    is_dcp: bool = False
    """A torch.distributed.checkpoint directory (``.distcp`` shards and ``.metadata``): on S3, `s3_dcp` loads it."""
    problem: str | None = None
    """Why it cannot be used (incomplete shards, unfinished marker), or None."""


def classify_checkpoint_name(name: str, is_directory: bool = False) -> str | None:
    """What a file (or directory) name denotes for resuming: ``"end"`` (``*end.ckpt``, ``*end``: the run finished),
    ``"last"`` (``*last[-vN].ckpt``, directories ``*last[-vN]`` and ``iter_NNNNNNN``), else None."""
    if is_directory:
        if MEGATRON_ITERATION_PATTERN.fullmatch(name):
            return "last"
        name = name.removesuffix(CHECKPOINT_SUFFIX)
        if name.endswith(END_FILE_SUFFIX.removesuffix(CHECKPOINT_SUFFIX)):
            return "end"
        return "last" if LAST_DIRECTORY_PATTERN.search(name) else None
    if name.endswith(END_FILE_SUFFIX):
        return "end"
    return "last" if LAST_FILE_PATTERN.search(name) else None


def checkpoint_step(name: str) -> int | None:
    """The ``N`` of the last ``step=N`` in a checkpoint name (``mystep=N`` does not count), or None."""
    steps = STEP_PATTERN.findall(name)
    if not steps and (iteration := MEGATRON_ITERATION_PATTERN.fullmatch(name)):
        return int(iteration.group(1))
    return int(steps[-1]) if steps else None


# ---- megatron-core and NeMo 2.x checkpoints (s3_mcore writes them on S3) -------------------------------------------
MEGATRON_ITERATION_PATTERN = re.compile(r"iter_(\d{7,})")
"""Megatron-LM's checkpoint directories, ``<save>/iter_0000100``: resumable, their step is the iteration."""
_MEGATRON_CONFIG_NAME = "metadata.json"  # megatron-core's marker, written after DCP's .metadata
_MEGATRON_COMMON_NAME = "common.pt"  # megatron-core <= 0.18's common state
_NEMO_WEIGHTS_FOLDER = "weights"  # NeMo 2.x keeps the distributed checkpoint in <checkpoint>/weights


def megatron_checkpoint_problem(names: Iterable[str], is_megatron: bool = False) -> str | None:
    """`distributed_checkpoint_problem`, plus megatron-core's marker: a megatron-core checkpoint (`is_megatron`, or one
    holding ``common.pt``) is complete only once ``metadata.json`` follows ``.metadata`` (megatron-core needs it)."""
    names = set(names)
    problem = distributed_checkpoint_problem(names)
    megatron = is_megatron or _MEGATRON_COMMON_NAME in names
    if problem is None and megatron and _MEGATRON_CONFIG_NAME not in names:
        if looks_like_distributed_checkpoint(names):
            return f"it is a megatron-core checkpoint without {_MEGATRON_CONFIG_NAME}: its save never finished"
        return "it holds no distributed checkpoint files"
    return problem


# DCP's file names as s3_dcp defines them, for a fork without s3_dcp.py (tests/test_packaging.py checks they agree).
_METADATA_NAME = ".metadata"
_DCP_SHARD_SUFFIX = ".distcp"
_ITEM_CHECKSUMS_NAME = ".s3ckpt-items.json"
_LIGHTNING_META_NAME = "meta.pt"
_LAYOUT_NAME = ".s3ckpt-layout.json"  # s3_prefix_spreading's record: a spread save's first object
_DCP_SHARD = re.compile(rf"__(\d+)_\d+{re.escape(_DCP_SHARD_SUFFIX)}")
_DCP_RANK_METADATA = re.compile(rf"__(\d+){re.escape(_METADATA_NAME)}")


def distributed_checkpoint_problem(names: Iterable[str]) -> str | None:
    """Why a directory whose top level holds `names` is an incomplete DCP checkpoint (no ``.metadata``, nor with
    ``use_collectives=False`` a ``__{rank}.metadata`` for each rank holding shards), or None.
    Package-internal (docs/api.md)."""
    names = set(names)
    if _METADATA_NAME in names or not looks_like_distributed_checkpoint(names):
        return None
    shard_ranks = {int(m.group(1)) for m in map(_DCP_SHARD.fullmatch, names) if m}
    committed = {int(m.group(1)) for m in map(_DCP_RANK_METADATA.fullmatch, names) if m}
    if committed and shard_ranks <= committed:
        return None
    return f"it is a distributed (DCP) checkpoint without {_METADATA_NAME}: its save never finished"


def looks_like_distributed_checkpoint(names: Iterable[str]) -> bool:
    """Whether top-level `names` are a DCP checkpoint's, complete or not (shards, .metadata, item record, meta.pt).
    Package-internal (docs/api.md)."""
    names = set(names)
    markers = {_METADATA_NAME, _ITEM_CHECKSUMS_NAME, _LIGHTNING_META_NAME, _LAYOUT_NAME}
    return not names.isdisjoint(markers) or any(
        _DCP_SHARD.fullmatch(n) or _DCP_RANK_METADATA.fullmatch(n) for n in names
    )


def _unfinished_marker_name(name: str) -> str:
    """NeMo's marker for a checkpoint: the name without ``.nemo``/``.ckpt``/``-EMA``, plus ``-unfinished``."""
    for suffix in (".nemo", ".ckpt", "-EMA"):
        name = name.removesuffix(suffix)
    return name + _UNFINISHED_SUFFIX


def _resume_kind(name: str, is_directory: bool, include_steps: bool) -> str | None:
    """`classify_checkpoint_name`, plus ``"step"`` for another ``*.ckpt`` with ``step=N`` when `include_steps`."""
    kind = classify_checkpoint_name(name, is_directory)
    if kind is None and include_steps and name.endswith(CHECKPOINT_SUFFIX) and checkpoint_step(name) is not None:
        return "step"
    return kind


def _candidates_from_entries(
    base: str, entries: Iterable[tuple[str, float]], include_steps: bool = False
) -> list[ResumeCandidate]:
    """Candidates from ``(path relative to the checkpoint directory, mtime)`` of every file below it; only names in
    it, or in a shard folder or checkpoint directory directly below it, count (deeper ones are other runs, backups)."""
    files: dict[str, dict[str, float]] = {}  # name -> shard folder -> mtime
    directories: dict[str, float] = {}  # distributed checkpoint directory -> newest mtime inside
    directory_files: dict[str, set[str]] = {}  # distributed checkpoint directory -> names at its top level
    weights_files: dict[str, set[str]] = {}  # NeMo 2.x checkpoint directory -> names in its weights/ folder
    top_level: set[str] = set()
    for relative, modified in entries:
        parts = relative.split("/")
        if len(parts) == 1:
            top_level.add(parts[0])
            if _resume_kind(parts[0], False, include_steps):
                files.setdefault(parts[0], {})[""] = modified
        elif len(parts) == 2 and _RANK_FOLDER.fullmatch(parts[0]):
            if parts[1] and _resume_kind(parts[1], False, include_steps):
                files.setdefault(parts[1], {})[parts[0]] = modified
        elif parts[0] and not _RANK_FOLDER.fullmatch(parts[0]) and _resume_kind(parts[0], True, include_steps):
            directories[parts[0]] = max(modified, directories.get(parts[0], modified))
            if len(parts) == 2 and parts[1]:
                directory_files.setdefault(parts[0], set()).add(parts[1])
            elif len(parts) == 3 and parts[1] == _NEMO_WEIGHTS_FOLDER and parts[2]:
                weights_files.setdefault(parts[0], set()).add(parts[2])
    separator = "" if base.endswith("/") else "/"

    def candidate(name: str, is_directory: bool, problem: str | None, **fields: Any) -> ResumeCandidate:
        marker = _unfinished_marker_name(name)
        if problem is None and marker in top_level:
            problem = f"its unfinished marker {marker} exists"
        kind = _resume_kind(name, is_directory, include_steps) or ""
        url, step = f"{base}{separator}{name}", checkpoint_step(name)
        return ResumeCandidate(name, url, kind, step, is_directory=is_directory, problem=problem, **fields)

    candidates = [
        candidate(name, False, _shard_problem(shards), modified=max(shards.values()), shards=tuple(sorted(shards)))
        for name, shards in files.items()
    ]
    for name, modified in directories.items():
        nested = name in weights_files  # NeMo 2.x: the checkpoint's files are in weights/
        names = weights_files[name] if nested else directory_files.get(name, set())
        problem = megatron_checkpoint_problem(names, nested or bool(MEGATRON_ITERATION_PATTERN.fullmatch(name)))
        is_dcp = looks_like_distributed_checkpoint(names)
        candidates.append(candidate(name, True, problem, modified=modified, is_dcp=is_dcp))
    return sorted(candidates, key=lambda candidate: candidate.url)


def _s3_entries(url: str, s3_utils: _s3.S3Utils) -> list[tuple[str, float]]:
    """Every object under the S3 "directory" `url` (one paginated listing, ``/``-bounded), but those a stale run
    committed after the directory's owner took it over (`s3_fencing.stale_objects`: a GET of the owner record)."""
    _, prefix = _urls.s3_dir_prefix(url)
    entries = []
    listed = s3_utils.list_objects(url)
    stale = _fencing.stale_objects(s3_utils, url, [obj for obj in listed if _decides(obj.key[len(prefix) :])])
    if stale:
        logger.warning(
            "Not resuming from %s: committed by a stale run after the owner of %s took it over (docs/fencing.md)",
            ", ".join(sorted(obj.url for obj in stale)[:5]), url,
        )
    folders = tuple(obj.key.removesuffix(".metadata") for obj in stale if obj.key.endswith("/.metadata"))
    dropped = {obj.key for obj in stale}
    for obj in (obj for obj in listed if obj.key not in dropped and not (folders and obj.key.startswith(folders))):
        modified = obj.last_modified.timestamp() if hasattr(obj.last_modified, "timestamp") else 0.0
        entries.append((obj.key[len(prefix) :], modified))
    return entries


def _decides(relative: str) -> bool:
    """Whether the object at `relative` (to the checkpoint directory) decides a resume candidate: a checkpoint file
    at the top or in a shard folder, or a DCP checkpoint's ``.metadata`` (which decides for its folder)."""
    parts = relative.split("/")
    if len(parts) == 1:
        return bool(_resume_kind(parts[0], False, True))
    if len(parts) == 2 and _RANK_FOLDER.fullmatch(parts[0]):
        return bool(_resume_kind(parts[1], False, True))
    return len(parts) == 2 and parts[1] == ".metadata"


def _local_entries(directory: str) -> list[tuple[str, float]]:
    """The files a checkpoint directory can hold candidates in: top level, shard folders, distributed checkpoints."""
    entries: list[tuple[str, float]] = []
    with os.scandir(directory) as top:
        for entry in top:
            if entry.is_file():
                entries.append((entry.name, entry.stat().st_mtime))
            elif entry.is_dir() and _RANK_FOLDER.fullmatch(entry.name):
                with os.scandir(entry.path) as shard:
                    entries.extend(
                        (f"{entry.name}/{item.name}", item.stat().st_mtime) for item in shard if item.is_file()
                    )
            elif entry.is_dir() and classify_checkpoint_name(entry.name, True):
                newest = entry.stat().st_mtime
                for root, _, names in os.walk(entry.path):
                    for name in names:
                        with contextlib.suppress(OSError):
                            newest = max(newest, os.stat(os.path.join(root, name)).st_mtime)
                        if root == entry.path:  # its top-level names tell whether a DCP checkpoint is complete
                            entries.append((f"{entry.name}/{name}", newest))
                        elif root == os.path.join(entry.path, _NEMO_WEIGHTS_FOLDER):  # or, for NeMo 2.x, these
                            entries.append((f"{entry.name}/{_NEMO_WEIGHTS_FOLDER}/{name}", newest))
                entries.append((f"{entry.name}/", newest))
    return entries


def list_resume_candidates(
    dirpath: str | os.PathLike[str], *, s3_utils: _s3.S3Utils | None = None, include_steps: bool = False
) -> list[ResumeCandidate]:
    """Every ``*last`` / ``*end`` checkpoint in `dirpath` (``s3://`` or local), usable or not, sorted by URL, and with
    `include_steps` the top-k ``step=N`` ones (kind ``"step"``), from one ``/``-bounded listing. A missing local
    directory has none; a missing bucket raises `CheckpointNotFoundError`."""
    if _urls.is_s3_url(dirpath):
        url = _urls.normalize_s3_url(dirpath).rstrip("/")
        bucket, _ = _urls.parse_s3_url(url)
        try:
            entries = _s3_entries(url, s3_utils or _s3.S3Utils()) + _ckpt_io.memory_tier_entries(url)  # tiers too
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"Cannot look for a checkpoint to resume from in {url}: the bucket {bucket!r} does not exist "
                "(or these credentials cannot see it). Create the bucket, or fix the checkpoint dirpath."
            ) from exc
        return _candidates_from_entries(url, entries, include_steps)
    directory = _urls.as_path_or_s3_url(dirpath)  # refuses s3:/..., S3://..., http://... rather than going local
    if not os.path.isdir(directory):
        return []
    return _candidates_from_entries(directory, _local_entries(directory), include_steps)


def _newest_first_key(all_have_steps: bool) -> Any:
    """By step when every candidate has one (mtime breaks ties), else by mtime; at one step ``end`` is newer than
    ``last`` (same state, and the run finished). Never by name: S3 lists ``step=9`` after ``step=10``."""

    def key(candidate: ResumeCandidate) -> tuple[Any, ...]:
        is_end = candidate.kind == "end"
        if all_have_steps:
            return (candidate.step, is_end, candidate.modified, candidate.url)
        return (candidate.modified, is_end, candidate.step if candidate.step is not None else -1, candidate.url)

    return key


def select_resume_candidate(
    candidates: Iterable[ResumeCandidate], *, resume_past_end: bool = False, dirpath: str = ""
) -> ResumeCandidate | None:
    """The candidate to resume from, or None if none is usable. Unusable ones (incomplete shard grids, NeMo's
    ``-unfinished`` marker) are skipped with a warning; the newest usable one wins, by ``step=N`` when every candidate
    has one (then mtime), else by mtime. If it is an ``*end`` one the run finished: `CheckpointAlreadyCompletedError`
    unless `resume_past_end` (NeMo raised when any ``*end.ckpt`` existed; a newer ``*last`` means the run went past
    its end). A DCP one on S3 without `s3_dcp` beside this module: `DCPSupportMissingError`, never a fallback."""
    candidates = [candidate for candidate in candidates if candidate.kind != "step"]  # fallbacks only
    for candidate in candidates:
        if candidate.problem:
            logger.warning("Not resuming from %s: %s", candidate.url, candidate.problem)
    usable = [candidate for candidate in candidates if not candidate.problem]
    if not usable:
        return None
    newest = max(usable, key=_newest_first_key(all(c.step is not None for c in usable)))
    if newest.kind == "end" and not resume_past_end:
        raise CheckpointAlreadyCompletedError(
            f"Found {newest.url}, indicating that the previous training run in {dirpath or 'this directory'} "
            "already completed. To train further from it set resume_past_end=True; to start a new run use another "
            "dirpath (or remove the *end checkpoint)."
        )
    if newest.is_dcp:
        _require_dcp_support(newest.url)
    if newest.shards != ("",) and any(len(c.shards) > len(newest.shards) for c in candidates):
        logger.warning(
            "Resuming from %s with %d model-parallel shards, but another checkpoint in %s has more; if the parallel "
            "layout did not change, a shard of %s may be missing",
            newest.url,
            len(newest.shards),
            dirpath or "the directory",
            newest.name,
        )
    if len(usable) > 1:
        logger.info("Chose %s as the newest of %d resumable checkpoints", newest.url, len(usable))
    return newest


def find_resume_checkpoint(
    dirpath: str | os.PathLike[str],
    resume_past_end: bool = False,
    resume_ignore_no_checkpoint: bool = False,
    *,
    s3_utils: _s3.S3Utils | None = None,
) -> str | None:
    """The ``s3://`` URL (or local path) to resume from in `dirpath`, or None: `find_resume_checkpoints`'s first."""
    found = find_resume_checkpoints(
        dirpath, resume_past_end, resume_ignore_no_checkpoint, s3_utils=s3_utils, fallbacks=False
    )
    return found[0] if found else None


def find_resume_checkpoints(
    dirpath: str | os.PathLike[str],
    resume_past_end: bool = False,
    resume_ignore_no_checkpoint: bool = False,
    *,
    s3_utils: _s3.S3Utils | None = None,
    fallbacks: bool = True,
) -> list[str]:
    """The ``s3://`` URLs (or local paths) to resume from in `dirpath`, newest first: `select_resume_candidate`'s,
    then with `fallbacks` the other usable ``*last`` / ``*end`` and top-k ``step=N`` ones, by the same rule. One
    listing; model-parallel checkpoints come without their shard folder (NeMo's strategy injects it). Raises
    `CheckpointNotFoundError` when nothing usable exists (empty instead if `resume_ignore_no_checkpoint`) or the
    bucket does not (always), `CheckpointAlreadyCompletedError` when the run finished and not `resume_past_end`."""
    if dirpath is None or not os.fspath(dirpath):
        raise ValueError("find_resume_checkpoint needs the checkpoint directory (an s3:// URL or a local path)")
    shown = _urls.normalize_s3_url(dirpath).rstrip("/") if _urls.is_s3_url(dirpath) else os.fspath(dirpath)
    started = time.perf_counter()
    candidates = list_resume_candidates(dirpath, s3_utils=s3_utils, include_steps=fallbacks)
    chosen = select_resume_candidate(candidates, resume_past_end=resume_past_end, dirpath=shown)
    logger.debug("Resume discovery in %s took %.3f s", shown, time.perf_counter() - started)
    if chosen is not None:
        return [chosen.url, *_fallback_urls(candidates, chosen)]
    skipped = sum(candidate.kind != "step" for candidate in candidates)
    detail = f" ({skipped} incomplete or unfinished checkpoint(s) skipped)" if skipped else ""
    message = f"There were no checkpoints (*last.ckpt or *end.ckpt) to resume from in {shown}{detail}."
    if resume_ignore_no_checkpoint:
        logger.warning("%s Training from scratch (resume_ignore_no_checkpoint=True).", message)
        return []
    raise CheckpointNotFoundError(
        f"{message} Cannot resume. Set resume_ignore_no_checkpoint=True to start from scratch when there is none, "
        "or check the dirpath."
    )


def _fallback_urls(candidates: list[ResumeCandidate], chosen: ResumeCandidate) -> list[str]:
    """The usable candidates other than `chosen`, newest first; DCP ones on S3 only where s3_dcp can load them."""
    loadable = [c for c in candidates if not (c.is_dcp and _s3_dcp() is None and _urls.is_s3_url(c.url))]
    usable = [c for c in loadable if c is not chosen and not c.problem]
    key = _newest_first_key(all(c.step is not None for c in [*usable, chosen]))
    return [candidate.url for candidate in sorted(usable, key=key, reverse=True)]


# The resume fallback (`load_newest_usable`) lives in s3_checkpoint_io, beside the loads it retries; NeMo-style
# callers import it from here.
is_unusable_checkpoint_error = _ckpt_io.is_unusable_checkpoint_error
load_newest_usable = _ckpt_io.load_newest_usable
ResumeFailedError = _ckpt_io.ResumeFailedError

# --------------------------------------------------------------------------------------------------------------------
# check_resume (NeMo's exp_manager.check_resume)
# --------------------------------------------------------------------------------------------------------------------


def _s3_utils_of_trainer(trainer: Any) -> _s3.S3Utils | None:
    """The `S3Utils` of the trainer's `S3CheckpointIO`: discovery uses the saves' endpoint, credentials, retries.
    None if there is none, or if what the plugin holds is not an `S3Utils` (a test double as the plugin)."""
    s3 = getattr(_ckpt_io.s3_checkpoint_io_of(getattr(trainer, "strategy", None)), "s3", None)
    return s3 if isinstance(s3, _s3.S3Utils) else None


@dataclass(frozen=True)
class _Discovery:
    """What `check_resume` looked for with ``resume_if_exists`` (and, on rank 0, what it chose), so that the choice
    can be made again once the process group exists (`BroadcastResumeConnectorMixin.resume_start`)."""

    directory: str
    resume_past_end: bool
    resume_ignore_no_checkpoint: bool
    s3_utils: _s3.S3Utils | None
    resume_fallback: bool
    resume_from_checkpoint: str | None = None  # what resuming falls back to when the search finds nothing
    chosen: str | None = None  # rank 0's choice

    def find(self, trainer: Any) -> list[str]:
        return find_resume_checkpoints(
            self.directory, self.resume_past_end, self.resume_ignore_no_checkpoint,
            s3_utils=self.s3_utils or _s3_utils_of_trainer(trainer), fallbacks=self.resume_fallback,
        )  # fmt: skip


def check_resume(
    trainer: Any,
    log_dir: str | os.PathLike[str] | None = None,
    resume_if_exists: bool = False,
    resume_past_end: bool = False,
    resume_ignore_no_checkpoint: bool = False,
    dirpath: str | os.PathLike[str] | None = None,
    resume_from_checkpoint: str | os.PathLike[str] | None = None,
    *,
    s3_utils: _s3.S3Utils | None = None,
    resume_fallback: bool = True,
) -> str | None:
    """NeMo's ``exp_manager.check_resume``: find the checkpoint to resume from, set ``trainer.ckpt_path`` and return
    it (None if none). `resume_from_checkpoint` is used unless `resume_if_exists` finds one in `dirpath` (else
    ``<log_dir>/checkpoints``); on S3 **only global rank 0 lists** (rank from the environment) and the others get its
    choice by broadcast; a local directory is searched on every rank, as in NeMo. Errors as `find_resume_checkpoint`.
    `resume_fallback` (default True): a checkpoint that does not verify or load is skipped on every rank for the next
    newest (`load_newest_usable`); False: strict. Also installs `NeMoCheckpointConnector`, which with a memory tier
    and several ranks makes rank 0's choice again once the process group exists, among what every rank can load."""
    if resume_if_exists and not dirpath and not log_dir:
        raise ValueError(
            "Resuming requires the checkpoint dirpath or the log_dir (checkpoints are in log_dir/checkpoints)"
        )
    if getattr(trainer, "_checkpoint_connector", None) is not None:
        install_checkpoint_connector(trainer)
    checkpoint = _urls.as_path_or_s3_url(resume_from_checkpoint) if resume_from_checkpoint else None
    if resume_if_exists:
        directory = (
            _urls.as_path_or_s3_url(dirpath) if dirpath else os.path.join(os.fspath(log_dir or ""), "checkpoints")
        )
        rank = global_rank()
        discovery = _Discovery(
            directory, resume_past_end, resume_ignore_no_checkpoint, s3_utils, resume_fallback, checkpoint
        )
        if _urls.is_s3_url(directory) and rank != 0:
            logger.debug(
                "Rank %d: not listing %s; global rank 0 finds the checkpoint and broadcasts it", rank, directory
            )
        else:
            found = discovery.find(trainer)
            if found:
                checkpoint = found[0]
                _set_resume_fallbacks(trainer, found[0], found[1:], resume_fallback)
            elif checkpoint is not None:
                logger.warning("Training from resume_from_checkpoint=%s instead", checkpoint)
        if _urls.is_s3_url(directory):  # with a memory tier, made again once every rank can take part
            connector = getattr(trainer, "_checkpoint_connector", None)
            if isinstance(connector, BroadcastResumeConnectorMixin):
                connector.tier_rediscovery = dataclasses.replace(discovery, chosen=checkpoint)
    if checkpoint is not None:
        trainer.ckpt_path = checkpoint
        logger.info("Resuming training from checkpoint: %s", checkpoint)
    return checkpoint


# --------------------------------------------------------------------------------------------------------------------
# Lightning glue: the behaviour (plain mixins) ...
# --------------------------------------------------------------------------------------------------------------------


def _set_resume_fallbacks(trainer: Any, chosen: str, fallbacks: list[str], enabled: bool = True) -> None:
    """Tell the trainer's `BroadcastResumeConnectorMixin` (if any) what `chosen` falls back to (rank 0 knows)."""
    connector = getattr(trainer, "_checkpoint_connector", None)
    if isinstance(connector, BroadcastResumeConnectorMixin):
        connector.resume_fallback = enabled
        connector.resume_fallbacks = {chosen: list(fallbacks)} if enabled else {}


def _broadcast_from_rank_zero(trainer: Any, value: Any) -> Any:
    """Rank 0's `value` on every rank (a no-op in a single process or before the process group exists)."""
    if getattr(trainer, "world_size", 1) <= 1:
        return value
    return trainer.strategy.broadcast(value, src=0)


def _on_rank_zero_then_broadcast(trainer: Any, compute: Any, what: str) -> Any:
    """`compute()` run on global rank 0, on every rank; if it raises, every rank raises (not waiting for a timeout)."""
    result, error = None, None
    if trainer.is_global_zero:
        try:
            result = compute()
        except Exception as exc:
            error = exc
    result, message = _broadcast_from_rank_zero(trainer, (result, None if error is None else repr(error)))
    if error is not None:
        raise error
    if message is not None:
        raise RuntimeError(f"Global rank 0 failed while {what}: {message}")
    return result


def _is_s3_path(value: Any) -> bool:
    """Whether `value` is a path (str or PathLike) holding an ``s3://`` URL (`is_s3_url` refuses other types)."""
    return isinstance(value, (str, os.PathLike)) and _urls.is_s3_url(value)


def _has_s3_checkpoint_dir(trainer: Any) -> bool:
    return any(_is_s3_path(getattr(c, "dirpath", None)) for c in getattr(trainer, "checkpoint_callbacks", []) or [])


class BroadcastResumeConnectorMixin:
    """What `NeMoCheckpointConnector` adds to Lightning's ``_CheckpointConnector`` (mixed in front of it).
    ``resume_start``: every rank loads rank 0's choice (broadcast), whatever Lightning passed in there, collectively
    (`s3_checkpoint_io.collective_resume`), falling back past one that does not load (`load_newest_usable`) unless
    `resume_fallback` is off; with a memory tier, first agreeing over the tiers (`check_resume`'s choice made again,
    see `tier_rediscovery`). ``ckpt_path="last"`` on S3 is resolved on global rank 0 only, from one listing per
    `S3ModelCheckpoint` (Lightning's own resolution, still on rank 0, if some candidate lives elsewhere)."""

    trainer: Any
    resume_fallback: bool = True
    """Fall back past a checkpoint discovery chose (never a ``ckpt_path`` given) that does not verify or load."""
    resume_fallbacks: dict[str, list[str]] = {}  # noqa: RUF012 (replaced, never mutated)
    """On the rank that ran discovery: the chosen checkpoint -> the ones to fall back to, newest first."""

    tier_rediscovery: _Discovery | None = None
    """Set by `check_resume` (``resume_if_exists`` on S3); taken by the next ``resume_start``, where with a memory
    tier and several ranks every rank agrees over the tiers, then rank 0 makes its choice again from what all can
    load (before the process group, it saw S3 and its own node's memory only)."""

    def resume_start(self, checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        discovery, self.tier_rediscovery = self.tier_rediscovery, None
        tiered = _tiered_checkpoint_io(trainer) if getattr(trainer, "world_size", 1) > 1 else None
        agreed = None  # the s3:// directory the ranks agree on here
        if discovery is not None and tiered is not None:  # every rank: one collective, then rank 0 chooses again
            agreed = _normalize_dirpath(discovery.directory)
            tiered.agree_resume(agreed, checkpoint_step, list_s3=global_rank() == 0)
            chosen, fallbacks = _on_rank_zero_then_broadcast(
                trainer, lambda: self._choose_again(discovery, checkpoint_path), "choosing the checkpoint again"
            )
        else:
            fallbacks = self._fallbacks_of(checkpoint_path)
            chosen, fallbacks = _broadcast_from_rank_zero(trainer, (checkpoint_path, fallbacks))
        rank = getattr(trainer, "global_rank", 0)
        if chosen != checkpoint_path:
            logger.info("Rank %d: resuming from %s as chosen on rank 0 (was given %r)", rank, chosen, checkpoint_path)
        elif chosen:
            logger.info("Rank %d: resuming from checkpoint %s", rank, chosen)
        if _is_s3_path(chosen) and not (agreed and str(chosen).startswith(f"{agreed}/")):  # every rank, the group
            _agree_on_tier_resume(trainer)  # up: the tiers every rank can read `chosen` from
        started = time.perf_counter()

        def load(url: Any) -> None:
            with _ckpt_io.collective_resume(trainer):  # every rank loads `url` now: one download per node or job
                super(BroadcastResumeConnectorMixin, self).resume_start(url, *args, **kwargs)  # type: ignore[misc]

        if chosen and fallbacks:
            chosen, _ = load_newest_usable([chosen, *fallbacks], load)
        else:
            load(chosen)
        if chosen:
            logger.info("Rank %d: loaded %s in %.2f s", rank, chosen, time.perf_counter() - started)

    def _fallbacks_of(self, checkpoint_path: Any) -> list[str]:
        return self.resume_fallbacks.get(checkpoint_path, []) if self.resume_fallback and checkpoint_path else []

    def _choose_again(self, discovery: _Discovery, checkpoint_path: Any) -> tuple[Any, list[str]]:
        """On rank 0, after the ranks agreed over the tiers: `check_resume`'s search again, which now sees in the
        memory tiers only what every rank can load (and S3); a ``ckpt_path`` given to ``fit`` instead stays."""
        if checkpoint_path != discovery.chosen:
            return checkpoint_path, self._fallbacks_of(checkpoint_path)
        try:
            found = discovery.find(self.trainer)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(f"{exc} ({checkpoint_path} is not loadable on every rank.)") from exc
        chosen = found[0] if found else discovery.resume_from_checkpoint
        if chosen != checkpoint_path:
            logger.warning(
                "Resuming from %s, the newest checkpoint every rank can load from some tier, not %s (found in "
                "rank 0's memory tier before the process group existed)", chosen, checkpoint_path,
            )  # fmt: skip
        if found:
            _set_resume_fallbacks(self.trainer, found[0], found[1:], discovery.resume_fallback)
        return chosen, self._fallbacks_of(chosen)

    def _parse_ckpt_path(self, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        if ckpt_path == "last" and _has_s3_checkpoint_dir(self.trainer):
            _agree_on_tier_resume(self.trainer)  # every rank: one collective over the memory tiers, if any
            rank = global_rank()
            if rank != 0:
                logger.debug("Rank %d: ckpt_path='last' is resolved on rank 0 and broadcast", rank)
                return None
            sources = _last_checkpoint_sources(self.trainer)
            if sources is not None:
                newest_first = _last_checkpoints_newest_first(self.trainer, sources, state_fn)
                if newest_first:
                    self.resume_fallbacks = {newest_first[0]: newest_first[1:]}
                return newest_first[0] if newest_first else None
        return super()._parse_ckpt_path(  # type: ignore[misc]
            state_fn, ckpt_path, model_provided=model_provided, model_connected=model_connected
        )


def _tiered_checkpoint_io(trainer: Any) -> Any:
    """The trainer's checkpoint plugin if it has a memory tier (an `S3CheckpointIO`), else None."""
    io = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
    return io if getattr(io, "memory_tier", None) is not None else None


def _agree_on_tier_resume(trainer: Any) -> None:
    """With a memory tier, every rank agrees on what every rank can load from some tier (`S3CheckpointIO.agree_resume`:
    memory, a peer's replica, S3), so that rank 0's choice of "last" sees memory-only checkpoints every rank has."""
    io = _tiered_checkpoint_io(trainer)
    if io is not None:
        for callback in getattr(trainer, "checkpoint_callbacks", []) or []:
            if _is_s3_path(getattr(callback, "dirpath", None)):
                io.agree_resume(callback.dirpath, checkpoint_step, list_s3=global_rank() == 0)


def _last_checkpoint_sources(trainer: Any) -> list[S3ModelCheckpointMixin] | None:
    """The S3 callbacks holding every candidate for ``ckpt_path="last"``, or None if some candidate lives elsewhere."""
    sources = []
    for callback in trainer.callbacks:
        if isinstance(callback, S3ModelCheckpointMixin) and callback._is_s3_dir():
            sources.append(callback)
        elif callback in trainer.checkpoint_callbacks or type(callback).__name__ == "OnExceptionCheckpoint":
            return None
    return sources


def _last_checkpoints_newest_first(trainer: Any, sources: list[S3ModelCheckpointMixin], state_fn: Any) -> list[str]:
    """The last checkpoints, newest first by Lightning's rule for ``"last"``, from one listing per callback."""
    times: dict[str, float] = {}
    for callback in sources:
        times.update(callback.last_checkpoint_times(trainer))
    if not times:
        fn = getattr(state_fn, "value", state_fn)
        warnings.warn(
            f'.{fn}(ckpt_path="last") is set, but there is no last checkpoint available in '
            f"{', '.join(str(c.dirpath) for c in sources)}. No checkpoint will be loaded. "
            "HINT: Set `ModelCheckpoint(..., save_last=True)`.",
            UserWarning,
            stacklevel=2,
        )
        return []
    return sorted(times, key=_newest_url_key(times), reverse=True)


def _newest_url_key(times: dict[str, float]) -> Any:
    """Lightning's "last": the newest modification time (then the higher step, then the URL)."""
    return lambda url: (times[url], checkpoint_step(url.rpartition("/")[2]) or -1, url)


def _normalize_dirpath(dirpath: Any) -> Any:
    """An S3 dirpath as ``s3://bucket/prefix`` (str, no trailing ``/``, pathlib's ``s3:/`` repaired); others as is."""
    if not _is_s3_path(dirpath):
        return dirpath
    bucket, key = _urls.parse_s3_url(_urls.normalize_s3_url(dirpath))
    return _urls.build_s3_url(bucket, key.rstrip("/"))


def _template_regex(template: str) -> str:
    """A regex for names made from a Lightning filename template (``"{step}-last"`` matches ``step=12-last``)."""
    pieces = re.split(r"(\{[^}]*\})", template)
    return "".join(".+?" if piece.startswith("{") and piece.endswith("}") else re.escape(piece) for piece in pieces)


class S3ModelCheckpointMixin:
    """What `S3ModelCheckpoint` adds to a ``ModelCheckpoint`` class (mixed in front of it, e.g. NeMo's own):
    ``setup()`` installs `NeMoCheckpointConnector` and broadcasts rank 0's resume state; ``file_exists`` asks S3 on
    rank 0 (a stale s3fs cache made a second run overwrite the first one's checkpoints instead of writing ``-v1``),
    after this process's pending saves and the plugin's memory tier;
    ``"last"`` comes from one listing as ``s3://`` URLs (#18261); top-k keeps its ``s3://`` entries across a resume;
    the checkpoint resumed from and any outside the dirpath are never removed (`kept_from_removal`). S3 is asked
    through the plugin's `S3Utils`, and each save and removal drops the s3fs cache entries of its URL."""

    dirpath: Any
    last_model_path: str
    best_k_models: dict[str, Any]
    mode: str
    CHECKPOINT_NAME_LAST: str | None
    FILE_EXTENSION: str

    def __init__(self, *args: Any, s3_utils: _s3.S3Utils | None = None, **kwargs: Any) -> None:
        if "dirpath" in kwargs:
            kwargs["dirpath"] = _normalize_dirpath(kwargs["dirpath"])
        elif args and isinstance(args[0], (str, os.PathLike)):
            args = (_normalize_dirpath(args[0]), *args[1:])
        super().__init__(*args, **kwargs)
        self.s3_utils = s3_utils
        self.dirpath = _normalize_dirpath(self.dirpath)

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (``ddp_spawn`` pickles the trainer's callbacks): the S3 client is rebuilt after unpickling."""
        state = dict(super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__)
        state["s3_utils"] = None
        return state

    # ---- S3 access ------------------------------------------------------------------------------------------------

    def _s3_utils(self, trainer: Any = None) -> _s3.S3Utils:
        """The S3Utils to use: the one given, else the trainer's S3CheckpointIO's, else one from default settings."""
        if self.s3_utils is None:
            self.s3_utils = (_s3_utils_of_trainer(trainer) if trainer is not None else None) or _s3.S3Utils()
        return self.s3_utils

    def _is_s3_dir(self) -> bool:
        return _is_s3_path(self.dirpath)

    # ---- Lightning hooks ------------------------------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        install_checkpoint_connector(trainer)
        if self._is_s3_dir():
            self._s3_utils(trainer)  # bind the plugin's client before Lightning's setup asks S3 anything
        super().setup(trainer, pl_module, stage)  # type: ignore[misc]
        self.dirpath = _normalize_dirpath(self.dirpath)
        if self._is_s3_dir():
            self._s3_utils(trainer)
        connector = trainer._checkpoint_connector
        state = (getattr(connector, "_ckpt_path", None), getattr(connector, "_user_managed", False))
        run = getattr(_ckpt_io.s3_checkpoint_io_of(getattr(trainer, "strategy", None)), "run", None)
        if not isinstance(run, _fencing.CheckpointRun):  # no plugin, or a test double as the plugin: this process's run
            run = _fencing.current_run()
        shared = (state, self.last_model_path, run)
        (ckpt_path, user_managed), last_model_path, run = _broadcast_from_rank_zero(trainer, shared)
        connector._ckpt_path = ckpt_path
        connector._user_managed = user_managed
        self.last_model_path = last_model_path
        _fencing.adopt_run(run)  # the ranks of one job are one run (docs/runs.md), whatever their launcher said

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Lightning's ``AsyncCheckpointIO`` tears down only its own thread: an `S3CheckpointIO` it wraps is torn
        down here (its uploads waited for, its worker stopped, a failure raised), after the strategy's teardown."""
        super().teardown(trainer, pl_module, stage)  # type: ignore[misc]
        strategy = getattr(trainer, "strategy", None)
        plugin = _ckpt_io.s3_checkpoint_io_of(strategy)
        if plugin is not None and getattr(strategy, "_checkpoint_io", None) is not plugin:
            plugin.teardown()

    @property
    def state_key(self) -> str:
        """``ModelCheckpoint``'s key: Lightning files callback state under a key holding the class name, so the
        state (best and top-k models, last path) of a checkpoint written with either class resumes with the other."""
        key = str(super().state_key)  # type: ignore[misc]
        base = type(self).__dict__.get("lightning_base")  # a class built here; a user's subclass keeps its own name
        return base.__qualname__ + key.removeprefix(type(self).__qualname__) if base is not None else key

    @property
    def _legacy_state_key(self) -> Any:
        """Lightning's fallback key on load: the ``S3ModelCheckpoint{...}`` key this package wrote before, so those
        checkpoints keep their callback state too."""
        base = type(self).__dict__.get("lightning_base")
        if base is None:
            return super()._legacy_state_key  # type: ignore[misc]
        return type(self).__qualname__ + self.state_key.removeprefix(base.__qualname__)

    def file_exists(self, filepath: Any, trainer: Any, *args: Any, **kwargs: Any) -> bool:
        if not _is_s3_path(filepath):
            return super().file_exists(filepath, trainer, *args, **kwargs)  # type: ignore[misc]
        url = _urls.normalize_s3_url(filepath)

        def head() -> bool:
            queued = _ckpt_io.pending_operation(url)  # an async save in flight, or a removal deferred behind one
            if queued is not None:
                return queued == "save"
            plugin = _ckpt_io.s3_checkpoint_io_of(getattr(trainer, "strategy", None))
            if plugin is not None and plugin.holds_in_memory(url):  # committed in the node's memory tier
                return True
            _s3.invalidate_fsspec_cache(url)
            return self._s3_utils(trainer).s3_path_exists(url)

        return bool(_on_rank_zero_then_broadcast(trainer, head, f"checking whether {url} exists"))

    def _last_name_pattern(self) -> re.Pattern[str]:
        last = self.CHECKPOINT_NAME_LAST or "last"
        return re.compile(rf"{_template_regex(last)}(?:-v\d+)?{re.escape(self.FILE_EXTENSION)}")

    def last_checkpoint_times(self, trainer: Any = None) -> dict[str, float]:
        """``{s3:// URL: modification time}`` of this callback's last checkpoints (``last.ckpt``, ``last-v1.ckpt``, or
        NeMo's ``{filename}-last.ckpt``) directly in its S3 dirpath, from one ``/``-bounded listing; no s3fs."""
        url = self.dirpath
        pattern = self._last_name_pattern()
        try:
            entries = _s3_entries(url, self._s3_utils(trainer)) + _ckpt_io.memory_tier_entries(url)  # tiers too
        except FileNotFoundError:
            return {}
        times = {f"{url}/{name}": modified for name, modified in entries if "/" not in name and pattern.fullmatch(name)}
        directories: dict[str, tuple[float, set[str]]] = {}  # sharded (DCP) last checkpoints: last.ckpt/...
        for name, modified in entries:
            folder, _, inner = name.partition("/")
            if inner and pattern.fullmatch(folder):
                newest, names = directories.setdefault(folder, (modified, set()))
                directories[folder] = (max(newest, modified), names)
                if "/" not in inner:
                    names.add(inner)
        sharded = set()
        for folder, (modified, names) in directories.items():
            problem = distributed_checkpoint_problem(names)
            if problem is None and looks_like_distributed_checkpoint(names):
                times[f"{url}/{folder}"] = modified
                sharded.add(f"{url}/{folder}")
            else:
                logger.warning("Not resuming from %s/%s: %s", url, folder, problem or "it holds no DCP checkpoint")
        if times and (newest := max(times, key=_newest_url_key(times))) in sharded:
            _require_dcp_support(newest)
        return times

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        """Lightning's hook for ``ckpt_path="last"`` without `NeMoCheckpointConnector`: ``s3://`` URLs (#18261)."""
        if not self._is_s3_dir():
            return super()._find_last_checkpoints(trainer)  # type: ignore[misc]
        _s3.invalidate_fsspec_cache(self.dirpath)  # Lightning asks fsspec about each candidate next
        return set(self.last_checkpoint_times(trainer))

    # Overrides ModelCheckpoint's private (name-mangled) __warn_if_dir_not_empty; if Lightning renames it, its own runs.
    def _ModelCheckpoint__warn_if_dir_not_empty(self, dirpath: Any) -> None:
        """Lightning's "directory not empty" warning; an S3 dirpath is asked through this package's client."""
        if not _is_s3_path(dirpath):
            return super()._ModelCheckpoint__warn_if_dir_not_empty(dirpath)  # type: ignore[misc]
        if getattr(self, "save_top_k", 1) != 0 and self._s3_utils().s3_path_exists(dirpath, match_directory=True):
            warnings.warn(f"Checkpoint directory {dirpath} exists and is not empty.", UserWarning, stacklevel=2)
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "dirpath" in state_dict:
            state_dict = {**state_dict, "dirpath": _normalize_dirpath(state_dict["dirpath"])}
        super().load_state_dict(state_dict)  # type: ignore[misc]

    def _remove_invalid_entries_from_topk(self) -> None:
        """NeMo's hook (called from its ``load_state_dict``): NeMo's check applies to local entries only."""
        parent = getattr(super(), "_remove_invalid_entries_from_topk", None)
        if parent is None:
            return
        kept = {path: score for path, score in self.best_k_models.items() if _urls.is_s3_url(path)}
        order = list(self.best_k_models)
        self.best_k_models = {path: score for path, score in self.best_k_models.items() if path not in kept}
        parent()
        merged = {**self.best_k_models, **kept}
        self.best_k_models = {path: merged[path] for path in order if path in merged}
        if self.best_k_models:
            ranked = sorted(self.best_k_models, key=self.best_k_models.get, reverse=self.mode != "min")
            self.kth_best_model_path = ranked[-1]
            self.kth_value = self.best_k_models[ranked[-1]]
            self.best_model_path = ranked[0]
            self.best_model_score = self.best_k_models[ranked[0]]

    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)  # type: ignore[misc]
        if _urls.is_s3_url(filepath):
            _s3.invalidate_fsspec_cache(_urls.normalize_s3_url(filepath))

    # ---- what a run never removes on S3 ---------------------------------------------------------------------------

    def kept_from_removal(self, trainer: Any, filepath: Any) -> str | None:
        """Why this callback must not remove the ``s3://`` checkpoint `filepath` (None: it may): the run resumed from
        it, or it lies outside the S3 dirpath (Lightning's ``_should_remove_checkpoint`` checks local paths only)."""
        if not _is_s3_path(filepath):
            return None
        url = _urls.normalize_s3_url(filepath).rstrip("/")
        resumed = getattr(trainer, "ckpt_path", None) if trainer is not None else None
        if _is_s3_path(resumed) and _urls.normalize_s3_url(resumed).rstrip("/") == url:
            return "it is the checkpoint this run resumed from"
        if not self._is_s3_dir() or not url.startswith(str(self.dirpath).rstrip("/") + "/"):
            return f"it is outside this callback's dirpath {self.dirpath}"
        return None

    def _should_remove_checkpoint(self, trainer: Any, previous: str, current: str, *args: Any, **kwargs: Any) -> bool:
        """Lightning's rule (keep the resumed-from checkpoint and any outside dirpath) for ``s3://`` paths too."""
        if _urls.is_s3_url(previous) and self.kept_from_removal(trainer, previous) is not None:
            return False
        return bool(super()._should_remove_checkpoint(trainer, previous, current, *args, **kwargs))  # type: ignore[misc]

    def _remove_checkpoint(self, trainer: Any, filepath: str, *args: Any, **kwargs: Any) -> None:
        # Also guards removals that do not ask _should_remove_checkpoint first (NeMo-style subclasses' clean-ups).
        reason = self.kept_from_removal(trainer, filepath)
        if reason is not None:
            logger.info("Keeping %s (not removing it): %s", filepath, reason)
            return
        super()._remove_checkpoint(trainer, filepath, *args, **kwargs)  # type: ignore[misc]
        if _urls.is_s3_url(filepath):
            _s3.invalidate_fsspec_cache(_urls.normalize_s3_url(filepath))


# --------------------------------------------------------------------------------------------------------------------
# ... and the Lightning classes, built per family on first use
# --------------------------------------------------------------------------------------------------------------------

_FAMILIES = _ckpt_io.LIGHTNING_FAMILIES
_CLASS_SUFFIX = {"lightning.pytorch": "", "pytorch_lightning": "PL"}
_CONNECTOR_NAME = "NeMoCheckpointConnector"
_CALLBACK_NAME = "S3ModelCheckpoint"


def _family_of(family: str | None) -> str:
    return _ckpt_io.lightning_family(family, "the Lightning connector and ModelCheckpoint")


def _lightning_module(family: str, submodule: str) -> Any:
    return _process.import_optional_dependency(f"{family}.{submodule}", f"{family} support")


def checkpoint_connector_class(family: str | None = None) -> type:
    """`NeMoCheckpointConnector` for a Lightning family (default: ``lightning.pytorch`` if installed), built once."""
    family = _family_of(family)
    base = _lightning_module(family, "trainer.connectors.checkpoint_connector")._CheckpointConnector
    return _lightning_subclass(_CONNECTOR_NAME, family, BroadcastResumeConnectorMixin, base, "with rank-0 resume")


def s3_model_checkpoint_class(family: str | None = None) -> type:
    """`S3ModelCheckpoint` for a Lightning family (see `checkpoint_connector_class`). Built once and cached."""
    family = _family_of(family)
    base = _lightning_module(family, "callbacks").ModelCheckpoint
    return _lightning_subclass(_CALLBACK_NAME, family, S3ModelCheckpointMixin, base, "S3-aware")


@functools.cache
def _lightning_subclass(base_name: str, family: str, mixin: type, base: type, what: str) -> type:
    """``class <base_name>[PL](mixin, base)``, built once per family; `lightning_base` names the Lightning class."""
    name = base_name + _CLASS_SUFFIX[family]
    doc = f"Lightning's ``{base.__name__}`` ({family}), {what}. {mixin.__doc__}"
    namespace = {"__module__": __name__, "__qualname__": name, "__doc__": doc, "lightning_base": base}
    if mixin is S3ModelCheckpointMixin:
        namespace["__init__"] = _callback_init(base)
    return type(name, (mixin, base), namespace)


def _callback_init(base: type) -> Any:
    """`S3ModelCheckpointMixin.__init__` with the signature of `base`'s plus ``s3_utils``, so that
    ``inspect.signature``, LightningCLI and jsonargparse see (and configure) every ``ModelCheckpoint`` argument."""

    def init(self: Any, *args: Any, s3_utils: _s3.S3Utils | None = None, **kwargs: Any) -> None:
        S3ModelCheckpointMixin.__init__(self, *args, s3_utils=s3_utils, **kwargs)

    signature = inspect.signature(base.__init__)
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    parameters = [p for p in signature.parameters.values() if p.kind not in kinds]
    own = inspect.Parameter("s3_utils", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=_s3.S3Utils | None)
    init.__signature__ = signature.replace(parameters=[*parameters, own])  # type: ignore[attr-defined]
    init.__name__, init.__doc__ = "__init__", base.__init__.__doc__
    return init


NeMoCheckpointConnector: type
"""`checkpoint_connector_class()` for the default family; built on first access by ``__getattr__``."""
S3ModelCheckpoint: type
"""`s3_model_checkpoint_class()` for the default family; built on first access by ``__getattr__``."""


def __getattr__(name: str) -> Any:
    """PEP 562: the Lightning classes are built on first access (Lightning need not be installed to import this)."""
    for base_name, make in ((_CONNECTOR_NAME, checkpoint_connector_class), (_CALLBACK_NAME, s3_model_checkpoint_class)):
        if name == base_name:
            return make(None)
        for family, suffix in _CLASS_SUFFIX.items():
            if suffix and name == base_name + suffix:
                return make(family)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _trainer_family(trainer: Any) -> str:
    for cls in type(trainer).__mro__:
        module = cls.__module__ or ""
        for family in _FAMILIES:
            if module == family or module.startswith(family + "."):
                return family
    raise TypeError(f"expected a lightning.pytorch or pytorch_lightning Trainer, got {type(trainer).__name__}")


def install_checkpoint_connector(trainer: Any) -> Any:
    """Put `NeMoCheckpointConnector` in place of Lightning's plain connector (keeping its state) and return it; safe
    to repeat before ``fit``. Another subclass (a custom one, NeMo's own) is left in place, with a warning."""
    current = trainer._checkpoint_connector
    if isinstance(current, BroadcastResumeConnectorMixin):
        return current
    cls = checkpoint_connector_class(_trainer_family(trainer))
    if type(current) is not cls.lightning_base:
        logger.warning(
            "Trainer has a custom checkpoint connector %s; not replacing it with %s. Non-zero ranks then depend on "
            "it honouring trainer.ckpt_path (S3ModelCheckpoint.setup broadcasts it).",
            type(current).__qualname__,
            cls.__qualname__,
        )
        return current
    connector = cls(trainer)
    connector.__dict__.update(vars(current))
    trainer._checkpoint_connector = connector
    logger.debug("Installed %s on the trainer", cls.__qualname__)
    return connector


# --------------------------------------------------------------------------------------------------------------------
# One-call wiring from a NeMo-style config
# --------------------------------------------------------------------------------------------------------------------

# `s3_checkpointing:` keys (NeMo's megatron_gpt_config.yaml) -> S3CheckpointIO arguments; the first four are NeMo's.
_S3_CONFIG_TO_IO_KWARGS = {
    "max_write_concurrency": "max_write_concurrency",
    "max_read_concurrency": "max_read_concurrency",
    "chunk_size_MB": "chunk_size_MB",
    "enable_async_checkpointing": "async_checkpointing",
    "max_saves_in_flight": "max_saves_in_flight",
    "endpoint_url": "endpoint_url",
    "region_name": "region_name",
    "request_options": "request_options",  # a mapping of s3_utils.S3RequestOptions fields (S3's parameter names)
    "load_sharing": "load_sharing",
    "fencing": "fencing",  # false: no owner record, a stale run is not refused (docs/fencing.md)
    "max_requests_per_second": "max_requests_per_second",  # a number or {write: .., read: ..}: the job's, per prefix
    "memory_tier": "memory_tier",  # a tmpfs path or a mapping of s3_memory_tier.MemoryTier fields (docs/tiers.md)
}
# NeMoModelCheckpoint-only keys of checkpoint_callback_params: accepted, logged, not used.
_NEMO_ONLY_CALLBACK_KEYS = frozenset(
    "always_save_nemo save_nemo_on_train_end save_best_model postfix prefix n_resume model_parallel_size async_save "
    "filepath save_last_n_optim_states".split()
)
# NeMo's exp_manager resume settings (and resume_fallback), passed to check_resume.
_RESUME_KEYS = "resume_if_exists resume_past_end resume_ignore_no_checkpoint resume_from_checkpoint resume_fallback"


def _as_dict(node: Any, what: str) -> dict[str, Any]:
    """A plain dict from a Mapping or an OmegaConf node (resolved), so callers may pass either."""
    if node is None:
        return {}
    if type(node).__module__.startswith("omegaconf"):
        omegaconf = _process.import_optional_dependency("omegaconf", "OmegaConf configs")
        node = omegaconf.OmegaConf.to_container(node, resolve=True)
    if not isinstance(node, Mapping):
        raise TypeError(f"{what} must be a mapping (dict or OmegaConf DictConfig), got {type(node).__name__}")
    return dict(node)


@dataclass
class S3Checkpointing:
    """The pieces `build_s3_checkpointing` makes: pass them to the Trainer (``**parts.trainer_kwargs``)."""

    checkpoint_io: Any
    """The `S3CheckpointIO` plugin."""
    checkpoint_callback: Any
    """The `S3ModelCheckpoint` callback."""
    resume_path: str | None = None
    """What `check_resume` set ``trainer.ckpt_path`` to on this rank (`configure_s3_checkpointing` only)."""
    resume: dict[str, Any] = field(default_factory=dict)
    """The config's ``resume_*`` settings, as keyword arguments for `check_resume`."""

    @property
    def trainer_kwargs(self) -> dict[str, list[Any]]:
        """``{"plugins": [checkpoint_io], "callbacks": [checkpoint_callback]}`` for ``Trainer(**...)``."""
        return {"plugins": [self.checkpoint_io], "callbacks": [self.checkpoint_callback]}


def build_s3_checkpointing(
    cfg: Any, *, family: str | None = None, client_settings: _s3.S3ClientSettings | None = None
) -> S3Checkpointing:
    """Build the `S3CheckpointIO` plugin and the `S3ModelCheckpoint` callback from a NeMo-style config: `cfg` (dict
    or OmegaConf, or the ``exp_manager`` node) holds ``s3_checkpointing`` (NeMo's four keys, ``load_sharing``,
    ``fencing``, ``max_requests_per_second``, ``endpoint_url``...) and ``exp_manager`` with NeMo's ``resume_*`` keys
    and ``checkpoint_callback_params``: ``dirpath`` (required) and ``ModelCheckpoint`` arguments (NeMo-only keys are
    ignored with a warning; a ``filename`` names the last checkpoint ``{filename}-last``, as in NeMo)."""
    top = _as_dict(cfg, "cfg")
    exp = _as_dict(top["exp_manager"], "exp_manager") if "exp_manager" in top else top
    s3_cfg = _as_dict(top.get("s3_checkpointing", exp.get("s3_checkpointing")), "s3_checkpointing")
    unknown = sorted(set(s3_cfg) - set(_S3_CONFIG_TO_IO_KWARGS))
    if unknown:
        raise ValueError(f"s3_checkpointing: unknown key(s) {unknown}; known: {sorted(_S3_CONFIG_TO_IO_KWARGS)}")
    params = _as_dict(exp.get("checkpoint_callback_params"), "checkpoint_callback_params")
    dirpath = params.get("dirpath")
    if not dirpath:
        raise ValueError(
            "exp_manager.checkpoint_callback_params.dirpath must be set (e.g. s3://bucket/run/checkpoints)"
        )
    dirpath = _normalize_dirpath(dirpath)
    io_kwargs = {_S3_CONFIG_TO_IO_KWARGS[key]: value for key, value in s3_cfg.items() if value is not None}
    if client_settings is not None:
        io_kwargs["client_settings"] = _settings_with_config(client_settings, io_kwargs)
    checkpoint_io = _ckpt_io.S3CheckpointIO(dirpath, **io_kwargs)
    family = _family_of(family)
    callback_class = s3_model_checkpoint_class(family)
    accepted = set(inspect.signature(callback_class.lightning_base.__init__).parameters) - {"self"}
    nemo_only = sorted(key for key in params if key not in accepted and key in _NEMO_ONLY_CALLBACK_KEYS)
    unknown = sorted(key for key in params if key not in accepted and key not in _NEMO_ONLY_CALLBACK_KEYS)
    if nemo_only:
        logger.warning("checkpoint_callback_params: ignoring NeMoModelCheckpoint-only key(s) %s", nemo_only)
    if unknown:
        logger.warning(
            "checkpoint_callback_params: ignoring %s: not arguments of %s.ModelCheckpoint (a typo?)", unknown, family
        )
    callback_kwargs = {key: value for key, value in params.items() if key in accepted}
    callback_kwargs["dirpath"] = dirpath
    callback = callback_class(**callback_kwargs, s3_utils=checkpoint_io.s3 if _urls.is_s3_url(dirpath) else None)
    if callback_kwargs.get("filename"):
        callback.CHECKPOINT_NAME_LAST = f"{callback_kwargs['filename']}-last"  # NeMo's naming, on this instance only
    resume = {key: exp[key] for key in _RESUME_KEYS.split() if exp.get(key) is not None}
    return S3Checkpointing(checkpoint_io, callback, resume=resume)


def _settings_with_config(settings: _s3.S3ClientSettings, io_kwargs: dict[str, Any]) -> _s3.S3ClientSettings:
    """`settings` with the config's ``endpoint_url`` / ``region_name`` (popped from `io_kwargs`), which must agree."""
    changes = {}
    for name in ("endpoint_url", "region_name"):
        value = io_kwargs.pop(name, None)
        current = getattr(settings, name)
        if value is not None and current is not None and value != current:
            raise ValueError(f"s3_checkpointing.{name}={value!r} contradicts client_settings.{name}={current!r}")
        if value is not None:
            changes[name] = value
    return dataclasses.replace(settings, **changes) if changes else settings


def _is_default_model_checkpoint(callback: Any, base: type) -> bool:
    """Whether `callback` is the ModelCheckpoint Lightning adds by itself (``enable_checkpointing=True``)."""
    settings = (callback.dirpath, callback.monitor, callback.save_last, callback.save_top_k)
    return type(callback) is base and settings == (None, None, None, 1)


def configure_s3_checkpointing(
    trainer: Any, cfg: Any, *, client_settings: _s3.S3ClientSettings | None = None
) -> S3Checkpointing:
    """Wire S3 checkpointing into a Trainer from a NeMo-style config, before ``fit``: `build_s3_checkpointing`'s
    plugin and callback, `NeMoCheckpointConnector`, and `check_resume` with the config's ``resume_*`` settings.
    Raises ValueError if the trainer already has another checkpoint plugin or a configured ``ModelCheckpoint``."""
    family = _trainer_family(trainer)
    parts = build_s3_checkpointing(cfg, family=family, client_settings=client_settings)
    strategy = trainer.strategy
    current_io = getattr(strategy, "_checkpoint_io", None)
    torch_io = _lightning_module(family, "plugins.io").TorchCheckpointIO
    if current_io is not None and type(current_io) is not torch_io:
        raise ValueError(
            f"The trainer already has the checkpoint plugin {type(current_io).__name__}; remove it from the Trainer, "
            "or use build_s3_checkpointing(cfg) and pass its parts to the Trainer yourself"
        )
    strategy.checkpoint_io = parts.checkpoint_io
    base = type(parts.checkpoint_callback).lightning_base
    for callback in list(trainer.callbacks):
        if isinstance(callback, base):
            if not _is_default_model_checkpoint(callback, base):
                raise ValueError(
                    "The trainer already has a configured ModelCheckpoint; remove it (the S3 one is built from "
                    "exp_manager.checkpoint_callback_params) or pass enable_checkpointing=False"
                )
            trainer.callbacks.remove(callback)
    trainer.callbacks.append(parts.checkpoint_callback)
    install_checkpoint_connector(trainer)
    if parts.resume.get("resume_if_exists") or parts.resume.get("resume_from_checkpoint"):
        parts.resume_path = check_resume(
            trainer, dirpath=parts.checkpoint_callback.dirpath, s3_utils=parts.checkpoint_io.s3, **parts.resume
        )
    return parts
