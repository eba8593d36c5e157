"""megatron-core ``dist_checkpointing`` (torch_dist) checkpoints on S3 through `s3_mcore`.

Two launches of real ranks (tests/helpers/mcore_worker.py; gloo on CPU) serve every multi-rank case: 2 ranks save and
load sync, async (megatron-core's AsyncCallsQueue), under FullyParallelSaveStrategyWrapper and through the NeMo-style
checkpoint IO, fail on one rank's upload, overwrite, get fenced and throttled, exchange checkpoints with stock
megatron-core, save through megatron-core's own (default) strategy with the routing, and leave a replicated tensor to
its main replica; then 1 rank reshards what 2 saved. The single-process tests cover the routing's install / uninstall,
what stays local, the module without megatron-core, and pin the megatron-core names the module uses.

megatron-core is installed by the test set-up (``--no-deps``, see the Makefile); triton's one leaf module is stood in
for (tests/helpers/mcore_stub.py). Without megatron-core every test here is skipped.
"""

from __future__ import annotations

import collections
import importlib.metadata
import inspect
import io
import json
import os
import signal
import subprocess
import sys
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mcore_stub import megatron_core_installed, stand_in_for_triton_leaf

HELPERS = Path(__file__).resolve().parent / "helpers"

if not megatron_core_installed():
    pytest.skip("megatron-core is not installed (see the Makefile's test set-up)", allow_module_level=True)
pytest.importorskip("torch")
pytest.importorskip("moto")  # the rank processes reach the suite's servers through boto3

from fault_proxy import Fault, FaultProxy, FaultRule  # noqa: E402
from s3_servers import empty_and_delete_bucket, rank_environment  # noqa: E402

import s3_mcore  # noqa: E402

pytestmark = [pytest.mark.megatron]

MEGATRON_CORE_VERSION = tuple(int(part) for part in importlib.metadata.version("megatron-core").split(".")[:2])
BEFORE_0_19 = MEGATRON_CORE_VERSION < (0, 19)
"""megatron-core 0.16-0.18 (NeMo 2.x's): common state in its own common.pt, no ``maybe_msc`` (CI runs 0.19, and 0.18
in its second environment)."""

TWO_RANK_SCENARIOS = [
    "sync",
    "metadata",
    "fully_parallel",
    "async",
    "fault_sync",
    "fault_async",
    *(["fault_common"] if BEFORE_0_19 else []),
    "overwrite_fail",
    "overwrite_refused",
    "load_previous",
    "load_requests",
    "from_stock",
    "to_stock",
    "fencing",
    "throttled",
    "nemo_io",
    "default_strategy",
    "main_replica",
    "overwrite",
    "tier_sync",
    "tier_cut",
    "tier_async",
    "tier_two_nodes",
    "tier_nemo_two_nodes",
]


@pytest.fixture(scope="module")
def megatron() -> Any:
    """megatron-core, imported in this process with triton's leaf stood in for where triton is missing."""
    stand_in_for_triton_leaf()
    import megatron.core.dist_checkpointing

    return megatron.core


RANKS_TIMEOUT_S = 300
"""A run of every scenario takes 10-60 s (up to about 100 s on a loaded machine): past this, it hung."""


def _run_ranks(world_size: int, scenarios: list[str], base: str, endpoints: tuple[str, str], out: Path, server: Any):
    env = rank_environment(server, endpoints[0])
    env["PYTHONPATH"] = os.pathsep.join([str(HELPERS), env["PYTHONPATH"]])
    command = [sys.executable, "-m", "mcore_worker", "--world-size", str(world_size)]
    command += ["--scenarios", ",".join(scenarios)]
    command += ["--base", base, "--endpoint", endpoints[0], "--direct-endpoint", endpoints[1], "--out", str(out)]
    # Its own session: a hung job is killed whole (the ranks, megatron-core's upload processes), never left behind.
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as job:
        try:
            stdout, stderr = job.communicate(timeout=RANKS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            stdout, stderr = job.communicate()
            reported = {path.name for path in out.glob("*-rank*.json")}
            hung = [s for s in scenarios if any(f"{s}-rank{r}.json" not in reported for r in range(world_size))]
            where = f"in {hung[0]!r}" if hung else "after the last scenario"
            pytest.fail(f"the ranks hung {where} (killed after {RANKS_TIMEOUT_S} s):\n{stderr[-6000:]}")
    assert job.returncode == 0, f"ranks failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"


def _outcomes(out: Path, scenario: str, world_size: int = 2) -> list[dict[str, Any]]:
    outcomes = [json.loads((out / f"{scenario}-rank{rank}.json").read_text()) for rank in range(world_size)]
    for rank, outcome in enumerate(outcomes):
        assert outcome["ok"], f"{scenario} rank {rank}: {outcome.get('error')}\n{outcome.get('trace')}"
        assert outcome["differences"] == [], f"{scenario} rank {rank}: {outcome['differences']}"
    return outcomes


@pytest.fixture(scope="module")
def mcore_run(s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Runs every scenario once: 2 ranks, then 1 rank loading what 2 saved. On every backend the suite runs, not only
    `S3CKPT_MULTIRANK_BACKENDS`'s: megatron-core support is tested on moto and SeaweedFS both."""
    client = s3_server.client()
    bucket = f"mcore-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    base = f"s3://{bucket}/run"
    outs = {n: tmp_path_factory.mktemp(f"mcore-{n}-ranks") for n in (1, 2)}
    try:
        with FaultProxy(s3_server.endpoint_url) as proxy:
            for name in ("iter_0000040", "iter_0000041", "iter_0000050"):
                proxy.add_rule(FaultRule(Fault.status(500), method="PUT", path_regex=rf"/run/{name}/__1_0\.distcp$"))
            proxy.add_rule(FaultRule(Fault.status(500), method="PUT", path_regex=r"/run/iter_0000042/common\.pt$"))
            throttle = FaultRule(Fault.slow_down(), method="PUT", path_regex=r"/run/throttled/__\d_0\.distcp$", times=3)
            proxy.add_rule(throttle)
            endpoints = (proxy.endpoint_url, s3_server.endpoint_url)
            _run_ranks(2, TWO_RANK_SCENARIOS, base, endpoints, outs[2], s3_server)
            _run_ranks(1, ["reshard"], base, endpoints, outs[1], s3_server)
            yield {"client": client, "bucket": bucket, "outs": outs, "throttle": throttle, "proxy": proxy}
    finally:
        empty_and_delete_bucket(client, bucket)


# ---- 2 ranks --------------------------------------------------------------------------------------------------------

CHECKPOINT_FILES = [".metadata", ".s3ckpt-items.json", "__0_0.distcp", "__1_0.distcp"]
CHECKPOINT_FILES += ["common.pt", "metadata.json"] if BEFORE_0_19 else ["metadata.json"]


def test_sync_save_and_load(mcore_run: dict[str, Any]) -> None:
    """1-D and 2-D (bf16) shards, a replicated tensor, ShardedObjects and common state round-trip; the objects are
    DCP's layout plus megatron-core's metadata.json."""
    for outcome in _outcomes(mcore_run["outs"][2], "sync"):
        assert outcome["names"] == CHECKPOINT_FILES


def test_a_load_reads_each_small_file_once_per_rank(mcore_run: dict[str, Any]) -> None:
    """megatron-core's load checks the directory and reads ``metadata.json`` twice, and opens two DCP readers (the
    common state's, the tensors'), each reading ``.metadata`` and the item record: within one load the routing sends
    one request per rank for each (at thousands of ranks, all of them reach the prefix at once)."""
    _outcomes(mcore_run["outs"][2], "load_requests")
    proxy, prefix = mcore_run["proxy"], f"/{mcore_run['bucket']}/run/counted-load/"
    sent = [(r.method, r.path[len(prefix):]) for r in proxy.requests if r.path.startswith(prefix)]
    listings = [r for r in proxy.requests if r.method == "GET" and "counted-load" in urllib.parse.unquote(r.query)]
    per_file = collections.Counter(name for method, name in sent if method == "GET")
    for name in (".metadata", ".s3ckpt-items.json", "metadata.json"):
        assert per_file[name] == 2, f"{name}: {per_file[name]} GETs by 2 ranks; every request: {sent}"
    common_state_checks = 1 if BEFORE_0_19 else 2  # a HEAD of common.pt, which 0.19 answers with a listing too
    assert len(listings) == 2 * common_state_checks, [r.query for r in listings]


def test_metadata_readers_take_urls_and_collapsed_paths(mcore_run: dict[str, Any]) -> None:
    expected = {"layer.a": [16], "layer.w": [4, 6], "bias": [3]}
    for outcome in _outcomes(mcore_run["outs"][2], "metadata"):
        assert outcome["shapes"] == {"str": expected, "path": expected}
        assert {"layer.a", "layer.w", "bias"} <= set(outcome["sharded_keys"])
        assert any(key.startswith("rng/shard_") for key in outcome["sharded_keys"])
        assert outcome["common"] == {"iteration": 41, "note": "mcore"}
        assert outcome["verified"], outcome["problems"]
        assert "does not exist" in outcome["missing"] and "never-saved" in outcome["missing"]


def test_fully_parallel_wrapper(mcore_run: dict[str, Any]) -> None:
    for outcome in _outcomes(mcore_run["outs"][2], "fully_parallel"):
        assert outcome["names"] == CHECKPOINT_FILES


def test_async_save_commits_in_finalize(mcore_run: dict[str, Any]) -> None:
    """The shards were uploaded by megatron-core's upload process, but neither .metadata nor metadata.json existed
    until the finalize step ran on every rank."""
    for outcome in _outcomes(mcore_run["outs"][2], "async"):
        assert outcome["finalized"] == [0]  # the first call of its queue
        assert ".metadata" not in outcome["before_finalize"] and "metadata.json" not in outcome["before_finalize"]
        assert {"__0_0.distcp", "__1_0.distcp"} <= set(outcome["before_finalize"])


@pytest.mark.parametrize("scenario", ["fault_sync", "fault_async"])
def test_one_ranks_upload_failure_fails_every_rank(mcore_run: dict[str, Any], scenario: str) -> None:
    for outcome in _outcomes(mcore_run["outs"][2], scenario):
        assert outcome["error"].startswith("CheckpointException"), outcome["error"]
        assert "__1_0.distcp" in outcome["error"]
        assert ".metadata" not in outcome["names"] and "metadata.json" not in outcome["names"]
        assert "__1_0.distcp" not in outcome["names"]
        assert outcome["uploads"] == 0
    _outcomes(mcore_run["outs"][2], "load_previous")


@pytest.mark.skipif(not BEFORE_0_19, reason="megatron-core >= 0.19 keeps the common state in the DCP files")
def test_failed_common_state_upload_fails_every_rank(mcore_run: dict[str, Any]) -> None:
    """<= 0.18: rank 0 writes common.pt alone, before the collective save; its upload failing fails every rank at
    once (none waits in a collective), naming the file, with nothing committed."""
    for outcome in _outcomes(mcore_run["outs"][2], "fault_common"):
        assert outcome["error"].startswith("CheckpointException"), outcome["error"]
        assert "/run/iter_0000042/common.pt" in outcome["error"], outcome["error"]
        assert outcome["seconds"] < 60, outcome["seconds"]
        assert outcome["names"] == [] and outcome["uploads"] == 0


def test_failed_overwrite_retired_the_old_checkpoint(mcore_run: dict[str, Any]) -> None:
    for outcome in _outcomes(mcore_run["outs"][2], "overwrite_fail"):
        assert outcome["saved"] == CHECKPOINT_FILES
        assert outcome["error"].startswith("CheckpointException"), outcome["error"]
        assert ".metadata" not in outcome["names"] and "metadata.json" not in outcome["names"]


def test_refused_overwrite_keeps_the_checkpoint_whole(mcore_run: dict[str, Any]) -> None:
    """``overwrite=False`` on an existing checkpoint: every rank raises, nothing there changes, and it loads with its
    own values, common state included (on <= 0.18 rank 0 hands common.pt over before the sharded save starts)."""
    for outcome in _outcomes(mcore_run["outs"][2], "overwrite_refused"):
        assert outcome["error"].startswith("CheckpointException"), outcome["error"]
        assert "overwrite=False" in outcome["error"], outcome["error"]
        assert outcome["before"] == outcome["names"] == CHECKPOINT_FILES


def test_overwrite_loads_the_new_values(mcore_run: dict[str, Any]) -> None:
    for outcome in _outcomes(mcore_run["outs"][2], "overwrite"):
        assert outcome["names"] == CHECKPOINT_FILES


def test_stock_megatron_checkpoint_uploaded_loads_from_s3(mcore_run: dict[str, Any]) -> None:
    for outcome in _outcomes(mcore_run["outs"][2], "from_stock"):
        assert {".metadata", "metadata.json", "__0_0.distcp"} <= set(outcome["local_names"])


def test_s3_checkpoint_downloaded_loads_with_stock_megatron(mcore_run: dict[str, Any]) -> None:
    _outcomes(mcore_run["outs"][2], "to_stock")


def test_fenced_save_fails_on_every_rank(mcore_run: dict[str, Any]) -> None:
    """On every rank, at once (no rank left waiting in a collective), naming what was refused; nothing written (on
    <= 0.18 not even the common.pt rank 0 handed over first)."""
    for outcome in _outcomes(mcore_run["outs"][2], "fencing"):
        assert outcome["error"].startswith("CheckpointException"), outcome["error"]
        assert "CheckpointDirectoryTakenError: Refused" in outcome["error"], outcome["error"]
        assert outcome["checkpoint"] in outcome["error"]
        assert outcome["seconds"] < 60, outcome["seconds"]
        assert outcome["names"] == []


def test_throttled_save_completes(mcore_run: dict[str, Any]) -> None:
    _outcomes(mcore_run["outs"][2], "throttled")
    assert mcore_run["throttle"].fired >= 1


def test_nemo_checkpoint_io_keeps_urls(mcore_run: dict[str, Any]) -> None:
    """NeMo's layout (<checkpoint>/weights) on S3, sync and async (scheduled and finalized as NeMo's
    AsyncFinalizableCheckpointIO does, with a finalize function of the caller's), then removed."""
    for outcome in _outcomes(mcore_run["outs"][2], "nemo_io"):
        assert outcome["names"] == [f"weights/{name}" for name in CHECKPOINT_FILES]
        assert outcome["async_names"] == [f"weights/{name}" for name in CHECKPOINT_FILES]
        assert outcome["extra_finalize"] == [True]
        assert outcome["removed"] == []
        assert outcome["content_metadata"] == {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        assert outcome["missing"].startswith("FileNotFoundError: Checkpoint file not found"), outcome["missing"]


def test_resume_discovery_on_what_megatron_core_wrote(mcore_run: dict[str, Any]) -> None:
    """connector's resume discovery over the checkpoints above, as this megatron-core wrote them (with common.pt on
    <= 0.18): the newest complete iter_NNNNNNN first, never one whose save failed."""
    import connector

    base = f"s3://{mcore_run['bucket']}/run"
    candidates = {c.name: c for c in connector.list_resume_candidates(base)}
    usable = sorted(name for name, candidate in candidates.items() if candidate.problem is None)
    assert usable == ["iter_0000010", "iter_0000020", "iter_0000030"], candidates
    assert {"iter_0000040", "iter_0000041", "iter_0000050"} <= set(candidates)
    assert connector.find_resume_checkpoints(base) == [f"{base}/iter_00000{n}" for n in (30, 20, 10)]


def test_megatron_cores_own_strategy_saves_to_s3_not_to_a_local_directory(mcore_run: dict[str, Any]) -> None:
    """With the routing installed, ``dist_checkpointing.save(sd, "s3://...")`` with no strategy (megatron-core's
    default) and ``('torch_dist', 1)`` async under the fully-parallel wrapper go to S3 through this package: the
    checkpoints are complete there and load, and no local ``./s3:`` directory appears."""
    for outcome in _outcomes(mcore_run["outs"][2], "default_strategy"):
        assert outcome["local"] == [], outcome["local"]
        assert outcome["names"] == {"default-strategy": CHECKPOINT_FILES, "default-async": CHECKPOINT_FILES}


def test_the_main_replica_writes_a_replicated_tensor(mcore_run: dict[str, Any]) -> None:
    """megatron-core's default ``keep_only_main_replica=True``: the rank holding ``replica_id`` 0 writes it."""
    for outcome in _outcomes(mcore_run["outs"][2], "main_replica"):
        assert outcome["files"] == [f"__{outcome['main_rank']}_0.distcp"], outcome["files"]


def test_reshard_two_to_one(mcore_run: dict[str, Any]) -> None:
    _outcomes(mcore_run["outs"][1], "reshard", world_size=1)


# ---- 2 ranks through the memory tier, on one node and on two (tests/helpers/mcore_tier_scenarios.py) ----------------

DCP_FILES = [".metadata", ".s3ckpt-items.json", "__0_0.distcp", "__1_0.distcp"]
"""What the DCP part of a 2-rank checkpoint has on S3 (CHECKPOINT_FILES less megatron-core's own files)."""
MEGATRON_FILES = ["common.pt", "metadata.json"] if BEFORE_0_19 else ["metadata.json"]


def test_a_save_lands_in_memory_and_a_megatron_core_load_reads_it_there(mcore_run: dict[str, Any]) -> None:
    """The second save is not on S3 at all, yet megatron-core loads it, every file from the node's memory
    (metadata.json and common state included: S3 has none of them); S3 alone does not know it."""
    for outcome in _outcomes(mcore_run["outs"][2], "tier_sync"):
        assert outcome["names"] == {"iter_0000001": CHECKPOINT_FILES, "iter_0000002": []}, outcome["warnings"]
        assert outcome["memory"]["tiers"] == ["memory"]
        assert "does not exist" in outcome["s3_only"]["error"], outcome["s3_only"]
        assert outcome["names_after_finish"] == CHECKPOINT_FILES  # finish_drains: the last save reaches S3


def test_megatron_cores_files_reach_s3_after_every_file_and_metadata(mcore_run: dict[str, Any]) -> None:
    """The coordinator drains the item checksums, then .metadata, then megatron-core's files (common.pt before
    metadata.json on <= 0.18): metadata.json, what megatron-core's load looks for first, is the last to reach S3."""
    coordinator, other = _outcomes(mcore_run["outs"][2], "tier_sync")
    for drained in (coordinator["drained"], coordinator["drained_last"]):
        assert drained[0] == "__0_0.distcp" and drained[-(2 + len(MEGATRON_FILES)) :] == [
            ".s3ckpt-items.json", ".metadata", *MEGATRON_FILES
        ]  # fmt: skip
    assert other["drained"] == other["drained_last"] == ["__1_0.distcp"]


def test_a_drain_killed_before_metadata_json_leaves_no_loadable_checkpoint_and_the_next_process_finishes_it(
    mcore_run: dict[str, Any],
) -> None:
    coordinator, other = _outcomes(mcore_run["outs"][2], "tier_cut")
    for name, file in (("iter_0000003", ".metadata"), ("iter_0000004", "metadata.json")):
        assert coordinator["killed"][name].startswith("KeyboardInterrupt: killed while draining s3://")
        assert coordinator["killed"][name].endswith(f"/{name}/{file}")
    assert other["killed"] == {"iter_0000003": "", "iter_0000004": ""}
    for outcome in (coordinator, other):
        assert outcome["after_kill"] == {
            "iter_0000003": [".s3ckpt-items.json", "__0_0.distcp", "__1_0.distcp"],  # no .metadata, no metadata.json
            "iter_0000004": DCP_FILES + MEGATRON_FILES[:-1],  # all but metadata.json
        }
        for refused in outcome["refused"].values():  # megatron-core does not take either for a checkpoint
            assert "is not a distributed checkpoint" in refused["error"], refused
        assert outcome["names"] == {"iter_0000003": CHECKPOINT_FILES, "iter_0000004": CHECKPOINT_FILES}
    assert coordinator["drained"]["iter_0000003"][-(2 + len(MEGATRON_FILES)) :] == [
        ".s3ckpt-items.json", ".metadata", *MEGATRON_FILES
    ]  # fmt: skip


def test_an_async_save_commits_in_memory_without_an_upload_process_and_drains_behind(
    mcore_run: dict[str, Any],
) -> None:
    """megatron-core's own strategy, async: the copy into memory is the save's staging, so megatron-core's queue gets
    a request with nothing to run in an upload process (whose end would cut a drain short); the finalize step adds
    metadata.json, the drain takes it to S3 last, and S3 alone then loads the checkpoint."""
    coordinator, _ = found = _outcomes(mcore_run["outs"][2], "tier_async")
    for outcome in found:
        assert outcome["upload_process"] is False and outcome["finalized"] == [0]
        assert outcome["memory"]["tiers"] == ["memory"]
        assert outcome["names"] == CHECKPOINT_FILES
        assert outcome["s3_only"]["differences"] == []
    assert coordinator["drained"][-1] == "metadata.json"


def test_two_nodes_agree_on_a_checkpoint_only_in_memory_and_megatron_core_loads_it_from_the_peers_replicas(
    mcore_run: dict[str, Any],
) -> None:
    """Each rank a node of its own, replication started: iter_0000007 is only in the nodes' memory (S3 has none of
    it) when node 0 loses its memory and the replicas it held. Every rank agrees on it, not on iter_0000006 (S3's
    newest) nor on iter_0000008 (on S3 without metadata.json), and megatron-core loads it bit-exact: node 0 fetches
    each file, metadata.json included, from node 1's replicas (node 1's shard, in node 1's memory only, handed over);
    node 1 reads its shard from memory and node 0's files from the replicas it holds. Without metadata.json on the
    peer, every rank would resume iter_0000006."""
    node0, node1 = _outcomes(mcore_run["outs"][2], "tier_two_nodes")
    files = DCP_FILES + MEGATRON_FILES
    for node in (node0, node1):
        assert node["on_s3"] == []
        assert node["agreed"] == [7, [7, 6], "replica"]
        assert sorted(node["sources"]) == sorted(files)
    assert node0["sources"] == {**{name: ["replica", True] for name in files}, "__1_0.distcp": ["replica", False]}
    assert node1["sources"] == {**{name: ["replica", False] for name in files}, "__1_0.distcp": ["memory", False]}
    assert set(node0["first_reads"].values()) == {"replica"} and "__0_0.distcp" in node0["first_reads"]
    assert node1["first_reads"]["__1_0.distcp"] == "memory"
    assert {tier for name, tier in node1["first_reads"].items() if name != "__1_0.distcp"} == {"replica"}


def test_nemo_checkpoint_io_with_the_memory_tier_replicates_and_agrees_by_itself_on_two_nodes(
    mcore_run: dict[str, Any],
) -> None:
    """NeMo 2.x's S3MegatronCheckpointIO with ``memory_tier`` (over a stand-in for NeMo's class), each rank a node of
    its own, no call to s3_mcore's functions: its saves replicate to the other node by themselves, and after node 0
    lost its memory, its content-metadata read and its load agree on every rank by themselves and load model--step=7
    (only in the nodes' memory) bit-exact: node 0 from node 1's replicas, node 1 its shard from its memory."""
    node0, node1 = _outcomes(mcore_run["outs"][2], "tier_nemo_two_nodes")
    for node in (node0, node1):
        assert node["replicated"] is True
        assert node["on_s3"] == []
        assert node["content_metadata"] == {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    assert set(node0["first_reads"].values()) == {"replica"} and "__0_0.distcp" in node0["first_reads"]
    assert node1["first_reads"]["__1_0.distcp"] == "memory"
    assert {tier for name, tier in node1["first_reads"].items() if name != "__1_0.distcp"} == {"replica"}


# ---- this process: the routing, the module without megatron-core -----------------------------------------------------


def test_urls_megatron_core_hands_over() -> None:
    assert s3_mcore.megatron_s3_url("s3://bkt/run/iter_0000001/") == "s3://bkt/run/iter_0000001"
    assert s3_mcore.megatron_s3_url(Path("s3://bkt/run/iter_0000001")) == "s3://bkt/run/iter_0000001"
    assert s3_mcore.megatron_s3_url(str(Path("s3://bkt/run"))) == "s3://bkt/run"  # megatron-core's str(Path(...))
    assert s3_mcore.megatron_s3_url("s3://bkt") == "s3://bkt"
    for other in ("/tmp/ckpt", Path("/tmp/ckpt"), "msc://profile/ckpt", "ckpt/s3:/x", None, 3):
        assert s3_mcore.megatron_s3_url(other) is None
    # NeMo's checkpoint names carry Lightning's .ckpt; its checkpoint directory does not (ckpt_to_dir)
    assert s3_mcore.nemo_checkpoint_url(Path("s3://bkt/run/model--step=9-last.ckpt")) == "s3://bkt/run/model--step=9-last"
    assert s3_mcore.nemo_checkpoint_url("/tmp/x.ckpt") is None


def test_importing_s3_mcore_needs_no_megatron_core() -> None:
    """Importing never fails; using it names the pip line."""
    from optional_imports import HIDE_PREAMBLE

    code = HIDE_PREAMBLE.format(hidden={"megatron", "nemo"}) + (
        "import s3_mcore, s3_utils\n"
        "assert s3_mcore.megatron_s3_url('s3://bkt/k') == 's3://bkt/k'\n"
        "for use in (lambda: s3_mcore.S3TorchDistSaveShardedStrategy, s3_mcore.install_s3_routing,\n"
        "            lambda: s3_mcore.megatron_checkpoint_io_class()):\n"
        "    try:\n"
        "        use()\n"
        "    except s3_utils.MissingOptionalDependencyError as exc:\n"
        "        print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 3, done.stdout
    assert all(s3_mcore.MEGATRON_CORE_PIP in line for line in lines[:2])
    assert "nemo-toolkit 2.x" in lines[2]


@pytest.fixture
def routed(megatron: Any) -> Iterator[Any]:
    from megatron.core import msc_utils

    assert s3_mcore.routing() is None
    yield msc_utils
    active = s3_mcore.routing()
    if active is not None:
        active.uninstall()


@pytest.mark.skipif(BEFORE_0_19, reason="megatron-core >= 0.19's maybe_msc")
def test_one_s3_utils_reaches_the_save_strategy_the_routing_and_the_loads_it_routes(routed: Any) -> None:
    """An `S3Utils` given to megatron-core's save strategy, to the routing, or (as writer options) to NeMo 2.x's
    checkpoint IO is what their writers use and what the readers of megatron-core's own loads use: loads go where
    saves went; reader options that say how to reach S3 still win (docs/s3.md)."""
    from megatron.core.dist_checkpointing import serialization

    from s3_utils import S3ClientSettings, S3Utils

    url = "s3://bkt/run/iter_0000001"
    s3 = S3Utils(S3ClientSettings(endpoint_url="http://127.0.0.1:9"))
    assert s3_mcore.S3TorchDistSaveShardedStrategy(s3_utils=s3).s3_writer(url).s3 is s3

    class NeMoLike:  # NeMo 2.x's MegatronCheckpointIO, as far as the constructor goes
        def __init__(self, **kwargs: Any) -> None:
            pass

    s3_mcore.megatron_checkpoint_io_class(NeMoLike)(s3_writer_options={"client_settings": s3.settings})
    routing = s3_mcore.routing()
    assert routing is not None and routing.s3.settings.endpoint_url == "http://127.0.0.1:9"
    assert serialization._get_filesystem_reader(Path(url)).s3 is routing.s3
    s3_mcore.install_s3_routing(s3)
    assert serialization._get_filesystem_reader(Path(url)).s3 is s3
    s3_mcore.install_s3_routing(s3, reader_options={"endpoint_url": "http://127.0.0.1:8"})
    assert serialization._get_filesystem_reader(Path(url)).s3.settings.endpoint_url == "http://127.0.0.1:8"


@pytest.mark.skipif(BEFORE_0_19, reason="megatron-core >= 0.19's maybe_msc")
def test_routing_installs_once_and_uninstalls(routed: Any, tmp_path: Path) -> None:
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategies

    msc_utils = routed
    from megatron.core import dist_checkpointing

    before = (type(msc_utils.maybe_msc), torch_strategies._get_filesystem_reader, serialization._get_filesystem_reader)
    before += (serialization.load, dist_checkpointing.load)
    first = s3_mcore.install_s3_routing()
    assert dist_checkpointing.load is serialization.load is not before[-1]  # a load of s3:// in `s3_dcp.one_load`
    assert s3_mcore.install_s3_routing(reader_options={"max_read_concurrency": 3}) is first
    assert first.mechanism == "maybe_msc" and first.reader_options == {"max_read_concurrency": 3}
    assert not msc_utils.MultiStorageClientFeature.is_enabled()  # the MSC flag is left alone
    maybe = msc_utils.maybe_msc
    # local paths: what megatron-core used before
    (tmp_path / "metadata.json").write_text("{}")
    with maybe.open(str(tmp_path / "metadata.json")) as file:
        assert file.read() == "{}"
    assert isinstance(maybe.Path(str(tmp_path)), Path)
    assert maybe.path_isdir(str(tmp_path), strict=False) and maybe.os.path.exists(str(tmp_path / "metadata.json"))
    from torch.distributed.checkpoint import FileSystemReader

    assert type(torch_strategies._get_filesystem_reader(str(tmp_path))) is FileSystemReader
    # s3:// and its collapsed forms: this package
    assert str(maybe.Path(str(Path("s3://bkt/run/iter_0000001")))) == "s3://bkt/run/iter_0000001"
    reader = serialization._get_filesystem_reader(Path("s3://bkt/run/iter_0000001"))
    assert type(reader).__name__ == "S3StorageReader" and reader.path == "s3://bkt/run/iter_0000001"
    assert reader.max_read_concurrency == 3
    first.uninstall()
    after = (type(msc_utils.maybe_msc), torch_strategies._get_filesystem_reader, serialization._get_filesystem_reader)
    after += (serialization.load, dist_checkpointing.load)
    assert after == before and s3_mcore.routing() is None


def test_a_write_that_raises_uploads_nothing(routed: Any, bucket: str, s3_client: Any) -> None:
    """megatron-core writes its own files through the routing (``with open(...) as f: json.dump(obj, f)``,
    ``torch.save``): a writer that raises mid-way leaves no object behind, since a truncated ``metadata.json`` or
    ``common.pt`` would be read as the checkpoint's."""
    routing = s3_mcore.install_s3_routing(fencing=False)
    url = f"s3://{bucket}/run/iter_0000001/metadata.json"
    for mode, start in (("w", "{"), ("wb", b"{")):
        with pytest.raises(RuntimeError, match="the writer failed"), routing.open(url, mode) as file:
            file.write(start)
            raise RuntimeError("the writer failed")
    assert s3_client.list_objects_v2(Bucket=bucket).get("KeyCount") == 0
    with routing.open(url, "w") as file:
        file.write("{}")
    assert s3_client.get_object(Bucket=bucket, Key="run/iter_0000001/metadata.json")["Body"].read() == b"{}"


def test_megatron_cores_small_reads_and_directory_checks_take_one_request_each(routed: Any, bucket: str) -> None:
    """Every rank of a megatron-core load checks and reads ``metadata.json`` (twice each) and asks whether the
    checkpoint is a directory (twice): through the routing, a read is one GET (no HEAD first), a check of
    ``metadata.json`` reads it for the read right after (never past a write), and a directory check is one listing:
    at thousands of ranks, that is what reaches the prefix at once. An object is not a directory."""
    routing = s3_mcore.install_s3_routing(fencing=False)
    checkpoint = f"s3://{bucket}/run/iter_0000001"
    with routing.open(f"{checkpoint}/metadata.json", "w") as file:
        file.write('{"sharded_backend": "torch_dist"}')
    sent: list[str] = []

    def note(event_name: str, **kwargs: Any) -> None:
        sent.append(event_name.rsplit(".", 1)[-1])

    routing.s3.client.meta.events.register("before-send.s3", note)
    try:
        with routing.open(f"{checkpoint}/metadata.json") as file:
            assert json.loads(file.read()) == {"sharded_backend": "torch_dist"}
        assert sent == ["GetObject"]
        sent.clear()
        # megatron-core's check, then its read: the check reads it, the read sends nothing
        assert routing.exists(f"{checkpoint}/metadata.json") and not routing.exists(f"{checkpoint}/none.json")
        assert sent == ["GetObject", "HeadObject"]
        with routing.open(f"{checkpoint}/metadata.json") as file:
            assert json.loads(file.read()) == {"sharded_backend": "torch_dist"}
        assert sent == ["GetObject", "HeadObject"]
        with routing.open(f"{checkpoint}/metadata.json") as file:  # the check's bytes serve one read only
            file.read()
        assert sent == ["GetObject", "HeadObject", "GetObject"]
        sent.clear()
        # a write between the check and the read: the read is of what was written
        assert routing.exists(f"{checkpoint}/metadata.json")
        with routing.open(f"{checkpoint}/metadata.json", "w") as file:
            file.write('{"sharded_backend": "torch_dist", "version": 2}')
        with routing.open(f"{checkpoint}/metadata.json") as file:
            assert json.loads(file.read())["version"] == 2
        sent.clear()
        assert routing.is_dir(checkpoint) and routing.is_dir(f"{checkpoint}/")
        assert not routing.is_dir(f"{checkpoint}/metadata.json") and not routing.is_dir(f"s3://{bucket}/elsewhere")
        assert sent == ["ListObjectsV2"] * 4
    finally:
        routing.s3.client.meta.events.unregister("before-send.s3", note)


class FakeMultiStorageClient:
    """Stands in for the multistorageclient module: records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        outer = self

        class Os:
            class path:  # noqa: N801 (the module's name)
                @staticmethod
                def exists(p: Any) -> bool:
                    outer.calls.append(("exists", p))
                    return True

                @staticmethod
                def isdir(p: Any, strict: bool = True) -> bool:
                    outer.calls.append(("isdir", p))
                    return True

        self.os = Os

    def open(self, path: Any, mode: str = "r") -> Any:
        self.calls.append(("open", path))
        return io.StringIO("{}")


@pytest.mark.skipif(BEFORE_0_19, reason="megatron-core >= 0.19's maybe_msc")
def test_a_real_multi_storage_client_keeps_its_paths(routed: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    msc_utils = routed
    fake = FakeMultiStorageClient()
    monkeypatch.setattr(msc_utils, "msc", fake)
    monkeypatch.setattr(msc_utils.MultiStorageClientFeature, "_enabled", True)
    routing = s3_mcore.install_s3_routing()
    maybe = msc_utils.maybe_msc
    with maybe.open("msc://profile/run/metadata.json") as file:
        assert file.read() == "{}"
    assert maybe.path_isdir("msc://profile/run", strict=False)
    assert fake.calls == [("open", "msc://profile/run/metadata.json"), ("isdir", "msc://profile/run")]
    assert str(maybe.Path("s3://bkt/run")) == "s3://bkt/run"  # s3:// is still this package's
    routing.uninstall()
    assert msc_utils.msc is fake and msc_utils.MultiStorageClientFeature.is_enabled()


def test_routing_without_maybe_msc_replaces_the_msc_module(routed: Any, monkeypatch: pytest.MonkeyPatch, tmp_path):
    """megatron-core <= 0.18 has no ``maybe_msc``: the routing stands in for multi-storage-client's module and turns
    the MSC flag on; every other path still reaches the stdlib, and uninstall puts both back."""
    msc_utils = routed
    monkeypatch.delattr(msc_utils, "maybe_msc", raising=False)
    previous = msc_utils.msc
    routing = s3_mcore.install_s3_routing()
    try:
        assert routing.mechanism == "msc_module" and msc_utils.MultiStorageClientFeature.is_enabled()
        facade = msc_utils.MultiStorageClientFeature.import_package()
        (tmp_path / "common.pt").write_bytes(b"x")
        assert facade.os.path.isdir(str(tmp_path), strict=False) and facade.os.path.exists(str(tmp_path / "common.pt"))
        with facade.open(str(tmp_path / "common.pt"), "rb") as file:
            assert file.read() == b"x"
        assert isinstance(facade.Path(str(tmp_path)), Path)
        local_reader = facade.torch.MultiStorageFileSystemReader(str(tmp_path), thread_count=2)
        assert type(local_reader).__name__ == "FileSystemReader"
        assert type(facade.torch.MultiStorageFileSystemReader("s3://bkt/ckpt")).__name__ == "S3StorageReader"
        assert str(facade.Path("s3://bkt/ckpt") / "common.pt") == "s3://bkt/ckpt/common.pt"
    finally:
        routing.uninstall()
    assert msc_utils.msc is previous and not msc_utils.MultiStorageClientFeature.is_enabled()


def test_bad_writer_options_fail_when_the_strategy_is_built(megatron: Any) -> None:
    with pytest.raises(ValueError, match="chunk_size_MB"):
        s3_mcore.S3TorchDistSaveShardedStrategy(chunk_size_MB=1)


def test_the_strategy_takes_megatron_cores_arguments_and_defaults(megatron: Any) -> None:
    """Every argument of megatron-core's ``TorchDistSaveShardedStrategy``, with its default; what S3 cannot honour is
    refused by name, and an unknown keyword is named with the strategy, not by S3StorageWriter."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    strategy_class = s3_mcore.S3TorchDistSaveShardedStrategy
    ours = inspect.signature(strategy_class.__init__).parameters
    for name, parameter in inspect.signature(TorchDistSaveShardedStrategy.__init__).parameters.items():
        assert name in ours and ours[name].default == parameter.default, (name, ours.get(name))
    default = strategy_class()
    assert default.keep_only_main_replica is True and default.backend == "torch_dist" and default.version == 1
    accepted = strategy_class("torch_dist", 1, False, 2, cached_metadata=True, cpu_shm_mode=True, overwrite=False)
    assert (accepted.keep_only_main_replica, accepted.thread_count) == (False, 2)
    assert accepted.use_cached_ckpt_structure is True  # megatron-core's attribute for it
    with pytest.raises(ValueError, match=r"separation_hint='optimizer\.'.*separate files.*leave it None"):
        strategy_class(separation_hint="optimizer.")
    with pytest.raises(TypeError, match="S3TorchDistSaveShardedStrategy got an unexpected keyword argument 'bogus'"):
        strategy_class(bogus=1)
    assert strategy_class(memory_tier={"root": "tier", "drain_every": 5}).writer_options["memory_tier"] == {
        "root": "tier", "drain_every": 5
    }  # fmt: skip


def test_plain_classes_at_module_level(megatron: Any) -> None:
    """The writer is a class of the module's own source; the strategy is the module's mixin on megatron-core's base."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    assert s3_mcore.MegatronS3StorageWriter.__qualname__ == "MegatronS3StorageWriter"
    assert "prepare_global_plan" in inspect.getsource(s3_mcore.MegatronS3StorageWriter)
    mro = s3_mcore.S3TorchDistSaveShardedStrategy.__mro__
    assert mro[1:3] == (s3_mcore.S3SaveShardedStrategyMixin, TorchDistSaveShardedStrategy)


def test_megatron_cores_local_writer_refuses_an_s3_url(routed: Any) -> None:
    """The last guard: whatever strategy (a subclass with its own ``async_save``, say) hands megatron-core's local
    writer an s3:// checkpoint while the routing is installed, it raises naming the URL and the fix instead of
    writing into a local ``s3:/`` directory; uninstalling puts the writer back."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    init = FileSystemWriterAsync.__init__
    routing = s3_mcore.install_s3_routing()
    try:
        for path in ("s3://bkt/run/iter_0000001", Path("s3://bkt/run/iter_0000001")):
            with pytest.raises(ValueError, match=r"s3://bkt/run/iter_0000001.*S3TorchDistSaveShardedStrategy"):
                FileSystemWriterAsync(path, thread_count=1)
        assert not Path("s3:").exists()
    finally:
        routing.uninstall()
    assert FileSystemWriterAsync.__init__ is init


# ---- megatron-core names s3_mcore relies on (pinned: a release that changes them fails here first) -------------------


def test_pinned_strategy_internals(megatron: Any) -> None:
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategies

    params = inspect.signature(torch_strategies._replace_state_dict_keys_with_sharded_keys).parameters
    assert list(params)[:2] == ["sharded_state_dict", "keep_only_main_replica"]
    conversion = inspect.signature(torch_strategies.mcore_to_pyt_state_dict).parameters
    assert list(conversion)[:2] == ["state_dict", "is_loading"]
    planner_params = inspect.signature(torch_strategies.MCoreSavePlanner.__init__).parameters
    assert {"dedup_replicated_tensors", "can_run_decentralized_global_plan"} <= set(planner_params)
    init = inspect.signature(torch_strategies.TorchDistSaveShardedStrategy.__init__).parameters
    assert list(init)[1:5] == ["backend", "version", "keep_only_main_replica", "thread_count"]
    assert "checkpoint_dir" in inspect.signature(torch_strategies._get_filesystem_reader).parameters
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization

    assert dist_checkpointing.load is serialization.load  # the package's name for it, wrapped in both places
    assert list(inspect.signature(serialization.load).parameters)[:2] == ["sharded_state_dict", "checkpoint_dir"]
    assert hasattr(torch_strategies, "TorchDistLoadShardedStrategy")


@pytest.mark.skipif(BEFORE_0_19, reason="megatron-core >= 0.19's hooks")
def test_pinned_file_operation_hooks(megatron: Any) -> None:
    """0.19: every file operation outside the writer goes through ``msc_utils.maybe_msc`` (open/os/Path/torch through
    its class's ``__getattr__``, ``path_isdir(path, strict)``), the DCP reader through ``_get_filesystem_reader``, also
    imported by name into ``serialization``; the MSC flag and module (<= 0.18's hook) keep their names."""
    from megatron.core import msc_utils
    from megatron.core.dist_checkpointing import core, serialization, validation
    from megatron.core.dist_checkpointing.strategies import common

    maybe_class = type(msc_utils.maybe_msc)
    assert "__getattr__" in vars(maybe_class) and "path_isdir" in vars(maybe_class)
    assert list(inspect.signature(maybe_class.path_isdir).parameters) == ["self", "path", "strict"]
    for module in (core, serialization, validation, common):
        assert module.maybe_msc is msc_utils.maybe_msc
    assert serialization._get_filesystem_reader is megatron.dist_checkpointing.strategies.torch._get_filesystem_reader
    flag = msc_utils.MultiStorageClientFeature
    assert callable(flag.enable) and callable(flag.disable) and callable(flag.is_enabled) and hasattr(msc_utils, "msc")
    assert core.CONFIG_FNAME == s3_mcore.CONFIG_NAME
    import connector

    assert connector._MEGATRON_CONFIG_NAME == s3_mcore.CONFIG_NAME  # resume discovery spells it too


@pytest.mark.skipif(not BEFORE_0_19, reason="megatron-core <= 0.18's hooks")
def test_pinned_file_operation_hooks_before_0_19(megatron: Any) -> None:
    """<= 0.18: file operations ask ``MultiStorageClientFeature.is_enabled()``, then use the module ``msc_utils.msc``
    (``import_package``); rank 0 writes the common state with ``save_common`` through ``msc.torch.save`` to
    ``common.pt`` (the name by which a failure of that write is held for the strategy to raise on every rank)."""
    from megatron.core import msc_utils
    from megatron.core.dist_checkpointing import core, serialization
    from megatron.core.dist_checkpointing.strategies import common

    assert not hasattr(msc_utils, "maybe_msc") and hasattr(msc_utils, "msc")
    flag = msc_utils.MultiStorageClientFeature
    assert all(callable(getattr(flag, name)) for name in ("enable", "disable", "is_enabled", "import_package"))
    for module in (core, serialization, common):
        assert module.MultiStorageClientFeature is flag
    assert serialization.save_common is common.save_common
    assert "msc.torch.save(common_state_dict, path)" in inspect.getsource(common.save_common)
    assert common.COMMON_STATE_FNAME == s3_mcore.COMMON_STATE_NAME
    assert core.CONFIG_FNAME == s3_mcore.CONFIG_NAME


def test_pinned_async_and_dcp_internals(megatron: Any) -> None:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from torch.distributed.checkpoint.utils import _DistWrapper

    assert AsyncRequest._fields[:3] == ("async_fn", "async_fn_args", "finalize_fns")
    assert callable(AsyncRequest.add_finalize_fn)
    assert {"schedule_async_request", "maybe_finalize_async_calls", "close"} <= set(dir(AsyncCallsQueue))
    assert list(inspect.signature(FullyParallelSaveStrategyWrapper.__init__).parameters)[1:3] == [
        "strategy",
        "parallelization_group",
    ]
    assert list(inspect.signature(_DistWrapper.__init__).parameters)[1:4] == ["group", "use_dist", "coordinator_rank"]
    for method in (_DistWrapper.reduce_scatter, _DistWrapper.all_reduce):
        assert list(inspect.signature(method).parameters)[1:] == ["step", "map_fun", "reduce_fun"]
