"""One rank of a Lightning run for tests/test_dcp_lightning.py (``python -m dcp_lightning_worker ...``).

The test starts one process per rank with ``LOCAL_RANK``/``NODE_RANK``/``WORLD_SIZE``/``MASTER_*`` set, as a
launcher would, so Lightning does not re-launch the script. Phase ``fit`` trains an FSDP2 (``fully_shard``) module
with `S3ModelParallelStrategy` on CPU (``--strategy model_parallel``, 2 ranks) or a module FSDP1 wraps with
`S3FSDPStrategy(state_dict_type="sharded")` on GPUs (``--strategy fsdp``), and a ``ModelCheckpoint`` on an
``s3://`` dirpath; phase ``resume`` starts a fresh
Trainer from ``<dirpath>/last.ckpt``. Rank 0 writes the full (unsharded) state at the start and end of each phase to
``<out>/<phase>-start.pt`` / ``-end.pt`` for the test to compare. ``fit`` also saves a full (consolidated)
checkpoint; ``resume`` loads it back after training on (``full-loaded.pt``). With ``--memory-tier ROOT`` the strategy
saves through a memory tier under ROOT (a ``memory_tier`` config mapping; with ``--nodes 2`` each rank is a node of
its own, ``NODE_RANK``, with its tier under ``ROOT/node<NODE_RANK>``); rank 0 writes whether S3 had
``last.ckpt/.metadata`` when training ended, before teardown (``<phase>-s3-last-before-teardown``), each rank where its
loads read each file (``<phase>-sources-rank<r>.json``: the readers' ``tier_sources``), and no full checkpoint is made.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")


def _full_state(module: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(module, optimizer, options=options)
    return {"model": model_state, "optim": optim_state}


def build_module_class(pl: Any, out: Path, strategy_kind: str = "model_parallel") -> type:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class ShardedModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            if strategy_kind != "model_parallel":
                return  # FSDP1: the strategy wraps the whole module itself
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("gstep", float(self.global_step))
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.01)

        def train_dataloader(self) -> Any:
            data = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
            return DataLoader(TensorDataset(data), batch_size=4)

        def _record(self, name: str) -> None:
            """Rank 0 saves the full state as ``<out>/<name>.pt`` (every rank takes part in gathering it)."""
            wrapped = self if strategy_kind == "model_parallel" else self.trainer.strategy.model  # FSDP1's wrapper
            state = _full_state(wrapped, self.trainer.optimizers[0])  # collective: every rank takes part
            if self.global_rank == 0:
                torch.save({"global_step": self.global_step, **state}, out / f"{name}.pt")

        def on_train_start(self) -> None:
            self._record(f"{self.trainer.s3_phase}-start")

        def on_train_end(self) -> None:
            self._record(f"{self.trainer.s3_phase}-end")

    return ShardedModule


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", required=True, choices=["lightning.pytorch", "pytorch_lightning"])
    parser.add_argument("--phase", required=True, choices=["fit", "resume"])
    parser.add_argument("--dirpath", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="model_parallel", choices=["model_parallel", "fsdp"])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--prefix-spreading", type=int, default=None, help="the strategy's prefix_spreading")
    parser.add_argument("--memory-tier", default=None, help="the root of the strategy's memory tier")
    parser.add_argument("--nodes", type=int, default=1, help="the Trainer's num_nodes (devices: world size / nodes)")
    args = parser.parse_args(argv)
    out = Path(args.out)

    import torch
    from tiny_lightning import close_process_group

    import s3_dcp
    import s3_utils

    torch.set_num_threads(1)
    pl = importlib.import_module(args.family)
    s3_options = {
        "chunk_size_MB": 5,
        "max_write_concurrency": 2,
        "max_read_concurrency": 2,
        "retry_policy": s3_utils.RetryPolicy(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.2),
        "prefix_spreading": args.prefix_spreading,
    }
    if args.memory_tier:  # a config key's mapping; drains the first save, then only the last one (at teardown)
        root = Path(args.memory_tier) / f"node{os.environ['NODE_RANK']}" if args.nodes > 1 else args.memory_tier
        s3_options["memory_tier"] = {"root": str(root), "job": "job-1", "drain_every": 100, "keep": 4}
    strategy_class = s3_dcp.sharded_strategy_class(args.strategy, args.family)
    if args.strategy == "model_parallel":
        strategy = strategy_class(data_parallel_size=args.world_size, tensor_parallel_size=1, **s3_options)
    else:
        strategy = strategy_class(state_dict_type="sharded", **s3_options)
    readers: list[Any] = []
    make_reader = strategy.s3_storage_reader
    strategy.s3_storage_reader = lambda path: readers.append(make_reader(path)) or readers[-1]  # to see tier_sources

    class BeforeTeardown(pl.Callback):
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.global_rank == 0:
                on_s3 = strategy.s3.s3_path_exists(f"{args.dirpath}/last.ckpt/.metadata")
                (out / f"{args.phase}-s3-last-before-teardown").write_text(str(on_s3))

    checkpoint = pl.callbacks.ModelCheckpoint(
        dirpath=args.dirpath,
        filename="{step}",
        every_n_train_steps=2,
        save_top_k=2,
        monitor="gstep",
        mode="max",
        save_last=True,
    )
    trainer = pl.Trainer(
        accelerator="cpu" if args.strategy == "model_parallel" else "cuda",
        devices=args.world_size // args.nodes,
        num_nodes=args.nodes,
        strategy=strategy,
        max_steps=6 if args.phase == "fit" else 8,
        callbacks=[checkpoint, BeforeTeardown()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.s3_phase = args.phase
    module = build_module_class(pl, out, args.strategy)()
    ckpt_path = f"{args.dirpath}/last.ckpt" if args.phase == "resume" else None
    trainer.fit(module, ckpt_path=ckpt_path)
    if trainer.global_rank == 0:
        (out / f"{args.phase}-done-rank0").write_text(str(trainer.global_step))
    if args.memory_tier:
        loaded = [item for reader in readers for item in reader.tier_sources.items()]
        sources = {url: source[1] if source else "s3" for url, source in loaded}
        (out / f"{args.phase}-sources-rank{trainer.global_rank}.json").write_text(json.dumps(sources))
        close_process_group()
        return 0
    full_url = f"{args.dirpath}-full/consolidated.ckpt"
    if args.phase == "fit":  # also a full (consolidated) checkpoint of the final state, through S3CheckpointIO
        if args.strategy == "model_parallel":
            strategy._save_distributed_checkpoint = False
        else:
            strategy._state_dict_type = "full"
        trainer.save_checkpoint(full_url)
    else:  # after training on, the full checkpoint brings the end-of-fit state back
        checkpoint = strategy.load_checkpoint(full_url)
        module._record("full-loaded")
        if trainer.global_rank == 0:
            (out / "full-loaded-step").write_text(str(checkpoint["global_step"]))
    close_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    sys.exit(main())
