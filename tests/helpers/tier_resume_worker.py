"""One rank of a two-node job that saves into the memory tier, or resumes from it, for
tests/test_memory_tier_resume.py (gloo, CPU).

    python tier_resume_worker.py BUCKET OUT_DIR save DRAIN_EVERY STEP...
    python tier_resume_worker.py BUCKET OUT_DIR resume

Each rank is a node of its own (``GROUP_RANK``) with its tier root ``OUT_DIR/node<rank>`` and its part of the
checkpoint under ``s3://BUCKET/run/rank<rank>/``. ``save``: every rank saves the steps (the first, then every
DRAIN_EVERY-th, drains to S3), each replicated to the other node, then the process ends without its teardown (a kill:
the newest step is not drained). ``resume``: every rank agrees on the step (`S3CheckpointIO.agree_resume`) and loads
its part; writes ``OUT_DIR/rank<N>.json`` (step, URL, the tier it read, whether the state is bit-identical).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from lightning_stand_in import stand_in_for_lightning

import connector
from s3_checkpoint_io import S3CheckpointIO
from s3_memory_tier import MemoryTier


def state(rank: int, step: int) -> dict[str, object]:
    generator = torch.Generator().manual_seed(100 * rank + step)
    return {"w": torch.randn(1 << 16, generator=generator), "global_step": step}


def main() -> None:
    stand_in_for_lightning()  # no Trainer here: S3CheckpointIO need not import Lightning (lightning_stand_in.py)
    bucket, out, phase = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    drain_every = int(sys.argv[4]) if phase == "save" else 1
    tier = MemoryTier(root=str(out / f"node{rank}"), job="job-1", keep=3, drain_every=drain_every)
    plugin = S3CheckpointIO(memory_tier=tier)
    plugin.start_replication()
    directory = f"s3://{bucket}/run/rank{rank}"
    if phase == "save":
        for step in map(int, sys.argv[5:]):
            plugin.save_checkpoint(state(rank, step), f"{directory}/step={step}.ckpt")
        plugin.wait_for_pending_saves()
        dist.barrier()
        dist.destroy_process_group()
        os._exit(0)  # killed after the saves: no teardown, the newest step stays in memory only
    agreement = plugin.agree_resume(directory, connector.checkpoint_step)
    loaded = plugin.load_checkpoint(agreement.url)
    expected = state(rank, agreement.step)
    result = {
        "step": agreement.step,
        "steps": agreement.steps,
        "url": agreement.url,
        "tier": plugin.records[-1].tier,
        "via": agreement.tier,
        "equal": bool(torch.equal(loaded["w"], expected["w"])) and loaded["global_step"] == agreement.step,
        "own": [copy.url for copy in plugin.node_tier().copies()],
        "discovered": sorted(c.url for c in connector.list_resume_candidates(directory, include_steps=True)),
    }
    dist.barrier()
    plugin.teardown()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
