"""One rank of a two-node job with a memory tier and replication, for tests/test_memory_tier.py (gloo, CPU).

    python tier_dist_worker.py BUCKET OUT_DIR

Each rank is a node of its own (``GROUP_RANK``) with its own tier root ``OUT_DIR/node<rank>``. Rank 0 saves steps 1
and 2 (step 1 drains to S3, step 2 stays in memory and is replicated to node 1). Then every rank loads, collectively,
step 2 (only node 0 holds it in memory and S3 does not: every rank must fail alike) and step 1 (on S3: every rank
reads it from there, since node 1 has no memory copy). Writes ``OUT_DIR/rank<N>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from lightning_stand_in import stand_in_for_lightning

from s3_checkpoint_io import S3CheckpointIO
from s3_memory_tier import MemoryTier


def main() -> None:
    stand_in_for_lightning()  # no Trainer here: S3CheckpointIO need not import Lightning (lightning_stand_in.py)
    bucket, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plugin = S3CheckpointIO(memory_tier=MemoryTier(root=str(out / f"node{rank}"), job="job-1", drain_every=100))
    plugin.start_replication()
    urls = [f"s3://{bucket}/run/step={step}-last.ckpt" for step in (1, 2)]
    states = [{"w": torch.full((1 << 16,), float(step)), "global_step": step} for step in (1, 2)]
    if rank == 0:
        for state, url in zip(states, urls, strict=True):
            plugin.save_checkpoint(state, url)
    plugin.wait_for_pending_saves()
    dist.barrier()
    result: dict[str, object] = {"node": os.environ["GROUP_RANK"]}
    tier = plugin.node_tier()
    result["own"] = [copy.url for copy in tier.copies()]
    result["replicas"] = sorted(str(p.relative_to(tier.replicas)) for p in tier.replicas.rglob("*") if p.is_file())
    result["loads"] = []
    for url, state in zip(reversed(urls), reversed(states), strict=True):
        try:
            with plugin.collective_load():
                loaded = plugin.load_checkpoint(url)
            result["loads"].append([url, bool(torch.equal(loaded["w"], state["w"])), plugin.records[-1].tier])
        except FileNotFoundError:
            result["loads"].append([url, "missing", None])
    dist.barrier()
    plugin.teardown()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
