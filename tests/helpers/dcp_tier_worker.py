"""A process of a DCP job with a memory tier, for tests/test_dcp_tier.py (gloo, CPU).

    python dcp_tier_worker.py two-nodes BUCKET OUT_DIR   # one of two ranks, each a node (GROUP_RANK) of its own

    python dcp_tier_worker.py replicated-save BUCKET OUT_DIR  # the same ranks, replication started, then killed
    python dcp_tier_worker.py relaunch BUCKET OUT_DIR         # loads step 2, then agrees on a step and loads it

two-nodes: every rank saves its own tensor into step 1 (drained: the first save) and step 2 (memory only), waits for
its drains, loads step 1 (its file from its node's memory, the rest where it is), tries step 2 (only node 0 holds
its .metadata: every rank fails alike), drains the last save and loads step 2 from S3. Writes OUT_DIR/rank<N>.json.
replicated-save: replication started (`s3_dcp_tier.start_replication`), every rank saves steps 1 (drained), 2, 3 (in
memory and on the other node only, keep=2), each waited for (drain, replication), and exits without its teardown (a
kill). relaunch: replication started again, step 2 loaded (chosen by hand), node 0's memory emptied again, then the
step every rank agrees on (`s3_dcp_tier.agree_resume`) loaded; OUT_DIR/rank<N>.json says which step, whether it is
bit-identical, and the tier each file came from.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import s3_dcp
import s3_dcp_tier
import s3_memory_tier


def tensor_of(step: int, rank: int) -> torch.Tensor:
    return torch.randn(200, 500, generator=torch.Generator().manual_seed(100 * step + rank))


def tier_config(out: Path, node: int) -> s3_memory_tier.MemoryTier:
    return s3_memory_tier.MemoryTier(root=str(out / f"node{node}"), job="job-1", drain_every=10)


def load(url: str, key: str, expected: torch.Tensor, tier: Any) -> dict[str, Any]:
    reader = s3_dcp.S3StorageReader(url, chunk_size_MB=5, memory_tier=tier)
    target = {key: torch.zeros_like(expected)}
    try:
        dcp.load(target, storage_reader=reader)
    except BaseException as exc:  # DCP raises its CheckpointException (a BaseException) on every rank
        return {"error": str(exc)[-600:]}
    tiers = {u.rsplit("/", 1)[-1]: (s[1] if s else "s3") for u, s in reader.tier_sources.items()}
    return {"equal": bool(torch.equal(target[key], expected)), "tiers": tiers}


def two_nodes(bucket: str, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tier, key = tier_config(out, rank), f"rank{rank}"
    urls = [f"s3://{bucket}/run/step-{step}" for step in (1, 2)]
    for step, url in enumerate(urls, 1):
        writer = s3_dcp.S3StorageWriter(url, chunk_size_MB=5, memory_tier=tier)
        dcp.save({key: tensor_of(step, rank)}, storage_writer=writer)
    writer.finish_drains(drain_last=False)
    dist.barrier()
    result = {f"step{step}": load(url, key, tensor_of(step, rank), tier) for step, url in enumerate(urls, 1)}
    writer.finish_drains()  # the last save reaches S3
    dist.barrier()
    result["step2 drained"] = load(urls[1], key, tensor_of(2, rank), tier)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def replicated_tier(out: Path, node: int) -> s3_memory_tier.MemoryTier:
    return s3_memory_tier.MemoryTier(root=str(out / f"node{node}"), job="job-1", drain_every=10, keep=2)


def replicated_save(bucket: str, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tier, key = replicated_tier(out, rank), f"rank{rank}"
    for step in (1, 2, 3):
        writer = s3_dcp.S3StorageWriter(f"s3://{bucket}/run/step-{step}", chunk_size_MB=5, memory_tier=tier)
        if step == 1:
            s3_dcp_tier.start_replication(writer)
        dcp.save({key: tensor_of(step, rank)}, storage_writer=writer)
        writer.finish_drains(drain_last=False)  # its drain (step 1's) and replication done: `keep` counts no pending
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # killed: no teardown, steps 2 and 3 are in memory (and on the other node) only


def relaunch(bucket: str, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tier, key = replicated_tier(out, rank), f"rank{rank}"
    reader = s3_dcp.S3StorageReader(f"s3://{bucket}/run/step-2", chunk_size_MB=5, memory_tier=tier)
    s3_dcp_tier.start_replication(reader)
    result: dict[str, Any] = {"step 2": load(reader.path, key, tensor_of(2, rank), tier)}  # chosen by hand
    if rank == 0:  # node 0's memory lost again: what that load fetched into it goes
        node = s3_dcp_tier.tier_of(tier, reader.s3).node
        for copy in node.copies():
            node.remove(copy.url)
    agreement = s3_dcp_tier.agree_resume(reader, f"s3://{bucket}/run", lambda name: int(name.split("-")[1]))
    result["agreed"] = {"step": agreement.step, "steps": agreement.steps, "url": agreement.url, "via": agreement.tier,
                        **load(agreement.url, key, tensor_of(agreement.step, rank), tier)}  # fmt: skip
    dist.barrier()  # no server goes away while the other node still fetches from it
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    modes = {
        "two-nodes": two_nodes,
        "replicated-save": replicated_save,
        "relaunch": relaunch,
    }
    modes[sys.argv[1]](sys.argv[2], Path(sys.argv[3]))
