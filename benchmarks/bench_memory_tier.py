#!/usr/bin/env python
"""Training stall per save with the memory tier against a plain copy of the same tensors into tmpfs (issue 40's
first target: the tier's stall <= 1.2x the plain copy), and a resume from memory against one from S3 (moto).

    python benchmarks/bench_memory_tier.py                      # realistic GPT-style state d=256, 2 layers (~70 MiB)
    python benchmarks/bench_memory_tier.py --d 768 --layers 8   # 0.9 GiB

Per round, alternating:

* ``copy``: every tensor's bytes written into one new file in the tmpfs (no serialisation, no checksum): the floor;
* ``tier``: `S3CheckpointIO.save_checkpoint` with ``memory_tier`` (torch.save into the tmpfs with the running CRC,
  the atomic rename, the commit record, the launch check, the bound): what training waits for. Drains are kept out
  of the timed saves (``drain_every`` past the rounds; the first, drained, save is a warm-up);
* ``load-memory`` / ``load-s3``: `load_checkpoint` of the saved URL from the verified memory copy, and from S3 (a
  plugin without the tier), each followed by touching every tensor.

Prints a table of medians and ratios. Not a quiet machine unless you make it one: say so with the numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import realistic_state  # noqa: E402
import torch  # noqa: E402

from s3_checkpoint_io import S3CheckpointIO  # noqa: E402
from s3_local_servers import moto_server  # noqa: E402
from s3_memory_tier import MemoryTier  # noqa: E402


def tensors_of(obj: object) -> list[torch.Tensor]:
    found, pending = [], [obj]
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return found


def plain_copy(tensors: list[torch.Tensor], directory: str) -> float:
    started = time.perf_counter()
    fd, path = tempfile.mkstemp(dir=directory)
    try:
        for tensor in tensors:
            view = memoryview(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())
            while view:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - started
    os.unlink(path)
    return elapsed


def touch(checkpoint: object) -> None:
    for tensor in tensors_of(checkpoint):
        tensor.view(-1)[-1:].clone()  # the pages are there (mapped loads fault them in)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tmpfs", default="/dev/shm")
    args = parser.parse_args()
    state = realistic_state.checkpoint(args.d, args.layers)
    tensors = tensors_of(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    results: dict[str, list[float]] = {"copy": [], "tier": [], "load-memory": [], "load-s3": []}
    with tempfile.TemporaryDirectory(dir=args.tmpfs) as root, moto_server() as endpoint:
        os.environ.update(endpoint.env())
        S3CheckpointIO().s3.client.create_bucket(Bucket="bench")
        config = MemoryTier(root=root, job="bench", keep=2, drain_every=10**6)
        tiered, plain = S3CheckpointIO(memory_tier=config), S3CheckpointIO()
        url = "s3://bench/run/step=0-last.ckpt"
        tiered.save_checkpoint(state, url)  # warm-up; drained to S3 (the first save always is)
        tiered.wait_for_pending_saves()
        for index in range(args.rounds):
            results["copy"].append(plain_copy(tensors, root))
            newest = f"s3://bench/run/step={index + 1}.ckpt"
            tiered.save_checkpoint(state, newest)
            results["tier"].append(tiered.last_save_blocked_s)
            for kind, plugin, loaded in (("load-memory", tiered, newest), ("load-s3", plain, url)):
                started = time.perf_counter()
                touch(plugin.load_checkpoint(loaded, weights_only=False))
                results[kind].append(time.perf_counter() - started)
                assert plugin.records[-1].tier == kind.removeprefix("load-")
        tiered.teardown()
    median = {kind: statistics.median(times) for kind, times in results.items()}
    print(f"state d={args.d} layers={args.layers}: {nbytes / 2**20:.0f} MiB of tensors, {len(tensors)} tensors, "
          f"{args.rounds} rounds, {os.cpu_count()} CPUs, tmpfs {args.tmpfs}")
    print("| what | median s | GiB/s | ratio |")
    print("|---|---|---|---|")
    for kind, base in (("copy", "copy"), ("tier", "copy"), ("load-memory", "load-memory"), ("load-s3", "load-memory")):
        seconds = median[kind]
        print(f"| {kind} | {seconds:.3f} | {nbytes / seconds / 2**30:.2f} | {seconds / median[base]:.2f}x {base} |")


if __name__ == "__main__":
    main()
