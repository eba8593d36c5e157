"""Counting what `s3_dcp.S3StorageReader` does, from outside the package: ranged GETs and their bytes, items read
straight into their targets (`s3_dcp.DirectReads`), and tensors located through the spans their writer recorded
(`s3_dcp.SpanReads`, straight, buffered or scattered). The reader itself keeps no counters.

    with counting_reads() as counts:
        dcp.load(state, storage_reader=reader, no_dist=True)
    assert counts["requests"] == 1
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import s3_dcp
import s3_utils


@contextlib.contextmanager
def counting_reads() -> Iterator[dict[str, int]]:
    counts = {"requests": 0, "bytes": 0, "direct_items": 0, "recorded_spans": 0}
    lock = threading.Lock()

    def add(**amounts: int) -> None:
        with lock:
            for name, amount in amounts.items():
                counts[name] += amount

    real_range = vars(s3_utils.S3Utils)["read_range_into"]  # a descriptor of its own: called through __get__
    real_direct = s3_dcp.DirectReads.consume_direct
    real_span = s3_dcp.SpanReads.span_bytes
    real_scattered = s3_dcp.ScatterReads.consume_scattered

    def read_range_into(self: Any, url: str, start: int, target: Any, **kwargs: Any) -> Any:
        views = target if isinstance(target, list) else [target]
        add(requests=1, bytes=sum(memoryview(view).nbytes for view in views))
        return real_range.__get__(self, type(self))(url, start, target, **kwargs)

    def consume_direct(self: Any, reader: Any, read: Any, *args: Any) -> None:
        real_direct(self, reader, read, *args)
        add(direct_items=1, recorded_spans=1)  # a direct read always goes by its recorded span

    def span_bytes(self: Any, *args: Any) -> Any:
        found = real_span(self, *args)
        add(recorded_spans=int(found is not None))
        return found

    def consume_scattered(self: Any, reader: Any, group: Any, planner: Any) -> None:
        filled = sum(item.fill is not None for item in group.items)
        real_scattered(self, reader, group, planner)
        add(recorded_spans=filled)

    patches = [
        (s3_utils.S3Utils, "read_range_into", real_range, read_range_into),
        (s3_dcp.DirectReads, "consume_direct", real_direct, consume_direct),
        (s3_dcp.SpanReads, "span_bytes", real_span, span_bytes),
        (s3_dcp.ScatterReads, "consume_scattered", real_scattered, consume_scattered),
    ]
    for owner, name, _, replacement in patches:
        setattr(owner, name, replacement)
    try:
        yield counts
    finally:
        for owner, name, real, _ in patches:
            setattr(owner, name, real)
