"""One rank of the FSDP1-on-CPU check for tests/test_dcp_lightning.py (``python -m fsdp1_cpu_worker ...``).

Lightning's ``FSDPStrategy`` needs a CUDA accelerator, but torch's FSDP1 itself runs on CPU with gloo. This worker
drives a real `S3FSDPStrategy` without a Trainer: the module is FSDP1-wrapped (FULL_SHARD, ``device_id=cpu``) and
handed to the strategy as a Trainer would (``model``, ``optimizers``, cluster environment); Lightning's own
``lightning_module_state_dict`` / ``optimizer_state`` build the sharded checkpoint, the strategy's ``save_checkpoint``
writes it to S3, and a fresh strategy with fresh weights and optimizer loads it back through ``load_checkpoint``
(``_load_sharded_fsdp1``). Each rank writes its local shards of both states (model and optimizer) to
``<out>/saved-rank<r>.pt`` and ``<out>/loaded-rank<r>.pt`` (gathering a full state dict of an FSDP1 module on CPU
crashes torch 2.13 in FSDP's own state-dict hook, so the comparison is shard by shard).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")


class _ModuleSettings:
    """What the strategy reads from its LightningModule when loading (``strict_loading``)."""

    strict_loading = True


def _strategy(model: Any, optimizer: Any, endpoint: str) -> Any:
    from lightning.fabric.plugins.environments import LightningEnvironment

    import s3_dcp
    import s3_utils

    strategy = s3_dcp.S3FSDPStrategy(
        state_dict_type="sharded",
        chunk_size_MB=5,
        max_read_concurrency=2,
        max_write_concurrency=2,
        client_settings=s3_utils.S3ClientSettings(endpoint_url=endpoint),
        retry_policy=s3_utils.RetryPolicy(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.2),
    )
    environment = LightningEnvironment()
    environment.set_global_rank(int(os.environ["RANK"]))
    environment.set_world_size(int(os.environ["WORLD_SIZE"]))
    strategy.cluster_environment = environment
    strategy.model = model
    strategy._lightning_module = _ModuleSettings()
    strategy.optimizers = [optimizer]
    return strategy


def _fsdp1_model(seed: int) -> tuple[Any, Any]:
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8))
    model = FullyShardedDataParallel(module, device_id=torch.device("cpu"), use_orig_params=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(seed + 1)
    for _ in range(2):  # optimizer state exists
        optimizer.zero_grad()
        model(torch.randn(8, 64, generator=generator)).pow(2).mean().backward()
        optimizer.step()
    return model, optimizer


def _local_shards(model: Any, optimizer: Any) -> dict[str, Any]:
    """This rank's shards of the model and optimizer state, as plain tensors."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def local(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: local(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [local(v) for v in value]
        if hasattr(value, "local_shards"):  # ShardedTensor
            return [shard.tensor.clone() for shard in value.local_shards()]
        if hasattr(value, "to_local"):  # DTensor
            return value.to_local().clone()
        return value.clone() if isinstance(value, torch.Tensor) else value

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": local(model_state), "optim": local(optim_state)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        model, optimizer = _fsdp1_model(seed=0)
        strategy = _strategy(model, optimizer, args.endpoint)
        checkpoint = {
            "state_dict": strategy.lightning_module_state_dict(),
            "optimizer_states": [strategy.optimizer_state(optimizer)],
            "global_step": 2,
        }
        strategy.save_checkpoint(checkpoint, args.url)
        saved = _local_shards(model, optimizer)

        fresh_model, fresh_optimizer = _fsdp1_model(seed=7)  # other weights and optimizer state until loaded
        fresh = _strategy(fresh_model, fresh_optimizer, args.endpoint)
        meta = fresh.load_checkpoint(args.url)
        loaded = _local_shards(fresh_model, fresh_optimizer)
        torch.save(saved, out / f"saved-rank{rank}.pt")
        torch.save(loaded, out / f"loaded-rank{rank}.pt")
        if rank == 0:
            (out / "global_step").write_text(str(meta["global_step"]))
        for used in (strategy, fresh):
            used.s3_checkpoint_io.teardown()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
