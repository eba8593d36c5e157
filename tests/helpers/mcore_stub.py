"""Test-only stand-ins for what megatron-core needs but this suite does not install.

``import megatron.core`` reaches ``import triton`` through one leaf module (``megatron.core.transformer.moe.ops
.paged_stash``, MoE kernels no checkpoint code calls). Where triton is not installed, that leaf is replaced in
``sys.modules`` by a module with the same names whose kernels refuse to run. A fake top-level ``triton`` would break
torch (``torch._inductor`` imports ``triton.backends`` when it finds one), so only the leaf is stood in for.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"
"""The leaf that imports triton in megatron-core 0.19; 0.16-0.18 import it one level up, in ``moe.paged_stash``."""
PAGED_STASH_BEFORE_0_19 = "megatron.core.transformer.moe.paged_stash"


def _kernel(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("triton is not installed: the MoE paged-stash code is stood in for by the test suite")


def _any_kernel(attribute: str) -> Any:
    if attribute.startswith("__"):
        raise AttributeError(attribute)
    return _kernel


def _triton_leaf() -> str:
    """Which module imports triton in the installed megatron-core (found by file, without importing megatron.core)."""
    spec = importlib.util.find_spec("megatron")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if os.path.isdir(os.path.join(folder, "core")):  # the megatron.core that `import` finds first
            if os.path.exists(os.path.join(folder, "core", "transformer", "moe", "ops", "paged_stash.py")):
                return PAGED_STASH
            break
    return PAGED_STASH_BEFORE_0_19


def stand_in_for_triton_leaf() -> bool:
    """Put the stand-in leaf in ``sys.modules`` unless triton is installed (or it is there already); True if it was
    put there by this call. Any name imported from it is a function that refuses to run."""
    if importlib.util.find_spec("triton") is not None:
        return False
    name = _triton_leaf()
    if name in sys.modules:
        return False
    leaf = types.ModuleType(name, "stand-in: triton is not installed (tests/helpers/mcore_stub.py)")
    leaf.GLOBAL_BLOCK_SIZE = 1024  # type: ignore[attr-defined]
    leaf.__getattr__ = _any_kernel  # type: ignore[method-assign]
    sys.modules[name] = leaf
    return True


TENSORSTORE_STRATEGY = "megatron.core.dist_checkpointing.strategies.tensorstore"
"""megatron-core's zarr/tensorstore strategy, gone since 0.16. NeMo 2.7.3's ``nemo.utils.callbacks.dist_ckpt_io``
imports it with the rest of megatron-core in one ``try``: without it that module decides megatron-core is missing,
and ``AsyncFinalizableCheckpointIO`` refuses to be built ("megatron-core was not found")."""


def stand_in_for_removed_tensorstore_strategy() -> bool:
    """Put an empty `TENSORSTORE_STRATEGY` module in place where the installed megatron-core has none (call before
    NeMo is imported); True if it was put there by this call. Only NeMo's zarr format would use it."""
    import megatron.core.dist_checkpointing.strategies as strategies

    if TENSORSTORE_STRATEGY in sys.modules or importlib.util.find_spec(TENSORSTORE_STRATEGY) is not None:
        return False
    leaf = types.ModuleType(TENSORSTORE_STRATEGY, "stand-in: gone since megatron-core 0.16 (mcore_stub.py)")
    sys.modules[TENSORSTORE_STRATEGY] = leaf
    strategies.tensorstore = leaf  # type: ignore[attr-defined]
    return True


def nemo_importable() -> str:
    """'' if NeMo 2.x's ``nemo.lightning.io.pl`` imports here (megatron-core's stand-ins in place), else why not."""
    try:
        if importlib.util.find_spec("nemo") is None:
            return "nemo-toolkit is not installed (see `make nemo-check`)"
    except ImportError as exc:
        return f"nemo-toolkit cannot be found: {exc}"
    stand_in_for_triton_leaf()
    try:
        stand_in_for_removed_tensorstore_strategy()
        importlib.import_module("nemo.lightning.io.pl")
        importlib.import_module("nemo.utils.callbacks.dist_ckpt_io")
    except Exception as exc:
        return f"nemo.lightning.io.pl does not import: {type(exc).__name__}: {exc}"
    return ""


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
