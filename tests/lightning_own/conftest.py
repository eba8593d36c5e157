"""Fixtures for Lightning's own checkpoint tests run on ``s3://`` (tests/README.md, "Lightning's own tests").

Every test here runs with a sync and an async `S3CheckpointIO` (``s3_mode``; `FULL`), on the suite's first S3 backend
(what these tests check is Lightning's behaviour over this package, not the store), in a fresh bucket: ``tmp_path``
is an `s3_adapt.S3Path` there and ``local_tmp_path`` is pytest's own ``tmp_path`` for what a test keeps on the local
disk. The last part vendors the few autouse fixtures of Lightning's tests/tests_pytorch/conftest.py (Apache-2.0,
Lightning 2.6.5) that keep one test's process state from leaking into the next.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import BACKENDS
from packaging.version import Version

import lightning.pytorch as pl  # isort: skip
import s3_fencing
from lightning_own import s3_adapt

LIGHTNING_VERSION = Version(pl.__version__)
MIN_LIGHTNING = Version("2.6")  # the tests come from Lightning 2.6.5 and test what 2.6 does (save_on_exception, ...)

if LIGHTNING_VERSION < MIN_LIGHTNING:
    # Their modules import what Lightning 2.4 does not have: each file is reported as one skip instead.
    class _SkippedModule(pytest.File):
        def collect(self) -> Iterator[pytest.Item]:
            yield _SkippedItem.from_parent(self, name="lightning_2_6_tests")

    class _SkippedItem(pytest.Item):
        def runtest(self) -> None:
            pytest.skip(
                f"Lightning's own tests vendored from Lightning 2.6.5 test 2.6's behaviour; this is lightning "
                f"{LIGHTNING_VERSION}"
            )

    def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
        if module_path.name.startswith("test_"):
            return _SkippedModule.from_parent(parent, path=module_path)
        return None


FULL = os.environ.get("S3CKPT_OWN_TESTS_FULL") == "1"
"""Run every test in both modes with every parameter set; by default the async mode leaves out `SYNC_ONLY` and runs
each test with its first parameter set only (the suite's time: the sync mode runs them all)."""

_SAVES_MOCKED = "its saves are mocks that count calls: the async mode runs the same code"
_SPAWN = (
    "two ddp_spawn ranks (~45 s a run here); the async run is left out of the default run for time "
    "(S3CKPT_OWN_TESTS_FULL=1 runs it)"
)
SYNC_ONLY = {
    "test_checkpoint_callback_frequency.py::test_default_checkpoint_freq": _SAVES_MOCKED,
    "test_checkpoint_callback_frequency.py::test_top_k": _SAVES_MOCKED,
    "test_torch_saving.py::test_model_torch_save_ddp_cpu": _SPAWN,
    "test_model_checkpoint.py::test_model_checkpoint_no_extraneous_invocations": _SPAWN,
}
"""Tests whose async run is skipped (with the reason): where the mode changes nothing, and, unless `FULL`, the
slowest, whose sync run covers what they check."""


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything here is a Lightning test (CI's second environment runs ``-m lightning``); `SYNC_ONLY`; the async
    mode's further parameter sets of a test deselected unless `FULL`."""
    here = Path(__file__).parent
    seen_async: set[tuple[str, str]] = set()  # (file, test) whose first async parameter set was kept
    repeats = []
    for item in items:
        if here not in Path(item.path).parents:
            continue
        item.add_marker(pytest.mark.lightning)
        callspec = getattr(item, "callspec", None)
        if callspec is None or callspec.params.get("s3_mode") != "async":
            continue
        test = (Path(item.path).name, item.originalname)
        reason = SYNC_ONLY.get("::".join(test))
        if reason is not None and (reason != _SPAWN or not FULL):
            item.add_marker(pytest.mark.skip(reason=f"async mode: {reason}"))
        elif test in seen_async and not FULL:
            repeats.append(item)
        seen_async.add(test)
    if repeats:  # the async mode's further parameter sets: what they vary, the sync mode covers
        config.hook.pytest_deselected(items=repeats)
        dropped = set(map(id, repeats))
        items[:] = [item for item in items if id(item) not in dropped]


@pytest.fixture(scope="session", params=BACKENDS[:1])
def s3_server(s3_server: Any) -> Any:
    """The suite's first backend only: the store under these tests is not what they test."""
    return s3_server


@pytest.fixture(params=s3_adapt.MODES, autouse=True)
def s3_mode(
    request: pytest.FixtureRequest, s3_server: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """The test runs with a sync or an async `S3CheckpointIO` (every `s3_adapt.Trainer` gets one); the default
    ``ModelCheckpoint`` Lightning adds is an `S3ModelCheckpoint`; pending saves are finished when the test ends,
    before its `bucket` (a parameter here so that it is deleted after them) goes."""
    from lightning.pytorch.trainer.connectors import callback_connector

    monkeypatch.setattr(callback_connector, "ModelCheckpoint", s3_adapt.ModelCheckpoint)
    run = s3_fencing.current_run()
    try:
        with s3_adapt.running_test(s3_server.client(), request.param):
            yield request.param
    finally:
        # One test's run does not become the next one's (S3ModelCheckpoint.setup adopts its plugin's run process-wide).
        s3_fencing.adopt_run(run)


@pytest.fixture
def local_tmp_path(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """pytest's ``tmp_path``: a fresh local directory, for what a test keeps on the local disk."""
    return tmp_path_factory.mktemp(request.node.name[:30].replace("[", "-").replace("]", ""))


@pytest.fixture
def tmp_path(bucket: str) -> s3_adapt.S3Path:
    """The test's directory is an S3 prefix in a fresh bucket: ``s3://<bucket>/tmp``."""
    return s3_adapt.S3Path(f"s3://{bucket}/tmp")


@pytest.fixture
def tmpdir(tmp_path: s3_adapt.S3Path) -> s3_adapt.S3Path:
    """py.path's ``tmpdir`` is the same S3 prefix (the tests use it as a str or with ``/``)."""
    return tmp_path


@pytest.fixture(autouse=True)
def _local_working_directory(local_tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests that give no ``default_root_dir`` write Lightning's logs to the working directory: a local tmp one."""
    monkeypatch.chdir(local_tmp_path)


# ---- vendored from Lightning 2.6.5's tests/tests_pytorch/conftest.py (Apache-2.0) -----------------------------------
# Copyright The Lightning AI team. Licensed under the Apache License, Version 2.0.


@pytest.fixture(autouse=True)
def preserve_global_rank_variable() -> Iterator[None]:
    """Ensures that the rank_zero_only.rank global variable gets reset in each test."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only as rank_zero_only_fabric
    from lightning.pytorch.utilities.rank_zero import rank_zero_only as rank_zero_only_pytorch
    from lightning_utilities.core.rank_zero import rank_zero_only as rank_zero_only_utilities

    functions = (rank_zero_only_pytorch, rank_zero_only_fabric, rank_zero_only_utilities)
    ranks = [getattr(fn, "rank", None) for fn in functions]
    yield
    for fn, rank in zip(functions, ranks, strict=True):
        if rank is not None:
            fn.rank = rank


@pytest.fixture(autouse=True)
def restore_env_variables() -> Iterator[None]:
    """Ensures that environment variables set during the test do not leak out."""
    # s3: restores only (Lightning's also fails a test that leaks a variable outside its allowlist)
    env_backup = os.environ.copy()
    yield
    os.environ.clear()
    os.environ.update(env_backup)


@pytest.fixture(autouse=True)
def restore_signal_handlers() -> Iterator[None]:
    """Ensures that signal handlers get restored before the next test runs."""
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    valid_signals = _SignalConnector._valid_signals() - {signal.SIGKILL, signal.SIGSTOP}
    handlers = {signum: signal.getsignal(signum) for signum in valid_signals}
    yield
    for signum, handler in handlers.items():
        if handler is not None:
            signal.signal(signum, handler)


@pytest.fixture(autouse=True)
def teardown_process_group() -> Iterator[None]:
    """Ensures that the distributed process group gets closed before the next test runs."""
    from lightning.fabric.utilities.distributed import _destroy_dist_connection

    yield
    _destroy_dist_connection()


@pytest.fixture(autouse=True)
def reset_deterministic_algorithm() -> Iterator[None]:
    """Ensures that torch determinism settings are reset before the next test runs."""
    import torch

    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture
def caplog(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Workaround for https://github.com/pytest-dev/pytest/issues/3697: lightning.pytorch's loggers propagate."""
    root_logger = logging.getLogger()
    root_propagate = root_logger.propagate
    root_logger.propagate = True
    propagation_dict = {
        name: logging.getLogger(name).propagate
        for name in logging.root.manager.loggerDict
        if name.startswith("lightning.pytorch")
    }
    for name in propagation_dict:
        logging.getLogger(name).propagate = True
    yield caplog
    root_logger.propagate = root_propagate
    for name, propagate in propagation_dict.items():
        logging.getLogger(name).propagate = propagate


@pytest.fixture
def xla_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's fixture: XLA looks available (for a test of what the Trainer passes to its plugin)."""
    import lightning.fabric

    for module in (
        pl.strategies.xla,
        pl.strategies.single_xla,
        pl.plugins.precision.xla,
        pl.strategies.launchers.xla,
        lightning.fabric.accelerators.xla,
        lightning.fabric.plugins.environments.xla,
        lightning.fabric.plugins.io.xla,
        lightning.fabric.strategies.launchers.xla,
    ):
        monkeypatch.setattr(module, "_XLA_AVAILABLE", True)
