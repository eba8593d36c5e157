"""What turns torch's own DCP file-system checkpoint tests (vendored beside this module) into tests of `s3_dcp`.

Each vendored module imports ``FileSystemWriter`` / ``FileSystemReader`` (and ``FsspecWriter`` / ``FsspecReader``)
from here: they are `s3_dcp.S3StorageWriter` / `S3StorageReader`, the storage a DCP user puts on ``s3://``. Its
``TestCase`` is a plain class (pytest's, so that the suite's fixtures reach it) with the assertion methods of torch's
``TestCase``; the conftest gives each test a fresh bucket, and `s3_prefix` / `with_temp_dir` hand out an
``s3://bucket/<n>`` prefix where torch's tests make a temporary directory. torch's ``parametrize`` is pytest's.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from torch.testing._internal.common_utils import TestCase as _TorchTestCase

from s3_dcp import S3StorageReader, S3StorageWriter

FileSystemWriter = FsspecWriter = S3StorageWriter
FileSystemReader = FsspecReader = S3StorageReader

_prefixes = itertools.count()
TORCH_TEST_SEED = 1234  # torch.testing._internal.common_utils.SEED's default

parametrize = pytest.mark.parametrize
"""torch's ``parametrize`` (its methods are made by `instantiate_parametrized_tests`) as pytest's."""


def instantiate_parametrized_tests(cls: type) -> type:
    """Nothing to make: `parametrize` is pytest's."""
    return cls


class TestCase:
    """torch's ``TestCase`` assertions (``assertEqual`` compares tensors, ...) on a class pytest runs with fixtures;
    ``bucket`` is set by the conftest before each test."""

    bucket: str

    def __getattr__(self, name: str) -> Any:
        if name.startswith("assert") or name in ("fail", "subTest"):
            return getattr(_TorchTestCase("__init__"), name)
        raise AttributeError(name)


@contextlib.contextmanager
def s3_prefix(test: TestCase) -> Iterator[str]:
    """A fresh ``s3://`` prefix in the test's bucket, where torch's test makes a temporary directory."""
    yield f"s3://{test.bucket}/ckpt-{next(_prefixes)}"


def with_temp_dir(func: Callable[..., None]) -> Callable[..., None]:
    """torch's ``with_temp_dir``: ``self.temp_dir`` is a fresh ``s3://`` prefix (one process: nothing to broadcast)."""

    @functools.wraps(func)
    def wrapper(self: TestCase, *args: Any, **kwargs: Any) -> None:
        with s3_prefix(self) as path:
            self.temp_dir = path
            func(self, *args, **kwargs)

    return wrapper


def with_comms(init_rpc: bool = False, backend: str = "gloo") -> Callable[[Callable[..., None]], Callable[..., None]]:
    """torch's ``with_comms`` for ``ShardedTensorTestBase`` (which spawns its ranks per test): the test method runs in
    ``self.world_size`` spawned processes with a gloo group, each its own instance with this test's ``bucket``; the
    S3 endpoint travels in the environment. A rank's failure fails the test."""
    if init_rpc or backend != "gloo":
        raise ValueError("only gloo process groups without RPC run here")

    def decorate(func: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(func)
        def wrapper(self: TestCase, *args: Any, **kwargs: Any) -> None:
            import torch.multiprocessing as mp

            cls = type(self)
            with tempfile.TemporaryDirectory() as rendezvous:
                mp.start_processes(
                    _run_rank,
                    args=(
                        cls.__module__,
                        cls.__qualname__,
                        func.__name__,
                        self.bucket,
                        self.world_size,
                        os.path.join(rendezvous, "store"),
                        args,
                        kwargs,
                    ),
                    nprocs=self.world_size,
                    start_method="spawn",
                )

        return wrapper

    return decorate


def _run_rank(
    rank: int,
    module: str,
    qualname: str,
    method: str,
    bucket: str,
    world_size: int,
    store: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    import torch
    import torch.distributed as dist

    torch.manual_seed(TORCH_TEST_SEED)  # as torch's TestCase.setUp: replicated tensors are the same on every rank
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        cls: Any = importlib.import_module(module)
        for name in qualname.split("."):
            cls = getattr(cls, name)
        instance = cls()
        instance.bucket = bucket
        getattr(cls, method).__wrapped__(instance, *args, **kwargs)
        dist.barrier()
    finally:
        dist.destroy_process_group()
