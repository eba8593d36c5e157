"""One training run for the fencing tests: a process that saves, removes and loads checkpoints when told to.

Each process is its own run (`s3_fencing.current_run`), so two of them play a stale job and the job that replaced it.
Commands arrive as JSON lines on stdin, answers leave as JSON lines on stdout (``{"ok": true, ...}`` or
``{"ok": false, "type": ..., "taken": ..., "message": ...}``); the S3 endpoint and keys come from the environment.

    {"op": "save", "url": ..., "step": N, "async": false, "mib": 0}
        S3CheckpointIO.save_checkpoint (one plugin per mode; "mib" adds a tensor that size: a multipart upload)
    {"op": "remove", "url": ..., "async": false}    S3CheckpointIO.remove_checkpoint
    {"op": "teardown", "async": true}               S3CheckpointIO.teardown
    {"op": "resume", "dirpath": ...}                find_resume_checkpoint, then load: its URL and step
    {"op": "dcp_save", "url": ..., "value": V}      dcp.save of {"w": full(8, V)} with S3StorageWriter
    {"op": "dcp_load", "url": ...}                  dcp.load: the value
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from typing import Any

from lightning_stand_in import stand_in_for_lightning

from s3_fencing import CheckpointDirectoryTakenError, current_run

# The run exists from here on (its start time is now): say so before the slow imports, so that the test can start the
# other run's process at once, and the two import torch side by side.
print(json.dumps({"ok": True, "run": current_run().run_id}), flush=True)

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from connector import find_resume_checkpoint  # noqa: E402
from s3_checkpoint_io import S3CheckpointIO  # noqa: E402
from s3_dcp import S3StorageReader, S3StorageWriter  # noqa: E402

_plugins: dict[bool, S3CheckpointIO] = {}


def plugin(is_async: bool) -> S3CheckpointIO:
    if is_async not in _plugins:
        _plugins[is_async] = S3CheckpointIO(chunk_size_MB=5, async_checkpointing=is_async)
    return _plugins[is_async]


def state(step: int, mib: float = 0) -> dict[str, Any]:
    """A small checkpoint of `step`, plus `mib` MiB of tensor (enough for a multipart upload at 5 MiB parts)."""
    checkpoint: dict[str, Any] = {"step": step, "w": torch.full((64,), float(step))}
    if mib:
        checkpoint["big"] = torch.full((int(mib * 2**20) // 4,), float(step))
    return checkpoint


def failure_types(exc: BaseException) -> list[str]:
    """The exception's type and those DCP wrapped in it (a CheckpointException carries every rank's failure)."""
    names = [type(exc).__name__]
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        names.append(type(inner).__name__)
    return names


def run(command: dict[str, Any]) -> dict[str, Any]:
    op = command["op"]
    if op == "save":
        checkpoint = state(command["step"], command.get("mib", 0))
        plugin(command.get("async", False)).save_checkpoint(checkpoint, command["url"])
        return {}
    if op == "remove":
        plugin(command.get("async", False)).remove_checkpoint(command["url"])
        return {}
    if op == "teardown":
        plugin(command.get("async", False)).teardown()
        return {}
    if op == "resume":
        url = find_resume_checkpoint(command["dirpath"])
        return {"url": url, "step": plugin(False).load_checkpoint(url)["step"]}
    if op == "dcp_save":
        writer = S3StorageWriter(command["url"], chunk_size_MB=5)
        dcp.save({"w": torch.full((8,), float(command["value"]))}, storage_writer=writer, no_dist=True)
        return {}
    if op == "dcp_load":
        loaded = {"w": torch.zeros(8)}
        dcp.load(loaded, storage_reader=S3StorageReader(command["url"]), no_dist=True)
        return {"value": float(loaded["w"][0])}
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    stand_in_for_lightning()  # no Trainer here: S3CheckpointIO need not import Lightning (lightning_stand_in.py)
    plugin(False), plugin(True)  # built before the first command
    print(json.dumps({"ok": True}), flush=True)
    for line in sys.stdin:
        try:
            answer = {"ok": True, **run(json.loads(line))}
        except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
            types = failure_types(exc)
            answer = {
                "ok": False,
                "type": types[0],
                "taken": CheckpointDirectoryTakenError.__name__ in types,
                "message": "".join(traceback.format_exception_only(exc)),
                "traceback": "".join(traceback.format_exception(exc))[-3000:],
            }
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
