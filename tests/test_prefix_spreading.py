"""Prefix spreading (`s3_prefix_spreading`): a DCP save's shards in ``run/s3ckpt-spread-XX/step-N/``, the records at
``run/step-N/``; loads, ``convert``, ``verify``, ``ls``, ``rm``, ``gc`` and overwriting saves find every object from
what the checkpoint records, and the default layout is one prefix with the keys it always had.

Several ranks are played in one process through DCP's storage-writer contract (`save_as_ranks`): the layout is
decided by the coordinator's plan, and what a rank writes follows from its plan alone.
"""

from __future__ import annotations

import datetime
import io
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from dcp_worker import differences  # noqa: E402
from fault_proxy import Fault, FaultRule  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402

import s3_checkpoint_admin as admin  # noqa: E402
import s3_dcp  # noqa: E402
import s3_prefix_spreading as spreading  # noqa: E402
import s3_utils  # noqa: E402
from s3_checkpoint_convert import convert_checkpoint  # noqa: E402
from s3_fencing import (  # noqa: E402
    OWNER_RECORD_NAME,
    CheckpointDirectoryTakenError,
    CheckpointRun,
    DirectoryFence,
    current_run,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FAST_RETRIES = s3_utils.RetryPolicy(max_attempts=3, max_elapsed_s=10, initial_backoff_s=0.01, max_backoff_s=0.05)
SIDE = s3_utils.CHECKSUM_SIDECAR_SUFFIX


def rank_state(rank: int) -> dict[str, Any]:
    """What rank `rank` saves: tensors of its own (no rank's item is another's), and one shared value."""
    return {
        f"layer{rank}": {"w": torch.full((300, 7), float(rank)), "b": torch.arange(5) + rank},
        f"note{rank}": io.BytesIO(b"rank %d" % rank),
    }


def save_as_ranks(url: str, ranks: int, run: CheckpointRun | None = None, **kwargs: Any) -> dict[str, Any]:
    """A collective DCP save of `ranks` ranks, played in this process step by step as ``dcp.save`` drives each rank's
    `S3StorageWriter` (rank 0 coordinates); the whole state saved."""
    kwargs.setdefault("chunk_size_MB", 5)
    if "s3_utils" not in kwargs:
        kwargs["retry_policy"] = FAST_RETRIES
    writers = [s3_dcp.S3StorageWriter(url, **kwargs) for _ in range(ranks)]
    planners = [DefaultSavePlanner() for _ in range(ranks)]
    states = [rank_state(rank) for rank in range(ranks)]
    for rank, (writer, planner) in enumerate(zip(writers, planners, strict=True)):
        if run is not None:
            writer._run = run  # one process playing a given run, as tests/test_fencing.py does
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        planner.set_up_planner(state_dict=states[rank], storage_meta=None, is_coordinator=rank == 0)
    local = [w.prepare_local_plan(p.create_local_plan()) for w, p in zip(writers, planners, strict=True)]
    global_plans, metadata = planners[0].create_global_plan(local)
    global_plans = writers[0].prepare_global_plan(global_plans)
    results = [
        writer.write_data(planner.finish_plan(plan), planner).wait()
        for writer, planner, plan in zip(writers, planners, global_plans, strict=True)
    ]
    writers[0].finish(metadata, results)
    return {key: value for state in states for key, value in state.items()}


def empty_like(state: dict[str, Any]) -> dict[str, Any]:
    def empty(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: empty(v) for k, v in value.items()}
        return torch.zeros_like(value) if isinstance(value, torch.Tensor) else io.BytesIO()

    return empty(state)


def load(url: str, state: dict[str, Any]) -> dict[str, Any]:
    loaded = empty_like(state)
    reader = s3_dcp.S3StorageReader(url, chunk_size_MB=5, retry_policy=FAST_RETRIES)
    dcp.load(loaded, storage_reader=reader, no_dist=True)
    return {k: (v.getvalue() if isinstance(v, io.BytesIO) else v) for k, v in loaded.items()}


def plain(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.getvalue() if isinstance(v, io.BytesIO) else v) for k, v in state.items()}


def all_keys(client: Any, bucket: str) -> set[str]:
    """Every key in the bucket but the runs' owner records (tests/test_fencing.py covers those)."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    listed = {obj["Key"] for page in pages for obj in page.get("Contents", [])}
    return {key for key in listed if not key.endswith("/" + OWNER_RECORD_NAME)}


def keys(client: Any, bucket: str) -> set[str]:
    """`all_keys` without checksum records."""
    return {key for key in all_keys(client, bucket) if not key.endswith(SIDE)}


RECORDS = {".metadata", ".s3ckpt-items.json", ".s3ckpt-layout.json"}


def spread_keys(step: str, layout: dict[int, list[int]], threads: int = 1) -> set[str]:
    """The keys of a spread save of `step`: its records in ``run/step``, prefix p's ranks' shards in its directory."""
    shards = {
        f"run/s3ckpt-spread-{p:02x}/{step}/__{rank}_{n}.distcp" for p, ranks in layout.items() for rank in ranks
        for n in range(threads)
    }
    return shards | {f"run/{step}/{name}" for name in RECORDS}


# --------------------------------------------------------------------------------------------------------------------
# The layout and what reads it
# --------------------------------------------------------------------------------------------------------------------


def test_the_default_layout_is_one_prefix_with_the_keys_it_always_had(bucket: str, s3_client: Any) -> None:
    for spread in (None, 1):
        url = f"s3://{bucket}/run{spread}/step-2"
        state = save_as_ranks(url, 3, thread_count=2, prefix_spreading=spread)
        expected = {f"run{spread}/step-2/{name}" for name in (".metadata", ".s3ckpt-items.json")}
        expected |= {f"run{spread}/step-2/__{rank}_{n}.distcp" for rank in range(3) for n in range(2)}
        assert {k for k in keys(s3_client, bucket) if k.startswith(f"run{spread}/")} == expected
        paths = {info.relative_path for info in s3_dcp.S3StorageReader(url).read_metadata().storage_data.values()}
        assert paths == {f"__{rank}_{n}.distcp" for rank in range(3) for n in range(2)}
        assert differences(load(url, state), plain(state)) == []


def test_a_spread_save_round_trips_and_a_local_copy_of_the_run_loads_with_torch(
    bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/run/step-2"
    state = save_as_ranks(url, 3, thread_count=2, prefix_spreading=2)
    assert keys(s3_client, bucket) == spread_keys("step-2", {0: [0, 2], 1: [1]}, threads=2)
    metadata = s3_dcp.S3StorageReader(url).read_metadata()
    assert {info.relative_path for info in metadata.storage_data.values()} >= {
        "../s3ckpt-spread-00/step-2/__0_0.distcp", "../s3ckpt-spread-01/step-2/__1_1.distcp"
    }
    directories = ["../s3ckpt-spread-00/step-2/", "../s3ckpt-spread-01/step-2/"]
    assert spreading.read_layout(s3_utils.S3Utils(), url) == directories
    assert differences(load(url, state), plain(state)) == []

    for key in keys(s3_client, bucket):  # torch's own reader: the run directory copied as it is
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        s3_client.download_file(bucket, key, str(tmp_path / key))
    local = empty_like(state)
    dcp.load(local, storage_reader=dcp.FileSystemReader(str(tmp_path / "run" / "step-2")), no_dist=True)
    assert differences(plain(local), plain(state)) == []


def test_convert_verify_and_ls_find_every_object_of_a_spread_checkpoint(
    bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/run/step-2"
    state = save_as_ranks(url, 3, prefix_spreading=4)
    s3 = s3_utils.S3Utils(retry_policy=FAST_RETRIES)

    convert_checkpoint(url, tmp_path / "full.pt", s3_utils=s3, chunk_size_MB=5, weights_only=False)  # BytesIO
    assert differences(plain(torch.load(tmp_path / "full.pt", weights_only=False)), plain(state)) == []

    report = admin.verify_checkpoint(url, s3)
    assert report.ok, report.problems
    verified = {f.url for f in report.files}
    assert {f"s3://{bucket}/run/s3ckpt-spread-0{r}/step-2/__{r}_0.distcp" for r in range(3)} <= verified
    assert all(f.items for f in report.files if f.url.endswith(".distcp"))
    shard = "run/s3ckpt-spread-01/step-2/__1_0.distcp"
    s3_client.put_object(Bucket=bucket, Key=shard, Body=b"replaced")  # a shard in a spread directory changes
    assert any(shard in problem for problem in admin.verify_checkpoint(url, s3).problems)
    s3_client.delete_object(Bucket=bucket, Key=shard)
    assert any("is missing" in p and shard in p for p in admin.verify_checkpoint(url, s3).problems)


def test_ls_counts_a_spread_checkpoint_once_with_all_its_objects(bucket: str, s3_client: Any) -> None:
    save_as_ranks(f"s3://{bucket}/run/step=2.ckpt", 3, prefix_spreading=2)
    save_as_ranks(f"s3://{bucket}/run/step=4.ckpt", 2)  # beside it: one prefix
    sizes = {o["Key"]: o["Size"] for o in s3_client.list_objects_v2(Bucket=bucket)["Contents"]}
    total = sum(size for key, size in sizes.items() if "step=2.ckpt" in key and not key.endswith(SIDE))
    for recursive in (False, True):
        entries = admin.list_checkpoints(f"s3://{bucket}/run", recursive=recursive, all_objects=recursive)
        assert [(e.name, e.shards, e.complete) for e in entries] == [("step=2.ckpt", 3, True), ("step=4.ckpt", 2, True)]
        assert entries[0].size == total
    (alone,) = admin.list_checkpoints(f"s3://{bucket}/run/step=2.ckpt")
    assert (alone.shards, alone.size, alone.complete) == (3, total, True)


# --------------------------------------------------------------------------------------------------------------------
# Removing: rm, gc, overwriting saves, fenced removals
# --------------------------------------------------------------------------------------------------------------------


def test_rm_leaves_no_object_of_a_spread_checkpoint_anywhere(bucket: str, s3_client: Any) -> None:
    for step in (1, 2, 3):
        save_as_ranks(f"s3://{bucket}/run/m-step={step}.ckpt", 3, prefix_spreading=2)
    pruning = admin.prune_checkpoints(f"s3://{bucket}/run", 1)
    assert [e.name for e in pruning.delete] == ["m-step=1.ckpt", "m-step=2.ckpt"]
    assert keys(s3_client, bucket) == spread_keys("m-step=3.ckpt", {0: [0, 2], 1: [1]})
    assert all("m-step=3.ckpt" in key for key in all_keys(s3_client, bucket))  # checksum records included


def test_gc_removes_an_uncommitted_spread_save_everywhere_and_never_a_committed_one(
    bucket: str, s3_client: Any
) -> None:
    url = f"s3://{bucket}/run"
    save_as_ranks(f"{url}/step-1", 2, prefix_spreading=2)  # committed: its spread directories are not garbage
    save_as_ranks(f"{url}/step-2", 3, prefix_spreading=2)
    s3_client.delete_object(Bucket=bucket, Key="run/step-2/.metadata")  # as if killed before the commit
    s3_client.delete_object(Bucket=bucket, Key="run/step-2/.s3ckpt-items.json")
    committed = {k for k in all_keys(s3_client, bucket) if "step-1" in k}
    time.sleep(2.6)  # ages are whole seconds on SeaweedFS

    for where in (url, f"{url}/step-2"):
        garbage = admin.find_garbage(where, datetime.timedelta(seconds=1), incomplete_checkpoints=True)
        (dead,) = garbage.checkpoints
        assert dead.url == f"{url}/step-2" and dead.kept == ()
        assert {i.key for i in dead.files if not i.key.endswith(SIDE)} == spread_keys(
            "step-2", {0: [0, 2], 1: [1]}
        ) - {"run/step-2/.metadata", "run/step-2/.s3ckpt-items.json"}
        assert dead.files[-1].key.endswith(spreading.LAYOUT_NAME)  # the record that finds the rest goes last
    assert admin.remove_incomplete_checkpoint(dead) is True
    assert all_keys(s3_client, bucket) == committed


def test_an_overwriting_save_removes_the_replaced_checkpoints_shards_from_every_prefix(
    bucket: str, s3_client: Any
) -> None:
    url = f"s3://{bucket}/run/step-2"
    save_as_ranks(url, 4, prefix_spreading=4)
    state = save_as_ranks(url, 2, prefix_spreading=2)  # fewer ranks, fewer prefixes
    assert keys(s3_client, bucket) == spread_keys("step-2", {0: [0], 1: [1]})
    assert differences(load(url, state), plain(state)) == []
    state = save_as_ranks(url, 2)  # and back to one prefix: nothing of the spread layout stays
    assert keys(s3_client, bucket) == {
        f"run/step-2/{name}" for name in (".metadata", ".s3ckpt-items.json", "__0_0.distcp", "__1_0.distcp")
    }
    assert differences(load(url, state), plain(state)) == []


def test_a_stale_runs_removal_of_a_spread_checkpoint_removes_nothing(bucket: str, s3_client: Any) -> None:
    owner = current_run()
    stale = CheckpointRun(uuid.uuid4().hex[:16], "test-host", os.getpid(), owner.started - 60)
    url = f"s3://{bucket}/run/step-2"
    save_as_ranks(url, 2, run=owner, prefix_spreading=2)
    before = all_keys(s3_client, bucket)
    s3 = s3_utils.S3Utils(retry_policy=FAST_RETRIES)
    with pytest.raises(CheckpointDirectoryTakenError):
        spreading.remove_checkpoint(s3, url, fence=DirectoryFence(s3, f"s3://{bucket}/run", stale))
    assert all_keys(s3_client, bucket) == before
    spreading.remove_checkpoint(s3, url, fence=DirectoryFence(s3, f"s3://{bucket}/run", owner))
    assert all_keys(s3_client, bucket) == set()


# --------------------------------------------------------------------------------------------------------------------
# The strategy, keys and the automatic choice (no S3)
# --------------------------------------------------------------------------------------------------------------------


def test_segments_keep_their_names_as_prefixes_grow_and_relative_paths_stay_in_the_run() -> None:
    assert [spreading.PrefixSpreading(16).segment(i) for i in (0, 15)] == ["s3ckpt-spread-00", "s3ckpt-spread-0f"]
    assert spreading.PrefixSpreading(300).segment(15) == "s3ckpt-spread-00f"  # more than 256: wider names
    assert spreading.PrefixSpreading.from_value(1) is None and spreading.PrefixSpreading.from_value(None) is None
    assert spreading.PrefixSpreading.from_value("auto") == spreading.PrefixSpreading(16, after_throttles=1)
    for bad in (0, -2, "many", True, 2.5):
        with pytest.raises(ValueError, match="prefix_spreading must be"):
            spreading.PrefixSpreading.from_value(bad)  # type: ignore[arg-type]
    base = "s3://bucket/run/step-2"
    assert spreading.join(base, "__0_0.distcp") == "s3://bucket/run/step-2/__0_0.distcp"
    spread = "s3ckpt-spread-01/step-2/__1_0.distcp"
    assert spreading.join(base, f"../{spread}") == f"s3://bucket/run/{spread}"
    for escaping in ("../../other/x", "../../../x"):
        with pytest.raises(ValueError, match="outside the directory holding the checkpoint"):
            spreading.join(base, escaping)
    assert spreading.owner_of("a/s3ckpt-spread-03/step-2/__3_0.distcp") == "a/step-2"


def test_a_budget_applies_per_prefix_to_a_spread_save_and_load_and_the_commit_does_not_wait(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``max_requests_per_second`` is per prefix: a process of a 64-process job takes 1/64 of it for the checkpoint's
    own prefix and 1/4 for each of 16 spread prefixes (4 processes send to each), on save and load; what the
    coordinator sends alone (the takeover, the layout record, the commit) does not wait for its 1/64."""
    monkeypatch.setenv("WORLD_SIZE", "64")
    budget = {"write": 64, "read": 6400}
    s3 = s3_utils.S3Utils(s3_utils.S3ClientSettings(max_requests_per_second=budget), FAST_RETRIES)
    url = f"s3://{bucket}/run/step-1"
    state = save_as_ranks(url, 16, s3_utils=s3, prefix_spreading=16)  # 16 of the 64 ranks: a file in each prefix
    own, spread = s3.pacer(f"{url}/.metadata"), s3.pacer(f"s3://{bucket}/run/s3ckpt-spread-01/step-1/__1_0.distcp")
    assert own is not spread
    assert own.writes.rate == pytest.approx(1.0) and spread.writes.rate == pytest.approx(16.0)
    assert own.writes.waits == 0  # at 1 write/s, each of its writes after the first would have waited for a token

    loaded = empty_like(state)
    reader = s3_dcp.S3StorageReader(url, chunk_size_MB=5, s3_utils=s3)
    dcp.load(loaded, storage_reader=reader, no_dist=True)
    assert own.reads.rate == pytest.approx(100.0) and spread.reads.rate == pytest.approx(1600.0)
    assert differences({k: (v.getvalue() if isinstance(v, io.BytesIO) else v) for k, v in loaded.items()},
                       plain(state)) == []


def test_auto_spreads_the_saves_after_the_runs_writes_were_throttled(
    bucket: str, s3_client: Any, fault_proxy: Any
) -> None:
    s3 = s3_utils.S3Utils(s3_utils.S3ClientSettings(endpoint_url=fault_proxy.endpoint_url), FAST_RETRIES)
    fault_proxy.add_rule(FaultRule(Fault.status(503, "SlowDown"), method="PUT", path_regex=r"distcp$", times=1))
    save_as_ranks(f"s3://{bucket}/run/step-1", 2, s3_utils=s3, prefix_spreading="auto")  # decided before the 503
    assert s3.pacer(f"s3://{bucket}/run").writes.throttles == 1
    assert {k for k in keys(s3_client, bucket) if "spread" in k or "layout" in k} == set()
    state = save_as_ranks(f"s3://{bucket}/run/step-2", 2, s3_utils=s3, prefix_spreading="auto")
    assert {k for k in keys(s3_client, bucket) if "step-2" in k} == spread_keys("step-2", {0: [0], 1: [1]})
    assert differences(load(f"s3://{bucket}/run/step-2", state), plain(state)) == []


def test_the_scale_simulation_lays_out_the_packages_keys_and_only_spread_splits_outlive_their_save() -> None:
    """benchmarks/s3_sim.py names spread keys as a spread save does; a split at a save's median key serves the next
    save's keys only in the spread layout (benchmarks/bench_spread_sim.py's finding, here without simulating)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import s3_sim

    def keys_of(layout: str, step: int) -> list[str]:
        work = s3_sim.Workload(kind="dcp", layout=layout, prefixes=16, partitioned=False, step=step)
        return [s3_sim.key_of(work, f"__{rank}_0.distcp", rank) for rank in range(64)]

    url = "s3://bucket/run/step-1000"
    written = spreading.join(url, spreading.SaveLayout(spreading.PrefixSpreading(16)).file_prefix(url, "__19_", 19))
    assert f"s3://bucket/{keys_of('spread', 1000)[19]}" == written + "0.distcp"
    assert keys_of("spread", 1000)[19] == "run/s3ckpt-spread-03/step-1000/__19_0.distcp"
    for kind, kept in (("one-prefix", False), ("spread", True)):
        split = sorted(keys_of(kind, 1000))[32]  # S3 splits at the median of what it served
        model = s3_sim.S3Model(s3_sim.S3Params(), [split])
        upper = {model.partition_of(key).low for key in keys_of(kind, 1100)}  # the next save
        assert (upper == {"", split}) is kept, (kind, upper)
