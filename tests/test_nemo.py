"""S3MegatronCheckpointIO with the real NeMo 2.x classes (nemo-toolkit installed), not the stand-in of test_mcore.

Runs only where ``nemo.lightning.io.pl`` imports: `make nemo-check` builds such a venv (.venv-nemo: nemo-toolkit
2.7.3 without its declared dependencies, the few its ``nemo.lightning`` imports need, lightning 2.4.0,
megatron-core 0.18.2, CPU torch) and runs this file there. CI's venv has no NeMo, so it skips here, saying why.

Two ranks (gloo, CPU) through tests/helpers/mcore_worker.py:

* ``nemo_real_io``: the IO built on NeMo's own ``MegatronCheckpointIO``; a sync save, NeMo's
  ``load_content_metadata`` and loads with ``strict`` None/True/False, an async save through NeMo's own
  ``AsyncFinalizableCheckpointIO`` (with a caller's ``finalize_fn``), a load and the removal through that wrapper.
* ``tier_nemo_real_two_nodes``: the IO on NeMo's own class with the memory tier, each rank a node of its own
  (tests/helpers/mcore_tier_scenarios.py): its saves replicate by themselves, and after node 0 lost its memory NeMo's
  ``load_content_metadata`` and load agree on every rank and load the step only the nodes' memory holds.
* ``nemo_real_strategy``: NeMo's own ``MegatronStrategy`` (without a Trainer) as docs/megatron.md builds it:
  ``save_checkpoint``, the blocking finalize (what ``AsyncFinalizerCallback`` runs at the end of training),
  ``load_checkpoint`` of the collapsed Path, and ``remove_checkpoint``, NeMo's own and the documented subclass's.

What is stood in for, and why: triton's one leaf module (as everywhere in the suite); megatron-core's tensorstore
strategy, gone since megatron-core 0.16 but imported by NeMo 2.7.3's ``dist_ckpt_io`` (see mcore_stub); the
ModelOpt hooks ``MegatronStrategy`` imports from NeMo's LLM collection (no-ops, as NeMo's are for a model without
ModelOpt state); the model (``megatron_parallel``), and the CUDA calls megatron-core's async queue makes.
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
from mcore_stub import megatron_core_installed, nemo_importable

if not megatron_core_installed() and os.environ.get("S3CKPT_TEST_REQUIRE_NEMO") != "1":
    pytest.skip("megatron-core is not installed (see `make nemo-check`)", allow_module_level=True)
_WHY_NOT = nemo_importable()
if _WHY_NOT and os.environ.get("S3CKPT_TEST_REQUIRE_NEMO") == "1":  # `make nemo-check`: a skip would prove nothing
    pytest.fail(f"NeMo 2.x is not importable here: {_WHY_NOT}", pytrace=False)
if _WHY_NOT:
    pytest.skip(f"NeMo 2.x is not importable here: {_WHY_NOT}", allow_module_level=True)
pytest.importorskip("moto")

from s3_servers import empty_and_delete_bucket, rank_environment, skip_unless_multirank_backend  # noqa: E402

pytestmark = [pytest.mark.megatron]

HELPERS = Path(__file__).resolve().parent / "helpers"
SCENARIOS = ["nemo_real_io", "nemo_real_strategy", "tier_nemo_real_two_nodes"]
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


@pytest.fixture(scope="module")
def nemo_run(s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    skip_unless_multirank_backend(s3_server)
    client = s3_server.client()
    bucket = f"nemo-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    out = tmp_path_factory.mktemp("nemo-ranks")
    env = rank_environment(s3_server, s3_server.endpoint_url)
    env["PYTHONPATH"] = os.pathsep.join([str(HELPERS), env["PYTHONPATH"]])
    command = [sys.executable, "-m", "mcore_worker", "--world-size", "2", "--scenarios", ",".join(SCENARIOS)]
    command += ["--base", f"s3://{bucket}/run", "--endpoint", s3_server.endpoint_url, "--out", str(out)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"ranks failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        yield out
    finally:
        empty_and_delete_bucket(client, bucket)


def _outcomes(out: Path, scenario: str) -> list[dict[str, Any]]:
    outcomes = [json.loads((out / f"{scenario}-rank{rank}.json").read_text()) for rank in range(2)]
    for rank, outcome in enumerate(outcomes):
        assert outcome["ok"], f"{scenario} rank {rank}: {outcome.get('error')}\n{outcome.get('trace')}"
    return outcomes


def _checkpoint_files() -> list[str]:
    import importlib.metadata

    version = tuple(int(part) for part in importlib.metadata.version("megatron-core").split(".")[:2])
    files = [".metadata", ".s3ckpt-items.json", "__0_0.distcp", "__1_0.distcp"]
    files += ["common.pt", "metadata.json"] if version < (0, 19) else ["metadata.json"]
    return [f"weights/{name}" for name in files]


def test_checkpoint_io_on_nemos_own_classes(nemo_run: Path) -> None:
    for rank, outcome in enumerate(_outcomes(nemo_run, "nemo_real_io")):
        # NeMo's non-strict load keeps only the keys load_tensors_metadata lists, which are tensors: it drops
        # ShardedObjects (here each rank's "rng") before loading, for local checkpoints too.
        assert outcome["differences"] == [f"strict=False: rng: None != {{'seed': {7 + rank + 1}}}"]
        assert outcome["saved"] is None  # sync: no request
        assert outcome["names"] == _checkpoint_files()
        assert outcome["content_metadata"] == CONTENT_METADATA
        assert ".metadata" not in outcome["before_finalize"] and "metadata.json" not in outcome["before_finalize"]
        assert outcome["finalized"] is True
        assert outcome["async_names"] == _checkpoint_files()
        assert outcome["extra_finalize"] == [True]
        assert outcome["removed"] == []


def test_nemos_megatron_strategy_drives_it(nemo_run: Path) -> None:
    outcomes = _outcomes(nemo_run, "nemo_real_strategy")
    for outcome in outcomes:
        assert outcome["differences"] == []
        assert outcome["finalized"] is True
        assert outcome["names"] == _checkpoint_files()
        assert {"state_dict", "sharded_state_dict", "content_metadata"} <= set(outcome["loaded_keys"])
        assert outcome["removed"] == []
    # NeMo's own MegatronStrategy.remove_checkpoint removes with shutil.rmtree, locally: hence the documented subclass
    assert outcomes[0]["nemo_remove"].startswith("FileNotFoundError"), outcomes[0]["nemo_remove"]
    assert "s3:/" in outcomes[0]["nemo_remove"]


def test_nemos_own_checkpoint_io_with_the_memory_tier_replicates_and_agrees_by_itself_on_two_nodes(
    nemo_run: Path,
) -> None:
    """As test_mcore's test of the same name, on NeMo's own MegatronCheckpointIO: model--step=7 is only in the nodes'
    memory; node 0 lost its own and reads its files from node 1's replicas, node 1 its shard from its memory."""
    node0, node1 = _outcomes(nemo_run, "tier_nemo_real_two_nodes")
    for node in (node0, node1):
        assert node["differences"] == []
        assert node["replicated"] is True
        assert node["on_s3"] == []
        assert node["content_metadata"] == CONTENT_METADATA
    assert set(node0["first_reads"].values()) == {"replica"} and "__0_0.distcp" in node0["first_reads"]
    assert node1["first_reads"]["__1_0.distcp"] == "memory"
