"""Checksum arithmetic: parts checksummed in parallel must combine to the whole object's checksum."""

from __future__ import annotations

import base64
import itertools
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s3_utils import _CHECKSUMS, _piece_checksums, combine_checksums

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


@pytest.mark.parametrize("name", ALGORITHMS)
@given(
    first=st.integers(min_value=0),
    second=st.integers(min_value=0),
    second_length=st.integers(min_value=1, max_value=2**40),  # checksums of real pieces: only b"" has length 0
)
@settings(max_examples=200, deadline=None)
def test_gf2_fallback_agrees_with_awscrt_combine(name: str, first: int, second: int, second_length: int) -> None:
    """The GF(2) code serves where awscrt (>= 0.31, with ``combine_*``) is missing; both must give the same value."""
    checksums = pytest.importorskip("awscrt.checksums")
    crt_combine = getattr(checksums, f"combine_{name.lower()}", None)
    if crt_combine is None:
        pytest.skip(f"awscrt {getattr(checksums, '__version__', '')} has no combine_{name.lower()} (needs >= 0.31)")
    algorithm = _CHECKSUMS[name]
    mask = (1 << (8 * algorithm.nbytes)) - 1
    first, second = first & mask, second & mask
    assert algorithm.combine_gf2(first, second, second_length) == crt_combine(first, second, second_length)


@pytest.mark.parametrize("name", ALGORITHMS)
@given(pieces=st.lists(st.binary(max_size=2000), max_size=6))
@settings(max_examples=50, deadline=None)
def test_fold_of_piece_checksums_is_the_checksum_of_the_whole(name: str, pieces: list[bytes]) -> None:
    algorithm = _CHECKSUMS[name]
    folded = combine_checksums(algorithm, [(algorithm.update(piece, 0), len(piece)) for piece in pieces])
    assert folded == algorithm.update(b"".join(pieces), 0)


def test_awscrt_functions_are_resolved_once() -> None:
    checksums = pytest.importorskip("awscrt.checksums")
    algorithm = _CHECKSUMS["CRC32C"]
    algorithm.update(b"x", 0)
    algorithm.combine(1, 2, 3)
    assert algorithm._update is checksums.crc32c  # later blocks call awscrt directly, no import per block
    assert algorithm._combine is getattr(checksums, "combine_crc32c", algorithm.combine_gf2)


@pytest.mark.parametrize("name", ALGORITHMS)
@given(data=st.binary(max_size=4000), cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=8))
@settings(max_examples=50, deadline=None)
def test_pieces_between_cuts_combine_to_the_checksum_of_every_span(name: str, data: bytes, cuts: list[int]) -> None:
    """What the streaming writer computes per part (pieces split at marked boundaries) folds back into the checksum of
    the part, and of any span between boundaries, exactly as a second pass over those bytes would give."""
    algorithm = _CHECKSUMS[name]
    cuts = sorted({cut for cut in cuts if 0 < cut < len(data)})
    pieces = _piece_checksums(algorithm, memoryview(data), cuts)
    bounds = [0, *cuts, len(data)]
    assert [length for _, length in pieces] == [b - a for a, b in itertools.pairwise(bounds) if b > a]
    assert combine_checksums(algorithm, pieces) == algorithm.update(data, 0)
    for first in range(len(pieces)):
        for last in range(first, len(pieces)):
            span = data[bounds[first] : bounds[last + 1]]
            assert combine_checksums(algorithm, pieces[first : last + 1]) == algorithm.update(span, 0)
