"""One rank of a CPU DDP job (gloo) that checkpoints to S3 and resumes; started once per rank by test_connector_ddp.py.

The parent sets the torchrun-style environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT), so Lightning takes the processes as created externally and does not re-execute this
script. Every S3 request of this process carries ``rank/<N>`` (S3ClientSettings.user_agent_extra, for boto3) and
``app/rank-<N>`` (AWS_SDK_UA_APP_ID, which s3fs's aiobotocore honours too), so the fault proxy can attribute it.

Modes (``--mode``):
  train         fit from scratch (S3 wiring from a NeMo-style config)
  check_resume  fit with exp_manager.resume_if_exists=True: rank 0 finds the checkpoint, the others get it broadcast
  last          fit(ckpt_path="last") with the S3-aware connector and ModelCheckpoint
  stock_last    fit(ckpt_path="last") with Lightning's own connector and ModelCheckpoint (the behaviour being fixed)

Writes ``<out>/rank<N>.json``: what this rank saw when training (re)started and when it ended.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["train", "check_resume", "last", "stock_last"], required=True)
    parser.add_argument("--dirpath", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])

    import lightning.pytorch as pl
    from tiny_lightning import TOP_K_CHECKPOINT, close_process_group, tiny_module_class, tiny_trainer

    import connector
    from s3_checkpoint_io import S3CheckpointIO
    from s3_fencing import current_run
    from s3_utils import S3ClientSettings

    # Weights differ on every rank (only a real restore makes them agree); 256 rows give 16+ batches per rank and
    # epoch, so no epoch ends within 6 steps whatever the world size.
    TinyModule = tiny_module_class(pl, outputs=2, seed=1234 + rank, samples=256, data_seed=7)

    config = {
        "s3_checkpointing": {
            "max_write_concurrency": 2,
            "max_read_concurrency": 2,
            "chunk_size_MB": 5,
            "enable_async_checkpointing": False,
        },
        "exp_manager": {
            "resume_if_exists": args.mode == "check_resume",
            "checkpoint_callback_params": {**TOP_K_CHECKPOINT, "dirpath": args.dirpath, "filename": "tiny--{step}"},
        },
    }
    settings = S3ClientSettings(user_agent_extra=f"rank/{rank}", max_pool_connections=8)
    trainer_kwargs = dict(strategy="ddp", devices=world_size, num_nodes=1)
    ckpt_path = "last" if args.mode in ("last", "stock_last") else None
    if args.mode == "stock_last":
        callback = pl.callbacks.ModelCheckpoint(
            dirpath=args.dirpath, filename="tiny--{step}", save_last=True, every_n_train_steps=2
        )
        checkpoint_io = S3CheckpointIO(args.dirpath, chunk_size_MB=5, client_settings=settings)
        trainer = tiny_trainer(pl, args.max_steps, plugins=[checkpoint_io], callbacks=[callback], **trainer_kwargs)
    else:
        trainer = tiny_trainer(pl, args.max_steps, **trainer_kwargs)
        connector.configure_s3_checkpointing(trainer, config, client_settings=settings)

    model = TinyModule()
    trainer.fit(model, ckpt_path=ckpt_path)
    report: dict = {
        "end": {"global_step": trainer.global_step, "rank": trainer.global_rank},
        "connector": type(trainer._checkpoint_connector).__name__,
        "run": current_run().run_id,  # no launcher variable names the launch: rank 0's run, shared in setup
    }
    start = model.started_at
    if start is not None:  # training ran
        report["start"] = {
            "global_step": start["global_step"],
            "ckpt_path": start["ckpt_path"],
            "weights": {name: tensor.tolist() for name, tensor in start["weights"].items()},
            "exp_avg": {str(k): state["exp_avg"].tolist() for k, state in start["optimizer_state"].items()},
        }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))
    close_process_group()


if __name__ == "__main__":
    main()
