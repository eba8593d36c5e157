#!/usr/bin/env python
"""Which of a save's byte operations hold the GIL: a background thread repeats one operation on a 64 MiB buffer
while the main thread runs a Python loop and records its longest pause. An operation that holds the GIL pauses the
loop for at least its own duration every time; one that releases it pauses the loop only when the machine has no
free CPU (so compare the pause with the operation's time, and run it on a quiet machine).

    python benchmarks/gil_probe.py
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import s3_utils

MiB = 1024**2


def probe(operation: Any, seconds: float = 1.5) -> tuple[float, float]:
    """(median operation ms, longest pause of the main thread's loop in ms)."""
    stop, durations = threading.Event(), []

    def repeat() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            operation()
            durations.append(time.perf_counter() - started)

    thread = threading.Thread(target=repeat)
    thread.start()
    time.sleep(0.02)
    last = time.perf_counter()
    end, longest = last + seconds, 0.0
    while last < end:
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    stop.set()
    thread.join()
    return 1000 * statistics.median(durations), 1000 * longest


def main() -> int:
    import torch

    torch.set_num_threads(1)
    size = 64 * MiB
    source, target = bytearray(b"\1" * size), bytearray(size)
    tensor = torch.rand(size // 4)
    operations = {
        "memoryview slice assignment (main's part-buffer copy)": lambda: memoryview(target).__setitem__(
            slice(None), memoryview(source)
        ),
        "s3_utils._copy_into (slice assignment)": lambda: s3_utils._copy_into(target, 0, memoryview(source).toreadonly()),
        "tensor.to('cpu', copy=True) (snapshot_to_host)": lambda: tensor.to("cpu", copy=True),
        "zlib.crc32": lambda: zlib.crc32(source),
    }
    try:
        from awscrt import checksums

        operations["awscrt crc32c"] = lambda: checksums.crc32c(source)
    except ImportError:
        pass
    print("| 64 MiB operation in a thread | operation ms | main loop's longest pause ms (3 tries) | GIL |")
    print("|---|---:|---:|---|")
    for name, operation in operations.items():
        tries = [probe(operation) for _ in range(3)]
        duration = statistics.median(d for d, _ in tries)
        pauses = [p for _, p in tries]
        verdict = "released" if min(pauses) < 0.5 * duration else "held"
        print(f"| {name} | {duration:.1f} | {', '.join(f'{p:.1f}' for p in pauses)} | {verdict} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
