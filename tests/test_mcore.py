"""megatron-core ``dist_checkpointing`` (torch_dist) checkpoints on S3 through `s3_mcore`.

Two launches of real ranks (tests/helpers/mcore_worker.py; gloo on CPU) serve every multi-rank case: 2 ranks save and
load sync, async (megatron-core's AsyncCallsQueue), under FullyParallelSaveStrategyWrapper and through the NeMo-style
checkpoint IO, fail on one rank's upload, overwrite, get fenced and throttled, exchange checkpoints with stock
megatron-core; then 1 rank reshards what 2 saved. The single-process tests cover the routing's install / uninstall,
what stays local, the module without megatron-core, and pin the megatron-core names the module uses.

megatron-core is installed by the test set-up (``--no-deps``, see the Makefile); triton's one leaf module is stood in
for (tests/helpers/mcore_stub.py). Without megatron-core every test here is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HELPERS = Path(__file__).resolve().parent / "helpers"
sys.path.insert(0, str(HELPERS))
from mcore_stub import megatron_core_installed, stand_in_for_triton_leaf  # noqa: E402

if not megatron_core_installed():
    pytest.skip("megatron-core is not installed (see the Makefile's test set-up)", allow_module_level=True)
pytest.importorskip("torch")
pytest.importorskip("moto")  # the rank processes reach the suite's servers through boto3

from fault_proxy import Fault, FaultProxy, FaultRule  # noqa: E402
from s3_servers import empty_and_delete_bucket, rank_environment, skip_unless_multirank_backend  # noqa: E402

pytestmark = [pytest.mark.megatron]

TWO_RANK_SCENARIOS = [
    "sync",
    "metadata",
    "fully_parallel",
    "async",
    "fault_sync",
    "fault_async",
    "overwrite_fail",
    "load_previous",
    "from_stock",
    "to_stock",
    "fencing",
    "throttled",
    "nemo_io",
    "overwrite",
]


@pytest.fixture(scope="module")
def megatron() -> Any:
    """megatron-core, imported in this process with triton's leaf stood in for where triton is missing."""
    stand_in_for_triton_leaf()
    import megatron.core.dist_checkpointing

    return megatron.core


def _run_ranks(world_size: int, scenarios: list[str], base: str, endpoints: tuple[str, str], out: Path, server: Any):
    env = rank_environment(server, endpoints[0])
    env["PYTHONPATH"] = os.pathsep.join([str(HELPERS), env["PYTHONPATH"]])
    command = [sys.executable, "-m", "mcore_worker", "--world-size", str(world_size)]
    command += ["--scenarios", ",".join(scenarios)]
    command += ["--base", base, "--endpoint", endpoints[0], "--direct-endpoint", endpoints[1], "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"ranks failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def _outcomes(out: Path, scenario: str, world_size: int = 2) -> list[dict[str, Any]]:
    outcomes = [json.loads((out / f"{scenario}-rank{rank}.json").read_text()) for rank in range(world_size)]
    for rank, outcome in enumerate(outcomes):
        assert outcome["ok"], f"{scenario} rank {rank}: {outcome.get('error')}\n{outcome.get('trace')}"
        assert outcome["differences"] == [], f"{scenario} rank {rank}: {outcome['differences']}"
    return outcomes


@pytest.fixture(scope="module")
def mcore_run(s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Runs every scenario once: 2 ranks, then 1 rank loading what 2 saved."""
    skip_unless_multirank_backend(s3_server)
    client = s3_server.client()
    bucket = f"mcore-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    base = f"s3://{bucket}/run"
    outs = {n: tmp_path_factory.mktemp(f"mcore-{n}-ranks") for n in (1, 2)}
    try:
        with FaultProxy(s3_server.endpoint_url) as proxy:
            for name in ("iter_0000040", "iter_0000041", "iter_0000050"):
                proxy.add_rule(FaultRule(Fault.status(500), method="PUT", path_regex=rf"/run/{name}/__1_0\.distcp$"))
            throttle = FaultRule(Fault.slow_down(), method="PUT", path_regex=r"/run/throttled/__\d_0\.distcp$", times=3)
            proxy.add_rule(throttle)
            endpoints = (proxy.endpoint_url, s3_server.endpoint_url)
            _run_ranks(2, TWO_RANK_SCENARIOS, base, endpoints, outs[2], s3_server)
            _run_ranks(1, ["reshard"], base, endpoints, outs[1], s3_server)
            yield {"client": client, "bucket": bucket, "outs": outs, "throttle": throttle}
    finally:
        empty_and_delete_bucket(client, bucket)


# ---- 2 ranks --------------------------------------------------------------------------------------------------------

CHECKPOINT_FILES = [".metadata", ".s3ckpt-items.json", "__0_0.distcp", "__1_0.distcp", "metadata.json"]


def test_sync_save_and_load(mcore_run: dict[str, Any]) -> None:
    """1-D and 2-D (bf16) shards, a replicated tensor, ShardedObjects and common state round-trip; the objects are
    DCP's layout plus megatron-core's metadata.json."""
    for outcome in _outcomes(mcore_run["outs"][2], "sync"):
        assert outcome["names"] == CHECKPOINT_FILES


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


def test_failed_overwrite_retired_the_old_checkpoint(mcore_run: dict[str, Any]) -> None:
    for outcome in _outcomes(mcore_run["outs"][2], "overwrite_fail"):
        assert outcome["saved"] == CHECKPOINT_FILES
        assert outcome["error"].startswith("CheckpointException"), outcome["error"]
        assert ".metadata" not in outcome["names"] and "metadata.json" not in outcome["names"]


def test_overwrite_loads_the_new_values(mcore_run: dict[str, Any]) -> None:
    for outcome in _outcomes(mcore_run["outs"][2], "overwrite"):
        assert outcome["names"] == CHECKPOINT_FILES


def test_stock_megatron_checkpoint_uploaded_loads_from_s3(mcore_run: dict[str, Any]) -> None:
    for outcome in _outcomes(mcore_run["outs"][2], "from_stock"):
        assert {".metadata", "metadata.json", "__0_0.distcp"} <= set(outcome["local_names"])


def test_s3_checkpoint_downloaded_loads_with_stock_megatron(mcore_run: dict[str, Any]) -> None:
    _outcomes(mcore_run["outs"][2], "to_stock")


def test_fenced_save_fails_on_every_rank(mcore_run: dict[str, Any]) -> None:
    for outcome in _outcomes(mcore_run["outs"][2], "fencing"):
        assert outcome["error"].startswith("CheckpointException"), outcome["error"]
        assert "CheckpointDirectoryTakenError" in outcome["error"] or "newer run" in outcome["error"]
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


def test_reshard_two_to_one(mcore_run: dict[str, Any]) -> None:
    _outcomes(mcore_run["outs"][1], "reshard", world_size=1)
