"""A job of ``--world`` ranks (``--per-node`` per "node") that checkpoints through an S3 that throttles, for
tests/test_throttling.py: ``python throttle_worker.py --world 8 --per-node 4 --base s3://bucket/run --out DIR``.

The caller sets MASTER_ADDR, MASTER_PORT and AWS_ENDPOINT_URL_S3 (the fault proxy, whose `RateLimit` answers SlowDown
beyond a few requests per second); this process imports torch and the package once and forks the ranks, each with
the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK: the node). Every rank, on one
gloo process group, at once after a barrier:

1. a sync save of its own single-file checkpoint (a multipart upload) with `S3CheckpointIO`;
2. an async save of a second one (``async_checkpointing=True``), waited for;
3. loads of both, each compared with what it saved;
4. a DCP save of one tensor per rank with `S3StorageWriter`, then a DCP load into zeros, compared;
5. a node-mode collective load (``load_sharing="node"``) of rank 0's sync checkpoint: one download per "node"
   (GROUP_RANK), compared with the tensor rank 0 saved.

Writes ``<out>/rank<N>.json``: what failed (nothing, if all went well), the comparisons, and this process's request
pacer counters (throttling answers, seconds waited) per direction.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

MiB = 1 << 20


def tensor_of(rank: int, kind: str, mib: float) -> Any:
    """The deterministic tensor rank `rank` saves as `kind` (any rank can rebuild any other's)."""
    import torch

    generator = torch.Generator().manual_seed(zlib.crc32(f"{rank}/{kind}".encode()))
    return torch.rand(int(mib * MiB) // 4, generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="s3://bucket/prefix for this job's checkpoints")
    parser.add_argument("--out", required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--per-node", type=int, required=True)
    parser.add_argument("--mib", type=float, default=6.0, help="size of each single-file checkpoint's tensor")
    args = parser.parse_args()
    # Import once, then fork the ranks: 8 interpreters importing torch each would take most of a minute of CPU on a
    # small machine. Nothing has started a thread or an S3 client yet (clients and pacers are per pid). No Trainer
    # here: a stand-in spares each rank the import of Lightning that building an S3CheckpointIO would make.
    from lightning_stand_in import stand_in_for_lightning

    stand_in_for_lightning()
    import torch.distributed.checkpoint  # noqa: F401

    import s3_checkpoint_io  # noqa: F401
    import s3_dcp  # noqa: F401

    def environment(rank: int) -> dict[str, str]:
        node, local = divmod(rank, args.per_node)
        return {
            "RANK": str(rank),
            "LOCAL_RANK": str(local),
            "GROUP_RANK": str(node),
            "WORLD_SIZE": str(args.world),
            "LOCAL_WORLD_SIZE": str(args.per_node),
        }

    fork_ranks(args.world, environment, lambda rank, report: run(args, rank, report), args.out, error_code=3)


def fork_ranks(
    world: int,
    environment: Callable[[int], dict[str, str]],
    run_rank: Callable[[int, dict[str, Any]], None],
    out: str,
    *,
    error_code: int,
) -> NoReturn:
    """Fork `world` ranks of this interpreter (its imports done once): each sets `environment(rank)`, runs
    `run_rank(rank, report)`, writes the report (with any error and its traceback) to ``{out}/rank{rank}.json`` and
    exits 0, or `error_code` if it failed; then exit naming the ranks that did not exit 0 (launch_worker too)."""
    children = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            os.environ.update(environment(rank))
            code = 1
            try:
                report: dict[str, Any] = {"rank": rank, "steps": {}}
                try:
                    run_rank(rank, report)
                except Exception as exc:
                    notes = getattr(exc, "__notes__", "")
                    report["error"] = f"{type(exc).__name__}: {exc} {notes}\n{traceback.format_exc()}"
                Path(out, f"rank{rank}.json").write_text(json.dumps(report))
                code = 0 if "error" not in report else error_code
            finally:
                os._exit(code)
        children[pid] = rank
    failed = []
    for _ in range(world):
        pid, status = os.wait()
        if os.waitstatus_to_exitcode(status) != 0:
            failed.append(children[pid])
    raise SystemExit(f"ranks {sorted(failed)} failed" if failed else 0)


def run(args: argparse.Namespace, rank: int, report: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import s3_dcp
    from s3_checkpoint_io import S3CheckpointIO
    from s3_utils import S3ClientSettings

    settings = S3ClientSettings(user_agent_extra=f"rank/{rank}", connect_timeout_s=5)
    sync_io = S3CheckpointIO(chunk_size_MB=5, max_write_concurrency=4, client_settings=settings)
    async_io = S3CheckpointIO(chunk_size_MB=5, async_checkpointing=True, client_settings=settings)
    shared_io = S3CheckpointIO(chunk_size_MB=5, load_sharing="node", client_settings=settings)
    sync_url, async_url = f"{args.base}/rank{rank}/sync.ckpt", f"{args.base}/rank{rank}/async.ckpt"
    saved = {"sync": tensor_of(rank, "sync", args.mib), "async": tensor_of(rank, "async", args.mib)}
    dist.init_process_group("gloo")
    dist.barrier()
    started = time.monotonic()

    def step(name: str, action: Any) -> None:
        began = time.monotonic()
        report["steps"][name] = {"ok": bool(action()), "seconds": time.monotonic() - began}

    step("sync_save", lambda: sync_io.save_checkpoint({"w": saved["sync"]}, sync_url) or True)
    step("async_save", lambda: async_io.save_checkpoint({"w": saved["async"]}, async_url) or True)
    step("async_wait", lambda: async_io.wait_for_pending_saves() or True)
    for kind, url in (("sync", sync_url), ("async", async_url)):
        step(f"{kind}_load", lambda url=url, kind=kind: torch.equal(sync_io.load_checkpoint(url)["w"], saved[kind]))

    dcp_state = {f"rank{rank}": tensor_of(rank, "dcp", 1)}
    dcp_writer = s3_dcp.S3StorageWriter(f"{args.base}/dcp.ckpt", chunk_size_MB=5, client_settings=settings)
    step("dcp_save", lambda: dcp.save(dcp_state, storage_writer=dcp_writer) or True)

    def dcp_load() -> bool:
        target = {name: torch.zeros_like(value) for name, value in dcp_state.items()}
        dcp.load(target, storage_reader=s3_dcp.S3StorageReader(f"{args.base}/dcp.ckpt", client_settings=settings))
        return all(torch.equal(target[name], value) for name, value in dcp_state.items())

    step("dcp_load", dcp_load)

    dist.barrier()  # rank 0's sync checkpoint is complete on every rank's view

    def collective() -> bool:
        with shared_io.collective_load():
            loaded = shared_io.load_checkpoint(f"{args.base}/rank0/sync.ckpt")
        return torch.equal(loaded["w"], tensor_of(0, "sync", args.mib))

    step("node_load", collective)
    report["seconds"] = time.monotonic() - started
    pacer = sync_io.s3.pacer(args.base)
    report["pacer"] = {
        lane.name: {"throttles": lane.throttles, "waited_s": lane.waited_s, "activations": lane.activations}
        for lane in (pacer.writes, pacer.reads)
    }
    report["retries"] = sync_io.s3.retries + async_io.s3.retries + shared_io.s3.retries
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
