"""Sharded (DCP) checkpoint benchmark: 2 gloo ranks save and load a sharded state on SeaweedFS, side by side.

Methods, each run in fresh processes (2 ranks spawned per run), interleaved rep by rep:

* ``ours``: `s3_dcp.S3StorageWriter` / `S3StorageReader` (package defaults) with `s3_dcp.S3SavePlanner` /
  `S3LoadPlanner`, as the package's Lightning strategies call DCP;
* ``ours-torchplan``: the same writer and reader with torch's ``DefaultSavePlanner`` / ``DefaultLoadPlanner`` (what
  ``dcp.save`` / ``dcp.load`` use when given no planner; ``ours`` before the planners existed);
* ``fsspec``: torch's ``FsspecWriter`` / ``FsspecReader`` over s3fs (``sync_files=False``: with True every file
  ends in ``os.sync()``);
* ``s3tc``: s3torchconnector's ``S3StorageWriter`` / ``S3StorageReader`` (DCP-optimised reader, its default), run in
  the peers venv (``benchmarks/.venv-peers`` or ``/work/venv-peers``; skipped with a note when neither has it);
* ``raw``: each rank sends its shard's bytes in one ``put_object`` at the same time (the store's ceiling for
  uploads on this machine), then reads them back with 16 MiB ranged GETs, 15 in parallel, into a touched buffer,
  unverified and undecoded (the ceiling for loads): both measured in the same run;
* ``raw-parts``: the same bytes as a plain boto3 multipart upload of 16 MiB parts (the package's default part size),
  one part after another (what any streaming writer sends instead of one PUT), and the same ranged GETs;
* ``raw-crc``, ``raw-parts-crc``: ``raw`` and ``raw-parts`` plus a CRC32C (the package's algorithm) of every byte,
  computed by the thread that sends or receives it: what checking the bytes against a recorded checksum costs at
  least, and a verified storage cannot skip. ``floor`` plus these is a verified DCP storage's floor;
* ``floor``: ``dcp.save`` / ``dcp.load`` with our planners and a storage writer / reader that move no bytes
  (`_NullWriter`, `_NullReader`): every item is still resolved (``resolve_data``; ``resolve_tensor`` /
  ``commit_tensor``), so this is DCP's own cost (planning, its collectives, ``.metadata``), which every DCP storage
  pays on top of sending the bytes and the raw ceilings do not.

The state is ``--size`` MiB of float32 DTensors sharded row-wise over the 2 ranks (``DTensor.from_local``), filled
from fixed seeds so every load is checked bit-identical (after the clock stops), nested under one top-level key
(``{"model": {...}}``) as Lightning's strategies and torch's DCP examples pass it: ``dcp.load`` checks every
top-level value against its ``Stateful`` protocol, about 0.1 ms each on Python 3.11, which a flat dict of 256
tensors would add to every method's load. Per operation: aggregate MiB/s
(global bytes over the slowest rank's wall time between two barriers), client CPU seconds per GiB (both ranks, all
threads, ``getrusage``), and peak extra RSS per rank (``VmHWM`` after resetting it through ``/proc/self/clear_refs``,
minus ``VmRSS`` before). Load targets are allocated and touched before the clock starts, and each method first saves
and loads a tiny state with the same writer and reader (clients, connections and DCP's code paths warm). Each
operation starts from a collected heap (``gc.collect()`` before the clock, as ``timeit`` and pyperf isolate their
timings): otherwise the first full collection of the ~350,000 objects that importing torch and boto3 leaves, 0.15 to
0.46 s on this machine, lands in whichever operation happens to cross the collector's threshold.

    python benchmarks/bench_dcp.py --size 1024 --reps 3

writes ``benchmarks/results/<stamp>-dcp.json``, ``.md`` and ``.png`` (the chart; needs the ``bench`` extra). The machine has 2 cores shared by the two ranks and the
store, so absolute numbers move with load; compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import datetime as dt
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PEERS_PYTHONS = [REPO / "benchmarks" / ".venv-peers" / "bin" / "python", Path("/work/venv-peers/bin/python")]
PEERS_PYTHON = next((p for p in PEERS_PYTHONS if p.exists()), PEERS_PYTHONS[0])
"""The peers venv with s3torchconnector (see benchmarks/README.md); either location works."""
BUCKET = "bench-dcp"
MiB = 1024**2
TENSORS = 16
WORLD_SIZE = 2


# --------------------------------------------------------------------------------------------------------------------
# Rank side (runs in the worker processes; imports torch and the clients lazily)
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
    return usage.ru_utime + usage.ru_stime


LAYOUTS = ("2d", "1d", "mixed", "gpt")
GPT = {"d": 768, "layers": 8}
"""The ``gpt`` layout's model (`realistic_state`): set from ``--d`` / ``--layers``, passed to the ranks in the spec."""


def _gpt_size_mib(d: int, layers: int) -> int:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import realistic_state

    return round(realistic_state.size_mib(d, layers))


def _local_shapes(size_mib: int, layout: str) -> list[tuple[int, ...]]:
    """Each rank's shard shapes (dim 0 is split over the ranks): ``2d`` 16 tensors of rows x 1024 (the original
    layout), ``1d`` the same elements as 16 flat tensors (biases, norms, flattened parameters), ``mixed`` 8 large 2-D
    tensors with 7/8 of the bytes and 248 small 1-D ones with the rest, as a real model has."""
    elements = size_mib * MiB // 4 // WORLD_SIZE
    if layout == "2d":
        return [(elements // TENSORS // 1024, 1024)] * TENSORS
    if layout == "1d":
        return [(elements // TENSORS,)] * TENSORS
    if layout == "mixed":
        large = elements * 7 // 8 // 8 // 1024
        return [(large, 1024)] * 8 + [((elements - 8 * large * 1024) // 248,)] * 248
    raise ValueError(f"unknown layout {layout!r}")


def _local_tensors(rank: int, size_mib: int, fill: bool, layout: str = "2d") -> list[Any]:
    import torch

    tensors = []
    for n, shape in enumerate(_local_shapes(size_mib, layout)):
        if fill:
            generator = torch.Generator().manual_seed(1000 * n + rank)
            tensors.append(torch.rand(shape, generator=generator))
        else:
            tensors.append(torch.empty(shape).fill_(-1.0))  # touched: its pages are resident before the clock
    return tensors


def _state(mesh: Any, tensors: list[Any]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    return {f"layer{n}.weight": DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for n, t in enumerate(tensors)}


def _planners(spec: dict[str, Any]) -> dict[str, Any]:
    """``planner=`` for dcp.save / dcp.load: ours for ``ours``, none (torch's defaults) for every other method."""
    if spec["method"] not in ("ours", "floor"):
        return {"save": None, "load": None}
    import s3_dcp

    return {"save": s3_dcp.S3SavePlanner(), "load": s3_dcp.S3LoadPlanner()}


def _writer_and_reader(spec: dict[str, Any], url: str) -> tuple[Any, Any]:
    method = spec["method"]
    if method == "floor":
        return _null_storage(Path(spec["out"], "floor-metadata.pickle"))
    if method in ("ours", "ours-torchplan"):
        sys.path.insert(0, str(REPO))
        import s3_dcp

        options = spec.get("ours_options") or {}
        reader_only = ("max_read_concurrency", "coalesce_gap_MB", "direct_read_min_MB")
        writer_options = {k: v for k, v in options.items() if k not in reader_only}
        reader_options = {k: v for k, v in options.items() if k in ("chunk_size_MB", *reader_only)}
        return s3_dcp.S3StorageWriter(url, **writer_options), s3_dcp.S3StorageReader(url, **reader_options)
    if method == "fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        options = {"endpoint_url": spec["endpoint"]}
        return FsspecWriter(url, sync_files=False, **options), FsspecReader(url, **options)
    if method == "s3tc":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

        config = S3ClientConfig(force_path_style=True)
        writer = S3StorageWriter("us-east-1", url, s3client_config=config)
        reader = S3StorageReader("us-east-1", url, s3client_config=config)
        for storage in (writer, reader):  # its DCP classes take no endpoint; their client does
            storage.fs._client = S3Client("us-east-1", endpoint=spec["endpoint"], s3client_config=config)
        return writer, reader
    raise ValueError(method)


def _null_storage(metadata_path: Path, objects: bool = False) -> tuple[Any, Any]:
    """The ``floor`` method's writer and reader: DCP's own work with no bytes moved (module doc). The coordinator's
    writer pickles the save's `Metadata` to `metadata_path` (a local file all ranks see; DCP's save returns on no
    rank before the coordinator's ``finish``); the reader serves it back, so the load plans against what the save
    recorded. With `objects`, the bytes of DCP's byte items (pickled non-tensor values, a few KiB) are kept in that
    file and handed back to the load planner, for a load that cannot go on without them (megatron-core's common
    state, bench_mcore.py); no tensor's bytes are ever moved."""
    import io
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

    def done(value: Any) -> Any:
        future = torch.futures.Future()
        future.set_result(value)
        return future

    class _Planless:
        """What the null writer and reader share: any checkpoint id, plans passed on unchanged."""

        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return True

        def prepare_local_plan(self, plan: Any) -> Any:
            return plan

        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            return plans

    class _NullWriter(_Planless, StorageWriter):
        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            pass

        def write_data(self, plan: Any, planner: Any) -> Any:
            results = []
            for item in plan.items:
                data = planner.resolve_data(item)
                if objects and item.type.name == "BYTE_IO":
                    kept = data.getvalue()
                    results.append(WriteResult(index=item.index, size_in_bytes=len(kept), storage_data=kept))
                    continue
                results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=_StorageInfo("-", 0, 0)))
            return done(results)

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
            metadata_path.write_bytes(pickle.dumps(metadata))

    class _NullReader(_Planless, StorageReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return pickle.loads(metadata_path.read_bytes())

        def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            self.storage_data = metadata.storage_data

        def read_data(self, plan: Any, planner: Any) -> Any:
            for request in plan.items:
                if request.type.name == "BYTE_IO":
                    if objects:
                        planner.load_bytes(request, io.BytesIO(self.storage_data[request.storage_index]))
                    continue  # without `objects`, a non-tensor item: nothing was stored to decode
                planner.commit_tensor(request, planner.resolve_tensor(request))
            return done(None)

    return _NullWriter(), _NullReader()


def _measure(operation: Any) -> dict[str, float]:
    import torch.distributed as dist

    gc.collect()  # a full collection pending since the imports is not charged to this operation (module doc)
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status()["VmRSS"]
    cpu = _cpu_s()
    started = time.perf_counter()
    operation()
    wall = time.perf_counter() - started
    cpu = _cpu_s() - cpu
    peak = _status()["VmHWM"] - before
    dist.barrier()
    return {"wall_s": wall, "cpu_s": cpu, "peak_extra_mib": peak / MiB}


def _raw(spec: dict[str, Any], rank: int, tensors: list[Any]) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    import torch

    import s3_utils

    utils = s3_utils.S3Utils(s3_utils.S3ClientSettings(endpoint_url=spec["endpoint"]))
    client = utils.client
    # raw-crc / raw-parts-crc: every byte also goes through the package's CRC (module doc); None: not computed
    crc = s3_utils.ChecksumAlgorithm.named("auto") if spec["method"].endswith("-crc") else None
    payload = b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors)
    client.put_object(Bucket=BUCKET, Key=f"raw/warmup-rank{rank}", Body=b"x" * 1024)  # connection up first
    key = f"raw/rank{rank}-{spec['method']}-{spec['layout']}-{spec['rep']}"
    if spec["method"].startswith("raw-parts"):
        part = s3_utils.DEFAULT_CHUNK_SIZE_MB * MiB  # the package's default part size
        bodies = [payload[start : start + part] for start in range(0, len(payload), part)]
        outcome = {"save": _measure(lambda: _upload_in_parts(client, key, bodies, crc))}
    else:
        outcome = {"save": _measure(lambda: _put(client, key, payload, crc))}
    url = f"s3://{BUCKET}/{key}"
    buffer = bytearray(b"\xff" * len(payload))  # touched: its pages are resident before the clock
    view = memoryview(buffer)
    chunk = 16 * MiB
    ranges = [(start, view[start : start + chunk]) for start in range(0, len(view), chunk)]
    utils.read_range_into(f"s3://{BUCKET}/raw/warmup-rank{rank}", 0, bytearray(1024))  # connections warm
    outcome["load"] = _measure(lambda: _get_ranges(utils, url, ranges, crc))
    outcome["load"]["identical"] = buffer == payload
    return outcome


def _put(client: Any, key: str, payload: bytes, crc: Any, bucket: str = BUCKET) -> None:
    if crc is not None:
        crc.update(payload, 0)
    client.put_object(Bucket=bucket, Key=key, Body=payload)


def _get_ranges(utils: Any, url: str, ranges: list[tuple[int, memoryview]], crc: Any) -> None:
    """15 ranged GETs at a time, as `S3Utils.read_ranges_into` reads them, each range's CRC in its own thread."""

    def get(start: int, view: memoryview) -> None:
        utils.read_range_into(url, start, view)
        if crc is not None:
            crc.update(view, 0)

    with ThreadPoolExecutor(15, thread_name_prefix="raw-get") as pool:
        for future in [pool.submit(get, start, view) for start, view in ranges]:
            future.result()


def _upload_in_parts(client: Any, key: str, bodies: list[bytes], crc: Any, bucket: str = BUCKET) -> None:
    """``raw-parts``: a plain multipart upload of `bodies` (cut before the clock), one part after another."""
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    parts = []
    for number, body in enumerate(bodies, 1):
        if crc is not None:
            crc.update(body, 0)
        response = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body)
        parts.append({"PartNumber": number, "ETag": response["ETag"]})
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts})


def _rank_main(rank: int, spec: dict[str, Any], port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    gpt = spec["layout"] == "gpt"
    if gpt:
        sys.path.insert(0, str(REPO / "benchmarks"))
        import realistic_state

        d, layers = spec["gpt"]["d"], spec["gpt"]["layers"]
    try:
        if gpt:
            named = realistic_state.local_tensors(d, layers, rank, WORLD_SIZE, fill=True)
            tensors = [t for _, t in named]
        else:
            tensors = _local_tensors(rank, spec["size_mib"], fill=True, layout=spec["layout"])
        if spec["method"] in RAW_METHODS:
            outcome = _raw(spec, rank, tensors)
        else:
            mesh = init_device_mesh("cpu", (WORLD_SIZE,))
            url = f"s3://{BUCKET}/{spec['method']}-{spec['layout']}/rep{spec['rep']}"
            writer, reader = _writer_and_reader(spec, url)
            planners = _planners(spec)  # a planner keeps no state between saves that changes the plan
            # warm-up on a tiny state: clients, connections and DCP's code paths are ready before the clock starts
            warm = {"warm": _state(mesh, [torch.ones(4, 4)])["layer0.weight"]}
            dcp.save(warm, storage_writer=writer, checkpoint_id=f"{url}-warmup", planner=planners["save"])
            dcp.load(warm, storage_reader=reader, checkpoint_id=f"{url}-warmup", planner=planners["load"])
            state = realistic_state.sharded_state(mesh, named, d, layers) if gpt else {"model": _state(mesh, tensors)}
            outcome = {
                "save": _measure(
                    lambda: dcp.save(state, storage_writer=writer, checkpoint_id=url, planner=planners["save"])
                )
            }
            del state
            if gpt:
                named_targets = realistic_state.local_tensors(d, layers, rank, WORLD_SIZE, fill=False)
                targets = [t for _, t in named_targets]
                loaded = realistic_state.sharded_state(mesh, named_targets, d, layers)
            else:
                targets = _local_tensors(rank, spec["size_mib"], fill=False, layout=spec["layout"])
                loaded = {"model": _state(mesh, targets)}
            outcome["load"] = _measure(
                lambda: dcp.load(loaded, storage_reader=reader, checkpoint_id=url, planner=planners["load"])
            )
            if spec["method"] != "floor":  # it moves no bytes: nothing to compare
                outcome["load"]["identical"] = all(
                    torch.equal(t.view(-1).view(torch.uint8), e.view(-1).view(torch.uint8))
                    for t, e in zip(targets, tensors, strict=True)
                )
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


def _seaweedfs(data_dir: str) -> Any:
    """The package's embedded SeaweedFS (waits for the machine-wide weed lock while another run holds it)."""
    sys.path.insert(0, str(REPO))
    import s3_local_servers

    return s3_local_servers.seaweedfs_server(data_dir, lock="wait")


def _peers_ready() -> str | None:
    """None if s3torchconnector runs in the peers venv, else why not."""
    if not PEERS_PYTHON.exists():
        return f"{PEERS_PYTHON} does not exist"
    check = subprocess.run(
        [str(PEERS_PYTHON), "-c", "import s3torchconnector.dcp, torch; print(s3torchconnector.__version__)"],
        capture_output=True,
        text=True,
    )
    return None if check.returncode == 0 else f"s3torchconnector does not import there: {check.stderr[-300:]}"


def _run(
    method: str,
    rep: int,
    size_mib: int,
    endpoint: str,
    env: dict[str, str],
    timeout: float,
    ours: dict[str, Any],
    layout: str = "2d",
) -> dict[str, Any]:
    python = str(PEERS_PYTHON) if method == "s3tc" else sys.executable
    label = method
    if method.startswith("ours@ref="):  # ours, with these fast paths on their reference paths
        env = {**env, "S3CKPT_REFERENCE_PATHS": method.removeprefix("ours@ref=")}
        method = "ours"
    if method.startswith("ours:"):  # a --variant (its options are in `ours`)
        method = "ours"
    with tempfile.TemporaryDirectory(prefix="bench-dcp-") as out:
        spec = {"method": method, "rep": rep, "size_mib": size_mib, "endpoint": endpoint, "out": out, "layout": layout}
        spec["ours_options"] = ours
        spec["gpt"] = GPT
        done = subprocess.run(
            [python, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            return {"method": label, "rep": rep, "layout": layout, "error": done.stderr[-3000:]}
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    result: dict[str, Any] = {"method": label, "rep": rep, "layout": layout}
    gib = size_mib / 1024
    for direction in ("save", "load"):
        if direction not in ranks[0]:
            continue
        per_rank = [r[direction] for r in ranks]
        wall = max(r["wall_s"] for r in per_rank)
        result[direction] = {
            "mib_s": size_mib / wall,
            "wall_s": wall,
            "cpu_s_per_gib": sum(r["cpu_s"] for r in per_rank) / gib,
            "peak_extra_mib_per_rank": max(r["peak_extra_mib"] for r in per_rank),
            "identical": all(r.get("identical", True) for r in per_rank) if "identical" in per_rank[0] else None,
        }
    return result


RAW_METHODS = ("raw", "raw-crc", "raw-parts", "raw-parts-crc")
METHODS = ("ours", "ours-torchplan", "s3tc", "fsspec", *RAW_METHODS, "floor")


def _label(run: dict[str, Any]) -> str:
    """A table row: the method, with its layout unless it is the original 2-D one."""
    layout = run.get("layout", "2d")
    return run["method"] if layout == "2d" else f"{run['method']} {layout}"


def _labels(medians: dict[str, Any]) -> list[str]:
    """Rows in order: layout by layout, methods in their usual order."""
    order = [_label({"method": m, "layout": layout}) for layout in LAYOUTS for m in METHODS]
    return [label for label in order if label in medians] + sorted(set(medians) - set(order))


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for run in runs:
        for direction in ("save", "load"):
            if direction in run:
                summary.setdefault(_label(run), {}).setdefault(direction, []).append(run[direction])
    medians: dict[str, Any] = {}
    for method, directions in summary.items():
        for direction, rows in directions.items():
            medians.setdefault(method, {})[direction] = {
                "mib_s": statistics.median(r["mib_s"] for r in rows),
                "cpu_s_per_gib": statistics.median(r["cpu_s_per_gib"] for r in rows),
                "peak_extra_mib_per_rank": max(r["peak_extra_mib_per_rank"] for r in rows),
                "identical": None if rows[0]["identical"] is None else all(r["identical"] for r in rows),
                "reps": len(rows),
            }
    return medians


def _ratio(medians: dict[str, Any], a: str, b: str, direction: str) -> str:
    try:
        return f"{medians[a][direction]['mib_s'] / medians[b][direction]['mib_s']:.2f}x"
    except KeyError:
        return "n/a"


FLOOR_METHODS = ("ours", "raw-parts-crc", "floor")
DIRS = ("save", "load")


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f} to {max(values):.2f})"


def verified_floor_lines(runs: list[dict[str, Any]], floor: str, heading: str = "") -> list[str]:
    """Client CPU against the verified floor (``floor`` + ``raw-parts-crc``: the library's own work with no bytes
    moved, `floor` saying which, plus a plain multipart upload / ranged GETs of the same bytes with a CRC32C of every
    byte): per rep, since the methods of one rep run back to back; a rep counts only with all three methods. Medians
    (min to max). bench_mcore.py's report uses it too."""
    by_rep: dict[int, dict[str, Any]] = {}
    for run in runs:
        if "error" not in run:
            by_rep.setdefault(run["rep"], {})[run["method"]] = run
    reps = [rep for rep in by_rep.values() if all(method in rep for method in FLOOR_METHODS)]
    if not reps:
        return []

    def per_rep(method: str, key: str) -> list[list[float]]:
        """[the saves' values, the loads' values], one per rep."""
        return [[rep[method][direction][key] for rep in reps] for direction in DIRS]

    def combine(a: list[list[float]], b: list[list[float]], how: Any) -> list[list[float]]:
        return [[how(x, y) for x, y in zip(xs, ys, strict=True)] for xs, ys in zip(a, b, strict=True)]

    def row(name: str, cpu: list[list[float]] | None, wall: list[list[float]] | None) -> str:
        cells = [name]
        for direction in range(len(DIRS)):
            cells += [_spread(cpu[direction]) if cpu else "-", _spread(wall[direction]) if wall else "-"]
        return "| " + " | ".join(cells) + " |"

    cpu = {method: per_rep(method, "cpu_s_per_gib") for method in FLOOR_METHODS}
    wall = {method: per_rep(method, "wall_s") for method in FLOOR_METHODS}
    raw = "raw-parts-crc"
    floors = combine(cpu["floor"], cpu[raw], lambda x, y: x + y)
    ratios = combine(cpu["ours"], floors, lambda x, y: x / y)
    return [
        "",
        f"Client CPU against the verified floor{heading}, side by side in the same run ({len(reps)} reps with all "
        "three methods; medians, min to max):",
        "",
        "| | save CPU s/GiB | save wall s | load CPU s/GiB | load wall s |",
        "|---|---:|---:|---:|---:|",
        row("ours", cpu["ours"], wall["ours"]),
        row("raw-parts-crc (multipart upload / ranged GETs, a CRC32C of every byte)", cpu[raw], wall[raw]),
        row(f"floor ({floor})", cpu["floor"], wall["floor"]),
        row("verified floor: floor + raw-parts-crc", floors, None),
        row("**ours / verified floor** (per rep)", ratios, None),
        row("ours / raw-parts-crc wall (per rep)", None, combine(wall["ours"], wall[raw], lambda x, y: x / y)),
        "",
        f"Target: ours within 1.2x of the verified floor; medians: save {statistics.median(ratios[0]):.2f}x, "
        f"load {statistics.median(ratios[1]):.2f}x.",
    ]


def _markdown(report: dict[str, Any]) -> str:
    medians = report["medians"]
    lines = [
        f"# DCP benchmark {report['stamp']}",
        "",
        f"{report['size_mib']} MiB sharded over {WORLD_SIZE} gloo ranks on SeaweedFS (`weed mini`), "
        f"{report['reps']} reps, medians (peak RSS: the largest). Machine: {report['machine']}. "
        f"Our options: {report.get('ours_options') or 'package defaults'}.",
        "",
        "| method | save MiB/s | save CPU s/GiB | save peak extra RSS/rank MiB | load MiB/s | load CPU s/GiB "
        "| load peak extra RSS/rank MiB | loads identical |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for method in _labels(medians):
        save, load = medians[method].get("save"), medians[method].get("load")
        cells = [method]
        for row in (save, load):
            if row is None:
                cells += ["-", "-", "-"]
            else:
                cells += [f"{row['mib_s']:.0f}", f"{row['cpu_s_per_gib']:.2f}", f"{row['peak_extra_mib_per_rank']:.0f}"]
        checked = load is not None and load["identical"] is not None
        cells.append("-" if not checked else ("yes" if load["identical"] else "**NO**"))
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Ratios (aggregate MiB/s, medians): "
        f"save ours/s3tc {_ratio(medians, 'ours', 's3tc', 'save')}, ours/fsspec {_ratio(medians, 'ours', 'fsspec', 'save')}, "
        f"ours/raw {_ratio(medians, 'ours', 'raw', 'save')}; "
        f"load ours/s3tc {_ratio(medians, 'ours', 's3tc', 'load')}, ours/fsspec {_ratio(medians, 'ours', 'fsspec', 'load')}, "
        f"ours/raw {_ratio(medians, 'ours', 'raw', 'load')}.",
    ]
    for method in ("ours", "ours-torchplan"):
        for layout in LAYOUTS[1:]:
            ours = _label({"method": method, "layout": layout})
            if ours in medians and method in medians:
                lines += [
                    "",
                    f"Layout {layout} against 2d ({method}, MiB/s): save {_ratio(medians, ours, method, 'save')}, "
                    f"load {_ratio(medians, ours, method, 'load')}; against raw {layout}: "
                    f"save {_ratio(medians, ours, _label({'method': 'raw', 'layout': layout}), 'save')}, "
                    f"load {_ratio(medians, ours, _label({'method': 'raw', 'layout': layout}), 'load')}.",
                ]
    for layout in report["layouts"]:
        runs = [run for run in report["runs"] if run.get("layout", layout) == layout]
        heading = f" (layout {layout})" if len(report["layouts"]) > 1 else ""
        lines += verified_floor_lines(runs, "DCP's save / load with our planners, no bytes moved", heading)
    for note in report["notes"]:
        lines += ["", f"Note: {note}"]
    errors = [r for r in report["runs"] if "error" in r]
    for run in errors:
        lines += ["", f"Error in {run['method']} rep {run['rep']}:", "```", run["error"][-1500:], "```"]
    return "\n".join(lines) + "\n"


def _chart(report: dict[str, Any], path: Path) -> bool:
    """A PNG of the table: aggregate MiB/s and client CPU s/GiB per method, save and load, all from this one run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('NOTE: no chart: matplotlib is missing (pip install ".[bench]")', flush=True)
        return False
    medians = report["medians"]
    methods = _labels(medians)
    metrics = (("mib_s", "aggregate MiB/s (higher is better)"), ("cpu_s_per_gib", "client CPU s/GiB (lower is better)"))
    fig, axes = plt.subplots(2, len(metrics), figsize=(11, 5.5), squeeze=False)
    for row, direction in zip(axes, ("save", "load"), strict=True):
        chosen = [m for m in methods if direction in medians[m]]
        for axis, (metric, title) in zip(row, metrics, strict=True):
            values = [medians[m][direction][metric] for m in chosen]
            colours = [
                "tab:orange"
                if m.startswith("ours")
                else ("tab:gray" if m.startswith(("raw", "floor")) else "tab:blue")
                for m in chosen
            ]
            axis.barh(chosen, values, color=colours)
            axis.invert_yaxis()
            axis.set_title(f"{direction}: {title}", fontsize=9)
            for y, value in enumerate(values):
                axis.text(value, y, f" {value:.0f}" if metric == "mib_s" else f" {value:.2f}", va="center", fontsize=8)
    fig.suptitle(
        f"DCP, {report['size_mib']} MiB over {WORLD_SIZE} gloo ranks, SeaweedFS, {report['reps']} reps "
        f"(medians; {report['stamp']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=1024, help="global state size in MiB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--methods", default="ours,s3tc,fsspec,raw")
    parser.add_argument(
        "--layouts",
        default="2d",
        help=f"comma-separated tensor layouts, each a set of rows ({', '.join(LAYOUTS)}; see _local_shapes)",
    )
    parser.add_argument("--d", type=int, default=768, help="model width of the gpt layout (realistic_state.py)")
    parser.add_argument("--layers", type=int, default=8, help="layers of the gpt layout")
    parser.add_argument(
        "--reference",
        default="",
        help='extra methods: ours with these fast paths on their reference paths, e.g. "framing_reuse;all"',
    )
    parser.add_argument(
        "--reference-layouts", default="", help="layouts the --reference methods run on (default: every layout)"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help='extra method NAME=JSON: ours with these writer/reader options, e.g. \'min4={"direct_read_min_MB": 4}\'',
    )
    parser.add_argument("--tag", default="")
    parser.add_argument(
        "--ours",
        default="{}",
        help="JSON keyword arguments for our writer/reader, e.g. '{\"max_write_concurrency\": 4}'",
    )
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args.worker)

    methods = [m for m in args.methods.split(",") if m]
    methods += [f"ours@ref={item}" for item in args.reference.split(";") if item]
    variants = {name: json.loads(options) for name, _, options in (v.partition("=") for v in args.variant)}
    methods += [f"ours:{name}" for name in variants]
    GPT.update(d=args.d, layers=args.layers)
    notes = []
    if "s3tc" in methods:
        why = _peers_ready()
        if why:
            methods.remove("s3tc")
            notes.append(f"s3torchconnector skipped: {why}")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    data_dir = tempfile.mkdtemp(prefix="bench-dcp-weed-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    runs = []
    try:
        with _seaweedfs(data_dir) as endpoint:
            client = endpoint.client()
            client.create_bucket(Bucket=BUCKET)
            env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
            env.update(endpoint.env())
            env["PYTHONPATH"] = str(REPO)
            for rep in range(args.reps):
                for layout in [layout for layout in args.layouts.split(",") if layout]:
                    for method in methods:
                        if method.startswith("ours@ref=") and args.reference_layouts:
                            if layout not in args.reference_layouts.split(","):
                                continue
                        print(f"rep {rep} {method} {layout} ...", flush=True)
                        ours = json.loads(args.ours)
                        if method.startswith("ours:"):  # a --variant: ours with these options on top
                            ours.update(variants[method.removeprefix("ours:")])
                        size = _gpt_size_mib(args.d, args.layers) if layout == "gpt" else args.size
                        run = _run(method, rep, size, endpoint.endpoint_url, env, args.timeout, ours, layout)
                        print(json.dumps(run)[:400], flush=True)
                        runs.append(run)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)  # the store's data sits in RAM (/dev/shm): GiBs per run
    report = {
        "stamp": stamp,
        "size_mib": args.size,
        "reps": args.reps,
        "machine": f"{os.cpu_count()} CPUs",
        "methods": methods,
        "layouts": args.layouts.split(","),
        "gpt": dict(GPT),
        "ours_options": json.loads(args.ours),
        "notes": [*notes, "the two ranks and SeaweedFS share this machine's CPUs: all numbers compete for them"],
        "runs": runs,
        "medians": _summary([r for r in runs if "error" not in r]),
    }
    RESULTS.mkdir(exist_ok=True)
    name = f"{stamp}-dcp{('-' + args.tag) if args.tag else ''}"
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
    (RESULTS / f"{name}.md").write_text(_markdown(report))
    _chart(report, RESULTS / f"{name}.png")
    print(_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
