"""`S3ModelParallelStrategy` at 2 CPU ranks (gloo, FSDP2 ``fully_shard``): ``fit`` with a ``ModelCheckpoint`` on an
``s3://`` dirpath (top-k and last), then a fresh Trainer resumes from ``s3://.../last.ckpt`` with the same global
step, weights and optimizer state; a full (consolidated) checkpoint goes to S3 and comes back too; nothing lands in
a local ``s3:`` directory. Lightning's FSDPStrategy (FSDP1) needs GPUs: the `S3FSDPStrategy` Trainer fit/resume test
runs on 1 or 2 GPUs (NCCL) and skips without one, while its sharded save and ``_load_sharded_fsdp1`` also run on 2
CPU ranks with an FSDP1 module handed to the strategy directly (tests/helpers/fsdp1_cpu_worker.py). The Trainer
ranks run tests/helpers/dcp_lightning_worker.py, started the way a launcher starts them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from s3_servers import skip_unless_multirank_backend  # noqa: E402

import s3_dcp  # noqa: E402
from s3_fencing import OWNER_RECORD_NAME  # noqa: E402
from s3_memory_tier import COMMIT_RECORD_SUFFIX  # noqa: E402
from s3_tier_replication import MANIFEST_SUFFIX  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.lightning]

HELPERS = Path(__file__).resolve().parent / "helpers"
FAMILIES = ["lightning.pytorch", "pytorch_lightning"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(module: str, arguments: list[str], world_size: int, cwd: Path, what: str, nodes: int = 1) -> None:
    """Start one ``python -m <module>`` process per rank with the variables a launcher sets (`nodes` simulated nodes
    of ``world_size / nodes`` ranks each), wait for all of them (killing any left after 300 s), and fail with a
    rank's output if it failed."""
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HELPERS), *sys.path]),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % (world_size // nodes)),
            "NODE_RANK": str(rank // (world_size // nodes)),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        command = [sys.executable, "-m", module, *arguments]
        procs.append(subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = []
    try:
        for proc in procs:
            output, _ = proc.communicate(timeout=300)
            outputs.append(output.decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"{what} rank {rank} failed:\n{output[-6000:]}"


def _run_ranks(
    family: str, phase: str, dirpath: str, out: Path, cwd: Path, strategy: str = "model_parallel", world_size: int = 2,
    prefix_spreading: int | None = None, memory_tier: Path | None = None, nodes: int = 1,
) -> None:
    arguments = ["--family", family, "--phase", phase, "--dirpath", dirpath, "--out", str(out)]
    arguments += ["--strategy", strategy, "--world-size", str(world_size)]
    arguments += ["--prefix-spreading", str(prefix_spreading)] if prefix_spreading else []
    arguments += ["--memory-tier", str(memory_tier)] if memory_tier else []
    arguments += ["--nodes", str(nodes)]
    _launch("dcp_lightning_worker", arguments, world_size, cwd, phase, nodes)


SIDECAR = ".s3ckpt-checksum.json"


def keys_now(client: Any, bucket: str) -> set[str]:
    return {obj["Key"] for obj in client.list_objects_v2(Bucket=bucket).get("Contents", [])}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(b, dict):
        return isinstance(a, dict) and set(a) == set(b) and all(_equal(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("family", FAMILIES)
def test_model_parallel_fit_checkpoints_to_s3_and_resumes(
    family: str, s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    pytest.importorskip(family)
    skip_unless_multirank_backend(s3_server)
    dirpath = f"s3://{bucket}/run/checkpoints"
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    out.mkdir()
    cwd.mkdir()

    spread = 2 if family == "pytorch_lightning" else None  # one family saves with prefix spreading, one without
    _run_ranks(family, "fit", dirpath, out, cwd, prefix_spreading=spread)
    keys = {k for k in keys_now(s3_client, bucket) if k.startswith("run/checkpoints/")}
    assert f"run/checkpoints/{OWNER_RECORD_NAME}" in keys  # rank 0's run took the directory over (fencing)
    spread_dirs = {f"s3ckpt-spread-0{rank}" for rank in range(2)} if spread else set()
    prefixes = {key.split("/")[2] for key in keys} - {OWNER_RECORD_NAME} - spread_dirs
    assert prefixes == {"step=4.ckpt", "step=6.ckpt", "last.ckpt"}  # top 2 by step, step=2 removed whole
    for name in prefixes:
        base = f"run/checkpoints/{name}/"
        assert {base + n for n in (".metadata", ".s3ckpt-items.json", "meta.pt")} <= keys
        shards = [f"run/checkpoints/s3ckpt-spread-0{r}/{name}/__{r}_0.distcp" for r in range(2)] if spread else [
            base + f"__{r}_0.distcp" for r in range(2)
        ]
        assert set(shards) <= keys and (base + ".s3ckpt-layout.json" in keys) == bool(spread)
    assert {key.split("/")[3] for key in keys if key.split("/")[2] in spread_dirs} == (prefixes if spread else set())

    _run_ranks(family, "resume", dirpath, out, cwd, prefix_spreading=spread)
    end = torch.load(out / "fit-end.pt", weights_only=True)
    start = torch.load(out / "resume-start.pt", weights_only=True)
    assert end["global_step"] == 6 and start["global_step"] == 6
    assert _equal(start["model"], end["model"])
    assert _equal(start["optim"], end["optim"])
    assert (out / "resume-done-rank0").read_text() == "8"  # and training went on from there

    # the full (consolidated) checkpoint: one object written by rank 0, loaded on every rank
    folder = "run/checkpoints-full/"
    full_keys = {k for k in keys_now(s3_client, bucket) if k.startswith(folder)} - {folder + OWNER_RECORD_NAME}
    assert full_keys <= {f"{folder}consolidated.ckpt", f"{folder}consolidated.ckpt{SIDECAR}"}
    assert "run/checkpoints-full/consolidated.ckpt" in full_keys
    assert (out / "full-loaded-step").read_text() == "6"
    full = torch.load(out / "full-loaded.pt", weights_only=True)
    assert _equal(full["model"], end["model"]) and _equal(full["optim"], end["optim"])

    assert list(cwd.iterdir()) == [], f"something was written locally: {list(cwd.iterdir())}"
    assert not Path("s3:").exists()


def replicas_held(node: Path, checkpoint: str) -> dict[Path, str]:
    """The replicas of `checkpoint`'s files a node's tier holds: each replica's folder -> the file's URL."""
    records = node.rglob(f"replicas/*/*/*{COMMIT_RECORD_SUFFIX}")
    found = {record.parent: json.loads(record.read_text())["url"] for record in records}
    return {folder: url for folder, url in found.items() if url.startswith(checkpoint + "/")}


def test_model_parallel_saves_into_the_memory_tier_replicates_resumes_from_it_and_drains_the_last_at_teardown(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    """Two simulated nodes of one rank each (their own NODE_RANK and tier). With ``memory_tier`` the sharded strategy
    saves into the node's memory (S3 gets a checkpoint's ``.metadata`` only from its drain: the first save, then the
    last at teardown), replicates each node's files to the other by itself, and top-k removal drops the memory
    copies too. A relaunch resumes ``last.ckpt`` whose ``.metadata`` is only in node 0's memory (not on S3, and its
    replica on node 1 lost): every rank agrees by itself where each file comes from, node 0 hands the files over,
    and each rank reads its own shard from memory; teardown leaves the newest checkpoint complete on S3."""
    pytest.importorskip("lightning.pytorch")
    skip_unless_multirank_backend(s3_server)
    dirpath, base = f"s3://{bucket}/run/checkpoints", "run/checkpoints/"
    out, cwd, root = tmp_path / "out", tmp_path / "cwd", tmp_path / "tier"
    for folder in (out, cwd, root):
        folder.mkdir()

    def in_memory() -> set[str]:  # the checkpoints with a committed .metadata in a node's own tier
        return {path.parent.name for path in root.rglob(".metadata") if path.parent.parent.name == "checkpoints"}

    _run_ranks("lightning.pytorch", "fit", dirpath, out, cwd, memory_tier=root, nodes=2)
    assert (out / "fit-s3-last-before-teardown").read_text() == "False"  # last.ckpt was in memory only
    keys = {k for k in keys_now(s3_client, bucket) if k.startswith(base)}
    assert {k.split("/")[2] for k in keys} - {OWNER_RECORD_NAME} == {"step=4.ckpt", "step=6.ckpt", "last.ckpt"}
    assert {base + f"last.ckpt/{n}" for n in (".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp")} <= keys
    assert base + "step=6.ckpt/meta.pt" in keys and base + "step=6.ckpt/.metadata" not in keys  # never drained
    assert in_memory() == {"step=4.ckpt", "step=6.ckpt", "last.ckpt"}  # step=2.ckpt: removed from memory too
    last = f"{dirpath}/last.ckpt"
    node0_files = {f"{last}/{name}" for name in (".metadata", ".s3ckpt-items.json", "__0_0.distcp")}
    assert set(replicas_held(root / "node1", last).values()) == node0_files  # replicated without being asked
    assert set(replicas_held(root / "node0", last).values()) == {f"{last}/__1_0.distcp"}

    for name in (".metadata", ".s3ckpt-items.json"):  # as if the drain had not run: .metadata only in memory
        s3_client.delete_object(Bucket=bucket, Key=f"{base}last.ckpt/{name}")
    for folder in replicas_held(root / "node1", last):  # and node 1's replicas of it lost
        shutil.rmtree(folder)
        folder.with_name(folder.name + MANIFEST_SUFFIX).unlink()
    _run_ranks("lightning.pytorch", "resume", dirpath, out, cwd, memory_tier=root, nodes=2)
    end = torch.load(out / "fit-end.pt", weights_only=True)
    start = torch.load(out / "resume-start.pt", weights_only=True)
    assert start["global_step"] == 6 and _equal(start["model"], end["model"]) and _equal(start["optim"], end["optim"])
    sources = [json.loads((out / f"resume-sources-rank{rank}.json").read_text()) for rank in range(2)]
    assert {url: tier for url, tier in sources[0].items() if url.startswith(last)} == {
        **dict.fromkeys([f"{last}/.metadata", f"{last}/.s3ckpt-items.json", f"{last}/__0_0.distcp"], "memory"),
        f"{last}/__1_0.distcp": "replica"}  # DCP's load reads an item rank 1 alone saved: node 1's replica  # fmt: skip
    assert {url: tier for url, tier in sources[1].items() if url.startswith(last)} == {
        f"{last}/.metadata": "replica", f"{last}/.s3ckpt-items.json": "replica",  # handed over by node 0
        f"{last}/__1_0.distcp": "memory"}  # fmt: skip
    assert (out / "resume-s3-last-before-teardown").read_text() == "False"
    keys = {k for k in keys_now(s3_client, bucket) if k.startswith(base)}
    assert {base + f"last.ckpt/{n}" for n in (".metadata", ".s3ckpt-items.json", "meta.pt")} <= keys
    assert base + "step=8.ckpt/.metadata" in keys and not any(k.startswith(base + "step=4.ckpt/") for k in keys)
    assert list(cwd.iterdir()) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP1 (FSDPStrategy) needs a GPU")
def test_fsdp1_fit_checkpoints_to_s3_and_resumes_on_gpus(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    """`S3FSDPStrategy(state_dict_type="sharded")` on 1 or 2 GPUs: top-k + last sharded checkpoints on S3, a fresh
    Trainer resumes them through ``_load_sharded_fsdp1`` (sharded-state-dict context, the optimizer through
    ``load_sharded_optimizer_state_dict``), and a full checkpoint goes through S3CheckpointIO."""
    family = "lightning.pytorch"
    pytest.importorskip(family)
    world_size = min(2, torch.cuda.device_count())
    dirpath = f"s3://{bucket}/run/checkpoints"
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    out.mkdir()
    cwd.mkdir()

    _run_ranks(family, "fit", dirpath, out, cwd, strategy="fsdp", world_size=world_size)
    keys = {k for k in keys_now(s3_client, bucket) if k.startswith("run/checkpoints/")}
    assert f"run/checkpoints/{OWNER_RECORD_NAME}" in keys  # rank 0's run took the directory over (fencing)
    assert {key.split("/")[2] for key in keys} - {OWNER_RECORD_NAME} == {"step=4.ckpt", "step=6.ckpt", "last.ckpt"}
    shards = {f"__{rank}_0.distcp" for rank in range(world_size)}
    for name in ("step=4.ckpt", "step=6.ckpt", "last.ckpt"):
        base = f"run/checkpoints/{name}/"
        assert {base + n for n in {".metadata", ".s3ckpt-items.json", "meta.pt", *shards}} <= keys

    _run_ranks(family, "resume", dirpath, out, cwd, strategy="fsdp", world_size=world_size)
    end = torch.load(out / "fit-end.pt", weights_only=True)
    start = torch.load(out / "resume-start.pt", weights_only=True)
    assert end["global_step"] == 6 and start["global_step"] == 6
    assert _equal(start["model"], end["model"]) and _equal(start["optim"], end["optim"])
    assert (out / "resume-done-rank0").read_text() == "8"
    assert (out / "full-loaded-step").read_text() == "6"
    full = torch.load(out / "full-loaded.pt", weights_only=True)
    assert _equal(full["model"], end["model"])
    assert list(cwd.iterdir()) == [], f"something was written locally: {list(cwd.iterdir())}"


def test_fsdp1_sharded_checkpoint_save_and_load_on_cpu(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    """`S3FSDPStrategy`'s sharded save and ``_load_sharded_fsdp1`` on 2 CPU ranks (gloo): torch's FSDP1 runs on CPU
    even though Lightning's FSDPStrategy does not, so the worker hands the strategy an FSDP1 module as a Trainer
    would (tests/helpers/fsdp1_cpu_worker.py). ShardedTensor state goes through our writer and reader."""
    pytest.importorskip("lightning.pytorch")
    skip_unless_multirank_backend(s3_server)
    url = f"s3://{bucket}/run/fsdp1.ckpt"
    arguments = ["--url", url, "--endpoint", s3_server.endpoint_url, "--out", str(tmp_path)]
    _launch("fsdp1_cpu_worker", arguments, 2, tmp_path, "FSDP1 save and load")

    names = {k.rsplit("/", 1)[-1] for k in keys_now(s3_client, bucket) if k.startswith("run/fsdp1.ckpt/")}
    assert {".metadata", ".s3ckpt-items.json", "meta.pt", "__0_0.distcp", "__1_0.distcp"} <= names
    for rank in range(2):
        saved = torch.load(tmp_path / f"saved-rank{rank}.pt", weights_only=True)
        loaded = torch.load(tmp_path / f"loaded-rank{rank}.pt", weights_only=True)
        assert saved["model"] and saved["optim"]["state"]
        assert _equal(loaded["model"], saved["model"]), f"rank {rank}: model shards differ after the load"
        assert _equal(loaded["optim"], saved["optim"]), f"rank {rank}: optimizer shards differ after the load"
    assert (tmp_path / "global_step").read_text() == "2"
    assert not (tmp_path / "s3:").exists()


def test_strategy_classes_for_both_families_and_their_options() -> None:
    for family in FAMILIES:
        pl = pytest.importorskip(family)
        model_parallel = s3_dcp.sharded_strategy_class("model_parallel", family)
        fsdp = s3_dcp.sharded_strategy_class("fsdp", family)
        assert issubclass(model_parallel, pl.strategies.ModelParallelStrategy)
        assert issubclass(fsdp, pl.strategies.FSDPStrategy)
        strategy = model_parallel(data_parallel_size=1, tensor_parallel_size=1, chunk_size_MB=8, thread_count=2)
        assert strategy.s3_options["chunk_size_MB"] == 8 and strategy.s3_options["thread_count"] == 2
        assert isinstance(strategy._dcp_planner("save"), s3_dcp.S3SavePlanner)  # DTensor chunks without torch's index
        assert isinstance(strategy._dcp_planner("load"), s3_dcp.S3LoadPlanner)
        torch_planners = model_parallel(data_parallel_size=1, tensor_parallel_size=1, s3_planners=False)
        assert torch_planners._dcp_planner("save") is None and torch_planners._dcp_planner("load") is None
    assert s3_dcp.S3ModelParallelStrategy is s3_dcp.sharded_strategy_class("model_parallel", "lightning.pytorch")
    assert s3_dcp.S3FSDPStrategyPL is s3_dcp.sharded_strategy_class("fsdp", "pytorch_lightning")
    with pytest.raises(ValueError, match="chunk_size_MB"):
        s3_dcp.S3ModelParallelStrategy(chunk_size_MB=1)
    with pytest.raises(ValueError, match="kind"):
        s3_dcp.sharded_strategy_class("ddp")


def test_strategy_builds_its_client_one_way_shares_it_and_pickles_without_it() -> None:
    """The strategy refuses client arguments another would override (as `S3CheckpointIO` does), its plugin, writers
    and readers share its one `S3Utils`, and a pickled strategy (``ddp_spawn``) carries settings, not the client."""
    import pickle

    from s3_utils import S3ClientSettings

    with pytest.raises(ValueError, match=r"^S3ModelParallelStrategy: endpoint_url would be ignored because client_set"):
        s3_dcp.S3ModelParallelStrategy(endpoint_url="http://127.0.0.1:1", client_settings=S3ClientSettings())
    with pytest.raises(ValueError, match="max_requests_per_second would be ignored because client_settings"):
        s3_dcp.S3FSDPStrategy(max_requests_per_second=5, client_settings=S3ClientSettings(max_requests_per_second=9))
    strategy = s3_dcp.S3ModelParallelStrategy(
        data_parallel_size=1, tensor_parallel_size=1, endpoint_url="http://127.0.0.1:9", thread_count=8
    )
    assert strategy.s3.settings.endpoint_url == "http://127.0.0.1:9"
    assert "(lightning; " in (strategy.s3.settings.user_agent_extra or "")  # as S3CheckpointIO reports Lightning
    assert strategy.s3.settings.max_pool_connections == 8 * s3_dcp.DEFAULT_DCP_MAX_WRITE_CONCURRENCY + 4
    assert strategy.s3_checkpoint_io.s3 is strategy.s3
    assert strategy.s3_storage_writer("s3://bucket/x").s3 is strategy.s3
    assert strategy.s3_storage_reader("s3://bucket/x").s3 is strategy.s3
    _ = strategy.s3.client
    copy = pickle.loads(pickle.dumps(strategy))
    assert copy.s3 is not strategy.s3 and copy.s3.settings == strategy.s3.settings
    assert copy.s3_checkpoint_io.s3.settings == strategy.s3.settings


def test_lightning_names_it_relies_on_are_still_there() -> None:
    """Lightning's sharded strategies keep their non-model state in ``meta.pt`` and their switches under these
    private names; the strategies read them."""
    from lightning.fabric.strategies import fsdp as fabric_fsdp
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    assert fabric_fsdp._METADATA_FILENAME == s3_dcp.LIGHTNING_META_NAME
    assert callable(fabric_fsdp._get_sharded_state_dict_context)
    assert ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)._save_distributed_checkpoint is True
    assert FSDPStrategy(state_dict_type="sharded")._state_dict_type == "sharded"
