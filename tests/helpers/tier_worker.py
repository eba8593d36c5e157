"""A process of a job with a memory tier, for tests/test_memory_tier.py.

    python tier_worker.py save URL TIER_ROOT JOB SEED   # save into the tier; SIGKILL just before the drain's upload
    python tier_worker.py save-remove URL TIER_ROOT JOB SEED  # as save, but its removal is asked for while it drains
    python tier_worker.py relaunch TIER_ROOT JOB        # open the tier (finishing drains), teardown, print records

``save`` kills its own process (SIGKILL: nothing runs after it) when the drain is about to send the checkpoint's
object to S3, so the memory copy is committed and its drain is recorded as begun but S3 has nothing. ``relaunch``
prints its transfer records as one JSON list. The S3 endpoint and keys come from the environment.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

import torch
from lightning_stand_in import stand_in_for_lightning

from s3_checkpoint_io import S3CheckpointIO
from s3_memory_tier import MemoryTier


def main() -> None:
    stand_in_for_lightning()  # no Trainer here: S3CheckpointIO need not import Lightning (lightning_stand_in.py)
    mode = sys.argv[1]
    if mode in ("save", "save-remove"):
        url, root, job, seed = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
        plugin = S3CheckpointIO(memory_tier=MemoryTier(root=root, job=job))
        key = url.split("/", 3)[3]
        uploading, removed = threading.Event(), threading.Event()

        def before_call(model: object, params: dict[str, object], **_: object) -> None:
            path = str(params.get("url_path", ""))  # the checkpoint's object, not the owner record
            target = path.endswith(key) or path.endswith(key.replace("=", "%3D"))
            if target and getattr(model, "name", "") in ("PutObject", "CreateMultipartUpload"):
                uploading.set()
                if mode == "save-remove":
                    removed.wait(60)  # the main thread asks for the removal meanwhile
                os.kill(os.getpid(), signal.SIGKILL)

        plugin.s3.client.meta.events.register("before-call.s3", before_call)
        state = {"weight": torch.randn(1 << 16, generator=torch.Generator().manual_seed(seed)), "global_step": seed}
        plugin.save_checkpoint(state, url)
        if mode == "save-remove":
            uploading.wait(60)
            plugin.remove_checkpoint(url)  # as top-k or the "-last" clean-up does while the drain runs
            removed.set()
        plugin.teardown()  # waits for the drain, which kills this process
        print("not killed", flush=True)
        sys.exit(3)
    root, job = sys.argv[2], sys.argv[3]
    plugin = S3CheckpointIO(memory_tier=MemoryTier(root=root, job=job))
    plugin.node_tier()
    plugin.teardown()
    print(json.dumps([[r.kind, r.url, r.size, r.checksum, r.tier] for r in plugin.records]), flush=True)


if __name__ == "__main__":
    main()
