"""Test-only stand-ins for what megatron-core needs but this suite does not install.

``import megatron.core`` reaches ``import triton`` through one leaf module (``megatron.core.transformer.moe.ops
.paged_stash``, MoE kernels no checkpoint code calls). Where triton is not installed, that leaf is replaced in
``sys.modules`` by a module with the same names whose kernels refuse to run. A fake top-level ``triton`` would break
torch (``torch._inductor`` imports ``triton.backends`` when it finds one), so only the leaf is stood in for.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any

PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


def _kernel(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("triton is not installed: the MoE paged-stash kernels are stood in for by the test suite")


def stand_in_for_triton_leaf() -> bool:
    """Put the stand-in leaf in ``sys.modules`` unless triton is installed (or it is there already); True if it was
    put there by this call."""
    if PAGED_STASH in sys.modules or importlib.util.find_spec("triton") is not None:
        return False
    leaf = types.ModuleType(PAGED_STASH, "stand-in: triton is not installed (tests/helpers/mcore_stub.py)")
    leaf.GLOBAL_BLOCK_SIZE = 1024  # type: ignore[attr-defined]
    leaf.paged_stash_copy_kernel = _kernel  # type: ignore[attr-defined]
    leaf.paged_stash_pop_kernel = _kernel  # type: ignore[attr-defined]
    sys.modules[PAGED_STASH] = leaf
    return True


def megatron_core_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:
        return False


@contextlib.contextmanager
def cuda_calls_of_megatron_core() -> Iterator[None]:
    """megatron-core's own CUDA calls on a machine without CUDA: its async queue (``torch.cuda.synchronize`` before it
    forks, a ``current_device()`` tensor for its all-reduces) and its local writer's ``synchronize``. Only for those:
    this package's S3 path runs without it. Does nothing where CUDA is available."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved
