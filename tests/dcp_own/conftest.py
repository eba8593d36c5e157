"""Fixtures for torch's own DCP tests run on ``s3://`` (tests/README.md, "torch's own DCP tests"): one backend (the
suite's first; the store is not what they test), a fresh bucket per test, handed to the test class."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from conftest import BACKENDS


@pytest.fixture(scope="session", params=BACKENDS[:1])
def s3_server(s3_server: Any) -> Any:
    """The suite's first backend only."""
    return s3_server


@pytest.fixture(autouse=True)
def _s3_bucket(request: pytest.FixtureRequest, bucket: str) -> None:
    """The test's bucket, where `s3_dcp_adapt.s3_prefix` makes its checkpoint prefixes."""
    if request.instance is not None:
        request.instance.bucket = bucket


FULL = os.environ.get("S3CKPT_OWN_TESTS_FULL") == "1"
"""Run the two-rank tests with both of torch's thread counts; by default with 1 only (the suite's time)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Unless `FULL`, the two-rank tests' ``thread_count=2`` runs (about 30 s each here) are skipped: two files per
    rank are what the one-process tests' ``thread_count=2`` runs write too."""
    if FULL:
        return
    for item in items:
        callspec = getattr(item, "callspec", None)
        if Path(item.path).name == "test_file_system_checkpoint_2ranks.py" and callspec is not None:
            if callspec.params.get("thread_count") == 2:
                reason = "thread_count=2 with two ranks: left out for time (S3CKPT_OWN_TESTS_FULL=1 runs it)"
                item.add_marker(pytest.mark.skip(reason=reason))
