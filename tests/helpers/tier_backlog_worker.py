"""One rank of a two-node job whose replication cannot keep up, for tests/test_memory_tier_resume.py (gloo, CPU).

    python tier_backlog_worker.py BUCKET OUT_DIR SAVES

Each rank is a node of its own (``GROUP_RANK``) with its tier under ``OUT_DIR/node<rank>`` and replication on. After
the start, node 1 stops itself (SIGSTOP: its replica server accepts connections but answers nothing, as a peer
under a long pause or a slow network would), and node 0 saves ``SAVES`` checkpoints into memory (``keep=2``), then
writes ``OUT_DIR/rank0.json``: how many committed copies its tier holds after each save. It exits without teardown
(which would wait for the stalled sends); the test kills node 1.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from lightning_stand_in import stand_in_for_lightning

from s3_checkpoint_io import S3CheckpointIO
from s3_memory_tier import MemoryTier


def main() -> None:
    stand_in_for_lightning()  # no Trainer here: S3CheckpointIO need not import Lightning (lightning_stand_in.py)
    bucket, out, saves = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tier = MemoryTier(root=str(out / f"node{rank}"), job="job-1", keep=2, drain_every=1000)
    plugin = S3CheckpointIO(memory_tier=tier)
    plugin.start_replication()
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    held = []
    for step in range(1, saves + 1):
        state = {"w": torch.full((1 << 16,), float(step)), "global_step": step}
        plugin.save_checkpoint(state, f"s3://{bucket}/run/step={step}.ckpt")
        plugin.node_tier().wait_pruned()
        held.append(len(plugin.node_tier().copies()))
    (out / "rank0.json").write_text(json.dumps({"held": held}))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
