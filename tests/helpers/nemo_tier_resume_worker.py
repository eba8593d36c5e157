"""One rank of a two-node Lightning DDP job (gloo, CPU) with a memory tier, resumed the way NeMo's exp_manager
resumes; for tests/test_memory_tier_resume.py.

    python nemo_tier_resume_worker.py DIRPATH OUT_DIR save
    python nemo_tier_resume_worker.py DIRPATH OUT_DIR resume

Each rank is a node of its own (``GROUP_RANK``) with its tier root ``OUT_DIR/node<rank>``, wired from a NeMo-style
config (``s3_checkpointing: memory_tier:``). ``save``, node 0 alone (in DDP only rank 0 saves): a ``*-last``
checkpoint every 2 steps, the first drained to S3, the next kept in node 0's memory only (no replication); the job
is killed right after step 4's checkpoint (no teardown, so it is not drained). ``resume``, both nodes:
`connector.check_resume` with ``resume_if_exists`` before the process group exists (as exp_manager calls it;
strict: no fallback past a checkpoint that fails to load), then a fit to step 6. Writes ``OUT_DIR/rank<N>.json``:
what the rank resumed from, and from which tier.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl
from tiny_lightning import close_process_group, tiny_module_class, tiny_trainer

import connector


class KillAfterStep4(pl.Callback):
    """Ends every rank of the save job once step 4's checkpoint is in memory: no teardown, no drain to S3."""

    def __init__(self, checkpoint_io: object) -> None:
        self.checkpoint_io = checkpoint_io

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == 4:
            self.checkpoint_io.wait_for_pending_saves()  # type: ignore[attr-defined]
            os._exit(0)


def main() -> None:
    dirpath, out, phase = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    rank = int(os.environ["RANK"])
    config = {
        "s3_checkpointing": {
            "memory_tier": {"root": str(out / f"node{rank}"), "job": "job-1", "drain_every": 10},
            "enable_async_checkpointing": False,
        },
        "exp_manager": {
            "checkpoint_callback_params": {
                "dirpath": dirpath, "filename": "tiny-{step}", "save_top_k": 0, "save_last": True,
                "every_n_train_steps": 2,
            },
        },
    }  # fmt: skip
    module = tiny_module_class(pl, outputs=2, seed=1234 + rank)()  # different weights on each rank until restored
    if phase == "save":  # node 0 alone, as in DDP only rank 0 saves
        trainer = tiny_trainer(pl, 6)
        parts = connector.configure_s3_checkpointing(trainer, config)
        trainer.callbacks.append(KillAfterStep4(parts.checkpoint_io))
        trainer.fit(module)
        raise AssertionError("the save job was to end at step 4")
    trainer = tiny_trainer(pl, 6, strategy="ddp", devices=1, num_nodes=2)
    parts = connector.configure_s3_checkpointing(trainer, config)
    found = connector.check_resume(trainer, dirpath=dirpath, resume_if_exists=True, resume_fallback=False)
    trainer.fit(module)
    start = module.started_at
    report = {
        "check_resume": found,
        "ckpt_path": start["ckpt_path"],
        "global_step": start["global_step"],
        "weights": {name: tensor.tolist() for name, tensor in start["weights"].items()},
        "loads": [(record.url, record.tier) for record in parts.checkpoint_io.records if record.kind == "load"],
        "end": trainer.global_step,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    close_process_group()


if __name__ == "__main__":
    main()
