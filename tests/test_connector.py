"""Resume-checkpoint selection rules (local directories and a real S3 server), rank detection, check_resume, config.

None of these tests needs Lightning: `find_resume_checkpoint` and the rules must work without it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import connector
import s3_process
from connector import (
    CheckpointAlreadyCompletedError,
    CheckpointNotFoundError,
    ResumeCandidate,
    check_resume,
    find_resume_checkpoint,
    global_rank,
    list_resume_candidates,
    select_resume_candidate,
    uninject_model_parallel_rank,
)
from s3_utils import S3ClientSettings, S3Utils

BOTH_BUCKET_KINDS = pytest.mark.parametrize("bucket", ["general_purpose", "directory"], indirect=True)
"""Run a test on a general purpose bucket and on a directory bucket behind the directory-bucket proxy."""

# --------------------------------------------------------------------------------------------------------------------
# Stores: the same layouts as files in a local directory and as objects in a bucket
# --------------------------------------------------------------------------------------------------------------------


class LocalStore:
    """Checkpoint files under a temporary directory; `put` can set the modification time exactly."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.clock = time.time() - 10_000

    def dirpath(self, prefix: str = "ckpt") -> str:
        return str(self.root / prefix) if prefix else str(self.root)

    def url(self, relative: str) -> str:
        return str(self.root / relative)

    def put(self, *relatives: str) -> None:
        """Create files in this order, each one second newer than the previous."""
        for relative in relatives:
            path = self.root / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x")
            self.clock += 1
            os.utime(path, (self.clock, self.clock))


class S3Store:
    """Checkpoint objects in a fresh bucket; `put` waits so S3's one-second LastModified keeps the order."""

    def __init__(self, bucket: str, client) -> None:
        self.bucket = bucket
        self.client = client
        self.waits = False

    def dirpath(self, prefix: str = "ckpt") -> str:
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    def url(self, relative: str) -> str:
        return f"s3://{self.bucket}/{relative}"

    def put(self, *relatives: str) -> None:
        for index, relative in enumerate(relatives):
            if self.waits and index:
                time.sleep(1.1)
            self.client.put_object(Bucket=self.bucket, Key=relative, Body=b"x")


class SelectionRules:
    """The rules, run against every store (see the subclasses)."""

    store: LocalStore | S3Store

    def find(self, prefix: str = "ckpt", **kwargs) -> str | None:
        return find_resume_checkpoint(self.store.dirpath(prefix), **kwargs)

    def test_newest_last_checkpoint_by_step_not_by_name_or_listing_order(self) -> None:
        # Byte order (S3's listing order) puts step=10 and step=100 before step=9; the oldest is the newest step.
        self.store.put("ckpt/gpt--step=100-last.ckpt", "ckpt/gpt--step=9-last.ckpt", "ckpt/gpt--step=10-last.ckpt")
        assert self.find() == self.store.url("ckpt/gpt--step=100-last.ckpt")

    def test_end_checkpoint_means_finished_unless_resume_past_end(self) -> None:
        self.store.put("ckpt/gpt--step=10-last.ckpt", "ckpt/gpt--step=20-end.ckpt")
        with pytest.raises(CheckpointAlreadyCompletedError, match=r"gpt--step=20-end\.ckpt.*resume_past_end=True"):
            self.find()
        with pytest.raises(ValueError):  # NeMo raised ValueError: callers catching it keep working
            self.find()
        assert self.find(resume_past_end=True) == self.store.url("ckpt/gpt--step=20-end.ckpt")

    def test_end_and_last_at_the_same_step_is_finished(self) -> None:
        self.store.put("ckpt/gpt--step=20-end.ckpt", "ckpt/gpt--step=20-last.ckpt")
        with pytest.raises(CheckpointAlreadyCompletedError):
            self.find()

    def test_last_newer_than_end_was_resumed_past_the_end(self) -> None:
        self.store.put("ckpt/gpt--step=20-end.ckpt", "ckpt/gpt--step=30-last.ckpt")
        assert self.find() == self.store.url("ckpt/gpt--step=30-last.ckpt")

    def test_sibling_prefixes_and_nested_folders_are_not_part_of_the_directory(self) -> None:
        self.store.put(
            "ckpt_old/gpt--step=50-last.ckpt",  # sibling "directory" sharing the key prefix
            "ckpt2-step=60-last.ckpt",  # object whose key starts with "ckpt"
            "ckpt/backup/gpt--step=70-last.ckpt",  # nested deeper than a shard folder
            "ckpt/gpt--step=5-last.ckpt",
        )
        assert self.find() == self.store.url("ckpt/gpt--step=5-last.ckpt")

    def test_nothing_found_raises_or_returns_none(self) -> None:
        self.store.put("ckpt/gpt--step=5.ckpt", "ckpt/gpt--step=5-last-EMA.ckpt", "ckpt/notes.txt")
        with pytest.raises(CheckpointNotFoundError, match=r"ckpt.*resume_ignore_no_checkpoint=True"):
            self.find()
        with pytest.raises(FileNotFoundError):  # CheckpointNotFoundError is a FileNotFoundError
            self.find()
        assert self.find(resume_ignore_no_checkpoint=True) is None

    def test_missing_directory_is_nothing_found(self) -> None:
        self.store.put("other/gpt--step=5-last.ckpt")
        with pytest.raises(CheckpointNotFoundError, match="no checkpoints"):
            self.find("ckpt")
        assert self.find("ckpt", resume_ignore_no_checkpoint=True) is None

    def test_root_of_the_store(self) -> None:
        self.store.put("gpt--step=3-last.ckpt", "sub/gpt--step=9-last.ckpt")
        assert self.find("") == self.store.url("gpt--step=3-last.ckpt")

    def test_tensor_and_pipeline_parallel_folders(self) -> None:
        complete = [f"ckpt/tp_rank_{tp:02d}_pp_rank_{pp:03d}/gpt--step=20-last.ckpt" for tp in (0, 1) for pp in (0, 1)]
        newer_but_partial = [  # tp_rank_01_pp_rank_001 never arrived
            f"ckpt/tp_rank_{tp:02d}_pp_rank_{pp:03d}/gpt--step=30-last.ckpt" for tp, pp in ((0, 0), (0, 1), (1, 0))
        ]
        self.store.put(*complete, *newer_but_partial)
        assert self.find() == self.store.url("ckpt/gpt--step=20-last.ckpt")
        candidates = {c.step: c for c in list_resume_candidates(self.store.dirpath())}
        assert candidates[20].problem is None
        assert candidates[20].shards == tuple(sorted(path.split("/")[1] for path in complete))
        assert "only 3 of its 4" in (candidates[30].problem or "")

    def test_mp_rank_folders(self) -> None:
        self.store.put(
            "ckpt/mp_rank_00/gpt--step=7-last.ckpt",
            "ckpt/mp_rank_01/gpt--step=7-last.ckpt",
            "ckpt/mp_rank_00/gpt--step=8-last.ckpt",
            "ckpt/mp_rank_01/gpt--step=8-last.ckpt",
            "ckpt/mp_rank_01/gpt--step=9-last.ckpt",  # mp_rank_00 missing: incomplete
        )
        assert self.find() == self.store.url("ckpt/gpt--step=8-last.ckpt")

    def test_unfinished_marker_skips_a_checkpoint(self) -> None:
        self.store.put("ckpt/gpt--step=7-last.ckpt", "ckpt/gpt--step=8-last.ckpt", "ckpt/gpt--step=8-last-unfinished")
        assert self.find() == self.store.url("ckpt/gpt--step=7-last.ckpt")

    def test_distributed_checkpoint_directory(self) -> None:
        self.store.put(
            "ckpt/gpt--step=4-last.ckpt",
            "ckpt/gpt--step=40-last/metadata.json",
            "ckpt/gpt--step=40-last/__0_0.distcp",
            "ckpt/gpt--step=40-last/.metadata",
        )
        assert self.find() == self.store.url("ckpt/gpt--step=40-last")

    # ---- DCP checkpoints (a prefix such as x-last.ckpt/ holding .distcp shards; .metadata is written last) ---------

    def test_complete_dcp_last_beats_an_older_file_last_by_step(self) -> None:
        self.store.put(
            "ckpt/gpt--step=50-last.ckpt/__0_0.distcp",
            "ckpt/gpt--step=50-last.ckpt/__1_0.distcp",
            "ckpt/gpt--step=50-last.ckpt/.s3ckpt-items.json",
            "ckpt/gpt--step=50-last.ckpt/.metadata",
            "ckpt/gpt--step=9-last.ckpt",  # newer by time, older by step
        )
        assert self.find() == self.store.url("ckpt/gpt--step=50-last.ckpt")
        (chosen,) = [c for c in list_resume_candidates(self.store.dirpath()) if c.step == 50]
        assert chosen.is_directory and chosen.kind == "last" and chosen.problem is None

    def test_incomplete_dcp_without_metadata_is_skipped_with_a_log_line(self, caplog: pytest.LogCaptureFixture) -> None:
        self.store.put(
            "ckpt/gpt--step=9-last.ckpt",
            "ckpt/gpt--step=60-last.ckpt/meta.pt",
            "ckpt/gpt--step=60-last.ckpt/__0_0.distcp",
            "ckpt/gpt--step=60-last.ckpt/__1_0.distcp",  # the save died before .metadata
        )
        with caplog.at_level("WARNING", logger="connector"):
            assert self.find() == self.store.url("ckpt/gpt--step=9-last.ckpt")
        skipped = self.store.url("ckpt/gpt--step=60-last.ckpt")
        assert f"Not resuming from {skipped}: " in caplog.text and "without .metadata" in caplog.text

    def test_only_an_incomplete_dcp_is_nothing_found(self) -> None:
        self.store.put("ckpt/gpt--step=60-last.ckpt/__0_0.distcp")
        with pytest.raises(CheckpointNotFoundError, match=r"1 incomplete or unfinished checkpoint\(s\) skipped"):
            self.find()

    def test_end_dcp_means_finished(self) -> None:
        self.store.put(
            "ckpt/gpt--step=10-last.ckpt",
            "ckpt/gpt--step=20-end.ckpt/__0_0.distcp",
            "ckpt/gpt--step=20-end.ckpt/.metadata",
        )
        with pytest.raises(CheckpointAlreadyCompletedError, match=r"gpt--step=20-end\.ckpt"):
            self.find()
        assert self.find(resume_past_end=True) == self.store.url("ckpt/gpt--step=20-end.ckpt")

    def test_dcp_without_collectives_needs_every_ranks_metadata(self) -> None:
        self.store.put(
            "ckpt/gpt--step=5-last.ckpt",
            "ckpt/gpt--step=70-last.ckpt/__0_0.distcp",
            "ckpt/gpt--step=70-last.ckpt/__1_0.distcp",
            "ckpt/gpt--step=70-last.ckpt/__0.metadata",
        )
        assert self.find() == self.store.url("ckpt/gpt--step=5-last.ckpt")  # rank 1 never committed
        self.store.put("ckpt/gpt--step=70-last.ckpt/__1.metadata")
        assert self.find() == self.store.url("ckpt/gpt--step=70-last.ckpt")

    def test_metadata_of_a_nested_folder_does_not_complete_a_dcp(self) -> None:
        self.store.put(
            "ckpt/gpt--step=5-last.ckpt",
            "ckpt/gpt--step=80-last.ckpt/__0_0.distcp",
            "ckpt/gpt--step=80-last.ckpt/old/.metadata",
        )
        assert self.find() == self.store.url("ckpt/gpt--step=5-last.ckpt")


class TestSelectionLocal(SelectionRules):
    @pytest.fixture(autouse=True)
    def _store(self, tmp_path: Path) -> None:
        self.store = LocalStore(tmp_path)

    def test_real_local_dcp_save_is_found(self, tmp_path: Path) -> None:
        dcp = pytest.importorskip("torch.distributed.checkpoint")
        torch = pytest.importorskip("torch")
        self.store.put("ckpt/gpt--step=3-last.ckpt")
        directory = tmp_path / "ckpt" / "gpt--step=30-last.ckpt"
        dcp.save({"w": torch.arange(8.0)}, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
        assert self.find() == str(directory)
        (directory / ".metadata").unlink()
        assert self.find() == self.store.url("ckpt/gpt--step=3-last.ckpt")

    def test_lightning_last_names_without_step_pick_the_newest_file(self) -> None:
        self.store.put("ckpt/last-v1.ckpt", "ckpt/last.ckpt", "ckpt/last-v2.ckpt")
        assert self.find() == self.store.url("ckpt/last-v2.ckpt")


@BOTH_BUCKET_KINDS
class TestSelectionS3(SelectionRules):
    @pytest.fixture(autouse=True)
    def _store(self, bucket: str, s3_client) -> None:
        self.store = S3Store(bucket, s3_client)

    def test_lightning_last_names_without_step_pick_the_newest_object(self) -> None:
        self.store.waits = True
        self.store.put("ckpt/last-v1.ckpt", "ckpt/last.ckpt")
        assert self.find() == self.store.url("ckpt/last.ckpt")

    def test_missing_bucket_is_an_error_even_when_ignoring_missing_checkpoints(self, bucket: str) -> None:
        missing = f"s3://{bucket}-missing/ckpt"
        for ignore in (False, True):
            with pytest.raises(CheckpointNotFoundError, match=rf"{missing}.*bucket '{bucket}-missing' does not exist"):
                find_resume_checkpoint(missing, resume_ignore_no_checkpoint=ignore)

    def test_listing_is_paginated(self, bucket: str) -> None:
        """25 checkpoints listed 7 keys per request: four listing requests on the wire, each asking for 7 keys, and
        the newest found on the last page."""
        names = [f"ckpt/gpt--step={step}-last.ckpt" for step in range(25)]
        self.store.put(*names)
        s3 = S3Utils(list_page_size=7)
        listings: list[str] = []  # the query string of each ListObjectsV2 request sent

        def count(request: Any, **_: Any) -> None:
            listings.append(request.url.partition("?")[2])

        s3.client.meta.events.register("before-send.s3.ListObjectsV2", count)
        assert (
            find_resume_checkpoint(f"s3://{bucket}/ckpt", s3_utils=s3) == f"s3://{bucket}/ckpt/gpt--step=24-last.ckpt"
        )
        assert len(listings) == 4 and all("max-keys=7" in query for query in listings), listings

    def test_real_dcp_save_is_found_and_costs_one_listing(self, bucket: str) -> None:
        dcp = pytest.importorskip("torch.distributed.checkpoint")
        torch = pytest.importorskip("torch")
        from s3_dcp import S3StorageWriter

        self.store.put("ckpt/gpt--step=3-last.ckpt")
        url = f"s3://{bucket}/ckpt/gpt--step=30-last.ckpt"
        dcp.save({"w": torch.arange(8.0)}, storage_writer=S3StorageWriter(url), no_dist=True)
        s3 = S3Utils()
        calls: list[str] = []
        original = s3.call
        s3.call = lambda operation, *args, **kwargs: calls.append(operation) or original(operation, *args, **kwargs)
        assert find_resume_checkpoint(f"s3://{bucket}/ckpt", s3_utils=s3) == url
        # no HEAD per DCP folder to see whether it is complete (the listing shows .metadata); the owner record's GET,
        # and a HEAD of each candidate committed since its owner took over (a stale run's is ignored)
        assert calls[:2] == ["list_objects_v2", "get_object"] and set(calls[2:]) <= {"head_object"}
        assert len(calls) <= 4

    def test_last_lookup_of_s3_model_checkpoint_sees_complete_dcp_lasts_only(
        self, bucket: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        pytest.importorskip("lightning")
        callback = connector.s3_model_checkpoint_class("lightning.pytorch")(dirpath=f"s3://{bucket}/ckpt")
        self.store.put("ckpt/last-v1.ckpt/__0_0.distcp", "ckpt/last-v1.ckpt/.metadata", "ckpt/last.ckpt/__0_0.distcp")
        with caplog.at_level("WARNING", logger="connector"):
            times = callback.last_checkpoint_times()
        assert set(times) == {f"s3://{bucket}/ckpt/last-v1.ckpt"}
        assert f"Not resuming from s3://{bucket}/ckpt/last.ckpt: " in caplog.text

    def test_pathlib_collapsed_url_is_repaired(self, bucket: str) -> None:
        self.store.put("ckpt/gpt--step=1-last.ckpt")
        assert find_resume_checkpoint(Path(f"s3://{bucket}/ckpt")) == f"s3://{bucket}/ckpt/gpt--step=1-last.ckpt"


# --------------------------------------------------------------------------------------------------------------------
# Pure rules (no storage)
# --------------------------------------------------------------------------------------------------------------------


def candidate(name: str, modified: float, **kwargs) -> ResumeCandidate:
    kind = "end" if name.endswith("end.ckpt") else "last"
    return ResumeCandidate(
        name=name, url=f"s3://b/c/{name}", kind=kind, step=connector.checkpoint_step(name), modified=modified, **kwargs
    )


def test_step_wins_over_modification_time_and_time_breaks_ties() -> None:
    chosen = select_resume_candidate([candidate("a-step=10-last.ckpt", 5.0), candidate("a-step=9-last.ckpt", 9.0)])
    assert chosen is not None and chosen.name == "a-step=10-last.ckpt"
    chosen = select_resume_candidate([candidate("b-step=10-last.ckpt", 5.0), candidate("a-step=10-last.ckpt", 6.0)])
    assert chosen is not None and chosen.name == "a-step=10-last.ckpt"


def test_without_steps_everywhere_the_newest_by_time_wins() -> None:
    chosen = select_resume_candidate([candidate("a-step=10-last.ckpt", 5.0), candidate("last.ckpt", 9.0)])
    assert chosen is not None and chosen.name == "last.ckpt"


def test_step_parsing_takes_the_last_step_field() -> None:
    assert connector.checkpoint_step("gpt--val_loss=1.20-step=1200-consumed_samples=9600.0-last.ckpt") == 1200
    assert connector.checkpoint_step("mystep=3-last.ckpt") is None
    assert connector.checkpoint_step("last.ckpt") is None


def test_fewer_shards_than_another_checkpoint_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    shards = tuple(f"mp_rank_0{i}" for i in range(4))
    chosen = select_resume_candidate(
        [candidate("a-step=1-last.ckpt", 1.0, shards=shards), candidate("a-step=2-last.ckpt", 2.0, shards=shards[:2])]
    )
    assert chosen is not None and chosen.step == 2  # a missing top shard cannot be told from a layout change
    assert "another checkpoint in the directory has more" in caplog.text


def test_unusable_candidates_only_give_none() -> None:
    broken = candidate("a-step=1-last.ckpt", 1.0, problem="incomplete")
    assert select_resume_candidate([broken]) is None


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("s3://b/c/mp_rank_00/x-last.ckpt", "s3://b/c/x-last.ckpt"),
        ("s3://b/c/tp_rank_01_pp_rank_002/x-last.ckpt", "s3://b/c/x-last.ckpt"),
        ("s3://b/c/mp_rank_00_fsdp_shard_00003/x.ckpt", "s3://b/c/x.ckpt"),
        ("/l/c/fsdp_shard_00001/x.ckpt", "/l/c/x.ckpt"),
        ("s3://b/mp_rank_notes/x.ckpt", "s3://b/mp_rank_notes/x.ckpt"),  # not a shard folder: unchanged
        ("s3://b/c/x-last.ckpt", "s3://b/c/x-last.ckpt"),
        (Path("s3://b/c/mp_rank_01/x.ckpt"), "s3://b/c/x.ckpt"),  # pathlib-collapsed URL stays an S3 URL
    ],
)
def test_uninject_model_parallel_rank(path, expected: str) -> None:
    assert uninject_model_parallel_rank(path) == expected


# --------------------------------------------------------------------------------------------------------------------
# Rank from the environment
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "rank"),
    [
        ({}, 0),
        ({"RANK": "3", "SLURM_PROCID": "0"}, 3),  # RANK first, as in NeMo
        ({"SLURM_PROCID": "5", "OMPI_COMM_WORLD_RANK": "0"}, 5),
        ({"OMPI_COMM_WORLD_RANK": "2"}, 2),
        ({"PMI_RANK": "7"}, 7),
        ({"LOCAL_RANK": "1"}, 1),  # Lightning's own DDP launcher on node 0
        ({"NODE_RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}, 8),
        ({"GROUP_RANK": "2", "LOCAL_RANK": "0"}, 2),
        ({"RANK": "", "SLURM_PROCID": "4"}, 4),  # empty values are ignored
    ],
)
def test_global_rank_from_environment(environ: dict[str, str], rank: int) -> None:
    assert global_rank(environ) == rank
    assert connector.is_global_rank_zero(environ) == (rank == 0)


def test_which_process_am_i_is_answered_in_one_place() -> None:
    """World size, node and job come from the same launcher table as the rank (s3_process);
    connector re-exports the rank under NeMo's name."""
    assert global_rank is s3_process.global_rank
    assert s3_process.world_size({}) == 1 and s3_process.world_size({"WORLD_SIZE": "", "SLURM_NTASKS": "16"}) == 16
    assert s3_process.world_size({"WORLD_SIZE": "0"}) == 1
    assert s3_process.node_key(3) == "node 3"
    assert s3_process.node_key(environ={"SLURM_NODEID": "2", "NODE_RANK": "5"}) == "node 2 (SLURM_NODEID)"
    assert s3_process.node_key(environ={}).startswith("host ")  # ranks that share the host share /dev/shm
    assert s3_process.job_key({}) is None
    assert s3_process.job_key({"SLURM_JOB_ID": "42", "MASTER_PORT": "29500"}) == "|42|||29500"


# --------------------------------------------------------------------------------------------------------------------
# check_resume: NeMo's meaning, rank-0-only listing on S3
# --------------------------------------------------------------------------------------------------------------------


def fake_trainer() -> SimpleNamespace:
    """Just what check_resume touches on a non-Lightning trainer: the ``ckpt_path`` attribute."""
    return SimpleNamespace(ckpt_path=None)


@pytest.fixture
def rank_env(monkeypatch: pytest.MonkeyPatch):
    """Set this process's global rank the way launchers do (other rank variables removed)."""
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)

    def set_rank(rank: int) -> None:
        monkeypatch.setenv("RANK", str(rank))

    return set_rank


@BOTH_BUCKET_KINDS
@pytest.mark.parametrize("rank", [0, 1])
def test_check_resume_lists_s3_on_rank_zero_only(rank: int, rank_env, bucket: str, s3_client, fault_proxy) -> None:
    s3_client.put_object(Bucket=bucket, Key="ckpt/gpt--step=4-last.ckpt", Body=b"x")
    rank_env(rank)
    trainer = fake_trainer()
    s3 = S3Utils(S3ClientSettings(endpoint_url=fault_proxy.endpoint_url))
    found = check_resume(trainer, "/logs", resume_if_exists=True, dirpath=f"s3://{bucket}/ckpt", s3_utils=s3)
    if rank == 0:
        assert found == trainer.ckpt_path == f"s3://{bucket}/ckpt/gpt--step=4-last.ckpt"
        assert fault_proxy.count(method="GET", query_contains="list-type=2") == 1
    else:  # the path arrives later by broadcast
        assert found is None and trainer.ckpt_path is None
        assert fault_proxy.requests == []


def test_check_resume_on_another_rank_keeps_resume_from_checkpoint(rank_env, bucket: str, fault_proxy) -> None:
    rank_env(2)
    trainer = fake_trainer()
    s3 = S3Utils(S3ClientSettings(endpoint_url=fault_proxy.endpoint_url))
    explicit = f"s3://{bucket}/elsewhere/x.ckpt"
    check_resume(
        trainer,
        None,
        resume_if_exists=True,
        dirpath=f"s3://{bucket}/ckpt",
        resume_from_checkpoint=explicit,
        s3_utils=s3,
    )
    assert trainer.ckpt_path == explicit and fault_proxy.requests == []


def test_check_resume_found_checkpoint_wins_over_resume_from_checkpoint(rank_env, tmp_path: Path) -> None:
    rank_env(0)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "a--step=3-last.ckpt").write_bytes(b"x")
    trainer = fake_trainer()
    check_resume(trainer, tmp_path, resume_if_exists=True, resume_from_checkpoint="/other/x.ckpt")
    assert trainer.ckpt_path == str(tmp_path / "checkpoints" / "a--step=3-last.ckpt")  # log_dir/checkpoints


def test_check_resume_local_dirs_are_searched_on_every_rank(rank_env, tmp_path: Path) -> None:
    rank_env(3)
    (tmp_path / "a--step=3-last.ckpt").write_bytes(b"x")
    trainer = fake_trainer()
    check_resume(trainer, None, resume_if_exists=True, dirpath=str(tmp_path))
    assert trainer.ckpt_path == str(tmp_path / "a--step=3-last.ckpt")


def test_check_resume_errors(rank_env, tmp_path: Path) -> None:
    rank_env(0)
    with pytest.raises(ValueError, match="dirpath or the log_dir"):
        check_resume(fake_trainer(), None, resume_if_exists=True)
    with pytest.raises(CheckpointNotFoundError, match="Cannot resume"):
        check_resume(fake_trainer(), tmp_path, resume_if_exists=True)
    trainer = fake_trainer()
    assert check_resume(trainer, tmp_path, resume_if_exists=True, resume_ignore_no_checkpoint=True) is None
    assert trainer.ckpt_path is None
    assert connector.NotFoundError is CheckpointNotFoundError


def test_check_resume_without_resume_if_exists_only_uses_resume_from_checkpoint(tmp_path: Path) -> None:
    trainer = fake_trainer()
    assert check_resume(trainer, tmp_path, resume_from_checkpoint=Path("s3://b/x.ckpt")) == "s3://b/x.ckpt"
    assert trainer.ckpt_path == "s3://b/x.ckpt"
    assert check_resume(fake_trainer(), tmp_path) is None


# --------------------------------------------------------------------------------------------------------------------
# Config validation (no Lightning objects built)
# --------------------------------------------------------------------------------------------------------------------


def test_config_rejects_unknown_s3_keys_and_missing_dirpath() -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['max_write_concurency'\]"):
        connector.build_s3_checkpointing(
            {"s3_checkpointing": {"max_write_concurency": 4}, "checkpoint_callback_params": {"dirpath": "s3://b/c"}}
        )
    with pytest.raises(ValueError, match=r"checkpoint_callback_params\.dirpath must be set"):
        connector.build_s3_checkpointing({"exp_manager": {"checkpoint_callback_params": {}}})
    with pytest.raises(TypeError, match="s3_checkpointing must be a mapping"):
        connector.build_s3_checkpointing({"s3_checkpointing": [1], "checkpoint_callback_params": {"dirpath": "/x"}})


def test_unknown_module_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchThing"):
        _ = connector.NoSuchThing
    with pytest.raises(ValueError, match="family must be one of"):
        connector.checkpoint_connector_class("lightning.fabric")
