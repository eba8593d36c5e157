"""A load from the memory tier reads the copy's bytes for verification once, and still verifies them.

The fast paths (a large file checksummed in segments at once; a resume whose decision already verified the copy not
reading it again) are compared with the reference paths (one pass over the file; a load from S3) on the same bytes.
Tiers live under tmp_path, S3 is the suite's server.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

import connector
import s3_memory_tier
import s3_utils
from s3_checkpoint_io import S3CheckpointIO
from s3_memory_tier import MemoryTier, file_checksum


@pytest.mark.parametrize("algorithm", ["CRC32C", "CRC32"])
def test_a_file_checksummed_in_segments_at_once_matches_one_pass(tmp_path: Path, algorithm: str) -> None:
    segment = 4096
    checksums = s3_utils.ChecksumAlgorithm.named(algorithm)
    rng = random.Random(7)
    for size in (0, 1, segment - 1, segment, segment + 1, 3 * segment + 7):
        data = bytearray(rng.randbytes(size))
        path = tmp_path / f"f{size}"
        path.write_bytes(data)
        reference = (size, f"{algorithm} {checksums.encode(s3_utils.checksum_of(checksums, data))}")
        assert file_checksum(path, algorithm, segment) == reference == file_checksum(path, algorithm, 1 << 40)
        for where in range(0, size, segment):  # a flipped byte in any segment changes the checksum
            flipped = bytearray(data)
            flipped[where + (min(segment, size - where) - 1)] ^= 0x01
            path.write_bytes(flipped)
            assert file_checksum(path, algorithm, segment) != reference


def make_checkpoint(step: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    weights = OrderedDict(weight=torch.randn(1 << 18, generator=generator), bias=torch.arange(7.0) + step)
    return {"state_dict": weights, "global_step": step}


def assert_same(loaded: dict[str, Any], expected: dict[str, Any]) -> None:
    assert loaded["global_step"] == expected["global_step"]
    assert loaded["state_dict"].keys() == expected["state_dict"].keys()
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(loaded["state_dict"][name], tensor), name


def flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as stream:
        stream.seek(path.stat().st_size // 2)
        byte = stream.read(1)
        stream.seek(-1, os.SEEK_CUR)
        stream.write(bytes([byte[0] ^ 0xFF]))


def test_a_resume_reads_each_memory_copy_once_and_loads_what_s3_loads(
    s3_server: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    directory = f"s3://{bucket}/run"
    saver = S3CheckpointIO(memory_tier=MemoryTier(root=str(tmp_path), job="j", drain_every=1))
    states = {step: make_checkpoint(step) for step in (1, 2)}
    for step, state in states.items():
        saver.save_checkpoint(state, f"{directory}/step={step}-last.ckpt")
    saver.teardown()  # both on S3 too: the reference path loads them from there

    read: list[str] = []
    one_pass = s3_memory_tier.file_checksum

    def counted(path: Path | str, *args: Any, **kwargs: Any) -> tuple[int, str]:
        read.append(Path(path).name)
        return one_pass(path, *args, **kwargs)

    monkeypatch.setattr(s3_memory_tier, "file_checksum", counted)
    url = f"{directory}/step=2-last.ckpt"
    relaunch = S3CheckpointIO(memory_tier=MemoryTier(root=str(tmp_path), job="j"))
    agreement = relaunch.agree_resume(directory, connector.checkpoint_step)
    assert (agreement.step, agreement.url, agreement.tier) == (2, url, "memory")
    assert sorted(read) == ["step=1-last.ckpt", "step=2-last.ckpt"]  # each copy once, for the decision
    fast = relaunch.load_checkpoint(url)
    assert relaunch.records[-1].tier == "memory"
    assert sorted(read) == ["step=1-last.ckpt", "step=2-last.ckpt"]  # not read again by the load
    reference = S3CheckpointIO().load_checkpoint(url)
    assert_same(fast, states[2])
    assert_same(reference, states[2])

    relaunch.load_checkpoint(url)  # the decision's verification counts for one load; a later one verifies again
    assert sorted(read) == ["step=1-last.ckpt", "step=2-last.ckpt", "step=2-last.ckpt"]

    relaunch.agree_resume(directory, connector.checkpoint_step)
    time.sleep(0.05)  # file times move with the kernel's coarse clock: a change in the same tick would not show
    flip_a_byte(relaunch.node_tier().path_of(url))  # changed after the decision verified it
    with caplog.at_level(logging.ERROR):
        assert_same(relaunch.load_checkpoint(url), states[2])
    assert relaunch.records[-1].tier == "s3"
    assert any("does not match its commit record" in r.getMessage() for r in caplog.records)
