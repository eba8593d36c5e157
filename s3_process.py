"""This process: the optional packages and sibling files it has, and which rank of which job on which node it is.

A core file, standard library only, the first that every other module of the package imports (after
s3_dirpath_utils): what each of them asks of the process it runs in, answered in one place. Two parts:

1. Optional dependencies and sibling modules: `import_optional_dependency` (an ImportError that names the
   ``pip install`` line, `MissingOptionalDependencyError`), `import_sibling` / `require_sibling` (a module beside this
   one, in a package or copied into a fork), `node_sharing` (the optional s3_node_sharing).
2. Which process: `global_rank`, `world_size`, `node_key`, `job_key`, from torch.distributed once its process group
   is up, else from the launcher's environment (`LAUNCHER_ENV_VARS`: torchrun, SLURM, Open MPI, MPICH/PMIx).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import types
from collections.abc import Mapping
from typing import Any

__all__ = ["MissingOptionalDependencyError"]

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------------------------
# Optional dependencies and sibling modules
# --------------------------------------------------------------------------------------------------------------------

_INSTALL_HINTS: dict[str, tuple[str, str]] = {  # import name: (distribution, the command that fixes it)
    "boto3": ("boto3", 'pip install "s3-checkpoint-io[s3]"'),
    "botocore": ("botocore", 'pip install "s3-checkpoint-io[s3]"'),
    "s3transfer": ("s3transfer", 'pip install "s3-checkpoint-io[s3]"'),
    "awscrt": ("awscrt (boto3[crt])", 'pip install "s3-checkpoint-io[s3]"'),
    "s3fs": ("s3fs", 'pip install "s3-checkpoint-io[s3]"'),
    "lightning": ("lightning", 'pip install "s3-checkpoint-io[lightning]"'),
    "pytorch_lightning": ("pytorch_lightning", 'pip install "s3-checkpoint-io[lightning]"'),
    "torch": ("torch", "pip install torch  (pick the build for your hardware at https://pytorch.org)"),
}


class MissingOptionalDependencyError(ImportError):
    """A feature needs an optional package that is not installed; the message says how to install it."""


def import_optional_dependency(name: str, feature: str = "") -> types.ModuleType:
    """Import `name` (a module, e.g. ``"boto3"`` or ``"s3transfer.crt"``) or explain which extra provides it.
    Package-internal (docs/api.md)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        top = name.split(".")[0]
        package, command = _INSTALL_HINTS.get(top, (top, f"pip install {top}"))
        purpose = f" for {feature}" if feature else ""
        raise MissingOptionalDependencyError(
            f"s3-checkpoint-io needs the optional package '{package}'{purpose}, but it could not be imported "
            f"({exc}). Install it with: {command}",
            name=top,
        ) from exc


def optional_module(name: str) -> types.ModuleType | None:
    """The module `name`, or None where it cannot be imported (a package this process may lack). Package-internal
    (docs/api.md)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def import_sibling(name: str, package: str | None) -> types.ModuleType | None:
    """The module `name` from beside the caller, imported now: ``package.name`` inside a package (pass the caller's
    ``__package__``, which differs per copy: ``nemo.utils`` in a fork), else the top-level module `name`. None where
    that file is absent (a fork copied only some files); one that is there but fails to import raises as usual. What
    an absent sibling means (a feature off, or an error naming the file) is the caller's to say.
    Package-internal (docs/api.md)."""
    full = f"{package}.{name}" if package else name
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError as exc:
        if exc.name != full:
            raise
        return None


def require_sibling(name: str, package: str | None, feature: str, caller: str, *, needs: tuple[str, ...] = (),
                    otherwise: str = "") -> types.ModuleType:  # fmt: skip
    """`import_sibling`, or the ImportError for a file a fork lacks: "`feature` needs X.py beside `caller` (...): copy
    it there`otherwise`", X being `name` or one of the siblings it imports at its top (`needs`). Package-internal
    (docs/api.md)."""
    try:
        module, missing = import_sibling(name, package), name
    except ModuleNotFoundError as exc:
        module, missing = None, (exc.name or "").rsplit(".", 1)[-1]
        if missing not in needs:
            raise
    if module is None:
        raise ImportError(f"{feature} needs {missing}.py beside {caller} (part of s3-checkpoint-io; a fork that copied "
                          f"only some files lacks it): copy it there{otherwise}")
    return module


NODE_SHARING_MODULE = "s3_node_sharing"  # the optional sibling module with what a host's processes share
_node_sharing: list[types.ModuleType | None] = []  # the import's outcome, once known
_node_sharing_warned = False


def node_sharing() -> types.ModuleType | None:
    """`s3_node_sharing` from beside this module, imported on first use; None (warned once in a job) where absent.
    Package-internal (docs/api.md)."""
    global _node_sharing_warned
    if not _node_sharing:
        _node_sharing.append(import_sibling(NODE_SHARING_MODULE, __package__))
    module = _node_sharing[0]
    processes = 1 if module is not None or _node_sharing_warned else world_size()
    if processes > 1:
        _node_sharing_warned = True
        logger.warning(
            "This job has %d processes, but %s.py is not beside s3_utils.py in %s: each process paces its S3 requests "
            "on its own and every rank downloads the checkpoints it loads (no load_sharing='node' or 'job'). Copy "
            "%s.py from s3-checkpoint-io beside s3_utils.py (or pip install s3-checkpoint-io) for multi-node scale.",
            *(processes, NODE_SHARING_MODULE, os.path.dirname(os.path.abspath(__file__)), NODE_SHARING_MODULE),
        )
    return module



# --------------------------------------------------------------------------------------------------------------------
# This process: which rank of which job on which node
# --------------------------------------------------------------------------------------------------------------------
#
# torch.distributed answers once its process group is up (torch is never imported just to ask); before that (resume
# discovery runs first), the launcher's environment.

LAUNCHER_ENV_VARS: Mapping[str, tuple[str, ...]] = {
    "global_rank": ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"),
    "world_size": ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"),
    "node_rank": ("GROUP_RANK", "SLURM_NODEID", "NODE_RANK"),
    "local_rank": ("LOCAL_RANK",),
    "local_world_size": ("LOCAL_WORLD_SIZE",),
    "job": ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "MASTER_ADDR", "MASTER_PORT"),
}
"""The launcher variables each answer reads (torchrun, SLURM, Open MPI, MPICH/PMIx, MVAPICH): the first set wins."""


def _launcher_int(environ: Mapping[str, str], what: str, minimum: int = 0) -> int | None:
    """The first of `what`'s launcher variables that holds a whole number of at least `minimum`."""
    for name in LAUNCHER_ENV_VARS[what]:
        with contextlib.suppress(ValueError):
            value = int(environ.get(name, "").strip())
            if value >= minimum:
                return value
    return None


def _process_group() -> Any:
    distributed = getattr(sys.modules.get("torch"), "distributed", None)
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return distributed
    return None


def global_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank: torch.distributed's, else the launcher's (or node and local rank), else 0.
    Package-internal (docs/api.md)."""
    if environ is None:
        group = _process_group()
        if group is not None:
            return int(group.get_rank())
        environ = os.environ
    rank = _launcher_int(environ, "global_rank")
    if rank is not None:
        return rank
    node_rank = _launcher_int(environ, "node_rank") or 0
    local_rank = _launcher_int(environ, "local_rank") or 0
    local_world_size = _launcher_int(environ, "local_world_size") or 1
    return node_rank * max(local_world_size, local_rank + 1) + local_rank


def world_size(environ: Mapping[str, str] | None = None) -> int:
    """The job's process count: torch.distributed's, else the launcher's environment, else 1. Package-internal
    (docs/api.md)."""
    if environ is None:
        group = _process_group()
        if group is not None:
            return max(1, int(group.get_world_size()))
        environ = os.environ
    return _launcher_int(environ, "world_size", minimum=1) or 1


def node_key(node_rank: int | None = None, environ: Mapping[str, str] | None = None) -> str:
    """A label equal on every process of this node: the node rank given or the launcher's, else host and boot id.
    Package-internal (docs/api.md)."""
    if node_rank is not None:
        return f"node {node_rank}"
    environ = os.environ if environ is None else environ
    for name in LAUNCHER_ENV_VARS["node_rank"]:
        if environ.get(name, "").strip():
            return f"node {environ[name].strip()} ({name})"
    boot_id = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as stream:
        boot_id = stream.read().strip()
    return f"host {os.uname().nodename} {boot_id}"


def job_key(environ: Mapping[str, str] | None = None) -> str | None:
    """What tells this job apart from others on the host (`LAUNCHER_ENV_VARS` ``job``); None outside any launcher.
    Package-internal (docs/api.md)."""
    environ = os.environ if environ is None else environ
    values = [environ.get(name, "").strip() for name in LAUNCHER_ENV_VARS["job"]]
    return "|".join(values) if any(values) else None
