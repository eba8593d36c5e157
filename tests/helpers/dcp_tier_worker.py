"""A process of a DCP job with a memory tier, for tests/test_dcp_tier.py (gloo, CPU).

    python dcp_tier_worker.py two-nodes BUCKET OUT_DIR   # one of two ranks, each a node (GROUP_RANK) of its own

two-nodes: every rank saves its own tensor into step 1 (drained: the first save) and step 2 (memory only), waits for
its drains, loads step 1 (its file from its node's memory, the rest where it is), tries step 2 (only node 0 holds
its .metadata: every rank fails alike), drains the last save and loads step 2 from S3. Writes OUT_DIR/rank<N>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import s3_dcp
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


if __name__ == "__main__":
    {"two-nodes": two_nodes}[sys.argv[1]](sys.argv[2], Path(sys.argv[3]))
