"""Conversion benchmark: a 2-rank DCP checkpoint on SeaweedFS into one safetensors / torch file (and that torch file
back into DCP), S3 to S3, against a raw copy of the same bytes in the same run.

Setup (outside the clock): 2 gloo ranks save ``--size`` MiB of float32 DTensors, sharded row-wise, with
`s3_dcp.S3StorageWriter` (the state of ``bench_dcp.py``, 16 tensors, filled from fixed seeds). Then, each in a fresh
process and interleaved rep by rep:

* ``safetensors``: ``convert_checkpoint(src, "s3://.../model.safetensors")``;
* ``torch``: ``convert_checkpoint(src, "s3://.../model.pt")``;
* ``to-dcp``: ``convert_checkpoint("s3://.../model.pt", "s3://.../dcp")``, the reverse (its source is the
  ``torch`` run's output of the same rep);
* ``raw``: the checkpoint's shard files copied into one object: parallel ranged GETs (the conversion's part size,
  `RAW_GETS` in flight) into a window of buffers, written into `s3_utils.S3MultipartWriter` (the same writer, part size and
  parts in flight as the conversion): the bytes in and out, with no decoding, assembly or verification. That is the
  ceiling the conversions are measured against (target: >= 0.8x).

Per run: MiB/s (tensor bytes over wall time), client CPU seconds per GiB (all threads, ``getrusage``), peak extra RSS
(``VmHWM`` after resetting it, minus ``VmRSS`` before). Each worker first converts (or copies) a tiny checkpoint so
clients and code paths are warm. The first rep's outputs are checked against the regenerated tensors after the
clock stops.

    python benchmarks/bench_convert.py --size 1024 --reps 3

writes ``benchmarks/results/<stamp>-convert.json``, ``.md`` and ``.png`` (needs the ``bench`` extra). The machine's
2 cores are shared by the client and the store: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(BENCH)]
import bench_dcp  # noqa: E402  (the 2-rank state, the server, the measurement helpers)

RESULTS = BENCH / "results"
BUCKET = "bench-convert"
MiB = 1024**2
METHODS = ("safetensors", "torch", "to-dcp", "raw")
SOURCE = f"s3://{BUCKET}/source"
RAW_GETS = 4
"""GETs in flight in the raw copy: a window of 4 parts is read while earlier windows upload (a window larger than the
writer's pool would stop the uploads while it is read)."""


# --------------------------------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------------------------------


def _save_source(rank: int, spec: dict[str, Any], port: int) -> None:
    """One rank of the setup: saves its shards of the state (and a tiny warm-up checkpoint) with S3StorageWriter."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import s3_dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        if spec.get("gpt"):
            import realistic_state

            d, layers = spec["gpt"]
            named = realistic_state.local_tensors(d, layers, rank, 2, fill=True)
            state = realistic_state.sharded_state(mesh, named, d, layers, tensors_only=True)
        else:
            state = bench_dcp._state(mesh, bench_dcp._local_tensors(rank, spec["size_mib"], fill=True))
        dcp.save(state, storage_writer=s3_dcp.S3StorageWriter(SOURCE))
        warm = bench_dcp._state(mesh, [torch.ones(4, 4)])
        dcp.save(warm, storage_writer=s3_dcp.S3StorageWriter(f"{SOURCE}-warmup"))
    finally:
        dist.destroy_process_group()


def _raw_copy(utils: Any, sources: list[str], destination: str, chunk_mb: int, reads: int, writes: int) -> int:
    """Copy the objects `sources` into one object: windows of ranged GETs, each written into the multipart writer."""
    chunk = chunk_mb * MiB
    window = bytearray(chunk * reads)
    total = 0
    with utils.open_writer(destination, chunk_mb, writes) as writer:
        for url in sources:
            size = utils.head_object(url).size
            for start in range(0, size, len(window)):
                view = memoryview(window)[: min(len(window), size - start)]
                ranges = [(start + o, view[o : o + chunk]) for o in range(0, len(view), chunk)]
                utils.read_ranges_into(url, ranges, max_concurrency=reads)
                writer.write(view)
                total += len(view)
    return total


def _measure_run(spec: dict[str, Any]) -> dict[str, Any]:
    import s3_checkpoint_convert
    import s3_utils

    utils = s3_utils.S3Utils()
    method, out = spec["method"], f"s3://{BUCKET}/out/rep{spec['rep']}"
    options = {"s3_utils": utils, "chunk_size_MB": spec["chunk_mb"], "overwrite": True}
    if method == "raw":
        shards = sorted(info.url for info in utils.list_objects(SOURCE) if info.url.endswith(".distcp"))
        warm = sorted(info.url for info in utils.list_objects(f"{SOURCE}-warmup") if info.url.endswith(".distcp"))
        _raw_copy(utils, warm, f"{out}/warmup.raw", spec["chunk_mb"], RAW_GETS, 10)

        def run() -> int:
            return _raw_copy(utils, shards, f"{out}/copy.raw", spec["chunk_mb"], RAW_GETS, 10)

    else:
        src, dst = {
            "safetensors": (SOURCE, f"{out}/model.safetensors"),
            "torch": (SOURCE, f"{out}/model.pt"),
            "to-dcp": (f"{out}/model.pt", f"{out}/dcp"),
        }[method]
        warm_src = f"{SOURCE}-warmup" if method != "to-dcp" else f"s3://{BUCKET}/warmup.pt"
        s3_checkpoint_convert.convert_checkpoint(warm_src, dst, **options)

        def run() -> int:
            return s3_checkpoint_convert.convert_checkpoint(src, dst, **options).tensor_bytes

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = bench_dcp._status()["VmRSS"]
    cpu = bench_dcp._cpu_s()
    started = time.perf_counter()
    nbytes = run()
    wall = time.perf_counter() - started
    cpu = bench_dcp._cpu_s() - cpu
    peak = bench_dcp._status()["VmHWM"] - before
    return {"bytes": nbytes, "wall_s": wall, "cpu_s": cpu, "peak_extra_mib": peak / MiB}


# --------------------------------------------------------------------------------------------------------------------
# Orchestrator
# --------------------------------------------------------------------------------------------------------------------


GPT: tuple[int, int] | None = None
"""``(d, layers)`` with ``--gpt``: the source is the realistic state's tensors (realistic_state.py)."""


def _reference(size_mib: int) -> dict[str, Any]:
    """The full tensors of the source, regenerated from the seeds (both ranks' row shards, concatenated)."""
    import torch

    if GPT is not None:
        import realistic_state

        return realistic_state.full_tensors(*GPT)

    shards = [bench_dcp._local_tensors(rank, size_mib, fill=True) for rank in range(2)]
    return {f"layer{n}.weight": torch.cat([shards[0][n], shards[1][n]]) for n in range(bench_dcp.TENSORS)}


def _flattened(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested state dict (a torch file converted from DCP nests as the saved state did) by DCP's dotted names."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flattened(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _check_outputs(utils: Any, size_mib: int, rep: int) -> list[str]:
    """Every tensor of the first rep's outputs against the regenerated state (after the clock)."""
    import safetensors.torch
    import torch
    import torch.distributed.checkpoint as dcp

    import s3_dcp

    expected = _reference(size_mib)
    problems = []
    out = f"s3://{BUCKET}/out/rep{rep}"
    with utils.download_to_memory(f"{out}/model.safetensors") as downloaded:
        exported = safetensors.torch.load(downloaded.read_all())
    if set(exported) != set(expected) or not all(torch.equal(exported[k], v) for k, v in expected.items()):
        problems.append("model.safetensors differs from the saved state")
    with utils.download_to_memory(f"{out}/model.pt") as downloaded:
        loaded = _flattened(torch.load(downloaded.path, mmap=True, weights_only=True))
    if set(loaded) != set(expected) or not all(torch.equal(loaded[k], v) for k, v in expected.items()):
        problems.append("model.pt differs from the saved state")
    del exported, loaded
    targets = {k: torch.empty_like(v) for k, v in expected.items()}
    dcp.load(targets, storage_reader=s3_dcp.S3StorageReader(f"{out}/dcp"))
    if not all(torch.equal(targets[k], v) for k, v in expected.items()):
        problems.append("the DCP checkpoint converted back differs from the saved state")
    return problems


def _run(spec: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        return {"method": spec["method"], "rep": spec["rep"], "error": done.stderr[-3000:]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    gib = result["bytes"] / 1024**3
    return {
        "method": spec["method"],
        "rep": spec["rep"],
        "mib_s": result["bytes"] / MiB / result["wall_s"],
        "wall_s": result["wall_s"],
        "cpu_s_per_gib": result["cpu_s"] / gib,
        "peak_extra_mib": result["peak_extra_mib"],
    }


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    medians: dict[str, Any] = {}
    for method in METHODS:
        rows = [r for r in runs if r["method"] == method and "error" not in r]
        if rows:
            medians[method] = {
                "mib_s": statistics.median(r["mib_s"] for r in rows),
                "cpu_s_per_gib": statistics.median(r["cpu_s_per_gib"] for r in rows),
                "peak_extra_mib": max(r["peak_extra_mib"] for r in rows),
                "reps": len(rows),
            }
    raw = medians.get("raw", {}).get("mib_s")
    for method, row in medians.items():
        row["x_raw"] = row["mib_s"] / raw if raw else None
        per_rep = []
        for run in runs:
            twin = next((r for r in runs if r["method"] == "raw" and r["rep"] == run["rep"] and "error" not in r), None)
            if run["method"] == method and "error" not in run and twin:
                per_rep.append(run["mib_s"] / twin["mib_s"])
        row["x_raw_per_rep"] = [round(x, 2) for x in per_rep]
    return medians


LABELS = {
    "safetensors": "DCP -> .safetensors",
    "torch": "DCP -> .pt",
    "to-dcp": ".pt -> DCP",
    "raw": "raw copy (ranged GETs + multipart PUT)",
}


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Conversion benchmark {report['stamp']}",
        "",
        f"{report['size_mib']} MiB (16 float32 tensors) saved by 2 gloo ranks, converted S3 to S3 on SeaweedFS "
        f"(`weed mini`), {report['chunk_mb']} MiB parts and GETs, package defaults otherwise; {report['reps']} reps, "
        f"medians (peak RSS: the largest). Machine: {report['machine']}.",
        "",
        "| method | MiB/s | x raw copy (per rep) | client CPU s/GiB | peak extra RSS MiB |",
        "|---|---:|---|---:|---:|",
    ]
    for method in METHODS:
        row = report["medians"].get(method)
        if row is None:
            continue
        ratio = f"{row['x_raw']:.2f}x ({', '.join(f'{x:.2f}' for x in row['x_raw_per_rep'])})" if row["x_raw"] else "-"
        lines.append(
            f"| {LABELS[method]} | {row['mib_s']:.0f} | {ratio} | {row['cpu_s_per_gib']:.2f} | "
            f"{row['peak_extra_mib']:.0f} |"
        )
    lines += ["", f"Outputs checked against the saved state: {report['check']}"]
    for note in report["notes"]:
        lines += ["", f"Note: {note}"]
    for run in [r for r in report["runs"] if "error" in r]:
        lines += ["", f"Error in {run['method']} rep {run['rep']}:", "```", run["error"][-1500:], "```"]
    return "\n".join(lines) + "\n"


def _chart(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('NOTE: no chart: matplotlib is missing (pip install ".[bench]")', flush=True)
        return False
    medians = report["medians"]
    methods = [m for m in METHODS if m in medians]
    metrics = (
        ("mib_s", "MiB/s (higher is better)", "{:.0f}"),
        ("cpu_s_per_gib", "client CPU s/GiB (lower is better)", "{:.2f}"),
        ("peak_extra_mib", "peak extra RSS MiB (lower is better)", "{:.0f}"),
    )
    fig, axes = plt.subplots(1, len(metrics), figsize=(12, 2.8), squeeze=False)
    for axis, (metric, title, fmt) in zip(axes[0], metrics, strict=True):
        values = [medians[m][metric] for m in methods]
        names = ["raw copy" if m == "raw" else LABELS[m] for m in methods]
        axis.barh(names, values, color=["tab:gray" if m == "raw" else "tab:orange" for m in methods])
        axis.invert_yaxis()
        axis.set_title(title, fontsize=9)
        axis.tick_params(labelsize=8)
        for y, value in enumerate(values):
            axis.text(value, y, " " + fmt.format(value), va="center", fontsize=8)
    fig.suptitle(
        f"Convert {report['size_mib']} MiB S3 to S3, SeaweedFS, {report['reps']} reps (medians; {report['stamp']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _worker(spec_json: str) -> int:
    spec = json.loads(spec_json)
    if spec["method"] == "setup":
        import socket

        import torch
        import torch.multiprocessing as mp

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(_save_source, args=(spec, port), nprocs=2, join=True)
        import s3_utils

        buffer = io.BytesIO()
        torch.save({"warm": torch.ones(4, 4)}, buffer)
        with s3_utils.S3Utils().open_writer(f"s3://{BUCKET}/warmup.pt") as writer:
            writer.write(buffer.getvalue())
        return 0
    print(json.dumps(_measure_run(spec)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=1024, help="checkpoint size in MiB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk-mb", type=int, default=16, help="part and GET size (the package default: 16)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--tag", default="")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--gpt", default="", help='"D,LAYERS": the realistic state (realistic_state.py), e.g. "768,8"')
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args.worker)
    global GPT
    if args.gpt:
        import realistic_state

        d, layers = (int(x) for x in args.gpt.split(","))
        GPT = (d, layers)
        args.size = round(realistic_state.size_mib(d, layers))

    methods = [m for m in args.methods.split(",") if m]
    if "to-dcp" in methods and "torch" not in methods:
        parser.error("to-dcp converts the torch run's output: keep torch in --methods")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    data_dir = tempfile.mkdtemp(prefix="bench-convert-weed-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    runs: list[dict[str, Any]] = []
    check = "not run"
    try:
        with bench_dcp._seaweedfs(data_dir) as endpoint:
            endpoint.client().create_bucket(Bucket=BUCKET)
            env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
            env.update(endpoint.env())
            env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(BENCH)])
            base = {"size_mib": args.size, "chunk_mb": args.chunk_mb, "gpt": GPT}
            print(f"setup: 2 ranks save {args.size} MiB ...", flush=True)
            setup = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps({**base, "method": "setup"})],
                env=env,
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
            if setup.returncode != 0:
                raise RuntimeError(f"setup failed: {setup.stderr[-3000:]}")
            for rep in range(args.reps):
                for method in methods:
                    print(f"rep {rep} {method} ...", flush=True)
                    run = _run({**base, "method": method, "rep": rep}, env, args.timeout)
                    print(json.dumps(run)[:300], flush=True)
                    runs.append(run)
            if {"safetensors", "torch", "to-dcp"} <= set(methods):
                os.environ.update(endpoint.env())
                import s3_utils

                problems = _check_outputs(s3_utils.S3Utils(), args.size, 0)
                check = "every tensor equal (rep 0)" if not problems else "; ".join(problems)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    report = {
        "stamp": stamp,
        "size_mib": args.size,
        "reps": args.reps,
        "chunk_mb": args.chunk_mb,
        "gpt": GPT,
        "machine": f"{os.cpu_count()} CPUs",
        "check": check,
        "notes": ["the client and SeaweedFS share this machine's CPUs: all numbers compete for them"],
        "runs": runs,
        "medians": _summary(runs),
    }
    RESULTS.mkdir(exist_ok=True)
    name = f"{stamp}-convert{('-' + args.tag) if args.tag else ''}"
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
    (RESULTS / f"{name}.md").write_text(_markdown(report))
    _chart(report, RESULTS / f"{name}.png")
    print(_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
