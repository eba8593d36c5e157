#!/usr/bin/env python
"""Profile this package's save and load with py-spy (function level), against the same local SeaweedFS setup.

    python benchmarks/profile_ours.py --size 1024 [--params '{"chunk": 64}']

Needs py-spy (``benchmarks/.venv-peers/bin/pip install py-spy``). Takes the weed lock, starts weed on /dev/shm,
runs ``bench_worker.py`` ours-save then ours-load under ``py-spy record --format raw`` (CPU samples, and with
``--idle`` for wall-clock), and prints the top functions by self and inclusive samples, restricted to stacks
inside the measured call (``save_checkpoint`` / ``load_checkpoint``). Raw stacks go to ``benchmarks/profiles/``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_checkpoint as bc  # noqa: E402

PYSPY = HERE / ".venv-peers" / "bin" / "py-spy"


def summarise(raw: Path, marker: str, top: int = 18) -> str:
    self_c: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if marker not in stack:
            continue
        n = int(count)
        frames = [
            f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] + ")" if " (" in f else f
            for f in stack.split(";")
        ]
        total += n
        self_c[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    lines = [f"  samples inside {marker}: {total}", "  top self:"]
    lines += [f"    {100 * c / total:5.1f}%  {f}" for f, c in self_c.most_common(top)]
    lines += ["  top inclusive:"]
    lines += [f"    {100 * c / total:5.1f}%  {f}" for f, c in incl.most_common(top + 12)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--params", default="{}")
    ap.add_argument("--rate", type=int, default=200)
    args = ap.parse_args()
    out_dir = HERE / "profiles"
    out_dir.mkdir(exist_ok=True)
    data_root = tempfile.mkdtemp(prefix="s3ckpt-prof-", dir="/dev/shm")
    with bc.benchmark_seaweedfs(data_root) as (ep, weed_pid):
        client = ep.client()
        client.create_bucket(Bucket=bc.BUCKET)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(ep.env())
        params = json.loads(args.params)
        tag = "_".join(f"{k}{v}" for k, v in params.items()) or "default"
        for method, marker in (("ours-save", "save_checkpoint"), ("ours-load", "load_checkpoint")):
            for idle in (False, True):
                spec = {
                    "method": method,
                    "size_mib": args.size,
                    "tensor_mib": 64,
                    "bucket": bc.BUCKET,
                    "key": "prof/ckpt",
                    "params": params,
                    "weed_pid": weed_pid,
                    "repo": str(bc.REPO),
                }
                if method == "ours-save" and idle:
                    continue  # one save is enough for wall-clock view of the load; saves: CPU view
                raw = out_dir / f"{method}-{args.size}-{tag}{'-wall' if idle else '-cpu'}.raw"
                cmd = [
                    str(PYSPY),
                    "record",
                    "-r",
                    str(args.rate),
                    "-f",
                    "raw",
                    "-o",
                    str(raw),
                    "--threads",
                    "-n",
                ]
                if idle:
                    cmd.append("--idle")
                cmd += ["--", sys.executable, str(HERE / "bench_worker.py"), json.dumps(spec)]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                result = [line for line in proc.stdout.splitlines() if line.startswith("BENCH_RESULT")]
                print(
                    f"== {method} {'wall (--idle)' if idle else 'cpu'}: {result[0][13:300] if result else proc.stderr[-800:]}"
                )
                print(summarise(raw, marker), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
