"""One run per checkpoint directory: a stale run's saves, overwrites and removals fail and change nothing.

Two runs in two processes (`fence_worker`, each its own `s3_fencing.CheckpointRun`) play a job that was replaced and
the job that replaced it, for single-file saves (sync and async) and DCP saves, on both backends. The moments that
two processes cannot hit on purpose (a takeover between a run's check and its commit, a rank's files after the
coordinator planned) are played in one process by two plugins with two runs. The fault proxy plays stores without
conditional writes and counts what fencing costs a single run.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from botocore.exceptions import ClientError
from fault_proxy import Fault, FaultProxy, FaultRule, RateLimit
from s3_servers import S3Endpoint, empty_and_delete_bucket, rank_environment

import s3_checkpoint_cli
import s3_dcp
from connector import build_s3_checkpointing, find_resume_checkpoint
from s3_checkpoint_io import S3CheckpointIO
from s3_fencing import (
    OWNER_RECORD_NAME,
    CheckpointDirectoryTakenError,
    CheckpointRun,
    DirectoryFence,
    LaunchIdentity,
    current_run,
    launch_identity,
)
from s3_pacing import is_retriable_error
from s3_utils import (
    RetryPolicy,
    S3ClientSettings,
    S3Utils,
    note_capability,
    store_capabilities,
)

REPO = Path(__file__).resolve().parent.parent
HELPERS = Path(__file__).resolve().parent / "helpers"
QUICK = RetryPolicy(max_attempts=4, max_elapsed_s=20, initial_backoff_s=0.01, max_backoff_s=0.05)


def state(step: int, mib: float = 0) -> dict[str, Any]:
    checkpoint: dict[str, Any] = {"step": step, "w": torch.full((64,), float(step))}
    if mib:
        checkpoint["big"] = torch.full((int(mib * 2**20) // 4,), float(step))
    return checkpoint


def snapshot(client: Any, bucket: str, prefix: str) -> dict[str, tuple[str, bytes]]:
    """Every object under `prefix` (records included) with its ETag and bytes, and no multipart upload left open."""
    uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    assert uploads == [], f"open multipart uploads under {prefix}: {uploads}"
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {
        obj["Key"]: (obj["ETag"], client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()) for obj in listed
    }


def etag_conditions_only(bucket: str) -> None:
    """Fenced requests to `bucket` go unsigned for expiry (as on a store that ignores it, moto): the test plays the
    ETag conditions alone. With it, the stale run's check, older than half the lifetime, is made again before the
    request, and refuses it before the store's condition is reached (tests/test_fencing_expiry.py)."""
    note_capability(store_capabilities(S3Utils(), bucket), "expiring_requests", False)


def run_at(offset_s: float) -> CheckpointRun:
    """A run of this process's host that started `offset_s` seconds after this process's own run."""
    return CheckpointRun(uuid.uuid4().hex[:16], "test-host", os.getpid(), current_run().started + offset_s)


def plugin_of(run: CheckpointRun, **kwargs: Any) -> S3CheckpointIO:
    """A plugin acting as `run` (one process playing two runs; each real process is its own run)."""
    plugin = S3CheckpointIO(chunk_size_MB=5, retry_policy=kwargs.pop("retry_policy", QUICK), **kwargs)
    plugin._run = run
    return plugin


def coordinators_plan(url: str, run: CheckpointRun) -> tuple[Any, Any]:
    """The plan (and planner) of a one-tensor DCP save of `url` whose coordinator (rank 0) acts as `run`: it takes
    the directory over while planning; another rank then has only this plan."""
    planner_module = pytest.importorskip("torch.distributed.checkpoint.default_planner")
    coordinator = s3_dcp.S3StorageWriter(url, chunk_size_MB=5)
    coordinator._run = run
    coordinator.set_up_storage_writer(True, rank=0, use_collectives=True)
    planner = planner_module.DefaultSavePlanner()
    planner.set_up_planner(state_dict={"w": torch.arange(8.0)}, storage_meta=None, is_coordinator=True)
    plans, _ = planner.create_global_plan([coordinator.prepare_local_plan(planner.create_local_plan())])
    return planner.finish_plan(coordinator.prepare_global_plan(plans)[0]), planner


# --------------------------------------------------------------------------------------------------------------------
# Two runs, two processes
# --------------------------------------------------------------------------------------------------------------------


class Run:
    """A `fence_worker` process: one run that does what it is told, one JSON line at a time."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log = log
        self._stderr = open(log, "wb")  # closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fence_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            cwd=REPO,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.run_id = self._answer()["run"]  # its run exists; the imports go on

    def ready(self) -> Run:
        assert self._answer()["ok"]
        return self

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")

    def _answer(self) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=120)
        except queue.Empty:
            line = ""
        if not line:
            pytest.fail(f"fence_worker gave no answer; its log:\n{self.log.read_text()[-4000:]}")
        return json.loads(line)

    def __call__(self, op: str, **arguments: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


@pytest.fixture(scope="module")
def two_runs(s3_server: S3Endpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Run, Run, str]]:
    """(stale, new, bucket): the stale run's process started first, the new one after it was ready."""
    client = s3_server.client()
    bucket = f"fence-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    logs = tmp_path_factory.mktemp(f"fence-{s3_server.name}")
    env = {**os.environ, **s3_server.env(), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HELPERS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    stale = Run(env, logs / "stale.log")
    new = None
    try:
        new = Run(env, logs / "new.log")  # a later run: the stale one's already exists
        yield stale.ready(), new.ready(), bucket
    finally:
        for run in (stale, new):
            if run is not None:
                run.close()
        empty_and_delete_bucket(client, bucket)


def assert_refused(answer: dict[str, Any], stale: Run, new: Run, directory: str) -> None:
    assert not answer["ok"] and answer["taken"], answer.get("traceback", answer)
    if answer["type"] == "CheckpointDirectoryTakenError":  # DCP wraps it: its message is then DCP's
        message = answer["message"]
        assert stale.run_id in message and new.run_id in message and directory in message, message
        assert "fencing=False" in message and OWNER_RECORD_NAME in message


def test_stale_run_save_overwrite_and_removal_fail_and_change_nothing(
    two_runs: tuple[Run, Run, str], s3_server: S3Endpoint
) -> None:
    stale, new, bucket = two_runs
    client, directory = s3_server.client(), f"s3://{bucket}/sync"
    for name in ("step=10.ckpt", "last.ckpt"):
        assert stale("save", url=f"{directory}/{name}", step=10)["ok"]
    assert new("resume", dirpath=directory) == {"ok": True, "url": f"{directory}/last.ckpt", "step": 10}
    for name in ("step=20.ckpt", "last.ckpt"):  # the new run's first save takes the directory over
        assert new("save", url=f"{directory}/{name}", step=20)["ok"]
    before = snapshot(client, bucket, "sync/")

    refused = [
        stale("save", url=f"{directory}/step=11.ckpt", step=11),  # a new checkpoint
        stale("save", url=f"{directory}/last.ckpt", step=11, mib=6),  # an overwrite (multipart: aborted)
        stale("remove", url=f"{directory}/step=20.ckpt"),  # the new run's top-k
        stale("remove", url=f"{directory}/step=10.ckpt"),  # its own: the directory is no longer its own
    ]
    for answer in refused:
        assert_refused(answer, stale, new, directory)
    assert snapshot(client, bucket, "sync/") == before  # byte for byte, no upload left open
    assert new("resume", dirpath=directory) == {"ok": True, "url": f"{directory}/last.ckpt", "step": 20}


def test_stale_async_save_fails_at_the_next_call_or_teardown_and_removes_nothing(
    two_runs: tuple[Run, Run, str], s3_server: S3Endpoint
) -> None:
    stale, new, bucket = two_runs
    client, directory = s3_server.client(), f"s3://{bucket}/async"
    assert stale("save", url=f"{directory}/last.ckpt", step=10, **{"async": True})["ok"]
    assert stale("teardown", **{"async": True})["ok"]
    for name in ("step=20.ckpt", "last.ckpt"):
        assert new("save", url=f"{directory}/{name}", step=20, **{"async": True})["ok"]
    assert new("teardown", **{"async": True})["ok"]
    before = snapshot(client, bucket, "async/")

    assert stale("save", url=f"{directory}/last.ckpt", step=11, **{"async": True})["ok"]  # queued: fails behind
    # Deferred behind the failing save (then dropped), or refused at once with that save's error if it already failed.
    removal = stale("remove", url=f"{directory}/step=20.ckpt", **{"async": True})
    end = stale("teardown", **{"async": True})
    assert [removal["ok"], end["ok"]].count(False) == 1, (removal, end)  # reported once, where it surfaced
    assert_refused(removal if not removal["ok"] else end, stale, new, directory)
    assert snapshot(client, bucket, "async/") == before
    assert new("resume", dirpath=directory)["step"] == 20


def test_stale_dcp_save_commits_and_overwrites_nothing(two_runs: tuple[Run, Run, str], s3_server: S3Endpoint) -> None:
    stale, new, bucket = two_runs
    client, directory = s3_server.client(), f"s3://{bucket}/dcp"
    assert stale("dcp_save", url=f"{directory}/last.ckpt", value=1)["ok"]
    assert new("dcp_save", url=f"{directory}/last.ckpt", value=2)["ok"]
    before = snapshot(client, bucket, "dcp/")

    # A new checkpoint: the plan was made, the shard is refused before it completes, no .metadata is written.
    assert_refused(stale("dcp_save", url=f"{directory}/step=11.ckpt", value=3), stale, new, directory)
    # An overwrite of the new run's checkpoint: its .metadata is not retired, nothing is written.
    assert_refused(stale("dcp_save", url=f"{directory}/last.ckpt", value=3), stale, new, directory)
    assert snapshot(client, bucket, "dcp/") == before
    assert new("dcp_load", url=f"{directory}/last.ckpt") == {"ok": True, "value": 2.0}


# --------------------------------------------------------------------------------------------------------------------
# One process, two runs: the moments two processes cannot hit on purpose
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mib", [0, 6], ids=["put", "multipart"])
def test_if_match_refuses_a_takeover_between_check_and_commit(
    mib: float, s3_server: S3Endpoint, bucket: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    etag_conditions_only(bucket)
    if mib and not store_capabilities(S3Utils(), bucket, ["conditional_complete"]).conditional_complete:
        pytest.skip(f"{s3_server.name} ignores If-Match on CompleteMultipartUpload (SeaweedFS and S3 honour it)")
    older, newer = run_at(-60), run_at(0)
    stale, new = plugin_of(older), plugin_of(newer)
    last = f"s3://{bucket}/race/last.ckpt"
    stale.save_checkpoint(state(10, mib), last)  # its own object: the next overwrite carries If-Match on its ETag
    check = DirectoryFence.before_mutation
    raced: list[str] = []

    def newer_run_right_after_the_check(self: DirectoryFence, url: str, action: str) -> None:
        check(self, url, action)
        if self.run == older and not raced:
            raced.append(url)
            new.save_checkpoint(state(20), last)  # takes the directory over and overwrites last.ckpt

    monkeypatch.setattr(DirectoryFence, "before_mutation", newer_run_right_after_the_check)
    with pytest.raises(CheckpointDirectoryTakenError) as refused:
        stale.save_checkpoint(state(11, mib), last)
    assert raced == [last] and newer.run_id in str(refused.value)
    assert isinstance(refused.value.__cause__, (ClientError, FileNotFoundError))  # the store's 412
    monkeypatch.undo()
    assert new.load_checkpoint(last)["step"] == 20
    assert s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


@pytest.mark.parametrize("mib", [0, 6], ids=["put", "multipart"])
def test_if_none_match_refuses_a_stale_run_stopped_before_committing_a_key_it_never_wrote(
    mib: float, s3_server: S3Endpoint, bucket: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The straggler of a relaunch: stopped right after its fence check (the check-then-act gap), it goes on after
    the newer run saved the same key. Its commit carries If-None-Match (it never wrote that key), fails, and the
    record it then reads names the newer run: refused, the newer run's object intact, no upload left open."""
    etag_conditions_only(bucket)
    older, newer = run_at(-60), run_at(0)
    stale, new = plugin_of(older), plugin_of(newer)
    stale.save_checkpoint(state(1), f"s3://{bucket}/gap/step=1.ckpt")  # the stale run held the directory
    url = f"s3://{bucket}/gap/step=2.ckpt"
    conditions = DirectoryFence.conditions
    raced: list[str] = []

    def newer_run_between_the_last_check_and_the_commit(self: DirectoryFence, key: str) -> dict[str, str]:
        sent = conditions(self, key)  # what the commit will carry, asked for right before it is sent
        if self.run == older and not raced:
            raced.append(key)
            new.save_checkpoint(state(20), url)  # the relaunch takes the directory over and saves the same step
        return sent

    monkeypatch.setattr(DirectoryFence, "conditions", newer_run_between_the_last_check_and_the_commit)
    with pytest.raises(CheckpointDirectoryTakenError) as refused:
        stale.save_checkpoint(state(2, mib), url)
    monkeypatch.undo()
    assert raced == ["gap/step=2.ckpt"] and newer.run_id in str(refused.value)
    assert isinstance(refused.value.__cause__, ClientError)  # the store's 412 to If-None-Match
    assert new.load_checkpoint(url)["step"] == 20
    assert s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_a_dcp_rank_stopped_after_its_check_cannot_overwrite_the_relaunchs_file(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank of the stale run's sharded save passes its check against the plan's token, stops, and goes on after
    the relaunch wrote the same shard: its commit carries the coordinator's ETag conditions (If-None-Match here)
    and is refused; the relaunch's shard is intact."""
    etag_conditions_only(bucket)
    older, newer = run_at(-60), run_at(0)
    url = f"s3://{bucket}/straggler/step=5.ckpt"
    plan, planner = coordinators_plan(url, older)
    assert plan.storage_data.fence.conditional  # the store honours conditions: the ranks' commits carry them
    conditions = DirectoryFence.conditions
    raced: list[str] = []

    def relaunch_between_the_check_and_the_commit(self: DirectoryFence, key: str) -> dict[str, str]:
        sent = conditions(self, key)
        if self.run == older and key.endswith("/__0_0.distcp") and not raced:
            raced.append(key)
            plugin_of(newer).save_checkpoint(state(7), f"s3://{bucket}/straggler/last.ckpt")  # takes it over
            s3_client.put_object(Bucket=bucket, Key=key, Body=b"the relaunch's shard")  # and saves this step too
        return sent

    rank = s3_dcp.S3StorageWriter(url, chunk_size_MB=5)  # another rank: it only has the plan
    rank.set_up_storage_writer(False, rank=1, use_collectives=True)
    monkeypatch.setattr(DirectoryFence, "conditions", relaunch_between_the_check_and_the_commit)
    with pytest.raises(CheckpointDirectoryTakenError, match=newer.run_id):
        rank.write_data(plan, planner).wait()
    monkeypatch.undo()
    assert raced == ["straggler/step=5.ckpt/__0_0.distcp"]
    assert s3_client.get_object(Bucket=bucket, Key=raced[0])["Body"].read() == b"the relaunch's shard"
    assert s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_a_stale_rank_saving_the_same_tensors_as_the_relaunch_cannot_commit_over_its_file(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An earlier launch left a file of an incomplete save; a straggler and its relaunch save the same step with the
    same tensors. The straggler's first commit fails (If-None-Match: the file is there), it reads the file's ETag and
    its own record, and stops before sending If-Match on that ETag; the relaunch takes the directory over and commits
    the same tensors over the earlier file. Each file ends with its own nonce, so the relaunch's ETag is not the one
    the straggler names: its commit is refused, and the file stays the relaunch's, bytes and run."""
    etag_conditions_only(bucket)
    earliest, older, newer = run_at(-120), run_at(-60), run_at(0)
    url = f"s3://{bucket}/same-bytes/step=5.ckpt"
    key = "same-bytes/step=5.ckpt/__0_0.distcp"

    def rank_of(run: CheckpointRun) -> tuple[Any, Any, s3_dcp.S3StorageWriter]:
        plan, planner = coordinators_plan(url, run)  # its coordinator takes the directory over
        rank = s3_dcp.S3StorageWriter(url, chunk_size_MB=5)
        rank.set_up_storage_writer(False, rank=1, use_collectives=True)
        return plan, planner, rank

    plan, planner, rank = rank_of(earliest)
    rank.write_data(plan, planner).wait()  # and is killed before its .metadata
    earlier = s3_client.head_object(Bucket=bucket, Key=key)["ETag"]
    failed = DirectoryFence.precondition_failed
    relaunched: list[str] = []

    def relaunch_before_the_retried_commit(self: DirectoryFence, *args: Any, **kwargs: Any) -> dict[str, str]:
        retry = failed(self, *args, **kwargs)
        if self.run == older and not relaunched:
            assert retry == {"IfMatch": earlier}  # what the straggler's next commit is to carry
            relaunched.append(s3_client.head_object(Bucket=bucket, Key=key)["ETag"])
            plan, planner, rank = rank_of(newer)
            rank.write_data(plan, planner).wait()  # the same tensors, over the earlier launch's file
        return retry

    plan, planner, rank = rank_of(older)
    monkeypatch.setattr(DirectoryFence, "precondition_failed", relaunch_before_the_retried_commit)
    with pytest.raises(CheckpointDirectoryTakenError, match=newer.run_id):
        rank.write_data(plan, planner).wait()
    monkeypatch.undo()
    assert relaunched == [earlier]
    now = s3_client.head_object(Bucket=bucket, Key=key)
    assert now["ETag"] != earlier and newer.run_id in now["Metadata"]["s3ckpt-run"]
    assert s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_dcp_rank_is_refused_when_the_directory_changes_hands_after_the_plan(
    s3_server: S3Endpoint, bucket: str, s3_client: Any
) -> None:
    """What one rank of a multi-rank save does with the coordinator's plan, played step by step in one process."""
    older, newer = run_at(-60), run_at(0)
    url = f"s3://{bucket}/ranks/step=5.ckpt"
    plan, planner = coordinators_plan(url, older)  # the stale run took the directory
    assert plan.storage_data.fence.run == older

    plugin_of(newer).save_checkpoint(state(1), f"s3://{bucket}/ranks/last.ckpt")  # a newer run takes it over
    rank = s3_dcp.S3StorageWriter(url, chunk_size_MB=5)  # another rank: it only has the plan
    rank.set_up_storage_writer(False, rank=1, use_collectives=True)
    with pytest.raises(CheckpointDirectoryTakenError, match=newer.run_id):
        rank.write_data(plan, planner)
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix="ranks/step=5.ckpt/").get("Contents", [])
    assert listed == [] and s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_async_refused_save_drops_the_removal_waiting_for_it(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, fault_proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    if s3_server.name != "moto":
        pytest.skip("the same code on every backend: moto is enough")
    older, newer = run_at(-60), run_at(0)
    settings = S3ClientSettings(endpoint_url=fault_proxy.endpoint_url, user_agent_extra="stale-run")
    stale = plugin_of(older, async_checkpointing=True, client_settings=settings)
    new = plugin_of(newer)
    directory = f"s3://{bucket}/deferred"
    stale.save_checkpoint(state(10), f"{directory}/last.ckpt")
    stale.wait_for_pending_saves()
    new.save_checkpoint(state(20), f"{directory}/step=20.ckpt")
    before = snapshot(s3_client, bucket, "deferred/")

    record = f"/{bucket}/deferred/{OWNER_RECORD_NAME}$"
    fault_proxy.add_rule(FaultRule(Fault.stall(0.5), method="HEAD", path_regex=record, times=1))
    stale.save_checkpoint(state(11), f"{directory}/last.ckpt")  # its check waits on the stalled HEAD
    stale.remove_checkpoint(f"{directory}/step=20.ckpt")  # so this waits for that save
    assert [removal.path for removal in stale._deferred] == [f"{directory}/step=20.ckpt"]  # private: no public view
    with caplog.at_level(logging.WARNING, logger="s3_checkpoint_io"), pytest.raises(CheckpointDirectoryTakenError):
        stale.teardown()
    assert "Not removing" in caplog.text
    assert snapshot(s3_client, bucket, "deferred/") == before


def test_a_stale_removal_stopped_after_its_check_is_refused_by_the_store(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A straggler paused between its fence check and its DeleteObjects while a relaunch takes the directory over
    and saves the same name: the removal carries the ETag the straggler committed, the store refuses it (412), and
    the record it then reads names the newer run. Without the condition the newer run's checkpoint would go."""
    etag_conditions_only(bucket)
    older, newer = run_at(-60), run_at(0)
    stale, new = plugin_of(older), plugin_of(newer)
    url = f"s3://{bucket}/removal/step=1.ckpt"
    stale.save_checkpoint(state(1), url)
    check = DirectoryFence.before_mutation
    raced: list[str] = []

    def newer_run_right_after_the_check(self: DirectoryFence, checked: str, action: str) -> None:
        check(self, checked, action)
        if self.run == older and action == "removal" and not raced:
            raced.append(checked)
            new.save_checkpoint(state(20), url)  # takes the directory over and replaces the stale run's object

    monkeypatch.setattr(DirectoryFence, "before_mutation", newer_run_right_after_the_check)
    with pytest.raises(CheckpointDirectoryTakenError) as refused:
        stale.remove_checkpoint(url)
    monkeypatch.undo()
    assert raced == [url] and newer.run_id in str(refused.value)
    assert "PreconditionFailed" in str(refused.value.__cause__)  # the store's 412 on the removal's ETag
    assert new.load_checkpoint(url)["step"] == 20


def test_a_removal_whose_object_changed_while_the_run_still_owns_it_removes_what_is_there(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, fault_proxy: FaultProxy
) -> None:
    """412 on a removal while the record is still this run's: the object is read again and removed (If-Match on its
    new ETag), not refused."""
    plugin = plugin_of(current_run(), client_settings=S3ClientSettings(endpoint_url=fault_proxy.endpoint_url))
    url = f"s3://{bucket}/changed/step=1.ckpt"
    plugin.save_checkpoint(state(1), url)
    s3_client.put_object(Bucket=bucket, Key="changed/step=1.ckpt", Body=b"replaced by hand")
    assert store_capabilities(plugin.s3, bucket, ["conditional_delete"]).conditional_delete  # probed (moto 5.2.6+)
    fault_proxy.clear()
    plugin.remove_checkpoint(url)
    assert "Contents" not in s3_client.list_objects_v2(Bucket=bucket, Prefix="changed/step=1.ckpt")
    deletes = [r for r in fault_proxy.requests if r.method == "POST" and "delete" in r.query]
    assert len(deletes) == 2  # the first one refused (412 on the committed ETag), the second with the new ETag


def test_a_conditional_removal_answered_409_is_sent_again(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, fault_proxy: FaultProxy
) -> None:
    """409 ConditionalRequestConflict (a concurrent request on the key) is not a refusal: sent again, removed."""
    plugin = plugin_of(current_run(), client_settings=S3ClientSettings(endpoint_url=fault_proxy.endpoint_url))
    url = f"s3://{bucket}/conflict/step=1.ckpt"
    plugin.save_checkpoint(state(1), url)
    assert store_capabilities(plugin.s3, bucket, ["conditional_delete"]).conditional_delete
    conflict = Fault.status(409, "ConditionalRequestConflict")
    fault_proxy.add_rule(FaultRule(conflict, method="POST", query="delete", times=1))
    plugin.remove_checkpoint(url)
    assert "Contents" not in s3_client.list_objects_v2(Bucket=bucket, Prefix="conflict/step=1.ckpt")
    assert fault_proxy.count(method="POST", faulted=True) == 1


def test_a_store_without_conditional_deletes_warns_once_and_checks_before_removing(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the store does not honour conditional deletes (recorded so here), fenced removals keep the check
    before the request, and say once, naming the store, what that leaves open."""
    plugin = plugin_of(current_run())
    note_capability(store_capabilities(plugin.s3, bucket), "conditional_delete", False)
    for step in (1, 2):
        plugin.save_checkpoint(state(step), f"s3://{bucket}/plain/step={step}.ckpt")
    with caplog.at_level(logging.WARNING, logger="s3_utils"):
        plugin.remove_checkpoint(f"s3://{bucket}/plain/step=1.ckpt")
        plugin.remove_checkpoint(f"s3://{bucket}/plain/step=2.ckpt")
    warned = [r.getMessage() for r in caplog.records if "If-Match on DeleteObject" in r.getMessage()]
    assert len(warned) == 1 and bucket in warned[0] and "stale run paused between" in warned[0], warned
    assert s3_client.list_objects_v2(Bucket=bucket, Prefix="plain/step=").get("Contents") is None
    newer = plugin_of(run_at(3600))
    newer.save_checkpoint(state(3), f"s3://{bucket}/plain/step=3.ckpt")
    with pytest.raises(CheckpointDirectoryTakenError):  # still checked: the owner record refuses the stale run
        plugin.remove_checkpoint(f"s3://{bucket}/plain/step=3.ckpt")


def test_an_unfenced_prefix_removal_keeps_an_object_replaced_since_it_was_listed(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rm`` and ``gc`` remove a listed prefix with the ETags of the listing: an object replaced between the
    listing and the removal is kept (with a warning), the others go."""
    for name in ("a", "b"):
        s3_client.put_object(Bucket=bucket, Key=f"dcp.ckpt/{name}", Body=b"old")
    utils = S3Utils()
    listing = utils.list_objects

    def replaced_after_the_listing(*args: Any, **kwargs: Any) -> Any:
        listed = listing(*args, **kwargs)
        s3_client.put_object(Bucket=bucket, Key="dcp.ckpt/b", Body=b"new")  # a save that came in meanwhile
        return listed

    monkeypatch.setattr(utils, "list_objects", replaced_after_the_listing)
    utils.remove_objects_with_prefix(f"s3://{bucket}/dcp.ckpt")
    monkeypatch.undo()
    left = [item["Key"] for item in s3_client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert left == ["dcp.ckpt/b"]
    assert s3_client.get_object(Bucket=bucket, Key="dcp.ckpt/b")["Body"].read() == b"new"


# --------------------------------------------------------------------------------------------------------------------
# A single run: what it pays, and what it never sees
# --------------------------------------------------------------------------------------------------------------------


def test_a_single_run_pays_one_small_request_per_save_and_removal(
    s3_server: S3Endpoint, bucket: str, fault_proxy: FaultProxy
) -> None:
    settings = S3ClientSettings(endpoint_url=fault_proxy.endpoint_url)
    plugin = S3CheckpointIO(chunk_size_MB=5, client_settings=settings)
    directory = f"s3://{bucket}/counted"
    record = f"/{bucket}/counted/{OWNER_RECORD_NAME}"

    def on_record() -> list[tuple[str, int | None]]:
        return [(r.method, r.status) for r in fault_proxy.requests if r.path == record]

    plugin.save_checkpoint(state(1), f"{directory}/a.ckpt")
    # read the record (none), write it (If-None-Match: *), probe the store once (If-None-Match: * must fail); after
    # the commit, its time for the look for a stale run's objects (later saves reuse their check's HEAD)
    assert on_record() == [("GET", 404), ("PUT", 200), ("PUT", 412), ("HEAD", 200)]
    fault_proxy.clear()
    plugin.save_checkpoint(state(2), f"{directory}/b.ckpt")
    plugin.save_checkpoint(state(3), f"{directory}/a.ckpt")  # an overwrite of its own: If-Match, no fallback
    assert on_record() == [("HEAD", 200)] * 2
    assert [r.status for r in fault_proxy.requests if r.method == "PUT"] == [200] * len(
        [r for r in fault_proxy.requests if r.method == "PUT"]
    )
    fenced_saves = len(fault_proxy.requests)
    fault_proxy.clear()
    plugin.remove_checkpoint(f"{directory}/b.ckpt")
    assert on_record() == [("HEAD", 200)]
    fault_proxy.clear()
    assert plugin.load_checkpoint(f"{directory}/a.ckpt")["step"] == 3
    assert find_resume_checkpoint(directory, resume_ignore_no_checkpoint=True, s3_utils=plugin.s3) is None
    assert on_record() == [("GET", 200)]  # resume reads who owns the directory, once

    unfenced = S3CheckpointIO(chunk_size_MB=5, client_settings=settings, fencing=False)
    fault_proxy.clear()
    unfenced.save_checkpoint(state(2), f"{directory}/b.ckpt")
    unfenced.save_checkpoint(state(3), f"{directory}/a.ckpt")
    listings = [r for r in fault_proxy.requests if r.method == "GET" and "list-type" in r.query]
    assert on_record() == [] and len(fault_proxy.requests) == fenced_saves - 4  # a HEAD and a listing per save
    assert len(listings) == 0


def test_a_dcp_save_pays_one_small_request_per_rank_and_one_for_its_commit(
    s3_server: S3Endpoint, bucket: str, fault_proxy: FaultProxy
) -> None:
    if s3_server.name != "moto":
        pytest.skip("request counts, the same on every backend: moto is enough")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    settings = S3ClientSettings(endpoint_url=fault_proxy.endpoint_url)
    record = f"/{bucket}/sharded/{OWNER_RECORD_NAME}"

    def save(name: str, thread_count: int) -> list[tuple[str, int | None]]:
        fault_proxy.clear()
        url = f"s3://{bucket}/sharded/{name}"
        writer = s3_dcp.S3StorageWriter(url, chunk_size_MB=5, thread_count=thread_count, client_settings=settings)
        dcp.save({"a": torch.arange(8.0), "b": torch.ones(8)}, storage_writer=writer, no_dist=True)
        return [(r.method, r.status) for r in fault_proxy.requests if r.path == record]

    # the coordinator takes the directory over while planning; then one check per file, record and .metadata
    assert save("one.ckpt", 1) == [("GET", 404), ("PUT", 200), ("PUT", 412)] + [("HEAD", 200)] * 3
    assert save("two.ckpt", 2) == [("HEAD", 200)] * 4  # each of a rank's files is checked right before its commit
    # an overwrite: retiring the old .metadata (one check for its removals), the file, the record, .metadata, and
    # removing the shard the new save does not write; the file's commit carries If-Match on the ETag this run
    # committed there, so it does not fail
    assert save("two.ckpt", 1) == [("HEAD", 200)] * 5
    metadata_puts = [r.status for r in fault_proxy.requests if r.method == "PUT" and r.path.endswith("/.metadata")]
    assert metadata_puts == [200]  # If-None-Match: * on the retired .metadata, no fallback


def test_an_object_changed_outside_the_run_is_overwritten_with_a_warning(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    plugin = plugin_of(current_run())
    last = f"s3://{bucket}/outside/last.ckpt"
    plugin.save_checkpoint(state(1), last)
    s3_client.put_object(Bucket=bucket, Key="outside/last.ckpt", Body=b"copied in by hand")
    with caplog.at_level(logging.WARNING, logger="s3_fencing"):
        plugin.save_checkpoint(state(2), last)  # If-Match fails; the run still owns the directory: no failure
    assert "is not what this run last left there" in caplog.text
    assert plugin.load_checkpoint(last)["step"] == 2


@pytest.mark.parametrize("mode", ["refuse", "ignore"])
def test_store_without_conditional_writes_warns_once_and_saves_go_on(
    mode: str, s3_server: S3Endpoint, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    credentials = (s3_server.access_key, s3_server.secret_key)
    with FaultProxy(s3_server.endpoint_url, conditional_writes=mode, credentials=credentials) as proxy:
        settings = S3ClientSettings(endpoint_url=proxy.endpoint_url)
        stale, new = plugin_of(run_at(-60), client_settings=settings), plugin_of(run_at(0), client_settings=settings)
        a, b = f"s3://{bucket}/plain/a.ckpt", f"s3://{bucket}/plain/b.ckpt"
        with caplog.at_level(logging.WARNING, logger="s3_fencing"):
            for step, url in [(1, a), (2, a), (3, b)]:
                stale.save_checkpoint(state(step), url)
        warnings = [r.getMessage() for r in caplog.records if "does not honour conditional writes" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert proxy.endpoint_url in warnings[0] and bucket in warnings[0] and "not protected" in warnings[0]
        # refused: the takeover's conditional PUT (then written without); ignored: the takeover and the probe
        assert proxy.count(faulted=True) == {"refuse": 1, "ignore": 2}[mode]
        assert stale.load_checkpoint(a)["step"] == 2

        new.save_checkpoint(state(20), a)  # the record is still checked: a newer run still stops the stale one
        with pytest.raises(CheckpointDirectoryTakenError):
            stale.save_checkpoint(state(4), a)
        assert new.load_checkpoint(a)["step"] == 20


def test_owner_record_is_invisible_to_listings_resume_cli_and_directory_checks(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    if s3_server.name != "moto":
        pytest.skip("listing rules, the same on every backend")
    directory = f"s3://{bucket}/hidden"
    plugin = plugin_of(current_run())
    plugin.save_checkpoint(state(5), f"{directory}/step=5-last.ckpt")
    assert s3_client.head_object(Bucket=bucket, Key=f"hidden/{OWNER_RECORD_NAME}")
    assert [info.key for info in S3Utils().list_objects(directory)] == ["hidden/step=5-last.ckpt"]
    assert find_resume_checkpoint(directory) == f"{directory}/step=5-last.ckpt"
    assert s3_checkpoint_cli.main(["ls", "-a", "--json", directory]) == 0
    assert OWNER_RECORD_NAME not in capsys.readouterr().out
    plugin.remove_checkpoint(f"{directory}/step=5-last.ckpt")
    assert not S3Utils().s3_path_exists(directory, match_directory=True)  # only the record is left: "empty"


def test_an_older_run_never_takes_a_directory_over_and_a_lost_record_is_taken_again(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    if s3_server.name != "moto":
        pytest.skip("the same code on every backend: moto is enough")
    directory = f"s3://{bucket}/order"
    owner = plugin_of(run_at(0))
    owner.save_checkpoint(state(1), f"{directory}/last.ckpt")
    started_before = plugin_of(run_at(-3600))  # e.g. a preempted job that never saved here before its replacement
    with pytest.raises(CheckpointDirectoryTakenError, match="a later launch than this run"):
        started_before.save_checkpoint(state(0), f"{directory}/last.ckpt")
    assert owner.load_checkpoint(f"{directory}/last.ckpt")["step"] == 1

    s3_client.delete_object(Bucket=bucket, Key=f"order/{OWNER_RECORD_NAME}")
    with caplog.at_level(logging.WARNING, logger="s3_fencing"):
        owner.save_checkpoint(state(2), f"{directory}/last.ckpt")  # a single run does not fail for it
    assert "is gone" in caplog.text
    assert s3_client.head_object(Bucket=bucket, Key=f"order/{OWNER_RECORD_NAME}")


def test_fencing_can_be_turned_off_by_argument_and_config(s3_server: S3Endpoint, bucket: str, s3_client: Any) -> None:
    if s3_server.name != "moto":
        pytest.skip("the same code on every backend: moto is enough")
    directory = f"s3://{bucket}/off"
    plugin_of(run_at(0)).save_checkpoint(state(1), f"{directory}/last.ckpt")
    older = plugin_of(run_at(-60), fencing=False)
    older.save_checkpoint(state(0), f"{directory}/last.ckpt")  # not refused: the switch is off
    assert older.load_checkpoint(f"{directory}/last.ckpt")["step"] == 0
    s3_client.delete_object(Bucket=bucket, Key=f"off/{OWNER_RECORD_NAME}")
    older.save_checkpoint(state(0), f"{directory}/step=0.ckpt")
    assert "Contents" not in s3_client.list_objects_v2(Bucket=bucket, Prefix=f"off/{OWNER_RECORD_NAME}")

    config = {
        "s3_checkpointing": {"fencing": False},
        "exp_manager": {"checkpoint_callback_params": {"dirpath": directory}},
    }
    assert build_s3_checkpointing(config).checkpoint_io.fencing is False
    config["s3_checkpointing"] = {}
    assert build_s3_checkpointing(config).checkpoint_io.fencing is True


# --------------------------------------------------------------------------------------------------------------------
# A run is a launch: its ranks never refuse each other; a relaunch fences the previous launch's stragglers
# --------------------------------------------------------------------------------------------------------------------

LAUNCH_WORKER = HELPERS / "launch_worker.py"


def launch(
    server: S3Endpoint, endpoint_url: str, directory: str, out: Path, launcher: str, run_id: str, **options: Any
) -> list[dict[str, Any]]:
    """Run `launch_worker` (one launch of `options["world"]` ranks, each saving and removing its own files in
    `directory` at the same instant); every rank's report."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(LAUNCH_WORKER), "--launcher", launcher, "--run-id", run_id]
    command += ["--dir", directory, "--out", str(out)]
    for name, value in options.items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    env = rank_environment(server, endpoint_url)
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]


def assert_one_run_without_refusals(reports: list[dict[str, Any]], world: int, run_id: str) -> None:
    assert len(reports) == world
    for report in reports:
        assert "error" not in report, report["error"]
        failed = {name: error for name, error in report["steps"].items() if error is not None}
        assert not failed, f"rank {report['rank']} of run {report['run']}: {failed}"
    assert {report["run"] for report in reports} == {run_id}


@pytest.mark.parametrize(
    ("launcher", "job", "mib", "expected"),
    [
        ("torchrun", "job-{id}", 6, "torchrun:job-{id}#2"),  # multipart: CompleteMultipartUpload commits
        ("torchrun", "none", 0, "torchrun:none@"),  # torchrun's default run id: the agent (this process) names it
        ("slurm", "{id}", 0, "slurm:{id}#2.0"),
    ],
    ids=["torchrun", "torchrun-default-run-id", "slurm"],
)
def test_four_ranks_of_one_launch_save_and_remove_in_one_directory_without_refusals(
    launcher: str,
    job: str,
    mib: float,
    expected: str,
    s3_server: S3Endpoint,
    bucket: str,
    s3_client: Any,
    tmp_path: Path,
) -> None:
    if s3_server.name != "moto":
        pytest.skip("the same code on every backend: moto is enough")
    unique = str(uuid.uuid4().int % 10**8)
    job, expected = job.format(id=unique), expected.format(id=unique)
    directory = f"s3://{bucket}/ranks"
    reports = launch(s3_server, s3_server.endpoint_url, directory, tmp_path, launcher, job, world=4, restart=2, mib=mib)
    run_id = reports[0]["run"]
    assert run_id.startswith(expected) if job == "none" else run_id == expected
    assert_one_run_without_refusals(reports, 4, run_id)
    listed = sorted(obj["Key"] for obj in s3_client.list_objects_v2(Bucket=bucket, Prefix="ranks/")["Contents"])
    assert [key for key in listed if key.endswith(".ckpt")] == [f"ranks/rank{r}-step=2.ckpt" for r in range(4)]
    record = json.loads(s3_client.get_object(Bucket=bucket, Key=f"ranks/{OWNER_RECORD_NAME}")["Body"].read())
    assert record["run"] == run_id and record["generation"] == 1  # taken over once, by whichever rank came first
    assert s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


@pytest.mark.slow
def test_eight_ranks_of_one_launch_saving_in_one_directory_under_throttling_refuse_nothing(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    if s3_server.name != "moto":
        pytest.skip("the same code on every backend: moto is enough")
    directory = f"s3://{bucket}/throttled"
    with FaultProxy(s3_server.endpoint_url) as proxy:
        limit = proxy.add_rule(RateLimit(writes_per_s=12, reads_per_s=40, burst_s=0.1, path_regex=f"^/{bucket}/"))
        job = f"throttled-{uuid.uuid4().hex[:8]}"
        reports = launch(s3_server, proxy.endpoint_url, directory, tmp_path, "torchrun", job, world=8, mib=0)
        assert_one_run_without_refusals(reports, 8, f"torchrun:{job}#0")
        assert limit.throttled["write"] > 0, (limit.admitted, limit.throttled)  # S3 said SlowDown, and all went on
    listed = sorted(obj["Key"] for obj in s3_client.list_objects_v2(Bucket=bucket, Prefix="throttled/")["Contents"])
    assert [key for key in listed if key.endswith(".ckpt")] == [f"throttled/rank{r}-step=2.ckpt" for r in range(8)]


RELAUNCHES = {
    # (the straggler's launch, the relaunch's): launcher environments of one job, or of two jobs
    "torchrun-restart": (
        {"TORCHELASTIC_RUN_ID": "job-{id}", "TORCHELASTIC_RESTART_COUNT": "0", "RANK": "1", "WORLD_SIZE": "2"},
        {"TORCHELASTIC_RUN_ID": "job-{id}", "TORCHELASTIC_RESTART_COUNT": "1", "RANK": "0", "WORLD_SIZE": "2"},
    ),
    "slurm-requeue": (
        {"SLURM_JOB_ID": "{id}", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"},
        {"SLURM_JOB_ID": "{id}", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_RESTART_COUNT": "1"},
    ),
    "new-torchrun-run-id": (  # two jobs: the later launch (start time) is the newer
        {"TORCHELASTIC_RUN_ID": "old-{id}", "TORCHELASTIC_RESTART_COUNT": "0", "RANK": "1", "WORLD_SIZE": "2"},
        {"TORCHELASTIC_RUN_ID": "new-{id}", "TORCHELASTIC_RESTART_COUNT": "0", "RANK": "0", "WORLD_SIZE": "2"},
    ),
}


@pytest.mark.parametrize("relaunch", list(RELAUNCHES))
def test_a_relaunch_fences_the_previous_launchs_straggler(
    relaunch: str, s3_server: S3Endpoint, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    """The straggler (a rank of the previous launch still running) saved before the relaunch; after the relaunch's
    first save every save, overwrite and removal of the straggler is refused and changes nothing. Within one job the
    restart count decides, not the clock: there the relaunch's process is started first."""
    if s3_server.name != "moto":
        pytest.skip("the same code on every backend: moto is enough")
    unique = str(uuid.uuid4().int % 10**8)
    old_env, new_env = ({k: v.format(id=unique) for k, v in env.items()} for env in RELAUNCHES[relaunch])
    env = rank_environment(s3_server, s3_server.endpoint_url)
    env["PYTHONPATH"] = os.pathsep.join([str(HELPERS), env["PYTHONPATH"]])
    one_job = relaunch != "new-torchrun-run-id"
    runs: list[Run] = []
    try:
        if one_job:  # the relaunch's process starts (and takes its start time) before the straggler's
            runs.append(Run({**env, **new_env}, tmp_path / "new.log"))
            runs.insert(0, Run({**env, **old_env}, tmp_path / "stale.log"))
        else:
            runs.append(Run({**env, **old_env}, tmp_path / "stale.log"))
            runs.append(Run({**env, **new_env}, tmp_path / "new.log"))
        stale, new = (run.ready() for run in runs)
        assert stale.run_id != new.run_id and "#" in stale.run_id and "#" in new.run_id
        directory = f"s3://{bucket}/relaunch"
        for name in ("step=10.ckpt", "last.ckpt"):
            assert stale("save", url=f"{directory}/{name}", step=10)["ok"]
        for name in ("step=20.ckpt", "last.ckpt"):  # the relaunch's first save takes the directory over
            assert new("save", url=f"{directory}/{name}", step=20)["ok"]
        before = snapshot(s3_client, bucket, "relaunch/")
        for answer in [
            stale("save", url=f"{directory}/step=11.ckpt", step=11),
            stale("save", url=f"{directory}/last.ckpt", step=11),
            stale("remove", url=f"{directory}/step=20.ckpt"),
            stale("remove", url=f"{directory}/step=10.ckpt"),
        ]:
            assert_refused(answer, stale, new, directory)
        assert snapshot(s3_client, bucket, "relaunch/") == before
        assert new("resume", dirpath=directory)["step"] == 20
    finally:
        for run in runs:
            run.close()


def test_a_straggler_that_never_saved_does_not_take_the_relaunchs_directory(
    s3_server: S3Endpoint, bucket: str, s3_client: Any
) -> None:
    """In one process, by the runs' fields: the previous launch's rank arrives after the relaunch took the directory
    (and after its start time), and is still the stale one; ranks of one launch adopt each other's record."""
    if s3_server.name != "moto":
        pytest.skip("the same code on every backend: moto is enough")
    started = current_run().started

    def rank_of(restart: int, pid: int, offset_s: float) -> CheckpointRun:
        return CheckpointRun(f"torchrun:j#{restart}", f"node{pid}", pid, started + offset_s, "torchrun:j", (restart,))

    directory = f"s3://{bucket}/late"
    relaunch_rank0, relaunch_rank1 = plugin_of(rank_of(1, 1, 0)), plugin_of(rank_of(1, 2, 5))
    relaunch_rank0.save_checkpoint(state(20), f"{directory}/rank0.ckpt")
    relaunch_rank1.save_checkpoint(state(20), f"{directory}/rank1.ckpt")  # the same run: adopted, not taken over
    relaunch_rank1.remove_checkpoint(f"{directory}/rank0.ckpt")
    straggler = plugin_of(rank_of(0, 3, 60))  # started a minute after the relaunch's ranks, by its clock
    before = snapshot(s3_client, bucket, "late/")
    with pytest.raises(CheckpointDirectoryTakenError, match="a later launch than this run"):
        straggler.save_checkpoint(state(11), f"{directory}/rank0.ckpt")
    with pytest.raises(CheckpointDirectoryTakenError):
        straggler.remove_checkpoint(f"{directory}/rank1.ckpt")
    assert snapshot(s3_client, bucket, "late/") == before
    record = json.loads(s3_client.get_object(Bucket=bucket, Key=f"late/{OWNER_RECORD_NAME}")["Body"].read())
    owner = (record["run"], record["job"], record["attempt"], record["generation"])
    assert owner == ("torchrun:j#1", "torchrun:j", [1], 1)


# --------------------------------------------------------------------------------------------------------------------
# No server
# --------------------------------------------------------------------------------------------------------------------


def _client_error(status: int, code: str) -> ClientError:
    return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def test_a_conflict_is_retried_a_failed_condition_is_not() -> None:
    assert is_retriable_error(_client_error(409, "ConditionalRequestConflict"))
    assert not is_retriable_error(_client_error(412, "PreconditionFailed"))


def test_the_refusal_and_the_run_travel_to_other_processes() -> None:
    """DCP sends a rank's failure to the coordinator pickled; ddp_spawn and DCP's process executor pickle plugins and
    writers, which must stay the run they were."""
    error = CheckpointDirectoryTakenError("refused", "s3://bucket/run", run_at(-1), run_at(0))
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.directory, copy.run, copy.owner) == ("refused", error.directory, error.run, error.owner)
    plugin = plugin_of(run_at(-5))
    assert pickle.loads(pickle.dumps(plugin))._run == plugin._run
    writer = s3_dcp.S3StorageWriter("s3://bucket/run/ckpt")
    assert pickle.loads(pickle.dumps(writer))._run == current_run()


LAUNCHER_ENVIRONMENTS = [
    ({}, None),
    (
        {"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"},
        LaunchIdentity("torchrun", "torchrun:abc", (2,)),
    ),
    (
        {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3", "SLURM_RESTART_COUNT": "1", "SLURM_JOB_START_TIME": "1700000000"},
        LaunchIdentity("slurm", "slurm:42", (1, 3), 1700000000.0),
    ),
    ({"SLURM_JOB_ID": "42"}, LaunchIdentity("slurm", "slurm:42", (0, -1))),  # a batch script: no step, no requeue
    (  # torchrun under srun: torchrun's default run id names nothing, SLURM's job does
        {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "1"},
        LaunchIdentity("slurm+torchrun", "slurm:42", (0, 0, 1)),
    ),
    (
        {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "TORCHELASTIC_RUN_ID": "r7", "TORCHELASTIC_RESTART_COUNT": "0"},
        LaunchIdentity("slurm+torchrun", "slurm:42/torchrun:r7", (0, 0, 0)),
    ),
]


@pytest.mark.parametrize(("environment", "expected"), LAUNCHER_ENVIRONMENTS)
def test_launch_identity_from_the_launchers_environment(
    environment: dict[str, str], expected: LaunchIdentity | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TORCHELASTIC_")):
            monkeypatch.delenv(name)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert launch_identity() == expected


def test_torchruns_default_run_id_names_the_agent_on_this_host(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TORCHELASTIC_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    identity = launch_identity()
    assert identity is not None and identity.job.startswith(f"torchrun:none@{socket.gethostname()}:{os.getppid()}:")
    assert identity.run_id == f"{identity.job}#0"


def test_which_run_is_newer() -> None:
    def run(job: str, attempt: tuple[int, ...], started: float) -> CheckpointRun:
        return CheckpointRun(f"{job}#{attempt}", "h", 1, started, job, attempt)

    # one job: the attempt decides, whatever the clocks say
    assert run("slurm:1", (1, 0), 100).is_newer_than(run("slurm:1", (0, 5), 200))
    assert not run("slurm:1", (0, 5), 200).is_newer_than(run("slurm:1", (1, 0), 100))
    assert not run("slurm:1", (1, 0), 100).is_newer_than(run("slurm:1", (1, 0), 50))  # the same launch
    # two jobs, or processes outside any launcher: the later start
    assert run("slurm:2", (0, 0), 200).is_newer_than(run("slurm:1", (3, 0), 100))
    assert run("", (), 200).is_newer_than(run("torchrun:x", (9,), 100))
    assert not run("", (), 100).is_newer_than(run("", (), 200))
