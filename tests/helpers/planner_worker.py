"""Two gloo ranks compare `s3_dcp.S3SavePlanner` / `S3LoadPlanner` with torch's default planners (run by
tests/test_dcp_planner.py): local and global save plans, ``.metadata`` and the shard files of a real ``dcp.save`` to
a local directory, local load plans, and a ``dcp.load`` back, for DTensors on a 1-D mesh of 2, 2-D meshes (2x1, 1x2)
and a 1-rank mesh: even and uneven splits, empty shards, Shard(1), Replicate, and a ``_StridedShard`` (torch's own
function plans that one). Each rank writes ``rank{n}.json``; the test asserts on it.

It also counts the calls of torch's ``compute_local_shape_and_global_offset`` (the function that builds an index
tensor per shard) during each planner's runs: the default planners call it per DTensor, ours only for the
``_StridedShard``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

WORLD_SIZE = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cases() -> list[tuple[str, tuple[int, ...], str, list[Any]]]:
    """(name, global shape, mesh name, placements)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return [
        ("even_1d", (8,), "line", [Shard(0)]),
        ("uneven_1d", (7,), "line", [Shard(0)]),
        ("empty_shard", (1,), "line", [Shard(0)]),
        ("zero_elements", (0,), "line", [Shard(0)]),
        ("uneven_rows", (7, 3), "line", [Shard(0)]),
        ("columns", (3, 5), "line", [Shard(1)]),
        ("replicated", (4, 4), "line", [Replicate()]),
        ("twice_dim0_2x1", (7, 4), "2x1", [Shard(0), Shard(0)]),
        ("rows_then_cols_1x2", (5, 3), "1x2", [Shard(0), Shard(1)]),
        ("replicate_then_shard_2x1", (6, 2), "2x1", [Replicate(), Shard(0)]),
        ("shard_then_replicate_1x2", (5,), "1x2", [Shard(0), Replicate()]),
        ("uneven_1x2_dim1", (2, 3), "1x2", [Replicate(), Shard(1)]),
        ("one_rank_mesh", (6, 2), "one", [Shard(0)]),
        ("strided_2x1", (8, 2), "2x1", [_StridedShard(0, split_factor=1), Shard(0)]),  # FSDP2 over TP's form
    ]


FALLBACKS = 1
"""Cases whose chunk torch's own function computes in our planners (the ``_StridedShard``)."""


def _state(meshes: dict[str, Any], zeros: bool) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    state: dict[str, Any] = {}
    for n, (name, shape, mesh_name, placements) in enumerate(_cases()):
        count = 1
        for size in shape:
            count *= size
        full = torch.arange(count, dtype=torch.float32).reshape(shape) + 1000 * n
        if zeros:
            full = torch.zeros_like(full)
        mesh = meshes[mesh_name]
        if isinstance(placements[0], _StridedShard):  # split factor 1 over a tp of 1: rank r holds rows 4r..4r+3
            rank = mesh.get_coordinate()[0]
            local = full[4 * rank : 4 * rank + 4].clone()
            state[name] = DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride())
        else:
            state[name] = distribute_tensor(full, mesh, placements, src_data_rank=None)  # split locally
    state["plain"] = torch.zeros(3) if zeros else torch.ones(3)
    state["nested"] = {"step": 0 if zeros else 5, "bias": state.pop("uneven_1d")}
    return state


class _Counter:
    """Counts calls of torch's compute_local_shape_and_global_offset where DCP's planner helpers call it."""

    def __init__(self) -> None:
        from torch.distributed.checkpoint import planner_helpers

        self.helpers = planner_helpers
        self.original = planner_helpers.compute_local_shape_and_global_offset
        self.calls = 0

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self.original(*args, **kwargs)

        planner_helpers.compute_local_shape_and_global_offset = counted

    def take(self) -> int:
        calls, self.calls = self.calls, 0
        return calls


def _without_run_identity(metadata: Any) -> Any:
    """The pickled ``.metadata`` minus what differs between two saves of the same state (checkpoint id, save id)."""
    return (metadata.state_dict_metadata, metadata.planner_data, metadata.storage_data, metadata.version)


def _rank_main(rank: int, out: str, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    result: dict[str, Any] = {"ok": True, "checks": {}, "calls": {}}
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
        from torch.distributed.device_mesh import init_device_mesh

        import s3_dcp

        meshes = {
            "line": init_device_mesh("cpu", (2,)),
            "2x1": init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp")),
            "1x2": init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b")),
        }
        meshes["one"] = meshes["2x1"]["tp"]  # a mesh of this rank alone
        counter = _Counter()
        checks = result["checks"]
        planners = {
            "torch": (DefaultSavePlanner, DefaultLoadPlanner),
            "ours": (s3_dcp.S3SavePlanner, s3_dcp.S3LoadPlanner),
        }

        # local and global save plans
        local, metadata, global_plans = {}, {}, {}
        for kind, (save_planner, _) in planners.items():
            planner = save_planner()
            planner.set_up_planner(_state(meshes, zeros=False), None, rank == 0)
            counter.take()
            local[kind] = planner.create_local_plan()
            result["calls"][f"save plan {kind}"] = counter.take()
            gathered: list[Any] = [None] * WORLD_SIZE
            dist.all_gather_object(gathered, local[kind])
            global_plans[kind], metadata[kind] = planner.create_global_plan(gathered)
        checks["local save plans equal"] = local["torch"] == local["ours"]

        # a torch that plans DTensors without asking them (simulated): ours notices and plans with torch's code
        from torch.distributed.checkpoint import default_planner, planner_helpers

        def as_bytes_unless_tensor(fqn: str, obj: Any) -> list[Any]:
            if isinstance(obj, torch.Tensor):
                return asked(fqn, obj)
            return [planner_helpers._create_write_item_for_bytesio(fqn, obj)]

        asked = default_planner._create_write_items
        default_planner._create_write_items = as_bytes_unless_tensor
        try:
            planner = s3_dcp.S3SavePlanner()
            planner.set_up_planner(_state(meshes, zeros=False), None, rank == 0)
            checks["plans with torch's code when torch does not ask"] = planner.create_local_plan() == local["torch"]
        finally:
            default_planner._create_write_items = asked
        checks["local save plan has every item"] = len(local["ours"].items) == len(local["torch"].items) > 10
        checks["global save plans equal"] = global_plans["torch"] == global_plans["ours"]
        checks["global metadata equal"] = _without_run_identity(metadata["torch"]) == _without_run_identity(
            metadata["ours"]
        )

        # real saves to local directories: the same .metadata and byte-identical shard files
        dirs = {kind: Path(out, f"saved-{kind}") for kind in planners}
        saved = _state(meshes, zeros=False)
        for kind, (save_planner, _) in planners.items():
            counter.take()
            dcp.save(saved, storage_writer=dcp.FileSystemWriter(dirs[kind]), planner=save_planner())
            result["calls"][f"save {kind}"] = counter.take()
        dist.barrier()
        if rank == 0:
            on_disk = {kind: pickle.loads((dirs[kind] / ".metadata").read_bytes()) for kind in planners}
            checks[".metadata equal"] = _without_run_identity(on_disk["torch"]) == _without_run_identity(
                on_disk["ours"]
            )
            names = sorted(p.name for p in dirs["ours"].iterdir() if p.suffix == ".distcp")
            checks["shard files identical"] = (
                bool(names)
                and all((dirs["ours"] / name).read_bytes() == (dirs["torch"] / name).read_bytes() for name in names)
                and names == sorted(p.name for p in dirs["torch"].iterdir() if p.suffix == ".distcp")
            )

        # local load plans, then a real load with ours
        reader_metadata = dcp.FileSystemReader(dirs["ours"]).read_metadata()
        load_plans = {}
        for kind, (_, load_planner) in planners.items():
            planner = load_planner()
            planner.set_up_planner(_state(meshes, zeros=True), reader_metadata, rank == 0)
            counter.take()
            load_plans[kind] = planner.create_local_plan()
            result["calls"][f"load plan {kind}"] = counter.take()
        checks["local load plans equal"] = load_plans["torch"] == load_plans["ours"]
        loaded = _state(meshes, zeros=True)
        counter.take()
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(dirs["ours"]), planner=s3_dcp.S3LoadPlanner())
        result["calls"]["load ours"] = counter.take()
        flat_saved = {**saved, **saved["nested"]}
        flat_loaded = {**loaded, **loaded["nested"]}
        differences = []
        for name, value in flat_saved.items():
            if name == "nested":
                continue
            other = flat_loaded[name]
            if hasattr(value, "to_local"):
                same = torch.equal(value.to_local(), other.to_local())
            elif isinstance(value, torch.Tensor):
                same = torch.equal(value, other)
            else:
                same = value == other
            if not same:
                differences.append(name)
        checks["loaded equal to saved"] = differences == []
        result["differences"] = differences
    except BaseException as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Starts the ranks as plain child processes (this parent never imports torch: seconds saved per run)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        _rank_main(args.rank, args.out, args.port)
        return 0
    port = str(_free_port())
    command = [sys.executable, "-m", "planner_worker", "--out", args.out, "--port", port, "--rank"]
    ranks = [subprocess.Popen([*command, str(rank)]) for rank in range(WORLD_SIZE)]
    codes = [rank.wait(timeout=240) for rank in ranks]
    return max(codes, key=abs)


if __name__ == "__main__":
    raise SystemExit(main())
