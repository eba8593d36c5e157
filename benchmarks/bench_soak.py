#!/usr/bin/env python
"""Kill-and-relaunch soak, long: a deterministic two-rank job, SIGKILLed at random instants and
relaunched, many times, on moto behind a fault-injecting proxy. The harness and every check are
tests/helpers/soak.py (tests/test_soak.py runs it short in the suite).

    python benchmarks/bench_soak.py                           # 100 kills of single-file saves + 100 of DCP saves
    python benchmarks/bench_soak.py --kills 10 --tag quick    # a smoke run
    python benchmarks/bench_soak.py --modes single --kills 200
    python benchmarks/bench_soak.py --modes tier --kills 200 --node-loss-every 10 --logs DIR  # the memory tier

Each mode is one job: launches 0..K-1 are killed (or left as stragglers), launch K trains to the end, then
``s3-checkpoint-io gc`` aborts the uploads the kills left open. Reported per mode: kills (early ones: during the
resume), stragglers, resumes and fresh starts, fallbacks (resumes that skipped a newer checkpoint that did not verify
or load), steps lost per kill (the newest step any launch reached minus the resumed step), faults injected by kind,
uploads left open and aborted by gc, failures (each described), what stragglers changed, and for the memory tier
node losses and the tier each rank's load read (memory, a peer's replica, S3). Each launch's ranks start and import
while the launch before runs, and begin when it is killed ("seconds to resume" counts from there). Results:
``benchmarks/results/soak-<UTC>[-tag].json`` and a Markdown table on stdout (benchmarks/soak.md keeps the latest).
The store is moto: its wrong multipart checksums are the case where the checksum record carries a checkpoint's
integrity alone. ``--server seaweedfs`` runs it on SeaweedFS, which refuses expired requests (docs/fencing.md): there a
straggler's requests checked before a relaunch's takeover are refused by the store.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
for _path in (REPO, REPO / "tests" / "helpers"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from soak import SoakConfig, run_soak  # noqa: E402

from s3_local_servers import moto_server, seaweedfs_server  # noqa: E402


def table(reports: list[dict[str, Any]]) -> str:
    rows = [
        "| mode | kills (during resume) | stragglers | resumes (fresh starts) | fallbacks | steps lost per kill: "
        "mean / p50 / max | faults injected | uploads left open / aborted by gc / left after gc | failures | "
        "straggler overwrites / new keys (left after the next saves) / removals | node losses | rank loads from memory / replica / S3 | "
        "seconds to resume: mean / max | minutes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        lost = r["steps_lost"] or [0]
        faults = ", ".join(f"{k} {v}" for k, v in sorted(r["faults_by_kind"].items()))
        loads = r.get("resumed_from", {})
        tiers = " / ".join(str(loads.get(tier, 0)) for tier in ("memory", "replica", "s3"))
        waits = r.get("resume_seconds") or [0.0]
        rows.append(
            f"| {r['mode']} | {r['kills']} ({r['early_kills']}) | {r['stragglers']} | {r['resumes']} "
            f"({r['fresh_starts']}) | {r['fallbacks']} | {statistics.mean(lost):.1f} / {statistics.median(lost):g} / "
            f"{max(lost)} | {r['faults_injected']} ({faults}) | {r['uploads_left_open']} / "
            f"{r['uploads_aborted_by_gc']} / {r['uploads_after_gc']} | {len(r['failures'])} | "
            f"{len(r['straggler_changes'])} / {r.get('straggler_created', 0)} "
            f"({len(r.get('straggler_keys_left', []))} left) / {r.get('straggler_removals', 0)} | "
            f"{r.get('node_losses', 0)} | {tiers} | {statistics.mean(waits):.1f} / {max(waits):.1f} | "
            f"{r['seconds'] / 60:.1f} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="single,dcp")
    parser.add_argument("--kills", type=int, default=100, help="kills per mode")
    parser.add_argument("--mib", type=float, default=6.0, help="checkpoint size (>= 5: multipart uploads)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--straggler-probability", type=float, default=0.2)
    parser.add_argument("--early-kill-probability", type=float, default=0.2)
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--drain-every", type=int, default=3, help="tier mode: every Nth save in memory goes to S3")
    parser.add_argument("--node-loss-every", type=int, default=10, help="tier mode: every Nth kill loses a node")
    parser.add_argument("--tag", default="")
    parser.add_argument("--server", choices=("moto", "seaweedfs"), default="moto",
                        help="the store behind the fault proxy (SeaweedFS refuses expired requests: docs/fencing.md)")
    parser.add_argument("--logs", default=None, help="keep the launches' logs in this directory (default: removed)")
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    reports = []
    start_server = seaweedfs_server if args.server == "seaweedfs" else moto_server
    with start_server() as server, tempfile.TemporaryDirectory(prefix="soak-logs-") as temporary:
        logs = args.logs or temporary
        os.environ.update(server.env())
        client = server.client()
        for index, mode in enumerate(args.modes.split(",")):
            bucket = f"soak-{mode}-{stamp.lower()}"
            client.create_bucket(Bucket=bucket)
            config = SoakConfig(
                mode=mode,
                kills=args.kills,
                seed=args.seed + index,
                mib=args.mib,
                straggler_probability=args.straggler_probability,
                early_kill_probability=args.early_kill_probability,
                faults=not args.no_faults,
                drain_every=args.drain_every,
                node_loss_every=args.node_loss_every if mode == "tier" else 0,
            )
            report = run_soak(server.env(), server.endpoint_url, bucket, "job", config, Path(logs) / mode)
            reports.append(report.as_json())
            print(json.dumps(report.as_json()), flush=True)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"soak-{stamp}{'-' + args.tag if args.tag else ''}.json"
    environment = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()}
    out.write_text(json.dumps({"args": vars(args), "environment": environment, "reports": reports}, indent=1))
    print(table(reports))
    print(f"results: {out}")
    return 1 if any(r["failures"] for r in reports) else 0


if __name__ == "__main__":
    raise SystemExit(main())
