"""megatron-core distributed checkpoints (``dist_checkpointing``, the ``torch_dist`` format) on S3.

Megatron-LM, Megatron-Bridge and NeMo 2.x save through megatron-core's ``dist_checkpointing``, whose writer is local
files only. This module puts those checkpoints on ``s3://`` through `s3_dcp` (verified multipart uploads, ``.metadata``
as the commit marker, fencing, the request pacer)::

    import s3_mcore
    from megatron.core import dist_checkpointing

    s3_mcore.install_s3_routing()                      # once per process: megatron-core's own file operations
    strategy = s3_mcore.S3TorchDistSaveShardedStrategy()
    dist_checkpointing.save(sharded_sd, "s3://bucket/run/iter_0000100", sharded_strategy=strategy)
    state = dist_checkpointing.load(sharded_sd, "s3://bucket/run/iter_0000100")

Three parts, each usable alone:

* `S3TorchDistSaveShardedStrategy` (`S3SaveShardedStrategyMixin` on megatron-core's ``TorchDistSaveShardedStrategy``,
  with its arguments and defaults) writes ``s3://`` checkpoints with `MegatronS3StorageWriter` (sync, or async
  through megatron-core's ``AsyncRequest`` with the commit in its finalize step; also inside
  ``FullyParallelSaveStrategyWrapper``). Other paths go to megatron-core's own writer.
* `install_s3_routing`: megatron-core reads ``metadata.json``, checks directories and loads through module-level
  helpers (``megatron.core.msc_utils``, its hook for NVIDIA's multi-storage-client, and its filesystem reader). The
  call routes ``s3://`` URLs (and the ``s3:/...`` that ``pathlib`` makes of them) there to this package, leaves
  every other path where it went, and is undone by `S3Routing.uninstall`. Loads then use megatron-core's own load
  strategy and planner with `s3_dcp.S3StorageReader`. It also sends a save by megatron-core's own strategy (its
  default) to an ``s3://`` directory through this package: no save to ``s3://`` lands in a local ``./s3:`` directory.
* `megatron_checkpoint_io_class` / ``S3MegatronCheckpointIO``: NeMo 2.x's ``MegatronCheckpointIO`` keeping
  ``s3://`` URLs as text, built by the sibling `s3_mcore_nemo` (docs/megatron.md has the recipe).

The memory tier (``install_s3_routing(memory_tier=...)``, or a strategy's ``memory_tier``; docs/tiers.md): a save
lands in the node's tmpfs through `s3_dcp_tier` (an async one too: the copy into memory is its staging, and the
drains run on the training process's threads, not in megatron-core's upload process, which ends with its request);
megatron-core's ``metadata.json`` (and <= 0.18's ``common.pt``) follow ``.metadata`` into the tier and onto S3, so a
checkpoint is on S3 as megatron-core recognises one (``metadata.json``) only once all its files are. Loads read the
node's verified memory copies first. Every rank calls `finish_drains` at the end of a run. `start_replication` copies
each checkpoint in memory, ``metadata.json`` included, to the next node; `agree_resume` makes every rank resume the
newest checkpoint every rank reaches whole on some tier, and the loads that follow read each file where agreed.

megatron-core is imported on first use: importing this module never needs it. Versions: 0.19.2 and 0.18.2 are tested;
0.16-0.18 (NeMo 2.x's) are handled by feature detection (docs/megatron.md says what differs). No call here needs
CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import io
import json
import logging
import os
import pathlib
import pickle
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

if __package__:
    from . import s3_checkpoint_admin as _admin
    from . import s3_dcp as _dcp
    from . import s3_dirpath_utils as _urls
    from . import s3_fencing as _fencing
    from . import s3_process as _process
    from . import s3_utils as _s3
else:  # installed (or copied) as top-level modules
    import s3_checkpoint_admin as _admin
    import s3_dcp as _dcp
    import s3_dirpath_utils as _urls
    import s3_fencing as _fencing
    import s3_process as _process
    import s3_utils as _s3

__all__ = [
    "MegatronS3StorageWriter",
    "S3Routing",
    "S3SaveShardedStrategyMixin",
    "S3TorchDistSaveShardedStrategy",
    "agree_resume",
    "finish_drains",
    "install_s3_routing",
    "megatron_checkpoint_io_class",
    "megatron_s3_url",
    "nemo_checkpoint_url",
    "routing",
    "start_replication",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

MEGATRON_CORE_PIP = "pip install --no-deps megatron-core==0.19.2 numpy packaging"
"""How to install megatron-core for this module (its wheel declares far more than ``dist_checkpointing`` uses).
NeMo 2.x users keep the megatron-core their NeMo pins (0.16-0.18)."""
CONFIG_NAME = "metadata.json"  # package-internal (docs/api.md)
"""megatron-core's "this is a distributed checkpoint" marker, written after DCP's ``.metadata``."""
_CONFIG_READ_AT_CHECK_S = 1.0  # how long `S3Routing.open` uses the metadata.json its existence check read
COMMON_STATE_NAME = "common.pt"
"""Non-sharded state of megatron-core <= 0.18 checkpoints (0.19 keeps it inside the DCP files)."""


# --------------------------------------------------------------------------------------------------------------------
# megatron-core, imported on first use
# --------------------------------------------------------------------------------------------------------------------


def _mcore(module: str = "") -> Any:
    """``megatron.core`` or one of its submodules; ImportError naming the pip line when megatron-core is missing."""
    name = "megatron.core" + (f".{module}" if module else "")
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise _s3.MissingOptionalDependencyError(
            f"s3_mcore needs megatron-core ({name} could not be imported: {exc}). Install it with: "
            f"{MEGATRON_CORE_PIP}",
            name="megatron",
        ) from exc


def _torch_strategies() -> Any:
    return _mcore("dist_checkpointing.strategies.torch")


def _async_utils() -> Any:
    return _mcore("dist_checkpointing.strategies.async_utils")


def _msc_utils() -> Any:
    return _mcore("msc_utils")


_DCP_TIER = "s3_dcp_tier"


def _dcp_tier() -> Any:
    """The memory tier's DCP side (`s3_dcp_tier`), a sibling imported on first use (only with ``memory_tier``);
    ImportError naming the file where a fork lacks it."""
    return _process.require_sibling(_DCP_TIER, __package__, "memory_tier for megatron-core", "s3_mcore.py",
                                    needs=("s3_memory_tier",))  # fmt: skip


# --------------------------------------------------------------------------------------------------------------------
# URLs: megatron-core turns directories into Path objects and back into text
# --------------------------------------------------------------------------------------------------------------------


def megatron_s3_url(path: Any) -> str | None:
    """The ``s3://`` URL `path` names, or None for anything else (local paths, ``msc://``, None).

    Accepts ``s3://`` text, a ``Path`` made from one (``pathlib`` collapses it to ``s3:/bucket/key``) and the text of
    such a Path (megatron-core calls ``str()`` on the directories it is given: ``str(Path("s3://b/k"))`` is
    ``"s3:/b/k"``). Only inside megatron-core's calls is that collapsed text taken as S3: a local directory named
    ``s3:`` is not something a checkpoint lives in."""
    if path is None or not isinstance(path, (str, os.PathLike)):
        return None
    text = os.fspath(path)
    if not isinstance(text, str):
        return None
    if text.startswith("s3://"):
        url = text
    elif text.startswith("s3:/"):
        url = "s3://" + text[len("s3:/") :]
    else:
        return None
    return url.rstrip("/") if url.count("/") > 3 else url


# --------------------------------------------------------------------------------------------------------------------
# Saving: the writer, the strategy's arguments, the save itself, the strategy
# --------------------------------------------------------------------------------------------------------------------


class MegatronS3StorageWriter(_dcp.S3StorageWriter):
    """`s3_dcp.S3StorageWriter` for megatron-core checkpoints (same arguments): an overwrite also retires the old
    checkpoint's ``metadata.json`` before anything is written, and on megatron-core <= 0.18 the ``common.pt`` the
    routing holds is written once the save has taken the directory over.

    With ``memory_tier``, megatron-core's own files (``common.pt`` on <= 0.18, then ``metadata.json``) go into the
    node's tier after ``.metadata`` (`s3_dcp_tier.DcpTier.follow_commit`, through the routing), so they reach S3 only
    after every file and ``.metadata`` have, and leave it first when a newer save replaces the checkpoint there."""

    commit_followers = (COMMON_STATE_NAME, CONFIG_NAME)
    """Memory tier: the files that come after ``.metadata`` (removed from S3 before an older ``.metadata`` is)."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if self.memory_tier is not None:  # `finish_drains` finishes what it drains behind
            with _TIER_WRITERS_LOCK:
                _TIER_WRITERS[self.memory_tier] = self

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        """`s3_dcp.S3StorageWriter.prepare_global_plan` (take the directory over, refuse or retire an old
        ``.metadata``), then retire megatron-core's ``metadata.json`` of the checkpoint being replaced (it would
        otherwise outlive the old ``.metadata`` until this save's finalize step writes the new one), then, on
        megatron-core <= 0.18, write the ``common.pt`` the routing holds for this checkpoint
        (`S3Routing._save_common_state`). A failure here fails every rank's save at once, as DCP's planning does.
        With the memory tier, S3 is left alone (the drain replaces what is there, ``metadata.json`` first) and the
        routing sends megatron-core's files for this checkpoint into the tier once `finish` committed it there."""
        plans = super().prepare_global_plan(plans)
        active = _ROUTING.routing
        if self.memory_tier is not None:
            if active is not None:
                active._tier_saves[self.path] = self
            return plans
        config = _urls.join_s3_url(self.path, CONFIG_NAME)
        if self.s3.s3_path_exists(config):
            fence = _fencing.DirectoryFence(self.s3, _urls.s3_url_parent(self.path)) if self.fencing else None
            self.s3.remove_object(config, fence=fence)  # the directory is this run's: the plan just took it
            _s3.invalidate_fsspec_cache(self.path)
        if active is not None:
            active._write_common_state(self.path)
        return plans

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        """`s3_dcp.S3StorageWriter.finish`; with the memory tier, then the ``common.pt`` the routing holds (<= 0.18),
        into the tier after ``.metadata``."""
        super().finish(metadata=metadata, results=results)
        active = _ROUTING.routing
        if self.memory_tier is not None and active is not None:
            active._write_common_state(self.path)


_TIER_WRITERS_LOCK = threading.Lock()
_TIER_WRITERS: dict[Any, MegatronS3StorageWriter] = {}  # memory tier -> this process's last writer through it


def finish_drains(drain_last: bool = True) -> None:
    """Memory tier, every rank at the end of a run (after its last save returned; for an async save, after its
    finalize step): drain each tier's last checkpoint if it did not drain, so that the last checkpoint of a run that
    ends normally is on S3 (``metadata.json`` last), wait for this process's drains, and raise the first failure.
    Nothing to do without the memory tier."""
    with _TIER_WRITERS_LOCK:
        writers = list(_TIER_WRITERS.values())
    for writer in writers:
        writer.finish_drains(drain_last)


def _tier_routing(what: str) -> S3Routing:
    """The active routing, which must have a memory tier for `what`."""
    active = _ROUTING.routing
    if active is None or active.memory_tier is None:
        raise RuntimeError(f"s3_mcore.{what} needs the memory tier: call install_s3_routing(memory_tier=...) first")
    return active


def start_replication(group: Any = None, *, bind_host: str | None = None, local_rank: int | None = None) -> None:
    """Memory tier: send each checkpoint this node saves into memory (every file, megatron-core's ``metadata.json``
    and ``common.pt`` included) to the next node's, verified there (`s3_dcp_tier.start_replication` with the
    routing's tier). Collective: every rank of `group` (default: the default process group) once, after
    `install_s3_routing` with ``memory_tier`` and after the process group is up; the node's first rank (`local_rank`,
    default ``LOCAL_RANK``) serves the peer's replicas on `bind_host`, the node's address on the job's network
    (default: ``S3CKPT_REPLICA_HOST``, else this host's address on its route to ``MASTER_ADDR``)."""
    _dcp_tier().start_replication(_tier_routing("start_replication"), group, bind_host=bind_host, local_rank=local_rank)


def replicate_by_default(group: Any = None) -> None:
    """What NeMo 2.x's ``S3MegatronCheckpointIO`` does before each save and load with the memory tier, so that no
    extra call is needed: `s3_dcp_tier.replicate_by_default` with the routing's tier (`start_replication` once, where
    the process group spans several nodes). Collective. Package-internal (docs/api.md)."""
    _dcp_tier().replicate_by_default(_tier_routing("replicate_by_default"), group)


def _iteration_of(name: str) -> int | None:
    """The iteration of a Megatron-LM checkpoint directory name (``iter_0000100`` -> 100); None for other names."""
    digits = name.removeprefix("iter_")
    return int(digits) if digits != name and digits.isdigit() else None


def agree_resume(dirpath: str, step_of: Callable[[str], int | None] | None = None, *, group: Any = None) -> Any:
    """Memory tier, collective (every rank of `group`, after `install_s3_routing` with ``memory_tier``): the newest
    megatron-core checkpoint under the ``s3://`` `dirpath` (one per ``<dirpath>/<name>/``, `step_of(name)` its step,
    default Megatron-LM's ``iter_0000100``) that every rank can load whole from some tier: its node's memory, a
    replica held there or on another node, S3. A checkpoint counts only where every file is reachable,
    ``metadata.json`` included; on S3, only with its ``metadata.json``. Never older than the newest on S3. Returns
    the `s3_memory_tier.TierAgreement` (``step``, ``url``, ``tier``); ``dist_checkpointing.load(..., agreement.url)``
    then reads each file where agreed (a peer's replica fetched into this node's memory), megatron-core's own files
    too (`s3_dcp_tier.agree_resume` with megatron-core's files as ``followers``)."""
    active = _tier_routing("agree_resume")
    followers = _followers(active)
    return _dcp_tier().agree_resume(active, dirpath, step_of or _iteration_of, group=group, followers=followers)


def agree_to_load(url: str, group: Any = None) -> bool:
    """What NeMo 2.x's ``S3MegatronCheckpointIO`` does before each load with the memory tier:
    `s3_dcp_tier.agree_to_load` over the checkpoint at `url`, with the routing's tier and megatron-core's files as
    `agree_resume` counts them. Collective. Package-internal (docs/api.md)."""
    active = _tier_routing("agree_to_load")
    return _dcp_tier().agree_to_load(active, url, group=group, followers=_followers(active))


def _followers(active: S3Routing) -> tuple[str, ...]:
    """The files megatron-core writes after ``.metadata`` that a checkpoint must have to count (`agree_resume`)."""
    return (COMMON_STATE_NAME, CONFIG_NAME) if active.mechanism == "msc_module" else (CONFIG_NAME,)


_MEGATRON_ARGUMENTS = ("keep_only_main_replica", "thread_count", "cached_metadata", "separation_hint", "cpu_shm_mode")
"""megatron-core 0.19.2's ``TorchDistSaveShardedStrategy`` arguments after ``backend`` and ``version``."""
_WRITER_OPTIONS = frozenset(inspect.signature(_dcp.S3StorageWriter.__init__).parameters).difference(
    {"self", "path", "thread_count"}
)
"""The keyword arguments of `s3_dcp.S3StorageWriter` the strategy takes besides megatron-core's."""


CONNECTION_ARGUMENTS = frozenset(  # package-internal (docs/api.md)
    {"s3_utils", "client_settings", "endpoint_url", "region_name", "retry_policy", "request_options"}
    | {"max_requests_per_second"}
)
"""The writer's and reader's arguments that say how to reach S3 (`s3_utils.S3Utils.from_arguments`)."""


def _refuse_separation_hint(separation_hint: str | None, where: str) -> None:
    """ValueError for a ``separation_hint``: megatron-core's local writer puts the tensors whose key starts with it
    into separate files; the S3 writer splits each rank's items into ``thread_count`` objects by size alone."""
    if separation_hint is not None:
        raise ValueError(
            f"{where}: separation_hint={separation_hint!r} (megatron-core's local writer puts the tensors whose key "
            "starts with it into separate files) is not supported on S3, where each rank writes its items into "
            "thread_count objects split by size: leave it None"
        )


class _StagedItems:
    """What `s3_dcp.S3StorageWriter.write_data` asks a planner for, answered from host copies made before the upload
    started: the upload process (forked or persistent) needs neither the planner nor the live tensors."""

    def __init__(self, data: dict[Any, Any]) -> None:
        self.data = data

    def resolve_data(self, item: Any) -> Any:
        return self.data[item.index]


def _stage(plan: Any, planner: Any) -> _StagedItems:
    """Host copies of this rank's items (device tensors copied to CPU, CPU tensors cloned): training may change the
    live tensors while the upload runs. Objects are already serialised by the planner."""
    torch = _process.import_optional_dependency("torch", "megatron-core checkpoints")
    from torch.distributed.checkpoint.planner import WriteItemType

    staged: dict[Any, Any] = {}
    with torch.no_grad():
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                staged[item.index] = io.BytesIO(data.getbuffer().tobytes())
            else:
                tensor = data.detach()
                staged[item.index] = tensor.clone() if tensor.device.type == "cpu" else tensor.to("cpu")
    return _StagedItems(staged)


def _upload_in_background(writer: Any, plan: Any, staged: _StagedItems, result_path: str) -> None:
    """megatron-core's ``async_fn``: runs in its upload process (forked, or its persistent worker). Uploads this
    rank's files and leaves the outcome in `result_path` for the finalize step; never raises (an exception in that
    process would only be printed)."""
    try:
        writer = pickle.loads(pickle.dumps(writer))  # a fresh client in this process, no sockets shared with training
        future = writer.write_data(plan, staged)
        future.wait()
        outcome: tuple[str, Any] = ("ok", future.value())
    except BaseException as exc:  # reported to every rank by the finalize step
        outcome = ("error", exc)
    try:
        body = pickle.dumps(outcome)
    except Exception:  # an exception that does not pickle: keep its text
        detail = "".join(traceback.format_exception(outcome[1])) if outcome[0] == "error" else "unpicklable results"
        body = pickle.dumps(("error", _dcp.CheckpointWriteError(f"{writer.path}: the upload failed: {detail}")))
    partial = result_path + ".partial"
    with open(partial, "wb") as file:
        file.write(body)
    os.replace(partial, result_path)


def _read_outcome(result_path: str, url: str) -> list[Any]:
    try:
        with open(result_path, "rb") as file:
            status, value = pickle.load(file)
    except FileNotFoundError:
        raise _dcp.CheckpointWriteError(
            f"The upload process of {url} ended without reporting (killed?); nothing was committed. Save again."
        ) from None
    if status != "ok":
        raise value
    return value


@dataclass
class _PlannedSave:
    """A save after planning: every rank's plan is fixed and the coordinator holds the checkpoint's metadata."""

    url: str
    writer: Any
    planner: Any
    plan: Any
    metadata: Any
    dist: Any


def _plan_save(strategy: Any, sharded_state_dict: Any, writer: MegatronS3StorageWriter) -> _PlannedSave:
    """megatron-core's conversion of the sharded state (as `strategy`, any ``TorchDistSaveShardedStrategy``, does it)
    and DCP's planning step, as ``dcp.save`` runs it, without writing: every rank's local plan to the coordinator,
    which builds the global plan (and, in `MegatronS3StorageWriter.prepare_global_plan`, takes the directory over,
    retires a checkpoint being replaced and writes the ``common.pt`` of megatron-core <= 0.18). A failure there is
    raised on every rank as a ``CheckpointException``."""
    from torch.distributed.checkpoint.utils import _DistWrapper

    _refuse_separation_hint(getattr(strategy, "separation_hint", None), writer.path)
    torch_strategies = _torch_strategies()
    keep_only_main_replica = strategy.keep_only_main_replica
    sharded, _, _ = torch_strategies._replace_state_dict_keys_with_sharded_keys(
        sharded_state_dict, keep_only_main_replica
    )
    pyt_state_dict = torch_strategies.mcore_to_pyt_state_dict(sharded, False)
    planner = _save_planner(keep_only_main_replica)
    dist = _DistWrapper(None, True, 0)
    metadata: list[Any] = [None]

    def local_step() -> Any:
        planner.set_up_planner(
            state_dict=pyt_state_dict, storage_meta=writer.storage_meta(), is_coordinator=dist.is_coordinator
        )
        writer.set_up_storage_writer(dist.is_coordinator, rank=dist.rank, use_collectives=True)
        return writer.prepare_local_plan(planner.create_local_plan())

    def global_step(all_plans: list[Any]) -> list[Any]:
        all_plans, metadata[0] = planner.create_global_plan(all_plans)
        return writer.prepare_global_plan(all_plans)

    central = dist.reduce_scatter("plan", local_step, global_step)
    return _PlannedSave(writer.path, writer, planner, planner.finish_plan(central), metadata[0], dist)


def _commit(save: _PlannedSave, write_results: Callable[[], list[Any]]) -> None:
    """Gather every rank's write results (or its failure) on the coordinator, which commits with ``.metadata`` only if
    none failed; a failure anywhere is raised on every rank as a ``CheckpointException``."""

    def finish(all_results: list[list[Any]]) -> None:
        save.writer.finish(metadata=save.metadata, results=all_results)

    save.dist.all_reduce("write", write_results, finish)


def _save_to_s3(strategy: Any, sharded_state_dict: Any, writer: MegatronS3StorageWriter) -> None:
    """A sync save of `sharded_state_dict` by `strategy` (any ``TorchDistSaveShardedStrategy``: its
    ``keep_only_main_replica`` decides who writes a replicated tensor) to the checkpoint `writer` writes. Collective:
    every rank calls it; a failure on any rank raises on every rank, with nothing committed."""
    save = _plan_save(strategy, sharded_state_dict, writer)

    def write() -> list[Any]:
        future = save.writer.write_data(save.plan, save.planner)
        future.wait()
        return future.value()

    _commit(save, write)


def _async_save_to_s3(strategy: Any, sharded_state_dict: Any, writer: MegatronS3StorageWriter) -> Any:
    """`_save_to_s3` as megatron-core's ``AsyncRequest``: host copies of this rank's shards are taken now, the upload
    runs in megatron-core's upload process, and the commit happens in the request's finalize step.

    With the memory tier the save is the copy into memory, made here (training waits for it, as for any tier
    save) and committed in the tier; the drains run on this process's threads, which outlive megatron-core's upload
    process (a fork that ends with its request). The request has nothing left to run: megatron-core's finalize step
    writes ``metadata.json`` (into the tier too)."""
    if writer.memory_tier is not None:
        _save_to_s3(strategy, sharded_state_dict, writer)
        return _async_utils().AsyncRequest(async_fn=None, async_fn_args=(), finalize_fns=[])
    save = _plan_save(strategy, sharded_state_dict, writer)
    staged = _stage(save.plan, save.planner)
    result_dir = tempfile.mkdtemp(prefix="s3ckpt-mcore-")
    result_path = os.path.join(result_dir, "outcome.pickle")

    def finalize() -> None:
        try:
            _commit(save, lambda: _read_outcome(result_path, save.url))
        finally:
            shutil.rmtree(result_dir, ignore_errors=True)

    return _async_utils().AsyncRequest(
        async_fn=_upload_in_background,
        async_fn_args=(save.writer, save.plan, staged, result_path),
        finalize_fns=[finalize],
    )


def _save_planner(keep_only_main_replica: bool) -> Any:
    """megatron-core's save planner, with the keyword arguments this version knows (0.19 added the flatten ones)."""
    planner_class = _torch_strategies().MCoreSavePlanner
    wanted = {
        "dedup_replicated_tensors": not keep_only_main_replica,
        "can_run_decentralized_global_plan": False,
        "flatten_state_dict": False,
        "flatten_sharded_tensors": False,
    }
    accepted = set(inspect.signature(planner_class.__init__).parameters)
    takes_any = "kwargs" in accepted
    return planner_class(**{k: v for k, v in wanted.items() if k in accepted or takes_any})


class S3SaveShardedStrategyMixin:
    """Makes megatron-core's ``TorchDistSaveShardedStrategy`` (or a subclass of it) write ``s3://`` checkpoints
    through `s3_dcp`: `S3TorchDistSaveShardedStrategy` is this mixin on megatron-core's class.

    For an ``s3://`` directory (or a Path made from one) the state goes through megatron-core's own conversion and
    save planner, then `MegatronS3StorageWriter` uploads every rank's files and the coordinator commits with
    ``.metadata``; megatron-core's ``metadata.json`` follows in its finalize step. Any other directory goes to
    megatron-core's writer unchanged. `install_s3_routing` must be active (megatron-core lists the directory and
    writes ``metadata.json`` itself). Works inside ``FullyParallelSaveStrategyWrapper``.

    Args (megatron-core's ``TorchDistSaveShardedStrategy``'s, with its defaults, then the writer's):
        backend, version: written to ``metadata.json``, as megatron-core does.
        keep_only_main_replica: True (megatron-core's default): the rank holding a replicated tensor's main replica
            (``replica_id`` 0) writes it; False leaves the choice to DCP's deduplication.
        thread_count: files each rank writes, uploaded concurrently.
        cached_metadata: accepted; every save is planned afresh all the same (the planning step is where the
            checkpoint being replaced is retired and the directory's fence checked), with the same result.
        separation_hint: refused unless None: each rank's items go into `thread_count` objects split by size.
        cpu_shm_mode: accepted; an async save always takes host copies in the training process before the upload
            process gets them, which is what it asks for.
        **writer_options: keyword arguments for `s3_dcp.S3StorageWriter` (``client_settings``, ``retry_policy``,
            ``chunk_size_MB``, ``max_write_concurrency``, ``fencing``, ``overwrite``, ``max_requests_per_second``,
            ``request_options``, ``memory_tier``, ...). A bad one fails here, not in the middle of a save. Without
            ``memory_tier``, the routing's (`install_s3_routing`) applies; ``memory_tier=False`` turns it off here.

    ``async_save`` returns megatron-core's ``AsyncRequest``: host copies of the shards are taken at once, the upload
    runs in megatron-core's upload process, and the commit happens in the request's finalize step
    (``AsyncCallsQueue.maybe_finalize_async_calls``) on every rank. Its ``async_strategy`` argument
    (``"nvrx"``/``"mcore"``) is accepted and ignored: the upload is this package's either way.
    """

    keep_only_main_replica: bool
    thread_count: int

    def __init__(
        self,
        backend: str = "torch_dist",
        version: int = 1,
        keep_only_main_replica: bool = True,
        thread_count: int = 1,
        cached_metadata: bool = False,
        separation_hint: str | None = None,
        cpu_shm_mode: bool = False,
        **writer_options: Any,
    ) -> None:
        name = type(self).__name__
        unknown = sorted(set(writer_options) - _WRITER_OPTIONS)
        if unknown:
            megatron = ", ".join(("backend", "version", *_MEGATRON_ARGUMENTS))
            writer = ", ".join(sorted(_WRITER_OPTIONS))
            raise TypeError(
                f"{name} got an unexpected keyword argument {unknown[0]!r}: it takes megatron-core's ({megatron}) "
                f"and S3StorageWriter's ({writer})"
            )
        _refuse_separation_hint(separation_hint, name)
        given = {
            "keep_only_main_replica": keep_only_main_replica,
            "thread_count": thread_count,
            "cached_metadata": cached_metadata,
            "separation_hint": separation_hint,
            "cpu_shm_mode": cpu_shm_mode,
        }
        accepted = inspect.signature(super().__init__).parameters  # megatron-core <= 0.18 lacks some
        super().__init__(backend, version, **{k: v for k, v in given.items() if k in accepted})  # type: ignore[call-arg]
        self.keep_only_main_replica, self.thread_count = keep_only_main_replica, thread_count
        self.use_cached_ckpt_structure = cached_metadata  # megatron-core's attribute for it
        self.separation_hint, self.cpu_shm_mode = separation_hint, cpu_shm_mode
        self.writer_options = writer_options
        self.s3_writer("s3://validate/options")  # a bad option fails when the strategy is built

    def s3_writer(self, url: str) -> MegatronS3StorageWriter:
        """The writer of one save to `url`, with this strategy's options and its current ``thread_count`` (Megatron-LM
        and NeMo set that attribute after building the strategy)."""
        options = {**self.writer_options, "thread_count": self.thread_count}
        active = _ROUTING.routing
        if "memory_tier" not in options and active is not None and active.memory_tier is not None:
            options["memory_tier"] = active.memory_tier  # the routing's, unless this strategy names its own
        return MegatronS3StorageWriter(url, **options)

    def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
        url = megatron_s3_url(checkpoint_dir)
        if url is None:
            return super().save(sharded_state_dict, checkpoint_dir)  # type: ignore[misc]
        return _save_to_s3(self, sharded_state_dict, self.s3_writer(url))

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        url = megatron_s3_url(checkpoint_dir)
        if url is None:
            return super().async_save(sharded_state_dict, checkpoint_dir, *args, **kwargs)  # type: ignore[misc]
        return _async_save_to_s3(self, sharded_state_dict, self.s3_writer(url))

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True


@functools.cache
def _strategy_class() -> type:
    """`S3SaveShardedStrategyMixin` on megatron-core's ``TorchDistSaveShardedStrategy``."""
    base = _torch_strategies().TorchDistSaveShardedStrategy
    namespace = {
        "__module__": __name__,
        "__qualname__": "S3TorchDistSaveShardedStrategy",
        "__doc__": S3SaveShardedStrategyMixin.__doc__,
    }
    return type("S3TorchDistSaveShardedStrategy", (S3SaveShardedStrategyMixin, base), namespace)


# --------------------------------------------------------------------------------------------------------------------
# Routing megatron-core's own file operations (metadata.json, directory checks, common state, the reader)
# --------------------------------------------------------------------------------------------------------------------


class _S3File(io.BytesIO):
    """An object written by megatron-core (``metadata.json``, ``common.pt``): buffered, uploaded whole on close."""

    def __init__(self, s3: _s3.S3Utils, url: str, fence: _fencing.DirectoryFence | None = None) -> None:
        super().__init__()
        self.s3 = s3
        self.url = url
        self.fence = fence

    def close(self) -> None:
        if not self.closed:
            body = self.getvalue()
            size_mb = max(_s3.DEFAULT_CHUNK_SIZE_MB, len(body) / _s3.MB + 1)
            with self.s3.open_writer(self.url, size_mb, 1, fence=self.fence) as out:
                out.write(body)
            _s3.invalidate_fsspec_cache(self.url)
        super().close()

    def discard(self) -> None:
        """Close without uploading: what was written is incomplete."""
        super().close()

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:  # the writer failed mid-way (a torch.save or json.dump that raised)
            self.discard()
        else:
            self.close()


class _FollowerFile(_S3File):
    """An object megatron-core writes beside a checkpoint saved into the memory tier (``metadata.json``;
    ``common.pt`` on <= 0.18): buffered, committed on close in the node's tier after the checkpoint's ``.metadata``,
    and drained to S3 after it (`s3_dcp_tier.DcpTier.follow_commit`)."""

    def __init__(self, writer: MegatronS3StorageWriter, url: str) -> None:
        super().__init__(writer.s3, url)
        self.writer = writer

    def close(self) -> None:
        if not self.closed:
            writer = self.writer
            tier = _dcp_tier().tier_of(writer.memory_tier, writer.s3, writer.checksum_algorithm)
            tier.follow_commit(self.url, writer.path, _dcp.METADATA_NAME, self.getvalue(), writer)
        io.BytesIO.close(self)


class _S3TextFile(io.TextIOWrapper):
    """`_S3File` in a text mode (UTF-8): also uploads nothing when its ``with`` block raises."""

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self.buffer.discard()
        else:
            self.close()


class _S3Path:
    """What megatron-core asks of ``Path`` objects for an ``s3://`` directory: ``exists``, ``iterdir``, ``is_dir``,
    ``/``, ``name``; ``str()`` gives the ``s3://`` URL."""

    def __init__(self, routing: S3Routing, url: str) -> None:
        self._routing = routing
        self.url = url

    def __str__(self) -> str:
        return self.url

    def __fspath__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"S3Path({self.url!r})"

    def __truediv__(self, name: str) -> _S3Path:
        return _S3Path(self._routing, _urls.join_s3_url(self.url, str(name)))

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    def exists(self) -> bool:
        return self.is_file() or self._routing.is_dir(self.url)

    def is_dir(self) -> bool:
        return self._routing.is_dir(self.url) and not self.is_file()

    def is_file(self) -> bool:
        return self._routing.exists(self.url)

    def iterdir(self) -> Iterator[_S3Path]:
        """The entries right under this prefix (objects and sub-prefixes), as a directory listing shows them."""
        prefix = self.url.rstrip("/") + "/"
        names = {info.url[len(prefix) :].split("/", 1)[0] for info in self._routing.s3.list_objects(self.url)}
        return iter([self / name for name in sorted(names)])

    def mkdir(self, *args: Any, **kwargs: Any) -> None:
        """S3 has no directories: nothing to create."""


class _Router:
    """One of megatron-core's ``open`` / ``os`` / ``Path`` / ``torch`` entry points: ``s3://`` paths to this package,
    anything else to what megatron-core would have used without the routing (`fallback`)."""

    def __init__(self, routing: S3Routing, fallback: Any) -> None:
        self._routing = routing
        self._fallback = fallback

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fallback, name)


class _RoutedOpen(_Router):
    def __call__(self, path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        url = megatron_s3_url(path)
        if url is None:
            return self._fallback(path, mode, *args, **kwargs)
        return self._routing.open(url, mode)


class _RoutedPath(_Router):
    def __call__(self, path: Any, *args: Any) -> Any:
        url = megatron_s3_url(path)
        return self._fallback(path, *args) if url is None else _S3Path(self._routing, url)


class _RoutedOsPath(_Router):
    def exists(self, path: Any) -> bool:
        url = megatron_s3_url(path)
        return self._fallback.exists(path) if url is None else self._routing.exists(url)

    def isdir(self, path: Any, *args: Any, **kwargs: Any) -> bool:
        url = megatron_s3_url(path)
        if url is None:
            if self._fallback is os.path:
                return os.path.isdir(path)  # the stdlib takes no `strict` (multi-storage-client's does)
            return self._fallback.isdir(path, *args, **kwargs)
        return self._routing.is_dir(url)


class _RoutedOs(_Router):
    @property
    def path(self) -> _RoutedOsPath:
        return _RoutedOsPath(self._routing, self._fallback.path)

    def makedirs(self, path: Any, *args: Any, **kwargs: Any) -> None:
        if megatron_s3_url(path) is None:
            self._fallback.makedirs(path, *args, **kwargs)


class _RoutedTorch(_Router):
    def save(self, obj: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        url = megatron_s3_url(path)
        if url is None:
            return self._fallback.save(obj, path, *args, **kwargs)
        if _urls.s3_url_name(url) == COMMON_STATE_NAME:
            return self._routing._save_common_state(obj, url, *args, **kwargs)
        with self._routing.open(url, "wb") as file:
            _process.import_optional_dependency("torch").save(obj, file, *args, **kwargs)
        return None

    def load(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        url = megatron_s3_url(path)
        if url is None:
            return self._fallback.load(path, *args, **kwargs)
        with self._routing.open(url, "rb") as file:
            return _process.import_optional_dependency("torch").load(file, *args, **kwargs)

    def MultiStorageFileSystemReader(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        url = megatron_s3_url(path)
        if url is not None:
            return self._routing.reader(url)
        if getattr(self._fallback, "MultiStorageFileSystemReader", None) is not None:
            return self._fallback.MultiStorageFileSystemReader(path, *args, **kwargs)
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(path)


class _StdlibFiles:
    """megatron-core's file operations without multi-storage-client: the builtins it falls back to."""

    open = staticmethod(open)
    os = os
    Path = pathlib.Path

    @property
    def torch(self) -> Any:
        return _process.import_optional_dependency("torch")


class _S3Facade:
    """What megatron-core <= 0.18 takes as ``msc_utils.msc`` (multi-storage-client's module) once the routing is
    installed: ``open``, ``os``, ``Path``, ``torch``; paths that are not ``s3://`` go to `fallback` (the real
    multi-storage-client when it was installed and enabled, else the stdlib)."""

    def __init__(self, routing: S3Routing, fallback: Any) -> None:
        self._fallback = fallback
        self.open = _RoutedOpen(routing, fallback.open)
        self.os = _RoutedOs(routing, fallback.os)
        self.Path = _RoutedPath(routing, fallback.Path)
        self.torch = _RoutedTorch(routing, fallback.torch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fallback, name)


@dataclass
class _HeldCommonState:
    """A ``torch.save`` of megatron-core's common state (<= 0.18) waiting for its save's plan: what, where, how."""

    url: str
    obj: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class S3Routing:
    """The routing `install_s3_routing` put in place; `uninstall` restores what was there.

    Attributes:
        s3: the `s3_utils.S3Utils` megatron-core's own small files (``metadata.json``, ``common.pt``) and listings go
            through.
        reader_options: keyword arguments for the `s3_dcp.S3StorageReader` that loads use.
    """

    s3: _s3.S3Utils
    reader_options: dict[str, Any] = field(default_factory=dict)
    fencing: bool = True
    """megatron-core's own writes (``metadata.json``; ``common.pt`` before 0.19) are fenced as the checkpoint's
    files: refused with `s3_fencing.CheckpointDirectoryTakenError` once a newer run owns the directory holding it."""
    mechanism: str = ""
    """``"maybe_msc"`` (megatron-core >= 0.19: its ``maybe_msc`` object is taught ``s3://``) or ``"msc_module"``
    (<= 0.18: a stand-in for multi-storage-client's module, with megatron-core's MSC flag on)."""
    previous_flag: bool | None = None
    memory_tier: Any = None
    """An `s3_memory_tier.MemoryTier` (None: off): loads read each file from this node's verified memory copy first
    (megatron-core's ``metadata.json`` and common state too), and saves go into it (megatron-core's own strategy,
    and `S3TorchDistSaveShardedStrategy` unless it names its own). docs/tiers.md."""
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _held_common_state: _HeldCommonState | None = field(default=None, repr=False)
    _tier_saves: dict[str, MegatronS3StorageWriter] = field(default_factory=dict, repr=False)
    """Checkpoints saved into the memory tier whose megatron-core files (``metadata.json`` last) are still to come."""
    _checked_configs: dict[str, tuple[float, Any]] = field(default_factory=dict, repr=False)
    """``metadata.json`` bytes read by `exists` (megatron-core opens it right after): `open`'s, once, within
    `_CONFIG_READ_AT_CHECK_S`."""

    def _save_common_state(self, obj: Any, url: str, *args: Any, **kwargs: Any) -> None:
        """megatron-core <= 0.18's ``common.pt``, which rank 0 alone saves right before every rank enters the save
        strategy: held here, and written by `MegatronS3StorageWriter.prepare_global_plan` on the coordinator (rank 0,
        this process) once the directory is this run's and a checkpoint being replaced has been retired, or refused
        (``overwrite=False``). Written at once, it would replace the common state of a complete checkpoint before
        anything else: a crash or a refusal then would leave the old ``.metadata`` beside the new ``common.pt``, and
        a failure raised on rank 0 alone would leave the other ranks waiting in the save's first collective."""
        if self._held_common_state is not None:
            logger.warning(
                "%s was never written: no save through S3TorchDistSaveShardedStrategy followed it",
                self._held_common_state.url,
            )
        self._held_common_state = _HeldCommonState(url, obj, args, kwargs)

    def _write_common_state(self, checkpoint: str) -> None:
        """Write the ``common.pt`` held for the checkpoint at the URL `checkpoint`, if one is (fenced, as every file
        megatron-core writes); a failure raises `s3_dcp.CheckpointWriteError` (or the fence's refusal)."""
        held = self._held_common_state
        if held is None or _urls.s3_url_parent(held.url) != checkpoint:
            return
        self._held_common_state = None
        try:
            with self.open(held.url, "wb") as file:
                _process.import_optional_dependency("torch").save(held.obj, file, *held.args, **held.kwargs)
        except _fencing.CheckpointDirectoryTakenError:
            raise  # names the URL already
        except Exception as exc:
            message = f"{held.url}: megatron-core's common state could not be written: {exc!r}"
            raise _dcp.CheckpointWriteError(message) from exc

    def open(self, url: str, mode: str = "r") -> Any:
        """Read (whole, verified; from this node's memory tier first) or write (uploaded on close; for a checkpoint
        saved into the memory tier, committed there after its ``.metadata``) one object; text modes decode UTF-8."""
        if any(flag in mode for flag in "wax"):
            self._checked_configs.pop(url, None)  # a later read is of what this writes
            checkpoint = _urls.s3_url_parent(url)  # megatron-core writes its files at the checkpoint's top level
            tier_save = self._tier_saves.get(checkpoint)
            if tier_save is not None:
                if _urls.s3_url_name(url) == CONFIG_NAME:  # megatron-core's last file of a save
                    del self._tier_saves[checkpoint]
                file: Any = _FollowerFile(tier_save, url)
            else:
                fence = _fencing.DirectoryFence(self.s3, _urls.s3_url_parent(checkpoint)) if self.fencing else None
                file = _S3File(self.s3, url, fence)
            return file if "b" in mode else _S3TextFile(file, encoding="utf-8")
        local = self._tier_source(url)
        checked = self._checked_configs.pop(url, None)
        if local is not None:
            data: Any = local[0].read_bytes()
        elif checked is not None and time.monotonic() - checked[0] < _CONFIG_READ_AT_CHECK_S:
            data = checked[1]  # read by the existence check just before
        else:
            data = _dcp.read_record(self.s3, url)  # metadata.json, common.pt: one GET where its checksum is recorded
        return io.BytesIO(data) if "b" in mode else io.StringIO(bytes(data).decode("utf-8"))

    def exists(self, url: str) -> bool:
        """Whether the object `url` is in this node's memory tier or on S3. megatron-core checks ``metadata.json``
        and then reads it, on every rank: that check reads it (one GET where a HEAD would go, the next `open` none)."""
        if self._tier_copy(url):
            return True
        if _urls.s3_url_name(url) != CONFIG_NAME:
            return self.s3.s3_path_exists(url)
        try:
            self._checked_configs[url] = (time.monotonic(), _dcp.read_record(self.s3, url))
        except FileNotFoundError:
            return False
        return True

    def is_dir(self, url: str) -> bool:
        """Whether `url` is a checkpoint in this node's memory tier (its ``.metadata`` or ``metadata.json``) or a
        prefix on S3."""
        in_tier = any(self._tier_copy(_urls.join_s3_url(url, name)) for name in (_dcp.METADATA_NAME, CONFIG_NAME))
        if in_tier:
            return True
        load, prefix = _dcp.current_load(), url.rstrip("/") + "/"
        if load is not None and prefix in load.directories:
            return load.directories[prefix]  # megatron-core checks its checkpoint twice in one load
        found = self.s3.s3_path_exists(prefix, match_directory=True)  # a listing, no HEAD
        if load is not None:
            load.directories[prefix] = found
        return found

    def remove_from_tier(self, url: str) -> None:
        """Drop this node's memory copies of the checkpoint at `url` (and below it): a drain still due skips them."""
        tier = self._node_tier()
        if tier is not None:
            _dcp_tier().drop_checkpoint(tier, url)

    def _node_tier(self) -> Any:
        return None if self.memory_tier is None else _dcp_tier().tier_of(self.memory_tier, self.s3)

    def _tier_copy(self, url: str) -> bool:
        """Whether this node's tier has `url`, or the ranks agreed where this rank reads it (`agree_resume`)."""
        tier = self._node_tier()
        return tier is not None and _dcp_tier().holds(tier, url)

    def _tier_source(self, url: str) -> Any:
        """``(path, tier)`` of where the ranks agreed this rank reads `url` (a replica fetched if need be), else of
        this node's verified copy (or a replica held here); None: S3."""
        tier = self._node_tier()
        return None if tier is None or not self._tier_copy(url) else _dcp_tier().source_of(tier, url)

    def reader(self, url: str) -> Any:
        """The DCP reader for an ``s3://`` checkpoint (megatron-core's filesystem reader, routed): through this
        routing's `s3` unless `reader_options` say how to reach S3 themselves; with the memory tier, it reads each
        file from this node's verified memory copy first."""
        connection = {"s3_utils": self.s3} if not CONNECTION_ARGUMENTS & set(self.reader_options) else {}
        tier = {} if self.memory_tier is None else {"memory_tier": self.memory_tier}
        return _dcp.S3StorageReader(url, **connection, **{**tier, **self.reader_options})

    def writer(self, url: str, thread_count: int = 1) -> MegatronS3StorageWriter:
        """The writer of a save that megatron-core's own strategy makes to an ``s3://`` checkpoint (its default among
        them): this routing's `s3`, `fencing` and `memory_tier`, the strategy's ``thread_count``."""
        return MegatronS3StorageWriter(
            url, s3_utils=self.s3, thread_count=thread_count, fencing=self.fencing, memory_tier=self.memory_tier
        )

    def uninstall(self) -> None:
        """Put megatron-core's file operations back as they were before `install_s3_routing`."""
        with _ROUTING.lock:
            while self._undo:
                self._undo.pop()()
            if _ROUTING.routing is self:
                _ROUTING.routing = None


class _RoutingState:
    lock = threading.Lock()
    routing: S3Routing | None = None


_ROUTING = _RoutingState()


def routing() -> S3Routing | None:
    """The active `S3Routing`, or None."""
    return _ROUTING.routing


def install_s3_routing(
    s3_utils: _s3.S3Utils | None = None,
    *,
    reader_options: dict[str, Any] | None = None,
    fencing: bool = True,
    memory_tier: Any = None,
) -> S3Routing:
    """Route megatron-core's own file operations for ``s3://`` paths to this package, in this process.

    megatron-core lists the directory before a save, writes and reads ``metadata.json``, checks that a checkpoint
    directory exists, reads common state and opens its DCP reader through helpers in ``megatron.core.msc_utils`` and
    ``dist_checkpointing.strategies.torch``; after this call those take ``s3://`` URLs (and their collapsed
    ``s3:/`` Path forms), so ``dist_checkpointing.load``, ``load_tensors_metadata``, ``load_sharded_metadata``,
    ``load_common_state_dict`` and ``verify_checkpoint`` work on S3 with megatron-core's own load strategy and
    planner, reading through `s3_dcp.S3StorageReader`. Local and ``msc://`` paths, and a real multi-storage-client,
    are left as they were (megatron-core <= 0.18 has one switch for all paths; see docs/megatron.md).

    Idempotent: a second call returns the active routing with the new settings. Undo with `S3Routing.uninstall`.

    Args:
        s3_utils: how to reach S3 for ``metadata.json`` and listings (default: `s3_utils.S3Utils` from the
            environment, as the writer's and reader's defaults).
        reader_options: keyword arguments for `s3_dcp.S3StorageReader` (``client_settings``, ``retry_policy``,
            ``max_read_concurrency``, ``max_requests_per_second``, ...).
        fencing: fence megatron-core's own writes as the writer fences the checkpoint's files (`S3Routing.fencing`;
            pass the same as the strategy's ``fencing`` option).
        memory_tier: the node's memory tier (`s3_memory_tier.MemoryTier`, a mapping of its fields, a path or True;
            `S3Routing.memory_tier`): saves land there with S3 behind, loads read it first; every rank calls
            `finish_drains` at the end of the run (docs/tiers.md).
    """
    tier = _dcp_tier().config(memory_tier) if memory_tier is not None and memory_tier is not False else None
    msc_utils = _msc_utils()
    torch_strategies = _torch_strategies()
    with _ROUTING.lock:
        active = _ROUTING.routing
        if active is not None:
            active.s3 = s3_utils or active.s3
            active.reader_options = dict(reader_options or {})
            active.fencing = fencing
            active.memory_tier = tier
            return active
        routing_ = S3Routing(s3_utils or _s3.S3Utils(), dict(reader_options or {}), fencing, memory_tier=tier)
        _route_filesystem_reader(routing_, torch_strategies)
        _route_load(routing_)
        maybe = getattr(msc_utils, "maybe_msc", None)
        if maybe is not None:
            _route_maybe_msc(routing_, maybe)
        else:
            _route_msc_module(routing_, msc_utils)
        _route_stock_strategy(routing_, torch_strategies)
        _ROUTING.routing = routing_
        logger.info("megatron-core's file operations for s3:// go through s3-checkpoint-io (%s)", routing_.mechanism)
        return routing_


def _route_load(routing_: S3Routing) -> None:
    """``dist_checkpointing.load`` of an ``s3://`` checkpoint runs in `s3_dcp.one_load`: megatron-core checks the
    directory and reads ``metadata.json`` twice, and opens two DCP readers (the common state's, the tensors'), each
    reading ``.metadata`` and the item record; within one load each of these is one request per rank."""
    serialization = _mcore("dist_checkpointing.serialization")
    original = serialization.load

    @functools.wraps(original)
    def load(sharded_state_dict: Any, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        if megatron_s3_url(checkpoint_dir) is None:
            return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        with _dcp.one_load():
            return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)

    for module in (serialization, _mcore("dist_checkpointing")):
        if getattr(module, "load", None) is original:
            _patch(routing_, module, "load", load)


def _route_filesystem_reader(routing_: S3Routing, torch_strategies: Any) -> None:
    """megatron-core's loads take their DCP reader from ``strategies.torch._get_filesystem_reader`` (imported by name
    into ``serialization`` in 0.19): an ``s3://`` directory gets `s3_dcp.S3StorageReader`."""
    original = torch_strategies._get_filesystem_reader

    @functools.wraps(original)
    def get_reader(checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        url = megatron_s3_url(checkpoint_dir)
        return original(checkpoint_dir, *args, **kwargs) if url is None else routing_.reader(url)

    for module in (torch_strategies, _mcore("dist_checkpointing.serialization")):
        if getattr(module, "_get_filesystem_reader", None) is original:
            module._get_filesystem_reader = get_reader
            routing_._undo.append(functools.partial(setattr, module, "_get_filesystem_reader", original))


class _RoutedMaybeMsc:
    """Put in front of the class of megatron-core's ``maybe_msc`` (>= 0.19) by `_route_maybe_msc`: its ``open`` /
    ``os`` / ``Path`` / ``torch`` answers get `_Router`s for ``s3://`` paths, and ``path_isdir`` answers them."""

    _s3_routing: S3Routing
    _ROUTERS: ClassVar[dict[str, type[_Router]]] = {
        "open": _RoutedOpen, "os": _RoutedOs, "Path": _RoutedPath, "torch": _RoutedTorch
    }

    def __getattr__(self, name: str) -> Any:
        answer = super().__getattr__(name)  # type: ignore[misc]
        router = self._ROUTERS.get(name)
        return answer if router is None else router(self._s3_routing, answer)

    def path_isdir(self, path: Any, strict: bool = True) -> bool:
        url = megatron_s3_url(path)
        if url is None:
            return super().path_isdir(path, strict=strict)  # type: ignore[misc]
        return self._s3_routing.is_dir(url)


def _route_maybe_msc(routing_: S3Routing, maybe: Any) -> None:
    """megatron-core >= 0.19 sends every file operation outside its writer through one ``maybe_msc`` object, whose
    class answers ``open``/``os``/``Path``/``torch`` (multi-storage-client's when enabled, else the builtins). Its
    class is swapped for `_RoutedMaybeMsc` on that class; the MSC flag is not touched."""
    original_class = type(maybe)
    namespace = {"__module__": __name__, "_s3_routing": routing_}
    maybe.__class__ = type("S3RoutedMaybeMultiStorageClient", (_RoutedMaybeMsc, original_class), namespace)
    routing_.mechanism = "maybe_msc"
    routing_._undo.append(lambda: setattr(maybe, "__class__", original_class))


def _route_msc_module(routing_: S3Routing, msc_utils: Any) -> None:
    """megatron-core <= 0.18 asks ``MultiStorageClientFeature.is_enabled()`` at every file operation and then uses the
    module ``msc_utils.msc``: that module is replaced by `_S3Facade` and the flag switched on. What was there (a real
    multi-storage-client, enabled or not) answers every path that is not ``s3://``. megatron-core's own writer reads
    the flag too (and then imports multi-storage-client itself): `_route_stock_strategy` lets it see the flag as it
    was for any directory that is not ``s3://``."""
    flag = msc_utils.MultiStorageClientFeature
    previous_module = msc_utils.msc
    previous_flag = flag.is_enabled()  # False without a real multi-storage-client
    fallback = previous_module if previous_flag else _StdlibFiles()
    msc_utils.msc = _S3Facade(routing_, fallback)
    flag.enable()
    routing_.mechanism = "msc_module"
    routing_.previous_flag = previous_flag

    def undo() -> None:
        msc_utils.msc = previous_module
        if not previous_flag:
            flag.disable()

    routing_._undo.append(undo)


@contextlib.contextmanager
def _msc_flag_as_before(active: S3Routing) -> Iterator[None]:
    """megatron-core's MSC flag as the user left it, while its writer is built for a local directory (<= 0.18, see
    `_route_msc_module`); nothing to do on >= 0.19, whose flag the routing leaves alone."""
    if active.mechanism != "msc_module":
        yield
        return
    flag = _msc_utils().MultiStorageClientFeature
    if not active.previous_flag:
        flag.disable()
    try:
        yield
    finally:
        flag.enable()


def _patch(routing_: S3Routing, owner: Any, name: str, replacement: Any) -> None:
    """Set ``owner.name``, and have `S3Routing.uninstall` put back exactly what was there (or nothing)."""
    had_own = name in vars(owner)
    original = vars(owner).get(name)
    setattr(owner, name, replacement)
    routing_._undo.append(
        functools.partial(setattr, owner, name, original) if had_own else functools.partial(delattr, owner, name)
    )


def _route_stock_strategy(routing_: S3Routing, torch_strategies: Any) -> None:
    """megatron-core's own ``TorchDistSaveShardedStrategy`` for an ``s3://`` directory: what ``dist_checkpointing.save``
    uses when it is given no strategy, ``('torch_dist', 1)`` or any strategy it does not know, and what Megatron-LM and
    NeMo build. Its writer would write into a local ``s3:/bucket/...`` directory while only ``metadata.json`` reached
    S3; with the routing its ``save`` and ``async_save`` go to S3 through `_save_to_s3` / `_async_save_to_s3` (its own
    ``keep_only_main_replica`` and ``thread_count``, `S3Routing.writer`), and as the last guard megatron-core's local
    writer refuses an ``s3://`` checkpoint (a subclass with its own ``async_save`` would reach it)."""
    base = torch_strategies.TorchDistSaveShardedStrategy
    original_save, original_async_save = base.save, base.async_save

    @functools.wraps(original_save)
    def save(self: Any, sharded_state_dict: Any, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        url = megatron_s3_url(checkpoint_dir)
        if url is None:
            return original_save(self, sharded_state_dict, checkpoint_dir, *args, **kwargs)
        return _save_to_s3(self, sharded_state_dict, routing_.writer(url, self.thread_count))

    @functools.wraps(original_async_save)
    def async_save(self: Any, sharded_state_dict: Any, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        url = megatron_s3_url(checkpoint_dir)
        if url is None:
            with _msc_flag_as_before(routing_):
                return original_async_save(self, sharded_state_dict, checkpoint_dir, *args, **kwargs)
        return _async_save_to_s3(self, sharded_state_dict, routing_.writer(url, self.thread_count))

    _patch(routing_, base, "save", save)
    _patch(routing_, base, "async_save", async_save)
    local_writer = _mcore("dist_checkpointing.strategies.filesystem_async").FileSystemWriterAsync
    original_init = local_writer.__init__

    @functools.wraps(original_init)
    def refusing_init(self: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        url = megatron_s3_url(path)
        if url is not None:
            raise ValueError(
                f"{url}: megatron-core's local writer (FileSystemWriterAsync) was given this s3:// checkpoint and "
                f"would write it into the local directory {os.fspath(path)!r}. Save it with "
                "s3_mcore.S3TorchDistSaveShardedStrategy (or megatron-core's own strategy, which the routing sends to "
                "S3); a strategy of your own that builds the writer itself needs s3_mcore.S3SaveShardedStrategyMixin"
            )
        original_init(self, path, *args, **kwargs)

    _patch(routing_, local_writer, "__init__", refusing_init)


# --------------------------------------------------------------------------------------------------------------------
# Verifying a megatron-core checkpoint on S3
# --------------------------------------------------------------------------------------------------------------------


def verify_checkpoint(path: Any, s3_utils: _s3.S3Utils | None = None) -> _admin.CheckpointVerification:
    """`s3_checkpoint_admin.verify_checkpoint` for a megatron-core checkpoint (``s3://`` text or its collapsed
    Path): every file against its recorded checksums, plus megatron-core's ``metadata.json`` (present and naming a
    backend). Needs neither torch nor megatron-core."""
    url = megatron_s3_url(path)
    if url is None:
        raise ValueError(f"{path!r} is not an s3:// URL")
    s3 = s3_utils or _s3.S3Utils()
    report = _admin.verify_checkpoint(url, s3_utils=s3)
    config_url = _urls.join_s3_url(url, CONFIG_NAME)
    try:
        with s3.download_to_memory(config_url) as downloaded:
            config = json.loads(bytes(downloaded.read_all()))
        if not isinstance(config, dict) or "sharded_backend" not in config:
            report.problems.append(f"{config_url} is not megatron-core's checkpoint config: {config!r}")
    except FileNotFoundError:
        report.problems.append(
            f"{config_url} does not exist: the save did not finish its finalize step; megatron-core will not load it"
        )
    except (ValueError, _s3.ChecksumMismatchError) as exc:
        report.problems.append(f"{config_url} is unreadable or corrupt: {exc}")
    return report


# --------------------------------------------------------------------------------------------------------------------
# NeMo 2.x: MegatronCheckpointIO keeping s3:// URLs as text (the sibling s3_mcore_nemo)
# --------------------------------------------------------------------------------------------------------------------

_NEMO = "s3_mcore_nemo"


def _nemo() -> Any:
    return _process.require_sibling(_NEMO, __package__, "NeMo 2.x's checkpoint IO", "s3_mcore.py")


def megatron_checkpoint_io_class(base: type | None = None) -> type:
    """NeMo 2.x's ``MegatronCheckpointIO`` (or `base`) with ``s3://`` support: ``S3MegatronCheckpointIO``
    (`s3_mcore_nemo.megatron_checkpoint_io_class`, docs/megatron.md)."""
    return _nemo().megatron_checkpoint_io_class(base)


def nemo_checkpoint_url(path: Any) -> str | None:
    """The ``s3://`` URL of the NeMo 2.x checkpoint directory `path` names, without Lightning's ``.ckpt``
    (`s3_mcore_nemo.nemo_checkpoint_url`)."""
    return _nemo().nemo_checkpoint_url(path)


def megatron_core(module: str = "") -> Any:
    """``megatron.core`` or one of its submodules, imported on first use; ImportError naming the pip line.
    Package-internal (docs/api.md)."""
    return _mcore(module)


def save_strategy_class() -> type:
    """`S3TorchDistSaveShardedStrategy` (built on first use). Package-internal (docs/api.md)."""
    return _strategy_class()


# --------------------------------------------------------------------------------------------------------------------
# Lazily built public classes
# --------------------------------------------------------------------------------------------------------------------

S3TorchDistSaveShardedStrategy: type
"""megatron-core's ``TorchDistSaveShardedStrategy`` for ``s3://`` (built on first access; megatron-core needed)."""


def __getattr__(name: str) -> Any:
    """PEP 562: the classes whose base is megatron-core's or NeMo's are built on first access."""
    builders: dict[str, Callable[[], type]] = {
        "S3TorchDistSaveShardedStrategy": _strategy_class,
        "S3MegatronCheckpointIO": megatron_checkpoint_io_class,
    }
    if name in builders:
        return builders[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
