"""Checksum arithmetic: parts checksummed in parallel must combine to the whole object's checksum."""

from __future__ import annotations

import base64
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s3_utils import _CHECKSUMS

ALGORITHMS = sorted(_CHECKSUMS)


@pytest.mark.parametrize("name", ALGORITHMS)
@given(first=st.binary(max_size=3000), second=st.binary(max_size=3000))
@settings(max_examples=50, deadline=None)
def test_combine_equals_checksum_of_concatenation(name: str, first: bytes, second: bytes) -> None:
    algorithm = _CHECKSUMS[name]
    combined = algorithm.combine(algorithm.update(first, 0), algorithm.update(second, 0), len(second))
    assert combined == algorithm.update(first + second, 0)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_combine_over_many_large_parts(name: str) -> None:
    algorithm = _CHECKSUMS[name]
    parts = [os.urandom(5 * 1024 * 1024) for _ in range(3)] + [os.urandom(12345)]
    total = algorithm.update(parts[0], 0)
    for part in parts[1:]:
        total = algorithm.combine(total, algorithm.update(part, 0), len(part))
    assert total == algorithm.update(b"".join(parts), 0)


# The "check" values of the CRC catalogue (checksum of b"123456789"), and S3's encoding: base64 of big-endian bytes.
@pytest.mark.parametrize(
    ("name", "check", "nbytes"),
    [("CRC32", 0xCBF43926, 4), ("CRC32C", 0xE3069283, 4), ("CRC64NVME", 0xAE8B14860A799888, 8)],
)
def test_catalogue_check_values_and_s3_encoding(name: str, check: int, nbytes: int) -> None:
    algorithm = _CHECKSUMS[name]
    assert algorithm.update(b"123456789", 0) == check
    assert algorithm.encode(check) == base64.b64encode(check.to_bytes(nbytes, "big")).decode()
