"""For worker processes that use `S3CheckpointIO` without a Trainer: a bare ABC stands in for Lightning's
``CheckpointIO``, so the process does everything but import Lightning.

`S3CheckpointIO` registers itself with every installed Lightning family when it is constructed
(`s3_checkpoint_io.register_with_lightning`): that import costs each process about 3 s of CPU beyond torch's (9 s
wall on this shared machine under load), and a test starts such workers by the dozen. Nothing these workers check
depends on Lightning being imported; where a Trainer runs (ddp_worker, load_sharing_worker's trainer and save modes,
the DCP and NeMo Lightning workers), Lightning is imported for real.

Call `stand_in_for_lightning` before the first `S3CheckpointIO` is built (a worker started as a script has this
directory on ``sys.path``).
"""

from __future__ import annotations

import abc
import sys
import types

CHECKPOINT_IO_MODULE = "lightning.fabric.plugins.io.checkpoint_io"
STANDALONE_PACKAGES = ("lightning_fabric", "pytorch_lightning")


def stand_in_for_lightning() -> None:
    """Put a module with a bare ``CheckpointIO`` ABC where `S3CheckpointIO` registers itself, and mark Lightning's
    standalone packages as not installed; a no-op for what this process imported already."""
    stand_in = types.ModuleType(CHECKPOINT_IO_MODULE)
    stand_in.CheckpointIO = type("CheckpointIO", (abc.ABC,), {})  # type: ignore[attr-defined]
    sys.modules.setdefault(CHECKPOINT_IO_MODULE, stand_in)
    for name in STANDALONE_PACKAGES:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
