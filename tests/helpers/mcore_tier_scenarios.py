"""megatron-core saves through the memory tier: the ``tier_*`` scenarios of tests/helpers/mcore_worker.py (its 2
ranks on one simulated node: one tier root under ``--out``, LOCAL_RANK 0 and 1; ``tier_two_nodes`` and
``tier_nemo_two_nodes`` make each rank a node of its own for their duration; tests/test_mcore.py asserts on them).

Each scenario installs `s3_mcore`'s routing with ``memory_tier`` and puts it back without the tier when it ends; the
ranks adopt rank 0's run first, as one launch's ranks share one. The state and its expected values are
mcore_worker's. Each scenario has a tier of its own (its own ``job``), so its
first save is the one that drains. Which files this process drained, in order, is recorded around
`s3_memory_tier.NodeTier.upload`; a kill of the drain at one file is that upload raising there.
"""

from __future__ import annotations

import shutil
import time
from typing import Any

DRAINED: list[str] = []  # "<checkpoint>/<file>" in the order this process's drains uploaded them
CUT_AT: set[str] = set()  # file names whose drain is killed (the upload raises before S3 commits it)


def _tier(ctx: Any, job: str, node: int = 0, **fields: Any) -> Any:
    import s3_memory_tier

    return s3_memory_tier.MemoryTier(root=str(ctx.out / f"node{node}"), job=job, **{"drain_every": 10, **fields})


def _use_tier(ctx: Any, tier: Any) -> Any:
    import s3_mcore

    return s3_mcore.install_s3_routing(ctx.s3, reader_options=ctx.reader_options, memory_tier=tier)


def _readers(routing: Any) -> list[Any]:
    """Every DCP reader the routing hands megatron-core from now on (their ``tier_sources`` say where files came
    from)."""
    made: list[Any] = []
    original = routing.reader

    def reader(url: str) -> Any:
        made.append(original(url))
        return made[-1]

    routing.reader = reader
    return made


def _first_reads(readers: list[Any]) -> dict[str, str]:
    """Each file's name: the tier its first read came from."""
    first: dict[str, str] = {}
    for reader in readers:
        for url, source in reader.tier_sources.items():
            first.setdefault(url.rsplit("/", 1)[-1], source[1] if source else "s3")
    return first


def _tiers_read(readers: list[Any]) -> list[str]:
    return sorted({source[1] if source else "s3" for r in readers for source in r.tier_sources.values()})


def _load(ctx: Any, name: str, version: int, routing: Any) -> dict[str, Any]:
    """megatron-core's load of ``name``: its differences from `version` and the tiers its files came from."""
    from mcore_worker import _load_and_compare

    readers = _readers(routing)
    try:
        return {**_load_and_compare(ctx, ctx.url(name), version), "tiers": _tiers_read(readers)}
    finally:
        del routing.reader


def _s3_only_load(ctx: Any, name: str, version: int) -> dict[str, Any]:
    """The load a relaunch on new nodes makes: S3 alone (no tier); ``error`` if megatron-core refuses it."""
    from mcore_worker import _load_and_compare

    import s3_mcore

    s3_mcore.install_s3_routing(ctx.s3, reader_options=ctx.reader_options)  # memory_tier off
    try:
        return _load_and_compare(ctx, ctx.url(name), version)
    except Exception as exc:  # megatron-core's CheckpointingException: not a checkpoint it recognises
        return {"error": f"{type(exc).__name__}: {exc}"}


def _drained(name: str) -> list[str]:
    return [entry.split("/", 1)[1] for entry in DRAINED if entry.split("/", 1)[0] == name]


# ---- scenarios ------------------------------------------------------------------------------------------------------


def scenario_sync(ctx: Any) -> dict[str, Any]:
    """Two saves by megatron-core's own call with the S3 strategy (the routing's tier): the first drains, the second
    stays in memory. The second loads from memory while S3 has none of it; S3 alone does not see it."""
    from mcore_worker import _save

    import s3_mcore

    routing = _use_tier(ctx, _tier(ctx, "sync"))
    started = time.monotonic()
    _save(ctx, "iter_0000001", 1)
    _save(ctx, "iter_0000002", 2)
    save_seconds = time.monotonic() - started
    s3_mcore.finish_drains(drain_last=False)  # the first save's drain
    ctx.barrier()
    in_memory = _load(ctx, "iter_0000002", 2, routing)
    found = {
        "names": {name: ctx.names(name) for name in ("iter_0000001", "iter_0000002")},
        "memory": in_memory,
        "s3_only": _s3_only_load(ctx, "iter_0000002", 2),
        "drained": _drained("iter_0000001"),
        "save_seconds": save_seconds,
    }
    _use_tier(ctx, _tier(ctx, "sync"))
    s3_mcore.finish_drains()  # the last save reaches S3 too
    ctx.barrier()
    found["names_after_finish"] = ctx.names("iter_0000002")
    found["drained_last"] = _drained("iter_0000002")
    return {"differences": in_memory["differences"], **found}


def scenario_cut(ctx: Any) -> dict[str, Any]:
    """A drain killed at ``.metadata`` (iter_0000003) and one killed at ``metadata.json`` (iter_0000004, a save
    that drains at once: ``drain_every=1``): S3 then holds no checkpoint megatron-core recognises. The next process
    of the job finishes both drains; with the tier wiped, both load from S3 alone."""
    from mcore_worker import _save

    import s3_dcp_tier
    import s3_mcore

    tier = _tier(ctx, "cut", drain_every=1)
    _use_tier(ctx, tier)
    cuts = {"iter_0000003": ".metadata", "iter_0000004": "metadata.json"}
    killed = {}
    for version, (name, cut) in enumerate(cuts.items(), 3):
        CUT_AT.clear()
        CUT_AT.add(f"{name}/{cut}")
        _save(ctx, name, version)
        try:
            s3_mcore.finish_drains()
            killed[name] = ""
        except BaseException as exc:  # the simulated kill (rank 0's commit drain only)
            killed[name] = f"{type(exc).__name__}: {exc}"
        ctx.barrier()
    CUT_AT.clear()
    after_kill = {name: ctx.names(name) for name in cuts}
    refused = {name: _s3_only_load(ctx, name, version) for version, name in enumerate(cuts, 3)}
    ctx.barrier()
    relaunch = s3_dcp_tier.DcpTier(tier, ctx.s3)  # what the next process's first writer or reader opens
    relaunch.finish_drains(None, drain_last=False)
    ctx.barrier()
    if ctx.rank == 0:
        shutil.rmtree(ctx.out / "node0")  # the node is gone
    ctx.barrier()
    loaded = {name: _s3_only_load(ctx, name, version) for version, name in enumerate(cuts, 3)}
    return {
        "differences": [d for outcome in loaded.values() for d in outcome.get("differences", [outcome.get("error")])],
        "killed": killed,
        "after_kill": after_kill,
        "refused": refused,
        "names": {name: ctx.names(name) for name in cuts},
        "drained": {name: _drained(name) for name in cuts},
    }


def scenario_async(ctx: Any) -> dict[str, Any]:
    """megatron-core's async save with its own (default) strategy, which the routing sends through the tier, through
    its AsyncCallsQueue: committed in memory when the request is built (no upload process), ``metadata.json`` by the
    finalize step; the drain finishes after it, from this process."""
    from mcore_stub import cuda_calls_of_megatron_core
    from mcore_worker import sharded_state
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    import s3_mcore

    routing = _use_tier(ctx, _tier(ctx, "async"))
    name = "iter_0000005"
    request = dist_checkpointing.save(sharded_state(ctx, 5), ctx.url(name), async_sharded_save=True)
    with cuda_calls_of_megatron_core():
        queue = AsyncCallsQueue()
        queue.schedule_async_request(request)
        finalized = queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    ctx.barrier()
    in_memory = _load(ctx, name, 5, routing)
    s3_mcore.finish_drains()
    ctx.barrier()
    return {
        "differences": in_memory["differences"],
        "upload_process": request.async_fn is not None,
        "finalized": finalized,
        "memory": in_memory,
        "names": ctx.names(name),
        "drained": _drained(name),
        "s3_only": _s3_only_load(ctx, name, 5),
    }


def scenario_two_nodes(ctx: Any) -> dict[str, Any]:
    """Each rank a node of its own (GROUP_RANK, LOCAL_RANK 0, its tier root ``node<rank>``), replication started:
    iter_0000006 drains (the first save), iter_0000007 stays in memory and on the other node. Node 0's memory is then
    lost, and S3 gets an iter_0000008 with .metadata but no metadata.json (a drain killed in between); every rank
    agrees on iter_0000007 and megatron-core loads it, node 0 from node 1's replicas (its metadata.json too), node 1
    from its memory and the replicas it holds."""
    import os

    from mcore_worker import _load_and_compare, _save

    import s3_dcp_tier
    import s3_mcore

    before = {name: os.environ.get(name) for name in ("GROUP_RANK", "LOCAL_RANK")}
    os.environ.update(GROUP_RANK=str(ctx.rank), LOCAL_RANK="0")
    tier = _tier(ctx, "two-nodes", node=ctx.rank)
    routing = _use_tier(ctx, tier)
    dcp_tier = s3_dcp_tier.tier_of(tier, ctx.s3)
    try:
        s3_mcore.start_replication()
        for version in (6, 7):
            _save(ctx, f"iter_{version:07d}", version)
        s3_mcore.finish_drains(drain_last=False)  # the first save's drain; every replication sent
        ctx.barrier()
        on_s3 = ctx.names("iter_0000007")
        if ctx.rank == 0:  # node 0's memory is lost: its checkpoints and the replicas it held
            for copy in dcp_tier.node.copies():
                dcp_tier.node.remove(copy.url)
            for held in dcp_tier.node.replicas.iterdir():  # one folder per sender (its live server's lock stays)
                if held.is_dir():
                    shutil.rmtree(held)
            with ctx.s3.open_writer(ctx.url("iter_0000008/.metadata")) as stray:  # a drain killed before metadata.json
                stray.write(b"not loadable by megatron-core")
        ctx.barrier()
        agreement = s3_mcore.agree_resume(ctx.base)
        sources = {url.rsplit("/", 1)[-1]: [source.tier, source.peer is not None]
                   for url, source in agreement.sources.items()}  # fmt: skip (before the load fetches)
        readers = _readers(routing)
        try:
            loaded = _load_and_compare(ctx, agreement.url, agreement.step)
        finally:
            del routing.reader
        first_reads = _first_reads(readers)
        ctx.barrier()  # no replica server goes while the other node still fetches from it
        return {
            "differences": loaded["differences"],
            "on_s3": on_s3,
            "agreed": [agreement.step, agreement.steps[:2], agreement.tier],
            "sources": sources,
            "first_reads": first_reads,
        }
    finally:
        if dcp_tier.replication is not None:
            dcp_tier.replication.close()
        for name, value in before.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def scenario_nemo_two_nodes(ctx: Any) -> dict[str, Any]:
    """NeMo 2.x's checkpoint IO with the memory tier (``s3_writer_options``; over mcore_worker's stand-in for NeMo's
    class) on two nodes, each rank a node of its own, and no call to s3_mcore's replication or agreement: model--step=6
    drains (the first save), model--step=7 stays in memory, and on the other node if the IO's saves replicated by
    themselves. Node 0's own memory is then lost; the load of step 7 (its content metadata first, as NeMo's
    ``MegatronStrategy`` asks) agrees on every rank by itself, node 0 reading its files from node 1's replicas."""
    from mcore_worker import NeMoLikeCheckpointIO

    return _nemo_two_nodes(ctx, "nemo", NeMoLikeCheckpointIO)


def scenario_nemo_real_two_nodes(ctx: Any) -> dict[str, Any]:
    """As ``nemo_two_nodes``, on the real NeMo 2.x ``MegatronCheckpointIO`` (nemo-toolkit installed: tests/test_nemo.py
    under `make nemo-check`), megatron-core's removed tensorstore strategy stood in for as mcore_worker does."""
    from mcore_stub import stand_in_for_removed_tensorstore_strategy

    stand_in_for_removed_tensorstore_strategy()
    return _nemo_two_nodes(ctx, "nemo-real", None)


def _nemo_two_nodes(ctx: Any, where: str, nemo_class: Any) -> dict[str, Any]:
    import os

    from mcore_worker import CONTENT_METADATA, differences, sharded_state

    import s3_dcp_tier
    import s3_mcore

    before = {name: os.environ.get(name) for name in ("GROUP_RANK", "LOCAL_RANK")}
    os.environ.update(GROUP_RANK=str(ctx.rank), LOCAL_RANK="0")
    tier = _tier(ctx, f"{where}-two-nodes", node=ctx.rank)
    options = {"client_settings": ctx.settings, "retry_policy": ctx.retry_policy, "memory_tier": tier}
    io = s3_mcore.megatron_checkpoint_io_class(nemo_class)(s3_writer_options=options)  # None: NeMo's own class
    routing = s3_mcore.routing()
    dcp_tier = s3_dcp_tier.tier_of(tier, routing.s3)
    try:
        for version in (6, 7):
            url = ctx.url(f"{where}/model--step={version}")
            io.save_checkpoint(sharded_state(ctx, version), url, {"content_metadata": CONTENT_METADATA})
        s3_mcore.finish_drains(drain_last=False)  # the first save's drain; every replication sent
        ctx.barrier()
        replicated, on_s3 = dcp_tier.replication is not None, ctx.names(f"{where}/model--step=7")
        if not replicated:  # node 0 could not load step 7 while node 1 would wait for it in the load
            return {"differences": [], "replicated": False}
        if ctx.rank == 0:  # node 0's own memory is lost (the replicas of node 1's files it holds stay)
            for copy in dcp_tier.node.copies():
                dcp_tier.node.remove(copy.url)
        ctx.barrier()
        readers = _readers(routing)
        try:
            step7 = ctx.url(f"{where}/model--step=7")
            content = io.load_content_metadata(step7)
            loaded = io.load_checkpoint(step7, sharded_state_dict=sharded_state(ctx, 7, True))
        finally:
            del routing.reader
        first_reads = _first_reads(readers)
        ctx.barrier()  # no replica server goes while the other node still fetches from it
        return {"differences": differences(ctx, loaded, 7), "replicated": True, "on_s3": on_s3,
                "content_metadata": content, "first_reads": first_reads}  # fmt: skip
    finally:
        if dcp_tier.replication is not None:
            dcp_tier.replication.close()
        for name, value in before.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def _record_drains() -> None:
    """Record which files this process drains, in order (`DRAINED`), and kill the drain at those in `CUT_AT`."""
    import s3_memory_tier

    upload = s3_memory_tier.NodeTier.upload

    def recorded(copy: Any, writer: Any) -> None:
        where = "/".join(copy.url.rsplit("/", 2)[-2:])
        if where in CUT_AT:
            raise KeyboardInterrupt(f"killed while draining {copy.url}")
        upload(copy, writer)
        DRAINED.append(where)

    s3_memory_tier.NodeTier.upload = staticmethod(recorded)


def _one_launch(ctx: Any) -> None:
    """The ranks of one launch of a job share its run (a launcher's job id does that; these ranks adopt rank 0's, as
    `S3ModelCheckpoint.setup` makes them): the node's tier takes a run other than its newest for a straggler's."""
    import torch.distributed as dist

    import s3_fencing

    run = [s3_fencing.current_run()]
    dist.broadcast_object_list(run, src=0)
    s3_fencing.adopt_run(run[0])


_READY: list[bool] = []  # set once this process records its drains and shares rank 0's run


def _prepared(scenario: Any) -> Any:
    def run(ctx: Any) -> dict[str, Any]:
        if not _READY:
            _READY.append(True)
            _record_drains()
            _one_launch(ctx)
        base, ctx.base = ctx.base, ctx.base + "-tier"  # resume discovery's test looks at the others' base
        try:
            return scenario(ctx)
        finally:
            ctx.base = base
            import s3_mcore

            s3_mcore.install_s3_routing(ctx.s3, reader_options=ctx.reader_options)  # the tier off again

    return run


SCENARIOS = {
    f"tier_{name[len('scenario_') :]}": _prepared(fn) for name, fn in globals().items() if name.startswith("scenario_")
}
