"""DCP checkpoints through the memory tier (`S3StorageWriter` / `S3StorageReader` with ``memory_tier=``): saves land in
the node's tmpfs in S3's layout, loads read verified memory copies, drains put a loadable checkpoint on S3 with its
``.metadata`` last, and a memory copy that fails its checksum falls back to S3.

Each test keeps its tier under tmp_path (never /dev/shm). Two simulated nodes are two gloo ranks with their own
``GROUP_RANK`` and tier root (tests/helpers/dcp_tier_worker.py); a kill mid-drain is a worker that exits there.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from s3_servers import rank_environment, wait_for_ranks  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402

import s3_dcp  # noqa: E402
import s3_dcp_tier  # noqa: E402
import s3_fencing  # noqa: E402
import s3_memory_tier  # noqa: E402
import s3_prefix_spreading  # noqa: E402
import s3_utils  # noqa: E402
from s3_memory_tier import COMMIT_RECORD_SUFFIX, MemoryTier  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
COMMITTED = [".metadata", ".s3ckpt-items.json", "__0_0.distcp"]  # what a one-rank checkpoint has on S3
WORKER = REPO / "tests" / "helpers" / "dcp_tier_worker.py"


def state_of(step: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 1000, generator=generator), "b": torch.arange(11.0) + step, "step": step}


def empty_like(state: dict[str, Any]) -> dict[str, Any]:
    return {key: torch.zeros_like(value) if isinstance(value, torch.Tensor) else None for key, value in state.items()}


def assert_same(loaded: dict[str, Any], expected: dict[str, Any]) -> None:
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value, key


def s3_names(s3_client: Any, bucket: str, prefix: str) -> list[str]:
    found = s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    return sorted(o["Key"][len(prefix) + 1 :] for o in found)


def tier_config(root: Path, **fields: Any) -> MemoryTier:
    return MemoryTier(root=str(root), job="job-1", **fields)


def save(state: dict[str, Any], url: str, tier: MemoryTier) -> s3_dcp.S3StorageWriter:
    writer = s3_dcp.S3StorageWriter(url, chunk_size_MB=5, memory_tier=tier)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return writer


def load(expected: dict[str, Any], url: str, tier: MemoryTier | None) -> s3_dcp.S3StorageReader:
    reader = s3_dcp.S3StorageReader(url, chunk_size_MB=5, memory_tier=tier)
    target = empty_like(expected)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert_same(target, expected)
    return reader


def tiers_read(reader: s3_dcp.S3StorageReader) -> dict[str, str]:
    return {url.rsplit("/", 1)[-1]: (source[1] if source else "s3") for url, source in reader.tier_sources.items()}


def test_a_save_lands_in_memory_in_s3_layout_and_loads_bit_exact_from_memory(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    tier = tier_config(tmp_path, drain_every=10)
    first, second = f"s3://{bucket}/run/step-1", f"s3://{bucket}/run/step-2"
    writer = save(state_of(1), first, tier)  # the first save drains
    save(state_of(2), second, tier)  # the second stays in memory
    writer.finish_drains(drain_last=False)
    own = s3_dcp_tier.tier_of(tier, writer.s3).node.own
    files = sorted(p.name for p in (own / bucket / "run" / "step-2").iterdir())
    assert files == sorted(name + suffix for name in COMMITTED for suffix in ("", COMMIT_RECORD_SUFFIX))
    assert s3_names(s3_client, bucket, "run/step-2") == []  # not on S3
    assert s3_names(s3_client, bucket, "run/step-1") == COMMITTED

    reader = load(state_of(2), second, tier)
    assert set(tiers_read(reader).values()) == {"memory"}
    load(state_of(1), first, None)  # the drained one loads from S3 alone


def test_finish_drains_puts_the_last_save_on_s3_loadable_without_the_tier(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    tier = tier_config(tmp_path, drain_every=10)
    urls = [f"s3://{bucket}/run/step-{step}" for step in (1, 2, 3)]
    for step, url in enumerate(urls, 1):
        writer = save(state_of(step), url, tier)
    writer.finish_drains()
    assert s3_names(s3_client, bucket, "run/step-2") == []  # neither the first nor the last
    assert s3_names(s3_client, bucket, "run/step-3") == COMMITTED
    load(state_of(3), urls[2], None)


def test_the_drains_commit_does_not_wait_for_its_share_of_a_budget(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once every file of a checkpoint is on S3, the coordinator's drain sends the item record and ``.metadata`` alone
    (`s3_pacing.sending_alone`), as an S3 save's commit: not at its share of a budget, one write a second here (64
    writes/s over 64 processes), which would make each of the two wait."""
    monkeypatch.setenv("WORLD_SIZE", "64")
    s3 = s3_utils.S3Utils(s3_utils.S3ClientSettings(max_requests_per_second={"write": 64}))
    url = f"s3://{bucket}/run/step-1"
    writer = s3_dcp.S3StorageWriter(url, chunk_size_MB=5, memory_tier=tier_config(tmp_path), fencing=False, s3_utils=s3)
    dcp.save(state_of(1), storage_writer=writer, no_dist=True)
    writer.finish_drains()
    assert s3_names(s3_client, bucket, "run/step-1") == COMMITTED
    lane = s3.pacer(f"{url}/.metadata").writes
    assert lane.rate == pytest.approx(1.0) and lane.waits == 0  # the file took the one token, the commit none
    load(state_of(1), url, None)


def test_a_memory_copy_that_fails_its_checksum_is_skipped_and_s3_read(
    s3_server: Any, bucket: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = tier_config(tmp_path)
    url = f"s3://{bucket}/run/step-1"
    save(state_of(1), url, tier).finish_drains()
    node = s3_dcp_tier.tier_of(tier, s3_dcp.S3StorageReader(url).s3).node
    shard = node.path_of(url + "/__0_0.distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    reader = load(state_of(1), url, tier)
    assert tiers_read(reader) == {".metadata": "memory", ".s3ckpt-items.json": "memory", "__0_0.distcp": "s3"}
    assert "does not match its commit record" in caplog.text and "from S3 instead" in caplog.text


def test_a_drain_whose_file_fails_never_puts_metadata_on_s3(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = tier_config(tmp_path, drain_every=10)
    save(state_of(1), f"s3://{bucket}/run/step-1", tier).finish_drains()
    url = f"s3://{bucket}/run/step-2"
    writer = save(state_of(2), url, tier)  # in memory only
    shard = s3_dcp_tier.tier_of(tier, writer.s3).node.path_of(url + "/__0_0.distcp")
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    monkeypatch.setattr(s3_dcp_tier, "DRAIN_WAIT_S", 1.0)
    with pytest.raises(Exception, match=r"does not match its commit record|gave up"):
        writer.finish_drains()
    assert s3_names(s3_client, bucket, "run/step-2") == []  # no file, and above all no .metadata
    assert not s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_async_save_commits_in_memory_and_drains_behind(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    tier = tier_config(tmp_path)
    url = f"s3://{bucket}/run/async"
    writer = s3_dcp.S3StorageWriter(url, chunk_size_MB=5, memory_tier=tier)
    dcp.async_save(state_of(4), storage_writer=writer, no_dist=True).result()
    assert s3_dcp_tier.tier_of(tier, writer.s3).node.copy_of(url + "/.metadata") is not None
    writer.finish_drains()
    assert s3_names(s3_client, bucket, "run/async") == COMMITTED
    load(state_of(4), url, None)


def test_prune_keeps_keep_checkpoints_with_all_their_files(s3_server: Any, bucket: str, tmp_path: Path) -> None:
    tier = tier_config(tmp_path, keep=2, drain_every=10)
    for step in (1, 2, 3):
        writer = save(state_of(step), f"s3://{bucket}/run/step-{step}", tier)
        writer.finish_drains(drain_last=False)  # the first save's drain ends: a pending drain would count in `keep`
    own = s3_dcp_tier.tier_of(tier, writer.s3).node.own / bucket / "run"
    assert sorted(p.name for p in own.iterdir() if any(p.iterdir())) == ["step-2", "step-3"]
    assert len(list((own / "step-3").iterdir())) == 6


def test_a_straggler_of_an_older_launch_writes_nothing_into_the_tier(
    s3_server: Any, bucket: str, tmp_path: Path
) -> None:
    tier = tier_config(tmp_path)
    node = s3_dcp_tier.tier_of(tier, s3_dcp.S3StorageReader(f"s3://{bucket}/x").s3).node
    newer = s3_fencing.CheckpointRun("newer", "host", 1, node.run.started + 60)
    (node.directory / "launch.json").write_text(json.dumps({**newer.__dict__, "attempt": []}))
    url = f"s3://{bucket}/run/step-1"
    with pytest.raises(CheckpointException, match="newer launch"):
        save(state_of(1), url, tier)
    assert not list(node.own.rglob("*"))  # nothing written


def run_worker(mode: str, bucket: str, out: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(WORKER), mode, bucket, str(out)], env=env, cwd=REPO)


def test_two_nodes_save_into_their_own_memory_and_load_each_file_from_the_fastest_tier(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    """Two gloo ranks, each a node with its own tier: each rank's file is read from its node's memory; the
    coordinator's .metadata is only in node 0's memory until the drain, so before it every rank fails alike, naming
    the checkpoint's s3:// URL, and after it every rank loads."""
    env = rank_environment(s3_server, s3_server.endpoint_url, WORLD_SIZE="2")
    procs = [
        run_worker("two-nodes", bucket, tmp_path, {**env, "RANK": str(rank), "GROUP_RANK": str(rank)})
        for rank in range(2)
    ]
    assert wait_for_ranks(procs, 300) == [0, 0]
    node0, node1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2))
    assert node0["step1"] == {"equal": True, "tiers": dict.fromkeys(
        [".metadata", ".s3ckpt-items.json", "__0_0.distcp"], "memory")}  # fmt: skip
    assert node1["step1"] == {"equal": True, "tiers": {".metadata": "s3", ".s3ckpt-items.json": "s3",
                                                       "__1_0.distcp": "memory"}}  # fmt: skip
    for node in (node0, node1):
        assert f"s3://{bucket}/run/step-2" in node["step2"]["error"]
        assert node["step2 drained"]["equal"] is True
    assert s3_names(s3_client, bucket, "run/step-2") == [".metadata", ".s3ckpt-items.json", "__0_0.distcp",
                                                         "__1_0.distcp"]  # fmt: skip


def test_a_drain_cut_short_at_its_commit_leaves_no_metadata_on_s3_and_the_next_process_finishes_it(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upload of .metadata fails (as a kill there would stop it): its files are on S3, .metadata is not, and the
    commit records still say the drain is pending; the tier the next process opens finishes it."""
    tier, url = tier_config(tmp_path), f"s3://{bucket}/run/step-1"
    upload = s3_memory_tier.NodeTier.upload

    def cut_at_the_commit(copy: Any, writer: Any) -> None:
        if copy.url.endswith("/.metadata"):
            raise KeyboardInterrupt("killed")
        upload(copy, writer)

    monkeypatch.setattr(s3_memory_tier.NodeTier, "upload", staticmethod(cut_at_the_commit))
    writer = save(state_of(1), url, tier)
    with pytest.raises(KeyboardInterrupt):
        writer.finish_drains()
    assert s3_names(s3_client, bucket, "run/step-1") == [".s3ckpt-items.json", "__0_0.distcp"]  # no .metadata
    assert not s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    monkeypatch.setattr(s3_memory_tier.NodeTier, "upload", staticmethod(upload))
    relaunched = s3_dcp_tier.DcpTier(tier, writer.s3)  # what the next process's first writer or reader opens
    relaunched.finish_drains(None, drain_last=False)
    assert s3_names(s3_client, bucket, "run/step-1") == COMMITTED
    load(state_of(1), url, None)


def test_a_file_the_tier_has_no_room_for_goes_to_s3_directly_and_the_save_goes_on(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = tier_config(tmp_path, drain_every=10, capacity_bytes=200_000)  # a shard is 1.2 MB, .metadata a few KB
    save(state_of(1), f"s3://{bucket}/run/step-1", tier).finish_drains()
    url = f"s3://{bucket}/run/step-2"
    writer = save(state_of(2), url, tier)  # not a drained save: only the shard is on S3, the commit in memory
    assert "no room in the memory tier" in caplog.text and "goes to S3 directly" in caplog.text
    assert s3_names(s3_client, bucket, "run/step-2") == ["__0_0.distcp"]
    reader = load(state_of(2), url, tier)
    assert tiers_read(reader) == {".metadata": "memory", ".s3ckpt-items.json": "memory", "__0_0.distcp": "s3"}
    writer.finish_drains()
    assert s3_names(s3_client, bucket, "run/step-2") == COMMITTED
    load(state_of(2), url, None)


def test_a_save_over_a_checkpoint_on_s3_replaces_it_only_once_its_files_are_there(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    """The older .metadata leaves S3 before the new files arrive, the new one comes after them: the prefix never
    holds a .metadata with files of another save."""
    tier, url = tier_config(tmp_path, drain_every=1), f"s3://{bucket}/run/last"
    save(state_of(1), url, tier).finish_drains()
    save(state_of(2), url, tier).finish_drains()
    assert s3_names(s3_client, bucket, "run/last") == COMMITTED
    load(state_of(2), url, None)


SPREAD_SHARD = "s3ckpt-spread-00/step-2/__0_0.distcp"  # rank 0's shard of run/step-2 spread over 2 prefixes
LAYOUT = s3_prefix_spreading.LAYOUT_NAME
SPREAD_TOP = sorted([".metadata", LAYOUT, ".s3ckpt-items.json"])  # what a spread checkpoint has at its own prefix


def spread_save(state: dict[str, Any], url: str, tier: MemoryTier) -> s3_dcp.S3StorageWriter:
    writer = s3_dcp.S3StorageWriter(url, chunk_size_MB=5, memory_tier=tier, prefix_spreading=2)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return writer


def test_with_prefix_spreading_a_save_lands_in_memory_under_its_spread_urls_and_drains_layout_first_metadata_last(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both together: the shard is in memory under the URL S3 will hold it at (run/s3ckpt-spread-00/step-2/); S3
    holds nothing of the checkpoint until its drain; the drain puts the layout record up before the shard and
    .metadata after everything, so ls, rm and gc find every object; a load reads memory, and with the tier wiped
    reads S3, bit-exact."""
    tier, url = tier_config(tmp_path, drain_every=10), f"s3://{bucket}/run/step-2"
    spread_save(state_of(1), f"s3://{bucket}/run/step-1", tier).finish_drains(drain_last=False)  # the drained 1st
    writer = spread_save(state_of(2), url, tier)  # in memory only
    node = s3_dcp_tier.tier_of(tier, writer.s3).node
    assert node.copy_of(f"s3://{bucket}/run/{SPREAD_SHARD}") is not None
    assert sorted(p.name for p in (node.own / bucket / "run" / "step-2").iterdir()) == sorted(
        name + suffix for name in (".metadata", ".s3ckpt-items.json") for suffix in ("", COMMIT_RECORD_SUFFIX))
    assert s3_names(s3_client, bucket, "run/step-2") == s3_names(s3_client, bucket, "run/s3ckpt-spread-00/step-2") == []
    reader = load(state_of(2), url, tier)
    assert tiers_read(reader) == dict.fromkeys([".metadata", ".s3ckpt-items.json", "__0_0.distcp"], "memory")
    assert f"s3://{bucket}/run/{SPREAD_SHARD}" in reader.tier_sources

    order: list[tuple[str, bool]] = []  # each upload from memory, and whether the layout record was on S3 then
    upload = s3_memory_tier.NodeTier.upload

    def noted(copy: Any, target: Any) -> None:
        order.append((copy.url.rsplit("/", 1)[-1], s3_names(s3_client, bucket, "run/step-2") != []))
        upload(copy, target)

    monkeypatch.setattr(s3_memory_tier.NodeTier, "upload", staticmethod(noted))
    writer.finish_drains()  # the last save drains
    assert order == [("__0_0.distcp", True), (".s3ckpt-items.json", True), (".metadata", True)]
    assert s3_names(s3_client, bucket, "run/step-2") == SPREAD_TOP
    assert s3_names(s3_client, bucket, "run/s3ckpt-spread-00/step-2") == ["__0_0.distcp"]
    layout = json.loads(s3_client.get_object(Bucket=bucket, Key=f"run/step-2/{LAYOUT}")["Body"].read())
    assert layout["directories"] == ["../s3ckpt-spread-00/step-2/", "../s3ckpt-spread-01/step-2/"]
    named = sorted(name for name, _ in s3_prefix_spreading.checkpoint_objects(writer.s3, url))
    assert named == sorted([".metadata", LAYOUT, ".s3ckpt-items.json", "../" + SPREAD_SHARD])
    load(state_of(2), url, None)
    shutil.rmtree(node.own)  # the node's memory lost: its tier reads S3
    assert set(tiers_read(load(state_of(2), url, tier)).values()) == {"s3"}


def test_with_prefix_spreading_three_ranks_fill_two_spread_directories_in_memory_and_on_s3(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    """Three ranks of one collective save, played in this process as ``dcp.save`` drives them (rank 0 coordinates):
    ranks 0 and 2 write into spread directory 00, rank 1 into 01, in memory; the drain (the first save drains) puts
    the layout record naming both up, then every shard, then .metadata; a load reads every file from memory, and S3
    alone gives the same state."""
    tier, url = tier_config(tmp_path), f"s3://{bucket}/run/step-2"
    writers = [s3_dcp.S3StorageWriter(url, chunk_size_MB=5, memory_tier=tier, prefix_spreading=2) for _ in range(3)]
    planners = [DefaultSavePlanner() for _ in range(3)]
    states = [{f"w{rank}": torch.full((2000,), float(rank)), f"b{rank}": torch.arange(7.0) * rank} for rank in range(3)]
    for rank, (writer, planner) in enumerate(zip(writers, planners, strict=True)):
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        planner.set_up_planner(state_dict=states[rank], storage_meta=None, is_coordinator=rank == 0)
    local = [w.prepare_local_plan(p.create_local_plan()) for w, p in zip(writers, planners, strict=True)]
    global_plans, metadata = planners[0].create_global_plan(local)
    global_plans = writers[0].prepare_global_plan(global_plans)
    results = [writer.write_data(planner.finish_plan(plan), planner).wait()
               for writer, planner, plan in zip(writers, planners, global_plans, strict=True)]  # fmt: skip
    writers[0].finish(metadata, results)
    node = s3_dcp_tier.tier_of(tier, writers[0].s3).node
    for rank, spread in ((0, "00"), (1, "01"), (2, "00")):
        assert node.copy_of(f"s3://{bucket}/run/s3ckpt-spread-{spread}/step-2/__{rank}_0.distcp") is not None
    writers[0].finish_drains()
    assert s3_names(s3_client, bucket, "run/step-2") == SPREAD_TOP
    assert s3_names(s3_client, bucket, "run/s3ckpt-spread-00/step-2") == ["__0_0.distcp", "__2_0.distcp"]
    assert s3_names(s3_client, bucket, "run/s3ckpt-spread-01/step-2") == ["__1_0.distcp"]
    whole = {key: value for state in states for key, value in state.items()}
    assert set(tiers_read(load(whole, url, tier)).values()) == {"memory"}
    load(whole, url, None)


@pytest.mark.parametrize("cut", ["__0_0.distcp", ".metadata"])
def test_with_prefix_spreading_a_cut_drain_leaves_no_metadata_on_s3_and_the_next_process_finishes_it(
    cut: str, s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill at the spread shard's upload or at .metadata's: S3 has no .metadata (nothing loadable), and the next
    process's tier finishes the drain from the commit records alone (they keep the save's spread directories)."""
    tier, url = tier_config(tmp_path), f"s3://{bucket}/run/step-2"
    upload = s3_memory_tier.NodeTier.upload

    def killed_there(copy: Any, target: Any) -> None:
        if copy.url.endswith("/" + cut):
            raise KeyboardInterrupt("killed")
        upload(copy, target)

    monkeypatch.setattr(s3_memory_tier.NodeTier, "upload", staticmethod(killed_there))
    monkeypatch.setattr(s3_dcp_tier, "DRAIN_WAIT_S", 0.5)  # the commit waits for a shard that never comes
    writer = spread_save(state_of(2), url, tier)
    with pytest.raises((KeyboardInterrupt, TimeoutError)):
        writer.finish_drains()
    assert ".metadata" not in s3_names(s3_client, bucket, "run/step-2")
    assert not s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    monkeypatch.setattr(s3_memory_tier.NodeTier, "upload", staticmethod(upload))
    relaunched = s3_dcp_tier.DcpTier(tier, writer.s3)  # what the next process's first writer or reader opens
    relaunched.finish_drains(None, drain_last=False)
    assert s3_names(s3_client, bucket, "run/step-2") == SPREAD_TOP
    assert s3_names(s3_client, bucket, "run/s3ckpt-spread-00/step-2") == ["__0_0.distcp"]
    load(state_of(2), url, None)


def test_with_prefix_spreading_the_resume_agreement_counts_a_checkpoint_whose_shards_are_in_spread_directories(
    s3_server: Any, bucket: str, tmp_path: Path
) -> None:
    """Step 1 on S3, step 2 in memory only, both spread: the agreement takes step 2 from memory (its shard, under a
    spread prefix, is the checkpoint's), and the load follows it."""
    tier = tier_config(tmp_path, drain_every=10)
    spread_save(state_of(1), f"s3://{bucket}/run/step-1", tier).finish_drains(drain_last=False)
    writer = spread_save(state_of(2), f"s3://{bucket}/run/step-2", tier)
    agreed = s3_dcp_tier.agree_resume(writer, f"s3://{bucket}/run", lambda name: int(name.removeprefix("step-")))
    assert (agreed.step, agreed.url, agreed.tier) == (2, f"s3://{bucket}/run/step-2", "memory")
    assert f"s3://{bucket}/run/{SPREAD_SHARD}" in agreed.sources
    reader = load(state_of(2), agreed.url, tier)
    assert set(tiers_read(reader).values()) == {"memory"}


def test_with_prefix_spreading_a_file_the_tier_has_no_room_for_goes_to_s3_after_the_layout_record(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    tier = tier_config(tmp_path, drain_every=10, capacity_bytes=200_000)  # a shard is 1.2 MB, .metadata a few KB
    spread_save(state_of(1), f"s3://{bucket}/run/step-1", tier).finish_drains()
    url = f"s3://{bucket}/run/step-2"
    writer = spread_save(state_of(2), url, tier)  # not drained: the shard went to S3 directly, the commit did not
    assert s3_names(s3_client, bucket, "run/step-2") == [LAYOUT]
    assert s3_names(s3_client, bucket, "run/s3ckpt-spread-00/step-2") == ["__0_0.distcp"]
    writer.finish_drains()
    assert s3_names(s3_client, bucket, "run/step-2") == SPREAD_TOP
    load(state_of(2), url, None)


def run_launch(s3_server: Any, mode: str, bucket: str, out: Path) -> list[dict[str, Any]]:
    """Both ranks of one launch of the two-node job (each rank a node: its own GROUP_RANK and tier root); the
    results each rank wrote (none for a save)."""
    env = rank_environment(s3_server, s3_server.endpoint_url, WORLD_SIZE="2", LOCAL_RANK="0")
    procs = [run_worker(mode, bucket, out, {**env, "RANK": str(rank), "GROUP_RANK": str(rank)}) for rank in range(2)]
    assert wait_for_ranks(procs, 300) == [0, 0]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)] if mode == "relaunch" else []


def replicas_of_node0(out: Path) -> dict[str, list[str]]:
    """The replicas of node 0's files node 1 holds: checkpoint -> its file names."""
    found: dict[str, list[str]] = {}
    for record in (out / "node1").rglob(f"replicas/*/*/*{COMMIT_RECORD_SUFFIX}"):
        url = json.loads(record.read_text())["url"]
        checkpoint, name = url.rsplit("/", 1)
        found.setdefault(checkpoint.rsplit("/", 1)[-1], []).append(name)
    return {checkpoint: sorted(names) for checkpoint, names in sorted(found.items())}


NODE0_FILES = [".metadata", ".s3ckpt-items.json", "__0_0.distcp"]


@pytest.mark.slow
def test_replicas_keep_whole_dcp_checkpoints_a_replaced_node_loads_and_every_rank_agrees_on_a_loadable_step(
    s3_server: Any, bucket: str, tmp_path: Path
) -> None:
    """Replication on (step 1 on S3, 2 and 3 in memory): node 1 keeps node 0's `keep` newest DCP checkpoints with
    all their files (retention counts checkpoints, not files). Node 0 lost, and its step 3 shard never reached node
    1: node 0's rank reads each of its files of step 2 from node 1's replica, bit-exact. No rank may resume step 3
    (that shard is nowhere), nor fall back to step 1 (S3's newest) while step 2 is whole on the nodes: every rank
    agrees on step 2 in one collective and loads it bit-exact (node 0, its memory emptied again, from node 1)."""
    run_launch(s3_server, "replicated-save", bucket, tmp_path)
    assert replicas_of_node0(tmp_path) == {"step-2": NODE0_FILES, "step-3": NODE0_FILES}
    shutil.rmtree(tmp_path / "node0")  # node 0 lost: a new node with an empty tier takes its place
    for record in (tmp_path / "node1").rglob(f"replicas/*/*/__0_0.distcp{COMMIT_RECORD_SUFFIX}"):
        if "/run/step-3/" in json.loads(record.read_text())["url"]:
            shutil.rmtree(record.parent)
    node0, node1 = run_launch(s3_server, "relaunch", bucket, tmp_path)
    assert node0["step 2"] == {"equal": True, "tiers": dict.fromkeys(NODE0_FILES, "replica")}
    assert node1["step 2"] == {"equal": True, "tiers": {".metadata": "replica", ".s3ckpt-items.json": "replica",
                                                        "__1_0.distcp": "memory"}}  # fmt: skip
    for node in (node0["agreed"], node1["agreed"]):
        assert (node["step"], node["steps"], node["url"], node["equal"]) == (2, [2, 1], f"s3://{bucket}/run/step-2",
                                                                             True)  # fmt: skip
    # node 0 fetches its files from node 1's replicas where the agreement says; node 1's shard, which it does not
    # read, was handed over from node 1's memory (the decision counts every file)
    assert (node0["agreed"]["via"], node0["agreed"]["tiers"]) == ("replica", dict.fromkeys(NODE0_FILES, "replica"))
    assert node1["agreed"]["via"] == "replica"


def test_the_dcp_decision_counts_a_checkpoint_only_where_each_of_its_files_is_reachable(tmp_path: Path) -> None:
    """.metadata (the coordinator's) only in node 0's memory, no replication: node 1 cannot load step 2, so every
    rank takes step 1 from S3. Replicating, node 1 reads node 0's files of step 2 from the replicas it holds. With
    node 1's shard in its memory only, a node 0 whose replicas were lost reaches it only when node 1 replicates
    (node 1 hands it over before the load); node 0 fetches its own files from node 1's replicas."""
    node = s3_memory_tier.NodeTier(tier_config(tmp_path), s3_fencing.current_run())
    run = "s3://my-bucket/run"
    files = [f"{run}/step-2/{name}" for name in (".s3ckpt-items.json", "__0_0.distcp", "__1_0.distcp")]
    meta, items, shard0, shard1 = f"{run}/step-2/.metadata", *files

    def entry(name: str, own: list[str], held: list[str], address: bool = False, replicating: bool = False) -> dict:
        return {"node": name, "address": ["127.0.0.1", 9] if address else None, "directory": run, "own": own,
                "held": [[url, "n0", f"r{i}", f"/replicas/n0/r{i}/x"] for i, url in enumerate(held)],
                "lists": {f"{run}/step-2": [meta, files]} if items in own + held else {},
                "steps": {f"{run}/step-2": 2}, "s3": {f"{run}/step-1": 1}, "replicating": replicating}  # fmt: skip

    alone = [entry("n0", [meta, items, shard0], []), entry("n1", [shard1], [])]
    assert s3_dcp_tier.decide(alone, 1, node, {})[0] == [(1, f"{run}/step-1")]
    replicated = [entry("n0", [meta, items, shard0], [], True, True),
                  entry("n1", [shard1], [meta, items, shard0], True, True)]  # fmt: skip
    steps, mine, sources, *_ = s3_dcp_tier.decide(replicated, 1, node, {})
    assert steps == [(2, f"{run}/step-2"), (1, f"{run}/step-1")]
    assert sorted(mine) == sorted([meta, *files])
    assert {url: source.tier for url, source in sources.items()} == {
        meta: "replica", items: "replica", shard0: "replica", shard1: "memory"}  # fmt: skip
    lost = [entry("n0", [], [], address=True), entry("n1", [shard1], [meta, items, shard0], address=True)]
    assert s3_dcp_tier.decide(lost, 0, node, {})[0] == [(1, f"{run}/step-1")]  # shard 1 out of node 0's reach
    lost[1]["replicating"] = True
    steps, _, sources, hand_overs, any_hand_over = s3_dcp_tier.decide(lost, 1, node, {})
    assert steps[0] == (2, f"{run}/step-2") and any_hand_over and hand_overs == [(shard1, ("127.0.0.1", 9))]
    assert s3_dcp_tier.decide(lost, 0, node, {})[2][meta].peer == ("127.0.0.1", 9)  # fetched from node 1


def test_a_checkpoint_counts_only_where_the_files_that_follow_its_metadata_are_reachable(tmp_path: Path) -> None:
    """megatron-core's metadata.json follows .metadata: node 0 lost its memory, node 1 holds replicas of every DCP
    file of step 2 but not metadata.json, so no rank can load step 2 as megatron-core: every rank takes step 1 (S3).
    With the metadata.json replica held on node 1 too, every rank takes step 2, node 0 fetching metadata.json."""
    node = s3_memory_tier.NodeTier(tier_config(tmp_path), s3_fencing.current_run())
    run = "s3://my-bucket/run"
    meta, items, shard0, shard1, config = (f"{run}/step-2/{name}" for name in (
        ".metadata", ".s3ckpt-items.json", "__0_0.distcp", "__1_0.distcp", "metadata.json"))  # fmt: skip

    def entries(held: list[str]) -> list[dict[str, Any]]:
        common = {"directory": run, "steps": {f"{run}/step-2": 2}, "s3": {f"{run}/step-1": 1}, "replicating": True,
                  "followers": {f"{run}/step-2": [config]}}  # what agree_resume(followers=...) requires
        return [{**common, "node": "n0", "address": ["127.0.0.1", 9], "own": [], "held": [], "lists": {}},
                {**common, "node": "n1", "address": ["127.0.0.1", 10], "own": [shard1],
                 "held": [[url, "n0", f"r{i}", f"/replicas/n0/r{i}/x"] for i, url in enumerate(held)],
                 "lists": {f"{run}/step-2": [meta, [items, shard0, shard1]]}}]  # fmt: skip

    for rank in (0, 1):
        assert s3_dcp_tier.decide(entries([meta, items, shard0]), rank, node, {})[0] == [(1, f"{run}/step-1")]
    steps, mine, sources, *_ = s3_dcp_tier.decide(entries([meta, items, shard0, config]), 0, node, {})
    assert steps[0] == (2, f"{run}/step-2") and config in mine
    assert sources[config].peer == ("127.0.0.1", 10)  # fetched from node 1's replica


def test_the_resume_agreement_counts_a_file_that_went_to_s3_for_want_of_room_and_the_load_reads_it_there(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    """Step 1 drained, step 2 complete with its shard on S3 (no room in the tier) and its commit in memory: every
    rank agrees on step 2, the shard as read from S3, the rest from memory; a shard on S3 whose ETag is not the one
    its record names (written over since) does not count, and every rank takes step 1."""
    tier, run = tier_config(tmp_path, drain_every=10, capacity_bytes=200_000), f"s3://{bucket}/run"
    save(state_of(1), f"{run}/step-1", tier).finish_drains()
    writer = save(state_of(2), f"{run}/step-2", tier)  # not drained: the shard went to S3 directly
    agreed = s3_dcp_tier.agree_resume(writer, run, lambda name: int(name.removeprefix("step-")))
    assert (agreed.step, agreed.steps, agreed.url, agreed.tier) == (2, [2, 1], f"{run}/step-2", "memory")
    assert {url.rsplit("/", 1)[-1]: source.tier for url, source in agreed.sources.items()} == {
        ".metadata": "memory", ".s3ckpt-items.json": "memory", "__0_0.distcp": "s3"}  # fmt: skip
    reader = load(state_of(2), agreed.url, tier)
    assert tiers_read(reader) == {".metadata": "memory", ".s3ckpt-items.json": "memory", "__0_0.distcp": "s3"}

    s3_client.put_object(Bucket=bucket, Key="run/step-2/__0_0.distcp", Body=b"written over")
    agreed = s3_dcp_tier.agree_resume(writer, run, lambda name: int(name.removeprefix("step-")))
    assert (agreed.step, agreed.steps, agreed.tier) == (1, [1], "s3")


def test_the_dcp_decision_reads_a_file_that_went_to_s3_for_want_of_room_there_on_every_node(tmp_path: Path) -> None:
    """Node 1's shard of step 2 went to S3 directly (its record names its ETag); the rest is in node 0's memory and
    replicated to node 1: every rank agrees on step 2, node 1 reads its shard from S3 (not the copy of that URL in
    its memory, an older save's), and nobody hands it over. Listed with another ETag, it does not count."""
    node = s3_memory_tier.NodeTier(tier_config(tmp_path), s3_fencing.current_run())
    run = "s3://my-bucket/run"
    meta, items, shard0, shard1 = (f"{run}/step-2/{name}" for name in (
        ".metadata", ".s3ckpt-items.json", "__0_0.distcp", "__1_0.distcp"))  # fmt: skip

    def entries(etag_on_s3: str) -> list[dict[str, Any]]:
        common = {"directory": run, "steps": {f"{run}/step-2": 2}, "replicating": True,
                  "lists": {f"{run}/step-2": [meta, [items, shard0, shard1]]}, "direct": {shard1: [7, '"e1"']}}
        return [{**common, "node": "n0", "address": ["127.0.0.1", 9], "own": [meta, items, shard0], "held": [],
                 "s3": {f"{run}/step-1": 1}, "loose": {shard1: [7, etag_on_s3]}},
                {**common, "node": "n1", "address": ["127.0.0.1", 10], "own": [shard1], "s3": {},
                 "held": [[url, "n0", f"r{i}", f"/replicas/n0/r{i}/x"] for i, url in enumerate([meta, items, shard0])]}]

    steps, mine, sources, hand_overs, any_hand_over = s3_dcp_tier.decide(entries('"e1"'), 1, node, {})
    assert steps == [(2, f"{run}/step-2"), (1, f"{run}/step-1")] and (hand_overs, any_hand_over) == ([], False)
    assert {url: source.tier for url, source in sources.items() if url in mine} == {
        meta: "replica", items: "replica", shard0: "replica", shard1: "s3"}  # fmt: skip
    assert s3_dcp_tier.decide(entries('"e1"'), 0, node, {})[2][shard1].tier == "s3"
    for rank in (0, 1):
        assert s3_dcp_tier.decide(entries('"other"'), rank, node, {})[0] == [(1, f"{run}/step-1")]


def tier_files(node: s3_memory_tier.NodeTier, bucket: str, checkpoint: str) -> list[str]:
    return sorted(p.name for p in (node.own / bucket / checkpoint).iterdir())


def test_a_checkpoint_saved_again_at_its_url_leaves_none_of_the_replaced_saves_files_in_memory(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    """Saved with two files, then again at the same URL with one: once the new save is in memory, the replaced
    save's file it did not rewrite is gone (as an untiered overwrite removes unused shards from S3), the load reads
    the new state from memory alone, and the drain puts exactly the new checkpoint on S3."""
    tier, url = tier_config(tmp_path, drain_every=10), f"s3://{bucket}/run/last"
    first = s3_dcp.S3StorageWriter(url, memory_tier=tier, thread_count=2)
    dcp.save(state_of(1), storage_writer=first, no_dist=True)
    first.finish_drains(drain_last=False)  # the first save drains: done before the URL is saved again
    node = s3_dcp_tier.tier_of(tier, s3_dcp.S3StorageReader(url).s3).node
    assert [name for name in tier_files(node, bucket, "run/last") if name.endswith(".distcp")] == [
        "__0_0.distcp", "__0_1.distcp"]  # fmt: skip
    writer = save(state_of(2), url, tier)
    writer.finish_drains(drain_last=False)  # waits for the tier's pruning too
    assert tier_files(node, bucket, "run/last") == sorted(
        name + suffix for name in COMMITTED for suffix in ("", COMMIT_RECORD_SUFFIX))
    assert set(tiers_read(load(state_of(2), url, tier)).values()) == {"memory"}
    writer.finish_drains()
    assert s3_names(s3_client, bucket, "run/last") == COMMITTED
    load(state_of(2), url, None)


def test_a_file_saved_again_that_goes_to_s3_for_want_of_room_leaves_no_older_copy_of_its_url_to_read(
    s3_server: Any, bucket: str, tmp_path: Path
) -> None:
    """A small save fits the tier whole; the next save at the same URL has a shard too large for it, which goes to
    S3 directly: the older memory copy of that shard's URL goes, and the load reads the new shard from S3."""
    tier, url = tier_config(tmp_path, drain_every=10, capacity_bytes=200_000), f"s3://{bucket}/run/last"
    small = {"w": torch.arange(100.0), "b": torch.arange(11.0), "step": 1}
    save(small, f"s3://{bucket}/run/first", tier).finish_drains(drain_last=False)  # the one save that drains
    save(small, url, tier).finish_drains(drain_last=False)  # in memory only (on S3 it would refuse the fall-back)
    node = s3_dcp_tier.tier_of(tier, s3_dcp.S3StorageReader(url).s3).node
    assert node.copy_of(url + "/__0_0.distcp") is not None
    save(state_of(2), url, tier).finish_drains(drain_last=False)
    assert node.copy_of(url + "/__0_0.distcp") is None
    reader = load(state_of(2), url, tier)
    assert tiers_read(reader) == {".metadata": "memory", ".s3ckpt-items.json": "memory", "__0_0.distcp": "s3"}
