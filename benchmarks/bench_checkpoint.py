#!/usr/bin/env python
"""Checkpoint save/load benchmark against a local SeaweedFS (``weed mini``) — see benchmarks/README.md.

    python benchmarks/bench_checkpoint.py --sizes 256,1024 --reps 3

Starts SeaweedFS itself (data dir on /dev/shm, holding the exclusive lock /tmp/s3ckpt-weed.lock for as long as
it runs), then runs every measurement in a fresh ``bench_worker.py`` process and writes
``benchmarks/results/<timestamp>.json`` / ``.md`` / ``.png`` (the chart; needs the ``bench`` extra) plus
``latest.json`` / ``latest.md`` / ``latest.png``. ``--render FILE.json`` redraws the table and chart of a result.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
BUCKET = "bench"
PEERS_PY = HERE / ".venv-peers" / "bin" / "python"
MAIN_PY = Path(sys.executable)

# (scenario label, worker method, params, interpreter kind, direction)
#   direction: "save" | "load" | "copy"
# Groups run in this order; each group's loads read the object its save wrote; objects are deleted after a group.
GROUPS: dict[str, list[tuple[str, str, dict[str, Any], str, str]]] = {
    "host-copy": [("host copy (tensor.clone of all)", "host-copy", {}, "main", "copy")],
    "raw-put": [
        ("raw: boto3 put_object (single PUT)", "raw-put-boto3", {}, "main", "save"),
        ("raw: boto3 get_object (single GET)", "raw-get-boto3", {}, "main", "load"),
        ("raw: curl GET (single, to /dev/null)", "raw-get-curl", {}, "main", "load"),
    ],
    "raw-ranged": [
        ("raw: boto3 put_object (single PUT)", "raw-put-boto3", {}, "main", "save"),
        ("raw: ranged GETs 16MiBx15 (S3Utils.read_ranges_into)", "raw-ranged-get", {}, "main", "load"),
    ],
    "raw-curl": [("raw: curl PUT (single)", "raw-put-curl", {}, "main", "save")],
    "raw-mpu": [
        ("raw: s3transfer multipart upload 64MBx10", "raw-mpu-put", {}, "main", "save"),
        ("raw: s3transfer multipart download 64MBx15", "raw-mpu-get", {}, "main", "load"),
    ],
    "ours": [
        ("ours: sync save", "ours-save", {}, "main", "save"),
        ("ours: load", "ours-load", {}, "main", "load"),
    ],
    "ours-async": [("ours: async save", "ours-async-save", {}, "main", "save")],
    "nemo": [
        ("NeMo: torch.save->BytesIO->upload_fileobj", "nemo-save", {}, "main", "save"),
        ("NeMo: download_fileobj->BytesIO->torch.load", "nemo-load", {}, "main", "load"),
    ],
    "lightning": [
        ("Lightning TorchCheckpointIO (s3fs) save", "lightning-save", {}, "main", "save"),
        ("Lightning TorchCheckpointIO (s3fs) load", "lightning-load", {}, "main", "load"),
    ],
    "s3tc": [
        ("s3torchconnector: torch.save->S3Writer (8MiB parts)", "s3tc-save", {"part": 8}, "peers", "save"),
        ("s3torchconnector: torch.load(sequential reader)", "s3tc-load", {"part": 8}, "peers", "load"),
        ("s3torchconnector: torch.load(range_based reader)", "s3tc-load-ranged", {"part": 8}, "peers", "load"),
    ],
}
DEFAULT_GROUPS = ["host-copy", "raw-put", "raw-curl", "raw-mpu", "ours", "ours-async", "nemo", "lightning", "s3tc"]
PEER_PREFIXES = ("NeMo", "Lightning", "s3torchconnector")


def knob_groups(spec: str) -> dict[str, list[tuple[str, str, dict[str, Any], str, str]]]:
    """``--knobs "chunk=16,wc=10,rc=15;chunk=8"`` -> extra groups for this package."""
    groups = {}
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        params = {k: int(v) for k, v in (kv.split("=") for kv in item.split(","))}
        tag = ",".join(f"{k}={v}" for k, v in params.items())
        groups[f"ours@{tag}"] = [
            (f"ours: sync save @{tag}", "ours-save", params, "main", "save"),
            (f"ours: load @{tag}", "ours-load", params, "main", "load"),
        ]
    return groups


def reference_groups(spec: str) -> dict[str, list[tuple[str, str, dict[str, Any], str, str]]]:
    """``--reference "borrowed_parts;all"`` -> this package's save, async save and load with those fast paths
    on their reference paths (s3_utils.REFERENCE_PATHS_ENV), beside the default "ours" groups."""
    groups = {}
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        params = {"reference": item}
        groups[f"ours@ref={item}"] = [
            (f"ours: sync save @ref={item}", "ours-save", params, "main", "save"),
            (f"ours: load @ref={item}", "ours-load", params, "main", "load"),
        ]
        groups[f"ours-async@ref={item}"] = [(f"ours: async save @ref={item}", "ours-async-save", params, "main", "save")]
    return groups


def _repo_on_path() -> None:
    """Make the package's modules importable when it is not installed (``pip install -e .`` makes this a no-op)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def _local_servers() -> Any:
    """`s3_local_servers`, which starts weed (the same command line, lock and stop rule as the demo and tests)."""
    _repo_on_path()
    import s3_local_servers

    return s3_local_servers


def _package_default_chunk_mib() -> float:
    """The part size the "ours" rows ran with (the package default), for the memory target."""
    _repo_on_path()
    import s3_utils

    return s3_utils.DEFAULT_CHUNK_SIZE_MB


@contextlib.contextmanager
def benchmark_seaweedfs(data_root: str) -> Iterator[tuple[Any, int]]:
    """SeaweedFS for a benchmark run (`s3_local_servers.seaweedfs_server`, which waits its turn for the machine-wide
    lock), and weed's PID, whose CPU time the workers measure; `data_root` is removed afterwards."""
    servers = _local_servers()
    print("starting SeaweedFS in", data_root, "(after any other SeaweedFS user releases the lock)", flush=True)
    try:
        with servers.seaweedfs_server(data_root, lock="wait") as endpoint:
            yield endpoint, servers.weed_process(endpoint).proc.pid
    finally:
        shutil.rmtree(data_root, ignore_errors=True)


def _empty_bucket(client: Any) -> None:
    while True:
        page = client.list_objects_v2(Bucket=BUCKET)
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})
        if not page.get("IsTruncated"):
            break
    for up in client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []):
        with contextlib.suppress(Exception):
            client.abort_multipart_upload(Bucket=BUCKET, Key=up["Key"], UploadId=up["UploadId"])


def _vacuum() -> None:
    """Ask the master to compact volumes so deleted objects free tmpfs space."""
    with contextlib.suppress(Exception):
        urllib.request.urlopen("http://127.0.0.1:9333/vol/vacuum?garbageThreshold=0.0001", timeout=120).read()


def _run_worker(kind: str, spec: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    python = str(PEERS_PY if kind == "peers" else MAIN_PY)
    proc = subprocess.run(
        [python, str(HERE / "bench_worker.py"), json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(HERE),
    )
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            return json.loads(line[len("BENCH_RESULT ") :])
    tail = (proc.stderr or proc.stdout)[-3000:]
    if "VERIFY FAILED" in (proc.stderr + proc.stdout):
        raise SystemExit(f"!!! {spec['method']}: loaded tensors are NOT bit-identical\n{tail}")
    return {"error": f"exit {proc.returncode}: {tail.strip().splitlines()[-1] if tail.strip() else ''}", "stderr": tail}


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ["torch", "boto3", "botocore", "s3transfer", "awscrt", "s3fs", "fsspec", "lightning", "psutil"]:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "-"
    if PEERS_PY.exists():
        code = (
            "from importlib.metadata import version as v;"
            "print(v('s3torchconnector'), v('s3torchconnectorclient'), v('torch'))"
        )
        r = subprocess.run([str(PEERS_PY), "-c", code], capture_output=True, text=True)
        out["s3torchconnector (peers venv)"] = r.stdout.strip() or f"unavailable: {r.stderr.strip()[-200:]}"
    weed = shutil.which("weed") or str(MAIN_PY.parent / "weed")
    r = subprocess.run([weed, "version"], capture_output=True, text=True)
    out["weed"] = r.stdout.strip().splitlines()[0] if r.stdout.strip() else "?"
    out["python"] = platform.python_version()
    return out


def _machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "ram_gib": round(mem_kb / 1024**2, 1),
        "kernel": platform.release(),
    }


# ---------------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------------


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for r in runs:
        row = rows.setdefault(
            (r["scenario"], r["size_mib"]),
            {
                "scenario": r["scenario"],
                "size_mib": r["size_mib"],
                "direction": r["direction"],
                "runs": [],
                "errors": [],
            },
        )
        if "error" in r:
            row["errors"].append(r["error"])
        else:
            row["runs"].append(r)
    out = []
    for row in rows.values():
        rs = row["runs"]
        if rs:
            walls = [r["wall_s"] for r in rs]
            row["wall_s"] = _median(walls)
            row["walls"] = walls
            row["mib_s"] = row["size_mib"] / row["wall_s"]
            for k in (
                "client_cpu_s",
                "server_cpu_s",
                "peak_extra_mib",
                "hwm_extra_mib",
                "footprint_extra_mib",
                "other_cpu_s",
            ):
                row[k] = _median([r[k] for r in rs])
            if any("blocked_s" in r for r in rs) and row["scenario"].startswith("ours: async"):
                row["blocked_s"] = _median([r["blocked_s"] for r in rs])
                row["blocked_runs"] = [r["blocked_s"] for r in rs]
        out.append(row)
    # ratios per size
    for size in {r["size_mib"] for r in out}:
        sized = [r for r in out if r["size_mib"] == size and "mib_s" in r]
        ceil_save = max(
            (r["mib_s"] for r in sized if r["scenario"].startswith("raw: ") and "PUT" in r["scenario"]), default=None
        )
        ceil_load = max(
            (r["mib_s"] for r in sized if r["scenario"].startswith("raw: ") and "GET" in r["scenario"]), default=None
        )
        peer_save = max(
            (r["mib_s"] for r in sized if r["scenario"].startswith(PEER_PREFIXES) and r["direction"] == "save"),
            default=None,
        )
        peer_load = max(
            (r["mib_s"] for r in sized if r["scenario"].startswith(PEER_PREFIXES) and r["direction"] == "load"),
            default=None,
        )
        for r in sized:
            ceil, peer = (ceil_save, peer_save) if r["direction"] == "save" else (ceil_load, peer_load)
            if r["direction"] == "copy":
                continue
            r["ratio_ceiling"] = r["mib_s"] / ceil if ceil else None
            r["ratio_best_peer"] = r["mib_s"] / peer if peer else None
    return sorted(out, key=lambda r: (r["size_mib"], ORDER.get(r["scenario"], 99), r["scenario"]))


ORDER: dict[str, int] = {}


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None or (isinstance(x, float) and x != x) else fmt.format(x)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| scenario | size MiB | wall s (median) | runs s | MiB/s | client CPU s | server CPU s | peak extra RSS MiB "
        "| x raw ceiling | x best peer | async blocked s | other CPU s |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if "wall_s" not in r:
            lines.append(f"| {r['scenario']} | {r['size_mib']} | FAILED: {r['errors'][0][:120]} | | | | | | | | | |")
            continue
        blocked = _f(r.get("blocked_s"), "{:.3f}")
        if "blocked_runs" in r:
            blocked += " (" + "/".join(f"{b:.3f}" for b in r["blocked_runs"]) + ")"
        lines.append(
            f"| {r['scenario']} | {r['size_mib']} | {r['wall_s']:.2f} | {'/'.join(f'{w:.2f}' for w in r['walls'])} "
            f"| {r['mib_s']:.0f} | {r['client_cpu_s']:.2f} | {r['server_cpu_s']:.2f} | {r['peak_extra_mib']:.0f} "
            f"| {_f(r.get('ratio_ceiling'))} | {_f(r.get('ratio_best_peer'))} | {blocked} | {_f(r.get('other_cpu_s'), '{:.1f}')} |"
        )
    return head + "\n".join(lines) + "\n"


def targets(rows: list[dict[str, Any]], chunk_mib: int = 64, wc: int = 10) -> str:
    """Evaluate the lead's targets at each size (the 1 GiB one is the one that matters)."""
    out = []
    for size in sorted({r["size_mib"] for r in rows}):
        by = {r["scenario"]: r for r in rows if r["size_mib"] == size and "mib_s" in r}

        def v(name: str, key: str = "mib_s", by: dict[str, Any] = by) -> float | None:
            return by.get(name, {}).get(key)

        def versus(ours: str, *others: str, by: dict[str, Any] = by) -> tuple[float | None, float | None]:
            """Throughput of `ours` against the fastest of `others`: the ratio of the medians, and the ratio within
            each rep (vs that rep's fastest), median over reps. Scenarios of one rep run minutes apart, so the
            second cancels the machine's drift across a run."""
            theirs = [name for name in others if name in by]
            if ours not in by or not theirs:
                return None, None
            measured = by[ours]["mib_s"] / max(by[name]["mib_s"] for name in theirs)
            walls = [{r["rep"]: r["wall_s"] for r in by[name]["runs"]} for name in (ours, *theirs)]
            reps = set(walls[0]).intersection(*walls[1:])
            per_rep = _median([min(w[rep] for w in walls[1:]) / walls[0][rep] for rep in reps]) if reps else None
            return measured, per_rep

        ckpt_bytes = size
        checks = []

        def ratio(a: float | None, b: float | None) -> float | None:
            return a / b if a and b else None

        def add(
            name: str,
            value: float | None,
            target: float,
            higher_better: bool = True,
            unit: str = "x",
            checks: list[str] = checks,
            per_rep: float | None = None,
        ) -> None:
            if value is None:
                checks.append(f"| {name} | - | - | {target}{unit} | n/a |")
                return
            ok = value >= target if higher_better else value <= target
            checks.append(
                f"| {name} | {value:.2f}{unit} | {_f(per_rep)}{unit if per_rep else ''} "
                f"| {'>=' if higher_better else '<='} {target:.2f}{unit} | {'MET' if ok else 'MISSED'} |"
            )

        def add_versus(name: str, target: float, ours: str, *others: str) -> None:
            measured, per_rep = versus(ours, *others)
            add(name, measured, target, per_rep=per_rep)

        ours_save, ours_load = "ours: sync save", "ours: load"
        add_versus(
            "save vs raw single-stream PUT (best of boto3/curl)",
            0.85,
            ours_save,
            "raw: boto3 put_object (single PUT)",
            "raw: curl PUT (single)",
        )
        add_versus("save vs NeMo save", 1.4, ours_save, "NeMo: torch.save->BytesIO->upload_fileobj")
        add_versus(
            "save vs s3torchconnector streaming save",
            1.0,
            ours_save,
            "s3torchconnector: torch.save->S3Writer (8MiB parts)",
        )
        add("save peak extra RSS MiB", v(ours_save, "peak_extra_mib"), (wc + 1) * chunk_mib + 64, False, " MiB")
        add_versus("load vs NeMo load", 2.0, ours_load, "NeMo: download_fileobj->BytesIO->torch.load")
        add_versus(
            "load vs raw single GET (best of boto3/curl)",
            0.7,
            ours_load,
            "raw: boto3 get_object (single GET)",
            "raw: curl GET (single, to /dev/null)",
        )
        add("load peak extra RSS / checkpoint size", ratio(v(ours_load, "peak_extra_mib"), ckpt_bytes), 1.15, False)
        add(
            "async blocked / host copy",
            ratio(v("ours: async save", "blocked_s"), v("host copy (tensor.clone of all)", "wall_s")),
            1.2,
            False,
        )
        gib = size / 1024
        peers_save = [r for r in by.values() if r["scenario"].startswith(PEER_PREFIXES) and r["direction"] == "save"]
        peers_load = [r for r in by.values() if r["scenario"].startswith(PEER_PREFIXES) and r["direction"] == "load"]
        for direction, ours_name, peers in (
            ("save", ours_save, peers_save),
            ("load", ours_load, peers_load),
        ):
            best = min(peers, key=lambda r: r["client_cpu_s"], default=None)
            ours_cpu = v(ours_name, "client_cpu_s")
            if best is None or ours_cpu is None:
                continue
            add(
                f"{direction} client CPU s/GiB (best peer: {best['scenario']} {best['client_cpu_s'] / gib:.2f})",
                ours_cpu / gib,
                best["client_cpu_s"] / gib,
                False,
                " s",
            )
        out.append(
            f"\n### Targets at {size} MiB\n\n`measured` compares the medians above; `per rep` is the same ratio "
            "within each rep, median over reps (robust to the machine drifting during the run). Verdicts use "
            "`measured`.\n\n| target | measured | per rep | target | verdict |\n|---|---|---|---|---|\n"
            + "\n".join(checks)
            + "\n"
        )
    return "".join(out)


def render(doc: dict[str, Any]) -> str:
    m, v = doc["machine"], doc["versions"]
    rows = doc["summary"]
    md = [
        f"# Checkpoint benchmark {doc['timestamp']}\n",
        f"Machine: {m['nproc']} CPU ({m['cpu_model']}), {m['ram_gib']} GiB RAM, kernel {m['kernel']}. ",
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".\n",
        f"Command: `{doc['command']}`; reps={doc['reps']}, tensors of {doc['tensor_mib']} MiB float32. "
        "Server: SeaweedFS weed mini on 127.0.0.1, data on /dev/shm.\n",
        "MiB/s = state-dict MiB / wall (median). Ratios are throughput ratios at the same size in this run: "
        "`x raw ceiling` = vs the fastest raw single PUT (saves) or single GET (loads); `x best peer` = vs the fastest "
        "of NeMo / Lightning / s3torchconnector in the same direction. Peak extra RSS = max(VmHWM - RSS before, "
        "sampled RssAnon+RssFile+memfd pages - before). `other CPU s` = machine-wide busy CPU during the operation "
        "minus client and server CPU: other processes on the machine (noise; should be ~0).\n\n",
        markdown_table(rows),
        targets(rows, doc.get("ours_chunk_mib", 64), doc.get("ours_wc", 10)),
    ]
    return "".join(md)


# ---------------------------------------------------------------------------------------------------------------
# chart
# ---------------------------------------------------------------------------------------------------------------

CHART_METRICS = (("mib_s", "MiB/s (higher is better)"), ("peak_extra_mib", "peak extra RSS, MiB (lower is better)"))


def chart(doc: dict[str, Any], path: Path) -> bool:
    """Write a PNG beside the table: per size, save and load rows; MiB/s and peak extra RSS of every client side by
    side, all from this one run (medians over its reps). False (with a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('NOTE: no chart: matplotlib is missing (pip install ".[bench]")', flush=True)
        return False
    rows = [r for r in doc["summary"] if r["direction"] in ("save", "load") and "mib_s" in r]
    panels = [(size, d) for size in sorted({r["size_mib"] for r in rows}) for d in ("save", "load")]
    panels = [(size, d) for size, d in panels if any(r["size_mib"] == size and r["direction"] == d for r in rows)]
    heights = [len([r for r in rows if r["size_mib"] == size and r["direction"] == d]) for size, d in panels]
    fig, axes = plt.subplots(
        len(panels),
        len(CHART_METRICS),
        figsize=(12, 1.2 + 0.32 * sum(heights) + 0.6 * len(panels)),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for (size, direction), line in zip(panels, axes, strict=True):
        chosen = sorted(
            (r for r in rows if r["size_mib"] == size and r["direction"] == direction),
            key=lambda r: ORDER.get(r["scenario"], 999),
        )
        labels = [r["scenario"] for r in chosen]
        colours = [
            "tab:orange"
            if r["scenario"].startswith("ours")
            else ("tab:gray" if r["scenario"].startswith("raw") else "tab:blue")
            for r in chosen
        ]
        for col, (ax, (metric, title)) in enumerate(zip(line, CHART_METRICS, strict=True)):
            values = [r[metric] for r in chosen]
            ax.barh(range(len(chosen)), values, color=colours)
            ax.set_yticks(range(len(chosen)), labels if col == 0 else [""] * len(chosen), fontsize=8)
            ax.invert_yaxis()
            ax.set_title(f"{size} MiB {direction}: {title}", fontsize=9, loc="left")
            ax.tick_params(axis="x", labelsize=8)
            for i, value in enumerate(values):
                ax.text(value, i, f" {value:.0f}", va="center", fontsize=7)
            ax.set_xlim(0, max(values) * 1.15 if values else 1)
    machine = doc.get("machine", {})
    fig.suptitle(
        f"s3-checkpoint-io benchmark {doc['timestamp']} (SeaweedFS on 127.0.0.1, median of {doc.get('reps')} reps; "
        f"{machine.get('nproc', '?')} CPUs). Orange: this package; grey: raw transfers; blue: other clients",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256,1024", help="state-dict sizes in MiB, comma separated")
    ap.add_argument("--size", type=int, help="a single size in MiB (overrides --sizes), e.g. 4096")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tensor-mib", type=int, default=64)
    ap.add_argument("--groups", default=",".join(DEFAULT_GROUPS), help=f"subset of {list(GROUPS)}")
    ap.add_argument(
        "--knobs", default="", help='extra configs of this package, e.g. "chunk=16;chunk=32,wc=4;chunk=64,rc=8"'
    )
    ap.add_argument(
        "--reference", default="", help='fast paths on their reference path, per extra config: "borrowed_parts;all"'
    )
    ap.add_argument(
        "--state",
        default="equal",
        choices=("equal", "realistic"),
        help="equal float32 tensors of --tensor-mib, or a GPT-style Lightning checkpoint (realistic_state.py)",
    )
    ap.add_argument("--d", type=int, default=768, help="model width of the realistic state")
    ap.add_argument("--layers", type=int, default=8, help="layers of the realistic state")
    ap.add_argument("--data-dir", default=None, help="SeaweedFS data dir (default: a fresh dir on /dev/shm)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--tag", default="", help="suffix for the result file name")
    ap.add_argument("--no-latest", action="store_true", help="do not overwrite results/latest.*")
    ap.add_argument("--render", metavar="JSON", help="only re-render (summary + markdown) an existing result file")
    args = ap.parse_args(argv)
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        groups = {name: GROUPS[name] for name in DEFAULT_GROUPS}
        for i, g in enumerate(groups.values()):
            for j, item in enumerate(g):
                ORDER.setdefault(item[0], i * 10 + j)
        doc["summary"] = summarise(doc["runs"])
        doc["markdown"] = render(doc)
        Path(args.render).write_text(json.dumps(doc, indent=1, default=str))
        Path(args.render).with_suffix(".md").write_text(doc["markdown"])
        if chart(doc, Path(args.render).with_suffix(".png")):
            print(f"wrote {Path(args.render).with_suffix('.png')}")
        print(doc["markdown"])
        return 0

    sizes = [args.size] if args.size else [int(s) for s in args.sizes.split(",") if s]
    groups = {name: GROUPS[name] for name in args.groups.split(",") if name}
    groups.update(knob_groups(args.knobs))
    groups.update(reference_groups(args.reference))
    if args.state == "realistic":
        sys.path.insert(0, str(HERE))
        import realistic_state

        sizes = [round(realistic_state.size_mib(args.d, args.layers))]
    for i, g in enumerate(groups.values()):
        for j, item in enumerate(g):
            ORDER.setdefault(item[0], i * 10 + j)
    if any(item[3] == "peers" for g in groups.values() for item in g) and not PEERS_PY.exists():
        print(f"NOTE: {PEERS_PY} missing: s3torchconnector scenarios are skipped (see README)", flush=True)
        groups = {k: g for k, g in groups.items() if all(item[3] != "peers" for item in g)}

    shm_free = shutil.disk_usage("/dev/shm").free / 1024**3
    need = max(sizes) / 1024 * 4 + 2
    data_root = args.data_dir or (
        tempfile.mkdtemp(prefix="s3ckpt-bench-", dir="/dev/shm")
        if shm_free > need
        else tempfile.mkdtemp(prefix="s3ckpt-bench-")
    )
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    runs: list[dict[str, Any]] = []
    RESULTS.mkdir(exist_ok=True)

    with benchmark_seaweedfs(data_root) as (ep, weed_pid):
        client = ep.client()
        client.create_bucket(Bucket=BUCKET)
        client.put_object(Bucket=BUCKET, Key="warmup", Body=os.urandom(8 * 1024**2))  # grow the first volumes
        _empty_bucket(client)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(ep.env())
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        for size in sizes:
            for rep in range(args.reps):
                for gname, items in groups.items():
                    key = f"ckpt/{gname.replace('@', '_').replace('=', '').replace(',', '_')}-{size}.ckpt"
                    for label, method, params, kind, direction in items:
                        spec = {
                            "method": method,
                            "size_mib": size,
                            "tensor_mib": args.tensor_mib,
                            "bucket": BUCKET,
                            "key": key,
                            "params": params,
                            "weed_pid": weed_pid,
                            "repo": str(REPO),
                            "state": args.state,
                            "d": args.d,
                            "layers": args.layers,
                        }
                        res = _run_worker(kind, spec, env, args.timeout)
                        res.update(
                            scenario=label,
                            size_mib=size,
                            rep=rep,
                            direction=direction,
                            method=method,
                            params=params,
                        )
                        runs.append(res)
                        if "error" in res:
                            print(f"[{size} MiB rep {rep}] {label}: ERROR {res['error']}", flush=True)
                        else:
                            extra = f" blocked {res['blocked_s']:.3f}s" if "blocked_s" in res else ""
                            print(
                                f"[{size} MiB rep {rep}] {label}: {res['wall_s']:.2f}s {size / res['wall_s']:.0f} MiB/s "
                                f"cpu {res['client_cpu_s']:.1f}/{res['server_cpu_s']:.1f} peak+{res['peak_extra_mib']:.0f} MiB other-cpu {res['other_cpu_s']:.1f}{extra}",
                                flush=True,
                            )
                        time.sleep(0.5)
                    _empty_bucket(client)
                    _vacuum()

    doc = {
        "timestamp": stamp,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": _machine(),
        "versions": _versions(),
        "reps": args.reps,
        "ours_chunk_mib": _package_default_chunk_mib(),
        "tensor_mib": args.tensor_mib,
        "state": args.state if args.state == "equal" else f"realistic d={args.d} layers={args.layers}",
        "sizes": sizes,
        "runs": runs,
    }
    doc["summary"] = summarise(runs)
    md = render(doc)
    doc["markdown"] = md
    name = f"{stamp}{'-' + args.tag if args.tag else ''}"
    (RESULTS / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str))
    (RESULTS / f"{name}.md").write_text(md)
    charted = chart(doc, RESULTS / f"{name}.png")
    if not args.no_latest:
        (RESULTS / "latest.json").write_text(json.dumps(doc, indent=1, default=str))
        (RESULTS / "latest.md").write_text(md)
        if charted:
            shutil.copyfile(RESULTS / f"{name}.png", RESULTS / "latest.png")
    print(md)
    print(f"wrote {RESULTS / (name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
