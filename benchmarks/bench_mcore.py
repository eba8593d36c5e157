"""megatron-core benchmark: 2 gloo ranks save and load a GPT-style sharded state with ``dist_checkpointing``.

Methods, each run in fresh processes (2 ranks spawned per run), interleaved rep by rep (``--methods``; the first
three by default):

* ``ours``: ``dist_checkpointing.save`` with `s3_mcore.S3TorchDistSaveShardedStrategy` (package defaults) to
  SeaweedFS, ``dist_checkpointing.load`` with megatron-core's own load strategy through `s3_mcore.install_s3_routing`;
* ``local``: stock megatron-core (its ``FileSystemWriterAsync`` / ``FileSystemReader``) to a local directory on the
  disk under ``--local-dir`` (its CUDA synchronisation calls stood in for on a CPU-only machine, as in the tests);
* ``raw``: each rank sends its shard's bytes in one ``put_object`` at the same time, then reads them back with 16 MiB
  ranged GETs, 15 in parallel (the store's ceiling on this machine: nothing serialised, verified or decoded);
* ``raw-parts``: the same bytes as a plain boto3 multipart upload of 16 MiB parts (the package's part size), one part
  after another, and the same ranged GETs; ``raw-crc``, ``raw-parts-crc``: ``raw`` and ``raw-parts`` plus a CRC32C
  of every byte in the thread that sends or receives it (bench_dcp.py's helpers, the same definitions);
* ``floor``: stock megatron-core's ``dist_checkpointing.save`` / ``load`` (its ``TorchDistSaveShardedStrategy`` and
  load strategy: the conversion of the sharded state, its save and load planners, its decentralised save planning,
  DCP's load) with a writer and reader that move no tensor bytes (`_floor_storage`: bench_dcp.py's null storage in
  megatron-core's writer and reader seams). megatron-core's own file IO (``metadata.json``, its checks of the
  directory) goes to a local temp directory, and the null storage keeps DCP's metadata and the common state (one
  small pickled DCP item the load needs) in a local file. This is megatron-core's and DCP's own cost, which every
  storage pays on top of moving the bytes.

``floor`` plus ``raw-parts-crc`` is the verified floor: what any megatron-core storage that streams its bytes and
checks them costs at least. With ``ours``, ``raw-parts-crc`` and ``floor`` in a run, the report adds the table
benchmarks/README.md shows for bench_dcp.py: each method's client CPU and wall time, the verified floor, and ours over
it per rep (a rep counts only with all three methods), medians with min to max; the target is 1.2x.

The state is a tensor-parallel GPT layout in bf16 (``--hidden``, vocabulary 32000, as many layers as fit ``--size``
MiB): the embedding and the QKV / FC1 weights split on dim 0, the projection / FC2 weights on dim 1, layer norms
replicated, plus common state. Every load that moves bytes is checked bit-identical against regenerated tensors
(after the clock stops); the floor's load is checked to return the common state. Per operation: aggregate MiB/s
(global bytes over the slowest rank's wall time between two barriers), client CPU seconds per GiB (both ranks), peak
extra RSS per rank.

    python benchmarks/bench_mcore.py --size 512 --reps 2
    python benchmarks/bench_mcore.py --methods ours,raw-parts-crc,floor --size 512 --reps 5 --tag verified-floor

writes ``benchmarks/results/<stamp>-mcore.json`` and ``.md``. Needs megatron-core (``make test`` installs it) and
``weed`` (SeaweedFS: it waits for the machine-wide weed lock, like the other benchmarks).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import gc
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(BENCH)]
import bench_dcp  # noqa: E402  (the raw transfers, with or without CRC, and the null DCP storage)

RESULTS = BENCH / "results"
BUCKET = "bench-mcore"
MiB = 1024**2
WORLD_SIZE = 2
VOCAB = 32000
RAW_METHODS = ("raw", "raw-crc", "raw-parts", "raw-parts-crc")
METHODS = ("ours", "local", *RAW_METHODS, "floor")
DIRS = ("save", "load")
"""What the verified-floor rows need, in the same rep."""
DEFAULT_METHODS = ("ours", "local", "raw")
FLOOR_METADATA = "floor.metadata"
"""Where the ``floor`` method's null writer pickles DCP's metadata, in the local checkpoint directory."""


# --------------------------------------------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------------------------------------------


def _status() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime + children.ru_utime + children.ru_stime


def layers_for(size_mib: int, hidden: int) -> int:
    """GPT layers (12 h^2 bf16 parameters each, layer norms aside) that fit `size_mib` besides the embedding."""
    per_layer = 12 * hidden * hidden * 2
    return max(1, int((size_mib * MiB - VOCAB * hidden * 2) // per_layer))


def _tensors(rank: int, size_mib: int, hidden: int, fill: bool) -> dict[str, tuple[Any, int | None]]:
    """This rank's local tensors: name -> (tensor, the dim it is split on, None for replicated)."""
    import torch

    shapes: dict[str, tuple[tuple[int, ...], int | None]] = {"embedding.weight": ((VOCAB // 2, hidden), 0)}
    for layer in range(layers_for(size_mib, hidden)):
        prefix = f"decoder.layers.{layer}"
        shapes[f"{prefix}.self_attention.linear_qkv.weight"] = ((3 * hidden // 2, hidden), 0)
        shapes[f"{prefix}.self_attention.linear_proj.weight"] = ((hidden, hidden // 2), 1)
        shapes[f"{prefix}.mlp.linear_fc1.weight"] = ((4 * hidden // 2, hidden), 0)
        shapes[f"{prefix}.mlp.linear_fc2.weight"] = ((hidden, 4 * hidden // 2), 1)
        shapes[f"{prefix}.input_layernorm.weight"] = ((hidden,), None)
    tensors = {}
    for index, (name, (shape, dim)) in enumerate(shapes.items()):
        if fill:
            generator = torch.Generator().manual_seed(1000 * index + (rank if dim is not None else 0))
            tensor = torch.rand(shape, generator=generator).to(torch.bfloat16)
        else:
            tensor = torch.zeros(shape, dtype=torch.bfloat16)
        tensors[name] = (tensor, dim)
    return tensors


def _sharded_state(rank: int, tensors: dict[str, tuple[Any, int | None]]) -> dict[str, Any]:
    from megatron.core.dist_checkpointing import ShardedTensor

    state: dict[str, Any] = {"iteration": 100, "args": {"hidden": 0}}
    for name, (tensor, dim) in tensors.items():
        if dim is None:
            state[name] = ShardedTensor.from_rank_offsets(name, tensor, replica_id=rank)
        else:
            state[name] = ShardedTensor.from_rank_offsets(name, tensor, (dim, rank, WORLD_SIZE))
    return state


def _measure(operation: Any) -> dict[str, float]:
    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status()["VmRSS"]
    cpu = _cpu_s()
    started = time.perf_counter()
    operation()
    dist.barrier()
    wall = time.perf_counter() - started
    return {"wall_s": wall, "cpu_s": _cpu_s() - cpu, "peak_extra_mib": (_status()["VmHWM"] - before) / MiB}


def _raw(spec: dict[str, Any], rank: int, tensors: dict[str, tuple[Any, int | None]]) -> dict[str, Any]:
    """The ``raw*`` methods: this rank's shard bytes (replicated tensors on rank 0 only, as megatron-core saves them)
    in one PUT or a multipart upload of the package's part size, read back in 16 MiB ranged GETs, 15 at a time; the
    ``-crc`` ones with a CRC32C of every byte in the thread that moves it (bench_dcp.py's helpers)."""
    import torch

    import s3_utils

    utils = s3_utils.S3Utils(s3_utils.S3ClientSettings(endpoint_url=spec["endpoint"]))
    client = utils.client
    crc = s3_utils.ChecksumAlgorithm.named("auto") if spec["method"].endswith("-crc") else None
    mine = [t for t, dim in tensors.values() if dim is not None or rank == 0]  # replicated: saved once
    payload = b"".join(t.reshape(-1).view(torch.int16).numpy().tobytes() for t in mine)
    client.put_object(Bucket=BUCKET, Key=f"raw/warmup-rank{rank}", Body=b"x" * 1024)
    key = f"raw/rank{rank}-{spec['method']}-{spec['rep']}"
    if spec["method"].startswith("raw-parts"):
        part = s3_utils.DEFAULT_CHUNK_SIZE_MB * MiB
        bodies = [payload[start : start + part] for start in range(0, len(payload), part)]  # cut before the clock
        outcome = {"save": _measure(lambda: bench_dcp._upload_in_parts(client, key, bodies, crc, bucket=BUCKET))}
    else:
        outcome = {"save": _measure(lambda: bench_dcp._put(client, key, payload, crc, bucket=BUCKET))}
    buffer = bytearray(b"\xff" * len(payload))
    view = memoryview(buffer)
    chunk = 16 * MiB
    ranges = [(start, view[start : start + chunk]) for start in range(0, len(view), chunk)]
    utils.read_range_into(f"s3://{BUCKET}/raw/warmup-rank{rank}", 0, bytearray(1024))
    outcome["load"] = _measure(lambda: bench_dcp._get_ranges(utils, f"s3://{BUCKET}/{key}", ranges, crc))
    outcome["load"]["identical"] = buffer == payload
    return outcome


@contextlib.contextmanager
def _floor_storage() -> Iterator[None]:
    """The ``floor`` method's seams: megatron-core's stock save and load, with storage that moves no bytes.

    megatron-core's ``TorchDistSaveShardedStrategy`` takes its writer class from
    ``strategies.filesystem_async.FileSystemWriterAsync`` at every save, and its loads (common state and tensors)
    take their DCP reader from ``_get_filesystem_reader`` (as `s3_mcore.install_s3_routing` routes them): here they
    get bench_dcp.py's null writer and reader, keyed by checkpoint directory, which keep the common state's bytes
    (a DCP byte item the load decodes) and DCP's metadata in a local file."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategies

    storages: dict[str, tuple[Any, Any]] = {}

    def storage(directory: Any) -> tuple[Any, Any]:
        if str(directory) not in storages:
            storages[str(directory)] = bench_dcp._null_storage(Path(directory, FLOOR_METADATA), objects=True)
        return storages[str(directory)]

    class NullWriterAsync:
        """megatron-core's ``FileSystemWriterAsync`` interface over the null writer: planned as megatron-core plans
        (decentralised), every item resolved in ``prepare_write_data``, nothing left for the save function."""

        can_run_decentralized_global_plan = True

        def __init__(self, path: Any, *args: Any, **kwargs: Any) -> None:
            self.writer = storage(path)[0]
            self.results: list[Any] = []

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            self.writer.set_up_storage_writer(is_coordinator)

        def prepare_local_plan(self, plan: Any) -> Any:
            return plan

        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            return plans

        def prepare_decentralized_global_plan(self, plan: Any) -> Any:
            return plan

        def prepare_write_data(self, plan: Any, planner: Any) -> None:
            self.results = self.writer.write_data(plan, planner).value()

        def get_save_function_and_args(self) -> tuple[None, None, list[Any]]:
            return None, None, []

        def retrieve_write_results(self) -> list[Any]:
            return self.results

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            self.writer.finish(metadata, results)

    def get_reader(checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        return storage(checkpoint_dir)[1]

    saved = [(filesystem_async, "FileSystemWriterAsync"), (torch_strategies, "_get_filesystem_reader")]
    saved.append((serialization, "_get_filesystem_reader"))
    originals = [getattr(owner, name) for owner, name in saved]
    filesystem_async.FileSystemWriterAsync = NullWriterAsync
    torch_strategies._get_filesystem_reader = serialization._get_filesystem_reader = get_reader
    try:
        yield
    finally:
        for (owner, name), original in zip(saved, originals, strict=True):
            setattr(owner, name, original)


def _dist_checkpointing(spec: dict[str, Any], rank: int, tensors: dict[str, tuple[Any, int | None]]) -> dict[str, Any]:
    """``ours``, ``local`` and ``floor``: ``dist_checkpointing.save`` and ``load`` of the sharded state (after a warm-up
    save and load of a tiny one), the load checked bit-identical unless it moved no bytes."""
    import torch
    import torch.distributed as dist
    from mcore_stub import cuda_calls_of_megatron_core
    from megatron.core import dist_checkpointing

    import s3_mcore
    import s3_utils

    method = spec["method"]
    with contextlib.ExitStack() as stack:
        if method == "ours":
            settings = s3_utils.S3ClientSettings(endpoint_url=spec["endpoint"])
            routing = s3_mcore.install_s3_routing(
                s3_utils.S3Utils(settings), reader_options={"client_settings": settings}
            )
            stack.callback(routing.uninstall)
            location = f"s3://{BUCKET}/ours/rep{spec['rep']}"
            strategy = s3_mcore.S3TorchDistSaveShardedStrategy(client_settings=settings)
            shim: Any = contextlib.nullcontext
        else:  # local, floor: megatron-core's own strategies to a local directory
            if method == "floor":
                stack.enter_context(_floor_storage())
            location = os.path.join(spec["local_dir"], f"rep{spec['rep']}")
            strategy = None
            shim = cuda_calls_of_megatron_core
        warm = f"{location}-warmup"
        if method != "ours" and rank == 0:
            os.makedirs(location, exist_ok=True)
            os.makedirs(warm, exist_ok=True)
        dist.barrier()
        small = _sharded_state(rank, {"warm": (torch.ones(4, dtype=torch.bfloat16), 0)})

        def save(state: dict[str, Any], where: str) -> None:
            with shim():
                dist_checkpointing.save(state, where, sharded_strategy=strategy)

        save(small, warm)
        dist_checkpointing.load(_sharded_state(rank, {"warm": (torch.zeros(4, dtype=torch.bfloat16), 0)}), warm)
        state = _sharded_state(rank, tensors)
        outcome = {"save": _measure(functools.partial(save, state, location))}
        del state
        targets = _tensors(rank, spec["size_mib"], spec["hidden"], fill=False)
        loaded: dict[str, Any] = {}
        outcome["load"] = _measure(
            lambda: loaded.update(dist_checkpointing.load(_sharded_state(rank, targets), location))
        )
        if method != "floor":  # it moves no bytes: nothing to compare (its common state does come back)
            outcome["load"]["identical"] = all(
                torch.equal(loaded[name], expected) for name, (expected, _) in tensors.items()
            )
        elif loaded.get("iteration") != 100:
            raise RuntimeError(f"the floor's load did not return the common state: {sorted(loaded)[:5]}")
    return outcome


def _rank_main(rank: int, spec: dict[str, Any], port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path[:0] = [str(REPO), str(REPO / "tests" / "helpers")]
    from mcore_stub import stand_in_for_triton_leaf

    stand_in_for_triton_leaf()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        tensors = _tensors(rank, spec["size_mib"], spec["hidden"], fill=True)
        if spec["method"] in RAW_METHODS:
            outcome = _raw(spec, rank, tensors)
        else:
            outcome = _dist_checkpointing(spec, rank, tensors)
        Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(outcome))
    finally:
        dist.destroy_process_group()


def _worker(spec_json: str) -> int:
    import torch.multiprocessing as mp

    spec = json.loads(spec_json)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_rank_main, args=(spec, port), nprocs=WORLD_SIZE, join=True)
    return 0


# --------------------------------------------------------------------------------------------------------------------
# Orchestrator
# --------------------------------------------------------------------------------------------------------------------


def _run(method: str, rep: int, args: argparse.Namespace, endpoint: str, env: dict[str, str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-mcore-") as out, tempfile.TemporaryDirectory(
        prefix="bench-mcore-local-", dir=args.local_dir
    ) as local_dir:
        spec = {"method": method, "rep": rep, "size_mib": args.size, "hidden": args.hidden, "endpoint": endpoint}
        spec.update(out=out, local_dir=local_dir)
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        if done.returncode != 0:
            return {"method": method, "rep": rep, "error": done.stderr[-3000:]}
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    result: dict[str, Any] = {"method": method, "rep": rep}
    for direction in ("save", "load"):
        per_rank = [r[direction] for r in ranks]
        wall = max(r["wall_s"] for r in per_rank)
        result[direction] = {
            "mib_s": args.size / wall,
            "wall_s": wall,
            "cpu_s_per_gib": sum(r["cpu_s"] for r in per_rank) / (args.size / 1024),
            "peak_extra_mib_per_rank": max(r["peak_extra_mib"] for r in per_rank),
            "identical": all(r["identical"] for r in per_rank) if "identical" in per_rank[0] else None,
        }
    return result


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    medians: dict[str, Any] = {}
    for method in METHODS:
        mine = [r for r in runs if r["method"] == method and "error" not in r]
        if not mine:
            continue
        medians[method] = {}
        for direction in DIRS:
            rows = [r[direction] for r in mine]
            checked = rows[0]["identical"] is not None  # the floor moves no bytes: nothing to check
            medians[method][direction] = {
                key: statistics.median(r[key] for r in rows)
                for key in ("mib_s", "wall_s", "cpu_s_per_gib", "peak_extra_mib_per_rank")
            } | {"identical": all(r["identical"] for r in rows) if checked else None}
    return medians


def _markdown(report: dict[str, Any]) -> str:
    medians = report["medians"]
    lines = [
        f"megatron-core dist_checkpointing, {report['size_mib']} MiB GPT-style bf16 state "
        f"({report['layers']} layers, hidden {report['hidden']}), 2 gloo ranks, median of {report['reps']} "
        f"({report['stamp']}; {report['server']}; {report['machine']})",
        "",
        "| method | save MiB/s | save CPU s/GiB | save peak extra MiB/rank | load MiB/s | load CPU s/GiB "
        "| load peak extra MiB/rank | load identical |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for method, row in medians.items():
        save, load = row["save"], row["load"]
        identical = "-" if load["identical"] is None else load["identical"]
        lines.append(
            f"| {method} | {save['mib_s']:.0f} | {save['cpu_s_per_gib']:.2f} | {save['peak_extra_mib_per_rank']:.0f} "
            f"| {load['mib_s']:.0f} | {load['cpu_s_per_gib']:.2f} | {load['peak_extra_mib_per_rank']:.0f} "
            f"| {identical} |"
        )
    lines += bench_dcp.verified_floor_lines(report["runs"], "megatron-core's save / load, no bytes moved")
    lines += ["", *[f"- {note}" for note in report["notes"]]]
    errors = [r for r in report["runs"] if "error" in r]
    lines += [f"- {len(errors)} run(s) failed: {errors[0]['error'][-500:]!r}"] if errors else []
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=512, help="global state size in MiB (about)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"any of {', '.join(METHODS)}")
    parser.add_argument("--local-dir", default=None, help="where the local method writes (default: the temp dir)")
    parser.add_argument(
        "--server", default="seaweedfs", choices=["seaweedfs", "moto"], help="moto: a quick check of the code only"
    )
    parser.add_argument("--tag", default="")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args.worker)
    sys.path.insert(0, str(REPO))
    import s3_local_servers

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    methods = [m for m in args.methods.split(",") if m]
    runs = []
    data_dir = tempfile.mkdtemp(prefix="bench-mcore-weed-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    notes = ["the two ranks and the store share this machine's CPUs: all numbers compete for them"]
    try:
        server = (
            s3_local_servers.seaweedfs_server(data_dir, lock="wait")
            if args.server == "seaweedfs"
            else s3_local_servers.moto_server()
        )
        with server as endpoint:
            client = endpoint.client()
            client.create_bucket(Bucket=BUCKET)
            env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
            env.update(endpoint.env())
            env["PYTHONPATH"] = str(REPO)
            for rep in range(args.reps):
                for method in methods:
                    print(f"rep {rep} {method} ...", flush=True)
                    run = _run(method, rep, args, endpoint.endpoint_url, env)
                    print(json.dumps(run)[:400], flush=True)
                    runs.append(run)
                    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
                        for obj in page.get("Contents", []):
                            client.delete_object(Bucket=BUCKET, Key=obj["Key"])
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    report = {
        "stamp": stamp,
        "size_mib": args.size,
        "hidden": args.hidden,
        "layers": layers_for(args.size, args.hidden),
        "reps": args.reps,
        "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
        "server": "SeaweedFS (weed mini) on /dev/shm" if args.server == "seaweedfs" else "moto (in-process)",
        "local_dir": args.local_dir or tempfile.gettempdir(),
        "notes": notes,
        "runs": runs,
        "medians": _summary(runs),
    }
    RESULTS.mkdir(exist_ok=True)
    name = f"{stamp}-mcore{('-' + args.tag) if args.tag else ''}"
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
    (RESULTS / f"{name}.md").write_text(_markdown(report))
    print(_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
