#!/usr/bin/env python
"""Saves and loads under S3 throttling: this package vs boto3's transfer manager, many writers at once, through a proxy
that admits a fixed number of requests per second (a token bucket per direction) and answers ``503 SlowDown`` beyond,
as S3 does per prefix.

    python benchmarks/bench_throttle.py                      # 8 and 32 writers, saves and loads (about 6 min)
    python benchmarks/bench_throttle.py --writers 8 --clients ours,adaptive --tag quick
    python benchmarks/bench_throttle.py --clients ours,ours+per-process --writers-per-host 0,8   # shared pacer

Each scenario (writers x direction) runs once per client, clients interleaved. Writers are processes forked from one
that imported torch, boto3 and the package (multiprocessing's forkserver), each holding its own S3 client; they
wait at a barrier and then each saves (or loads) one checkpoint of ``--mib`` MiB (a float32 tensor) at once:

* ``ours``: `S3CheckpointIO(chunk_size_MB=5)` ``save_checkpoint`` / ``load_checkpoint`` (default retry policy);
* ``ours+budget``: the same with ``max_requests_per_second`` set to the proxy's rates (each process takes its share
  by world size: WORLD_SIZE is the writer count);
* ``standard`` / ``adaptive``: boto3 ``upload_fileobj`` of the serialised bytes / ``download_fileobj`` then
  ``torch.load``, 5 MiB parts, 10 threads, ``retries={"mode": ..., "max_attempts": 10}``.

The store is moto (a separate process; a ranged GET costs it the whole object, which only matters at rates far above
these). Writes are limited to ``--write-rate-per-writer`` x writers per second, reads to ``--read-rate-per-writer``
x writers, each with one second's worth of burst (the issue's emulation: 2 writes/s and 4 reads/s for 8 writers).

Measured per run: failed operations (an exception left the client), SlowDown answers per admitted request, goodput
(the seconds the admitted requests beyond the burst need at the proxy's rate / the seconds from the first request to
the last admitted one), p50 / p99 operation time, admitted requests per operation. Results:
``benchmarks/results/throttle-<UTC>[-tag].{json,md,png}`` (the chart needs matplotlib, the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import multiprocessing
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
import traceback
import zlib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
BUCKET = "throttle-bench"
CLIENTS = ("ours", "ours+budget", "standard", "adaptive")
EXTRA_CLIENTS = ("ours+desync", "ours+per-process")
"""Not run by default: ``ours+desync`` sleeps a random 0 to ``--desync-s`` seconds (inside the clock) before its
operation, to measure whether desynchronising the writers' first requests helps; ``ours+per-process`` turns the
host's shared pacer off (``S3CKPT_PACER_SHARING=0``: one pacer per process, as before it was shared)."""
MiB = 1 << 20
PART_MIB = 5


def _repo_on_path() -> None:
    for path in (REPO, REPO / "tests" / "helpers"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


_repo_on_path()


# --------------------------------------------------------------------------------------------------------------------
# The writers (forked from the forkserver, which imported the heavy modules once)
# --------------------------------------------------------------------------------------------------------------------


def _tensor(rank: int, mib: float) -> Any:
    import torch

    generator = torch.Generator().manual_seed(zlib.crc32(f"bench/{rank}".encode()))
    return torch.rand(int(mib * MiB) // 4, generator=generator)


def _writer(spec: dict[str, Any], rank: int, barrier: Any, results: Any) -> None:
    """One writer: set up its client (outside the clock), wait for the others, save or load once, report."""
    os.environ.update(spec["env"])
    os.environ["WORLD_SIZE"] = str(spec["writers"])
    # The job on this "host": writers in groups of --writers-per-host share a pacer (one job key per group).
    per_host = spec["per_host"] or spec["writers"]
    os.environ["TORCHELASTIC_RUN_ID"] = f"{spec['job']}-host{rank // per_host}"
    os.environ["LOCAL_WORLD_SIZE"] = str(per_host)
    if spec["client"] == "ours+per-process":
        os.environ["S3CKPT_PACER_SHARING"] = "0"
    import torch

    report: dict[str, Any] = {"rank": rank}
    try:
        key = f"{spec['prefix']}/w{rank}.ckpt"
        tensor = _tensor(rank, spec["mib"])
        client = spec["client"]
        if client.startswith("ours"):
            from s3_checkpoint_io import S3CheckpointIO

            budget = spec["budget"] if client == "ours+budget" else None
            plugin = S3CheckpointIO(chunk_size_MB=PART_MIB, max_requests_per_second=budget)
            plugin.s3.client  # noqa: B018 - built before the clock
            url = f"s3://{BUCKET}/{key}"

            def save() -> None:
                plugin.save_checkpoint({"w": tensor}, url)

            def load() -> bool:
                return torch.equal(plugin.load_checkpoint(url)["w"], tensor)
        else:
            import boto3
            from boto3.s3.transfer import TransferConfig
            from botocore.config import Config

            s3 = boto3.client(
                "s3",
                config=Config(
                    retries={"mode": client, "max_attempts": 10},
                    s3={"addressing_style": "path"},
                    max_pool_connections=16,
                ),
            )
            transfer = TransferConfig(
                multipart_threshold=PART_MIB * MiB, multipart_chunksize=PART_MIB * MiB, max_concurrency=10
            )
            payload = io.BytesIO()
            torch.save({"w": tensor}, payload)
            body = payload.getvalue()

            def save() -> None:
                s3.upload_fileobj(io.BytesIO(body), BUCKET, key, Config=transfer)

            def load() -> bool:
                buffer = io.BytesIO()
                s3.download_fileobj(BUCKET, key, buffer, Config=transfer)
                buffer.seek(0)
                return torch.equal(torch.load(buffer, weights_only=True)["w"], tensor)

        barrier.wait(timeout=300)
        started = time.monotonic()
        if client == "ours+desync":
            time.sleep(random.Random(rank).uniform(0, spec["desync_s"]))
        try:
            ok = save() if spec["direction"] == "save" else load()
            report["ok"] = ok is None or bool(ok)
            if not report["ok"]:
                report["error"] = "loaded values differ"
        except Exception as exc:
            report["ok"] = False
            report["error"] = f"{type(exc).__name__}: {exc}"[:500]
        report["seconds"] = time.monotonic() - started
    except Exception:
        report["ok"] = False
        report["error"] = traceback.format_exc()[-1500:]
    results.put(report)


# --------------------------------------------------------------------------------------------------------------------
# One run: a fresh rate limit, N writers of one client
# --------------------------------------------------------------------------------------------------------------------


def _run(ctx: Any, proxy: Any, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    from fault_proxy import RateLimit

    writers = spec["writers"]
    rates = {"save": ("write", spec["write_rate"]), "load": ("read", spec["read_rate"])}
    direction, rate = rates[spec["direction"]]
    limit = RateLimit(
        writes_per_s=spec["write_rate"],
        reads_per_s=spec["read_rate"],
        path_regex=f"^/{BUCKET}/{re.escape(spec['prefix'])}/",
    )
    proxy.add_rule(limit)
    barrier, results = ctx.Barrier(writers), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(spec, rank, barrier, results)) for rank in range(writers)]
    for proc in procs:
        proc.start()
    reports = []
    deadline = time.monotonic() + timeout
    try:
        while len(reports) < writers and time.monotonic() < deadline:
            try:
                reports.append(results.get(timeout=1.0))
            except Exception:  # queue.Empty
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        proxy.remove_rule(limit)
    missing = writers - len(reports)
    times = sorted(r["seconds"] for r in reports if "seconds" in r)
    admitted, throttled = limit.admitted[direction], limit.throttled[direction]
    return {
        **{k: v for k, v in spec.items() if k != "env"},
        "failed": sum(not r["ok"] for r in reports) + missing,
        "errors": sorted({r["error"][:200] for r in reports if r.get("error")})[:3],
        "admitted": admitted,
        "throttled": throttled,
        "slowdown_per_admitted": throttled / max(1, admitted),
        "goodput": limit.goodput(direction) if admitted else 0.0,
        "burst": limit.burst(direction),
        "rate": rate,
        "p50_s": statistics.median(times) if times else None,
        "p99_s": times[min(len(times) - 1, int(0.99 * len(times)))] if times else None,
        "requests_per_op": admitted / writers,
        "span_s": limit.last_admitted.get(direction, 0) - limit.first_request.get(direction, 0),
    }


# --------------------------------------------------------------------------------------------------------------------
# A reference: evenly paced, independent senders against the same token bucket
# --------------------------------------------------------------------------------------------------------------------


def frontier(
    rate: float, burst: float, senders: int, loads: tuple[float, ...] = (1.0, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5)
):
    """(load, goodput, SlowDown per admitted) of `senders` processes that each send perfectly evenly at load x
    rate / senders, with random phases and 2 % jitter, into a `TokenBucket(rate, burst)`, every process always with a
    request ready (400 each): what ideal per-process pacing at a given total load gets in this emulation. With a
    small burst, collisions of independent senders cost SlowDowns even below the rate."""
    import random

    from fault_proxy import TokenBucket

    points = []
    for load in loads:
        rnd = random.Random(20)
        period = senders / (load * rate)
        arrivals = sorted(
            n * period + phase + rnd.gauss(0, 0.02 * period)
            for phase in (rnd.random() * period for _ in range(senders))
            for n in range(400)
        )
        clock = [0.0]
        bucket = TokenBucket(rate, burst, clock=lambda clock=clock: clock[0])
        admitted = throttled = 0
        for t in arrivals:
            clock[0] = t
            if bucket.admit():
                admitted += 1
            else:
                throttled += 1
        span = arrivals[-1] - arrivals[0]
        points.append((load, max(0.0, admitted - burst) / rate / span, throttled / admitted))
    return points


def _frontier_lines(rate: float, burst: float, senders: int) -> list[str]:
    points = frontier(rate, burst, senders)
    cells = " | ".join(f"{load:.2f}x: {goodput:.2f} / {ratio:.2f}" for load, goodput, ratio in points)
    best_at_half = max((g for _, g, r in points if r <= 0.5), default=0.0)
    least_at_09 = min((r for _, g, r in points if g >= 0.9), default=float("inf"))
    return [
        f"- {senders} senders, {rate:g}/s, burst {burst:g}: sending at load x rate gives goodput / SlowDown per "
        f"admitted {cells}. Best goodput with <= 0.5 SlowDown: {best_at_half:.2f}; least SlowDown with goodput "
        f">= 0.9: {least_at_09:.2f}."
    ]


# --------------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------------


def _markdown(doc: dict[str, Any]) -> str:
    lines = [
        f"# Saves and loads under S3 throttling ({doc['stamp']})",
        "",
        f"{doc['machine']}. moto behind a proxy admitting {doc['write_rate_per_writer']:g} writes/s and "
        f"{doc['read_rate_per_writer']:g} reads/s per writer (x writers, 1 s of burst), `503 SlowDown` beyond. "
        f"Every writer a process, all at once: one {doc['mib']:g} MiB checkpoint each, {PART_MIB} MiB parts / ranges.",
        "",
        "| direction | writers | client | failed | SlowDown / admitted | goodput | p50 s | p99 s | requests / op |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in doc["runs"]:
        p50 = f"{run['p50_s']:.1f}" if run["p50_s"] is not None else "-"
        p99 = f"{run['p99_s']:.1f}" if run["p99_s"] is not None else "-"
        lines.append(
            f"| {run['direction']} | {run['writers']} | {run.get('label', run['client'])} | {run['failed']} "
            f"| {run['slowdown_per_admitted']:.2f} | {run['goodput']:.2f} | {p50} | {p99} "
            f"| {run['requests_per_op']:.1f} |"
        )
    lines += [
        "",
        "Targets: 0 failed; goodput >= 0.9 and <= 0.5 SlowDown per admitted request, saves and loads.",
        "goodput = (admitted - burst) / rate over the seconds from the first request to the last admitted one.",
        "",
        "Reference (`frontier`): independent processes sending perfectly evenly (random phases, 2 % jitter, always a",
        "request ready) into the same token bucket, at a total load of x times its rate:",
    ]
    seen = set()
    for run in doc["runs"]:
        key = (run["rate"], run["burst"], run["writers"])
        if key not in seen and run["burst"]:
            seen.add(key)
            lines += _frontier_lines(*key)
    for run in doc["runs"]:
        for error in run["errors"]:
            lines.append(f"- {run['direction']} {run['writers']} {run.get('label', run['client'])}: `{error}`")
    return "\n".join(lines) + "\n"


def _chart(doc: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('NOTE: no chart: matplotlib is missing (pip install ".[bench]")', flush=True)
        return False
    runs = doc["runs"]
    scenarios = sorted({(r["direction"], r["writers"]) for r in runs}, key=lambda s: (s[0] != "save", s[1]))
    clients = list(dict.fromkeys(r.get("label", r["client"]) for r in runs))
    colours = {"ours": "tab:orange", "ours+budget": "tab:red", "standard": "tab:gray", "adaptive": "tab:blue"}
    colours.update({"ours+desync": "tab:brown", "ours+per-process": "tab:olive"})
    metrics = (
        ("slowdown_per_admitted", "SlowDown per admitted request (lower is better; target <= 0.5)", 0.5),
        ("goodput", "goodput (higher is better; target >= 0.9)", 0.9),
    )
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(1, len(clients))
    for axis, (metric, title, target) in zip(axes, metrics, strict=True):
        for n, client in enumerate(clients):
            values = []
            for scenario in scenarios:
                run = next(
                    (
                        r
                        for r in runs
                        if (r["direction"], r["writers"]) == scenario and r.get("label", r["client"]) == client
                    ),
                    None,
                )
                values.append(run[metric] if run else 0.0)
            xs = [i + (n - (len(clients) - 1) / 2) * width for i in range(len(scenarios))]
            hatch = "//" if "/host" in client else None  # a client's N/host variant: its colour, hatched
            axis.bar(xs, values, width, label=client, color=colours.get(client.split()[0]), hatch=hatch)
            for x, scenario in zip(xs, scenarios, strict=True):
                run = next(
                    (
                        r
                        for r in runs
                        if (r["direction"], r["writers"]) == scenario and r.get("label", r["client"]) == client
                    ),
                    None,
                )
                if run and run["failed"]:
                    axis.text(x, 0, f"{run['failed']} failed", rotation=90, fontsize=7, va="bottom", ha="center")
        axis.axhline(target, color="black", linewidth=0.8, linestyle="--")
        axis.set_xticks(range(len(scenarios)), [f"{d} x{w}" for d, w in scenarios])
        axis.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"S3 throttling emulation, {doc['mib']:g} MiB per writer ({doc['stamp']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------------------------


def _moto(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writers", default="8,32", help="writer counts, comma-separated")
    parser.add_argument("--directions", default="save,load")
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--mib", type=float, default=20.0, help="checkpoint size per writer (MiB)")
    parser.add_argument("--write-rate-per-writer", type=float, default=0.25, help="admitted writes/s per writer")
    parser.add_argument("--read-rate-per-writer", type=float, default=0.5, help="admitted reads/s per writer")
    parser.add_argument("--desync-s", type=float, default=2.0, help="the ours+desync client's largest delay")
    parser.add_argument(
        "--writers-per-host",
        default="0",
        help="comma-separated; for each N > 0 the ours clients also run with writers in groups of N, each group its "
        "own job key on its own 'host' (its own shared pacer); 0: all writers on one host (one shared pacer)",
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run before writers are killed")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)

    from fault_proxy import FaultProxy

    import s3_local_servers

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    port = s3_local_servers.free_port()
    moto = _moto(port)
    endpoint = s3_local_servers.LocalS3("moto", f"http://127.0.0.1:{port}", "bench-key", "bench-secret")
    runs: list[dict[str, Any]] = []
    try:
        s3_local_servers.wait_until_ready(endpoint, 30)
        endpoint.client().create_bucket(Bucket=BUCKET)
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "boto3", "boto3.s3.transfer", "s3_checkpoint_io", "fault_proxy"])
        with FaultProxy(endpoint.endpoint_url) as proxy:
            env = {**endpoint.env(), "AWS_ENDPOINT_URL_S3": proxy.endpoint_url, "OMP_NUM_THREADS": "1"}
            writer_counts = [int(n) for n in args.writers.split(",") if n]
            clients = [c for c in args.clients.split(",") if c]
            unknown = sorted(set(clients) - set(CLIENTS) - set(EXTRA_CLIENTS))
            if unknown:
                parser.error(f"unknown clients {unknown}; known: {list(CLIENTS + EXTRA_CLIENTS)}")
            for writers in writer_counts:
                write_rate, read_rate = args.write_rate_per_writer * writers, args.read_rate_per_writer * writers
                for direction in [d for d in args.directions.split(",") if d]:
                    per_hosts = [int(n) for n in args.writers_per_host.split(",") if n]
                    variants = [
                        (client, n)
                        for client in clients
                        for n in (per_hosts if client in ("ours", "ours+budget", "ours+desync") else [0])
                        if n == 0 or n < writers
                    ]
                    for client, per_host in variants:
                        label = f"{client} {per_host}/host" if per_host else client
                        spec = {
                            "client": client,
                            "label": label,
                            "per_host": per_host,
                            "job": f"bench-{stamp}-{client}-{writers}-{direction}-{per_host}",
                            "writers": writers,
                            "direction": direction,
                            "mib": args.mib,
                            "prefix": f"{client.replace('+', '-')}-{writers}" + (f"-h{per_host}" if per_host else ""),
                            "write_rate": write_rate,
                            "read_rate": read_rate,
                            "budget": {"write": write_rate, "read": read_rate},
                            "desync_s": args.desync_s,
                            "env": env,
                        }
                        if direction == "load" and not any(
                            r["label"] == label and r["writers"] == writers and r["direction"] == "save" for r in runs
                        ):
                            print(f"skip: load by {client} x{writers} needs its save first", flush=True)
                            continue
                        run = _run(ctx, proxy, spec, args.timeout)
                        runs.append(run)
                        print(
                            f"{direction} x{writers} {label:18} failed {run['failed']}  "
                            f"SlowDown/admitted {run['slowdown_per_admitted']:.2f}  goodput {run['goodput']:.2f}  "
                            f"p50 {run['p50_s'] or 0:.1f} s  p99 {run['p99_s'] or 0:.1f} s  "
                            f"({run['admitted']} admitted, {run['throttled']} throttled in {run['span_s']:.1f} s)",
                            flush=True,
                        )
    finally:
        moto.terminate()
        moto.wait(timeout=10)
    doc = {
        "stamp": stamp,
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "mib": args.mib,
        "write_rate_per_writer": args.write_rate_per_writer,
        "read_rate_per_writer": args.read_rate_per_writer,
        "runs": runs,
    }
    RESULTS.mkdir(exist_ok=True)
    base = RESULTS / f"throttle-{stamp}{'-' + args.tag if args.tag else ''}"
    base.with_name(base.name + ".json").write_text(json.dumps(doc, indent=1))
    base.with_name(base.name + ".md").write_text(_markdown(doc))
    _chart(doc, base.with_name(base.name + ".png"))
    print(_markdown(doc))
    print(f"wrote {base}.json, .md, .png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
