"""A stale run's new keys never count and never stay.

A run paused right after its check of the owner record (each of its checks answered before a newer run took the
directory over) still creates keys the newer run has not written: no condition on a commit of a key that holds no
object can refuse it. Every fenced commit names its run, and the owner record's time says when the owner took over:
resume discovery, ``ls``, ``verify``, ``convert`` and ``gc`` see such objects as a stale run's, and the owner's next
save (single-file or DCP) removes them. One process plays both runs (two plugins, two `CheckpointRun`s); the soak
(tests/test_soak.py) does it with real straggler processes.
"""

from __future__ import annotations

import datetime
import os
import time
import uuid
from typing import Any

import pytest
import torch
from s3_servers import S3Endpoint

import s3_checkpoint_cli
import s3_dcp
from connector import find_resume_checkpoint, find_resume_checkpoints
from s3_checkpoint_admin import find_garbage, list_checkpoints, verify_checkpoint
from s3_checkpoint_convert import convert_checkpoint
from s3_checkpoint_io import S3CheckpointIO
from s3_fencing import RUN_METADATA_KEY, CheckpointRun, DirectoryFence, current_run
from s3_utils import RetryPolicy, S3Utils

pytestmark = pytest.mark.integration

QUICK = RetryPolicy(max_attempts=4, max_elapsed_s=20, initial_backoff_s=0.01, max_backoff_s=0.05)
SECOND = 1.05  # the store dates objects to the second: an older run's object in the takeover's second is stale


def run_at(offset_s: float) -> CheckpointRun:
    return CheckpointRun(uuid.uuid4().hex[:16], "test-host", os.getpid(), current_run().started + offset_s)


def plugin_of(run: CheckpointRun, **kwargs: Any) -> S3CheckpointIO:
    plugin = S3CheckpointIO(chunk_size_MB=5, retry_policy=QUICK, **kwargs)
    plugin._run = run
    return plugin


def dcp_save(url: str, run: CheckpointRun, step: int) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    writer = s3_dcp.S3StorageWriter(url, chunk_size_MB=5)
    writer._run = run
    dcp.save({"step": step, "w": torch.full((8,), float(step))}, storage_writer=writer, no_dist=True)


def keys(s3_client: Any, bucket: str, prefix: str) -> set[str]:
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {obj["Key"][len(prefix) :] for obj in listed}


@pytest.fixture
def stale_after_takeover(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    """An older run saves (single-file and DCP), a newer run takes the directory over, then the older run, whose
    checks were all answered before the takeover, saves new keys: a single file and a whole DCP checkpoint."""
    if s3_server.name != "moto":
        pytest.skip("the same on every backend that dates objects: moto is enough")
    older, newer = run_at(-60), run_at(0)
    stale, new = plugin_of(older), plugin_of(newer)
    directory = f"s3://{bucket}/job"
    stale.save_checkpoint({"step": 1}, f"{directory}/step=1-last.ckpt")  # before the takeover: a checkpoint
    dcp_save(f"{directory}/step=1.ckpt", older, 1)
    time.sleep(SECOND)
    new.save_checkpoint({"step": 2}, f"{directory}/step=2-last.ckpt")  # takes the directory over
    check = DirectoryFence.before_mutation

    def answered_before_the_takeover(self: DirectoryFence, url: str, action: str) -> None:
        if self.run != older:
            check(self, url, action)

    monkeypatch.setattr(DirectoryFence, "before_mutation", answered_before_the_takeover)
    stale.save_checkpoint({"step": 9}, f"{directory}/step=9-last.ckpt")
    dcp_save(f"{directory}/step=8-last.ckpt", older, 8)
    monkeypatch.undo()
    written = keys(s3_client, bucket, "job/")
    assert {"step=9-last.ckpt", "step=8-last.ckpt/.metadata"} <= written  # the window: new keys were created
    assert "step=2-last.ckpt" in written  # the stale run's own clean-up never takes the newer run's objects for stale
    run = s3_client.head_object(Bucket=bucket, Key="job/step=9-last.ckpt")["Metadata"][RUN_METADATA_KEY]
    assert run.endswith(older.run_id)
    return {"directory": directory, "new": new, "newer": newer, "older": older}


def test_readers_ignore_what_a_stale_run_committed_after_the_takeover(stale_after_takeover: dict[str, Any]) -> None:
    directory = stale_after_takeover["directory"]
    assert find_resume_checkpoint(directory) == f"{directory}/step=2-last.ckpt"  # not step 9 nor 8
    fallbacks = find_resume_checkpoints(directory)
    assert f"{directory}/step=9-last.ckpt" not in fallbacks and f"{directory}/step=8-last.ckpt" not in fallbacks
    assert f"{directory}/step=1-last.ckpt" in fallbacks  # the older run's checkpoint from before the takeover
    listed = {entry.name for entry in list_checkpoints(directory)}
    assert listed == {"step=1-last.ckpt", "step=1.ckpt", "step=2-last.ckpt"}
    verification = verify_checkpoint(f"{directory}/step=8-last.ckpt")
    assert not verification.ok and not verification.complete
    assert verify_checkpoint(f"{directory}/step=1.ckpt").ok
    with pytest.raises(FileNotFoundError, match="stale run"):
        convert_checkpoint(f"{directory}/step=8-last.ckpt", f"{directory}-out/model.pt")
    with pytest.raises(FileNotFoundError, match="stale run"):
        convert_checkpoint(f"{directory}/step=9-last.ckpt", f"{directory}-out/dcp")


def test_the_owners_next_save_removes_a_stale_runs_keys(
    stale_after_takeover: dict[str, Any], bucket: str, s3_client: Any
) -> None:
    directory, new = stale_after_takeover["directory"], stale_after_takeover["new"]
    new.save_checkpoint({"step": 3}, f"{directory}/step=3.ckpt")
    left = keys(s3_client, bucket, "job/")
    assert not any(key.startswith(("step=9-last.ckpt", "step=8-last.ckpt")) for key in left), left
    assert {"step=1-last.ckpt", "step=1.ckpt/.metadata", "step=2-last.ckpt", "step=3.ckpt"} <= left
    assert find_garbage(directory, older_than=datetime.timedelta(hours=1)).stale == []


def test_the_owners_next_dcp_save_removes_a_stale_runs_keys(
    stale_after_takeover: dict[str, Any], bucket: str, s3_client: Any
) -> None:
    directory = stale_after_takeover["directory"]
    dcp_save(f"{directory}/step=3.ckpt", stale_after_takeover["newer"], 3)
    left = keys(s3_client, bucket, "job/")
    assert not any(key.startswith(("step=9-last.ckpt", "step=8-last.ckpt")) for key in left), left
    assert {"step=1-last.ckpt", "step=1.ckpt/.metadata", "step=2-last.ckpt", "step=3.ckpt/.metadata"} <= left


def test_gc_removes_a_stale_runs_keys_and_nothing_else(
    stale_after_takeover: dict[str, Any], bucket: str, s3_client: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = stale_after_takeover["directory"]
    before = keys(s3_client, bucket, "job/")
    assert s3_checkpoint_cli.main(["gc", directory, "--older-than", "1h"]) == 0  # a dry run
    out = capsys.readouterr().out
    assert "would remove" in out and f"{directory}/step=9-last.ckpt" in out and "stale run" in out
    assert keys(s3_client, bucket, "job/") == before
    assert s3_checkpoint_cli.main(["gc", directory, "--older-than", "1h", "--yes"]) == 0
    left = keys(s3_client, bucket, "job/")
    assert left == {key for key in before if not key.startswith(("step=9-last.ckpt", "step=8-last.ckpt"))}


def test_objects_that_name_no_run_are_never_a_stale_runs(s3_server: S3Endpoint, bucket: str) -> None:
    """Written with fencing off (or by another tool) after the takeover: counted, kept."""
    if s3_server.name != "moto":
        pytest.skip("the same on every backend: moto is enough")
    directory = f"s3://{bucket}/mixed"
    owner = plugin_of(run_at(0))
    owner.save_checkpoint({"step": 1}, f"{directory}/step=1-last.ckpt")
    S3CheckpointIO(fencing=False).save_checkpoint({"step": 5}, f"{directory}/step=5-last.ckpt")
    assert find_resume_checkpoint(directory) == f"{directory}/step=5-last.ckpt"
    owner.save_checkpoint({"step": 2}, f"{directory}/step=2.ckpt")
    assert S3Utils().s3_path_exists(f"{directory}/step=5-last.ckpt")


def test_a_later_launch_removes_what_a_stale_run_committed_after_an_earlier_takeover(
    stale_after_takeover: dict[str, Any], bucket: str, s3_client: Any
) -> None:
    """The newer run is killed before its next save, and a third run takes the directory over: the stale run's keys
    were committed before that third takeover, but after the second's, which the owner record still names (its
    earlier owners, with when each took over). Readers still leave them out, and the third run's first save removes
    them (the soak's straggler key left after 150 kills, before the record named earlier owners)."""
    directory = stale_after_takeover["directory"]
    time.sleep(SECOND)
    third = plugin_of(run_at(30))
    third.save_checkpoint({"step": 4}, f"{directory}/step=4-last.ckpt")  # takes over, then looks for stale objects
    left = keys(s3_client, bucket, "job/")
    assert not any(key.startswith(("step=9-last.ckpt", "step=8-last.ckpt")) for key in left), left
    assert {"step=1-last.ckpt", "step=1.ckpt/.metadata", "step=2-last.ckpt", "step=4-last.ckpt"} <= left
    listed = {entry.name for entry in list_checkpoints(directory)}
    assert listed == {"step=1-last.ckpt", "step=1.ckpt", "step=2-last.ckpt", "step=4-last.ckpt"}


def test_the_owner_record_names_its_earlier_owners_with_when_each_took_over(
    s3_server: S3Endpoint, bucket: str
) -> None:
    """Each takeover writes the previous owner, dated by the store's clock (the record's modification time), at the
    head of the record's ``earlier`` list, at most 8 of them; readers get them from `directory_owner`."""
    import s3_fencing

    if s3_server.name != "moto":
        pytest.skip("the record's fields are the same on every backend: moto is enough")
    directory = f"s3://{bucket}/owners"
    runs = [run_at(offset) for offset in range(0, 100, 10)]
    taken = []
    for step, run in enumerate(runs):
        plugin_of(run).save_checkpoint({"step": step}, f"{directory}/step={step}.ckpt")
        owner = s3_fencing.directory_owner(S3Utils(), directory)
        assert owner is not None and owner.run.run_id == run.run_id
        taken.append(owner.taken)
    assert [run.run_id for run, _ in owner.earlier] == [run.run_id for run in reversed(runs[1:-1])]
    assert [when for _, when in owner.earlier] == list(reversed(taken[1:-1]))
