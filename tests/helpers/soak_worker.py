"""One rank of the kill-and-relaunch soak job (tests/helpers/soak.py starts it).

    python soak_worker.py DIR_URL MODE STEPS [--mib M] [--step-s S] [--drain-every N]

Started ahead by the harness (``SOAK_HELD``), it imports and then waits for a line on stdin. Runs under a launcher's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``GROUP_RANK``, ``MASTER_ADDR``/
``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``), one gloo process group. The job is
deterministic: the weights at step ``s`` are `weights(s)`, a pure function of ``s``, so a resumed checkpoint can be
checked bit for bit against the closed form.

1. Resume: global rank 0 runs discovery (`find_resume_checkpoints`, newest first, fallbacks after it) and broadcasts
   the list; every rank loads with `load_newest_usable` (falls back alike on every rank), through node load sharing
   (``MODE=single``: `S3CheckpointIO.collective_load`) or ``dcp.load`` (``MODE=dcp``), and checks the weights.
2. Train ``STEPS`` steps; after each, save:
   * ``single``: global rank 0 only (as Lightning does) saves asynchronously ``step=N.ckpt`` and ``step=N-last.ckpt``
     with `S3CheckpointIO` (multipart at ``--mib`` >= 5; its "-last" clean-up removes the older ``-last``), and
     removes ``step=N-2.ckpt`` (top-2); the removal waits until the saves before it are durable.
   * ``dcp``: every rank saves its shard of the weights with ``dcp.save`` into ``step=N-last.ckpt/`` (the coordinator
     commits and fences), then global rank 0 removes ``step=N-2-last.ckpt/`` under its fence (top-2).
   * ``tier``: as ``single`` with the memory tier: each rank is a node of its own (``GROUP_RANK``) with
     its tier under ``$SOAK_TIER_ROOT/node<GROUP_RANK>``, replication on (`S3CheckpointIO.start_replication`); global
     rank 0 saves ``step=N-last.ckpt`` every step into memory and removes ``step=N-1-last.ckpt`` (as Lightning's
     "-last" clean-up: the memory copy now, the S3 object once a newer checkpoint is on S3), every
     ``--drain-every``-th save drains to S3, every save is sent to node 1.
With the memory tier every rank first agrees on its resume tier (`S3CheckpointIO.agree_resume`: own memory, the
peer's replica, S3), so rank 0's discovery sees the memory-only checkpoints every rank can load.
Events go to stdout as JSON lines (``{"event": ..., "rank": r, ...}``; events: started, joined (the process group is
up), replicating, agreed (tier mode), resuming, resumed, step, durable, done, error):
"durable" is sent by global rank 0 once a "-last" save is committed on S3 (async saves: when their record appears;
the tier: when its drain's record appears, never for the memory copy). "resumed" says which tier the load read.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from lightning_stand_in import stand_in_for_lightning

stand_in_for_lightning()  # a plain loop, no Trainer: the job does everything but import Lightning

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from soak import weights  # noqa: E402

from connector import checkpoint_step, find_resume_checkpoints, load_newest_usable  # noqa: E402
from s3_checkpoint_io import S3CheckpointIO  # noqa: E402
from s3_fencing import DirectoryFence, current_run  # noqa: E402
from s3_memory_tier import MemoryTier  # noqa: E402
from s3_utils import RetryPolicy, S3ClientSettings, S3Utils  # noqa: E402

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
LAUNCH = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
_print_lock = threading.Lock()
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks for every thread's stack before it kills
logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: %(message)s")


def emit(event: str, **fields: Any) -> None:
    with _print_lock:
        print(json.dumps({"event": event, "rank": RANK, "launch": LAUNCH, **fields}), flush=True)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))


def watch_durable(io: S3CheckpointIO, stop: threading.Event) -> None:
    """Report each "-last" save once its record appears (the save committed, with its checksum record)."""
    seen: set[str] = set()
    while not stop.is_set():
        for record in list(io.records):
            on_s3 = record.tier in (None, "s3")  # a memory-tier save counts once its drain is on S3
            if record.kind == "save" and on_s3 and record.url.endswith("-last.ckpt") and record.url not in seen:
                seen.add(record.url)
                emit("durable", step=int(record.url.rpartition("step=")[2].split("-")[0]), url=record.url)
        stop.wait(0.005)


def init_process_group(timeout: datetime.timedelta) -> None:
    """The gloo group over a TCPStore at ``MASTER_ADDR:MASTER_PORT`` that rank 0 serves: on the listening socket the
    harness passed it (``SOAK_STORE_FD``, bound before the launch started, so no other process can take the port
    meanwhile), else on a socket it binds now."""
    listen_fd = os.environ.get("SOAK_STORE_FD") if RANK == 0 else None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(
        host, port, WORLD, RANK == 0, timeout=timeout, master_listen_fd=None if listen_fd is None else int(listen_fd)
    )
    dist.init_process_group("gloo", store=store, rank=RANK, world_size=WORLD, timeout=timeout)


def loaded_from(io: S3CheckpointIO) -> str:
    """The tier the last load read (``memory``, ``replica``, ``s3``): its transfer record's (drains that a relaunch
    finishes add save records meanwhile)."""
    loads = [record for record in io.records if record.kind == "load"]
    return str(loads[-1].tier) if loads else "s3"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("mode", choices=["single", "dcp", "tier"])
    parser.add_argument("steps", type=int)
    parser.add_argument("--mib", type=float, default=6.0)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--drain-every", type=int, default=3, help="tier: every Nth save in memory goes to S3")
    parser.add_argument("--more", type=int, default=None, help="train this many steps past the resumed one, then end")
    args = parser.parse_args()
    if args.mode == "dcp":  # imported only where used: DCP's import costs a launch a second of start-up
        import torch.distributed.checkpoint as dcp

        from s3_dcp import S3StorageReader, S3StorageWriter
    if os.environ.get("SOAK_HELD"):  # started ahead by the harness: wait for its go before touching anything shared
        sys.stdin.readline()
    base = args.dir.rstrip("/")
    numel = int(args.mib * 2**20) // 4
    emit("started")
    init_process_group(datetime.timedelta(seconds=120))
    emit("joined")
    settings = S3ClientSettings(user_agent_extra=f"soak-launch-{LAUNCH}")
    retries = RetryPolicy(max_attempts=8, initial_backoff_s=0.05, max_backoff_s=0.5)
    utils = S3Utils(settings, retries)
    sharing = os.environ.get("SOAK_LOAD_SHARING", "node")
    tier = None
    if args.mode == "tier":
        root = os.path.join(os.environ["SOAK_TIER_ROOT"], f"node{os.environ['GROUP_RANK']}")
        tier = MemoryTier(root=root, job="soak", keep=2, drain_every=args.drain_every)
    io = S3CheckpointIO(
        chunk_size_MB=5, async_checkpointing=args.mode != "dcp", s3_utils=utils, load_sharing=sharing,
        memory_tier=tier,
    )
    if tier is not None:
        io.start_replication()  # collective; global rank 0 finishes the drains a killed launch left
        # collective: the newest step every rank can load from some tier (own memory, a peer's replica, S3); rank 0's
        # discovery below then sees the memory-only checkpoints every rank can load, and each load reads its tier
        emit("replicating")
        io.agree_resume(base, checkpoint_step, list_s3=RANK == 0)
        emit("agreed")

    # ---- resume
    found: list[Any] = [None]
    if RANK == 0:
        found[0] = find_resume_checkpoints(base, resume_ignore_no_checkpoint=True, s3_utils=utils)
    dist.broadcast_object_list(found, src=0)
    urls: list[str] = found[0]
    emit("resuming", candidates=len(urls))
    step = 0
    if urls:

        def load(url: str) -> dict[str, Any]:
            if args.mode != "dcp":
                with io.collective_load():
                    return io.load_checkpoint(url, weights_only=True)
            target: dict[str, Any] = {"step": 0, f"w{RANK}": torch.zeros(len(range(RANK, numel, WORLD)))}
            dcp.load(target, storage_reader=S3StorageReader(url, s3_utils=utils))
            return target

        url, checkpoint = load_newest_usable(urls, load)
        step = int(checkpoint["step"])
        expected = weights(step, numel)
        got = checkpoint[f"w{RANK}"] if args.mode == "dcp" else checkpoint["w"]
        exact = bit_equal(got, expected[RANK::WORLD].clone() if args.mode == "dcp" else expected)
        source = loaded_from(io) if args.mode != "dcp" else "s3"
        emit("resumed", step=step, url=url, exact=exact, skipped=urls.index(url), tier=source)
    else:
        emit("resumed", step=0, url=None, exact=True, skipped=0, tier=None)

    # ---- train and save
    stop = threading.Event()
    watcher = threading.Thread(target=watch_durable, args=(io, stop), daemon=True)
    if RANK == 0 and args.mode != "dcp":
        watcher.start()
    fence = DirectoryFence(utils, base, current_run()) if RANK == 0 else None
    last = step + args.more if args.more is not None else args.steps
    for current in range(step + 1, last + 1):
        time.sleep(args.step_s)
        w = weights(current, numel)
        if args.mode == "tier":
            if RANK == 0:  # as Lightning's "-last" clean-up: save the new one, then remove the one before it
                state = {"step": current, "global_step": current, "w": w}
                io.save_checkpoint(state, f"{base}/step={current}-last.ckpt")
                if current > 1:
                    io.remove_checkpoint(f"{base}/step={current - 1}-last.ckpt")
        elif args.mode == "single":
            if RANK == 0:
                checkpoint = {"step": current, "w": w}
                io.save_checkpoint(checkpoint, f"{base}/step={current}.ckpt")
                io.save_checkpoint(checkpoint, f"{base}/step={current}-last.ckpt")
                if current - 2 >= 1:
                    io.remove_checkpoint(f"{base}/step={current - 2}.ckpt")
        else:
            url = f"{base}/step={current}-last.ckpt"
            shard = {"step": current, f"w{RANK}": w[RANK::WORLD].clone()}
            dcp.save(shard, storage_writer=S3StorageWriter(url, s3_utils=utils))
            if RANK == 0:
                emit("durable", step=current, url=url)
                if current - 2 >= 1:
                    utils.remove_objects_with_prefix(f"{base}/step={current - 2}-last.ckpt", fence=fence)
        if RANK == 0:
            emit("step", step=current)
        dist.barrier()
    io.teardown()
    stop.set()
    if watcher.is_alive():
        watcher.join()
    dist.barrier()
    emit("done", step=last)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:
        emit("error", type=type(exc).__name__, message=str(exc)[:2000])
        raise
    sys.exit(0)
