"""Fixtures for torch's own DCP tests run on ``s3://`` (tests/README.md, "torch's own DCP tests"): one backend (the
suite's first; the store is not what they test), a fresh bucket per test, handed to the test class."""

from __future__ import annotations

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
