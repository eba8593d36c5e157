#!/usr/bin/env python
"""A replica over loopback (`s3_tier_replication`) against a raw socket copy of the same bytes (the target: a
replica within 2x of the time the bytes take over the transport).

    python benchmarks/bench_tier_replication.py                 # 1 GiB in 8 files under /dev/shm, 3 rounds
    python benchmarks/bench_tier_replication.py --mib 256 --files 4 --rounds 5

The receiving side runs in a process of its own, as on a peer node. Per round, in this order:

* ``raw``: sendfile of every file over one TCP connection; the receiver reads into an 8 MiB buffer and drops it
  (the time the bytes take over the transport);
* ``raw+files``: the same, the receiver writing each file into tmpfs (a copy with no checks);
* ``replica``: `send_directory` to a `ReplicaServer` (keep=1): the request, every byte checksummed and written into
  a temporary folder, the rename, the manifest, dropping the previous replica;
* ``fetch``: `fetch_directory` of that replica back into tmpfs (verified).

Prints a table (median seconds, GiB/s, ratio of the medians to ``raw``'s and the median of each round's ratio) and writes ``benchmarks/results/tier-replication-<UTC>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import s3_memory_tier  # noqa: E402
import s3_tier_replication as replication  # noqa: E402

MiB = 1024 * 1024
JOB, LAUNCH = "bench", "bench#0"


def raw_receiver(out: str) -> None:
    """Accept connections; each sends ``<total>\\n<count>\\n`` then sizes and bytes; read them (into files under
    `out` if it is not ``-``) and answer one byte."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    buffer = memoryview(bytearray(replication.CHUNK))
    while True:
        connection, _ = listener.accept()
        with connection, connection.makefile("rb", buffering=0) as stream:
            sizes = [int(x) for x in stream.readline().split()]
            for index, size in enumerate(sizes):
                fd = None if out == "-" else os.open(f"{out}/f{index}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                left = size
                while left:
                    count = connection.recv_into(buffer[: min(left, len(buffer))])
                    if fd is not None:
                        os.write(fd, buffer[:count])
                    left -= count
                if fd is not None:
                    os.close(fd)
            connection.sendall(b"k")


def serve(root: str) -> None:
    server = replication.ReplicaServer(Path(root), job=JOB, launch=LAUNCH, keep=1)
    print(server.address[1], flush=True)
    while True:
        time.sleep(60)


def start(*args: str) -> tuple[subprocess.Popen[bytes], tuple[str, int]]:
    process = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE)
    assert process.stdout is not None
    return process, ("127.0.0.1", int(process.stdout.readline()))


def raw_send(address: tuple[str, int], files: list[Path]) -> None:
    with socket.create_connection(address) as sock:
        sock.sendall((" ".join(str(f.stat().st_size) for f in files) + "\n").encode())
        for path in files:
            with open(path, "rb") as stream:
                sock.sendfile(stream)
        assert sock.recv(1) == b"k"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="total size of the checkpoint folder")
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--where", default="/dev/shm", help="the tmpfs for the folder, the replicas and the copies")
    args = parser.parse_args()

    base = Path(args.where) / f"s3ckpt-bench-replication-{os.getpid()}"
    source, raw_out, fetched = base / "memory" / "step=1", base / "raw", base / "fetched"
    for folder in (source, raw_out):
        folder.mkdir(parents=True)
    files = []
    for index in range(args.files):
        path = source / f"__{index}_0.distcp"
        path.write_bytes(os.urandom(args.mib * MiB // args.files))
        files.append(path)
    manifest = {path.name: s3_memory_tier.file_checksum(path, "auto") for path in files}
    processes = []
    try:
        raw, raw_address = start("raw-receiver", "-")
        raw_files, raw_files_address = start("raw-receiver", str(raw_out))
        server, server_address = start("serve", str(base / "replicas"))
        processes += [raw, raw_files, server]
        times: dict[str, list[float]] = {"raw": [], "raw+files": [], "replica": [], "fetch": []}
        for round_index in range(args.rounds):
            for kind, run in [
                ("raw", lambda: raw_send(raw_address, files)),
                ("raw+files", lambda: raw_send(raw_files_address, files)),
                ("replica", lambda i=round_index: replication.send_directory(
                    source, f"step={i}", server_address, sender_node="node 0", job=JOB, launch=LAUNCH,
                    manifest=manifest)),
                ("fetch", lambda i=round_index: replication.fetch_directory(
                    server_address, sender_node="node 0", name=f"step={i}", dest=fetched, job=JOB, launch=LAUNCH)),
            ]:  # fmt: skip
                started = time.perf_counter()
                run()
                times[kind].append(time.perf_counter() - started)
                shutil.rmtree(fetched, ignore_errors=True)
    finally:
        for process in processes:
            process.kill()
            process.wait()
        shutil.rmtree(base, ignore_errors=True)

    gib = args.mib / 1024
    raw_median = statistics.median(times["raw"])
    rows = {kind: statistics.median(seconds) for kind, seconds in times.items()}
    print(f"{args.mib} MiB in {args.files} files, {args.rounds} rounds, loopback, {os.cpu_count()} CPUs")
    per_round = {
        k: statistics.median(t / raw for t, raw in zip(v, times["raw"], strict=True)) for k, v in times.items()
    }
    print(f"{'':10} {'median s':>9} {'GiB/s':>7} {'x raw':>6} {'x raw/rd':>8}   all rounds (s)")
    for kind, median in rows.items():
        spread = " ".join(f"{s:.3f}" for s in times[kind])
        print(
            f"{kind:10} {median:9.3f} {gib / median:7.2f} {median / raw_median:6.2f} {per_round[kind]:8.2f}   {spread}"
        )
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    result = {
        "mib": args.mib, "files": args.files, "rounds": args.rounds, "where": args.where, "times_s": times,
        "median_s": rows, "ratio_to_raw": {k: v / raw_median for k, v in rows.items()},
        "median_ratio_to_raw_per_round": per_round,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
    }  # fmt: skip
    out = REPO / "benchmarks" / "results" / f"tier-replication-{stamp}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "raw-receiver":
        raw_receiver(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        main()
