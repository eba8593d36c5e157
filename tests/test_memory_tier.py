"""The memory tier in front of S3: saves into the node's tmpfs, drains to S3, resume from the fastest tier.

Each test keeps its tiers under tmp_path (never /dev/shm). Two simulated nodes are two tier roots; a relaunch is a
second process (tests/helpers/tier_worker.py), a kill is a SIGKILL.
"""

from __future__ import annotations

import errno
import gc
import io
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_proxy import Fault, FaultProxy, FaultRule
from s3_servers import rank_environment, wait_for_ranks
from tiny_lightning import FAMILIES, TOP_K_CHECKPOINT, lightning_family, tiny_module_class, tiny_trainer

import connector
import s3_checkpoint_admin
import s3_checkpoint_cli
import s3_fencing
import s3_memory_tier
import s3_process
import s3_utils
from s3_checkpoint_io import S3CheckpointIO
from s3_memory_tier import COMMIT_RECORD_SUFFIX, MemoryTier, NodeTier

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "helpers" / "tier_worker.py"
MiB = 1 << 20


def make_checkpoint(step: int, mib: float = 1) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    weights = OrderedDict(weight=torch.randn(int(mib * MiB) // 4, generator=generator), bias=torch.arange(7.0) + step)
    return {"state_dict": weights, "global_step": step, "epoch": 0}


def assert_same(loaded: dict[str, Any], expected: dict[str, Any]) -> None:
    assert loaded["global_step"] == expected["global_step"]
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(loaded["state_dict"][name], tensor), name


def tiered(root: Path, **config: Any) -> S3CheckpointIO:
    return S3CheckpointIO(chunk_size_MB=5, memory_tier=MemoryTier(root=str(root), job="job-1", **config))


def s3_keys(s3_client: Any, bucket: str) -> list[str]:
    found = s3_client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return sorted(o["Key"] for o in found if "s3ckpt" not in o["Key"])


def test_a_save_lands_in_memory_as_on_s3_and_resumes_from_memory_bit_identical(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/run/ckpts/step=1-last.ckpt"
    plugin = tiered(tmp_path, drain_every=1)
    state = make_checkpoint(1)
    plugin.save_checkpoint(state, url)
    tier = plugin.node_tier()
    copy = tier.copy_of(url)
    assert copy is not None
    assert copy.path == tier.own / bucket / "run" / "ckpts" / "step=1-last.ckpt"  # the S3 layout
    assert stat.S_IMODE(copy.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(tier.record_path(copy.path).stat().st_mode) == 0o600
    for directory in (tier.own, copy.path.parent, tier.directory):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    plugin.teardown()
    memory_save, s3_save = plugin.records
    assert (memory_save.tier, s3_save.tier) == ("memory", "s3")
    assert memory_save.checksum == s3_save.checksum == copy.checksum  # one format, one record across the tiers
    assert s3_keys(s3_client, bucket) == ["run/ckpts/step=1-last.ckpt"]
    with s3_utils.S3Utils().download_to_memory(url) as downloaded, open(copy.path, "rb") as stream:
        assert downloaded.read_all() == stream.read()  # byte for byte

    relaunch = tiered(tmp_path)
    assert_same(relaunch.load_checkpoint(url, weights_only=True), state)
    assert relaunch.records[-1].tier == "memory"
    assert relaunch.records[-1].checksum == copy.checksum


def test_drained_then_tier_wiped_resumes_from_s3(s3_server: Any, bucket: str, tmp_path: Path) -> None:
    url = f"s3://{bucket}/run/step=3-last.ckpt"
    plugin = tiered(tmp_path / "node0")
    state = make_checkpoint(3)
    plugin.save_checkpoint(state, url)
    plugin.teardown()
    assert plugin.node_tier().remove(url)  # the node's memory is gone (a new allocation)
    relaunch = tiered(tmp_path / "node0")
    assert_same(relaunch.load_checkpoint(url), state)
    assert relaunch.records[-1].tier == "s3"


def test_resume_discovery_takes_the_newest_step_of_any_tier(s3_server: Any, bucket: str, tmp_path: Path) -> None:
    directory = f"s3://{bucket}/run"
    plugin = tiered(tmp_path / "node0", drain_every=10)  # the first save drains, the next ones stay in memory
    for step in (1, 2, 3):
        plugin.save_checkpoint(make_checkpoint(step), f"{directory}/step={step}-last.ckpt")
    plugin.wait_for_pending_saves()
    found = connector.find_resume_checkpoints(directory, s3_utils=plugin.s3)
    assert found[0] == f"{directory}/step=3-last.ckpt"  # newest, in memory only
    assert f"{directory}/step=1-last.ckpt" in found  # on S3 (and dropped from memory: keep=2)
    del plugin  # its process is gone (without a clean end: no last drain)
    gc.collect()
    other_node = tiered(tmp_path / "node1")  # another node's tier does not hold steps 2 and 3
    found_elsewhere = connector.find_resume_checkpoints(directory, s3_utils=other_node.s3)
    assert found_elsewhere[0] == f"{directory}/step=1-last.ckpt"
    assert_same(other_node.load_checkpoint(found_elsewhere[0]), make_checkpoint(1))


def test_a_memory_copy_that_fails_its_checksum_is_skipped_loudly_for_s3(
    s3_server: Any, bucket: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"s3://{bucket}/run/step=4-last.ckpt"
    plugin = tiered(tmp_path)
    state = make_checkpoint(4)
    plugin.save_checkpoint(state, url)
    plugin.teardown()
    path = plugin.node_tier().path_of(url)
    with open(path, "r+b") as stream:  # one flipped byte in the middle of a tensor
        stream.seek(path.stat().st_size // 2)
        byte = stream.read(1)
        stream.seek(-1, os.SEEK_CUR)
        stream.write(bytes([byte[0] ^ 0xFF]))
    relaunch = tiered(tmp_path)
    with caplog.at_level(logging.ERROR, logger="s3_checkpoint_io"):
        assert_same(relaunch.load_checkpoint(url), state)
    assert relaunch.records[-1].tier == "s3"
    assert any("does not match its commit record" in r.getMessage() and str(path) in r.getMessage()
               for r in caplog.records if r.levelno == logging.ERROR)


def test_a_full_tier_warns_once_and_saves_to_s3_directly(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plugin = tiered(tmp_path, capacity_bytes=MiB // 2)  # less than one checkpoint
    with caplog.at_level(logging.INFO, logger="s3_memory_tier"):
        for step in (1, 2):
            plugin.save_checkpoint(make_checkpoint(step), f"s3://{bucket}/run/step={step}.ckpt")
    plugin.teardown()
    assert [r.tier for r in plugin.records] == ["s3", "s3"]
    assert s3_keys(s3_client, bucket) == ["run/step=1.ckpt", "run/step=2.ckpt"]
    assert plugin.node_tier().copies() == []
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "no room" in r.getMessage()]
    assert len(warnings) == 1
    assert_same(tiered(tmp_path).load_checkpoint(f"s3://{bucket}/run/step=2.ckpt"), make_checkpoint(2))


def test_a_save_that_finds_no_room_leaves_no_older_memory_copy_of_its_url(
    s3_server: Any, bucket: str, tmp_path: Path
) -> None:
    """A URL saved again (Lightning's ``last.ckpt``) when the tier has no room goes to S3, and the older copy of that
    URL leaves memory: a load reads the newer checkpoint, not the older one from memory."""
    plugin = tiered(tmp_path, capacity_bytes=3 * MiB)
    url = f"s3://{bucket}/run/last.ckpt"
    plugin.save_checkpoint(make_checkpoint(1), url)
    plugin.wait_for_pending_saves()
    newer = make_checkpoint(2, mib=4)
    plugin.save_checkpoint(newer, url)  # no room: to S3 directly
    assert_same(plugin.load_checkpoint(url), newer)
    assert [(r.kind, r.tier) for r in plugin.records][-1] == ("load", "s3")
    plugin.teardown()


def test_at_most_keep_checkpoints_stay_in_memory(s3_server: Any, bucket: str, tmp_path: Path) -> None:
    plugin = tiered(tmp_path, keep=2, drain_every=100)
    for step in range(1, 6):
        plugin.save_checkpoint(make_checkpoint(step, mib=0.25), f"s3://{bucket}/run/step={step}.ckpt")
        plugin.wait_for_pending_saves()
        assert len(plugin.node_tier().copies()) <= 2
    assert [copy.record["step"] for copy in plugin.node_tier().copies()] == [4, 5]
    files = [p for p in plugin.node_tier().own.rglob("*") if p.is_file()]
    assert len(files) == 4  # two checkpoints and their commit records, no leftovers
    plugin.teardown()  # the last one is drained at the end of a run
    assert plugin.node_tier().copy_of(f"s3://{bucket}/run/step=5.ckpt").drain == "done"


def test_top_k_removal_keeps_the_s3_copy_until_a_newer_one_is_on_s3(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    plugin = tiered(tmp_path, drain_every=2)  # steps 1, 3 drain
    urls = [f"s3://{bucket}/run/step={step}.ckpt" for step in (1, 2, 3)]
    plugin.save_checkpoint(make_checkpoint(1), urls[0])
    plugin.wait_for_pending_saves()
    plugin.save_checkpoint(make_checkpoint(2), urls[1])
    plugin.remove_checkpoint(urls[0])  # top-k drops step 1, but S3 has nothing newer yet
    plugin.wait_for_pending_saves()
    assert s3_keys(s3_client, bucket) == ["run/step=1.ckpt"]
    assert plugin.node_tier().copy_of(urls[0]) is None  # the memory copy went at once
    plugin.save_checkpoint(make_checkpoint(3), urls[2])
    plugin.remove_checkpoint(urls[1])
    plugin.teardown()
    assert s3_keys(s3_client, bucket) == ["run/step=3.ckpt"]


def test_a_drain_cut_short_by_a_kill_is_finished_by_the_relaunch(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/run/step=7-last.ckpt"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    killed = subprocess.run(
        [sys.executable, str(WORKER), "save", url, str(tmp_path), "job-1", "7"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr[-3000:]
    assert s3_keys(s3_client, bucket) == []
    relaunch = subprocess.run(
        [sys.executable, str(WORKER), "relaunch", str(tmp_path), "job-1"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env,
    )
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    records = json.loads(relaunch.stdout.strip().splitlines()[-1])
    assert [(kind, where) for kind, _, _, _, where in records] == [("save", "s3")]
    tier = NodeTier(MemoryTier(root=str(tmp_path), job="job-1"), s3_fencing.current_run())
    copy = tier.verified_copy(url)
    assert copy is not None and copy.drain == "done"
    assert records[0][3] == copy.checksum
    with s3_utils.S3Utils().download_to_memory(url) as downloaded, open(copy.path, "rb") as stream:
        assert downloaded.verified_against is not None
        assert downloaded.read_all() == stream.read()


def test_a_relaunch_does_not_drain_a_checkpoint_whose_removal_was_asked_for_while_it_drained(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    """A kill during a drain whose checkpoint was removed meanwhile (top-k, the "-last" clean-up) left it pending: each
    relaunch uploaded it, and memory held every such copy (a prune keeps pending drains), so under frequent kills
    the backlog grew and S3 fell ever further behind. Its record now says so: the relaunch drops it and uploads
    nothing of it; it finishes the other drains newest first."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    removed, kept = f"s3://{bucket}/run/step=7-last.ckpt", f"s3://{bucket}/run/step=8.ckpt"
    for mode, url, seed in (("save-remove", removed, "7"), ("save", kept, "8")):  # the second: a relaunch, killed
        killed = subprocess.run(
            [sys.executable, str(WORKER), mode, url, str(tmp_path), "job-1", seed],
            capture_output=True, text=True, timeout=120, cwd=REPO, env=env,
        )  # fmt: skip
        assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr[-3000:]
    tier = NodeTier(MemoryTier(root=str(tmp_path), job="job-1"), s3_fencing.current_run())
    assert [copy.url for copy in tier.pending_drains()] == [kept]
    relaunch = subprocess.run(
        [sys.executable, str(WORKER), "relaunch", str(tmp_path), "job-1"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env,
    )  # fmt: skip
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    assert [record[1] for record in json.loads(relaunch.stdout.strip().splitlines()[-1])] == [kept]
    assert s3_keys(s3_client, bucket) == ["run/step=8.ckpt"]
    assert tier.copy_of(removed) is None


def slow_first_drain(proxy: FaultProxy, root: Path) -> S3CheckpointIO:
    """A plugin through `proxy` whose first drain is slow (its first PUT stalls 3 s), keeping one copy in memory and
    draining every third save: later drains wait in the queue behind the first."""
    proxy.add_rule(FaultRule(Fault.stall(3.0), method="PUT", times=1))
    return S3CheckpointIO(
        chunk_size_MB=5, endpoint_url=proxy.endpoint_url,
        memory_tier=MemoryTier(root=str(root), job="job-1", keep=1, drain_every=3),
    )  # fmt: skip


def test_a_checkpoint_removed_while_its_drain_runs_is_still_drained_whatever_newer_saves_prune(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    """The "-last" clean-up removes a checkpoint whose drain to S3 is slow; newer saves prune the tier meanwhile: the
    copy stays until its drain has read it (a prune that dropped it made the drain fail, raised at the next save)."""
    urls = [f"s3://{bucket}/run/step={step}-last.ckpt" for step in range(1, 7)]
    with FaultProxy(s3_server.endpoint_url) as proxy:
        plugin = slow_first_drain(proxy, tmp_path)
        plugin.save_checkpoint(make_checkpoint(1, mib=0.5), urls[0])  # the first save drains (slowly); the 4th's
        for step in range(2, 7):  # drain waits behind it while step 5's save removes step 4 and prunes
            plugin.save_checkpoint(make_checkpoint(step, mib=0.5), urls[step - 1])
            plugin.remove_checkpoint(urls[step - 2])  # the "-last" clean-up; each save prunes to keep=1
        plugin.teardown()  # raises what a drain raised
    assert s3_keys(s3_client, bucket) == ["run/step=6-last.ckpt"]  # the older ones went once a newer one was there


def test_a_load_from_memory_does_not_wait_for_that_checkpoints_drain_to_s3(
    s3_server: Any, bucket: str, tmp_path: Path
) -> None:
    """A restart reads its committed memory copy at once, while S3 is still slow to take that checkpoint's drain
    (a relaunch finishing several drains a kill left used to wait for all of them before its resume)."""
    url = f"s3://{bucket}/run/step=1-last.ckpt"
    with FaultProxy(s3_server.endpoint_url) as proxy:
        stalled = proxy.add_rule(FaultRule(Fault.stall(4.0), method="PUT", times=1))
        plugin = S3CheckpointIO(
            chunk_size_MB=5, endpoint_url=proxy.endpoint_url, memory_tier=MemoryTier(root=str(tmp_path), job="job-1")
        )
        expected = make_checkpoint(1)
        plugin.save_checkpoint(expected, url)  # into memory; its drain to S3 is queued, and its first PUT stalls
        assert_same(plugin.load_checkpoint(url), expected)
        assert [(r.kind, r.tier) for r in plugin.records] == [("save", "memory"), ("load", "memory")]
        plugin.teardown()  # the drain went on meanwhile, and ends
    assert stalled.fired == 1
    assert [(r.kind, r.tier) for r in plugin.records][-1] == ("save", "s3")


def test_a_url_saved_again_while_its_drain_waits_in_the_queue_is_kept_and_drained(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    """A drain waits behind a slow one; meanwhile its URL is saved again (a relaunch saving a step again) and newer
    saves prune the tier to `keep`: the new copy stays until the queued drain uploads it, and S3 gets the new bytes
    (the pruned copy made the drain fail with FileNotFoundError, raised at the next save)."""
    url = f"s3://{bucket}/run/step=4-last.ckpt"
    with FaultProxy(s3_server.endpoint_url) as proxy:
        plugin = slow_first_drain(proxy, tmp_path)
        for step in (1, 2, 3):
            plugin.save_checkpoint(make_checkpoint(step), f"s3://{bucket}/run/step={step}-last.ckpt")
        plugin.save_checkpoint(make_checkpoint(4), url)  # the 4th save: its drain is queued behind the first
        newer = make_checkpoint(4)
        newer["state_dict"]["bias"] += 1
        plugin.save_checkpoint(newer, url)  # saved again, its drain not due
        plugin.save_checkpoint(make_checkpoint(6), f"s3://{bucket}/run/step=6-last.ckpt")  # prunes to keep=1
        plugin.teardown()
    body = s3_client.get_object(Bucket=bucket, Key="run/step=4-last.ckpt")["Body"].read()
    assert_same(torch.load(io.BytesIO(body), weights_only=True), newer)


def run_of(attempt: int) -> s3_fencing.CheckpointRun:
    return s3_fencing.CheckpointRun(f"slurm:9#{attempt}", "host", 1, 1.0, "slurm:9", (attempt,))


def test_a_straggler_of_an_older_launch_cannot_write_into_the_newer_launchs_tier(tmp_path: Path) -> None:
    config = MemoryTier(root=str(tmp_path))
    newer = NodeTier(config, run_of(1))
    newer.claim()
    straggler = NodeTier(config, run_of(0))
    assert straggler.directory == newer.directory  # the same job's tier
    with pytest.raises(s3_fencing.CheckpointDirectoryTakenError, match="newer launch"):
        straggler.save({"x": torch.ones(3)}, "s3://bkt/run/step=1.ckpt", 1, torch.save)
    assert newer.copies() == []
    assert not list(newer.own.rglob("*.ckpt*"))
    newer.save({"x": torch.ones(3)}, "s3://bkt/run/step=2.ckpt", 2, torch.save)  # the newer launch still writes
    assert [copy.record["step"] for copy in newer.copies()] == [2]
    assert NodeTier(MemoryTier(root=str(tmp_path), job="another"), run_of(0)).copies() == []  # other jobs see none


def test_a_straggler_stopped_after_its_claim_commits_and_drops_nothing_once_it_continues(tmp_path: Path) -> None:
    """A straggler claims, is stopped while it writes, and the newer launch takes the tier over and saves the same
    URL meanwhile: once it continues, its commit is refused, and its removals and prunes drop nothing."""
    config = MemoryTier(root=str(tmp_path), keep=1)
    straggler, newer = NodeTier(config, run_of(0)), NodeTier(config, run_of(1))
    url = "s3://bkt/run/step=2-last.ckpt"
    straggler.save({"x": torch.zeros(3)}, "s3://bkt/run/step=1-last.ckpt", 1, torch.save)

    def write_while_the_newer_launch_saves(checkpoint: object, stream: object) -> None:
        torch.save(checkpoint, stream)
        newer.save({"x": torch.ones(3)}, url, 2, torch.save)

    with pytest.raises(s3_fencing.CheckpointDirectoryTakenError, match="newer launch"):
        straggler.save({"x": torch.full((3,), 7.0)}, url, 2, write_while_the_newer_launch_saves)
    assert straggler.remove(url) is False
    assert straggler.prune() == []
    [copy] = [c for c in newer.copies() if c.url == url]
    assert copy.record["run"]["run_id"] == "slurm:9#1"
    assert torch.equal(torch.load(copy.path, weights_only=True)["x"], torch.ones(3))
    left = sorted(p.name for p in newer.own.rglob("*") if p.is_file())  # no temporary of the straggler's either
    assert left == ["step=1-last.ckpt", "step=1-last.ckpt.s3ckpt-tier.json", url.rpartition("/")[2],
                    "step=2-last.ckpt.s3ckpt-tier.json"]  # fmt: skip


STOPPED_INSIDE_THE_LOCK = """
import os, signal, sys, torch
import s3_fencing, s3_memory_tier
run = s3_fencing.CheckpointRun("slurm:9#0", "host", 1, 1.0, "slurm:9", (0,))
tier = s3_memory_tier.NodeTier(s3_memory_tier.MemoryTier(root=sys.argv[1]), run)
tier.claim()
with tier._launch_lock():  # as a commit between its launch check and its renames
    print("locked", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
try:
    tier.save({"x": torch.zeros(3)}, "s3://bkt/run/step=3.ckpt", 3, torch.save)
except s3_fencing.CheckpointDirectoryTakenError:
    print("refused", flush=True)
"""


def test_a_straggler_stopped_inside_the_tiers_lock_holds_no_relaunch_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A straggler stopped (SIGSTOP) while it holds the tier's short launch lock: the relaunch's claim waits a
    bounded time, says so, and goes on under a fresh lock (its next commits do not wait again); the straggler,
    once it continues, commits nothing more."""
    monkeypatch.setattr(s3_fencing, "TAKEOVER_LOCK_WAIT_S", 1.0)
    straggler = subprocess.Popen(
        [sys.executable, "-c", STOPPED_INSIDE_THE_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        assert straggler.stdout is not None and straggler.stdout.readline() == "locked\n"
        newer = NodeTier(MemoryTier(root=str(tmp_path)), run_of(1))
        claimed = threading.Thread(target=newer.claim, daemon=True)  # the old code waited here forever
        with caplog.at_level(logging.WARNING, logger="s3_fencing"):
            claimed.start()
            claimed.join(timeout=30)
            assert not claimed.is_alive(), "the relaunch still waits for the stopped straggler's lock"
        assert "stayed locked for 1 s" in caplog.text and "fresh lock" in caplog.text
        started = time.monotonic()
        newer.save({"x": torch.ones(3)}, "s3://bkt/run/step=2.ckpt", 2, torch.save)
        assert time.monotonic() - started < 1.0  # under the fresh lock: no second wait
        straggler.send_signal(signal.SIGCONT)
        assert straggler.communicate(timeout=60)[0] == "refused\n" and straggler.returncode == 0
    finally:
        straggler.kill()
        straggler.wait()
    assert [(copy.record["step"], copy.record["run"]["run_id"]) for copy in newer.copies()] == [(2, "slurm:9#1")]
    assert stat.S_IMODE(os.lstat(newer.directory / ".launch.lock").st_mode) == 0o600  # the fresh one: private too


def test_an_uncommitted_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    tier = NodeTier(MemoryTier(root=str(tmp_path), job="j"), run_of(0))
    copy = tier.save({"x": torch.ones(3)}, "s3://bkt/run/step=1.ckpt", 1, torch.save)
    os.unlink(tier.record_path(copy.path))  # a kill between the data's rename and the record's
    assert tier.copy_of(copy.url) is None and tier.copies() == []
    assert tier.record_path(copy.path).name.endswith(COMMIT_RECORD_SUFFIX)


def test_the_tier_is_configured_by_one_argument_or_config_key(s3_server: Any, bucket: str, tmp_path: Path) -> None:
    assert S3CheckpointIO(memory_tier=str(tmp_path)).memory_tier == MemoryTier(root=str(tmp_path))
    assert S3CheckpointIO().memory_tier is None
    parts = connector.build_s3_checkpointing(
        {
            "s3_checkpointing": {"memory_tier": {"root": str(tmp_path), "keep": 3, "drain_every": 10}},
            "exp_manager": {"checkpoint_callback_params": {"dirpath": f"s3://{bucket}/run"}},
        }
    )
    assert parts.checkpoint_io.memory_tier == MemoryTier(root=str(tmp_path), keep=3, drain_every=10)
    with pytest.raises(ValueError, match="unknown key"):
        S3CheckpointIO(memory_tier={"rooot": str(tmp_path)})


def test_without_the_module_the_core_and_the_dcp_writer_and_reader_say_what_is_missing() -> None:
    code = (
        "import sys; sys.modules['s3_memory_tier'] = None\n"
        "from s3_checkpoint_io import S3CheckpointIO\n"
        "from s3_dcp import S3StorageReader, S3StorageWriter\n"
        "S3CheckpointIO(), S3StorageWriter('s3://bkt/x'), S3StorageReader('s3://bkt/x')\n"
        "for make in (lambda: S3CheckpointIO(memory_tier=True),\n"
        "             lambda: S3StorageWriter('s3://bkt/x', memory_tier=True),\n"
        "             lambda: S3StorageReader('s3://bkt/x', memory_tier={'keep': 1})):\n"
        "    try:\n        make()\n    except ImportError as exc:\n        print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "AWS_DEFAULT_REGION": "us-east-1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "s3_memory_tier.py beside s3_checkpoint_io.py" in done.stdout
    assert done.stdout.count("memory_tier needs s3_memory_tier.py beside s3_dcp.py") == 2


def test_a_sibling_file_a_fork_lacks_is_named_with_what_needs_it_and_where_to_copy_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One message for every module: the missing file (the sibling asked for, or one it imports at its top that the
    caller names), what needs it, beside which file; another missing module is not hidden behind it."""
    monkeypatch.setitem(sys.modules, "s3_memory_tier", None)  # as if the file were absent
    monkeypatch.delitem(sys.modules, "s3_dcp_tier", raising=False)
    expected = r"^memory_tier for megatron-core needs s3_memory_tier\.py beside s3_mcore\.py .*: copy it there$"
    with pytest.raises(ImportError, match=expected):
        s3_process.require_sibling("s3_dcp_tier", None, "memory_tier for megatron-core", "s3_mcore.py",
                                   needs=("s3_memory_tier",))  # fmt: skip
    with pytest.raises(ModuleNotFoundError):  # s3_dcp_tier's own import, not named as needed: raised as it is
        s3_process.require_sibling("s3_dcp_tier", None, "memory_tier", "s3_dcp.py")
    with pytest.raises(ImportError, match=r"^listing needs s3_nowhere\.py beside s3_x\.py .*copy it there, or not$"):
        s3_process.require_sibling("s3_nowhere", None, "listing", "s3_x.py", otherwise=", or not")
    assert s3_process.require_sibling("s3_fencing", None, "x", "y.py") is sys.modules["s3_fencing"]


@pytest.mark.slow
def test_two_nodes_replicate_and_agree_on_what_every_rank_can_load(
    s3_server: Any, bucket: str, tmp_path: Path
) -> None:
    """Two gloo ranks, each a node with its own tier: node 0's in-memory checkpoint is replicated to node 1, and a
    collective load uses memory only where every rank has a verified copy, else S3 on every rank alike."""
    env = rank_environment(s3_server, s3_server.endpoint_url, WORLD_SIZE="2")
    procs = [
        subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "helpers" / "tier_dist_worker.py"), bucket, str(tmp_path)],
            env={**env, "RANK": str(rank), "GROUP_RANK": str(rank), "LOCAL_RANK": "0"}, cwd=REPO,
        )
        for rank in range(2)
    ]
    assert wait_for_ranks(procs, 300) == [0, 0]
    node0, node1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2))
    step1, step2 = (f"s3://{bucket}/run/step={step}-last.ckpt" for step in (1, 2))
    assert node0["own"] == [step1, step2] and node1["own"] == []
    name = NodeTier.record_path(Path("x")).name  # the commit record travels with the file
    assert any(p.endswith("/step=2-last.ckpt") for p in node1["replicas"])
    assert any(p.endswith("/step=2-last.ckpt" + name[1:]) for p in node1["replicas"])
    for node in (node0, node1):  # step 2 is only in node 0's memory: no rank loads it; step 1 from S3 everywhere
        assert node["loads"] == [[step2, "missing", None], [step1, True, "s3"]]


@pytest.mark.lightning
@pytest.mark.parametrize("family", FAMILIES)
def test_a_lightning_fit_saves_into_memory_keeps_top_k_on_s3_and_resumes_from_memory(
    family: str, s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    pl = lightning_family(family)
    module_class = tiny_module_class(pl, features=8, outputs=2)
    dirpath = f"s3://{bucket}/run"

    def fit(module: Any, max_steps: int, **fit_kwargs: Any) -> tuple[Any, S3CheckpointIO]:
        tier = MemoryTier(root=str(tmp_path), job="j", drain_every=2)
        plugin = S3CheckpointIO(dirpath, chunk_size_MB=5, memory_tier=tier)
        callback = connector.s3_model_checkpoint_class(family)(dirpath=dirpath, **TOP_K_CHECKPOINT)
        trainer = tiny_trainer(pl, max_steps, plugins=[plugin], callbacks=[callback])
        trainer.fit(module, **fit_kwargs)
        return trainer, plugin

    first = module_class()
    _, plugin = fit(first, 6)
    final_weights = {k: v.clone() for k, v in first.state_dict().items()}
    assert {r.tier for r in plugin.records if r.kind == "save"} == {"memory", "s3"}
    assert plugin.records[-1].tier == "s3" and plugin.records[-1].url == f"{dirpath}/last.ckpt"  # drained at the end
    assert [k for k in s3_keys(s3_client, bucket) if k.endswith(".ckpt")] == [
        "run/last.ckpt", "run/tiny-step=4.ckpt", "run/tiny-step=6.ckpt"
    ]  # top-k as without the tier: step 2 left S3 once a newer checkpoint was there
    assert not s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads")

    second = module_class()
    resumed, resume_plugin = fit(second, 8, ckpt_path=f"{dirpath}/last.ckpt")
    assert [r.tier for r in resume_plugin.records if r.kind == "load"] == ["memory"]
    assert second.started_at["global_step"] == 6
    for name, tensor in final_weights.items():
        assert torch.equal(second.started_at["weights"][name], tensor), name
    assert resumed.global_step == 8


def test_ls_shows_each_checkpoints_tiers(
    s3_server: Any, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = f"s3://{bucket}/run"
    plugin = tiered(tmp_path, drain_every=10, keep=3)  # step 1 drains, step 2 stays in memory
    for step in (1, 2):
        plugin.save_checkpoint(make_checkpoint(step, mib=0.25), f"{directory}/step={step}.ckpt")
    plugin.wait_for_pending_saves()
    plugin.node_tier().remove(f"{directory}/step=1.ckpt")  # memory lost it: only on S3 now
    plugin.save_checkpoint(make_checkpoint(3, mib=0.25), f"{directory}/step=3.ckpt")
    plugin.teardown()  # step 3: memory and S3
    listed = s3_checkpoint_admin.list_checkpoints(directory, memory_tier={"root": str(tmp_path), "job": "job-1"})
    assert [(entry.step, entry.tiers) for entry in listed] == [
        (1, ("s3",)), (2, ("memory",)), (3, ("s3", "memory"))
    ]
    assert [entry.step for entry in s3_checkpoint_admin.list_checkpoints(directory)] == [1, 3]  # S3 alone
    assert s3_checkpoint_cli.main(["ls", directory, "--memory-tier", str(tmp_path), "--job", "job-1"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:-1]
    assert [row.split("  [")[-1] for row in rows] == ["s3]", "memory]", "s3, memory]"]
    assert s3_checkpoint_cli.main(["ls", directory, "--json", "--memory-tier", str(tmp_path), "--job", "job-1"]) == 0
    assert [entry["tiers"] for entry in json.loads(capsys.readouterr().out)] == [["s3"], ["memory"], ["s3", "memory"]]
    with pytest.raises(ValueError, match="needs its job"):
        s3_checkpoint_admin.list_checkpoints(directory, memory_tier=str(tmp_path))


def test_a_checkpoint_saved_again_after_its_removal_stays(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    plugin = tiered(tmp_path, drain_every=10)
    first, second = (f"s3://{bucket}/run/{name}.ckpt" for name in ("a", "b"))
    plugin.save_checkpoint(make_checkpoint(1), first)  # drained
    plugin.save_checkpoint(make_checkpoint(2), second)
    plugin.remove_checkpoint(first)  # held for S3 until a newer checkpoint is there
    plugin.save_checkpoint(make_checkpoint(3), first)  # the same name again: the removal no longer applies
    plugin.teardown()  # drains the newest, `first`
    assert s3_keys(s3_client, bucket) == ["run/a.ckpt"]
    assert_same(tiered(tmp_path / "elsewhere").load_checkpoint(first), make_checkpoint(3))
    assert plugin.node_tier().copy_of(first) is not None


def test_enospc_in_the_middle_of_a_save_warns_once_and_saves_to_s3(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The tmpfs fills up while torch.save writes (the room check passed): no failed step, nothing left behind."""
    written = {"bytes": 0}
    real_write = s3_memory_tier._ChecksummingFile._write_all

    def write_until_full(self: Any, view: memoryview) -> None:
        written["bytes"] += len(view)
        if written["bytes"] > MiB // 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(self, view)

    monkeypatch.setattr(s3_memory_tier._ChecksummingFile, "_write_all", write_until_full)
    plugin = tiered(tmp_path)
    with caplog.at_level(logging.INFO, logger="s3_memory_tier"):
        for step in (1, 2):
            plugin.save_checkpoint(make_checkpoint(step), f"s3://{bucket}/run/step={step}.ckpt")
    plugin.teardown()
    assert [r.tier for r in plugin.records] == ["s3", "s3"]
    assert s3_keys(s3_client, bucket) == ["run/step=1.ckpt", "run/step=2.ckpt"]
    assert [p for p in plugin.node_tier().own.rglob("*") if p.is_file()] == []  # no partial file or record
    assert len([r for r in caplog.records if r.levelno == logging.WARNING and "no room" in r.getMessage()]) == 1


def test_drain_minutes_drains_once_the_time_has_passed(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    plugin = tiered(tmp_path, drain_every=100, drain_minutes=1 / 60_000)  # a millisecond
    for step in (1, 2, 3):
        plugin.save_checkpoint(make_checkpoint(step, mib=0.25), f"s3://{bucket}/run/step={step}.ckpt")
        plugin.wait_for_pending_saves()
        time.sleep(0.01)
    assert s3_keys(s3_client, bucket) == ["run/step=1.ckpt", "run/step=2.ckpt", "run/step=3.ckpt"]
    untimed = tiered(tmp_path / "other", drain_every=100)
    for step in (4, 5):
        untimed.save_checkpoint(make_checkpoint(step, mib=0.25), f"s3://{bucket}/other/step={step}.ckpt")
    untimed.wait_for_pending_saves()
    assert [k for k in s3_keys(s3_client, bucket) if k.startswith("other/")] == ["other/step=4.ckpt"]  # the first


@pytest.mark.lightning
@pytest.mark.parametrize("family", FAMILIES)
def test_a_name_held_only_in_memory_exists_for_model_checkpoint(
    family: str, s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    """ModelCheckpoint's "does this name exist?" (its -vN versioning) sees checkpoints that are committed in the
    node's memory tier and not on S3, so their name is not handed out again while their copy waits to drain."""
    pl = lightning_family(family)
    dirpath = f"s3://{bucket}/run"
    plugin = S3CheckpointIO(dirpath, chunk_size_MB=5, memory_tier=MemoryTier(root=str(tmp_path), job="j",
                                                                              drain_every=10))  # fmt: skip
    callback = connector.s3_model_checkpoint_class(family)(dirpath=dirpath, filename="tiny-{step}")
    trainer = tiny_trainer(pl, 1, plugins=[plugin], callbacks=[callback])
    on_s3, in_memory, unused = (f"{dirpath}/tiny-step={step}.ckpt" for step in (1, 2, 3))
    plugin.save_checkpoint(make_checkpoint(1), on_s3)  # the first save drains
    plugin.save_checkpoint(make_checkpoint(2), in_memory)  # the next nine stay in memory
    plugin.wait_for_pending_saves()
    assert s3_keys(s3_client, bucket) == ["run/tiny-step=1.ckpt"]
    assert callback.file_exists(on_s3, trainer)
    assert callback.file_exists(in_memory, trainer)
    assert not callback.file_exists(unused, trainer)
    plugin.remove_checkpoint(in_memory)
    assert not callback.file_exists(in_memory, trainer)  # gone from memory, never on S3


@pytest.mark.lightning
@pytest.mark.parametrize("family", FAMILIES)
def test_nemo_resume_if_exists_finds_and_loads_a_checkpoint_only_in_memory(
    family: str, s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    """NeMo-style config with the ``s3_checkpointing: memory_tier:`` key and ``resume_if_exists``: a relaunch on the
    same node resumes from the newest checkpoint although only the node's memory tier holds it (S3 lost it, or its
    drain never ran), and reads it from memory."""
    pl = lightning_family(family)
    module_class = tiny_module_class(pl, features=8, outputs=2)
    dirpath = f"s3://{bucket}/run"
    cfg = {
        "s3_checkpointing": {"memory_tier": {"root": str(tmp_path), "job": "j", "drain_every": 10}},
        "exp_manager": {
            "resume_if_exists": True,
            "resume_ignore_no_checkpoint": True,
            "checkpoint_callback_params": {"dirpath": dirpath, **TOP_K_CHECKPOINT},
        },
    }

    def launch(module: Any, max_steps: int) -> tuple[Any, Any]:
        trainer = tiny_trainer(pl, max_steps)
        parts = connector.configure_s3_checkpointing(trainer, cfg)
        trainer.fit(module)
        return parts, trainer

    first = module_class()
    parts, _ = launch(first, 4)
    newest = f"{dirpath}/tiny-step=4-last.ckpt"  # NeMo's {filename}-last
    assert parts.checkpoint_io.node_tier().copy_of(newest) is not None
    s3_client.delete_object(Bucket=bucket, Key="run/tiny-step=4-last.ckpt")  # on S3 no longer: memory only
    assert "run/tiny-step=4-last.ckpt" not in s3_keys(s3_client, bucket)
    weights = {k: v.clone() for k, v in first.state_dict().items()}
    del parts
    gc.collect()

    second = module_class()
    resumed, trainer = launch(second, 6)
    assert resumed.resume_path == newest
    assert [r.tier for r in resumed.checkpoint_io.records if r.kind == "load"] == ["memory"]
    assert second.started_at["global_step"] == 4
    for name, tensor in weights.items():
        assert torch.equal(second.started_at["weights"][name], tensor), name
    assert trainer.global_step == 6


def test_ranks_sharing_a_node_keep_keep_checkpoints_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks of one node save their parts of each step into the node's tier: `keep` counts each rank's copies,
    so a step stays whole in memory while the next one is only partly saved, and `keep` steps stay, not fewer."""
    config = MemoryTier(root=str(tmp_path), job="j", keep=2)
    ranks = {rank: NodeTier(config, run_of(0)) for rank in (0, 1)}

    def save(rank: int, step: int) -> None:
        monkeypatch.setenv("RANK", str(rank))
        ranks[rank].save({"x": torch.full((4,), float(step))}, f"s3://bkt/run/rank{rank}/step={step}.ckpt", step,
                         torch.save)  # fmt: skip
        ranks[rank].prune()

    def held() -> list[tuple[int, int]]:
        return sorted((copy.record["rank"], copy.record["step"]) for copy in ranks[0].copies())

    for step in (1, 2):
        save(0, step)
        save(1, step)
    save(0, 3)  # rank 1 has not saved step 3 yet: steps 2 (whole) and 1 (rank 1's part) stay
    assert held() == [(0, 2), (0, 3), (1, 1), (1, 2)]
    save(1, 3)
    assert held() == [(0, 2), (0, 3), (1, 2), (1, 3)]


def test_a_copy_waiting_for_its_drain_counts_toward_keep(tmp_path: Path) -> None:
    """While the drain of an older copy to S3 is pending, that copy stays and counts: the node holds `keep` copies,
    the draining one and the newest, not `keep` newest ones besides it."""
    tier = NodeTier(MemoryTier(root=str(tmp_path), job="j", keep=2), run_of(0))
    copies = [tier.save({"x": torch.ones(4)}, f"s3://bkt/run/step={step}.ckpt", step, torch.save) for step in (1, 2)]
    tier.set_drain(copies[0], "pending")
    tier.save({"x": torch.ones(4)}, "s3://bkt/run/step=3.ckpt", 3, torch.save)
    tier.prune()
    assert [(copy.record["step"], copy.drain) for copy in tier.copies()] == [(1, "pending"), (3, None)]


def test_the_copy_a_resume_agreed_on_stays_while_finishing_drains_prune_the_tier(
    s3_server: Any, bucket: str, tmp_path: Path
) -> None:
    """A relaunch finishes the drains its predecessor left pending, and each finished drain prunes the tier to
    `keep`. The copy the ranks agreed to read stays until this process saves a newer checkpoint, also where a newer
    copy that not every rank can load (here: one that fails its checksum) makes it look old to the prune: a prune
    between the decision and the load must not drop it (the load would fail and the job resume an older step)."""
    directory = f"s3://{bucket}/run"
    config = MemoryTier(root=str(tmp_path), job="job-1", keep=2)
    killed = NodeTier(config, run_of(0))
    states = {step: make_checkpoint(step, 0.25) for step in (1, 2, 3, 4)}
    for step, state in states.items():
        copy = killed.save(state, f"{directory}/step={step}-last.ckpt", step, torch.save)
        if step <= 2:  # queued for S3 when the kill came
            killed.set_drain(copy, "pending")
    with open(copy.path, "r+b") as stream:  # step 4's copy fails its checksum: no rank can load it from memory
        stream.seek(copy.size // 2)
        byte = stream.read(1)
        stream.seek(-1, os.SEEK_CUR)
        stream.write(bytes([byte[0] ^ 0xFF]))

    relaunch = tiered(tmp_path, keep=2)
    agreement = relaunch.agree_resume(directory, connector.checkpoint_step)
    assert (agreement.step, agreement.tier) == (3, "memory")
    relaunch.wait_for_pending_saves()  # the relaunch finished the two drains, each followed by a prune
    tier = relaunch.node_tier()
    assert 3 in [copy.record["step"] for copy in tier.copies()]
    assert_same(relaunch.load_checkpoint(agreement.url), states[3])
    assert relaunch.records[-1].tier == "memory"

    relaunch.save_checkpoint(make_checkpoint(5, 0.25), f"{directory}/step=5-last.ckpt")
    relaunch.wait_for_pending_saves()
    assert [copy.record["step"] for copy in tier.copies()] == [4, 5]  # `keep` holds again after a newer save
    relaunch.teardown()


def test_a_new_launch_frees_what_killed_processes_left_half_written(tmp_path: Path) -> None:
    """A kill inside a save leaves its temporary file, one between a commit's renames a data file without its commit
    record: neither is a checkpoint, and nothing else would free their memory. The next launch's first claim removes
    both; committed copies, and what this launch writes itself, stay."""
    config = MemoryTier(root=str(tmp_path))
    older = NodeTier(config, run_of(0))
    kept = older.save({"x": torch.ones(3)}, "s3://bkt/run/step=1.ckpt", 1, torch.save)
    partial, fd = older.temporary_file("s3://bkt/run/step=2.ckpt")  # killed while writing step 2
    os.write(fd, b"x" * 4096)
    os.close(fd)
    cut = older.save({"x": torch.ones(3)}, "s3://bkt/run/step=3.ckpt", 3, torch.save)
    os.unlink(older.record_path(cut.path))  # killed between the data's rename and the record's
    newer = NodeTier(config, run_of(1))
    newer.claim()
    assert not partial.exists() and not cut.path.exists()
    assert kept.path.exists() and [c.url for c in newer.copies()] == ["s3://bkt/run/step=1.ckpt"]
    mine, fd = newer.temporary_file("s3://bkt/run/step=4.ckpt")  # this launch's own write in progress
    os.close(fd)
    newer.claim()  # claimed already: nothing more is removed
    NodeTier(config, run_of(1)).claim()  # another process of the same launch
    assert mine.exists()
