"""A kill at any instant of a save leaves the previous object or the new one, and either verifies.

Each case first saves version A of an object for real, then saves version B in a process that SIGKILLs itself just
before its Nth request (tests/helpers/crash_worker.py), for every N the save sends: every instant between two
requests, the commit (CompleteMultipartUpload / PUT) and the checksum record's PUT included. After the kill, a
verified download of the key must give A or B, whole, never a ChecksumMismatchError. moto is the interesting store:
it does not keep the full-object checksum of a multipart upload, so the object's integrity rests on the record.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import boto3
import botocore.config
import pytest

from s3_utils import CHECKSUM_SIDECAR_SUFFIX, ChecksumMismatchError, S3Utils

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "helpers" / "crash_worker.py"
MULTIPART = 11 * 2**20  # three parts at 5 MiB
SMALL = 4096  # one PUT


def save(url: str, size: int, fill: int, kill_before: int = -1, fence: bool = False) -> list[str] | None:
    """Run crash_worker; the operations it sent, or None when it was killed as asked."""
    command = [sys.executable, str(WORKER), url, str(size), str(fill), str(kill_before)]
    done = subprocess.run(
        command + (["--fence"] if fence else []), capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if kill_before >= 0 and done.returncode == -signal.SIGKILL:
        return None
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def content(url: str) -> tuple[int, int]:
    """(size, fill byte) of the object, downloaded and verified against its recorded checksum."""
    with S3Utils().download_to_memory(url) as downloaded:
        assert downloaded.verified_against is not None, f"{url} verified against no record"
        with downloaded.view() as view:
            data = bytes(view)
    assert data == bytes([data[0]]) * len(data), "a mix of two versions"
    return len(data), data[0]


@pytest.mark.parametrize(
    ("size", "fence"), [(MULTIPART, False), (MULTIPART, True), (SMALL, False)], ids=["multipart", "fenced", "put"]
)
def test_a_kill_before_any_request_of_a_save_leaves_a_verifiable_object(
    s3_server: Any, bucket: str, size: int, fence: bool
) -> None:
    url = f"s3://{bucket}/run/model-last.ckpt"
    assert save(url, size, 0xAA, fence=fence) is not None  # version A, whole
    # what every later save sends: over an object of another run (each process is one), a fenced commit's
    # If-None-Match fails first, and the object and the owner record are read before it is sent again
    sent = save(url, size, 0xAA, fence=fence)
    assert sent is not None
    assert content(url) == (size, 0xAA)
    outcomes = []
    for kill_before in range(len(sent) + 1):
        fill = 0xB0 + kill_before % 16
        killed = save(url, size, fill, kill_before, fence) is None
        found = content(url)  # never a ChecksumMismatchError: A (or an older B), or this B
        outcomes.append((kill_before, killed, found[1] == fill))
        assert found[0] == size
    assert outcomes[-1] == (len(sent), False, True)  # past the last request: not killed, the new version
    if size == MULTIPART:  # a single PUT is one request: it commits the object and carries its checksum at once
        assert any(new for _, killed, new in outcomes if killed), f"no kill fell after the commit: {sent}, {outcomes}"


def test_a_record_written_before_a_commit_that_never_came_does_not_vouch_for_another_object(
    s3_server: Any, s3_client: Any, bucket: str
) -> None:
    """The unbound entry is checked against the bytes: another object of that size at the key is refused."""
    url = f"s3://{bucket}/run/x.ckpt"
    assert save(url, MULTIPART, 0x11) is not None
    record_key = "run/x.ckpt" + CHECKSUM_SIDECAR_SUFFIX
    try:
        current = json.loads(s3_client.get_object(Bucket=bucket, Key=record_key)["Body"].read())
    except s3_client.exceptions.NoSuchKey:
        pytest.skip("this store keeps multipart checksums itself: no checksum record is written")
    pending = {"algorithm": "CRC32", "checksum": "AAAAAA==", "size": MULTIPART, "etag": "", "earlier": [current]}
    s3_client.put_object(Bucket=bucket, Key=record_key, Body=json.dumps(pending).encode())  # killed before commit
    assert content(url) == (MULTIPART, 0x11)  # the entry kept for the object still at the key
    config = botocore.config.Config(request_checksum_calculation="when_required", s3={"addressing_style": "path"})
    other_tool = boto3.client("s3", config=config)  # sends no checksum: the store keeps none
    other_tool.put_object(Bucket=bucket, Key="run/x.ckpt", Body=b"\x22" * MULTIPART)
    assert S3Utils().head_object(url).checksums == {}
    with pytest.raises(ChecksumMismatchError, match=r"x\.ckpt is corrupt"):
        content(url)
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix="run/")["Contents"]]
    assert "run/x.ckpt" + CHECKSUM_SIDECAR_SUFFIX in keys
