"""Multi-rank megatron-core scenarios for tests/test_mcore.py: ``python -m mcore_worker --world-size N ...``.

Spawns N ranks (gloo on CPU; ``--backend nccl --device cuda`` on a GPU machine) that run the scenarios in order on
one process group, each rank writing ``<out>/<scenario>-rank<r>.json`` with its outcome (``ok``, ``differences`` from
the expected values, and what the scenario observed). Checkpoints go under ``--base`` (an ``s3://`` prefix) through
``--endpoint`` (the test's fault proxy); ``--direct-endpoint`` is the server itself.

The state: a 1-D fp32 ShardedTensor split on dim 0, a 2-D bf16 one split on dim 1, a replicated tensor, one
ShardedObject per rank and common (non-sharded) state. Values depend on the world size that saved and a version
number, so any rank count can check what it loaded.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import mcore_tier_scenarios

warnings.filterwarnings("ignore")

SAVED_WORLD = 2  # the checkpoints the 1-rank run reshards were saved by 2 ranks


# ---- the state ------------------------------------------------------------------------------------------------------


def _values(world: int, version: int) -> dict[str, Any]:
    """The full (unsharded) values a save by `world` ranks holds."""
    import torch

    a = torch.cat([torch.arange(8, dtype=torch.float32) + 100 * r + 1000 * version for r in range(world)])
    w = torch.cat([torch.full((4, 3), float(r + version), dtype=torch.bfloat16) for r in range(world)], dim=1)
    w[0, 0] = 0.5  # a value bf16 holds exactly, not a constant block
    bias = torch.tensor([1.0, 2.0, 3.0]) * (version + 1)
    return {"a": a, "w": w, "bias": bias, "seeds": [7 + r + version for r in range(world)]}


def sharded_state(ctx: Context, version: int, empty: bool = False) -> dict[str, Any]:
    """This rank's sharded state dict for a save (or, `empty`, load targets) at the current world size."""
    import torch
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    full = _values(world, version)
    a = full["a"][8 * rank : 8 * (rank + 1)].clone()
    w = full["w"][:, 3 * rank : 3 * (rank + 1)].clone()
    bias = full["bias"].clone()
    if empty:
        a, w, bias = torch.zeros_like(a), torch.zeros_like(w), torch.zeros_like(bias)
    return {
        "layer": {
            "a": ShardedTensor.from_rank_offsets("layer.a", a.to(device), (0, rank, world)),
            "w": ShardedTensor.from_rank_offsets("layer.w", w.to(device), (1, rank, world)),
        },
        "bias": ShardedTensor.from_rank_offsets("bias", bias.to(device), replica_id=rank),
        "rng": ShardedObject("rng", None if empty else {"seed": full["seeds"][rank]}, (world,), (rank,), replica_id=0),
        "iteration": 40 + version,
        "note": "mcore",
    }


def reshard_targets(ctx: Context, saved_world: int) -> dict[str, Any]:
    """Load targets at this world size for a checkpoint `saved_world` ranks saved: whole tensors, every object."""
    import torch
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    device, replica = ctx.device, ctx.rank
    a = torch.zeros(8 * saved_world, device=device)
    w = torch.zeros(4, 3 * saved_world, dtype=torch.bfloat16, device=device)
    return {
        "layer": {
            "a": ShardedTensor.from_rank_offsets("layer.a", a, replica_id=replica),
            "w": ShardedTensor.from_rank_offsets("layer.w", w, replica_id=replica),
        },
        "bias": ShardedTensor.from_rank_offsets("bias", torch.zeros(3, device=device), replica_id=replica),
        **{f"rng{r}": ShardedObject("rng", None, (saved_world,), (r,), replica_id=replica) for r in range(saved_world)},
    }


def differences(ctx: Context, loaded: dict[str, Any], version: int, saved_world: int | None = None) -> list[str]:
    """What `loaded` gets wrong, against the values a save by `saved_world` ranks (default: this world) holds."""
    import torch

    world = saved_world or ctx.world_size
    full = _values(world, version)
    found: list[str] = []
    if saved_world is None:
        rank = ctx.rank
        expected_a = full["a"][8 * rank : 8 * (rank + 1)]
        expected_w = full["w"][:, 3 * rank : 3 * (rank + 1)]
        objects = {"rng": {"seed": full["seeds"][rank]}}
    else:
        expected_a, expected_w = full["a"], full["w"]
        objects = {f"rng{r}": {"seed": full["seeds"][r]} for r in range(world)}
    layer = loaded.get("layer", {})
    pairs = [("layer.a", layer.get("a"), expected_a), ("layer.w", layer.get("w"), expected_w)]
    pairs.append(("bias", loaded.get("bias"), full["bias"]))
    for name, got, expected in pairs:
        if not isinstance(got, torch.Tensor):
            found.append(f"{name}: not loaded ({type(got).__name__})")
        elif got.dtype != expected.dtype or not torch.equal(got.cpu(), expected):
            found.append(f"{name}: {got.dtype} {got.cpu().float().tolist()} != {expected.float().tolist()}")
    for key, expected_object in objects.items():
        if loaded.get(key) != expected_object:
            found.append(f"{key}: {loaded.get(key)!r} != {expected_object!r}")
    if saved_world is None:
        for key, expected_value in (("iteration", 40 + version), ("note", "mcore")):
            if loaded.get(key) != expected_value:
                found.append(f"{key}: {loaded.get(key)!r} != {expected_value!r}")
    return found


# ---- context --------------------------------------------------------------------------------------------------------


class Context:
    def __init__(self, args: argparse.Namespace, rank: int, world_size: int, device: str) -> None:
        import s3_utils

        self.args = args
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.base = args.base.rstrip("/")
        self.out = Path(args.out)
        self.retry_policy = s3_utils.RetryPolicy(max_attempts=2, initial_backoff_s=0.05, max_backoff_s=0.2)
        self.settings = s3_utils.S3ClientSettings(endpoint_url=args.endpoint)
        self.direct_settings = s3_utils.S3ClientSettings(endpoint_url=args.direct_endpoint or args.endpoint)
        self.s3 = s3_utils.S3Utils(self.direct_settings)
        self.reader_options = {"client_settings": self.settings, "retry_policy": self.retry_policy}

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    def strategy(self, direct: bool = False, **options: Any) -> Any:
        import s3_mcore

        settings = self.direct_settings if direct else self.settings
        return s3_mcore.S3TorchDistSaveShardedStrategy(
            client_settings=settings, retry_policy=self.retry_policy, **options
        )

    def names(self, name: str) -> list[str]:
        prefix = self.url(name) + "/"
        return sorted(info.url[len(prefix) :] for info in self.s3.list_objects(self.url(name)))

    def open_uploads(self, name: str) -> int:
        return len(self.s3.list_multipart_uploads(self.url(name)))

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()


def _save(ctx: Context, name: str, version: int, **options: Any) -> None:
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sharded_state(ctx, version), ctx.url(name), sharded_strategy=ctx.strategy(**options))


def _load_and_compare(ctx: Context, location: Any, version: int) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(sharded_state(ctx, version, empty=True), location)
    return {"differences": differences(ctx, loaded, version)}


def _failure(action: Any) -> str:
    try:
        action()
    except BaseException as exc:  # the scenario reports it; the test asserts on its type and text
        return f"{type(exc).__name__}: {exc}"
    return ""


# ---- scenarios ------------------------------------------------------------------------------------------------------


def scenario_sync(ctx: Context) -> dict[str, Any]:
    """Sync save through the plain strategy, then load: no CUDA anywhere on this path."""
    _save(ctx, "iter_0000010", 1)
    ctx.barrier()
    return {**_load_and_compare(ctx, ctx.url("iter_0000010"), 1), "names": ctx.names("iter_0000010")}


def scenario_metadata(ctx: Context) -> dict[str, Any]:
    """megatron-core's metadata readers and checks on an s3:// URL and on the Path pathlib makes of it."""
    from megatron.core.dist_checkpointing import serialization, validation

    import s3_mcore

    url = ctx.url("iter_0000010")
    shapes = {}
    for form, location in (("str", url), ("path", Path(url))):
        tensors = serialization.load_tensors_metadata(location)
        shapes[form] = {key: list(value.global_shape) for key, value in tensors.items()}
    sharded = serialization.load_sharded_metadata(Path(url))
    validation.verify_checkpoint(url)
    validation.verify_checkpoint(str(Path(url)))
    common = serialization.load_common_state_dict(url)
    report = s3_mcore.verify_checkpoint(Path(url), ctx.s3)
    missing = _failure(lambda: serialization.load_tensors_metadata(ctx.url("never-saved")))
    return {
        "differences": [],
        "shapes": shapes,
        "sharded_keys": sorted(sharded),
        "common": {k: common[k] for k in ("iteration", "note")},
        "verified": report.ok,
        "problems": report.problems,
        "missing": missing,
    }


def scenario_fully_parallel(ctx: Context) -> dict[str, Any]:
    """Under FullyParallelSaveStrategyWrapper (replicated tensors saved once, by one rank)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    strategy = FullyParallelSaveStrategyWrapper(ctx.strategy())
    dist_checkpointing.save(sharded_state(ctx, 2), ctx.url("iter_0000020"), sharded_strategy=strategy)
    ctx.barrier()
    return {**_load_and_compare(ctx, ctx.url("iter_0000020"), 2), "names": ctx.names("iter_0000020")}


def _wait_for(ctx: Context, name: str, files: list[str], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not set(files) <= set(ctx.names(name)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{files} never appeared under {ctx.url(name)}: {ctx.names(name)}")
        time.sleep(0.1)


def _schedule(queue: Any, request: Any) -> None:
    """``queue.schedule_async_request(request)`` a moment after the save's last collective. megatron-core forks the
    upload process there, and on CPython 3.8-3.11 (gh-112275; CI's is 3.11.7) a fork while torch's gloo thread is
    creating or deleting its Python thread state deadlocks the forked process at its start (seen here, with that
    thread mid-way, in gdb; docs/megatron.md, Limits). The pause lets that thread finish first."""
    time.sleep(0.2)
    queue.schedule_async_request(request)


def scenario_async(ctx: Context) -> dict[str, Any]:
    """megatron-core's AsyncCallsQueue: the upload runs in its forked process; nothing is committed until finalize."""
    from mcore_stub import cuda_calls_of_megatron_core
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    name = "iter_0000030"
    request = dist_checkpointing.save(  # this package's part: no CUDA stand-in
        sharded_state(ctx, 3), ctx.url(name), sharded_strategy=ctx.strategy(), async_sharded_save=True
    )
    with cuda_calls_of_megatron_core():  # megatron-core's queue synchronises CUDA and all-reduces on a CUDA device
        queue = AsyncCallsQueue()
        _schedule(queue, request)
        shards = [f"__{r}_0.distcp" for r in range(ctx.world_size)]
        _wait_for(ctx, name, shards)
        before = ctx.names(name)
        ctx.barrier()
        finalized = queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    ctx.barrier()
    return {**_load_and_compare(ctx, ctx.url(name), 3), "before_finalize": before, "finalized": finalized}


def scenario_async_persistent(ctx: Context) -> dict[str, Any]:
    """As `async`, with megatron-core's persistent upload worker (spawned once; the request is pickled to it). GPU
    machines only: that worker calls ``torch.cuda.set_device`` first."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    name = "iter_0000032"
    request = dist_checkpointing.save(
        sharded_state(ctx, 3), ctx.url(name), sharded_strategy=ctx.strategy(), async_sharded_save=True
    )
    queue = AsyncCallsQueue(persistent=True)
    queue.schedule_async_request(request)
    finalized = queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    ctx.barrier()
    return {**_load_and_compare(ctx, ctx.url(name), 3), "finalized": finalized}


def scenario_fault_sync(ctx: Context) -> dict[str, Any]:
    """The test fails every upload of rank 1's file under iter_0000040: every rank must see the failure."""
    error = _failure(lambda: _save(ctx, "iter_0000040", 4))
    ctx.barrier()
    names, uploads = ctx.names("iter_0000040"), ctx.open_uploads("iter_0000040")
    return {"differences": [], "error": error, "names": names, "uploads": uploads}


def scenario_fault_async(ctx: Context) -> dict[str, Any]:
    """As fault_sync, for an async save: the upload process fails, the finalize step raises on every rank."""
    from mcore_stub import cuda_calls_of_megatron_core
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    name = "iter_0000041"
    request = dist_checkpointing.save(
        sharded_state(ctx, 4), ctx.url(name), sharded_strategy=ctx.strategy(), async_sharded_save=True
    )
    with cuda_calls_of_megatron_core():
        queue = AsyncCallsQueue()
        _schedule(queue, request)
        error = _failure(lambda: queue.maybe_finalize_async_calls(blocking=True))
        queue.close()
    ctx.barrier()
    return {"differences": [], "error": error, "names": ctx.names(name), "uploads": ctx.open_uploads(name)}


def scenario_fault_common(ctx: Context) -> dict[str, Any]:
    """megatron-core <= 0.18: the test fails every upload of common.pt under iter_0000042, which rank 0 writes alone
    before any collective: every rank must fail at once, with nothing committed. The routing goes through the proxy
    for this save only (its writes go past it in the other scenarios)."""
    import s3_mcore
    import s3_utils

    routing = s3_mcore.routing()
    direct, routing.s3 = routing.s3, s3_utils.S3Utils(ctx.settings, retry_policy=ctx.retry_policy)
    started = time.monotonic()
    try:
        error = _failure(lambda: _save(ctx, "iter_0000042", 4))
    finally:
        routing.s3 = direct
    seconds = time.monotonic() - started
    ctx.barrier()
    names, uploads = ctx.names("iter_0000042"), ctx.open_uploads("iter_0000042")
    return {"differences": [], "error": error, "names": names, "uploads": uploads, "seconds": seconds}


def scenario_overwrite_fail(ctx: Context) -> dict[str, Any]:
    """A checkpoint saved (past the proxy), then replaced by a save whose rank-1 upload fails: the old checkpoint's
    ``.metadata`` and ``metadata.json`` were retired first, so nothing there reads as complete."""
    _save(ctx, "iter_0000050", 5, direct=True)
    ctx.barrier()
    saved = ctx.names("iter_0000050")
    error = _failure(lambda: _save(ctx, "iter_0000050", 6))
    ctx.barrier()
    return {"differences": [], "saved": saved, "error": error, "names": ctx.names("iter_0000050")}


def scenario_overwrite_refused(ctx: Context) -> dict[str, Any]:
    """The first checkpoint saved again with ``overwrite=False``: refused on every rank before anything is written
    (on <= 0.18 its common.pt too, which rank 0 hands over before the sharded save), so it loads with its own values."""
    before = ctx.names("iter_0000010")
    error = _failure(lambda: _save(ctx, "iter_0000010", 99, overwrite=False))
    ctx.barrier()
    after = ctx.names("iter_0000010")
    return {**_load_and_compare(ctx, ctx.url("iter_0000010"), 1), "error": error, "before": before, "names": after}


def scenario_load_previous(ctx: Context) -> dict[str, Any]:
    """The first checkpoint loads after the failed saves."""
    return _load_and_compare(ctx, ctx.url("iter_0000010"), 1)


def scenario_load_requests(ctx: Context) -> dict[str, Any]:
    """A load whose every request goes through the proxy (the routing's own too), of a checkpoint saved past it: the
    test counts what one megatron-core load sends per rank."""
    from megatron.core import dist_checkpointing

    import s3_mcore
    import s3_utils

    strategy = ctx.strategy(direct=True)  # saved past the proxy (as the routing's own files): it sees the load alone
    dist_checkpointing.save(sharded_state(ctx, 1), ctx.url("counted-load"), sharded_strategy=strategy)
    ctx.barrier()
    s3_mcore.install_s3_routing(s3_utils.S3Utils(ctx.settings), reader_options=ctx.reader_options)
    try:
        return _load_and_compare(ctx, ctx.url("counted-load"), 1)
    finally:
        ctx.barrier()
        s3_mcore.install_s3_routing(ctx.s3, reader_options=ctx.reader_options)


def scenario_from_stock(ctx: Context) -> dict[str, Any]:
    """A checkpoint stock megatron-core saved to a local directory (routing installed: local paths are untouched),
    uploaded as files, loads from S3."""
    from mcore_stub import cuda_calls_of_megatron_core
    from megatron.core import dist_checkpointing

    local = ctx.out / "stock-local"
    with cuda_calls_of_megatron_core():  # stock megatron-core's local writer synchronizes CUDA
        if ctx.rank == 0:
            shutil.rmtree(local, ignore_errors=True)
            local.mkdir(parents=True)
        ctx.barrier()
        dist_checkpointing.save(sharded_state(ctx, 7), str(local))
    ctx.barrier()
    local_names = sorted(p.name for p in local.iterdir())
    if ctx.rank == 0:
        for file in local.iterdir():
            ctx.s3.upload_file(str(file), ctx.url(f"stock/{file.name}"))
    ctx.barrier()
    return {**_load_and_compare(ctx, ctx.url("stock"), 7), "local_names": local_names}


def scenario_to_stock(ctx: Context) -> dict[str, Any]:
    """A checkpoint this package saved, downloaded as files, loads with stock megatron-core."""
    local = ctx.out / "downloaded"
    if ctx.rank == 0:
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True)
        for name in ctx.names("iter_0000010"):
            ctx.s3.download_s3_file_to_path(ctx.url(f"iter_0000010/{name}"), str(local / name))
    ctx.barrier()
    return _load_and_compare(ctx, str(local), 1)


def scenario_fencing(ctx: Context) -> dict[str, Any]:
    """A newer run takes the directory over: this run's next save there fails on every rank, promptly (as it plans;
    on <= 0.18 before rank 0's common.pt), writing nothing."""
    import s3_fencing

    base = ctx.base + "-fenced"  # its own directory: a newer run takes it over
    first, second = f"{base}/iter_0000001", f"{base}/iter_0000002"
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sharded_state(ctx, 1), first, sharded_strategy=ctx.strategy())
    ctx.barrier()
    if ctx.rank == 0:
        newer = s3_fencing.CheckpointRun("feedfacefeedface", "newer-host", 1, time.time() + 3600)
        s3_fencing.DirectoryFence(ctx.s3, base, newer).token(second)
    ctx.barrier()
    started = time.monotonic()
    error = _failure(
        lambda: dist_checkpointing.save(sharded_state(ctx, 2), second, sharded_strategy=ctx.strategy())
    )
    seconds = time.monotonic() - started
    ctx.barrier()
    left = sorted(info.url.rsplit("/", 1)[-1] for info in ctx.s3.list_objects(second))
    return {"differences": [], "error": error, "names": left, "seconds": seconds, "checkpoint": second}


def scenario_throttled(ctx: Context) -> dict[str, Any]:
    """The test answers some uploads under throttled/ with 503 SlowDown: the save paces itself and completes."""
    _save(ctx, "throttled", 8)
    ctx.barrier()
    return _load_and_compare(ctx, ctx.url("throttled"), 8)


CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
"""What NeMo's MegatronStrategy passes as ``storage_options["content_metadata"]`` (no distributed optimizer)."""


class NeMoLikeCheckpointIO:
    """The part of NeMo 2.x's ``MegatronCheckpointIO`` interface the S3 subclass relies on (NeMo is not installed
    here): its constructor's flags and the three methods, which for local paths would be NeMo's own."""

    def __init__(self, save_ckpt_format: str = "torch_dist", async_save: bool = False, parallel_save: bool = True):
        self.save_ckpt_format = save_ckpt_format
        self.async_save = async_save
        self.parallel_save = parallel_save
        self.parallel_save_within_dp = False
        self.parallel_load = False
        self.assume_constant_structure = False
        self.validated_consistency = False

    def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> Any:
        raise AssertionError(f"NeMo's own save was called for {path!r}")

    def load_checkpoint(self, path: Any, sharded_state_dict: Any = None, map_location: Any = None, **kw: Any) -> Any:
        raise AssertionError(f"NeMo's own load was called for {path!r}")

    def remove_checkpoint(self, path: Any) -> None:
        raise AssertionError(f"NeMo's own remove was called for {path!r}")


def scenario_nemo_io(ctx: Context) -> dict[str, Any]:
    """S3MegatronCheckpointIO over a stand-in for NeMo's class: sync save to <url>/weights, load, then an async save
    scheduled and finalized as NeMo's AsyncFinalizableCheckpointIO does, then remove."""
    from mcore_stub import cuda_calls_of_megatron_core
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    import s3_mcore

    io_class = s3_mcore.megatron_checkpoint_io_class(NeMoLikeCheckpointIO)
    options = {"client_settings": ctx.settings, "retry_policy": ctx.retry_policy}
    sync_io = io_class(s3_writer_options=options)
    step1 = ctx.url("nemo/model--step=1")
    assert sync_io.save_checkpoint(sharded_state(ctx, 1), step1, {"content_metadata": CONTENT_METADATA}) is None
    ctx.barrier()
    names = ctx.names("nemo/model--step=1")
    loaded = sync_io.load_checkpoint(Path(step1), sharded_state_dict=sharded_state(ctx, 1, empty=True))
    found = differences(ctx, loaded, 1)
    # MegatronStrategy passes strict as a bool (its strict_loading) and asks for the content metadata first
    loaded = sync_io.load_checkpoint(step1, sharded_state_dict=sharded_state(ctx, 1, empty=True), strict=True)
    found += [f"strict=True: {d}" for d in differences(ctx, loaded, 1)]
    content = sync_io.load_content_metadata(Path(step1))
    missing = _failure(lambda: sync_io.load_checkpoint(ctx.url("nemo/never-saved"), sharded_state(ctx, 1, True)))
    async_io = io_class(async_save=True, s3_writer_options=options)
    step2 = ctx.url("nemo/model--step=2")
    request = async_io.save_checkpoint(sharded_state(ctx, 2), step2, {})
    finalized_by_caller: list[bool] = []
    request.add_finalize_fn(lambda: finalized_by_caller.append(True))  # as AsyncFinalizableCheckpointIO adds its own
    with cuda_calls_of_megatron_core():
        queue = AsyncCallsQueue()  # what NeMo's AsyncFinalizableCheckpointIO holds and drives
        _schedule(queue, request)
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    ctx.barrier()
    found += differences(ctx, async_io.load_checkpoint(step2, sharded_state_dict=sharded_state(ctx, 2, empty=True)), 2)
    ctx.barrier()
    if ctx.rank == 0:
        sync_io.remove_checkpoint(step1)
    ctx.barrier()
    return {
        "differences": found,
        "names": names,
        "async_names": ctx.names("nemo/model--step=2"),
        "extra_finalize": finalized_by_caller,
        "removed": ctx.names("nemo/model--step=1"),
        "content_metadata": content,
        "missing": missing,
    }


def _real_nemo_io(ctx: Context, **kwargs: Any) -> Any:
    """S3MegatronCheckpointIO on NeMo's own MegatronCheckpointIO (megatron-core's removed tensorstore strategy stood
    in for first, so that NeMo's AsyncFinalizableCheckpointIO can be built on megatron-core >= 0.16)."""
    from mcore_stub import stand_in_for_removed_tensorstore_strategy

    import s3_mcore

    stand_in_for_removed_tensorstore_strategy()
    options = {"client_settings": ctx.settings, "retry_policy": ctx.retry_policy}
    return s3_mcore.megatron_checkpoint_io_class()(s3_writer_options=options, **kwargs)


def scenario_nemo_real_io(ctx: Context) -> dict[str, Any]:
    """S3MegatronCheckpointIO built on the real NeMo 2.x MegatronCheckpointIO (nemo-toolkit installed): sync save
    of a Lightning-style ``.ckpt`` name, NeMo's load_content_metadata and load (strict None/True/False, as
    MegatronStrategy passes it), then an async save through NeMo's own AsyncFinalizableCheckpointIO (with a caller's
    finalize_fn), a load through the wrapper and the removal through it."""
    from mcore_stub import cuda_calls_of_megatron_core

    sync_io = _real_nemo_io(ctx)
    from nemo.lightning.io.pl import MegatronCheckpointIO
    from nemo.utils.callbacks.dist_ckpt_io import AsyncFinalizableCheckpointIO

    assert isinstance(sync_io, MegatronCheckpointIO), type(sync_io).__mro__
    step1 = ctx.url("nemo-real/model--step=1")
    saved = sync_io.save_checkpoint(sharded_state(ctx, 1), step1 + ".ckpt", {"content_metadata": CONTENT_METADATA})
    ctx.barrier()
    names = ctx.names("nemo-real/model--step=1")
    content = sync_io.load_content_metadata(step1)
    found: list[str] = []
    for strict in (None, True, False):
        loaded = sync_io.load_checkpoint(step1, sharded_state_dict=sharded_state(ctx, 1, empty=True), strict=strict)
        found += [f"strict={strict}: {d}" for d in differences(ctx, loaded, 1)]
    wrapper = AsyncFinalizableCheckpointIO(_real_nemo_io(ctx, async_save=True))
    step2 = ctx.url("nemo-real/model--step=2")
    finalized_by_caller: list[bool] = []
    options = {"content_metadata": CONTENT_METADATA, "finalize_fn": lambda: finalized_by_caller.append(True)}
    with cuda_calls_of_megatron_core():
        wrapper.save_checkpoint(sharded_state(ctx, 2), step2, options)
        before_finalize = ctx.names("nemo-real/model--step=2/weights")
        finalized = wrapper.maybe_finalize_save_checkpoint(blocking=True)
    wrapper.teardown()
    ctx.barrier()
    loaded = wrapper.load_checkpoint(step2, sharded_state_dict=sharded_state(ctx, 2, empty=True))
    found += differences(ctx, loaded, 2)
    ctx.barrier()
    if ctx.rank == 0:
        wrapper.remove_checkpoint(step1 + ".ckpt")
    ctx.barrier()
    return {
        "differences": found,
        "saved": saved,
        "names": names,
        "content_metadata": content,
        "before_finalize": before_finalize,
        "finalized": finalized,
        "async_names": ctx.names("nemo-real/model--step=2"),
        "extra_finalize": finalized_by_caller,
        "removed": ctx.names("nemo-real/model--step=1"),
    }


class _ModelParallelStandIn:
    """What MegatronStrategy asks its ``megatron_parallel`` (the wrapped model) for around a checkpoint."""

    def __init__(self, ctx: Context, version: int) -> None:
        self.ctx, self.version = ctx, version

    def sharded_state_dict(self, metadata: Any = None) -> dict[str, Any]:
        return sharded_state(self.ctx, self.version, empty=True)


def _stand_in_for_modelopt_hooks() -> None:
    """MegatronStrategy's save and load import ``nemo.collections.llm.modelopt.model_utils`` (NeMo's whole LLM
    collection and nvidia-modelopt): stood in for by hooks that do what NeMo's do for a model without ModelOpt
    state, nothing."""
    import sys
    import types

    name = "nemo.collections.llm.modelopt.model_utils"
    if name not in sys.modules:
        hooks = types.ModuleType(name, "stand-in (tests/helpers/mcore_worker.py): no ModelOpt state")
        hooks.save_modelopt_state = lambda model, path, checkpoint_io: None  # type: ignore[attr-defined]
        hooks.restore_modelopt_state = lambda model, path=None, trainer=None: None  # type: ignore[attr-defined]
        sys.modules[name] = hooks


def scenario_nemo_real_strategy(ctx: Context) -> dict[str, Any]:
    """NeMo's own MegatronStrategy (no Trainer) with the IO wrapped in NeMo's AsyncFinalizableCheckpointIO, as
    docs/megatron.md builds it: MegatronStrategy.save_checkpoint (a ``.ckpt`` name, as ModelCheckpoint gives it),
    the finalize AsyncFinalizerCallback would run, MegatronStrategy.load_checkpoint of the collapsed Path, and
    remove_checkpoint, NeMo's own (local shutil.rmtree) and the documented subclass's."""
    from mcore_stub import cuda_calls_of_megatron_core

    checkpoint_io = _real_nemo_io(ctx, async_save=True)
    _stand_in_for_modelopt_hooks()
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from nemo import lightning as nl
    from nemo.utils.callbacks.dist_ckpt_io import AsyncFinalizableCheckpointIO

    class S3MegatronStrategy(nl.MegatronStrategy):  # as docs/megatron.md
        def remove_checkpoint(self, filepath: Any) -> None:
            if self.is_global_zero:
                self.checkpoint_io.remove_checkpoint(filepath)

    def strategy(cls: type, version: int) -> Any:
        built = cls(
            ckpt_async_save=True,
            ckpt_load_optimizer=False,
            checkpoint_io=AsyncFinalizableCheckpointIO(checkpoint_io),
            cluster_environment=TorchElasticEnvironment(),  # the ranks' RANK / WORLD_SIZE
        )
        built.megatron_parallel = _ModelParallelStandIn(ctx, version)
        built._lightning_module = types.SimpleNamespace(strict_loading=True)
        return built

    import types

    s3_strategy = strategy(S3MegatronStrategy, 3)
    filepath = ctx.url("nemo-strategy/model--step=3.ckpt")
    lightning_dump = {"sharded_state_dict": sharded_state(ctx, 3), "epoch": 0, "global_step": 3}
    with cuda_calls_of_megatron_core():
        s3_strategy.save_checkpoint(lightning_dump, filepath)
        finalized = s3_strategy.checkpoint_io.maybe_finalize_save_checkpoint(blocking=True)
    ctx.barrier()
    names = ctx.names("nemo-strategy/model--step=3")
    loaded = s3_strategy.load_checkpoint(Path(filepath.removesuffix(".ckpt")))
    found = differences(ctx, {**loaded["state_dict"], **loaded["sharded_state_dict"]}, 3)
    ctx.barrier()
    nemo_remove = ""
    if ctx.rank == 0:
        nemo_remove = _failure(lambda: strategy(nl.MegatronStrategy, 3).remove_checkpoint(filepath))
    ctx.barrier()
    s3_strategy.remove_checkpoint(filepath)  # every rank calls it; global rank 0 removes
    ctx.barrier()
    return {
        "differences": found,
        "finalized": finalized,
        "names": names,
        "loaded_keys": sorted(loaded),
        "nemo_remove": nemo_remove,
        "removed": ctx.names("nemo-strategy/model--step=3"),
    }


def scenario_default_strategy(ctx: Context) -> dict[str, Any]:
    """megatron-core's own strategy for an s3:// URL with the routing installed: ``save`` with no strategy (megatron-
    core builds its default ``TorchDistSaveShardedStrategy``), then ``('torch_dist', 1)`` async inside
    ``FullyParallelSaveStrategyWrapper`` through megatron-core's queue. Both must reach S3 through this package and
    load; nothing may land in a local ``./s3:`` directory (megatron-core's own writer would put it there, under the
    CUDA stand-in its local writer needs on CPU, and only ``metadata.json`` would reach S3)."""
    from mcore_stub import cuda_calls_of_megatron_core
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    cwd = ctx.out / "default-strategy-cwd"  # where a local "s3:" directory would appear
    cwd.mkdir(parents=True, exist_ok=True)
    back = os.getcwd()
    os.chdir(cwd)
    try:
        with cuda_calls_of_megatron_core():
            dist_checkpointing.save(sharded_state(ctx, 11), ctx.url("default-strategy"))
            ctx.barrier()
            wrapped = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy())
            request = dist_checkpointing.save(
                sharded_state(ctx, 12), ctx.url("default-async"), sharded_strategy=wrapped, async_sharded_save=True
            )
            queue = AsyncCallsQueue()
            _schedule(queue, request)
            queue.maybe_finalize_async_calls(blocking=True)
            queue.close()
        ctx.barrier()
        local = sorted(str(path) for path in Path(".").rglob("*"))
    finally:
        os.chdir(back)
    found = _load_and_compare(ctx, ctx.url("default-strategy"), 11)["differences"]
    found += _load_and_compare(ctx, ctx.url("default-async"), 12)["differences"]
    names = {name: ctx.names(name) for name in ("default-strategy", "default-async")}
    return {"differences": found, "local": local, "names": names}


def scenario_main_replica(ctx: Context) -> dict[str, Any]:
    """A replicated tensor whose main replica (``replica_id`` 0) is on the last rank, first in the state dict: with
    megatron-core's default ``keep_only_main_replica=True`` that rank writes it; DCP's own deduplication (what
    ``False`` leaves the choice to) would give it to rank 0. Rank 0 reports which file holds it."""
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    import s3_dcp

    main_rank = ctx.world_size - 1
    replica = torch.arange(4, dtype=torch.float32) + 50
    state = {
        "main": ShardedTensor.from_rank_offsets("main", replica.clone(), replica_id=int(ctx.rank != main_rank)),
        **sharded_state(ctx, 13),
    }
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(state, ctx.url("main-replica"), sharded_strategy=ctx.strategy())
    ctx.barrier()
    metadata = s3_dcp.S3StorageReader(ctx.url("main-replica"), client_settings=ctx.direct_settings).read_metadata()
    files = sorted({info.relative_path for index, info in metadata.storage_data.items() if index.fqn == "main"})
    target = {"main": ShardedTensor.from_rank_offsets("main", torch.zeros(4), replica_id=ctx.rank)}
    loaded = dist_checkpointing.load(target, ctx.url("main-replica"))
    found = [] if torch.equal(loaded["main"], replica) else [f"main: {loaded['main'].tolist()}"]
    return {"differences": found, "files": files, "main_rank": main_rank}


def scenario_overwrite(ctx: Context) -> dict[str, Any]:
    """The first checkpoint saved again with new values: the new values load."""
    _save(ctx, "iter_0000010", 9)
    ctx.barrier()
    return {**_load_and_compare(ctx, ctx.url("iter_0000010"), 9), "names": ctx.names("iter_0000010")}


def scenario_reshard(ctx: Context) -> dict[str, Any]:
    """What 2 ranks saved (under the fully-parallel wrapper), loaded whole at this world size."""
    from megatron.core import dist_checkpointing

    source = f"{ctx.args.reshard_base or ctx.base}/iter_0000020"
    loaded = dist_checkpointing.load(reshard_targets(ctx, SAVED_WORLD), source)
    return {"differences": differences(ctx, loaded, 2, saved_world=SAVED_WORLD)}


def scenario_parallel_load(ctx: Context) -> dict[str, Any]:
    """megatron-core's FullyParallelLoadStrategyWrapper (NeMo's ckpt_parallel_load; CUDA only) on an S3 checkpoint."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    strategy = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())
    loaded = dist_checkpointing.load(sharded_state(ctx, 1, empty=True), ctx.url("iter_0000010"), strategy)
    return {"differences": differences(ctx, loaded, 1)}


SCENARIOS = {name[len("scenario_") :]: fn for name, fn in globals().items() if name.startswith("scenario_")}
SCENARIOS.update(mcore_tier_scenarios.SCENARIOS)  # tier_*: megatron-core saves through the memory tier


# ---- ranks ----------------------------------------------------------------------------------------------------------


def _rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.world_size), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    from dcp_worker import run_scenarios
    from mcore_stub import stand_in_for_triton_leaf

    stand_in_for_triton_leaf()
    import torch
    import torch.distributed as dist

    import s3_mcore

    torch.set_num_threads(1)
    device = args.device
    if device == "cuda":
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        device = f"cuda:{index}"
    dist.init_process_group(args.backend, rank=rank, world_size=args.world_size)
    ctx = Context(args, rank, args.world_size, device)
    routing = s3_mcore.install_s3_routing(ctx.s3, reader_options=ctx.reader_options)
    try:
        run_scenarios(SCENARIOS, args.scenarios, ctx, rank)
    finally:
        routing.uninstall()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--scenarios", required=True, help=f"comma-separated, from {sorted(SCENARIOS)}")
    parser.add_argument("--base", required=True, help="s3:// prefix under which checkpoints go")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--direct-endpoint", default="")
    parser.add_argument("--out", required=True, help="local directory for outcomes")
    parser.add_argument("--reshard-base", default="", help="where `reshard` finds what 2 ranks saved (--base)")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    import torch.multiprocessing as mp

    from s3_local_servers import free_port

    started = time.monotonic()
    if args.world_size == 1:  # in this process: a spawned one would import torch and the rest once more
        _rank_main(0, args, free_port())
    else:
        mp.spawn(_rank_main, args=(args, free_port()), nprocs=args.world_size, join=True)
    print(f"{args.world_size} ranks ran {args.scenarios} in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
