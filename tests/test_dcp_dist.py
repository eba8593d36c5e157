"""S3StorageWriter / S3StorageReader across real gloo ranks: FSDP2 (``fully_shard``) model + optimizer state through
``torch.distributed.checkpoint.state_dict``, resharding on load (2 -> 1, 2 -> 4), ``async_save`` with the thread and
process executors, ``use_collectives=False``, interop with torch's FileSystemWriter/Reader, one rank whose
uploads fail for good, and `s3_checkpoint_convert` on checkpoints the ranks saved (row and column shards). The ranks
run tests/helpers/dcp_worker.py; one process group serves many cases.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
from fault_proxy import Fault, FaultProxy, FaultRule
from s3_servers import empty_and_delete_bucket, skip_unless_multirank_backend

pytestmark = [pytest.mark.slow]

HELPERS = Path(__file__).resolve().parent / "helpers"
TWO_RANK_SCENARIOS = [
    "save",
    "load",
    "async_thread",
    "async_process",
    "no_collectives",
    "spread",
    "from_torch_writer",
    "to_torch_reader",
    "faulty_rank",
    "load_again",
    "convert",
    "load_converted",
]


def _run_ranks(world_size: int, scenarios: list[str], base: str, endpoint: str, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HELPERS), *sys.path])}
    command = [sys.executable, "-m", "dcp_worker", "--world-size", str(world_size), "--scenarios", ",".join(scenarios)]
    command += ["--base", base, "--endpoint", endpoint, "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, f"ranks failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def _outcomes(out: Path, scenario: str, world_size: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"{scenario}-rank{rank}.json").read_text()) for rank in range(world_size)]


def _assert_loaded_identical(out: Path, scenario: str, world_size: int) -> None:
    for rank, outcome in enumerate(_outcomes(out, scenario, world_size)):
        assert outcome["ok"], f"{scenario} rank {rank}: {outcome.get('error')}\n{outcome.get('trace')}"
        assert outcome["differences"] == [], f"{scenario} rank {rank}: {outcome['differences']}"


@pytest.fixture(scope="module")
def dcp_run(s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Runs every scenario once: 2 ranks save and load, then 1 and 4 ranks load what 2 saved."""
    skip_unless_multirank_backend(s3_server)
    client = s3_server.client()
    bucket = f"dcp-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    base = f"s3://{bucket}/run"
    outs = {n: tmp_path_factory.mktemp(f"dcp-{n}-ranks") for n in (1, 2, 4)}
    try:
        with FaultProxy(s3_server.endpoint_url) as proxy:
            proxy.add_rule(FaultRule(Fault.status(500), method="PUT", path_regex=r"/run/faulty/__1_0\.distcp$"))
            _run_ranks(2, TWO_RANK_SCENARIOS, base, proxy.endpoint_url, outs[2])
            for world_size, scenarios in ((1, ["load", "to_torch_reader"]), (4, ["load"])):
                shutil.copy(outs[2] / "reference.pt", outs[world_size] / "reference.pt")
                _run_ranks(world_size, scenarios, base, proxy.endpoint_url, outs[world_size])
            yield {"client": client, "bucket": bucket, "outs": outs, "proxy": proxy}
    finally:
        empty_and_delete_bucket(client, bucket)


def _names(run: dict[str, Any], prefix: str) -> list[str]:
    listed = run["client"].list_objects_v2(Bucket=run["bucket"], Prefix=f"run/{prefix}/").get("Contents", [])
    return sorted(obj["Key"].rsplit("/", 1)[-1] for obj in listed if not obj["Key"].endswith(".s3ckpt-checksum.json"))


def test_fsdp2_round_trip_at_two_ranks(dcp_run: dict[str, Any]) -> None:
    assert _names(dcp_run, "fsdp") == [".metadata", ".s3ckpt-items.json", "__0_0.distcp", "__1_0.distcp"]
    _assert_loaded_identical(dcp_run["outs"][2], "load", 2)
    assert all(outcome["stats"]["direct_items"] > 0 for outcome in _outcomes(dcp_run["outs"][2], "load", 2))


@pytest.mark.parametrize("world_size", [1, 4])
def test_reshard_on_load(dcp_run: dict[str, Any], world_size: int) -> None:
    _assert_loaded_identical(dcp_run["outs"][world_size], "load", world_size)

    def direct(n: int) -> list[int]:
        return [outcome["stats"]["direct_items"] for outcome in _outcomes(dcp_run["outs"][n], "load", n)]

    if world_size == 1:  # each saved shard is a whole, contiguous row block of the full tensor: read into it in place
        assert direct(1)[0] > max(direct(2))  # both ranks' shards
    else:  # each rank needs half of a saved shard (decoded from a buffer, then copied); only Adam's steps are whole
        assert max(direct(4)) < min(direct(2))


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_async_save_holds_the_staged_state(dcp_run: dict[str, Any], executor: str) -> None:
    """Training steps taken while the upload runs do not leak into the checkpoint."""
    _assert_loaded_identical(dcp_run["outs"][2], f"async_{executor}", 2)
    assert ".metadata" in _names(dcp_run, f"async-{executor}")


def test_without_collectives_each_rank_commits_its_own_metadata(dcp_run: dict[str, Any]) -> None:
    names = _names(dcp_run, "no-collectives")
    assert {"__0.metadata", "__1.metadata", "__0.s3ckpt-items.json", "__1.s3ckpt-items.json"} <= set(names)
    assert ".metadata" not in names
    _assert_loaded_identical(dcp_run["outs"][2], "no_collectives", 2)


def test_a_spread_save_puts_each_ranks_shard_in_its_prefix_and_loads(dcp_run: dict[str, Any]) -> None:
    for name, records in (("spread", {".metadata", ".s3ckpt-items.json"}),
                          ("spread-no-collectives", {"__0.metadata", "__1.metadata"})):
        assert records | {".s3ckpt-layout.json"} <= set(_names(dcp_run, name))
        assert not [n for n in _names(dcp_run, name) if n.endswith(".distcp")]
        for rank in (0, 1):
            assert _names(dcp_run, f"s3ckpt-spread-0{rank}/{name}") == [f"__{rank}_0.distcp"]
    for outcome in _outcomes(dcp_run["outs"][2], "spread", 2):
        assert outcome["ok"], f"{outcome.get('error')}\n{outcome.get('trace')}"
        assert [outcome[name]["differences"] for name in ("spread", "spread-no-collectives")] == [[], []]


def test_loads_what_torch_filesystem_writer_saved(dcp_run: dict[str, Any]) -> None:
    _assert_loaded_identical(dcp_run["outs"][2], "from_torch_writer", 2)


@pytest.mark.parametrize("world_size", [1, 2])
def test_torch_filesystem_reader_loads_ours(dcp_run: dict[str, Any], world_size: int) -> None:
    _assert_loaded_identical(dcp_run["outs"][world_size], "to_torch_reader", world_size)


def test_persistent_upload_failure_on_one_rank_fails_every_rank_and_commits_nothing(dcp_run: dict[str, Any]) -> None:
    for rank, outcome in enumerate(_outcomes(dcp_run["outs"][2], "faulty_rank", 2)):
        assert outcome["ok"] and outcome["raised"] == "CheckpointException", f"rank {rank}: {outcome}"
        assert outcome["failed_ranks"] == [1]
        assert "run/faulty/__1_0.distcp" in outcome["causes"][0]
    assert ".metadata" not in _names(dcp_run, "faulty")
    assert "__1_0.distcp" not in _names(dcp_run, "faulty")
    uploads = dcp_run["client"].list_multipart_uploads(Bucket=dcp_run["bucket"]).get("Uploads", [])
    assert uploads == []
    assert dcp_run["proxy"].count(faulted=True) >= 3  # retried, then given up
    _assert_loaded_identical(dcp_run["outs"][2], "load_again", 2)  # the previous checkpoint is intact


def _download(url: str) -> bytes:
    import s3_utils

    with s3_utils.S3Utils().download_to_memory(url) as downloaded:
        return downloaded.read_all()


def test_convert_a_two_rank_checkpoint_into_one_file(dcp_run: dict[str, Any]) -> None:
    """Row shards (FSDP2) and column shards (tensor parallel, bfloat16) assembled into one safetensors and one torch
    file; the torch file equals what torch's dcp_to_torch_save makes of the same checkpoint."""
    import safetensors.torch
    import torch
    from dcp_worker import differences, flat_tensors, tensor_parallel_reference
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = dcp_run["outs"][2]
    outcome = _outcomes(out, "convert", 2)[0]
    assert outcome["ok"], f"{outcome.get('error')}\n{outcome.get('trace')}"
    base = f"s3://{dcp_run['bucket']}/run"
    reference = torch.load(out / "reference.pt", weights_only=True)  # the full (unsharded) state that was saved
    exported = safetensors.torch.load(_download(f"{base}/exports/fsdp.safetensors"))
    expected = flat_tensors(reference)
    assert set(exported) == set(expected)
    assert all(
        exported[key].dtype == value.dtype and torch.equal(exported[key], value) for key, value in expected.items()
    )
    dcp_to_torch_save(out / "downloaded-2", out / "torch-converted.pt")  # a local copy of the same checkpoint
    converted = torch.load(io.BytesIO(_download(f"{base}/exports/fsdp.pt")), weights_only=True)
    assert differences(converted, torch.load(out / "torch-converted.pt", weights_only=False)) == []

    column, replicated = tensor_parallel_reference()
    exported = safetensors.torch.load(_download(f"{base}/exports/tp.safetensors"))
    assert set(exported) == {"tp.column", "tp.replicated"} and exported["tp.column"].dtype == torch.bfloat16
    assert torch.equal(exported["tp.column"], column) and torch.equal(exported["tp.replicated"], replicated)
    converted = torch.load(io.BytesIO(_download(f"{base}/exports/tp.pt")), weights_only=True)
    assert differences(converted, {"tp": {"column": column, "replicated": replicated}, "note": "tp"}) == []
    reports = outcome["reports"]
    assert reports["exports/tp.safetensors"]["skipped"] == ["note"]
    assert all(".s3ckpt-items.json" in reports[dst]["verification"] for dst in reports if dst.startswith("exports/"))


def test_a_torch_file_converted_to_dcp_loads_sharded_at_two_ranks(dcp_run: dict[str, Any]) -> None:
    assert ".metadata" in _names(dcp_run, "fsdp-from-pt")
    _assert_loaded_identical(dcp_run["outs"][2], "load_converted", 2)
