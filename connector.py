"""Resume from S3 at thousands of ranks: rank-0 discovery, broadcast, an S3-aware ``ModelCheckpoint``, one-call wiring.

Why: if every rank lists the bucket to find the checkpoint to resume from, a large job throttles S3 before it
trains a step. NeMo's design is to let global rank 0 find the checkpoint and broadcast the path; its guard later
regressed so that every rank lists again, and Lightning's own ``ckpt_path="last"`` lists on every rank and drops the
``s3://`` prefix (Lightning bug #18261). This module restores the design and keeps NeMo's names and meaning:

* `find_resume_checkpoint` (no Lightning needed): the ``s3://`` URL (or local path) to resume from, chosen by rules
  that do not depend on listing order (see `select_resume_candidate`); clear errors when nothing is found or the run
  already finished.
* `check_resume` (NeMo's ``exp_manager.check_resume``): for an ``s3://`` dirpath only global rank 0 lists (the rank
  comes from the environment, the process group does not exist yet) and sets ``trainer.ckpt_path``.
* Resume never sticks: a chosen checkpoint that does not verify or load is skipped, on every rank alike, for the next
  newest (`find_resume_checkpoints`, `load_newest_usable`; ``resume_fallback=False`` keeps the strict behaviour).
* `NeMoCheckpointConnector` (subclass of Lightning's ``_CheckpointConnector``): ``resume_start`` loads the path that
  rank 0 chose, broadcast to every rank, whatever Lightning passed in on the other ranks; ``ckpt_path="last"`` is
  resolved on rank 0 only.
* `S3ModelCheckpoint` (subclass of Lightning's ``ModelCheckpoint``, or `S3ModelCheckpointMixin` for other
  subclasses such as NeMo's): ``setup()`` broadcasts ``trainer.ckpt_path`` and ``last_model_path`` from rank 0, top-k
  bookkeeping survives a resume, ``"last"`` keeps its ``s3://`` URL, and existence checks (which decide Lightning's
  ``-v1`` names) ask S3 on rank 0 instead of a stale s3fs listing cache.
* `configure_s3_checkpointing` / `build_s3_checkpointing`: everything above from a NeMo-style config
  (``s3_checkpointing:`` block plus ``exp_manager.checkpoint_callback_params.dirpath``).

Lightning classes exist in two families (``lightning.pytorch`` and ``pytorch_lightning``) whose Trainers reject each
other's classes, and neither may be imported when this module is. So the Lightning subclasses are built on first use,
once per family, by `checkpoint_connector_class(family)` and `s3_model_checkpoint_class(family)`; the module-level
names ``NeMoCheckpointConnector`` and ``S3ModelCheckpoint`` (PEP 562 ``__getattr__``) are the ``lightning.pytorch``
classes (``pytorch_lightning`` if only that is installed), ``NeMoCheckpointConnectorPL`` and ``S3ModelCheckpointPL``
the ``pytorch_lightning`` ones. The behaviour lives in two plain mixins, `BroadcastResumeConnectorMixin` and
`S3ModelCheckpointMixin`, so it can be read (and mixed into other subclasses) without Lightning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import os
import pickle
import re
import sys
import time
import traceback
import types
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

if __package__:
    from . import s3_checkpoint_io as _ckpt_io
    from . import s3_dirpath_utils as _urls
    from . import s3_utils as _s3
else:  # installed (or copied) as top-level modules
    import s3_checkpoint_io as _ckpt_io
    import s3_dirpath_utils as _urls
    import s3_utils as _s3


@functools.cache
def _s3_dcp() -> types.ModuleType | None:
    """`s3_dcp` from beside this module (in the same package, or top-level), imported on first need (a DCP checkpoint
    met on resume), or None where it is absent: a fork may copy only the four core files, and single-file
    checkpointing and resume need nothing from it. An s3_dcp that is there but fails to import raises as usual."""
    name = f"{__package__}.s3_dcp" if __package__ else "s3_dcp"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return None


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
    "distributed_checkpoint_problem",
    "find_resume_checkpoint",
    "find_resume_checkpoints",
    "global_rank",
    "install_checkpoint_connector",
    "is_global_rank_zero",
    "is_unusable_checkpoint_error",
    "list_resume_candidates",
    "load_newest_usable",
    "looks_like_distributed_checkpoint",
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
    """A sharded (DCP) checkpoint on S3 needs ``s3_dcp.py``, which is not beside this module (a fork that copied only
    the four core files): raised when the checkpoint to resume from is one (nothing here could load it), and by
    ``s3_checkpoint_admin`` where it meets one."""


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

global_rank = _s3.global_rank
"""This process's global rank (`s3_utils.global_rank`, re-exported under the name NeMo's code imports from here):
torch.distributed's once its process group is up, else the launcher's environment, which resume discovery needs
because it runs before Lightning creates the process group."""


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
# Checkpoint names (after NeMo's ``*last.ckpt`` / ``*end.ckpt`` globs). Public so that tools (the CLI) apply the
# same rules as resume discovery.
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
    """`path` without its model-parallel shard folder: ``.../mp_rank_00/x.ckpt`` -> ``.../x.ckpt``.

    Like NeMo's function of the same name, but it only strips a real shard folder (NeMo stripped the parent of any
    path containing ``mp_rank``/``tp_rank``/``fsdp_shard`` anywhere) and keeps an ``s3://`` URL intact.
    """
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
    """Why a checkpoint's shard folders do not form a complete set, or None if they do.

    A set is complete when all folders use one layout and their indices fill the grid from 0 to the largest index
    in every dimension (``tp_rank_00..NN`` x ``pp_rank_000..MMM``). A missing top index cannot be detected from the
    names alone; that case is caught when loading.
    """
    shards = sorted(shards)
    if shards == [""]:
        return None
    if "" in shards:
        return "it exists both as a single file and as model-parallel shards"
    layouts = {_shard_index(folder) for folder in shards}
    if len({layout for layout, _ in layouts}) > 1:
        return f"its shard folders mix layouts ({', '.join(shards)})"
    indices = {index for _, index in layouts}
    sizes = [max(index[dim] for index in indices) + 1 for dim in range(len(next(iter(indices))))]
    expected = 1
    for size in sizes:
        expected *= size
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
    """``"last"``, ``"end"`` (the run finished), or ``"step"`` (a top-k checkpoint with ``step=N`` in its name: a
    fallback only, see `list_resume_candidates`)."""
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
    """The kind of checkpoint a file (or directory) name denotes for resuming: ``"end"`` for NeMo's ``*end.ckpt``
    (``*end`` for a directory: the run finished), ``"last"`` for ``*last.ckpt`` / ``*last-vN.ckpt`` (``*last`` /
    ``*last-vN`` for a directory), else None (top-k checkpoints and other files are not resumed from)."""
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
    """`distributed_checkpoint_problem`, plus megatron-core's own marker: a megatron-core checkpoint (`is_megatron`,
    e.g. NeMo 2.x's ``weights/`` or Megatron-LM's ``iter_NNNNNNN``, or one with megatron-core's ``common.pt``) is
    complete only once ``metadata.json`` follows ``.metadata``; megatron-core refuses to load it without."""
    names = set(names)
    problem = distributed_checkpoint_problem(names)
    megatron = is_megatron or _MEGATRON_COMMON_NAME in names
    if problem is None and megatron and _MEGATRON_CONFIG_NAME not in names:
        if looks_like_distributed_checkpoint(names):
            return f"it is a megatron-core checkpoint without {_MEGATRON_CONFIG_NAME}: its save never finished"
        return "it holds no distributed checkpoint files"
    return problem


# DCP's file names. s3_dcp defines them; they are spelled out here too so that a fork without s3_dcp.py still
# recognises a DCP checkpoint (tests/test_packaging.py checks that both agree).
_METADATA_NAME = ".metadata"
_DCP_SHARD_SUFFIX = ".distcp"
_ITEM_CHECKSUMS_NAME = ".s3ckpt-items.json"
_LIGHTNING_META_NAME = "meta.pt"
_DCP_SHARD = re.compile(rf"__(\d+)_\d+{re.escape(_DCP_SHARD_SUFFIX)}")
_DCP_RANK_METADATA = re.compile(rf"__(\d+){re.escape(_METADATA_NAME)}")


def distributed_checkpoint_problem(names: Iterable[str]) -> str | None:
    """Why a directory whose top level holds `names` is an incomplete DCP checkpoint, or None if it is complete or
    not a DCP checkpoint at all (no ``.distcp`` shard, ``.metadata``, item record or Lightning ``meta.pt``).

    ``.metadata`` is DCP's commit marker, written last. A save made with ``use_collectives=False`` commits one
    ``__{rank}.metadata`` per rank instead: complete when every rank holding shards has its own."""
    names = set(names)
    if _METADATA_NAME in names or not looks_like_distributed_checkpoint(names):
        return None
    shard_ranks = {int(m.group(1)) for m in map(_DCP_SHARD.fullmatch, names) if m}
    committed = {int(m.group(1)) for m in map(_DCP_RANK_METADATA.fullmatch, names) if m}
    if committed and shard_ranks <= committed:
        return None
    return f"it is a distributed (DCP) checkpoint without {_METADATA_NAME}: its save never finished"


def looks_like_distributed_checkpoint(names: Iterable[str]) -> bool:
    """Whether the names at the top level of a directory are those of a DCP checkpoint, complete or not: a
    ``__{rank}_{n}.distcp`` shard, ``.metadata`` / ``__{rank}.metadata``, the item record or Lightning's ``meta.pt``."""
    names = set(names)
    markers = {_METADATA_NAME, _ITEM_CHECKSUMS_NAME, _LIGHTNING_META_NAME}
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
    """Build candidates from ``(path relative to the checkpoint directory, mtime)`` pairs of every file below it.

    Only names directly in the directory, in a shard folder directly below it, or in a distributed-checkpoint
    directory directly below it count; anything nested deeper (other runs, backups) is ignored. A DCP checkpoint
    directory (``x-last.ckpt/`` holding ``.distcp`` shards) counts only once its ``.metadata`` is there (see
    `distributed_checkpoint_problem`); that key is in the same listing, so no request per directory is made.
    """
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
    candidates = []
    for name, shards in files.items():
        problem = _shard_problem(shards)
        if problem is None and _unfinished_marker_name(name) in top_level:
            problem = f"its unfinished marker {_unfinished_marker_name(name)} exists"
        candidates.append(
            ResumeCandidate(
                name=name,
                url=f"{base}{separator}{name}",
                kind=_resume_kind(name, False, include_steps) or "",
                step=checkpoint_step(name),
                modified=max(shards.values()),
                shards=tuple(sorted(shards)),
                problem=problem,
            )
        )
    for name, modified in directories.items():
        marker = _unfinished_marker_name(name)
        nested = name in weights_files  # NeMo 2.x: the checkpoint's files are in weights/
        names = weights_files[name] if nested else directory_files.get(name, set())
        problem = megatron_checkpoint_problem(names, nested or bool(MEGATRON_ITERATION_PATTERN.fullmatch(name)))
        if problem is None and marker in top_level:
            problem = f"its unfinished marker {marker} exists"
        candidates.append(
            ResumeCandidate(
                name=name,
                url=f"{base}{separator}{name}",
                kind=_resume_kind(name, True, include_steps) or "",
                step=checkpoint_step(name),
                modified=modified,
                is_directory=True,
                is_dcp=looks_like_distributed_checkpoint(names),
                problem=problem,
            )
        )
    return sorted(candidates, key=lambda candidate: candidate.url)


def _s3_entries(url: str, s3_utils: _s3.S3Utils) -> list[tuple[str, float]]:
    """Every object under the S3 "directory" `url` (one paginated listing, ``/``-bounded)."""
    _, prefix = _urls.s3_dir_prefix(url)
    entries = []
    for obj in s3_utils.list_objects(url):
        modified = obj.last_modified.timestamp() if hasattr(obj.last_modified, "timestamp") else 0.0
        entries.append((obj.key[len(prefix) :], modified))
    return entries


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
    """Every ``*last`` / ``*end`` checkpoint in `dirpath` (``s3://`` or local), usable or not, sorted by URL; with
    `include_steps` also the other ``*.ckpt`` checkpoints with ``step=N`` in their name (kind ``"step"``: top-k
    checkpoints, which resume falls back to, see `find_resume_checkpoints`).

    One S3 listing of ``dirpath/`` (all pages; ``s3://b/ckpt`` never sees ``s3://b/ckpt_old/...``). A local
    directory that does not exist has no candidates; a missing bucket raises `CheckpointNotFoundError`.
    """
    if _urls.is_s3_url(dirpath):
        url = _urls.normalize_s3_url(dirpath).rstrip("/")
        bucket, _ = _urls.parse_s3_url(url)
        try:
            entries = _s3_entries(url, s3_utils or _s3.S3Utils())
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
    """Order candidates by step when every one has a step (mtime breaks ties), else by modification time.

    At the same step an ``end`` checkpoint counts as newer than a ``last`` one: they hold the same state and the run
    finished there. Never by name: S3 lists in byte order, where ``step=9`` sorts after ``step=10``.
    """

    def key(candidate: ResumeCandidate) -> tuple[Any, ...]:
        is_end = candidate.kind == "end"
        if all_have_steps:
            return (candidate.step, is_end, candidate.modified, candidate.url)
        return (candidate.modified, is_end, candidate.step if candidate.step is not None else -1, candidate.url)

    return key


def select_resume_candidate(
    candidates: Iterable[ResumeCandidate], *, resume_past_end: bool = False, dirpath: str = ""
) -> ResumeCandidate | None:
    """The candidate to resume from, or None if none is usable. The rules:

    1. Unusable candidates are skipped with a warning: model-parallel checkpoints whose shard folders
       (``mp_rank_XX``, ``tp_rank_XX_pp_rank_YYY``, ``fsdp_shard_XXXXX``) do not form a complete grid, and
       checkpoints with NeMo's ``-unfinished`` marker.
    2. The newest usable one wins: by ``step=N`` in the name when every candidate has one (then by modification
       time), else by modification time (Lightning's rule for ``last``).
    3. If the newest is an ``*end`` checkpoint the previous run finished: `CheckpointAlreadyCompletedError` unless
       `resume_past_end`. (NeMo raised as soon as any ``*end.ckpt`` existed; here a newer ``*last`` means training
       was resumed past the end before, and it is what you resume from.)
    4. If the newest is a DCP checkpoint on S3 and `s3_dcp` is not beside this module: `DCPSupportMissingError`
       (never a silent fall back to an older checkpoint).
    """
    candidates = [candidate for candidate in candidates if candidate.kind != "step"]  # fallbacks only
    usable = []
    for candidate in candidates:
        if candidate.problem:
            logger.warning("Not resuming from %s: %s", candidate.url, candidate.problem)
        else:
            usable.append(candidate)
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
    """The ``s3://`` URL (or local path) to resume from in `dirpath`, or None: the first of `find_resume_checkpoints`
    (see there for the rules and errors)."""
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
    """The ``s3://`` URLs (or local paths) to resume from in `dirpath`, newest first: the one to resume from, then
    (with `fallbacks`) the checkpoints to fall back to, in order, if it does not verify or load (`load_newest_usable`):
    the other usable ``*last`` / ``*end`` checkpoints and the top-k checkpoints with ``step=N`` in their names, newest
    first by the same rule. Empty when there is none and `resume_ignore_no_checkpoint`.

    Lists `dirpath` once, on whatever rank calls it (`check_resume` calls it on global rank 0 only) and applies
    `select_resume_candidate`. Model-parallel checkpoints come back without their shard folder
    (``s3://b/ckpt/x-last.ckpt`` for ``s3://b/ckpt/mp_rank_00/x-last.ckpt`` ...), as NeMo's strategy injects it again.

    Raises `CheckpointNotFoundError` when nothing usable exists (returns None instead if
    `resume_ignore_no_checkpoint`) or when the bucket does not exist (always: saving would fail too), and
    `CheckpointAlreadyCompletedError` when the previous run finished and not `resume_past_end`.
    """
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
    """The usable candidates other than `chosen`, newest first (`_newest_first_key`); DCP ones only where s3_dcp is
    there to load them."""
    usable = [
        candidate
        for candidate in candidates
        if candidate is not chosen
        and not candidate.problem
        and not (candidate.is_dcp and _s3_dcp() is None and _urls.is_s3_url(candidate.url))
    ]
    key = _newest_first_key(all(c.step is not None for c in [*usable, chosen]))
    return [candidate.url for candidate in sorted(usable, key=key, reverse=True)]


# --------------------------------------------------------------------------------------------------------------------
# Resume never sticks: a checkpoint that does not verify or load is skipped (never deleted) for the next newest
# --------------------------------------------------------------------------------------------------------------------
#
# Why: a newest checkpoint that fails its checksum (or lost a shard, or holds an unreadable .metadata) made every
# relaunch pick it and fail the same way: a crash became a crash loop until a person deleted objects by hand.
# How: discovery gives the checkpoints newest first (`find_resume_checkpoints`, on global rank 0, broadcast); every
# rank tries the same one; the ranks exchange their outcomes (one all-gather per try) and all move on to the next one
# when any rank found the checkpoint unusable (`is_unusable_checkpoint_error`), so every rank resumes from the same
# checkpoint. Other failures (network, credentials, a run fenced off) are raised: an older checkpoint would not help.


def is_unusable_checkpoint_error(exc: BaseException) -> bool:
    """Whether `exc`, raised by loading a checkpoint, says that checkpoint itself is unusable: its bytes do not match
    the recorded checksum (`s3_utils.ChecksumMismatchError`), an object or shard is missing (FileNotFoundError,
    `s3_dcp.CheckpointIncompleteError`), or it does not unpickle (a truncated or unreadable file or ``.metadata``).
    DCP's ``CheckpointException`` counts when any rank's failure inside it does. A refusal of ``weights_only`` is a
    setting, not a broken checkpoint: not unusable. DCP's load reports a ``.metadata`` it could not read as an
    AssertionError whose text says so: that counts too."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, _s3.CheckpointDirectoryTakenError):
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
    """``(url, load(url))`` for the first of `urls` (newest first) that loads on every rank; each skipped one is
    logged as a WARNING with the reason, and left where it is.

    Collective when a ``torch.distributed`` process group is up: every rank must call it with the same `urls`
    (`find_resume_checkpoints` on global rank 0, broadcast), and after each try the ranks exchange their outcomes,
    so all of them end on the same checkpoint. A try that failed on some rank with an error that makes the checkpoint
    unusable (`is_unusable_checkpoint_error`) moves every rank to the next URL; any other failure is raised (on a
    rank whose own load succeeded, as `ResumeFailedError`). `fallback=False`: only the first URL is tried (strict).
    When no URL is left the last failure is raised, with a note naming the checkpoints skipped."""
    urls = list(urls)
    if not urls:
        raise ValueError("load_newest_usable needs at least one checkpoint URL")
    if not fallback:
        urls = urls[:1]
    skipped: list[str] = []
    for index, url in enumerate(urls):
        error: BaseException | None = None
        result = None
        try:
            result = load(url)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            error = exc
        outcome = None
        if error is not None:
            outcome = ("unusable" if is_unusable_checkpoint_error(error) else "error", _describe_failure(error))
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
# check_resume (NeMo's exp_manager.check_resume)
# --------------------------------------------------------------------------------------------------------------------


def _s3_utils_of_trainer(trainer: Any) -> _s3.S3Utils | None:
    """The `S3Utils` of the trainer's `S3CheckpointIO` (also inside Lightning's AsyncCheckpointIO), if it has one, so
    discovery uses the same endpoint, credentials and retry policy as the saves."""
    strategy = getattr(trainer, "strategy", None)
    plugin = getattr(strategy, "_checkpoint_io", None)  # not the property: it would create a default plugin
    for _ in range(3):
        if isinstance(plugin, _ckpt_io.S3CheckpointIO):
            return plugin.s3
        plugin = getattr(plugin, "checkpoint_io", None)
    return None


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
    """NeMo's ``exp_manager.check_resume``: find the checkpoint to resume from and set ``trainer.ckpt_path``.

    * `resume_from_checkpoint` is used on every rank unless `resume_if_exists` finds a checkpoint.
    * With `resume_if_exists` the directory is `dirpath`, else ``<log_dir>/checkpoints``. For an ``s3://``
      directory **only global rank 0 lists** (rank from the environment, see `global_rank`); the other ranks
      get the path by broadcast in `NeMoCheckpointConnector.resume_start` and `S3ModelCheckpoint.setup`.
      Local directories are searched on every rank, as in NeMo.
    * Errors as `find_resume_checkpoint`. NeMo's moving of old log files into ``run_N`` is not done here.
    * `resume_fallback` (default True): if the checkpoint found does not verify or load when ``fit`` loads it, every
      rank falls back to the next newest one that does (`find_resume_checkpoints`, `load_newest_usable`), with a
      WARNING naming the one skipped and why; nothing is deleted. False: strict, the load error is raised as before.

    Also installs `NeMoCheckpointConnector` on a Lightning trainer (see `install_checkpoint_connector`), so the
    order of the two calls no longer matters. Returns the path set on this rank (None if none).
    """
    if resume_if_exists and not dirpath and not log_dir:
        raise ValueError(
            "Resuming requires the checkpoint dirpath or the log_dir (checkpoints are in log_dir/checkpoints)"
        )
    if getattr(trainer, "_checkpoint_connector", None) is not None:
        install_checkpoint_connector(trainer)
    checkpoint: str | None = None
    if resume_from_checkpoint:
        checkpoint = _urls.as_path_or_s3_url(resume_from_checkpoint)
    if resume_if_exists:
        directory = (
            _urls.as_path_or_s3_url(dirpath) if dirpath else os.path.join(os.fspath(log_dir or ""), "checkpoints")
        )
        rank = global_rank()
        if _urls.is_s3_url(directory) and rank != 0:
            logger.debug(
                "Rank %d: not listing %s; global rank 0 finds the checkpoint and broadcasts it", rank, directory
            )
        else:
            found = find_resume_checkpoints(
                directory,
                resume_past_end=resume_past_end,
                resume_ignore_no_checkpoint=resume_ignore_no_checkpoint,
                s3_utils=s3_utils or _s3_utils_of_trainer(trainer),
                fallbacks=resume_fallback,
            )
            if found:
                checkpoint = found[0]
                _set_resume_fallbacks(trainer, found[0], found[1:], resume_fallback)
            elif checkpoint is not None:
                logger.warning("Training from resume_from_checkpoint=%s instead", checkpoint)
    if checkpoint is not None:
        trainer.ckpt_path = checkpoint
        logger.info("Resuming training from checkpoint: %s", checkpoint)
    return checkpoint


# --------------------------------------------------------------------------------------------------------------------
# Lightning glue: the behaviour (plain mixins) ...
# --------------------------------------------------------------------------------------------------------------------


def _set_resume_fallbacks(trainer: Any, chosen: str, fallbacks: list[str], enabled: bool = True) -> None:
    """Tell the trainer's `BroadcastResumeConnectorMixin` (if it has one) what to fall back to should `chosen` not
    load; only the rank that ran discovery knows, ``resume_start`` broadcasts it."""
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
    """Run `compute` on global rank 0 only and give its result to every rank. If it raises, every rank raises
    (rank 0 the original error), instead of the other ranks waiting in the broadcast until the collective timeout."""
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


def _has_s3_checkpoint_dir(trainer: Any) -> bool:
    for callback in getattr(trainer, "checkpoint_callbacks", []) or []:
        dirpath = getattr(callback, "dirpath", None)
        if isinstance(dirpath, (str, os.PathLike)) and _urls.is_s3_url(dirpath):
            return True
    return False


class BroadcastResumeConnectorMixin:
    """What `NeMoCheckpointConnector` adds to Lightning's ``_CheckpointConnector`` (mixed in front of it).

    * ``resume_start``: rank 0 loads what Lightning selected on rank 0; every other rank loads rank 0's choice,
      received by broadcast, whatever Lightning passed in there (None when only rank 0 ran discovery). NeMo's version
      ignored its argument on every rank, so ``fit(ckpt_path=...)`` was dropped when ``trainer.ckpt_path`` was unset.
      The load is collective (`s3_checkpoint_io.collective_resume`): one download per node by default, see the
      plugin's ``load_sharing``.
    * ``ckpt_path="last"`` with an ``s3://`` checkpoint directory: resolved on global rank 0 only (the other ranks
      would each list the bucket), from one listing per `S3ModelCheckpoint` (newest modification time, Lightning's
      rule); the answer reaches the other ranks through ``resume_start``. If some candidate lives elsewhere (a local
      or plain ModelCheckpoint, an OnExceptionCheckpoint) Lightning's own resolution runs, still on rank 0 only.
    * A checkpoint that discovery chose (`check_resume`, ``ckpt_path="last"``) and that does not verify or load on
      some rank is skipped on every rank for the next newest (`load_newest_usable`), unless `resume_fallback` is off.
    """

    trainer: Any
    resume_fallback: bool = True
    """Fall back to the next newest checkpoint when the one discovery chose does not verify or load (`check_resume`
    sets it from its ``resume_fallback``); only for checkpoints that discovery chose, never a ``ckpt_path`` given."""
    resume_fallbacks: dict[str, list[str]] = {}  # noqa: RUF012 (replaced, never mutated)
    """On the rank that ran discovery: the chosen checkpoint -> the ones to fall back to, newest first."""

    def resume_start(self, checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        fallbacks = self.resume_fallbacks.get(checkpoint_path, []) if self.resume_fallback and checkpoint_path else []
        chosen, fallbacks = _broadcast_from_rank_zero(trainer, (checkpoint_path, fallbacks))
        rank = getattr(trainer, "global_rank", 0)
        if chosen != checkpoint_path:
            logger.info("Rank %d: resuming from %s as chosen on rank 0 (was given %r)", rank, chosen, checkpoint_path)
        elif chosen:
            logger.info("Rank %d: resuming from checkpoint %s", rank, chosen)
        started = time.perf_counter()

        def load(url: Any) -> None:
            with _ckpt_io.collective_resume(trainer):  # every rank loads `url` now: one download per node or job
                super(BroadcastResumeConnectorMixin, self).resume_start(url, *args, **kwargs)  # type: ignore[misc]

        if not chosen:
            load(chosen)
            return
        if fallbacks:
            chosen, _ = load_newest_usable([chosen, *fallbacks], load)
        else:
            load(chosen)
        logger.info("Rank %d: loaded %s in %.2f s", rank, chosen, time.perf_counter() - started)

    def _parse_ckpt_path(self, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        if ckpt_path == "last" and _has_s3_checkpoint_dir(self.trainer):
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


def _last_checkpoint_sources(trainer: Any) -> list[S3ModelCheckpointMixin] | None:
    """The S3 callbacks that hold every candidate for ``ckpt_path="last"``, or None if some candidate lives
    elsewhere (a local or plain ModelCheckpoint, an OnExceptionCheckpoint): then Lightning's own resolution runs."""
    sources = []
    for callback in trainer.callbacks:
        if isinstance(callback, S3ModelCheckpointMixin) and callback._is_s3_dir():
            sources.append(callback)
        elif callback in trainer.checkpoint_callbacks or type(callback).__name__ == "OnExceptionCheckpoint":
            return None
    return sources


def _last_checkpoints_newest_first(trainer: Any, sources: list[S3ModelCheckpointMixin], state_fn: Any) -> list[str]:
    """Lightning's rule for ``"last"`` (the most recently modified last checkpoint) first, from one listing per
    callback, then the other last checkpoints in that order (fallbacks)."""
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


def _newest_url(times: dict[str, float]) -> str:
    return max(times, key=_newest_url_key(times))


def _normalize_dirpath(dirpath: Any) -> Any:
    """An S3 dirpath as ``s3://bucket/prefix`` (str, no trailing ``/``, pathlib's ``s3:/`` repaired); others as is."""
    if isinstance(dirpath, (str, os.PathLike)) and _urls.is_s3_url(dirpath):
        url = _urls.normalize_s3_url(dirpath)
        bucket, key = _urls.parse_s3_url(url)
        return _urls.build_s3_url(bucket, key.rstrip("/"))
    return dirpath


def _template_regex(template: str) -> str:
    """A regex for names made from a Lightning filename template (``"{step}-last"`` matches ``step=12-last``)."""
    pieces = re.split(r"(\{[^}]*\})", template)
    return "".join(".+?" if piece.startswith("{") and piece.endswith("}") else re.escape(piece) for piece in pieces)


class S3ModelCheckpointMixin:
    """What `S3ModelCheckpoint` adds to a ``ModelCheckpoint`` class (mixed in front of it, e.g. NeMo's own).

    * ``setup()``: installs `NeMoCheckpointConnector` if the trainer still has Lightning's, then broadcasts rank 0's
      ``trainer.ckpt_path`` and ``last_model_path`` (only rank 0 ran `check_resume` on S3).
    * ``file_exists``: asked on global rank 0 only, straight to S3 (one HEAD), and broadcast. Lightning asks
      fsspec, whose process-wide s3fs listing cache keeps answering "no" after objects appear, so a second run into
      the same dirpath silently overwrote the first one's checkpoints instead of writing ``-v1`` names.
    * ``ckpt_path="last"`` (`last_checkpoint_times`, ``_find_last_checkpoints``): one ``/``-bounded S3 listing that
      yields ``s3://`` URLs (Lightning's ``os.path.normpath`` turned them into ``s3:/...``, bug #18261); NeMo-style
      names such as ``{filename}-last`` are matched too.
    * top-k bookkeeping (``best_k_models``...) survives a resume: ``s3://`` entries are kept (NeMo dropped them
      because ``os.path.isfile`` is False for URLs, orphaning the objects).
    * a run never removes, on S3, the checkpoint it resumed from nor one outside its dirpath (`kept_from_removal`), as
      Lightning does on a local directory (its ``_should_remove_checkpoint`` removes any remote path: #21813).
    * S3 is asked through the plugin's `S3Utils` (same endpoint, credentials and retries as the saves), also for
      Lightning's "directory not empty" warning, so s3fs needs no configuration of its own; every save and removal
      still drops the s3fs cache entries for that URL, so Lightning's remaining fsspec calls stay true.
    """

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
        return isinstance(self.dirpath, (str, os.PathLike)) and _urls.is_s3_url(self.dirpath)

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
        shared = (state, self.last_model_path, self._run_of(trainer))
        (ckpt_path, user_managed), last_model_path, run = _broadcast_from_rank_zero(trainer, shared)
        connector._ckpt_path = ckpt_path
        connector._user_managed = user_managed
        self.last_model_path = last_model_path
        _s3.adopt_run(run)  # the ranks of one job are one run (docs/runs.md), whatever their launcher said

    @staticmethod
    def _run_of(trainer: Any) -> _s3.CheckpointRun:
        """The run the trainer's `S3CheckpointIO` saves as (pickled along by ``ddp_spawn``), else this process's."""
        plugin = getattr(getattr(trainer, "strategy", None), "_checkpoint_io", None)  # the property would make one
        for _ in range(3):
            if isinstance(plugin, _ckpt_io.S3CheckpointIO):
                return plugin.run
            plugin = getattr(plugin, "checkpoint_io", None)  # inside Lightning's AsyncCheckpointIO
        return _s3.current_run()

    def file_exists(self, filepath: Any, trainer: Any, *args: Any, **kwargs: Any) -> bool:
        if not (isinstance(filepath, (str, os.PathLike)) and _urls.is_s3_url(filepath)):
            return super().file_exists(filepath, trainer, *args, **kwargs)  # type: ignore[misc]
        url = _urls.normalize_s3_url(filepath)

        def head() -> bool:
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
            entries = _s3_entries(url, self._s3_utils(trainer))
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
        if times and _newest_url(times) in sharded:
            _require_dcp_support(_newest_url(times))
        return times

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        """Lightning's hook for ``ckpt_path="last"`` when `NeMoCheckpointConnector` is not installed (it then asks
        fsspec about each URL): the ``s3://`` URLs, not Lightning's ``s3:/`` (#18261)."""
        if not self._is_s3_dir():
            return super()._find_last_checkpoints(trainer)  # type: ignore[misc]
        _s3.invalidate_fsspec_cache(self.dirpath)  # Lightning asks fsspec about each candidate next
        return set(self.last_checkpoint_times(trainer))

    # Overrides ModelCheckpoint's private (name-mangled) __warn_if_dir_not_empty; if Lightning renames it, its own runs.
    def _ModelCheckpoint__warn_if_dir_not_empty(self, dirpath: Any) -> None:
        """Lightning's "directory not empty" warning from ``setup`` (rank 0), asked through this package's S3 client
        (one LIST, same endpoint and credentials as the saves) instead of s3fs, for an S3 dirpath."""
        if not (isinstance(dirpath, (str, os.PathLike)) and _urls.is_s3_url(dirpath)):
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
        """Why the ``s3://`` checkpoint `filepath` must not be removed by this callback (None: it may be): it is the
        checkpoint the run resumed from (``trainer.ckpt_path``), or it lies outside this callback's S3 dirpath. On a
        local directory Lightning's ``_should_remove_checkpoint`` says so; for a remote path it says "remove" (Lightning
        #21813), so a resumed run's top-k, "last" and NeMo-style clean-ups deleted the checkpoint it resumed from."""
        if not (isinstance(filepath, (str, os.PathLike)) and _urls.is_s3_url(filepath)):
            return None
        url = _urls.normalize_s3_url(filepath).rstrip("/")
        resumed = getattr(trainer, "ckpt_path", None) if trainer is not None else None
        if isinstance(resumed, (str, os.PathLike)) and _urls.is_s3_url(resumed):
            if _urls.normalize_s3_url(resumed).rstrip("/") == url:
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

_FAMILIES = ("lightning.pytorch", "pytorch_lightning")
_CLASS_SUFFIX = {"lightning.pytorch": "", "pytorch_lightning": "PL"}
_CONNECTOR_NAME = "NeMoCheckpointConnector"
_CALLBACK_NAME = "S3ModelCheckpoint"


def _default_family() -> str:
    for family in _FAMILIES:
        with contextlib.suppress(ImportError):
            importlib.import_module(family)
            return family
    _s3.import_optional_dependency("lightning", "the Lightning connector and ModelCheckpoint")
    raise AssertionError("unreachable")  # pragma: no cover


def _family_of(family: str | None) -> str:
    if family is None:
        return _default_family()
    if family not in _FAMILIES:
        raise ValueError(f"family must be one of {_FAMILIES}, got {family!r}")
    return family


def _lightning_module(family: str, submodule: str) -> Any:
    name = f"{family}.{submodule}"
    return _s3.import_optional_dependency(name, f"{family} support")


def checkpoint_connector_class(family: str | None = None) -> type:
    """`NeMoCheckpointConnector` for a Lightning family (``"lightning.pytorch"`` or ``"pytorch_lightning"``;
    default: ``lightning.pytorch`` if installed). Built once per family and cached."""
    return _build_connector_class(_family_of(family))


def s3_model_checkpoint_class(family: str | None = None) -> type:
    """`S3ModelCheckpoint` for a Lightning family (see `checkpoint_connector_class`). Built once and cached."""
    return _build_callback_class(_family_of(family))


def _build_connector_class(family: str) -> type:
    base = _lightning_module(family, "trainer.connectors.checkpoint_connector")._CheckpointConnector
    return _lightning_subclass(_CONNECTOR_NAME, family, BroadcastResumeConnectorMixin, base, "with rank-0 resume")


def _build_callback_class(family: str) -> type:
    base = _lightning_module(family, "callbacks").ModelCheckpoint
    return _lightning_subclass(_CALLBACK_NAME, family, S3ModelCheckpointMixin, base, "S3-aware")


@functools.cache
def _lightning_subclass(base_name: str, family: str, mixin: type, base: type, what: str) -> type:
    """``class <base_name>[PL](mixin, base)``, built once per family; `lightning_base` names the Lightning class."""
    name = base_name + _CLASS_SUFFIX[family]
    doc = f"Lightning's ``{base.__name__}`` ({family}), {what}. {mixin.__doc__}"
    namespace = {"__module__": __name__, "__qualname__": name, "__doc__": doc, "lightning_base": base}
    return type(name, (mixin, base), namespace)


NeMoCheckpointConnector: type
"""`checkpoint_connector_class()` for the default family; built on first access by ``__getattr__``."""
S3ModelCheckpoint: type
"""`s3_model_checkpoint_class()` for the default family; built on first access by ``__getattr__``."""


def __getattr__(name: str) -> Any:
    """PEP 562: the Lightning classes are built on first access (Lightning need not be installed to import this)."""
    for base_name, build in (
        (_CONNECTOR_NAME, checkpoint_connector_class),
        (_CALLBACK_NAME, s3_model_checkpoint_class),
    ):
        if name == base_name:
            return build(None)
        for family, suffix in _CLASS_SUFFIX.items():
            if suffix and name == base_name + suffix:
                return build(family)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _trainer_family(trainer: Any) -> str:
    for cls in type(trainer).__mro__:
        module = cls.__module__ or ""
        for family in _FAMILIES:
            if module == family or module.startswith(family + "."):
                return family
    raise TypeError(f"expected a lightning.pytorch or pytorch_lightning Trainer, got {type(trainer).__name__}")


def install_checkpoint_connector(trainer: Any) -> Any:
    """Put `NeMoCheckpointConnector` (of the trainer's family) in place of Lightning's plain connector and return it.

    Idempotent, and safe at any time before ``fit``: the state of the replaced connector (including a
    ``trainer.ckpt_path`` already set by `check_resume`) is carried over. A connector that is some other subclass
    (a custom one, or NeMo's own ``NeMoCheckpointConnector``) is left in place with a warning.
    """
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
    "max_requests_per_second": "max_requests_per_second",  # a number, or {write: .., read: ..}: the whole job's
}
# NeMoModelCheckpoint-only keys of checkpoint_callback_params: accepted, logged, not used.
_NEMO_ONLY_CALLBACK_KEYS = frozenset(
    {
        "always_save_nemo",
        "save_nemo_on_train_end",
        "save_best_model",
        "postfix",
        "prefix",
        "n_resume",
        "model_parallel_size",
        "async_save",
        "filepath",
        "save_last_n_optim_states",
    }
)


def _as_dict(node: Any, what: str) -> dict[str, Any]:
    """A plain dict from a Mapping or an OmegaConf node (resolved), so callers may pass either."""
    if node is None:
        return {}
    if type(node).__module__.startswith("omegaconf"):
        omegaconf = _s3.import_optional_dependency("omegaconf", "OmegaConf configs")
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
    """Build the `S3CheckpointIO` plugin and the `S3ModelCheckpoint` callback from a NeMo-style config.

    `cfg` (dict or OmegaConf) holds ``s3_checkpointing`` (``max_write_concurrency``, ``max_read_concurrency``,
    ``chunk_size_MB``, ``enable_async_checkpointing``; optionally ``max_saves_in_flight``, ``endpoint_url``,
    ``region_name``, ``request_options``) and ``exp_manager`` with ``checkpoint_callback_params`` (``dirpath``
    required; the other keys are ``ModelCheckpoint`` arguments) and NeMo's ``resume_*`` keys. ``cfg`` may also be
    the ``exp_manager`` node itself with ``s3_checkpointing`` inside it. As in NeMo, a ``filename`` makes the last
    checkpoint ``{filename}-last``. NeMoModelCheckpoint-only keys (``save_nemo_on_train_end``...) are ignored with
    a warning.
    ``s3_checkpointing.load_sharing`` (``"node"``, ``"job"`` or ``"rank"``) says who downloads on a resume;
    ``s3_checkpointing.fencing: false`` turns off the refusal of a stale run's saves and removals, and
    ``s3_checkpointing.max_requests_per_second`` (a number, or ``{write: .., read: ..}``) caps the job's S3 requests.
    """
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

    resume = {
        key: exp[key]
        for key in (
            "resume_if_exists",
            "resume_past_end",
            "resume_ignore_no_checkpoint",
            "resume_from_checkpoint",
            "resume_fallback",
        )
        if exp.get(key) is not None
    }
    return S3Checkpointing(checkpoint_io, callback, resume=resume)


def _settings_with_config(settings: _s3.S3ClientSettings, io_kwargs: dict[str, Any]) -> _s3.S3ClientSettings:
    """`settings` with the config's ``endpoint_url`` / ``region_name`` (popped from `io_kwargs`) filled in, since
    S3CheckpointIO refuses them next to explicit settings; a value that contradicts the settings is an error."""
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
    return (
        type(callback) is base
        and callback.dirpath is None
        and callback.monitor is None
        and callback.save_last is None
        and callback.save_top_k == 1
    )


def configure_s3_checkpointing(
    trainer: Any, cfg: Any, *, client_settings: _s3.S3ClientSettings | None = None
) -> S3Checkpointing:
    """Wire S3 checkpointing into an existing Trainer from a NeMo-style config, in one call (before ``fit``).

    Builds the plugin and callback (`build_s3_checkpointing`), makes the plugin the strategy's ``checkpoint_io``,
    adds the callback (replacing the ``ModelCheckpoint`` Lightning adds by default), installs
    `NeMoCheckpointConnector`, and runs `check_resume` with the config's ``resume_*`` settings (global rank 0 lists).
    Raises ValueError if the trainer already has another checkpoint plugin or a configured ``ModelCheckpoint``.
    """
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
