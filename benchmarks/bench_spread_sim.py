#!/usr/bin/env python
"""When prefix spreading pays, simulated: consecutive DCP saves of one run against the model of S3's partitions
(`s3_sim.py`), with S3's splits carried from one save to the next, for the default layout (every key under
``run/step-N/``) and for ``S3StorageWriter(prefix_spreading=16)``'s (shards under ``run/s3ckpt-spread-XX/step-N/``),
neither partitioned at the start.

    python benchmarks/bench_spread_sim.py                       # 2,048 ranks, 4 saves, splits after 300 s and 1 s
    python benchmarks/bench_spread_sim.py --ranks 4096 --saves 8 --split-after-s 300,2 --clients pacer

S3 splits a partition after sustained load, over minutes (its documentation gives no figure; the model's default is
300 s of SlowDown without a 5 s pause). The second figure is a what-if in which S3 splits within a save. Clients:
the package's pacer, and ``none`` (SlowDown retried as any error, as botocore's standard mode), whose SlowDowns go on
for the whole save where the pacer's stop within its first fraction of a second. A split lands at the median of the keys the partition served recently; the next save's keys show whether it still helps:
with the default layout they all sort after it (``run/step-1100/`` > ``run/step-1000/__1023_0.distcp``), with the
spread layout they fall into the same ranges. Between saves the partitions' token buckets refill (the saves are
minutes apart); only their boundaries carry over. Output: ``benchmarks/results/spread-sim-<UTC>[-tag].{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import s3_sim  # noqa: E402


def sequence(
    ranks: int, saves: int, layout: str, prefixes: int, split_after_s: float, mib: float, client: str
) -> list[dict[str, Any]]:
    """`saves` DCP saves, one after the other, each starting with the partitions the ones before it left."""
    lows: list[str] = []
    rows = []
    for n in range(saves):
        work = s3_sim.Workload(kind="dcp", direction="save", ranks=ranks, mib_per_rank=mib, layout=layout,
                               prefixes=prefixes, partitioned=False, step=1000 + 100 * n)
        result = s3_sim.run(work, s3_sim.ClientParams(pacer=client), s3_sim.S3Params(split_after_s=split_after_s),
                            partitions=lows)
        lows = result["partition_lows"]
        rows.append({
            "save": n + 1, "ranks": ranks, "client": client, "layout": layout if layout == "one-prefix" else f"spread/{prefixes}",
            "split_after_s": split_after_s, "failed": result["failed"], "elapsed_s": result["elapsed_s"],
            "slowdown_per_admitted": result["slowdown_per_admitted"], "partitions_used": result["partitions_used"],
            "partitions": len(lows), "splits": result["splits"],
        })
    return rows


def markdown(rows: list[dict[str, Any]], saves: int) -> str:
    shown = sorted({1, 2, 3, saves // 2, saves} - {0})
    lines = [
        "| ranks | client | splits after | layout | " + " | ".join(f"save {n}" for n in shown) + " | partitions after |",
        "|---:|---|---:|---|" + "---:|" * len(shown) + "---:|",
    ]
    groups: dict[tuple[int, str, float, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["ranks"], row["client"], row["split_after_s"], row["layout"]), []).append(row)
    for (ranks, client, split, layout), group in groups.items():
        cells = [f"{group[n - 1]['elapsed_s']:.1f} s ({group[n - 1]['slowdown_per_admitted']:.2f})" for n in shown]
        lines.append(f"| {ranks:,} | {client} | {split:g} s | {layout} | " + " | ".join(cells)
                     + f" | {group[-1]['partitions']} |")
    splits = sum(row["splits"] for row in rows)
    return "\n".join(lines) + (
        f"\n\nEach cell: the save's time (SlowDown answers per admitted request). No save failed; {splits} splits.\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2048")
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--mib", type=float, default=64.0, help="each rank's file, MiB")
    parser.add_argument("--split-after-s", default="300,1", help="S3's sustained SlowDown before a split, s")
    parser.add_argument("--clients", default="pacer,none", help="the package's pacer, or none")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    started = time.monotonic()
    rows = []
    for ranks in (int(n) for n in args.ranks.split(",")):
        for client, split in ((c, float(s)) for c in args.clients.split(",") for s in args.split_after_s.split(",")):
            for layout in ("one-prefix", "spread"):
                rows += sequence(ranks, args.saves, layout, args.prefixes, split, args.mib, client)
                last = rows[-1]
                print(f"x{ranks} {client} split {split:g} s {last['layout']}: save 1 {rows[-args.saves]['elapsed_s']:.1f} s, "
                      f"save {args.saves} {last['elapsed_s']:.1f} s, {last['partitions']} partitions", flush=True)
    assert all(row["failed"] == 0 for row in rows), [row for row in rows if row["failed"]]
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = HERE / "results" / f"spread-sim-{stamp}{'-' + args.tag if args.tag else ''}"
    out.with_name(out.name + ".json").write_text(json.dumps({"stamp": stamp, "args": vars(args), "rows": rows}, indent=1))
    out.with_name(out.name + ".md").write_text(markdown(rows, args.saves))
    print(markdown(rows, args.saves))
    print(f"wrote {out}.json, .md in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
