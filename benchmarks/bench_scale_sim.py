#!/usr/bin/env python
"""S3 at 2,048-16,384 ranks, simulated: saves and resumes against a model of S3's partitions, driving this package's
own request pacer, job budget, retry policy and load-sharing decision in simulated time (the model: `s3_sim.py`).

    python benchmarks/bench_scale_sim.py                     # the sweep and the emulation check (a few minutes)
    python benchmarks/bench_scale_sim.py --ranks 2048 --tag quick
    python benchmarks/bench_scale_sim.py --check-only        # only the comparison with bench_throttle's measurements
    python benchmarks/bench_scale_sim.py --only spread --only "dcp 16384 one-prefix pacer" --tag lanes  # some rows
    python benchmarks/bench_scale_sim.py --ranks 16384 --draws 4 --tag draws   # each row under 4 latency draws

Scenarios (every rank starts at once):

* saves, single-file (each rank one file, as NeMo's model-parallel ranks write) and DCP (``__{rank}_0.distcp``, then
  the coordinator's checksum record and ``.metadata``), each rank `--mib` MiB in 16 MiB parts, with the default layout
  (every key under ``run/step-N/``: one partition) and spread over `--prefixes` prefixes (the shards in
  ``run/s3ckpt-spread-XX/step-N/``, `s3_prefix_spreading`'s layout; assumed already partitioned by S3);
  clients: the package's default (its pacer, shared by a host's ranks), with a job budget
  (``max_requests_per_second`` a little under S3's rates) and, at the smallest rank count, without pacing
  (SlowDown retried like any other error: counted attempts, exponential backoff, as botocore's standard mode);
  at the largest rank count also the oracle (`s3_sim`'s ``pacer="oracle"``: a job-wide queue per partition that
  sends the moment the partition holds a token, no SlowDown, no token unused while a request waits): not a client
  anyone can run, the least time any client takes in this model, latencies and phases included; with
  `--spread-mib`, the largest job's spread DCP save again with bigger files (pacer and budget);
* resumes: a single-file checkpoint of `--resume-gib` GiB that every rank loads (``load_sharing`` ``"node"`` and
  ``"job"``; ``"rank"`` is counted, not simulated), and a DCP load (every rank reads ``.metadata`` and its own file).

Measured per run: failed operations, time against the bound (the larger of the partition-capacity bound: the hottest
partition's requests beyond its burst at its rate, and the bandwidth bound: the same run with no request limit),
SlowDown answers per admitted request, goodput (of the partition that bounds the run: its admitted requests beyond
its burst / its rate / the seconds from the first request to the last admitted one, as bench_throttle's; only where
the partitions bound the time beyond their burst), requests per rank. With `--draws N`, every row again under N - 1
other draws of the requests' latencies (`s3_sim.S3Params.latency_draw`; the main table is draw 0's, as without it) and a
table of each row's range over them: where a row sits within the model's chaos. Output: ``benchmarks/results/scale-sim-<UTC>[-tag].{json,md,png}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

import s3_sim  # noqa: E402

EMULATION_RESULT = RESULTS / "throttle-20261202T153110Z-side-by-side.json"
"""bench_throttle's measured run the simulation is checked against (its ``ours`` rows: the default client)."""

TOLERANCE = {"p99_ratio": 0.2, "goodput": 0.1, "slowdown_per_admitted": 0.3}
"""How close the simulation of bench_throttle's setup must come to its measurements: p99 operation time within 20 %,
goodput within 0.1, SlowDown per admitted request within 0.3 (the measured rows differ by that much between runs)."""

TARGETS = {"slowdown_per_admitted": 0.5, "goodput": 0.9, "time_over_bound": 1.3}


# --------------------------------------------------------------------------------------------------------------------
# The check against bench_throttle's emulation (moto behind a token-bucket proxy, one machine)
# --------------------------------------------------------------------------------------------------------------------


def emulation_params(writers: int) -> s3_sim.S3Params:
    """bench_throttle's store: 0.25 writes/s and 0.5 reads/s per writer, one second of burst, no splits; a local moto
    (about 50 ms a request, a few hundred MB/s)."""
    return s3_sim.S3Params(
        write_rate=0.25 * writers, read_rate=0.5 * writers, burst_s=1.0, split_after_s=math.inf, latency_s=0.05,
        slowdown_latency_s=0.01, conn_bytes_per_s=200e6, host_bytes_per_s=400e6,
    )


def emulation_work(writers: int, direction: str) -> s3_sim.Workload:
    """20 MiB (plus the pickle's header) in 5 MiB parts: 5 parts; moto keeps no full-object checksums, so a save also
    writes a checksum record and a load reads it (bench_throttle's 8 writes and 7 reads per operation)."""
    return s3_sim.Workload(
        kind="single", direction=direction, ranks=writers, mib_per_rank=20.01, part_mib=5, load_sharing="rank",
        extra_writes_per_file=1, extra_reads_per_download=1,
    )


def emulation_check(path: Path = EMULATION_RESULT) -> list[dict[str, Any]]:
    """Each measured ``ours`` row beside the simulation of the same setup, and whether they agree (`TOLERANCE`)."""
    measured = json.loads(path.read_text())
    rows = []
    for run in measured["runs"]:
        if run["client"] != "ours":
            continue
        writers, per_host = run["writers"], run["per_host"] or run["writers"]
        sim = s3_sim.run(
            emulation_work(writers, run["direction"]), s3_sim.ClientParams(ranks_per_host=per_host),
            emulation_params(writers),
        )
        agree = {
            "p99_ratio": abs(sim["p99_s"] / run["p99_s"] - 1.0),
            "goodput": abs(sim["goodput"] - run["goodput"]),
            "slowdown_per_admitted": abs(sim["slowdown_per_admitted"] - run["slowdown_per_admitted"]),
        }
        rows.append({
            "direction": run["direction"], "writers": writers, "per_host": per_host, "label": run["label"],
            "measured": {k: run[k] for k in ("failed", "slowdown_per_admitted", "goodput", "p50_s", "p99_s",
                                             "requests_per_op")},
            "simulated": {k: sim[k] for k in ("failed", "slowdown_per_admitted", "goodput", "p50_s", "p99_s")}
            | {"requests_per_op": sim["requests_per_rank"]},
            "differences": agree,
            "agree": sim["failed"] == run["failed"] and all(agree[k] <= TOLERANCE[k] for k in TOLERANCE),
        })
    return rows


# --------------------------------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------------------------------


def scenarios(ranks_list: list[int], args: argparse.Namespace) -> list[tuple[str, s3_sim.Workload, s3_sim.ClientParams]]:
    budget = s3_sim.ClientParams(pacer="budget", budget=(args.budget_write, args.budget_read))  # per prefix
    out = []
    for ranks in ranks_list:
        for kind in ("single", "dcp"):
            for layout, prefixes in (("one-prefix", 1), ("spread", args.prefixes)):
                work = s3_sim.Workload(kind=kind, direction="save", ranks=ranks, mib_per_rank=args.mib,
                                       layout=layout, prefixes=prefixes)
                out.append(("pacer", work, s3_sim.ClientParams()))
                if ranks in (min(ranks_list), max(ranks_list)):
                    out.append(("budget", work, budget))
                    if ranks == min(ranks_list) and layout == "one-prefix":
                        out.append(("none", work, s3_sim.ClientParams(pacer="none")))
        for sharing in ("node", "job"):
            work = s3_sim.Workload(kind="single", direction="load", ranks=ranks, mib_per_rank=args.resume_gib * 1024,
                                   load_sharing=sharing)
            out.append(("pacer", work, s3_sim.ClientParams()))
        for layout, prefixes in (("one-prefix", 1), ("spread", args.prefixes)):
            work = s3_sim.Workload(kind="dcp", direction="load", ranks=ranks, mib_per_rank=args.mib, layout=layout,
                                   prefixes=prefixes)
            out.append(("pacer", work, s3_sim.ClientParams()))
            if ranks in (min(ranks_list), max(ranks_list)):
                out.append(("budget", work, budget))
    if args.big_mib:  # the largest job again with bigger files: more requests per rank after the first wave
        for direction in ("save", "load"):
            work = s3_sim.Workload(kind="dcp", direction=direction, ranks=max(ranks_list), mib_per_rank=args.big_mib)
            out.append(("pacer", work, s3_sim.ClientParams()))
    if args.spread_mib:  # the largest job's spread save with bigger files: a bound of seconds, not of latencies
        work = s3_sim.Workload(kind="dcp", direction="save", ranks=max(ranks_list), mib_per_rank=args.spread_mib,
                               layout="spread", prefixes=args.prefixes)
        out += [("pacer", work, s3_sim.ClientParams()), ("budget", work, budget)]
    if args.oracle:  # the least time any client takes: the largest job's partition-bound rows with the oracle client
        top = max(ranks_list)
        oracle = s3_sim.ClientParams(pacer="oracle")
        out += [("oracle", work, oracle) for label, work, _ in list(out)
                if label == "pacer" and work.ranks == top and not (work.kind == "single" and work.direction == "load")]
    return out


def scenario_words(label: str, work: s3_sim.Workload) -> set[str]:
    """What ``--only`` matches: ``save dcp 16384 one-prefix pacer``, ``load single node 2048 one-prefix pacer``..."""
    layout = "one-prefix" if work.layout == "one-prefix" else "spread"
    sharing = work.load_sharing if work.kind == "single" and work.direction == "load" else ""
    return {work.direction, work.kind, sharing, str(work.ranks), layout, label, f"{work.mib_per_rank:g}MiB"} - {""}


def selected(label: str, work: s3_sim.Workload, only: list[str]) -> bool:
    """Whether a scenario runs: every one without ``--only``, else those with all the words of one ``--only``."""
    return not only or any(set(words.split()) <= scenario_words(label, work) for words in only)


def job_broadcast_s(ranks: int, gib: float, per_host: int = 8, link_bytes_per_s: float = 2e9) -> float:
    """``load_sharing="job"``'s gloo broadcast to the other nodes (docs/scale.md: log2(nodes) x size / link rate)."""
    nodes = max(1, ranks // per_host)
    return math.ceil(math.log2(nodes)) * gib * (1 << 30) / link_bytes_per_s if nodes > 1 else 0.0


def rank_mode_requests(ranks: int, gib: float, part_mib: float = 16.0) -> int:
    """``load_sharing="rank"``: every rank one HEAD and its ranged GETs (counted, too many events to simulate)."""
    return ranks * (1 + math.ceil(gib * 1024 / part_mib))


def row_of(label: str, result: dict[str, Any], draw: int = 0) -> dict[str, Any]:
    work = result["work"]
    row = {
        "draw": draw, "client": label, "ranks": work["ranks"], "hosts": result["hosts"], "kind": work["kind"],
        "direction": work["direction"], "layout": work["layout"] if work["layout"] == "one-prefix"
        else f"spread/{work['prefixes']}",
        "load_sharing": work["load_sharing"] if work["kind"] == "single" and work["direction"] == "load" else None,
        "mib_per_rank": work["mib_per_rank"],
        **{k: result[k] for k in ("failed", "elapsed_s", "bound_s", "capacity_bound_s", "bandwidth_bound_s",
                                  "time_over_bound", "slowdown_per_admitted", "goodput", "requests",
                                  "requests_per_rank", "downloads", "partitions_used", "splits", "p99_s", "events")},
    }
    if row["load_sharing"] == "job":  # the bytes then cross the process group: add the broadcast's time
        extra = job_broadcast_s(work["ranks"], work["mib_per_rank"] / 1024)
        row["broadcast_s"] = extra
        row["elapsed_s"] += extra
        row["bound_s"] += extra
    row["meets"] = meets(row)
    return row


def meets(row: dict[str, Any]) -> bool:
    """The issue's targets: nothing failed, <= 0.5 SlowDown per admitted request, goodput >= 0.9 (where the partitions
    bound the time), time within 1.3x of the bound."""
    goodput_ok = row["goodput"] is None or row["goodput"] >= TARGETS["goodput"]
    return (
        row["failed"] == 0 and row["slowdown_per_admitted"] <= TARGETS["slowdown_per_admitted"] and goodput_ok
        and row["elapsed_s"] <= TARGETS["time_over_bound"] * row["bound_s"]
    )


# --------------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def over_bound(row: dict[str, Any]) -> float | None:
    """A row's time over its bound, as the tables and the chart give it (a ``"job"`` resume's broadcast in both)."""
    return row["elapsed_s"] / row["bound_s"] if row["bound_s"] else None


def op_name(row: dict[str, Any], mib: float) -> str:
    name = f"{row['direction']} {row['kind']}" + (f" ({row['load_sharing']})" if row["load_sharing"] else "")
    return name + (f" {row['mib_per_rank']:g} MiB" if row["load_sharing"] is None and row["mib_per_rank"] != mib else "")


def markdown(doc: dict[str, Any]) -> str:
    args = doc["args"]
    lines = [
        f"# S3 at scale, simulated ({doc['stamp']})",
        "",
        f"{args['mib']:g} MiB per rank in 16 MiB parts (saves, DCP loads); a {args['resume_gib']:g} GiB single-file "
        f"checkpoint every rank resumes from; 8 ranks per host; S3: 3,500 writes / 5,500 reads per second per "
        f"partition, 1 s of burst, splits after {doc['s3']['split_after_s']:g} s of sustained SlowDown; 100 ms per "
        f"request, 5 Gb/s per connection, 100 Gb/s per host. spread/P: keys over P already partitioned prefixes. "
        f"budget: max_requests_per_second write={args['budget_write']:g}, read={args['budget_read']:g}. "
        f"none: no pacer (SlowDown retried with counted backoff). oracle: a measure, not a client (one job-wide queue "
        f"per partition, sent the moment the partition holds a token): the least time any client takes.",
        "",
        "| op | ranks (hosts) | layout | client | failed | time s | bound s | time / bound | SlowDown / admitted "
        "| goodput | requests / rank | targets |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in first_draw(doc["rows"]):
        op = op_name(row, args["mib"])
        ratio = over_bound(row)
        lines.append(
            f"| {op} | {row['ranks']:,} ({row['hosts']:,}) | {row['layout']} | {row['client']} | {row['failed']} "
            f"| {row['elapsed_s']:.1f} | {row['bound_s']:.1f} | {_fmt(ratio)} | {row['slowdown_per_admitted']:.2f} "
            f"| {_fmt(row['goodput'])} | {row['requests_per_rank']:.2f} | {'met' if row['meets'] else 'missed'} |"
        )
    lines += ["", "`load_sharing=\"rank\"` (counted, not simulated): "
              + "; ".join(f"{r['ranks']:,} ranks: {r['requests']:,} requests, >= {r['bound_s']:.0f} s at 5,500/s"
                          for r in doc["rank_mode"]), ""]
    lines += draws_table(doc)
    lines += [
        "## Against bench_throttle's emulation (the same setup simulated)",
        "",
        f"Tolerance: p99 within {TOLERANCE['p99_ratio']:.0%}, goodput within {TOLERANCE['goodput']}, SlowDown per "
        f"admitted within {TOLERANCE['slowdown_per_admitted']}, the same failures.",
        "",
        "| op | writers | pacer per | measured SlowDown / goodput / p99 s | simulated SlowDown / goodput / p99 s | agree |",
        "|---|---:|---|---|---|---|",
    ]
    for row in doc["emulation"]:
        m, s = row["measured"], row["simulated"]
        lines.append(
            f"| {row['direction']} | {row['writers']} | {row['per_host']} ranks | {m['slowdown_per_admitted']:.2f} / "
            f"{m['goodput']:.2f} / {m['p99_s']:.1f} | {s['slowdown_per_admitted']:.2f} / {s['goodput']:.2f} / "
            f"{s['p99_s']:.1f} | {'yes' if row['agree'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def first_draw(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of latency draw 0 (the main table and chart: every run without ``--draws`` has only these)."""
    return [row for row in rows if row.get("draw", 0) == 0]


def draws_table(doc: dict[str, Any]) -> list[str]:
    """With ``--draws N`` > 1: each row's range over the N latency draws (empty otherwise)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in doc["rows"]:
        key = (op_name(row, doc["args"]["mib"]), row["ranks"], row["layout"], row["client"])
        groups.setdefault(key, []).append(row)
    if all(len(rows) < 2 for rows in groups.values()):
        return []

    def span(values: list[float | None]) -> str:
        known = [v for v in values if v is not None]
        if not known:
            return "-"
        low, high = min(known), max(known)
        return f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}"

    lines = [
        f"## Over {doc['args']['draws']} draws of the requests' latencies (draw 0: the table above)",
        "",
        "| op | ranks | layout | client | time s | time / bound | SlowDown / admitted | goodput | targets met |",
        "|---|---:|---|---|---|---|---|---|---|",
    ]
    for (op, ranks, layout, client), rows in groups.items():
        met = sum(row["meets"] for row in rows)
        lines.append(
            f"| {op} | {ranks:,} | {layout} | {client} | {span([r['elapsed_s'] for r in rows])} "
            f"| {span([over_bound(r) for r in rows])} "
            f"| {span([r['slowdown_per_admitted'] for r in rows])} | {span([r['goodput'] for r in rows])} "
            f"| {met} of {len(rows)} |"
        )
    return [*lines, ""]


def chart(doc: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('NOTE: no chart: matplotlib is missing (pip install ".[bench]")', flush=True)
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for axis in axes:
        axis.set_prop_cycle(color=plt.get_cmap("tab20").colors)
    series: dict[str, list[dict[str, Any]]] = {}
    for row in first_draw(doc["rows"]):
        if row["client"] in ("none", "oracle"):
            continue
        op = op_name(row, doc["args"]["mib"])
        series.setdefault(f"{op}, {row['layout']}, {row['client']}", []).append(row)
    for name, rows in series.items():
        xs = [r["ranks"] for r in rows]
        style = "--" if "budget" in name else "-"
        marker = "s" if "spread" in name else "o"
        axes[0].plot(xs, [r["elapsed_s"] for r in rows], style, marker=marker, label=name, linewidth=1)
        axes[1].plot(xs, [over_bound(r) for r in rows], style, marker=marker, linewidth=1)
        axes[2].plot(xs, [r["slowdown_per_admitted"] for r in rows], style, marker=marker, linewidth=1)
    axes[1].axhline(TARGETS["time_over_bound"], color="black", linewidth=0.8, linestyle=":")
    axes[2].axhline(TARGETS["slowdown_per_admitted"], color="black", linewidth=0.8, linestyle=":")
    titles = ("time (s)", "time / partition-capacity bound (target <= 1.3)", "SlowDown per admitted (target <= 0.5)")
    for axis, title in zip(axes, titles, strict=True):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("ranks")
        axis.set_title(title, fontsize=9)
    axes[0].set_yscale("log")
    fig.legend(fontsize=6, loc="lower center", ncol=4)
    fig.suptitle(f"S3 at scale, simulated ({doc['stamp']})", fontsize=10)
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2048,4096,8192,16384")
    parser.add_argument("--mib", type=float, default=64.0, help="each rank's file (saves, DCP loads), MiB")
    parser.add_argument("--resume-gib", type=float, default=1.0, help="the single-file checkpoint resumed, GiB")
    parser.add_argument("--big-mib", type=float, default=0.0, help="the largest DCP job again with this much per rank")
    parser.add_argument("--spread-mib", type=float, default=0.0,
                        help="the largest job's spread DCP save again with this much per rank (pacer and budget)")
    parser.add_argument("--oracle", action=argparse.BooleanOptionalAction, default=True,
                        help="the largest job's rows with the oracle client too (the least time any client takes)")
    parser.add_argument("--prefixes", type=int, default=16, help="spread layout: how many prefixes")
    parser.add_argument("--budget-write", type=float, default=3500.0, help="the job budget's writes/s")
    parser.add_argument("--budget-read", type=float, default=5500.0, help="the job budget's reads/s")
    parser.add_argument("--split-after-s", type=float, default=300.0)
    parser.add_argument("--draws", type=int, default=1,
                        help="run every row under this many draws of the requests' latencies (1: draw 0 alone)")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--tag", default="")
    parser.add_argument("--only", action="append", default=[], metavar="WORDS",
                        help="run only the rows with all these words (repeatable), e.g. 'spread' or "
                             "'dcp 16384 one-prefix pacer'; words: save/load, single/dcp, node/job, ranks, "
                             "one-prefix/spread, pacer/budget/none/oracle, 64MiB")
    args = parser.parse_args(argv)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    started = time.monotonic()
    emulation = emulation_check()
    for row in emulation:
        print(f"emulation {row['direction']} x{row['writers']} ({row['per_host']}/host): measured "
              f"{row['measured']['slowdown_per_admitted']:.2f}/{row['measured']['goodput']:.2f}/"
              f"{row['measured']['p99_s']:.1f}s, simulated {row['simulated']['slowdown_per_admitted']:.2f}/"
              f"{row['simulated']['goodput']:.2f}/{row['simulated']['p99_s']:.1f}s: "
              f"{'agree' if row['agree'] else 'DISAGREE'}", flush=True)
    rows: list[dict[str, Any]] = []
    s3 = s3_sim.S3Params(split_after_s=args.split_after_s)
    ranks_list = [int(n) for n in args.ranks.split(",") if n]
    if not args.check_only:
        for label, work, client in scenarios(ranks_list, args):
            if not selected(label, work, args.only):
                continue
            for draw in range(max(1, args.draws)):
                t = time.monotonic()
                row = row_of(label, s3_sim.run(work, client, dataclasses.replace(s3, latency_draw=draw)), draw)
                rows.append(row)
                print(f"draw {draw}: " * (args.draws > 1)
                      + f"{row['direction']} {row['kind']} {row['load_sharing'] or ''} x{row['ranks']} {row['layout']} "
                      f"{label}: failed {row['failed']}, {row['elapsed_s']:.1f} s (bound {row['bound_s']:.1f} s), "
                      f"SlowDown/admitted {row['slowdown_per_admitted']:.2f}, goodput {_fmt(row['goodput'])}, "
                      f"{row['requests_per_rank']:.2f} req/rank, {'met' if row['meets'] else 'missed'} "
                      f"[{row['events']} events, {time.monotonic() - t:.1f} s]", flush=True)
    rank_mode = [
        {"ranks": n, "requests": rank_mode_requests(n, args.resume_gib),
         "bound_s": rank_mode_requests(n, args.resume_gib) / s3.read_rate}
        for n in ranks_list
    ]
    doc = {
        "stamp": stamp,
        "machine": f"{platform.node()}, Python {platform.python_version()}",
        "wall_s": time.monotonic() - started,
        "args": vars(args),
        "s3": vars(s3),
        "targets": TARGETS,
        "tolerance": TOLERANCE,
        "emulation": emulation,
        "rows": rows,
        "rank_mode": rank_mode,
    }
    RESULTS.mkdir(exist_ok=True)
    base = RESULTS / f"scale-sim-{stamp}{'-' + args.tag if args.tag else ''}"
    base.with_name(base.name + ".json").write_text(json.dumps(doc, indent=1, default=str))
    base.with_name(base.name + ".md").write_text(markdown(doc))
    if rows:
        chart(doc, base.with_name(base.name + ".png"))
    print(markdown(doc))
    print(f"wrote {base}.json, .md, .png in {doc['wall_s']:.0f} s", flush=True)
    return 0 if all(row["agree"] for row in emulation) else 1


if __name__ == "__main__":
    sys.exit(main())
