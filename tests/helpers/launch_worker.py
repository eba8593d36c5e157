"""The ranks of one launch, each saving its own checkpoints into ONE directory and removing its own older ones, for
tests/test_fencing.py: ``python launch_worker.py --launcher torchrun --world 4 --dir s3://bucket/run --out DIR``.

This process plays the launcher (a torchrun agent, or srun): it imports torch and the package once, then forks the
ranks, each with the environment that launcher gives its workers (``--launcher torchrun``: ``TORCHELASTIC_RUN_ID``
(``--run-id``; ``none`` is torchrun's default), ``TORCHELASTIC_RESTART_COUNT``, RANK, LOCAL_RANK, WORLD_SIZE, ...;
``--launcher slurm``: ``SLURM_JOB_ID``, ``SLURM_STEP_ID``, ``SLURM_PROCID``, ``SLURM_NTASKS``, ...). No rank has
asked for its run before its environment is set: each finds its run from that environment, as a real worker does.
Every rank, at the same instant (``--start-at``, epoch seconds):

1. saves ``rank<N>-step=1.ckpt`` then ``rank<N>-step=2.ckpt`` with `S3CheckpointIO` (``--mib`` each; 6: multipart);
2. removes its ``rank<N>-step=1.ckpt`` (a top-k clean-up of its own file).

Writes ``<out>/rank<N>.json``: its run id and, per step, None or the error (type and message).
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def launcher_environment(launcher: str, rank: int, args: argparse.Namespace) -> dict[str, str]:
    world, per_node = args.world, args.per_node
    node, local = divmod(rank, per_node)
    if launcher == "torchrun":
        return {
            "TORCHELASTIC_RUN_ID": args.run_id,
            "TORCHELASTIC_RESTART_COUNT": str(args.restart),
            "TORCHELASTIC_MAX_RESTARTS": "3",
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "RANK": str(rank),
            "LOCAL_RANK": str(local),
            "GROUP_RANK": str(node),
            "ROLE_RANK": str(rank),
            "ROLE_NAME": "default",
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_WORLD_SIZE": str(world // per_node),
            "ROLE_WORLD_SIZE": str(world),
        }
    if launcher == "slurm":
        return {
            "SLURM_JOB_ID": args.run_id,
            "SLURM_JOBID": args.run_id,
            "SLURM_STEP_ID": "0",
            "SLURM_STEPID": "0",
            "SLURM_RESTART_COUNT": str(args.restart),
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(local),
            "SLURM_NODEID": str(node),
            "SLURM_NTASKS": str(world),
            "SLURM_NNODES": str(world // per_node),
            "SLURM_NTASKS_PER_NODE": str(per_node),
        }
    raise ValueError(f"unknown launcher {launcher!r}")


def run(args: argparse.Namespace, rank: int, report: dict[str, Any]) -> None:
    import torch

    from s3_checkpoint_io import S3CheckpointIO
    from s3_fencing import current_run
    from s3_utils import S3ClientSettings

    report["run"] = current_run().run_id
    settings = S3ClientSettings(user_agent_extra=f"rank/{rank}", connect_timeout_s=5)
    plugin = S3CheckpointIO(chunk_size_MB=5, client_settings=settings)
    payload = torch.full((max(16, int(args.mib * 2**20) // 4),), float(rank))
    first, second = f"{args.dir}/rank{rank}-step=1.ckpt", f"{args.dir}/rank{rank}-step=2.ckpt"
    time.sleep(max(0.0, args.start_at - time.time()))  # every rank at the same instant

    def step(name: str, action: Any) -> None:
        try:
            action()
            report["steps"][name] = None
        except Exception as exc:
            report["steps"][name] = {"type": type(exc).__name__, "message": f"{exc}"[:2000]}

    step("save1", lambda: plugin.save_checkpoint({"rank": rank, "step": 1, "w": payload}, first))
    step("save2", lambda: plugin.save_checkpoint({"rank": rank, "step": 2, "w": payload}, second))
    step("remove1", lambda: plugin.remove_checkpoint(first))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--launcher", choices=["torchrun", "slurm"], required=True)
    parser.add_argument("--run-id", required=True, help="TORCHELASTIC_RUN_ID or SLURM_JOB_ID")
    parser.add_argument("--restart", type=int, default=0)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--per-node", type=int, default=4)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--mib", type=float, default=0.0)
    args = parser.parse_args()
    from lightning_stand_in import stand_in_for_lightning

    stand_in_for_lightning()  # no Trainer here: the forked ranks' S3CheckpointIO need not import Lightning
    import torch  # noqa: F401
    from throttle_worker import fork_ranks

    import s3_checkpoint_io  # noqa: F401

    args.start_at = time.time() + 1.0
    fork_ranks(
        args.world,
        lambda rank: launcher_environment(args.launcher, rank, args),
        lambda rank, report: run(args, rank, report),
        args.out,
        error_code=0,  # a rank's error is read from its report
    )


if __name__ == "__main__":
    main()
