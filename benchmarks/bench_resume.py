#!/usr/bin/env python
"""Resume at several ranks: one checkpoint loaded by 4 ranks (2 "nodes" x 2 local ranks) from a local SeaweedFS.

    /work/venv/bin/python benchmarks/bench_resume.py --size-mib 1024 --reps 3

Scenarios, each a fresh job of 4 processes (the torchrun environment, GROUP_RANK being the node, gloo) started by
``tests/helpers/load_sharing_worker.py``, every rank loading the same ``s3://`` checkpoint at once:

* ``node``: `S3CheckpointIO(load_sharing="node")` in a collective load: one download per node into /dev/shm,
  every rank of the node maps those pages;
* ``job``: ``load_sharing="job"``: global rank 0 downloads, the other node's downloader receives the bytes over a
  gloo process group (loopback here: a stand-in for the interconnect), then as ``node``;
* ``rank``: ``load_sharing="rank"``: every rank downloads its own copy (what this package did before);
* ``NeMo``: NeMo's load on every rank: ``download_fileobj`` (64 MiB parts, 15 threads) into a BytesIO, then
  ``torch.load`` from it.

Measured per job: wall time from the common start (a barrier) until the last rank holds the state; GETs and bytes
the store served (counted by each rank's client); node RAM: the PSS the load added, summed over a node's ranks,
read once every rank holds the state, the larger node reported. Results: ``benchmarks/results/resume-<UTC>.json``
and ``.md`` (plus ``resume-latest.*``). Scenarios run interleaved, rep by rep, so drift hits them alike. The machine
has 2 cores shared by 4 ranks and the store: absolute times are pessimistic; compare the ratios.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
WORKER = REPO / "tests" / "helpers" / "load_sharing_worker.py"
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
SCENARIOS = ("node", "job", "rank", "NeMo")
BUCKET = "resume-bench"


def _repo_on_path() -> None:
    for path in (REPO, REPO / "tests", REPO / "tests" / "helpers"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


def _free_port() -> int:
    _repo_on_path()
    try:
        from s3_servers import free_port  # the test helpers (tests/ or tests/helpers/)
    except ImportError:
        from s3_local_servers import free_port
    return free_port()


def _seaweedfs(data_dir: str) -> Any:
    """A running ``weed mini`` (context manager yielding its endpoint), waiting for the machine-wide weed lock."""
    _repo_on_path()
    try:
        from s3_servers import start_seaweedfs

        return start_seaweedfs(data_dir)
    except ImportError:
        from s3_local_servers import seaweedfs_server

        return seaweedfs_server(data_dir, lock="wait")


PEAK_COPIES = {"node": NODES, "job": NODES, "rank": WORLD, "NeMo": 2 * WORLD}
"""Copies of the checkpoint a scenario holds at its peak on this machine (NeMo: the BytesIO and the tensors)."""


def _available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _run_job(scenario: str, url: str, env: dict[str, str], out: Path, chunk_mib: float, timeout: float) -> dict:
    out.mkdir(parents=True)
    base = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(WORLD)}
    base.update(LOCAL_WORLD_SIZE=str(PER_NODE), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    if scenario == "NeMo":
        args = ["--mode", "nemo"]
    else:
        _repo_on_path()
        import s3_utils

        args = ["--mode", "load", "--sharing", scenario, "--chunk", str(chunk_mib)]
        args += ["--concurrency", str(s3_utils.DEFAULT_MAX_READ_CONCURRENCY), "--read-timeout", "120"]
    procs = []
    for rank in range(WORLD):
        node, local = divmod(rank, PER_NODE)
        rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(local), "GROUP_RANK": str(node)}
        command = [sys.executable, str(WORKER), *args, "--url", url, "--out", str(out)]
        with open(out / f"rank{rank}.log", "wb") as log:
            procs.append(subprocess.Popen(command, env=rank_env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    reports = []
    for rank in range(WORLD):
        path = out / f"rank{rank}.json"
        if not path.exists():
            tail = (out / f"rank{rank}.log").read_text()[-2000:]
            return {"scenario": scenario, "error": f"rank {rank} wrote no report: {tail}"}
        report = json.loads(path.read_text())
        reports.append(report["scenarios"]["load"] if "scenarios" in report else report)
    errors = [r["error"]["message"] for r in reports if "error" in r]
    if errors:
        return {"scenario": scenario, "error": errors[0]}
    fingerprints = {json.dumps(r["fingerprint"], sort_keys=True) for r in reports}
    if len(fingerprints) != 1:
        return {"scenario": scenario, "error": "ranks hold different states"}
    node_ram = [
        sum(r["pss_during"] - r["pss_before"] for i, r in enumerate(reports) if i // PER_NODE == node)
        for node in range(NODES)
    ]
    return {
        "scenario": scenario,
        "wall_s": max(r["loaded_at"] for r in reports) - min(r["started"] for r in reports),
        "rank_load_s": [r["load_s"] for r in reports],
        "gets": sum(r["gets"] for r in reports),
        "bytes": sum(r["bytes"] for r in reports),
        "node_ram_bytes": max(node_ram),
        "fingerprint": next(iter(fingerprints)),
    }


def _summary(runs: list[dict], size: int) -> list[dict]:
    rows = []
    for scenario in SCENARIOS:
        good = [r for r in runs if r["scenario"] == scenario and "error" not in r]
        failed = [r["error"] for r in runs if r["scenario"] == scenario and "error" in r]
        if not good:
            rows.append({"scenario": scenario, "errors": failed})
            continue
        rows.append(
            {
                "scenario": scenario,
                "wall_s": statistics.median(r["wall_s"] for r in good),
                "walls": [r["wall_s"] for r in good],
                "gets": statistics.median(r["gets"] for r in good),
                "downloads": statistics.median(r["bytes"] for r in good) / size,
                "bytes": statistics.median(r["bytes"] for r in good),
                "node_ram_x": statistics.median(r["node_ram_bytes"] for r in good) / size,
                "errors": failed,
            }
        )
    rank = next((row for row in rows if row["scenario"] == "rank" and "wall_s" in row), None)
    for row in rows:
        if rank and "wall_s" in row:
            row["speedup_vs_rank"] = rank["wall_s"] / row["wall_s"]
    return rows


def _markdown(doc: dict) -> str:
    size_mib = doc["size_bytes"] / 2**20
    lines = [
        f"# Resume: one {size_mib:.0f} MiB checkpoint loaded by {WORLD} ranks ({NODES} nodes x {PER_NODE}), "
        f"SeaweedFS on 127.0.0.1\n\n",
        f"{doc['started']}, {doc['reps']} rep(s) per scenario, interleaved; {doc['machine']}. "
        "Wall: from the common start until the last rank holds the state (median; every run listed). "
        "Downloads: bytes the store served / checkpoint size. Node RAM: PSS the load added on a node's ranks / "
        "checkpoint size.\n\n",
        "| scenario | wall s (median) | runs s | x faster than rank | GETs | downloads | bytes served MiB "
        "| node RAM x ckpt |\n|---|---|---|---|---|---|---|---|\n",
    ]
    for row in doc["summary"]:
        if "wall_s" not in row:
            lines.append(f"| {row['scenario']} | FAILED: {row['errors'][0][:150]} | | | | | | |\n")
            continue
        lines.append(
            f"| {row['scenario']} | {row['wall_s']:.2f} | {'/'.join(f'{w:.2f}' for w in row['walls'])} "
            f"| {row.get('speedup_vs_rank', float('nan')):.2f} | {row['gets']:.0f} | {row['downloads']:.2f} "
            f"| {row['bytes'] / 2**20:.0f} | {row['node_ram_x']:.2f} |\n"
        )
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensor-mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; known: {SCENARIOS}")
    _repo_on_path()
    import torch

    from s3_checkpoint_io import S3CheckpointIO

    started = dt.datetime.now(dt.timezone.utc)
    # the store's data on disk (page cache): /dev/shm is what the shared loads use, and memory is what is measured
    with tempfile.TemporaryDirectory(prefix="resume-bench-") as data, _seaweedfs(data) as ep:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(ep.env())
        os.environ.update(ep.env())
        client = ep.client()
        client.create_bucket(Bucket=BUCKET)
        url = f"s3://{BUCKET}/run/step=1000-last.ckpt"
        count = args.size_mib // args.tensor_mib
        state = {
            "state_dict": {f"layers.{i}.weight": torch.rand(args.tensor_mib * 2**18) for i in range(count)},
            "global_step": 1000,
        }
        S3CheckpointIO().save_checkpoint(state, url)
        del state
        size = client.head_object(Bucket=BUCKET, Key="run/step=1000-last.ckpt")["ContentLength"]
        runs = []
        with tempfile.TemporaryDirectory(prefix="resume-bench-out-") as out:
            for rep in range(args.reps):
                for scenario in scenarios:
                    needed = PEAK_COPIES[scenario] * size + 2**30
                    if _available_bytes() < needed:  # the machine is shared: never push it into the OOM killer
                        run = {"scenario": scenario, "error": f"skipped: needs {needed / 2**30:.1f} GiB of memory"}
                    else:
                        run = _run_job(scenario, url, env, Path(out, f"{scenario}-{rep}"), 16, args.timeout)
                    run["rep"] = rep
                    runs.append(run)
                    shown = run.get("error") or (
                        f"{run['wall_s']:.2f} s, {run['gets']} GETs, {run['bytes'] / size:.2f} downloads, "
                        f"node RAM {run['node_ram_bytes'] / size:.2f}x"
                    )
                    print(f"rep {rep} {scenario}: {shown}", flush=True)
    fingerprints = {r["fingerprint"] for r in runs if "fingerprint" in r}
    if len(fingerprints) > 1:
        print("!!! scenarios loaded different states", file=sys.stderr)
        return 1
    with open("/proc/cpuinfo") as cpuinfo:
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    doc = {
        "started": started.strftime("%Y-%m-%d %H:%M UTC"),
        "size_bytes": size,
        "reps": args.reps,
        "machine": f"{os.cpu_count()} cores ({model}), torch {torch.__version__}",
        "layout": {"nodes": NODES, "ranks_per_node": PER_NODE, "chunk_mib": 16},
        "runs": runs,
        "summary": _summary(runs, size),
    }
    RESULTS.mkdir(exist_ok=True)
    stem = "resume-" + started.strftime("%Y%m%dT%H%M%SZ") + (f"-{args.tag}" if args.tag else "")
    (RESULTS / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    markdown = _markdown(doc)
    (RESULTS / f"{stem}.md").write_text(markdown)
    (RESULTS / "resume-latest.json").write_text(json.dumps(doc, indent=1))
    (RESULTS / "resume-latest.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
