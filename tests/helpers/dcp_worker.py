"""Multi-rank DCP scenarios for tests/test_dcp_dist.py: ``python -m dcp_worker --world-size N --scenarios a,b ...``.

Spawns N gloo ranks on 127.0.0.1 that run the scenarios in order on one process group (starting ranks is the slow
part, so one group serves many cases). Each rank writes ``<out>/<scenario>-rank<r>.json`` with its outcome; the test
asserts on those files and on what the server holds. The model is FSDP2 (``fully_shard``) on CPU, its state taken
with ``torch.distributed.checkpoint.state_dict`` helpers; the reference (full, unsharded) state of the first save is
written to ``<out>/reference.pt`` so loads at other world sizes can be compared with it bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

HIDDEN = 1024  # two 1024x1024 layers: 8 MiB of weights, 24 MiB with Adam's state; 12 MiB per rank at 2 ranks


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _model(seed: int, world_size: int) -> tuple[Any, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 8))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optimizer


def _train(model: Any, optimizer: Any, steps: int, seed: int = 123) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = torch.randn(4, HIDDEN, generator=generator)
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _sharded_state(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "extra": {"step": 2, "note": "dcp"}}


def _full_state(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optim": optim_state}


def _apply(model: Any, optimizer: Any, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def differences(actual: Any, expected: Any, where: str = "") -> list[str]:
    """Where two nested states differ (dict keys, lengths, tensor dtypes and values, other values); [] if nowhere."""
    import torch

    if isinstance(expected, dict):
        if set(actual) != set(expected):
            return [f"{where}: keys {sorted(map(str, actual))} != {sorted(map(str, expected))}"]
        return [d for key in expected for d in differences(actual[key], expected[key], f"{where}.{key}")]
    if isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            return [f"{where}: length {len(actual)} != {len(expected)}"]
        pairs = enumerate(zip(actual, expected, strict=True))
        return [d for n, (a, e) in pairs for d in differences(a, e, f"{where}[{n}]")]
    if isinstance(expected, torch.Tensor):
        same = isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype and torch.equal(actual, expected)
        return [] if same else [f"{where}: tensors differ"]
    return [] if actual == expected else [f"{where}: {actual!r} != {expected!r}"]


def flat_tensors(value: Any, prefix: str = "") -> dict[str, Any]:
    """The tensors of a nested state dict under DCP's flattened keys (mapping keys and list indexes joined by ".")."""
    import torch

    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    flat: dict[str, Any] = {}
    for key, item in items:
        flat.update(flat_tensors(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat


class Context:
    def __init__(self, args: argparse.Namespace, rank: int, world_size: int) -> None:
        import torch.distributed as dist

        import s3_utils

        self.args = args
        self.rank = rank
        self.world_size = world_size
        self.out = Path(args.out)
        self.base = args.base.rstrip("/")
        self.settings = s3_utils.S3ClientSettings(endpoint_url=args.endpoint, user_agent_extra=f"dcp-rank-{rank}")
        self.async_group = dist.new_group(backend="gloo")
        self.retry_policy = s3_utils.RetryPolicy(
            max_attempts=3, max_elapsed_s=20, initial_backoff_s=0.05, max_backoff_s=0.2
        )

    def writer(self, name: str, **kwargs: Any) -> Any:
        import s3_dcp

        kwargs.setdefault("chunk_size_MB", 5)
        kwargs.setdefault("max_write_concurrency", 3)
        return s3_dcp.S3StorageWriter(
            f"{self.base}/{name}", client_settings=self.settings, retry_policy=self.retry_policy, **kwargs
        )

    def reader(self, name: str, **kwargs: Any) -> Any:
        import s3_dcp

        kwargs.setdefault("chunk_size_MB", 5)
        kwargs.setdefault("max_read_concurrency", 4)
        return s3_dcp.S3StorageReader(
            f"{self.base}/{name}", client_settings=self.settings, retry_policy=self.retry_policy, **kwargs
        )

    def load_and_compare(self, reader: Any) -> dict[str, Any]:
        import torch
        import torch.distributed.checkpoint as dcp

        model, optimizer = _model(seed=99, world_size=self.world_size)  # different weights until loaded
        _train(model, optimizer, 1, seed=7)  # optimizer state exists, with the wrong values
        state = _sharded_state(model, optimizer)
        state["extra"] = {"step": -1, "note": ""}
        from read_counts import counting_reads

        with counting_reads() as counts:
            dcp.load(state, storage_reader=reader)
        _apply(model, optimizer, state)
        full = _full_state(model, optimizer)  # gathered on rank 0 only
        found = differences(state["extra"], {"step": 2, "note": "dcp"})
        if self.rank == 0:
            found += differences(full, torch.load(self.out / "reference.pt", weights_only=True))
        return {"differences": found[:5], "stats": counts}


def scenario_save(ctx: Context) -> dict[str, Any]:
    """FSDP2 model + optimizer saved by every rank; the full state is kept as the reference."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    model, optimizer = _model(seed=0, world_size=ctx.world_size)
    _train(model, optimizer, 2)
    dcp.save(_sharded_state(model, optimizer), storage_writer=ctx.writer("fsdp"))
    full = _full_state(model, optimizer)
    if ctx.rank == 0:
        torch.save(full, ctx.out / "reference.pt")
    dist.barrier()
    return {}


def scenario_load(ctx: Context) -> dict[str, Any]:
    """Every tensor item may go straight into its target here (`scenario_load_again` keeps the default threshold,
    so both read paths run at every world size that loads)."""
    return ctx.load_and_compare(ctx.reader("fsdp", direct_read_min_MB=0))


def _async(ctx: Context, kind: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    model, optimizer = _model(seed=0, world_size=ctx.world_size)
    _train(model, optimizer, 2)
    executor = AsyncCheckpointerType.PROCESS if kind == "process" else AsyncCheckpointerType.THREAD
    future = dcp.async_save(
        _sharded_state(model, optimizer),
        storage_writer=ctx.writer(f"async-{kind}"),
        async_checkpointer_type=executor,
        process_group=ctx.async_group,  # training's collectives keep the default group meanwhile
    )
    _train(model, optimizer, 1, seed=5)  # training goes on: the checkpoint must hold the staged state
    future.result()
    return ctx.load_and_compare(ctx.reader(f"async-{kind}"))


def scenario_async_thread(ctx: Context) -> dict[str, Any]:
    return _async(ctx, "thread")


def scenario_async_process(ctx: Context) -> dict[str, Any]:
    return _async(ctx, "process")


def scenario_no_collectives(ctx: Context) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    model, optimizer = _model(seed=0, world_size=ctx.world_size)
    _train(model, optimizer, 2)
    dcp.save(_sharded_state(model, optimizer), storage_writer=ctx.writer("no-collectives"), use_collectives=False)
    return ctx.load_and_compare(ctx.reader("no-collectives"))


def scenario_spread(ctx: Context) -> dict[str, Any]:
    """Each rank's shard in a prefix of its own (``run/s3ckpt-spread-0R/spread/``), with and without collectives."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = _model(seed=0, world_size=ctx.world_size)
    _train(model, optimizer, 2)
    for name, collectives in (("spread", True), ("spread-no-collectives", False)):
        writer = ctx.writer(name, prefix_spreading=ctx.world_size)
        dcp.save(_sharded_state(model, optimizer), storage_writer=writer, use_collectives=collectives)
    return {name: ctx.load_and_compare(ctx.reader(name)) for name in ("spread", "spread-no-collectives")}


def scenario_from_torch_writer(ctx: Context) -> dict[str, Any]:
    """torch's FileSystemWriter saves locally, rank 0 uploads the files, our reader loads them."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import s3_utils

    local = ctx.out / "torch-written"
    model, optimizer = _model(seed=0, world_size=ctx.world_size)
    _train(model, optimizer, 2)
    dcp.save(_sharded_state(model, optimizer), storage_writer=dcp.FileSystemWriter(str(local)))
    if ctx.rank == 0:
        utils = s3_utils.S3Utils(ctx.settings)
        for path in local.iterdir():
            utils.upload_file(path, f"{ctx.base}/torch-written/{path.name}")
    dist.barrier()
    return ctx.load_and_compare(ctx.reader("torch-written"))


def scenario_to_torch_reader(ctx: Context) -> dict[str, Any]:
    """Our checkpoint, copied to a local directory, loads with torch's FileSystemReader."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import s3_utils

    local = ctx.out / f"downloaded-{ctx.world_size}"
    if ctx.rank == 0:
        local.mkdir()
        utils = s3_utils.S3Utils(ctx.settings)
        for obj in utils.list_objects(f"{ctx.base}/fsdp"):
            utils.download_s3_file_to_path(obj.url, local / obj.key.rsplit("/", 1)[-1])
    dist.barrier()
    return ctx.load_and_compare(dcp.FileSystemReader(str(local)))


def scenario_faulty_rank(ctx: Context) -> dict[str, Any]:
    """The test makes every upload of rank 1's shard under ``faulty/`` fail; every rank must see the failure."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    model, optimizer = _model(seed=0, world_size=ctx.world_size)
    _train(model, optimizer, 2)
    try:
        dcp.save(_sharded_state(model, optimizer), storage_writer=ctx.writer("faulty"))
    except CheckpointException as exc:
        return {
            "raised": "CheckpointException",
            "failed_ranks": sorted(exc.failures),
            "causes": ["".join(traceback.format_exception_only(e)) for e, _ in exc.failures.values()],
        }
    return {"raised": None}


def tensor_parallel_reference() -> tuple[Any, Any]:
    """The full tensors `scenario_convert` saves split by columns (bfloat16) and replicated."""
    import torch

    generator = torch.Generator().manual_seed(5)
    return torch.randn(6, 10, generator=generator).to(torch.bfloat16), torch.randn(3, 3, generator=generator)


CONVERSIONS = [
    ("fsdp", "exports/fsdp.safetensors"),
    ("fsdp", "exports/fsdp.pt"),
    ("tp", "exports/tp.safetensors"),
    ("tp", "exports/tp.pt"),
    ("exports/fsdp.pt", "fsdp-from-pt"),
]
"""What `scenario_convert` converts, under the run's base prefix: the 2-rank FSDP2 checkpoint of `scenario_save`
(row shards), a tensor-parallel one (column shards, replicated), and one converted file back into DCP."""


def scenario_convert(ctx: Context) -> dict[str, Any]:
    """Every rank saves a DTensor split by columns and a replicated one; rank 0 then runs `CONVERSIONS`."""
    import dataclasses

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import s3_checkpoint_convert
    import s3_utils

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    column, replicated = tensor_parallel_reference()
    state = {
        "tp": {
            "column": distribute_tensor(column, mesh, [Shard(1)]),
            "replicated": distribute_tensor(replicated, mesh, [Replicate()]),
        },
        "note": "tp",
    }
    dcp.save(state, storage_writer=ctx.writer("tp"))
    reports = {}
    if ctx.rank == 0:
        utils = s3_utils.S3Utils(ctx.settings, ctx.retry_policy)
        for src, dst in CONVERSIONS:
            report = s3_checkpoint_convert.convert_checkpoint(
                f"{ctx.base}/{src}", f"{ctx.base}/{dst}", s3_utils=utils, chunk_size_MB=5, max_read_concurrency=4
            )
            reports[dst] = dataclasses.asdict(report)
    dist.barrier()
    return {"reports": reports}


def scenario_load_converted(ctx: Context) -> dict[str, Any]:
    """The checkpoint `scenario_convert` made from one .pt file, loaded into the sharded model at every rank."""
    return ctx.load_and_compare(ctx.reader("fsdp-from-pt"))


def scenario_load_again(ctx: Context) -> dict[str, Any]:
    """The first checkpoint, loaded again after the failed save."""
    return ctx.load_and_compare(ctx.reader("fsdp"))


SCENARIOS = {name[len("scenario_") :]: fn for name, fn in globals().items() if name.startswith("scenario_")}


@contextlib.contextmanager
def _warnings_logged() -> Iterator[list[str]]:
    """The package's log records at WARNING and above while the block runs, as text."""
    logged: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(f"{record.name}: {record.getMessage()}")

    handler = Keep(logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield logged
    finally:
        root.removeHandler(handler)


def run_scenarios(scenarios: dict[str, Any], names: str, ctx: Any, rank: int) -> None:
    """Run the comma-separated `names` of `scenarios` on this rank, in order: each outcome (or its error and
    traceback) goes to ``{ctx.out}/{name}-rank{rank}.json``, and the ranks meet after each one, so a failing
    scenario does not stop the others (mcore_worker runs its scenarios the same way)."""
    import torch.distributed as dist

    for name in names.split(","):
        started = time.monotonic()
        with _warnings_logged() as logged:
            try:
                outcome = {"ok": True, **scenarios[name](ctx)}
            except BaseException as exc:
                outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        outcome["seconds"] = round(time.monotonic() - started, 2)
        outcome["warnings"] = logged  # what the package warned about meanwhile: a failed check's first clue
        (ctx.out / f"{name}-rank{rank}.json").write_text(json.dumps(outcome, default=str))
        dist.barrier()


def _rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(args.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    ctx = Context(args, rank, args.world_size)
    try:
        run_scenarios(SCENARIOS, args.scenarios, ctx, rank)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--scenarios", required=True, help=f"comma-separated, from {sorted(SCENARIOS)}")
    parser.add_argument("--base", required=True, help="s3:// prefix under which checkpoints go")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--out", required=True, help="local directory for outcomes and the reference state")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    import torch.multiprocessing as mp

    started = time.monotonic()
    if args.world_size == 1:  # in this process: a spawned one would import torch and the rest once more
        _rank_main(0, args, _free_port())
    else:
        mp.spawn(_rank_main, args=(args, _free_port()), nprocs=args.world_size, join=True)
    shutil.rmtree(Path(args.out) / "torch-written", ignore_errors=True)
    print(f"{args.world_size} ranks ran {args.scenarios} in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
