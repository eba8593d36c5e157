#!/usr/bin/env python
"""What a save or load costs the training job: client CPU per GiB beside the raw requests of the same bytes, and
the training loop's step time while an async save uploads. SeaweedFS on 127.0.0.1, every measurement in a fresh
process, scenarios interleaved rep by rep.

    python benchmarks/bench_cpu.py --size 1024 --reps 3            # CPU per GiB (about 4 min on 2 cores)
    python benchmarks/bench_cpu.py --steps --size 1024 --reps 3     # step-time inflation only (about 3 min)
    python benchmarks/bench_cpu.py --repo /path/to/other/checkout   # the same scenarios with another checkout's code
    python benchmarks/bench_cpu.py --steps --also-repo main=/work/main  # and ours@main beside ours, same run

CPU mode (``--scenarios``, all by default), each on the same state (16 float32 tensors, ``--size`` MiB in all):

* ``raw-put``: one ``put_object`` of the already serialised checkpoint (bytes in memory) with a CRC32C checksum and
  payload signing off, on this package's client: the cheapest way to send those bytes with a checksum;
* ``sync`` / ``async``: `S3CheckpointIO.save_checkpoint` (async: until `wait_for_pending_saves` returns, the snapshot
  included);
* ``dcp-save``: ``dcp.save(no_dist=True)`` through `s3_dcp.S3StorageWriter`;
* ``raw-get``: 16 MiB ranged GETs, 15 in parallel, of the raw object into a touched buffer (``read_ranges_into``),
  the cheapest load of the same bytes;
* ``dcp-load``: ``dcp.load(no_dist=True)`` through `s3_dcp.S3StorageReader` into touched target tensors.

Each worker runs its operation once unmeasured, then measures the second run (a training job saves and loads many
times; ``--cold`` measures the first). Client CPU is ``getrusage`` (every thread of the process), per GiB of state. Ratios are taken within each rep (the
scenarios of one rep run back to back), then the median over reps, so the machine's drift cancels out.

Steps mode: one process runs a small CPU-bound training loop (a 2-layer MLP, forward, backward and SGD step, one
torch thread) and measures each step's time: ``--baseline-s`` seconds with no save, then while one async save of
the state uploads, for this package (`S3CheckpointIO(async_checkpointing=True)`), Lightning's
``AsyncCheckpointIO(TorchCheckpointIO())`` on s3fs, and NeMo's async path (``torch.save`` to a ``/dev/shm`` file in
the training process, then boto3 ``upload_file`` with 64 MB parts x 10 in a ``ProcessPoolExecutor`` worker, as NeMo's
S3CheckpointIO does). It reports the median and p99 step time during the save over the baseline's, and splits the
loop's time (Linux schedstat of its thread) into time blocked, which in this loop means waiting for the GIL, and time
runnable but waiting for a CPU. This is very
sensitive to anything else running on the machine: run it alone.

Output: ``benchmarks/results/<stamp>-cpu[-steps][-tag].json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
BUCKET = "bench-cpu"
MiB = 1024**2
GiB = 1024**3
TENSORS = 16
SCENARIOS = ("raw-put", "sync", "async", "dcp-save", "raw-get", "dcp-load")
STEP_METHODS = ("ours", "lightning", "nemo")
RATIOS = (("sync", "raw-put"), ("async", "raw-put"), ("dcp-save", "raw-put"), ("dcp-load", "raw-get"))


# --------------------------------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------------------------------


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _shapes(size_mib: int, layout: str) -> list[tuple[int, ...]]:
    """The tensors' shapes: ``2d`` rows x 1024 (16 tensors), ``1d`` the same elements flat, ``mixed`` 8 large 2-D
    tensors with 7/8 of the bytes and 248 small 1-D ones (biases, norms) with the rest, as a real model has."""
    elements = size_mib * MiB // 4
    if layout == "2d":
        return [(elements // TENSORS // 1024, 1024)] * TENSORS
    if layout == "1d":
        return [(elements // TENSORS,)] * TENSORS
    if layout == "mixed":
        large = elements * 7 // 8 // 8 // 1024
        small = (elements - 8 * large * 1024) // 248
        return [(large, 1024)] * 8 + [(small,)] * 248
    raise ValueError(f"unknown layout {layout!r}")


def _tensors(size_mib: int, fill: bool, layout: str = "2d") -> dict[str, Any]:
    import torch

    state = {}
    for n, shape in enumerate(_shapes(size_mib, layout)):
        if fill:
            state[f"layer{n}.weight"] = torch.rand(shape, generator=torch.Generator().manual_seed(1000 + n))
        else:
            state[f"layer{n}.weight"] = torch.full(shape, -1.0)  # touched before the clock starts
    return state


def _start_perf(spec: dict[str, Any]) -> Any:
    """``perf record`` of this process during the measured operation only (``--perf DIR``), or None."""
    if not spec.get("perf"):
        return None
    output = Path(spec["perf"], f"{spec['scenario']}-{spec['key']}")
    command = ["perf", "record", "-F", "999", "-g", "-o", f"{output}.data", "-p", str(os.getpid())]
    if os.environ.get("BENCH_CPU_PYSPY"):  # Python-level view instead (py-spy on PATH)
        command = ["py-spy", "record", "-r", "250", "-f", "raw", "-o", f"{output}.pyspy", "--threads", "--nonblocking"]
        command += ["-p", str(os.getpid())]
    profiler = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # perf attaches to every thread before the clock starts
    return profiler


def _stop_perf(profiler: Any) -> None:
    if profiler is not None:
        profiler.send_signal(2)  # SIGINT: perf writes its file and exits
        profiler.wait(timeout=60)


def _cpu_worker(spec: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, spec["repo"])
    import torch

    torch.set_num_threads(1)
    import s3_utils

    scenario, size = spec["scenario"].split("@")[0], spec["size_mib"]  # "sync@main": sync, another checkout
    url = f"s3://{BUCKET}/{spec['key']}"
    utils = s3_utils.S3Utils(s3_utils.S3ClientSettings(endpoint_url=spec["endpoint"]))
    utils.client.head_bucket(Bucket=BUCKET)  # client and first connection up before the clock
    state = _tensors(size, fill=scenario not in ("raw-get", "dcp-load"), layout=spec.get("layout", "2d"))
    operation: Any
    if scenario == "raw-put":
        buffer = io.BytesIO()
        torch.save({"state_dict": state}, buffer)
        payload = buffer.getvalue()
        del buffer

        def operation() -> None:
            utils.client.put_object(Bucket=BUCKET, Key=spec["key"], Body=payload, ChecksumAlgorithm="CRC32C")

    elif scenario in ("sync", "async"):
        import s3_checkpoint_io

        plugin = s3_checkpoint_io.S3CheckpointIO(
            f"s3://{BUCKET}/", async_checkpointing=scenario == "async", s3_utils=utils
        )
        plugin.save_checkpoint({"warm": torch.ones(4)}, f"{url}-warmup")
        plugin.wait_for_pending_saves()

        def operation() -> None:
            plugin.save_checkpoint({"state_dict": state}, url)
            plugin.wait_for_pending_saves()

    elif scenario in ("dcp-save", "dcp-load"):
        import torch.distributed.checkpoint as dcp

        import s3_dcp

        writer = s3_dcp.S3StorageWriter(url, s3_utils=utils)
        reader = s3_dcp.S3StorageReader(url, s3_utils=utils)
        warm = {"warm": torch.ones(4)}
        dcp.save(warm, storage_writer=writer, checkpoint_id=f"{url}-warmup", no_dist=True)
        dcp.load(warm, storage_reader=reader, checkpoint_id=f"{url}-warmup", no_dist=True)
        if scenario == "dcp-save":

            def operation() -> None:
                dcp.save(state, storage_writer=writer, checkpoint_id=url, no_dist=True)

        else:

            def operation() -> None:
                dcp.load(state, storage_reader=reader, checkpoint_id=url, no_dist=True)

    elif scenario == "raw-get":
        size_bytes = utils.head_object(url).size
        target = bytearray(b"\xff" * size_bytes)
        view = memoryview(target)
        chunk = 16 * MiB
        ranges = [(start, view[start : start + chunk]) for start in range(0, size_bytes, chunk)]
        utils.read_range_into(url, 0, bytearray(1024))

        def operation() -> None:
            utils.read_ranges_into(url, ranges, max_concurrency=15)

    else:
        raise SystemExit(f"unknown scenario {scenario}")
    if spec["warm"]:
        operation()  # a job saves and loads many times: measure one that finds the process as the last one left it
    profiler = _start_perf(spec)
    cpu, started = _cpu_s(), time.perf_counter()
    operation()
    wall, cpu = time.perf_counter() - started, _cpu_s() - cpu
    _stop_perf(profiler)
    result = {"wall_s": wall, "cpu_s": cpu, "cpu_s_per_gib": cpu / (size / 1024), "mib_s": size / wall}
    if scenario == "dcp-load":
        expected = _tensors(size, fill=True, layout=spec.get("layout", "2d"))
        result["identical"] = all(torch.equal(state[name], expected[name]) for name in expected)
    return result


# ---- steps mode --------------------------------------------------------------------------------------------------


def _nemo_upload(path: str, url: str, endpoint: str) -> None:
    """NeMo's async upload, in its ProcessPoolExecutor worker: boto3 ``upload_file``, 64 MB parts x 10 threads."""
    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.session.Session().client("s3", endpoint_url=endpoint)
    bucket, key = url[len("s3://") :].split("/", 1)
    client.upload_file(path, bucket, key, Config=TransferConfig(multipart_chunksize=64 * MiB, max_concurrency=10))
    os.unlink(path)


def _steps_worker(spec: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, spec["repo"])
    import torch

    torch.set_num_threads(1)
    method, size = spec["method"].split("@")[0], spec["size_mib"]  # "ours@main": ours, another checkout
    url = f"s3://{BUCKET}/{spec['key']}"
    state = {"state_dict": _tensors(size, fill=True)}
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, labels = torch.randn(64, 256), torch.randint(0, 10, (64,))

    schedstat = _thread_schedstat()
    waits: dict[str, list[tuple[float, float]]] = {"baseline": [], "during": []}

    def step(phase: str = "warm") -> float:
        before = schedstat()
        started = time.perf_counter()
        for _ in range(spec["inner"]):
            optimiser.zero_grad()
            torch.nn.functional.cross_entropy(model(inputs), labels).backward()
            optimiser.step()
        elapsed = time.perf_counter() - started
        after = schedstat()
        if before and after and phase in waits:
            on_cpu, queued = after[0] - before[0], after[1] - before[1]
            # (off a CPU and not runnable, queued). Not clamped per step: the kernel updates a running thread's CPU
            # time at ticks, so one step's share may come out negative and the next's too high; the sums are right.
            waits[phase].append((elapsed - on_cpu - queued, queued))
        return elapsed

    if method == "ours":
        import s3_checkpoint_io

        options = spec.get("ours") or {}
        plugin = s3_checkpoint_io.S3CheckpointIO(f"s3://{BUCKET}/", async_checkpointing=True, **options)
        plugin.save_checkpoint({"warm": torch.ones(4)}, f"{url}-warmup")
        plugin.wait_for_pending_saves()

        def start() -> Any:
            plugin.save_checkpoint(state, url)
            return lambda: not plugin._pending

        finish = plugin.wait_for_pending_saves
    elif method == "lightning":
        import fsspec
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
        from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO

        fsspec.filesystem("s3").ls(BUCKET)
        plugin = AsyncCheckpointIO(TorchCheckpointIO())

        def start() -> Any:
            plugin.save_checkpoint(state, url)
            marker = plugin._executor.submit(lambda: None)  # its one worker thread reaches this once the save ended
            return marker.done

        def finish() -> None:
            plugin.teardown()  # waits for the thread; raises the save's error, if any

    elif method == "nemo":
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(max_workers=1)
        pool.submit(time.sleep, 0.01).result()  # NeMo forks its worker up front
        pending: list[Any] = []

        def start() -> Any:
            with tempfile.NamedTemporaryFile(dir="/dev/shm", delete=False) as file:
                torch.save(state, file)
            pending.append(pool.submit(_nemo_upload, file.name, url, spec["endpoint"]))
            return pending[-1].done

        def finish() -> None:
            pending[-1].result()
            pool.shutdown()

    else:
        raise SystemExit(f"unknown method {method}")
    for _ in range(20):  # warm: allocator, autograd graph
        step()
    baseline = []
    deadline = time.perf_counter() + spec["baseline_s"]
    while time.perf_counter() < deadline:
        baseline.append(step("baseline"))
    cpu, started = _cpu_s(), time.perf_counter()
    done = start()
    blocked = time.perf_counter() - started
    during = []
    while not done():
        during.append(step("during"))
    finish()
    wall, cpu = time.perf_counter() - started, _cpu_s() - cpu
    return {
        "baseline": baseline,
        "during": during,
        "blocked_s": blocked,
        "save_wall_s": wall,
        "cpu_s": cpu,
        "waits": waits,
    }


def _thread_schedstat() -> Any:
    """A function returning the calling thread's ``(seconds on a CPU, seconds runnable but waiting for one)`` from
    Linux's ``/proc/thread-self/schedstat`` (None where there is none). A step's wall time less both is time the
    thread was blocked: in this loop, which does no I/O, waiting for the GIL."""
    try:
        fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    except OSError:
        return lambda: None

    def read() -> tuple[float, float] | None:
        fields = os.pread(fd, 200, 0).split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9

    return read


# --------------------------------------------------------------------------------------------------------------------
# Orchestrator
# --------------------------------------------------------------------------------------------------------------------


def _empty_store(endpoint: Any) -> None:
    """Delete every object of the bucket and have SeaweedFS compact its volumes, so tmpfs space comes back."""
    client = endpoint.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})
    with contextlib.suppress(Exception):
        urllib.request.urlopen("http://127.0.0.1:9333/vol/vacuum?garbageThreshold=0.0001", timeout=120).read()


def _run_worker(kind: str, spec: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), f"--{kind}-worker", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"error": (done.stderr or done.stdout)[-2000:]}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _cpu_report(runs: list[dict[str, Any]], reps: int) -> dict[str, Any]:
    medians: dict[str, Any] = {}
    for scenario in dict.fromkeys(r["scenario"] for r in runs):
        rows = [r for r in runs if r["scenario"] == scenario and "error" not in r]
        if rows:
            medians[scenario] = {
                key: statistics.median(r[key] for r in rows) for key in ("cpu_s_per_gib", "mib_s", "wall_s")
            }
    ratios = {}
    references = dict(RATIOS)
    for scenario in medians:
        reference = references.get(scenario.split("@")[0])
        per_rep = []
        for rep in range(reps):
            mine = [r for r in runs if r["scenario"] == scenario and r["rep"] == rep and "error" not in r]
            base = [r for r in runs if r["scenario"] == reference and r["rep"] == rep and "error" not in r]
            if mine and base:
                per_rep.append(mine[0]["cpu_s_per_gib"] / base[0]["cpu_s_per_gib"])
        if per_rep:
            ratios[f"{scenario}/{reference}"] = {"median": statistics.median(per_rep), "per_rep": per_rep}
    return {"medians": medians, "ratios": ratios}


def _steps_report(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary = {}
    for method in dict.fromkeys(r["method"] for r in runs):
        rows = [r for r in runs if r["method"] == method and "error" not in r and r["during"]]
        if not rows:
            continue
        per_rep = []
        for r in rows:
            base_median, base_p99 = statistics.median(r["baseline"]), _percentile(r["baseline"], 0.99)
            per_rep.append(
                {
                    "median_inflation": statistics.median(r["during"]) / base_median - 1,
                    "p99_inflation": _percentile(r["during"], 0.99) / base_p99 - 1,
                    "baseline_median_ms": 1000 * base_median,
                    "during_median_ms": 1000 * statistics.median(r["during"]),
                    "steps_during": len(r["during"]),
                    "blocked_s": r["blocked_s"],
                    "save_wall_s": r["save_wall_s"],
                    **_wait_shares(r),
                }
            )
        keys = [key for key in per_rep[0] if all(key in p for p in per_rep)]
        summary[method] = {key: statistics.median(p[key] for p in per_rep) for key in keys}
        summary[method]["per_rep"] = per_rep
    return summary


def _wait_shares(run: dict[str, Any]) -> dict[str, float]:
    """Where the loop's step time went besides computing, as shares of it: blocked (the GIL) and runnable but
    waiting for a CPU (the machine's other load, the upload's own CPU), with no save and during it."""
    shares = {}
    for phase in ("baseline", "during"):
        waits = (run.get("waits") or {}).get(phase) or []
        total = sum(run[phase][: len(waits)]) or 1.0
        if waits:
            shares[f"gil_wait_share_{phase}"] = max(0.0, sum(blocked for blocked, _ in waits)) / total
            shares[f"cpu_wait_share_{phase}"] = sum(queued for _, queued in waits) / total
    return shares


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# CPU benchmark {report['stamp']}",
        "",
        f"{report['size_mib']} MiB, {report['reps']} reps, "
        f"SeaweedFS on 127.0.0.1, {report['machine']}; load average before: {report['load_before']}; "
        f"code: {report['repo']}"
        + "".join(f"; {item.replace('=', ': ', 1)}" for item in report.get("also_repos", []))
        + ".",
        "",
    ]
    if report["mode"] == "cpu":
        medians, ratios = report["summary"]["medians"], report["summary"]["ratios"]
        lines += [
            "| scenario | client CPU s/GiB | MiB/s | wall s | CPU x raw (median of per-rep ratios) |",
            "|---|---:|---:|---:|---:|",
        ]
        references = dict(RATIOS)
        for scenario, row in medians.items():
            reference = references.get(scenario.split("@")[0])
            key = f"{scenario}/{reference}"
            ratio = f"{ratios[key]['median']:.2f}x {reference}" if key in ratios else "-"
            lines.append(
                f"| {scenario} | {row['cpu_s_per_gib']:.2f} | {row['mib_s']:.0f} | {row['wall_s']:.2f} | {ratio} |"
            )
    else:
        lines += [
            "| async save by | median step inflation | p99 step inflation | baseline median ms | during median ms "
            "| steps during | GIL wait % of step: none / during | CPU wait %: none / during "
            "| caller blocked s | save wall s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]

        def shares(row: dict[str, Any], kind: str) -> str:
            if f"{kind}_share_during" not in row:
                return "-"
            return f"{100 * row[f'{kind}_share_baseline']:.1f} / {100 * row[f'{kind}_share_during']:.1f}"

        for method, row in report["summary"].items():
            lines.append(
                f"| {method} | {100 * row['median_inflation']:+.1f}% | {100 * row['p99_inflation']:+.1f}% | "
                f"{row['baseline_median_ms']:.1f} | {row['during_median_ms']:.1f} | {row['steps_during']:.0f} | "
                f"{shares(row, 'gil_wait')} | {shares(row, 'cpu_wait')} | {row['blocked_s']:.2f} | "
                f"{row['save_wall_s']:.2f} |"
            )
        lines += [
            "",
            "GIL wait: the loop's thread blocked (off a CPU, not runnable: in this loop, waiting for the GIL); CPU "
            "wait: runnable but waiting for a CPU (Linux schedstat), each as a share of the steps' wall time.",
        ]
    errors = [r for r in report["runs"] if "error" in r]
    for run in errors:
        lines += [
            "",
            f"Error in {run.get('scenario') or run.get('method')} rep {run['rep']}:",
            "```",
            run["error"][-1500:],
            "```",
        ]
    return "\n".join(lines) + "\n"


def _chart(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('NOTE: no chart: matplotlib is missing (pip install ".[bench]")', flush=True)
        return
    fig, axis = plt.subplots(figsize=(8, 3.8))
    if report["mode"] == "cpu":
        medians = report["summary"]["medians"]
        names = list(medians)
        values = [medians[n]["cpu_s_per_gib"] for n in names]
        colours = ["tab:gray" if n.startswith("raw") else "tab:orange" for n in names]
        axis.barh(names, values, color=colours)
        axis.set_xlabel("client CPU s per GiB (lower is better; grey: raw requests of the same bytes)")
        for y, value in enumerate(values):
            axis.text(value, y, f" {value:.2f}", va="center", fontsize=8)
    else:
        summary = report["summary"]
        names = list(summary)
        medians = [100 * summary[n]["median_inflation"] for n in names]
        p99s = [100 * summary[n]["p99_inflation"] for n in names]
        positions = range(len(names))
        axis.barh([p - 0.2 for p in positions], medians, height=0.4, label="median", color="tab:orange")
        axis.barh([p + 0.2 for p in positions], p99s, height=0.4, label="p99", color="tab:blue")
        axis.set_yticks(list(positions), names)
        axis.axvline(10, color="gray", linestyle="--", linewidth=0.8)
        axis.set_xlabel("step time during an async save, % over the same loop with no save")
        axis.legend(fontsize=8)
    axis.invert_yaxis()
    fig.suptitle(f"{report['mode']}: {report['size_mib']} MiB, {report['reps']} reps ({report['stamp']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-worker", help=argparse.SUPPRESS)
    parser.add_argument("--steps-worker", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=1024, help="state size in MiB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--steps", action="store_true", help="measure step-time inflation instead of CPU")
    parser.add_argument("--methods", default=",".join(STEP_METHODS), help="steps mode: whose async save")
    parser.add_argument("--baseline-s", type=float, default=5.0, help="steps mode: seconds of steps with no save")
    parser.add_argument("--inner", type=int, default=20, help="steps mode: MLP iterations per step")
    parser.add_argument("--ours", default="{}", help="steps mode: JSON keyword arguments for S3CheckpointIO")
    parser.add_argument("--repo", default=str(REPO), help="the checkout whose modules are measured")
    parser.add_argument(
        "--also-repo",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also measure this checkout's modules in the same run, interleaved: steps mode adds method ours@NAME, "
        "CPU mode sync@NAME, async@NAME, dcp-save@NAME, dcp-load@NAME for those scenarios selected (repeatable)",
    )
    parser.add_argument(
        "--cold", action="store_true", help="CPU mode: measure the first full-size operation of each process"
    )
    parser.add_argument("--layout", default="2d", choices=("2d", "1d", "mixed"), help="CPU mode: tensor shapes")
    parser.add_argument("--perf", help="CPU mode: write a perf profile of each measured operation into this folder")
    parser.add_argument("--tag", default="")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    for kind in ("cpu", "steps"):
        worker_spec = getattr(args, f"{kind}_worker")
        if worker_spec:
            spec = json.loads(worker_spec)
            result = (_cpu_worker if kind == "cpu" else _steps_worker)(spec)
            print("RESULT " + json.dumps(result), flush=True)
            return 0

    sys.path.insert(0, str(REPO))
    import s3_local_servers

    mode = "steps" if args.steps else "cpu"
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    data_dir = tempfile.mkdtemp(prefix="bench-cpu-weed-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    runs: list[dict[str, Any]] = []
    try:
        with s3_local_servers.seaweedfs_server(data_dir, lock="wait") as endpoint:
            endpoint.client().create_bucket(Bucket=BUCKET)
            env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
            env.update(endpoint.env())
            base = {"size_mib": args.size, "endpoint": endpoint.endpoint_url, "repo": str(Path(args.repo).resolve())}
            others = dict(item.split("=", 1) for item in args.also_repo)
            repos = {name: str(Path(path).resolve()) for name, path in others.items()}
            scenarios = [s for s in args.scenarios.split(",") if s]
            scenarios += [
                f"{s}@{name}" for name in repos for s in scenarios if s in ("sync", "async", "dcp-save", "dcp-load")
            ]
            methods = [m for m in args.methods.split(",") if m]
            methods += [f"ours@{name}" for name in repos if "ours" in methods]
            for rep in range(args.reps):
                if rep:
                    _empty_store(endpoint)  # the store keeps its data in RAM (/dev/shm): a few GiB per rep
                if mode == "cpu":
                    for scenario in scenarios:
                        name = scenario.partition("@")[2]
                        key = (
                            "raw" if scenario.startswith("raw") else ("dcp" if scenario.startswith("dcp") else scenario)
                        )
                        key += f"@{name}" if name and key == "dcp" else ""  # dcp-load@NAME reads dcp-save@NAME's
                        spec = {**base, "scenario": scenario, "key": f"{key}-{rep}", "warm": not args.cold}
                        spec["repo"] = repos.get(name, base["repo"])
                        spec["perf"] = args.perf and str(Path(args.perf).resolve())
                        spec["layout"] = args.layout
                        run = {"scenario": scenario, "rep": rep, **_run_worker("cpu", spec, env, args.timeout)}
                        print(json.dumps(run)[:300], flush=True)
                        runs.append(run)
                else:
                    for method in methods:
                        spec = {
                            **base,
                            "repo": repos.get(method.partition("@")[2], base["repo"]),
                            "method": method,
                            "key": f"steps-{method}-{rep}",
                            "baseline_s": args.baseline_s,
                            "inner": args.inner,
                            "ours": json.loads(args.ours),
                        }
                        run = {"method": method, "rep": rep, **_run_worker("steps", spec, env, args.timeout)}
                        print(
                            json.dumps({k: v for k, v in run.items() if k not in ("baseline", "during")})[:300],
                            flush=True,
                        )
                        runs.append(run)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    report = {
        "stamp": stamp,
        "mode": mode,
        "size_mib": args.size,
        "reps": args.reps,
        "repo": args.repo,
        "also_repos": args.also_repo,
        "machine": f"{os.cpu_count()} CPUs",
        "load_before": load_before,
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "runs": runs,
        "summary": _cpu_report(runs, args.reps) if mode == "cpu" else _steps_report(runs),
    }
    RESULTS.mkdir(exist_ok=True)
    name = f"{stamp}-cpu{'-steps' if args.steps else ''}{('-' + args.tag) if args.tag else ''}"
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
    (RESULTS / f"{name}.md").write_text(_markdown(report))
    _chart(report, RESULTS / f"{name}.png")
    print(_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
